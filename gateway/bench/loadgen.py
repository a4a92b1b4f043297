"""The load generator every ``kvgw bench`` benchmark drives its targets with (kvgw, nginx, FastAPI, S3...).

Apples to apples: each target is measured with the same client, and the client is cheap enough not to
be what is measured. It is a minimal HTTP/1.1 keep-alive client over a raw socket:

- one connection per client thread (socket calls release the GIL, so threads overlap their I/O);
- request heads are encoded once per ``LoadRequest`` object and cached; bodies go out with ``sendall``
  straight from the caller's prebuilt buffer;
- response bodies are read with ``recv_into`` a buffer preallocated per connection: nothing is
  allocated per response body. A body that fits the buffer stays readable (``conn.body``) until the
  next request; a larger one streams through it and only its length is kept;
- it parses the status line and ``Content-Length`` (and ``Transfer-Encoding: chunked``, and bodies
  delimited by the connection closing, for robustness), skips ``1xx`` interim responses, honours
  ``Connection: close`` by reconnecting on the next request.

Every response is checked against the request's expected statuses; a mismatch or a socket error is
an *error* in the ``Stats``, counted and sampled, never dropped. Latencies and bytes are recorded for
successful operations only.

``run_ops`` is the generic driver (any per-client callable, e.g. raw file I/O baselines, gets the same
timing, barrier and statistics); ``run_load`` is ``run_ops`` with an ``HttpConnection`` per client.
"""

from __future__ import annotations

import itertools
import multiprocessing
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import xxhash

Body = bytes | bytearray | memoryview
Address = tuple[str, int]

HEADER_BUFFER_BYTES = 64 * 1024
DEFAULT_BODY_BUFFER_BYTES = 4 << 20
_SMALL_BODY = 64 * 1024  # bodies up to this size are sent in the same send call as the head
_NO_BODY_STATUSES = frozenset({204, 304})
_ERROR_SAMPLES = 5


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 as this client understands it, or the connection broke."""


class StatusError(Exception):
    """A complete response whose status the request did not expect (the connection stays usable)."""

    def __init__(self, status: int, method: str, target: str, snippet: bytes) -> None:
        super().__init__(f"{method} {target[:80]} -> {status} {snippet[:160]!r}")
        self.status = status


class LoadRequest:
    """One request, reusable: build them once and hand the same objects out again and again.

    ``expect`` lists the statuses that count as success. ``body`` is sent as is (keep it alive and
    unchanged while requests use it).
    """

    __slots__ = ("_head", "_host", "body", "expect", "headers", "method", "target")

    def __init__(
        self,
        method: str,
        target: str,
        *,
        body: Body | None = None,
        headers: Sequence[tuple[str, str]] = (),
        expect: Sequence[int] = (200,),
    ) -> None:
        self.method = method.upper()
        self.target = target
        self.body = memoryview(body).cast("B") if body is not None else None
        self.headers = tuple(headers)
        self.expect = frozenset(expect)
        self._head = b""
        self._host = ""

    @property
    def body_length(self) -> int:
        return 0 if self.body is None else self.body.nbytes

    def head_bytes(self, host: str) -> bytes:
        if self._host != host:
            lines = [f"{self.method} {self.target} HTTP/1.1\r\nHost: {host}\r\n"]
            lines += [f"{name}: {value}\r\n" for name, value in self.headers]
            if self.body is not None or self.method in ("PUT", "POST", "PATCH"):
                lines.append(f"Content-Length: {self.body_length}\r\n")
            lines.append("\r\n")
            self._head = "".join(lines).encode("latin-1")
            self._host = host
        return self._head


class HttpConnection:
    """One keep-alive HTTP/1.1 connection; not thread-safe (one per client thread).

    ``request`` returns ``(status, body_bytes)``; afterwards ``body`` is the response body if it fit
    the body buffer (else None). Raises ``ProtocolError`` or ``OSError`` on a broken exchange, after
    which the connection is closed and the next request reconnects.
    """

    def __init__(self, address: Address, *, body_buffer_bytes: int = DEFAULT_BODY_BUFFER_BYTES,
                 timeout: float = 120.0) -> None:
        self.address = address
        self.host = f"{address[0]}:{address[1]}"
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.connects = 0  # how many times a connection was opened (1 = perfect keep-alive reuse)
        self._hbuf = bytearray(HEADER_BUFFER_BYTES)
        self._hview = memoryview(self._hbuf)
        self._start = 0  # unread bytes of the header buffer are _hbuf[_start:_end]
        self._end = 0
        self._bbuf = bytearray(max(body_buffer_bytes, 1))
        self._bview = memoryview(self._bbuf)
        self._pos = 0  # write position in the body buffer
        self._wrapped = False  # the last body did not fit the body buffer
        self._fresh = False  # no request has been sent on this connection yet

    # -- connection ------------------------------------------------------------------------------

    def connect(self) -> None:
        self.close()
        sock = socket.create_connection(self.address, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.connects += 1
        self._start = self._end = 0
        self._fresh = True

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    @property
    def body(self) -> memoryview | None:
        return None if self._wrapped else self._bview[: self._pos]

    # -- one exchange ----------------------------------------------------------------------------

    def request(self, req: LoadRequest) -> tuple[int, int]:
        """Send ``req`` and read its whole response. A request that fails on a reused connection
        before any response byte arrived (the server closed it while idle) is retried once."""
        if self.sock is None:
            self.connect()
        reused = not self._fresh
        try:
            return self._exchange(req)
        except (ProtocolError, OSError) as exc:
            self.close()
            if reused and isinstance(exc, _IdleClose | ConnectionResetError | BrokenPipeError):
                self.connect()
                try:
                    return self._exchange(req)
                except (ProtocolError, OSError):
                    self.close()
                    raise
            raise

    def _exchange(self, req: LoadRequest) -> tuple[int, int]:
        sock = self.sock
        assert sock is not None
        self._fresh = False
        head = req.head_bytes(self.host)
        body = req.body
        if body is None:
            sock.sendall(head)
        elif body.nbytes <= _SMALL_BODY:
            sock.sendall(head + body)
        else:
            sock.sendall(head)
            sock.sendall(body)
        status, length, chunked, close = self._read_head(first=True)
        while 100 <= status < 200 and status != 101:
            status, length, chunked, close = self._read_head(first=False)
        self._pos = 0
        self._wrapped = False
        received = 0
        if req.method != "HEAD" and status not in _NO_BODY_STATUSES:
            if chunked:
                received = self._read_chunked()
            elif length is not None:
                self._consume(length)
                received = length
            else:
                received = self._read_to_close()
                close = True
        if close:
            self.close()
        return status, received

    # -- response parsing ------------------------------------------------------------------------

    def _fill(self) -> int:
        """Receive more bytes into the header buffer (compacting it first); 0 at end of stream."""
        sock = self.sock
        assert sock is not None
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._hbuf):
            if self._start == 0:
                raise ProtocolError("response head larger than the header buffer")
            pending = self._end - self._start
            self._hbuf[:pending] = self._hbuf[self._start : self._end]
            self._start, self._end = 0, pending
        got = sock.recv_into(self._hview[self._end :])
        self._end += got
        return got

    def _read_head(self, *, first: bool) -> tuple[int, int | None, bool, bool]:
        """Status, Content-Length, chunked?, Connection: close?"""
        while True:
            at = self._hbuf.find(b"\r\n\r\n", self._start, self._end)
            if at >= 0:
                break
            if self._fill() == 0:
                if first and self._end == self._start:
                    raise _IdleClose("connection closed before any response byte")
                raise ProtocolError("connection closed inside the response head")
        text = self._hbuf[self._start : at].decode("latin-1")
        self._start = at + 4
        status_line, *lines = text.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {status_line[:80]!r}")
        status = int(parts[1])
        length: int | None = None
        chunked = False
        close = parts[0] == "HTTP/1.0"
        for line in lines:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                value = value.strip()
                if not value.isdigit():
                    raise ProtocolError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif name == "connection":
                token = value.strip().lower()
                close = token == "close" or (close and token != "keep-alive")
        return status, length, chunked, close

    def _consume(self, n: int) -> None:
        """Read ``n`` body bytes into the body buffer (wrapping around if they do not fit)."""
        cap = len(self._bbuf)
        while n:
            if self._pos == cap:
                self._pos = 0
                self._wrapped = True
            room = min(n, cap - self._pos)
            if self._start < self._end:  # bytes that arrived with the head
                take = min(room, self._end - self._start)
                self._bbuf[self._pos : self._pos + take] = self._hview[self._start : self._start + take]
                self._start += take
            else:
                sock = self.sock
                assert sock is not None
                take = sock.recv_into(self._bview[self._pos : self._pos + room], room)
                if take == 0:
                    raise ProtocolError(f"connection closed with {n} body bytes missing")
            self._pos += take
            n -= take

    def _readline(self) -> bytes:
        while True:
            at = self._hbuf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._hbuf[self._start : at])
                self._start = at + 2
                return line
            if self._fill() == 0:
                raise ProtocolError("connection closed inside a chunked body")

    def _read_chunked(self) -> int:
        total = 0
        while True:
            size_text = self._readline().split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                while self._readline():  # trailer fields, up to the empty line
                    pass
                return total
            self._consume(size)
            total += size
            if self._readline():
                raise ProtocolError("chunk data not followed by CRLF")

    def _read_to_close(self) -> int:
        total = 0
        cap = len(self._bbuf)
        while True:
            if self._start < self._end:
                pending = self._end - self._start
                self._consume(pending)
                total += pending
                continue
            if self._pos == cap:
                self._pos = 0
                self._wrapped = True
            sock = self.sock
            assert sock is not None
            got = sock.recv_into(self._bview[self._pos :])
            if got == 0:
                return total
            self._pos += got
            total += got


class _IdleClose(ProtocolError):
    """The server closed a kept-alive connection before answering (safe to retry once)."""


# -- the driver ----------------------------------------------------------------------------------

Op = Callable[[int], int]  # seq -> payload bytes moved; raises on failure


@dataclass
class Stats:
    """What ``run_ops`` / ``run_load`` measured.

    Rates: with a duration, the work done inside the measurement window over the window (an operation
    still in flight at the deadline counts for the share of its time inside the window, so slow
    operations are neither lost nor given the drain time for free); with a count, all the work over
    ``elapsed``.
    """

    clients: int
    ops: int = 0  # successful operations
    errors: int = 0
    bytes: int = 0  # payload bytes of successful operations (request + response bodies)
    elapsed: float = 0.0  # first start to last finish
    window: float = 0.0  # the measurement window (the duration; elapsed with a count)
    window_ops: float = 0.0  # successful operations inside the window, prorated
    window_bytes: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds, successful operations only
    statuses: Counter[int] = field(default_factory=Counter)  # HTTP statuses seen (run_load only)
    error_samples: list[str] = field(default_factory=list)
    client_cpu: float = 0.0  # CPU seconds used by the client threads
    connects: int = 0  # connections opened (run_load; == clients when keep-alive held throughout)

    @property
    def ops_per_s(self) -> float:
        return self.window_ops / self.window if self.window > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.window_bytes / self.window if self.window > 0 else 0.0

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)

    def summary(self) -> dict[str, float | int | list[str]]:
        return {
            "clients": self.clients, "ops": self.ops, "errors": self.errors, "bytes": self.bytes,
            "elapsed_s": self.elapsed, "window_s": self.window, "ops_per_s": self.ops_per_s,
            "bytes_per_s": self.bytes_per_s,
            "p50_s": self.percentile(0.50), "p99_s": self.percentile(0.99), "client_cpu_s": self.client_cpu,
            "connects": self.connects, "error_samples": list(self.error_samples),
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(q * len(ordered) + 0.999999)))
    return ordered[rank - 1]


@dataclass
class _ClientResult:
    ops: int = 0
    errors: int = 0
    bytes: int = 0
    window_ops: float = 0.0
    window_bytes: float = 0.0
    latencies: list[float] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    cpu: float = 0.0
    finished: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    connects: int = 0


Clock = Callable[[], float]
"""Seconds on a monotonic clock; with ``processes=True`` one that forked children share (``time.perf_counter``)."""

Finish = Callable[[int, _ClientResult], None]
"""Called in the client's thread or process after its last op: close what ``open_client`` opened and
record extra results (``run_load``: HTTP statuses and connections) into the client's result."""


def run_ops(open_client: Callable[[int], Op], clients: int, *, duration: float | None = None,
            count: int | None = None, processes: bool = False, finish: Finish | None = None,
            clock: Clock = time.perf_counter) -> Stats:
    """Run ``clients`` threads, each calling the op ``open_client(i)`` returned, until ``duration``
    seconds have passed or ``count`` operations have started in total (exactly one of the two).

    ``open_client`` runs in the client's thread before the clock starts (open connections there).
    The op gets ``seq``: with ``count``, a ticket 0..count-1 issued once across all clients; with
    ``duration``, the client's own counter 0, 1, 2... It returns the payload bytes it moved and raises
    on failure (counted as an error; the client goes on). Operations started before the deadline
    finish and count (see ``Stats`` for how they enter the rates).

    ``processes=True`` runs each client in its own forked process instead (``open_client``, the op
    and ``finish`` run there; tickets come from a shared counter): no client shares a GIL with
    another, so the server, not the client process, is what is measured.

    ``clock`` times everything (start, deadline, latencies); tests pass a fake one.
    """
    if (duration is None) == (count is None):
        raise ValueError("give exactly one of duration and count")
    run = _clients_in_processes if processes else _clients_in_threads
    results, t0 = run(_Client(open_client, finish, clock), clients, duration, count)
    stats = Stats(clients=clients)
    for res in results:
        stats.ops += res.ops
        stats.errors += res.errors
        stats.bytes += res.bytes
        stats.window_ops += res.window_ops
        stats.window_bytes += res.window_bytes
        stats.latencies.extend(res.latencies)
        stats.client_cpu += res.cpu
        stats.statuses.update(res.statuses)
        stats.connects += res.connects
        stats.error_samples.extend(res.samples[: _ERROR_SAMPLES - len(stats.error_samples)])
    stats.elapsed = max(res.finished for res in results) - t0 if results else 0.0
    stats.window = duration if duration is not None else stats.elapsed
    return stats


@dataclass
class _Client:
    """What one client runs, in a thread or in a process: open, ops until told to stop, finish."""

    open_client: Callable[[int], Op]
    finish: Finish | None
    clock: Clock

    def run(self, i: int, ready: Callable[[], float], next_seq: Callable[[], int | None],
            duration: float | None) -> _ClientResult:
        """``ready`` waits for every client to be open and returns the start time."""
        res = _ClientResult()
        try:
            op: Op | None = self.open_client(i)
        except Exception as exc:
            res.errors += 1
            res.samples.append(f"setup: {type(exc).__name__}: {exc}")
            op = None
        t0 = ready()
        _drive(op, res, t0 + duration if duration is not None else float("inf"), next_seq, self.clock)
        if self.finish is not None:
            self.finish(i, res)
        return res


def _drive(op: Op | None, res: _ClientResult, deadline: float, next_seq: Callable[[], int | None],
           perf: Clock) -> None:
    """One client's loop: ops until the deadline or until ``next_seq`` runs out (None)."""
    cpu0 = time.thread_time()
    while op is not None:
        if perf() >= deadline:
            break
        seq = next_seq()
        if seq is None:
            break
        began = perf()
        try:
            moved = op(seq)
        except Exception as exc:
            res.errors += 1
            if len(res.samples) < _ERROR_SAMPLES:
                res.samples.append(f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, StatusError):
                time.sleep(0.001)  # a dead target must not turn into a busy loop
            continue
        ended = perf()
        res.latencies.append(ended - began)
        res.ops += 1
        res.bytes += moved
        share = 1.0 if ended <= deadline else max(0.0, deadline - began) / max(ended - began, 1e-9)
        res.window_ops += share
        res.window_bytes += share * moved
    res.finished = perf()
    res.cpu = time.thread_time() - cpu0


def _sequence(duration: float | None, count: int | None, take: Callable[[], int]) -> Callable[[], int | None]:
    """A client's ``next_seq``: its own counter with a duration, else shared tickets below ``count``."""
    if duration is not None:
        return itertools.count().__next__
    limit = count or 0

    def ticket() -> int | None:
        seq = take()
        return seq if seq < limit else None

    return ticket


def _clients_in_threads(client: _Client, clients: int, duration: float | None, count: int | None
                        ) -> tuple[list[_ClientResult], float]:
    results = [_ClientResult() for _ in range(clients)]
    clock: dict[str, float] = {}
    barrier = threading.Barrier(clients, action=lambda: clock.__setitem__("t0", client.clock()))
    tickets = itertools.count()
    tickets_lock = threading.Lock()

    def take() -> int:
        with tickets_lock:
            return next(tickets)

    def ready() -> float:
        barrier.wait()
        return clock["t0"]

    def run(i: int) -> None:
        results[i] = client.run(i, ready, _sequence(duration, count, take), duration)

    threads = [threading.Thread(target=run, args=(i,), name=f"loadgen-{i}", daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, clock.get("t0", 0.0)


def _clients_in_processes(client: _Client, clients: int, duration: float | None, count: int | None
                          ) -> tuple[list[_ClientResult], float]:
    """Forked children (they inherit ``client``, no pickling); perf_counter (the default clock) is the
    system-wide monotonic clock, so the children's deadlines and finish times compare with the parent's."""
    ctx = multiprocessing.get_context("fork")
    t0 = ctx.Value("d", 0.0, lock=False)
    barrier = ctx.Barrier(clients, action=lambda: setattr(t0, "value", client.clock()))
    tickets = ctx.Value("q", 0)

    def take() -> int:
        with tickets.get_lock():
            seq: int = tickets.value
            tickets.value = seq + 1
        return seq

    def ready() -> float:
        barrier.wait()
        return float(t0.value)

    def child(i: int, conn: Connection) -> None:
        conn.send(client.run(i, ready, _sequence(duration, count, take), duration))
        conn.close()

    pipes = [ctx.Pipe(duplex=False) for _ in range(clients)]
    procs = [ctx.Process(target=child, args=(i, pipes[i][1]), daemon=True) for i in range(clients)]
    for proc in procs:
        proc.start()
    results: list[_ClientResult] = []
    for (reader, writer), proc in zip(pipes, procs, strict=True):
        writer.close()
        try:
            results.append(reader.recv())
        except EOFError:
            results.append(_ClientResult(errors=1, samples=[f"client process exited with {proc.exitcode}"]))
        proc.join()
    return results, float(t0.value)


MakeRequest = Callable[[int, int], LoadRequest]  # (client index, seq) -> the request to send


def run_load(address: Address, make_request: MakeRequest, clients: int, *, duration: float | None = None,
             count: int | None = None, body_buffer_bytes: int = DEFAULT_BODY_BUFFER_BYTES,
             timeout: float = 120.0, processes: bool = False, then: MakeRequest | None = None,
             hash_bodies: bool = False) -> Stats:
    """HTTP load: each client (a thread, or a process with ``processes``) owns one keep-alive
    connection and sends ``make_request(i, seq)`` (``seq`` as in ``run_ops``). Connections are opened
    before the clock starts. Bytes are request plus response body bytes; a status outside the
    request's ``expect`` is an error.

    ``then``: a second request sent on the same connection after each successful first one, as part
    of the same operation (timed with it, its bytes counted): e.g. a DELETE of what the PUT stored.

    ``hash_bodies``: each response body is xxh3-64-hashed once read, as part of the operation (a body
    larger than ``body_buffer_bytes`` is then an error: its bytes were not all kept)."""
    conns: dict[int, HttpConnection] = {}  # the client's own, in its thread or process
    seen: dict[int, Counter[int]] = {}

    def open_client(i: int) -> Op:
        conn = conns[i] = HttpConnection(address, body_buffer_bytes=body_buffer_bytes, timeout=timeout)
        statuses = seen[i] = Counter()
        conn.connect()

        def send(req: LoadRequest) -> int:
            status, received = conn.request(req)
            statuses[status] += 1
            if hash_bodies and received:
                body = conn.body
                if body is None:
                    raise ProtocolError(f"a {received}-byte body does not fit the body buffer: it cannot be hashed")
                xxhash.xxh3_64_intdigest(body)
            if status not in req.expect:
                body = conn.body
                raise StatusError(status, req.method, req.target, bytes(body[:200]) if body is not None else b"")
            return req.body_length + received

        def op(seq: int) -> int:
            moved = send(make_request(i, seq))
            return moved if then is None else moved + send(then(i, seq))

        return op

    def finish(i: int, res: _ClientResult) -> None:
        conn = conns.get(i)
        if conn is not None:
            conn.close()
            res.connects = conn.connects
            res.statuses = seen[i]

    return run_ops(open_client, clients, duration=duration, count=count, processes=processes, finish=finish)


def request_once(address: Address, req: LoadRequest, *, timeout: float = 30.0) -> tuple[int, bytes]:
    """One request on a fresh connection: (status, body) -- for set-up and checks, not for load."""
    conn = HttpConnection(address, body_buffer_bytes=1 << 20, timeout=timeout)
    try:
        status, _ = conn.request(req)
        body = conn.body
        return status, bytes(body) if body is not None else b""
    finally:
        conn.close()
