"""``kvgw bench head`` runs end to end (a short smoke run: every row measured, no request failed)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO
from tests.requirements import require_module


def test_bench_head_smoke() -> None:
    require_module("nixl._api", "NIXL 1.5.1 (the row \"NIXL query_memory\"; bash .ci/install-nixl.sh)")
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "head", "--clients", "2,4", "--rounds", "1", "--duration",
         "0.3", "--objects", "64"],
        capture_output=True, text=True, cwd=REPO, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    table = result.stdout
    for row in ("kvgw S3 HEAD hit", "kvgw S3 HEAD miss", "kvgw S3 HEAD hit, lane off", "kvgw S3 HEAD miss, lane off",
                "kvgw native HEAD hit", "FastAPI dict route", "NIXL query_memory"):
        assert row in table, table
    assert "4 clients: kvgw S3 HEAD (hit)" in table
    assert "4 clients: kvgw S3 HEAD miss with the lookup lane / without:" in table
