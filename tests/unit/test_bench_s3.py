"""``kvgw bench s3``'s choice of baseline servers, its ratio columns and its verdicts, without a server:
which targets count (RGW's, and moto's boto3 PUT) and which are informative, and that a run without
Ceph says RGW was not measured instead of failing or passing quietly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.bench import baselines, s3
from gateway.bench.loadgen import Stats
from tests.pagecache import cached_pages, file_bytes


def result(target: str, op: str, clients: int, mb_per_s: float) -> s3.Result:
    stats = Stats(clients=clients, ops=10, window=1.0, window_ops=10, window_bytes=mb_per_s * 1e6)
    return s3.Result(target, op, clients, stats)


def test_default_baselines_follow_what_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3.rgw, "missing_commands", lambda: [])
    assert s3._baselines(None) == (["rgw", "moto"], {})
    monkeypatch.setattr(s3.rgw, "missing_commands", lambda: ["radosgw"])
    baselines, unavailable = s3._baselines(None)
    assert baselines == ["moto"]
    assert "radosgw missing" in unavailable["rgw"] and ".ci/install-rgw.sh" in unavailable["rgw"]
    assert s3._baselines("moto") == (["moto"], {})


def test_asking_for_rgw_without_ceph_or_for_an_unknown_server_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3.rgw, "missing_commands", lambda: ["ceph-osd"])
    with pytest.raises(SystemExit, match="Ceph is not installed"):
        s3._baselines("rgw,moto")
    with pytest.raises(SystemExit, match="unknown minio"):
        s3._baselines("minio")


def test_rgw_targets_count_and_moto_is_informative_but_for_boto3_put() -> None:
    counted = {(t.numerator, t.denominator, t.op) for t in s3.targets(["rgw", "moto"]) if t.counts}
    assert counted == {
        ("kvgw-s3 loadgen", s3.NATIVE, "GET"),
        ("kvgw-s3 boto3", "rgw boto3", "PUT"), ("kvgw-s3 loadgen", "rgw loadgen", "PUT"),
        ("kvgw-s3 boto3", "rgw boto3", "GET"), ("kvgw-s3 loadgen", "rgw loadgen", "GET"),
        ("kvgw-s3 boto3", "moto boto3", "PUT"),
    }


def rows(rgw_put: float) -> list[s3.Result]:
    """kvgw 3x moto and 3x RGW everywhere, except RGW's loadgen PUT at ``rgw_put`` MB/s against kvgw's 300."""
    found = [result(s3.NATIVE, "GET", 1, 1000), result(s3.NATIVE, "PUT", 1, 300)]
    for client in s3.CLIENTS:
        for op, kvgw in (("GET", 1000.0), ("PUT", 300.0)):
            found.append(result(f"kvgw-s3 {client}", op, 1, kvgw))
            found.append(result(f"moto {client}", op, 1, kvgw / 3))
            found.append(result(f"rgw {client}", op, 1, rgw_put if (client, op) == ("loadgen", "PUT") else kvgw / 3))
    return found


def test_verdicts_fail_on_a_counted_rgw_cell_only() -> None:
    text, ok = s3._verdicts(rows(rgw_put=100), [1], ["rgw", "moto"], {})
    assert ok and "FAIL" not in text
    text, ok = s3._verdicts(rows(rgw_put=150), [1], ["rgw", "moto"], {})
    assert not ok
    assert [line for line in text.splitlines() if "FAIL" in line] == [
        "  S3 PUT >= 3x rgw (loadgen both)              1 client(s):     300 / 150     =  2.00  FAIL"]


def test_without_rgw_the_verdicts_say_it_was_not_measured() -> None:
    results = [r for r in rows(rgw_put=100) if not r.target.startswith("rgw")]
    text, ok = s3._verdicts(results, [1], ["moto"], {"rgw": "Ceph not installed"})
    assert ok
    assert "RGW NOT MEASURED (Ceph not installed)" in text
    assert "3x rgw (" not in text


def test_table_ratios_compare_like_clients() -> None:
    table = s3._table(rows(rgw_put=150), ["rgw", "moto"]).splitlines()
    assert table[0].split()[10:13] == ["/native", "/rgw", "/moto"]
    loadgen_put = next(line for line in table if line.startswith("kvgw-s3 loadgen") and " PUT " in line)
    assert loadgen_put.split()[9:12] == ["1.00", "2.00", "3.00"]  # /native, /rgw (loadgen), /moto (loadgen)


def test_put_targets_are_set_beside_the_disk_loop_without_changing_the_verdict() -> None:
    """3x RGW above what the disk loop moved is called unreachable, below it is not; neither counts."""
    results = [*rows(rgw_put=150), result(s3.DISK, "PUT", 1, 400)]
    text, ok = s3._verdicts(results, [1], ["rgw", "moto"], {})
    assert not ok  # the loadgen PUT target still fails: the disk loop only explains it
    lines = text.splitlines()
    assert "  S3 PUT (loadgen) / the disk loop             1 client(s):     300 / 400     =  0.75  " \
           "(informative)" in lines
    assert "  3x rgw PUT (loadgen) / the disk loop         1 client(s):     450 / 400     =  1.12  " \
           "beyond the disk: unreachable here" in lines
    assert "  3x rgw PUT (boto3) / the disk loop           1 client(s):     300 / 400     =  0.75  " \
           "within the disk" in lines
    assert "  3x moto PUT (boto3) / the disk loop          1 client(s):     300 / 400     =  0.75  " \
           "within the disk" in lines


def test_without_a_disk_loop_row_nothing_is_said_of_the_disk() -> None:
    text, _ = s3._verdicts(rows(rgw_put=150), [1], ["rgw", "moto"], {})
    assert "disk" not in text


def test_the_disk_loop_writes_every_file_and_leaves_none(tmp_path: Path) -> None:
    """The disk loop stores ``count`` real files (write, fsync, link) across its threads, counts each
    as one PUT of the payload's size, and deletes what it wrote after the phase."""
    payload = os.urandom(3 * 1024 + 5)
    result = s3.disk_put(tmp_path, 2, payload, 7, fsync=True)
    assert (result.target, result.op, result.clients) == (s3.DISK, "PUT", 2)
    assert (result.stats.ops, result.stats.errors) == (7, 0)
    assert result.stats.client_cpu == 0.0
    assert result.stats.bytes == 7 * len(payload) and result.mb_per_s > 0
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_the_direct_disk_loop_stores_the_bytes_around_the_page_cache(tmp_path: Path) -> None:
    """``--direct-writes``: the loop writes as the tier's direct writes do (whole blocks around the page
    cache, the tail through it), and the file holds exactly the payload."""
    payload = memoryview(os.urandom(2 * 2 * 1024 * 1024 + 5))
    written: list[str] = []
    op = baselines.raw_write_op(tmp_path, payload, fsync=True, written=written, direct=True)(0)
    assert op(0) == payload.nbytes
    (path,) = written
    resident, pages = cached_pages(path)
    assert resident <= 1 and pages == 1025  # the 5-byte tail's page at most
    assert file_bytes(path) == payload.tobytes()
