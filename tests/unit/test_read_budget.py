"""The read budget: first come first served, streams reserve once (no hold-and-wait), releases are exact."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.read_budget import ReadBudget, budgeted


async def windows(n: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(n):
        yield b"x" * size


async def test_try_take_and_release_are_exact() -> None:
    budget = ReadBudget(100)
    first = budget.try_take(60)
    assert first is not None and budget.used == 60
    assert budget.try_take(50) is None
    first()
    first()  # a second release is a no-op
    assert budget.used == 0


async def test_waiters_are_served_in_arrival_order_and_try_take_does_not_jump_the_queue() -> None:
    budget = ReadBudget(100)
    held = budget.try_take(100)
    assert held is not None
    order: list[str] = []

    async def wait(name: str, n: int) -> None:
        release = await budget.take(n)
        order.append(name)
        release()

    a = asyncio.create_task(wait("a", 80))
    b = asyncio.create_task(wait("b", 10))
    await asyncio.sleep(0)
    assert budget.try_take(1) is None  # someone is waiting: no overtaking
    held()
    await asyncio.gather(a, b)
    assert order == ["a", "b"] and budget.used == 0


async def test_a_cancelled_waiter_leaves_no_debt() -> None:
    budget = ReadBudget(10)
    held = budget.try_take(10)
    assert held is not None
    waiter = asyncio.create_task(budget.take(5))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    held()
    assert budget.used == 0 and budget.try_take(10) is not None


async def test_more_take_than_the_budget_is_capped_not_stuck() -> None:
    budget = ReadBudget(10)
    release = await budget.take(1000)
    assert budget.used == 10
    release()
    assert budget.used == 0


async def test_streams_reserve_for_their_whole_life_and_many_cannot_deadlock() -> None:
    budget = ReadBudget(8)  # room for two streams of hold 4 at a time
    peak = 0

    async def consume(i: int) -> int:
        nonlocal peak
        total = 0
        async for piece in budgeted(windows(5, 2), budget, hold=4):
            peak = max(peak, budget.used)
            total += len(piece)
            await asyncio.sleep(0)
        return total

    totals = await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(20))), timeout=5)
    assert totals == [10] * 20
    assert peak <= 8 and budget.used == 0


async def test_a_stream_closed_early_gives_its_reservation_back() -> None:
    budget = ReadBudget(8)
    stream = budgeted(windows(5, 2), budget, hold=4)
    assert await stream.__anext__() == b"xx"
    assert budget.used == 4
    await stream.aclose()  # type: ignore[attr-defined]
    assert budget.used == 0
