"""``kvgw bench s3`` starts a whole Ceph cluster (radosgw, osd, mon) in its work directory: an interrupted
bench must not leave it running or on disk. The benchmark itself is not run here (no timed tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.fileio import pid_alive
from gateway.bench import rgw, s3
from tests.requirements import require_or_skip


def interrupted(workdir: Path) -> None:
    """Ctrl-C while the cluster runs (the bench turns SIGTERM and SIGHUP into the same)."""
    with s3.rgw_s3(workdir) as server:
        assert len(server.pids) == 3 and all(pid_alive(pid) for pid in server.pids)
        assert (workdir / "rgw" / "ceph.conf").exists()
        raise KeyboardInterrupt(server)


def test_the_benchs_rgw_is_stopped_and_deleted_when_interrupted(tmp_path: Path) -> None:
    missing = rgw.missing_commands()
    if missing:
        require_or_skip(f"Ceph RGW not installed ({', '.join(missing)} missing; run .ci/install-rgw.sh)")
    with pytest.raises(KeyboardInterrupt) as info:
        interrupted(tmp_path)
    server: s3.Server = info.value.args[0]
    assert not any(pid_alive(pid) for pid in server.pids)
    assert not (tmp_path / "rgw").exists()
