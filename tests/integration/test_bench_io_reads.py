"""``kvgw bench io``'s batch-get cell end to end: kvgw answers the batch-get sent as kvgw's client sends
it (``x-kvgw-verify: xxh3``: frames sent from the files unverified) and without that header (verified
by the gateway), kvgw's own client reads it into buffers (checking every frame), and every row moved as
many bytes per operation as the raw socket stream it is compared with."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.bench import io
from gateway.bench.baselines import find_nginx
from tests.requirements import require_or_skip


def test_batch_cell_measures_every_reader(tmp_path: Path) -> None:
    if find_nginx() is None:
        require_or_skip("nginx is not installed (kvgw bench io's GET baseline; apt-get install nginx-light)")
    out = tmp_path / "io.json"
    status = io.main(["--quick", "--ops", "batch", "--data-dir", str(tmp_path), "--json", str(out)])
    assert status in (0, 1)  # 1: a target missed, which is a measurement, not a failure of the bench
    doc = json.loads(out.read_text())
    rows = {s["target"]: s for s in doc["samples"] if s["op"] == io.BATCH_GET}
    assert set(rows) == {io.KVGW, io.KVGW_SERVER_VERIFIED, io.KVGW_CLIENT, io.RAW_STREAM, io.VERIFIED_SENDER}
    per_op = {name: row["bytes"] / row["ops"] for name, row in rows.items()}
    for name, row in rows.items():
        assert row["errors"] == 0 and row["ops"] > 0, (name, row["error_samples"])
        assert per_op[name] == per_op[io.RAW_STREAM], name
    names = {t["name"]: t["verdict"] for t in doc["targets"]}
    for mine in (io.KVGW, io.KVGW_CLIENT):
        assert names[f"{io.BATCH_GET} warm, 1 client: {mine} / raw socket stream throughput"] in ("PASS", "FAIL")
