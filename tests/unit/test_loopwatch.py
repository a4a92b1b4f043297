"""The event-loop watch on a real event loop in its own thread, blocked by a real callback; the watch's
clock is injected and its checks are made by the test, so nothing depends on how long anything takes."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from gateway.loopwatch import LoopWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own, as a gateway's runs in its main thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def on_loop(loop: asyncio.AbstractEventLoop, watch: LoopWatch) -> None:
    """``watch.start`` from the loop's own thread (without its checking thread), and every callback
    queued before this call run."""
    async def start() -> None:
        watch.start(thread=False)

    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)


def settle(loop: asyncio.AbstractEventLoop) -> None:
    """Every callback queued on ``loop`` so far has run."""
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)


def stalls(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value("kvgw_event_loop_stalls_total")
    assert value is not None
    return value


def test_a_blocked_loop_is_reported_once_with_where_it_is(loop: asyncio.AbstractEventLoop,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    clock, registry = Clock(), CollectorRegistry()
    watch = LoopWatch(registry, threshold=1.0, clock=clock)
    on_loop(loop, watch)
    entered, release = threading.Event(), threading.Event()

    def blocking_callback_under_test() -> None:
        entered.set()
        release.wait(timeout=30)

    loop.call_soon_threadsafe(blocking_callback_under_test)
    assert entered.wait(timeout=10)
    caplog.set_level(logging.WARNING, logger="kvgw.loopwatch")
    watch.check()  # t=0: asks the (blocked) loop for a callback
    clock.now = 0.9
    watch.check()
    assert stalls(registry) == 0 and not caplog.records
    clock.now = 1.5
    watch.check()
    (record,) = caplog.records
    assert "run nothing for 1.5 s" in record.getMessage()
    assert "blocking_callback_under_test" in record.getMessage()  # the loop thread's stack
    clock.now = 4.0
    watch.check()  # the same stall: not again
    assert stalls(registry) == 1 and len(caplog.records) == 1
    release.set()
    settle(loop)
    assert "runs again after 4.0 s" in caplog.records[-1].getMessage()
    watch.check()  # a new round: asks again, and the loop answers
    settle(loop)
    clock.now = 9.0
    watch.check()
    assert stalls(registry) == 1 and len(caplog.records) == 2


def test_a_loop_that_keeps_answering_is_never_reported(loop: asyncio.AbstractEventLoop,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    clock, registry = Clock(), CollectorRegistry()
    watch = LoopWatch(registry, threshold=1.0, clock=clock)
    on_loop(loop, watch)
    caplog.set_level(logging.WARNING, logger="kvgw.loopwatch")
    for step in range(20):
        clock.now = step * 0.25
        watch.check()
        settle(loop)
    assert stalls(registry) == 0 and not caplog.records

