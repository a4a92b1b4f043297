"""The event-loop watch: a thread that notices when a gateway process's event loop stops running
callbacks for ``threshold`` seconds, and logs where the loop is stuck.

Why: every request of a process passes through its one event loop, so a call that blocks it (a
synchronous disk or lock wait, a long computation) stalls every connection at once, and clients
time out and send their requests again (aws-sdk-cpp after 3 s: ``kvgw_retried_requests``). The log
line carries the loop thread's Python stack at the moment the stall passed the threshold, which is
what finding such a call needs; ``kvgw_event_loop_stalls_total`` counts them.

What it cannot see: a whole process or VM that stops (SIGSTOP, a host pause) stops this thread too.
A client's retries with no stall logged here point there instead.

How: every ``interval`` the thread asks the loop to run a callback (``call_soon_threadsafe``); while
one is outstanding it only checks how long ago it was asked. Costs one callback on the loop per
interval (4 a second by default).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("kvgw.loopwatch")


class LoopWatch:
    """Watches one event loop; ``start`` on that loop, ``stop`` before it closes."""

    def __init__(self, registry: CollectorRegistry, *, threshold: float = 1.0, interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self._interval = interval
        self._clock = clock
        self._stalls = Counter("kvgw_event_loop_stalls", "Times the event loop ran no callback for longer than "
                               "the stall threshold (each is logged with where the loop was).", registry=registry)
        self._lock = threading.Lock()
        self._asked: float | None = None  # when the outstanding callback was asked for
        self._reported = False  # the outstanding callback's stall was logged
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, *, thread: bool = True) -> None:
        """Watch the running loop (call from it); ``thread=False`` leaves ``check`` to the caller."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        if thread:
            self._thread = threading.Thread(target=self._run, name="kvgw-loopwatch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self.check()

    def check(self) -> None:
        """One look, from the watching thread: ask the loop for a callback if none is outstanding, or
        log the stall once the outstanding one is ``threshold`` late."""
        loop = self._loop
        assert loop is not None, "start() first"
        now = self._clock()
        with self._lock:
            if self._asked is None:
                self._asked = now
                ask = True
            else:
                ask = False
                late = now - self._asked
                report = late >= self.threshold and not self._reported
                if report:
                    self._reported = True
        if ask:
            try:
                loop.call_soon_threadsafe(self._answered)
            except RuntimeError:  # the loop closed under us: nothing left to watch
                self._stopped.set()
            return
        if report:
            self._stalls.inc()
            frame = sys._current_frames().get(self._loop_thread)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
            log.warning("the event loop has run nothing for %.1f s; it is at:\n%s", late, where.rstrip())

    def _answered(self) -> None:
        """On the loop: it runs callbacks again."""
        with self._lock:
            late = self._clock() - self._asked if self._asked is not None else 0.0
            reported, self._asked, self._reported = self._reported, None, False
        if reported:
            log.warning("the event loop runs again after %.1f s", late)
