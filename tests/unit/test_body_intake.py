"""The body intake's own logic (gateway.dataplane.intake.BodyIntake): pieces, flow control, the slow path.

The connection and the request cycle around it are stand-ins recording what the intake asks of them;
threaded receives read a real loopback TCP connection; ``tests/integration/test_body_intake.py``
drives the real thing over sockets.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest

from gateway.dataplane import intake
from gateway.dataplane.intake import INTAKE_PIECE_BYTES, BodyIntake


class FakeFlow:
    def __init__(self) -> None:
        self.paused = False
        self.pauses = 0

    def pause_reading(self) -> None:
        self.pauses += not self.paused
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.extra: dict[str, Any] = {}  # ``get_extra_info``: a threaded receive's socket, TLS

    def get_extra_info(self, name: str) -> Any:
        return self.extra.get(name)

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False


class FakeHttp:
    """What the intake calls on the connection (``gateway.dataplane.protocol.Connection``)."""

    def __init__(self) -> None:
        self.flow = FakeFlow()
        self.transport = FakeTransport()
        self.loop = asyncio.get_running_loop()
        self.done = 0

    def pause_reading(self) -> None:
        self.flow.pause_reading()

    def resume_reading(self) -> None:
        self.flow.resume_reading()

    def intake_done(self) -> None:
        self.done += 1


class FakeCycle:
    """What the intake calls on the request cycle (``gateway.dataplane.cycle.RequestCycle``)."""

    def __init__(self, expect_continue: bool = False) -> None:
        self.waiting_for_100_continue = expect_continue
        self.response_complete = False
        self.disconnected = False
        self.http: FakeHttp | None = None

    def send_continue(self) -> None:
        if self.waiting_for_100_continue and self.http is not None:
            self.http.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.waiting_for_100_continue = False

    async def receive_after_intake(self) -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}


def receive_into(taker: BodyIntake, data: bytes) -> None:
    """What the event loop does for a BufferedProtocol: fill ``get_buffer``'s view, report the count."""
    view = memoryview(data)
    while view:
        buffer = taker.get_buffer(-1)
        n = min(len(buffer), len(view))
        buffer[:n] = view[:n]
        view = view[n:]
        taker.buffer_updated(n)


def make(length: int, cycle: FakeCycle | None = None) -> tuple[BodyIntake, FakeHttp, FakeCycle]:
    http, cycle = FakeHttp(), cycle or FakeCycle()
    cycle.http = http
    return BodyIntake(cast(Any, http), cast(Any, cycle), length), http, cycle


async def test_full_pieces_are_handed_over_as_they_are_and_reading_pauses_while_one_waits() -> None:
    body = bytes(range(256)) * ((2 * INTAKE_PIECE_BYTES + 1000) // 256) + b"tail"
    taker, http, _ = make(len(body))
    taker.feed(body[:5000])  # what came with the head
    receive_into(taker, body[5000:INTAKE_PIECE_BYTES + 10])
    assert http.flow.paused and http.done == 0  # a full piece waits: no more reading until it is taken

    first = await taker.receive()
    assert first["type"] == "http.request" and first["more_body"]
    assert isinstance(first["body"], bytearray) and first["body"] == body[:INTAKE_PIECE_BYTES]
    assert not http.flow.paused

    receive_into(taker, body[INTAKE_PIECE_BYTES + 10 :])
    assert http.done == 1  # the last byte: the HTTP protocol takes the transport back
    second, last = await taker.receive(), await taker.receive()
    assert second["body"] == body[INTAKE_PIECE_BYTES : 2 * INTAKE_PIECE_BYTES] and second["more_body"]
    assert last["body"] == body[2 * INTAKE_PIECE_BYTES :] and not last["more_body"]
    assert first["body"] == body[:INTAKE_PIECE_BYTES]  # a piece handed over is never written again


async def test_a_trickling_body_is_handed_over_as_it_arrives_once_the_app_has_waited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake, "PARTIAL_AFTER", 0.01)
    body = b"x" * 1000 + b"y" * (INTAKE_PIECE_BYTES - 1000) + b"z" * 10
    taker, http, _ = make(len(body))
    receive_into(taker, body[:1000])
    partial = await taker.receive()  # no full piece comes: what has arrived, copied out
    assert partial["body"] == body[:1000] and partial["more_body"] and isinstance(partial["body"], bytes)

    receive_into(taker, body[1000:])
    rest, last = await taker.receive(), await taker.receive()
    assert rest["body"] == body[1000:INTAKE_PIECE_BYTES] and rest["more_body"]
    assert last["body"] == body[INTAKE_PIECE_BYTES:] and not last["more_body"]
    assert http.done == 1


async def test_100_continue_goes_out_on_the_first_receive_only() -> None:
    taker, http, cycle = make(10, FakeCycle(expect_continue=True))
    waiting = asyncio.ensure_future(taker.receive())
    await asyncio.sleep(0)
    assert http.transport.written == [b"HTTP/1.1 100 Continue\r\n\r\n"] and not cycle.waiting_for_100_continue
    receive_into(taker, b"0123456789")
    message = await waiting
    assert message["body"] == b"0123456789" and not message["more_body"]
    assert http.transport.written == [b"HTTP/1.1 100 Continue\r\n\r\n"]


async def test_a_lost_connection_wakes_the_app_with_a_disconnect() -> None:
    taker, _, _ = make(INTAKE_PIECE_BYTES * 3)
    receive_into(taker, b"a" * 100)
    waiting = asyncio.ensure_future(taker.receive())
    await asyncio.sleep(0)
    assert not waiting.done()
    taker.lose()
    assert await waiting == {"type": "http.disconnect"}
    assert await taker.receive() == {"type": "http.disconnect"}


# -- threaded receives: the rest of the body read from a real socket in a worker thread ---------------


@pytest.fixture
def peer() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A loopback TCP connection: (the gateway's end, non-blocking as the event loop keeps it; the
    client's end)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    ours.setblocking(False)
    yield ours, theirs
    ours.close()
    theirs.close()


def threaded(length: int, ours: socket.socket) -> tuple[BodyIntake, FakeHttp]:
    taker, http, _ = make(length)
    http.transport.extra["socket"] = ours
    return taker, http


class Collected:
    """A consumer that copies what it is given (a piece's buffer is refilled once it returns)."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.threads: set[int] = set()

    def __call__(self, piece: memoryview) -> None:
        self.pieces.append(bytes(piece))
        self.threads.add(threading.get_ident())


def sender(sock: socket.socket, data: bytes) -> threading.Thread:
    thread = threading.Thread(target=sock.sendall, args=(data,))
    thread.start()
    return thread


async def test_a_threaded_receive_hands_every_piece_to_a_worker_thread_and_ends_the_body(
        peer: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = peer
    body = bytes(range(256)) * ((2 * INTAKE_PIECE_BYTES + 1000) // 256) + b"tail"
    taker, http = threaded(len(body), ours)
    taker.feed(body[:5000])  # what came with the head
    receive_into(taker, body[5000 : INTAKE_PIECE_BYTES + 10])  # a full piece already waits: it goes first
    sending = sender(theirs, body[INTAKE_PIECE_BYTES + 10 :])
    consume = Collected()

    assert await taker.consume_in_thread(consume) == "complete"
    sending.join()
    assert [len(p) for p in consume.pieces] == [INTAKE_PIECE_BYTES, INTAKE_PIECE_BYTES, len(body) % INTAKE_PIECE_BYTES]
    assert b"".join(consume.pieces) == body
    assert threading.get_ident() not in consume.threads and len(consume.threads) == 1
    assert http.done == 1 and not http.flow.paused  # the HTTP protocol has the transport back, reading


async def test_the_buffers_a_completed_threaded_receive_leaves_serve_later_bodies_without_their_bytes(
        peer: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """Its consumer keeps nothing, so its full-size buffers are taken by later intakes instead of new
    zero-filled ones; a later body's pieces hold that body's bytes only, whatever the buffer held."""
    monkeypatch.setattr(intake, "_SPARE_PIECES", [])
    ours, theirs = peer
    first = b"A" * (2 * INTAKE_PIECE_BYTES + 1000)
    taker, _ = threaded(len(first), ours)
    receive_into(taker, first[:INTAKE_PIECE_BYTES + 10])  # a full piece waits, the next one is begun
    sending = sender(theirs, first[INTAKE_PIECE_BYTES + 10 :])
    assert await taker.consume_in_thread(Collected()) == "complete"
    sending.join()
    spares = list(intake._SPARE_PIECES)
    assert len(spares) == 2  # the waiting piece and the thread's buffer; the short last piece is no spare

    second = b"b" * (INTAKE_PIECE_BYTES + 5)  # one full piece, then 5 bytes: read by the event loop
    later, _, _ = make(len(second))
    assert any(later.get_buffer(-1).obj is spare for spare in spares)  # no new 2 MiB buffer
    receive_into(later, second)
    messages = [await later.receive()]
    while messages[-1]["more_body"]:
        messages.append(await later.receive())
    assert b"".join(bytes(m["body"]) for m in messages) == second


async def test_a_threaded_receive_gives_a_slow_body_back_to_the_event_loop_where_it_stopped(
        peer: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake, "THREADED_PIECE_SECONDS", 0.01)
    ours, theirs = peer
    body = b"a" * INTAKE_PIECE_BYTES + b"b" * 700_000 + b"c" * 300_000  # the last piece is short
    taker, http = threaded(len(body), ours)
    sent = INTAKE_PIECE_BYTES + 700_000
    sending = sender(theirs, body[:sent])  # then nothing: the read gives up
    consume = Collected()

    assert await taker.consume_in_thread(consume) == "slow"
    sending.join()
    assert http.done == 0 and not http.flow.paused
    # the event loop reads the rest: what the thread left in the socket, then the body's last bytes,
    # into the piece the thread was filling, which ends where the body ends
    left = b""
    while True:
        try:
            left += ours.recv(1 << 20)
        except BlockingIOError:
            break
    assert len(taker.get_buffer(-1)) <= len(left) + len(body) - sent  # never past the body's end
    receive_into(taker, left + body[sent:])
    messages = [await taker.receive()]
    while messages[-1]["more_body"]:
        messages.append(await taker.receive())
    assert b"".join([*consume.pieces, *(bytes(m["body"]) for m in messages)]) == body
    assert http.done == 1


async def test_a_client_that_goes_away_mid_threaded_receive_gets_the_app_a_disconnect(
        peer: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = peer
    taker, _ = threaded(3 * INTAKE_PIECE_BYTES, ours)
    theirs.sendall(b"x" * (INTAKE_PIECE_BYTES + 10))
    theirs.close()
    consume = Collected()

    assert await taker.consume_in_thread(consume) == "gone"
    assert [len(p) for p in consume.pieces] == [INTAKE_PIECE_BYTES]
    assert await taker.receive() == {"type": "http.disconnect"}


async def test_a_failing_consumer_ends_the_threaded_receive_and_frees_its_reader(
        peer: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake, "_RECEIVER_SLOTS", threading.BoundedSemaphore(1))
    ours, theirs = peer
    taker, http = threaded(2 * INTAKE_PIECE_BYTES, ours)
    theirs.sendall(b"x" * INTAKE_PIECE_BYTES)

    def full_disk(piece: memoryview) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        await taker.consume_in_thread(full_disk)
    assert not http.flow.paused  # the connection reads again (the app answers, then drains or closes)
    other, _ = threaded(10, ours)
    theirs.sendall(b"0123456789")
    assert await other.consume_in_thread(Collected()) == "complete"  # the one reader slot was given back


async def test_no_threaded_receive_over_tls_or_without_a_free_reader(
        peer: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    ours, _ = peer
    taker, http = threaded(INTAKE_PIECE_BYTES, ours)
    http.transport.extra["sslcontext"] = object()
    assert await taker.consume_in_thread(Collected()) == "skipped"
    monkeypatch.setattr(intake, "_RECEIVER_SLOTS", threading.BoundedSemaphore(1))
    intake._RECEIVER_SLOTS.acquire()
    taker, http = threaded(INTAKE_PIECE_BYTES, ours)
    assert await taker.consume_in_thread(Collected()) == "skipped"
    assert not http.flow.paused and http.flow.pauses == 0  # the event loop reads this body as before
