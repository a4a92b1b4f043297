"""The client's view of the gateway's health, and how failures are counted and logged.

``Circuit`` is a pure state machine with the clock passed in: after N consecutive failures that say
something about the gateway (``KvgwClientError.trips``) it opens, calls fail fast without touching the
network, and after a cooldown one probe decides whether it closes again (each failed probe doubles
the cooldown). It belongs to the thread that owns the client's event loop.

``FailureLog`` counts every failure and logs one warning per burst: a burst starts at the first
failure after a success and ends at the next success, which logs one line saying how long the burst
lasted and how many calls failed. A long burst adds a summary line every ``summary_every`` seconds,
so a dead gateway produces a handful of lines per hour, not one per call. It is thread-safe.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Callable

from kvgw_client.config import HealthPolicy

Clock = Callable[[], float]


class CircuitState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    PROBING = "probing"


class Circuit:
    def __init__(self, policy: HealthPolicy, clock: Clock) -> None:
        self._policy = policy
        self._clock = clock
        self.state = CircuitState.CLOSED
        self.consecutive_failures = 0
        self._cooldown = policy.cooldown
        self.retry_at = 0.0
        self.opened = 0  # how many times the circuit opened

    def allow(self) -> bool:
        """Whether a call may go to the network now."""
        return self.state is CircuitState.CLOSED

    def retry_in(self) -> float:
        return self.retry_at - self._clock()

    def on_success(self) -> bool:
        """Record a successful call; True when this closed an open circuit."""
        self.consecutive_failures = 0
        if self.state is CircuitState.CLOSED:
            return False
        self._close()
        return True

    def on_failure(self) -> bool:
        """Record a failure that trips; True when this failure opened the circuit."""
        self.consecutive_failures += 1
        if self.state is CircuitState.CLOSED and self.consecutive_failures >= self._policy.failure_threshold:
            self._open(self._policy.cooldown)
            self.opened += 1
            return True
        return False

    def begin_probe(self) -> bool:
        """Move OPEN to PROBING once the cooldown has passed; True means: probe now."""
        if self.state is CircuitState.OPEN and self._clock() >= self.retry_at:
            self.state = CircuitState.PROBING
            return True
        return False

    def end_probe(self, ok: bool) -> None:
        if self.state is not CircuitState.PROBING:
            return
        if ok:
            self._close()
        else:
            self._open(min(self._cooldown * 2, self._policy.cooldown_max))

    def _open(self, cooldown: float) -> None:
        self.state = CircuitState.OPEN
        self._cooldown = cooldown
        self.retry_at = self._clock() + cooldown

    def _close(self) -> None:
        self.state = CircuitState.CLOSED
        self.consecutive_failures = 0
        self._cooldown = self._policy.cooldown


class FailureLog:
    def __init__(
        self, logger: logging.Logger, subject: str, clock: Clock, *, summary_every: float = 300.0
    ) -> None:
        self._logger = logger
        self._subject = subject
        self._clock = clock
        self._summary_every = summary_every
        self._lock = threading.Lock()
        self._totals: Counter[str] = Counter()
        self._burst: Counter[str] = Counter()
        self._burst_start: float | None = None
        self._last_summary = 0.0

    def failure(self, op: str, kind: str, message: str) -> None:
        now = self._clock()
        name = f"{op}.{kind}"
        with self._lock:
            self._totals[name] += 1
            self._burst[name] += 1
            if self._burst_start is None:
                self._burst_start = self._last_summary = now
                first = True
            else:
                first = False
                due = now - self._last_summary >= self._summary_every
                if due:
                    self._last_summary = now
            burst = dict(self._burst)
            started = self._burst_start
        if first:
            self._logger.warning(
                "%s: %s failed (%s): %s; further failures are counted, not logged, until it recovers",
                self._subject, op, kind, message,
            )
        elif due:
            self._logger.warning(
                "%s: still failing after %.0fs: %s; last: %s %s",
                self._subject, now - started, _fmt(burst), op, message,
            )
        else:
            self._logger.debug("%s: %s failed (%s): %s", self._subject, op, kind, message)

    def success(self) -> None:
        with self._lock:
            if self._burst_start is None:
                return
            burst = dict(self._burst)
            duration = self._clock() - self._burst_start
            self._burst.clear()
            self._burst_start = None
        self._logger.info("%s: recovered after %.1fs of failures: %s", self._subject, duration, _fmt(burst))

    @property
    def in_burst(self) -> bool:
        with self._lock:
            return self._burst_start is not None

    def counts(self) -> dict[str, int]:
        """Failures since start, by ``op.kind``."""
        with self._lock:
            return dict(self._totals)


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


class Counters:
    """Named monotonically increasing counters, safe to bump from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
