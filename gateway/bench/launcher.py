"""The one launcher of ``kvgw serve`` subprocesses, for the benches and the tests (``tests/conftest.py``'s
``ServerProcess`` is a ``KvgwProcess``), and the small process helpers they share: a free port,
starting any other server (nginx, moto) until it answers, stopping one, the tail of its log.

A ``KvgwProcess`` runs the command users run (``python -m gateway.cli serve``) on a free loopback
port, logs to a file beside its data directory and is ready when ``/readyz`` answers 200.

Last, what the two inference-engine benches (``kvgw bench lmcache``, ``kvgw bench sglang``) share
besides the launcher: the options that say how a run goes and the work directory they name, the files
whose page cache a "cold" pass drops, dropping it, and the printed result with its header. Both compare
kvgw with another storage path of the same engine on the same machine, so a result is only readable
beside what it depends on (the engine's and torch's versions, the CPUs, whether kvgw fsyncs, whether
both stores share one device); one copy keeps the two reports alike, and a fix to one a fix to both.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def http_status(url: str, timeout: float = 2.0, ca_file: Path | None = None) -> int:
    """The status a GET of ``url`` answers; OSError when nothing answers. ``ca_file``: trust for https."""
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def wait_until(check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path,
               timeout: float = 30.0) -> None:
    """Poll ``check`` until it holds. If ``proc`` dies or time runs out, stop it and raise with its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        with contextlib.suppress(OSError, RuntimeError):
            if check():
                return
        time.sleep(0.05)
    stop_process(proc)
    raise RuntimeError(f"{what} did not come up within {timeout:g} s:\n{tail(log)}")


@contextlib.contextmanager
def started(cmd: list[str], log: Path, ready: Callable[[], bool], *, what: str,
            env: Mapping[str, str] | None = None, timeout: float = 60.0) -> Iterator[subprocess.Popen[bytes]]:
    """A server process (output appended to ``log``) once ``ready()`` holds; stopped on exit."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=None if env is None else dict(env))
    try:
        wait_until(ready, proc, what, log, timeout)
        yield proc
    finally:
        stop_process(proc)


@contextlib.contextmanager
def moto_server(log: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """moto's S3 emulator on a free port (its port and process), ready once ``/moto-api/`` answers."""
    port = free_port()
    exe = shutil.which("moto_server")
    cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
    with started([*cmd, "-H", "127.0.0.1", "-p", str(port)], log,
                 lambda: http_status(f"http://127.0.0.1:{port}/moto-api/") == 200, what="moto_server") as proc:
        yield port, proc


@dataclass
class KvgwProcess:
    """``kvgw serve`` in a subprocess on a free port.

    ``env`` is added to this process's environment, from which ``inherit_kvgw_env=False`` first
    drops every ``KVGW_*`` setting (a bench measures the gateway on its defaults). ``extra_args``
    follow ``serve --port N --data-dir DIR``. The log goes to ``log_path`` (default: beside the data
    directory), appended across restarts.
    """

    data_dir: Path
    port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    inherit_kvgw_env: bool = True
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    ca_file: Path | None = None  # the server runs https (``--tls-cert``): trust this CA to reach it
    wrapper: list[str] = field(default_factory=list)  # a command prefix (``gateway.bench.callgrind``)

    @property
    def url(self) -> str:
        return f"{'https' if self.ca_file else 'http'}://127.0.0.1:{self.port}"

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if self.inherit_kvgw_env or not k.startswith("KVGW_")}
        env["KVGW_LOG_LEVEL"] = "warning"
        env.update(self.env)
        return env

    def start(self, timeout: float = 60.0) -> Self:
        if self.log_path is None:
            self.log_path = self.data_dir.parent / f"{self.data_dir.name}-server-{self.port}.log"
        cmd = [*self.wrapper, sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port),
               "--data-dir", str(self.data_dir), *self.extra_args]
        if self.wrapper:
            timeout *= 10  # valgrind starts a process 30-60x slower
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.environment(), cwd=REPO)
        wait_until(lambda: http_status(f"{self.url}/readyz", timeout=1.0, ca_file=self.ca_file) == 200, self.proc,
                   "kvgw serve",
                   self.log_path, timeout)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def pids(self) -> list[int]:
        return [] if self.proc is None else [self.proc.pid]

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no flushing; what a crash looks like."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)

    def restart(self) -> Self:
        self.stop()
        return self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- what the engine benches share


def add_run_options(p: argparse.ArgumentParser, *, read: str, read_done: str, targets: str, example: str,
                    no_fsync_note: str, other: str) -> None:
    """Add the options both benches take after their own: requests, rounds, cache states, targets, fsync,
    work directory; one definition so the two benches are run, and read, the same way.

    ``read``/``read_done``: the engine's word for a load ("retrieve"/"retrieved"); ``targets``: every
    target's letter (the default of ``--only``), ``example`` a subset; ``no_fsync_note``: what the compared
    store does about fsync; ``other``: the compared store's data, as in "kvgw's data and {other} go".
    """
    p.add_argument("--requests", type=int, default=4, help=f"requests stored and {read_done} (default 4)")
    p.add_argument("--rounds", type=int, default=3, help=f"{read} passes over all requests (default 3)")
    p.add_argument("--cache", choices=["warm", "cold", "both"], default="both")
    p.add_argument("--only", default=targets, help=f"targets to run, e.g. '{example}' (default {targets})")
    p.add_argument("--no-fsync", action="store_true", help=f"run kvgw with --no-fsync ({no_fsync_note})")
    p.add_argument("--workdir", type=Path, help=f"where kvgw's data and {other} go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")


@contextlib.contextmanager
def work_directory(args: argparse.Namespace, prefix: str) -> Iterator[Path]:
    """``--workdir`` (created if need be), or a new temporary directory named ``prefix...``.

    A temporary one is removed on exit, pass or fail, unless ``--keep``: a bench writes gigabytes there.
    One the user named is never removed.
    """
    workdir: Path = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        yield workdir
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def files_under(root: Path) -> list[Path]:
    """Every file below ``root`` (none if it does not exist yet): what a target stored, for a cold pass."""
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def drop_page_cache(paths: Sequence[Path]) -> None:
    """Write back and evict the cached pages of ``paths``: the next read goes to the disk."""
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def version(dist: str) -> str:
    """The installed version of ``dist``, or ``?``: a missing one must not stop the report."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def print_report(report: Callable[[str], tuple[str, bool]], *, title: str, engine: str, dist: str, fsync: bool,
                 other: str, kvgw_dir: Path, other_dir: Path, workdir: Path) -> int:
    """Print ``report(header)``'s table under a two-line header and return the bench's exit status.

    The header is ``title``, then what the numbers depend on: ``engine`` at the version of ``dist``,
    torch, the CPUs, kvgw's fsync, and whether kvgw's data (``kvgw_dir``) and the compared store
    (``other``, in ``other_dir``) are on one device, since a bench across two disks compares the disks.
    ``report`` returns the table and whether every target ran (and passed): exit status 0, else 1.
    """
    import torch  # the engines need it anyway; imported late so the module loads without it

    same_disk = os.stat(kvgw_dir).st_dev == os.stat(other_dir).st_dev
    header = (
        f"{title}; {engine} {version(dist)}, torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}\n"
        f"kvgw fsync {'on' if fsync else 'off'}; kvgw data and {other} "
        f"{'on the same device' if same_disk else 'on DIFFERENT devices'} ({workdir})"
    )
    text, ok = report(header)
    print(text)
    return 0 if ok else 1
