"""The clock routing and admission read: passed in, so tests and benchmarks run on simulated
time instead of monkeypatching the `time` module.

A clock has `monotonic()` (deadlines, ejections, LRU stamps) and `time()` (wall time, for what
other proxies publish and Redis TTLs). The `time` module itself is one, so the default costs
nothing over calling `time.monotonic()` directly.
"""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


SYSTEM: Clock = time  # type: ignore[assignment]


class ManualClock:
    """A clock that moves only when told (`advance`, or set `now`): both readings are `now`."""

    __slots__ = ("now",)

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
