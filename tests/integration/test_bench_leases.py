"""``kvgw bench leases`` runs end to end on PostgreSQL: both lookups, fresh and repeated, with and without
the lookup lane, answer 200 on both sides (a non-200 answer raises), and the in-process phase times the
lane's calls on a real gateway without any of them having to wait for a sync."""

from __future__ import annotations

import re

import pytest

from gateway.bench import leases
from tests.conftest import PG_URL


def test_leases_bench_reports_every_configuration(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert pg_url  # PostgreSQL is there (the fixture skips, or fails under KVGW_REQUIRE_SERVICES, if not)
    assert leases.main(["--rounds", "1", "--calls", "2", "--ops", "prefix,exists", "--pg-url", PG_URL]) == 0
    out = capsys.readouterr().out
    for op in ("prefix", "exists"):
        for kind in ("fresh", "again"):
            rows = re.findall(rf"^  {op} {kind}\s+([\d.]+) ms\s+([\d.]+) ms .* ([\d.]+)x \(", out, re.MULTILINE)
            assert len(rows) == 2, out  # with and without the lane
            assert all(float(leased) > 0 and float(plain) > 0 and float(ratio) > 0 for leased, plain, ratio in rows)
            inproc = re.search(rf"^  {op} {kind}\s+leased\s+([\d.]+) µs\s+plain\s+([\d.]+) µs", out, re.MULTILINE)
            assert inproc is not None and float(inproc[1]) > 0 and float(inproc[2]) > 0, out
