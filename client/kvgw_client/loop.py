"""The client's own event loop, on a daemon thread, and the ways to reach it from anywhere.

All network I/O of a ``KvgwClient`` runs on this loop, so one connection pool serves every caller
(except the first attempt of a plain thread's lookup, made on that thread: ``KvgwClient.lookup_now``):
coroutines on LMCache's event loop (``await io.run(...)``: the awaiting loop only waits on a future),
plain threads (``io.call(...)`` blocks that thread), and the client's own background work
(``io.submit(...)``). Checksums and payload copies happen on this thread as well, never on a
caller's loop.

Cancellation crosses the boundary: cancelling a caller's ``await io.run(coro)`` cancels ``coro`` on
the I/O loop (asynchronously; ``coro`` may still be finishing when the caller sees CancelledError).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvgw_client.errors import ClientClosed

T = TypeVar("T")


class IoLoop:
    def __init__(self, name: str = "kvgw-client-io") -> None:
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        try:
            self._loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            if tasks:
                self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    def in_loop(self) -> bool:
        """True when called from code running on this loop."""
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def submit(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        """Schedule ``coro`` on the I/O loop from any thread; never blocks."""
        with self._lock:
            if self._closed:
                coro.close()
                raise ClientClosed()
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run a plain callback on the I/O loop soon; dropped silently once the loop is closed."""
        with self._lock:
            if not self._closed:
                self._loop.call_soon_threadsafe(fn, *args)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` from any event loop: directly on the I/O loop, else through a future."""
        if self.in_loop():
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the I/O loop and block the calling thread for its result.

        Refuses to run on a thread that is running an event loop: blocking there would stall that
        loop (and deadlock if it is the I/O loop itself).
        """
        try:
            refuse_on_an_event_loop()
        except RuntimeError:
            coro.close()
            raise
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except cf.TimeoutError:
            future.cancel()
            raise

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop (cancelling what still runs on it) and wait for its thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


def refuse_on_an_event_loop() -> None:
    """Raise RuntimeError on a thread that is running an event loop: a blocking call there would stall
    that loop (and deadlock if it is the client's I/O loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError("blocking kvgw call from an event loop thread; use the async API")


async def wait_shared(future: cf.Future[T]) -> T:
    """Await a concurrent future that other waiters share, from any loop.

    Unlike ``asyncio.wrap_future``, cancelling this waiter leaves ``future`` alone.
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def relay(done: cf.Future[T]) -> None:
        def settle() -> None:
            if waiter.done():
                return
            if done.cancelled():
                waiter.cancel()
            elif (exc := done.exception()) is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(done.result())

        with contextlib.suppress(RuntimeError):  # the waiting loop is gone
            loop.call_soon_threadsafe(settle)

    future.add_done_callback(relay)
    return await waiter
