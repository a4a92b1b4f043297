"""``kvgw bench vllm`` runs end to end with vLLM's classes (a short smoke run: every tier measured, every
load byte for byte, no tier failed)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def test_bench_vllm_smoke() -> None:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "vllm", "--blocks", "4", "--block-mib", "1", "--rounds", "1",
         "--warmup", "0.2", "--no-fsync"],
        capture_output=True, text=True, cwd=REPO, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout
    for row in ("(k) kvgw tier (native API)", "(d) kvgw tier, direct reads", "(f) vLLM fs tier (same disk)",
                "(o) vLLM obj tier -> kvgw S3 API", "kvgw tier load / (f) load:", "kvgw tier load / (o) load:",
                "lookups answered after", "one step's lookup batch (4 keys"):
        assert row in table, table
    assert "FAILED" not in table
