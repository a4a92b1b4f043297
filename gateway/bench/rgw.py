"""A throwaway Ceph RADOS Gateway: one mon, one osd (bluestore) and one radosgw, as plain processes.

The one launcher of the real S3 server both ``kvgw bench s3`` (kvgw's S3 API against it) and the tests
(``tests/rgw/fixtures.py``: kvgw's S3 tier against it) run. Installs nothing (``.ci/install-rgw.sh``
installs Debian's ``radosgw ceph-mon ceph-osd ceph-common``): everything lives in one directory given by
the caller, listens on 127.0.0.1 only, and is deleted by ``stop``. Start to ready takes about 3 s here
(see ``shared/notes/ceph-rgw.md`` for the settings that matter and why). From a shell::

    python -m gateway.bench.rgw start DIR [--port N]   # prints the endpoint; DIR/endpoint.json has the keys
    python -m gateway.bench.rgw stop DIR               # kills the processes, deletes DIR
    python -m gateway.bench.rgw status DIR

(``python -m tests.rgw`` is the same command.) ``DIR/state.json`` records the process ids (and the pid
of the run that owns the cluster, if any). ``start`` first stops whatever an earlier start in the same
directory left running, and ``sweep(base)`` stops every cluster under ``base`` whose owning run is
dead: a run that was SIGKILLed leaves nothing behind past the next run. A cluster started with
``die_with_parent`` also dies at once with the process that started it (``PR_SET_PDEATHSIG``).

The S3 user has fixed keys (``ACCESS_KEY`` / ``SECRET_KEY``); ``pause`` / ``resume`` (SIGSTOP / SIGCONT)
and ``stop_gateway`` / ``start_gateway`` (SIGKILL, then a new radosgw on the same port) act on the
radosgw process only: the objects live in RADOS and survive a gateway restart, unlike moto's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.fileio import pid_alive

ACCESS_KEY = "KVGWRGWTESTACCESS000"
SECRET_KEY = "kvgw-rgw-test-secret-key-0123456789abcdef"
USER = "kvgw-test"
COMMANDS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool")
STATE_FILE = "state.json"
ENDPOINT_FILE = "endpoint.json"
_DAEMONS = ("rgw", "osd", "mon")  # stop order


class RgwError(RuntimeError):
    """The cluster did not start (the message carries the tail of the relevant log)."""


def missing_commands() -> list[str]:
    """The Ceph commands not on PATH (install them with ``.ci/install-rgw.sh``)."""
    return [c for c in COMMANDS if shutil.which(c) is None]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _port_window(width: int = 24) -> int:
    """The first of ``width`` consecutive ports, mostly free, below Linux's ephemeral range (which
    starts at 32768), for the mon and the osd's messengers (the osd takes the free ones it finds)."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - width)
        if sum(_port_free(p) for p in range(base, base + width)) >= width - 4 and _port_free(base):
            return base
    raise RgwError("no free port window for the Ceph daemons")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started us dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _runs_in(pid: int, directory: Path) -> bool:
    """True if ``pid`` is a process started with a path inside ``directory`` on its command line (so a
    recycled pid of an unrelated process is never killed)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return str(directory) in cmdline


def _kill(pid: int, directory: Path) -> None:
    if _runs_in(pid, directory):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


@dataclass
class RgwCluster:
    """One throwaway cluster in ``directory`` (created; emptied first if it holds an earlier one)."""

    directory: Path
    port: int = 0  # radosgw's HTTP port; 0: a free one
    owner: int | None = None  # pid whose death makes the cluster garbage (fixture: the test run)
    die_with_parent: bool = False
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    startup_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).resolve()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def conf(self) -> Path:
        return self.directory / "ceph.conf"

    # -- start ----------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> RgwCluster:
        missing = missing_commands()
        if missing:
            raise RgwError(f"Ceph commands missing: {', '.join(missing)} (run .ci/install-rgw.sh)")
        began = time.monotonic()
        deadline = began + timeout
        stop_directory(self.directory)  # whatever an earlier start here left behind
        self.directory.mkdir(parents=True, exist_ok=True)
        for sub in ("mon", "osd", "rgw", "run", "log"):
            (self.directory / sub).mkdir()
        if not self.port:
            self.port = _free_port()
        base = _port_window()
        fsid = str(uuid.uuid4())
        self._write_conf(fsid, mon_port=base, port_min=base + 1, port_max=base + 23)
        self._save_state()
        try:
            self._run("monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{base}]",
                      str(self.directory / "monmap"), conf=False)
            self._run("ceph-mon", "-i", "a", "--mkfs", "--monmap", str(self.directory / "monmap"))
            self._spawn("mon", "ceph-mon", "-i", "a")
            self._wait(deadline, "mon", lambda: self._ceph("mon", "stat").returncode == 0)
            osd_uuid = str(uuid.uuid4())
            osd_id = self._ceph("osd", "new", osd_uuid, check=True).stdout.strip()
            (self.directory / "osd" / osd_id).mkdir()
            self._run("ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
            self._spawn("osd", "ceph-osd", "-i", osd_id)
            self._wait(deadline, "osd", self._osd_up)
            self.start_gateway(deadline - time.monotonic())
            self._run("radosgw-admin", "user", "create", f"--uid={USER}", f"--display-name={USER}",
                      f"--access-key={ACCESS_KEY}", f"--secret-key={SECRET_KEY}")
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        (self.directory / ENDPOINT_FILE).write_text(json.dumps(
            {"endpoint": self.url, "access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "region": "us-east-1"}
        ))
        return self

    def _write_conf(self, fsid: str, *, mon_port: int, port_min: int, port_max: int) -> None:
        d = self.directory
        self.conf.write_text(f"""\
[global]
fsid = {fsid}
mon_host = [v2:127.0.0.1:{mon_port}]
public_addr = 127.0.0.1
ms_bind_msgr1 = false
ms_bind_msgr2 = true
ms_bind_ipv6 = false
ms_bind_port_min = {port_min}
ms_bind_port_max = {port_max}
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
ms_mon_client_mode = crc
ms_client_mode = crc
ms_mon_cluster_mode = crc
ms_mon_service_mode = crc
ms_cluster_mode = crc
ms_service_mode = crc
run_dir = {d}/run
admin_socket = {d}/run/$name.asok
pid_file = {d}/run/$name.pid
log_file = {d}/log/$name.log
keyring = {d}/keyring
mon_data = {d}/mon/$id
osd_data = {d}/osd/$id
rgw_data = {d}/rgw/$id
crash_dir = {d}/crash
log_to_stderr = false
err_to_stderr = true
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_max_pg_per_osd = 1000
paxos_propose_interval = 0.05
paxos_min_wait = 0.01
mon_osd_reporter_subtree_level = osd
osd_op_num_shards = 2
osd_memory_target = 1073741824
osd_objectstore = bluestore
bluestore_fsck_on_mkfs = false
bluestore_block_create = true
bluestore_block_size = 21474836480
bluestore_block_db_create = false
bluestore_block_wal_create = false
bdev_aio_poll_ms = 20

[client.rgw.a]
rgw_frontends = beast endpoint=127.0.0.1:{self.port}
rgw_enable_usage_log = false
# no metadata cache, hence no watch/notify: after a SIGKILLed radosgw a new one would otherwise wait
# for the dead one's watches to time out (30 s) on every bucket create or delete
rgw_cache_enabled = false
rgw_dns_name = 127.0.0.1
""")
        (d / "keyring").write_text("")

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CEPH_CONF": str(self.conf)}

    def _run(self, *argv: str, conf: bool = True) -> subprocess.CompletedProcess[str]:
        args = [argv[0], *(["-c", str(self.conf)] if conf else []), *argv[1:]]
        result = subprocess.run(args, capture_output=True, text=True, env=self._env(), timeout=60,
                                stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise RgwError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        return result

    def _ceph(self, *argv: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        args = ["ceph", "-c", str(self.conf), "--connect-timeout", "5", *argv]
        result = subprocess.run(args, capture_output=True, text=True, env=self._env(), timeout=30,
                                stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise RgwError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        return result

    def _spawn(self, role: str, *argv: str) -> None:
        out = open(self.directory / "log" / f"{role}.out", "ab")  # noqa: SIM115 - the child keeps it
        try:
            proc = subprocess.Popen(
                [argv[0], "-c", str(self.conf), "-f", *argv[1:]],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env(),
                start_new_session=True, preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        finally:
            out.close()
        self.procs[role] = proc
        self.pids[role] = proc.pid
        self._save_state()

    def _wait(self, deadline: float, role: str, ready: Any) -> None:
        while True:
            proc = self.procs.get(role)
            if proc is not None and proc.poll() is not None:
                raise RgwError(f"{role} exited ({proc.returncode}) during start:\n{self.log(role)}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise RgwError(f"{role} not ready in time:\n{self.log(role)}")
            time.sleep(0.05)

    def _osd_up(self) -> bool:
        result = self._ceph("osd", "dump", "--format", "json")
        if result.returncode != 0:
            return False
        with contextlib.suppress(ValueError, KeyError, IndexError):
            return bool(json.loads(result.stdout)["osds"][0]["up"])
        return False

    def _http_ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                return s.recv(12).startswith(b"HTTP/1.1 ")
        except OSError:
            return False

    def log(self, role: str) -> str:
        names = {"mon": ["mon.a.log", "mon.out"], "osd": ["osd.0.log", "osd.out"],
                 "rgw": ["client.rgw.a.log", "rgw.out"]}[role]
        parts = []
        for name in names:
            path = self.directory / "log" / name
            with contextlib.suppress(OSError):
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    # -- the gateway process alone ---------------------------------------------------------------

    def start_gateway(self, timeout: float = 30.0) -> None:
        """Start radosgw (again) on ``port``; returns once it answers HTTP."""
        self._spawn("rgw", "radosgw", "-n", "client.rgw.a")
        self._wait(time.monotonic() + timeout, "rgw", self._http_ready)

    def stop_gateway(self) -> None:
        """SIGKILL radosgw: connections to the port are refused until ``start_gateway``."""
        proc = self.procs.pop("rgw", None)
        self.pids.pop("rgw", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
        self._save_state()

    def pause(self) -> None:
        """SIGSTOP radosgw: the kernel still accepts connections, nothing answers; state is kept."""
        proc = self.procs.get("rgw")
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        proc = self.procs.get("rgw")
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)

    @property
    def gateway_running(self) -> bool:
        proc = self.procs.get("rgw")
        return proc is not None and proc.poll() is None

    # -- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Kill every process (gateway, osd, mon: nothing in it is worth a clean shutdown) and delete
        the directory."""
        for role in _DAEMONS:
            proc = self.procs.pop(role, None)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        stop_directory(self.directory)
        self.pids.clear()

    def _save_state(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            tmp = self.directory / f"{STATE_FILE}.tmp"
            tmp.write_text(json.dumps({"owner": self.owner, "port": self.port, "pids": self.pids}))
            tmp.replace(self.directory / STATE_FILE)


def stop_directory(directory: Path) -> None:
    """Kill the processes ``directory/state.json`` lists (only those still running from that directory)
    and delete the directory. A no-op for a directory that holds no cluster."""
    directory = Path(directory).resolve()
    state_path = directory / STATE_FILE
    with contextlib.suppress(OSError, ValueError):
        state = json.loads(state_path.read_text())
        for role in _DAEMONS:
            pid = state.get("pids", {}).get(role)
            if isinstance(pid, int):
                _kill(pid, directory)
    if state_path.exists() or (directory / "ceph.conf").exists():
        shutil.rmtree(directory, ignore_errors=True)


def sweep(base: Path) -> int:
    """Stop and delete every cluster under ``base`` whose owning process is gone; returns how many."""
    removed = 0
    if not base.is_dir():
        return 0
    for directory in base.iterdir():
        state_path = directory / STATE_FILE
        try:
            owner = json.loads(state_path.read_text()).get("owner")
        except (OSError, ValueError):
            if directory.is_dir() and time.time() - directory.stat().st_mtime > 600:
                shutil.rmtree(directory, ignore_errors=True)  # a start killed before it wrote its state
            continue
        if isinstance(owner, int) and not pid_alive(owner):
            stop_directory(directory)
            removed += 1
    return removed


def main(argv: list[str] | None = None, prog: str = "python -m gateway.bench.rgw") -> int:
    """``start|stop|status DIR`` from a shell (for a manual run against RGW, or another tool's tests)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog=prog, description="A throwaway Ceph RGW cluster in DIR.")
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("directory", type=Path, help="where the cluster lives (deleted by stop)")
    parser.add_argument("--port", type=int, default=0, help="radosgw's HTTP port (default: a free one)")
    args = parser.parse_args(argv)
    directory: Path = args.directory.resolve()
    if args.action == "start":
        try:
            cluster = RgwCluster(directory, port=args.port).start()
        except RgwError as exc:
            print(f"rgw: {exc}", file=sys.stderr)
            return 1
        print(cluster.url)
        print(f"rgw: ready in {cluster.startup_seconds:.1f} s; keys in {directory / ENDPOINT_FILE}",
              file=sys.stderr)
        return 0
    if args.action == "stop":
        stop_directory(directory)
        return 0
    try:
        state = json.loads((directory / STATE_FILE).read_text())
        endpoint = json.loads((directory / ENDPOINT_FILE).read_text())["endpoint"]
    except (OSError, ValueError, KeyError):
        print("rgw: no cluster here", file=sys.stderr)
        return 1
    alive = {role: pid_alive(pid) for role, pid in state.get("pids", {}).items()}
    print(json.dumps({"endpoint": endpoint, "running": alive}))
    return 0 if alive and all(alive.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
