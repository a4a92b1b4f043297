"""Instructions a server process executes per request, counted by valgrind's callgrind.

Why: this VM is shared and noisy. Rates and CPU seconds of small requests move 20-50% between identical
runs (``kvgw bench head``: the same build's S3 HEAD cost 115-219 µs of server CPU on different days), so a
change worth 5-10% per request cannot be told from noise by timing it. Callgrind counts the user-space
instructions a process runs: the same build, requests and data give the same count within a few percent,
whatever else the machine does. It is no wall-clock figure: it leaves out the kernel (the socket calls,
which are the same for every Python server here), cache misses and instruction costs, so compare
counts of one request shape across builds and servers, not with times.

How: the server runs under ``valgrind --tool=callgrind`` (``wrapper``; 30-60x slower). The caller sends
warm-up requests, then ``instructions_per_request`` zeroes the counters (``callgrind_control -z``),
sends ``n`` requests one at a time on one keep-alive connection, has the counts dumped
(``callgrind_control -d``) and reads the dump's total, then subtracts what the process runs idle in as
much time (``instructions_per_request``). Needs valgrind (``available``).
"""

from __future__ import annotations

import http.client
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from gateway.bench.loadgen import Address, LoadRequest

WARM_UP = 50  # requests before counting: first-call work (imports, caches, index pages) is not counted
IDLE_WINDOWS = 2  # the idle window lasts this many times the requests' (clock-driven work comes in bursts)


def available() -> bool:
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def wrapper(out: Path) -> list[str]:
    """The command prefix that runs a server under callgrind, its dumps at ``out.<n>``."""
    return ["valgrind", "--tool=callgrind", "--quiet", f"--callgrind-out-file={out}"]


class Sender:
    """``requests`` in turn on one keep-alive connection, each answer read and its status checked."""

    def __init__(self, address: Address, requests: Sequence[LoadRequest], timeout: float = 120.0) -> None:
        self._conn = http.client.HTTPConnection(*address, timeout=timeout)
        self._requests = requests
        self._next = 0

    def send(self, count: int) -> None:
        for _ in range(count):
            request = self._requests[self._next % len(self._requests)]
            self._next += 1
            body = None if request.body is None else bytes(request.body)
            self._conn.request(request.method, request.target, body=body, headers=dict(request.headers))
            response = self._conn.getresponse()
            response.read()
            if response.status not in request.expect:
                raise RuntimeError(f"{request.method} {request.target}: {response.status}, expected {request.expect}")

    def close(self) -> None:
        self._conn.close()


class Counted(NamedTuple):
    """Instructions per request, net of the clock-driven work in the same time (``background``: what
    the idle process ran in as much time, averaged over ``IDLE_WINDOWS`` times as long, per request;
    already subtracted)."""

    per_request: float
    background: float


def instructions_per_request(pid: int, out: Path, sender: Sender, count: int) -> Counted:
    """Instructions the callgrind-run process ``pid`` (dumping to ``out``) executes per request while
    ``sender`` sends ``count`` requests, after ``WARM_UP`` uncounted ones, minus what the process runs
    idle over as long a time right after (averaged over ``IDLE_WINDOWS`` times that).

    Why the idle window: a server's timers and background threads (kvgw's catalog and cluster polls,
    SQLAlchemy under them) run by the clock, and callgrind's 30-60x slowdown stretches the requests'
    window as much, so that work would be charged to the requests ~50x over what it costs at speed
    (~9% of a kvgw S3 HEAD's count, measured with ``--separate-threads=yes``: two pool threads running
    SQLAlchemy queries, none of it per request)."""
    sender.send(WARM_UP)
    _control("-z", pid)
    started = time.monotonic()
    sender.send(count)
    elapsed = time.monotonic() - started
    busy = _dump(pid, out)
    _control("-z", pid)
    time.sleep(IDLE_WINDOWS * elapsed)
    idle = _dump(pid, out) / IDLE_WINDOWS
    return Counted((busy - idle) / count, idle / count)


def _dump(pid: int, out: Path) -> int:
    """Dump the counts since the last zeroing; their total."""
    before = set(out.parent.glob(out.name + ".*"))
    _control("-d", pid)
    return _summary(before, out)


def _control(flag: str, pid: int) -> None:
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True, timeout=120)


def _summary(before: set[Path], out: Path, timeout: float = 60.0) -> int:
    """The total of the dump that appeared beside ``out`` after ``before`` was listed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for dump in set(out.parent.glob(out.name + ".*")) - before:
            for line in dump.read_text(errors="replace").splitlines():
                if line.startswith("summary:"):
                    return int(line.split()[1])
        time.sleep(0.1)
    raise RuntimeError(f"callgrind wrote no dump beside {out} within {timeout:g} s")
