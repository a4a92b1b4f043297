"""``kvgw bench dataplane`` runs end to end in its quick mode: the three candidate servers and the
baselines start, answer every call as the others do (the bench checks each answer before measuring:
the exists JSON, the GET's length, the PUT + DELETE pair on one connection), and the report holds, for
every call at every client count, each server's p50, throughput and server CPU, and each candidate's
ratios to the call's baseline. Structure only: no figure is compared with another (speed is the
bench's to show, not a test's)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from gateway.bench import dataplane
from gateway.bench.baselines import find_nginx
from gateway.bench.loadgen import LoadRequest, run_load
from tests.requirements import require_module, require_or_skip


def test_quick_run_reports_every_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_module("granian", "granian is not installed (kvgw bench dataplane's third candidate; the bench extra)")
    if find_nginx() is None:
        require_or_skip("nginx is not installed (kvgw bench dataplane's GET baseline; apt-get install nginx-light)")
    report = tmp_path / "dataplane.json"
    assert dataplane.main(["--quick", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out, out
    doc = json.loads(report.read_text())
    assert doc["skipped"] == [] and doc["granian"]
    cells = {(c["call"], c["clients"]): c for c in doc["cells"]}
    assert set(cells) == {(call, clients) for call in dataplane.CALLS.values() for clients in (1, 2)}
    for (call, _), cell in cells.items():
        baseline = dataplane.BASELINE[call]
        assert cell["baseline"] == baseline
        variants = {name for name, calls in dataplane.VARIANTS.items() if call in calls}
        assert set(cell["servers"]) == {dataplane.UVICORN, dataplane.PROTOCOL, dataplane.GRANIAN, *variants, baseline}
        for name, figures in cell["servers"].items():
            assert figures["rounds"] == 1 and figures["errors"] == 0
            for field in ("p50_ms", "throughput", "cpu"):
                assert math.isfinite(figures[field]) and figures[field] >= 0, (call, name, field, figures)
            assert figures["p50_ms"] > 0 and figures["throughput"] > 0
            ratios = figures["vs_baseline"]
            if name == baseline:
                assert ratios is None
            else:
                assert set(ratios) == {"p50", "throughput", "cpu"}
        # the printed table has a row per server and names the fastest and leanest candidate
        fastest, leanest = dataplane.best(cell)
        assert f"-> fastest: {fastest}; least CPU: {leanest}" in out
    assert len(doc["samples"]) == sum(len(c["servers"]) for c in doc["cells"])


@pytest.mark.parametrize(("kind", "part"), [("protocol", "chunks"), ("protocol", "threaded"), ("uvicorn", "chunks"),
                                          ("granian", "chunks")])
def test_candidates_store_every_body_whole(tmp_path: Path, kind: str, part: str) -> None:
    """A candidate that dropped or reordered body bytes would flatter itself: each stores exactly what it
    was sent (bodies below and above the own protocol's intake threshold, one ending mid-piece; ``threaded``:
    the own protocol receiving in a worker thread), and a PUT + DELETE pair leaves nothing behind."""
    if kind == "granian":
        require_module("granian", "granian is not installed (kvgw bench dataplane's third candidate; the bench extra)")
    data = tmp_path / "data"
    dataplane.prepare(data, 1, 4096)
    server = dataplane.Candidate(tmp_path, data, kind).start()
    try:
        bodies = [os.urandom(n) for n in (1, dataplane.INTAKE_MIN_BYTES - 1, dataplane.PIECE_BYTES,
                                          3 * dataplane.PIECE_BYTES + 12345)]
        done = run_load(server.address, lambda i, seq: LoadRequest("PUT", f"/v1/buckets/kvcache/{part}/k",
                                                                   body=bodies[seq], expect=(201,)), 1,
                        count=len(bodies))
        assert done.errors == 0, done.error_samples
        final = data / "puts" / kind / "final"
        assert sorted(p.read_bytes() for p in final.iterdir()) == sorted(bodies)
        for path in final.iterdir():
            path.unlink()
        pair = run_load(server.address, lambda i, seq: LoadRequest("PUT", f"/v1/buckets/kvcache/{part}/k",
                                                                   body=bodies[3], expect=(201,)), 1, count=3,
                        then=lambda i, seq: LoadRequest("DELETE", "/v1/buckets/kvcache/chunks/k", expect=(204,)))
        assert pair.errors == 0 and pair.statuses == {201: 3, 204: 3}, pair.error_samples
        assert not list(final.iterdir())
        assert not list((data / "puts" / kind / "staging").iterdir())
    finally:
        server.stop()
