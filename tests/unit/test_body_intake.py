"""The body intake's own logic (gateway.api.intake.BodyIntake): pieces, flow control, the slow path.

The HTTP protocol and uvicorn's cycle around it are stand-ins recording what the intake asks of them;
``tests/integration/test_body_intake.py`` drives the real thing over sockets.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from gateway.api import intake
from gateway.api.intake import INTAKE_PIECE_BYTES, BodyIntake


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

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False


class FakeHttp:
    """What the intake calls on ``IntakeHttpProtocol``."""

    def __init__(self) -> None:
        self.flow = FakeFlow()
        self.transport = FakeTransport()
        self.loop = asyncio.get_running_loop()
        self.done = 0

    def intake_done(self) -> None:
        self.done += 1


class FakeCycle:
    def __init__(self, expect_continue: bool = False) -> None:
        self.waiting_for_100_continue = expect_continue
        self.response_complete = False
        self.disconnected = False


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
