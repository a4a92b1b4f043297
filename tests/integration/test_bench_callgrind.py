"""``gateway.bench.callgrind``: the instruction counts ``kvgw bench head --instructions`` reports come from
a real server under valgrind, per request, and repeat from one measurement to the next."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gateway.bench import callgrind
from gateway.bench.launcher import free_port, stop_process, wait_until
from gateway.bench.loadgen import LoadRequest
from tests.requirements import require_or_skip


def test_counts_a_servers_instructions_per_request(tmp_path: Path) -> None:
    if not callgrind.available():
        require_or_skip("valgrind (callgrind_control) is not installed")
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "small").write_bytes(b"x" * 100)
    port = free_port()
    out = tmp_path / "server.callgrind"
    log = tmp_path / "server.log"
    with open(log, "ab") as sink:
        cmd = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(tmp_path / "www"),
               str(port)]
        proc = subprocess.Popen([*callgrind.wrapper(out), *cmd], stdout=sink, stderr=subprocess.STDOUT)
    try:
        sender = callgrind.Sender(("127.0.0.1", port), [LoadRequest("HEAD", "/small", expect=(200,))])
        wait_until(lambda: _answers(port), proc, "http.server under callgrind", log, timeout=120)
        first = callgrind.instructions_per_request(proc.pid, out, sender, 20)
        second = callgrind.instructions_per_request(proc.pid, out, sender, 40)
        sender.close()
    finally:
        stop_process(proc)
    # http.server answers a HEAD in tens of thousands of instructions; a count of the whole process
    # (start-up included) would be hundreds of millions, one not divided by the requests ~20x the first
    assert 5_000 < first.per_request < 5_000_000
    assert abs(second.per_request - first.per_request) / first.per_request < 0.25
    # idle, http.server waits in select: the window subtracted for clock-driven work is next to nothing
    assert 0 <= first.background < 0.1 * first.per_request


def _answers(port: int) -> bool:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("HEAD", "/small")
        return conn.getresponse().status == 200
    finally:
        conn.close()
