"""Fakes for the client's unit tests."""

from __future__ import annotations


class Clock:
    """A monotonic clock the test moves by setting ``now``."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
