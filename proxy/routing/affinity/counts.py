"""Exponentially decayed event counts on the policy's request clock."""
from __future__ import annotations

import math
from typing import Any, Final

_RESCALE_AFTER: Final = 40.0  # time constants; renormalise the scaled rate accumulators past it


class DecayedCounts:
    """Exponentially decayed event counts per key with O(1) updates: each event adds
    exp((t - t0) / tau) and a read multiplies by exp(-(t - t0) / tau). `t` is the policy's
    request clock. The factor is kept for the last `t` asked: one request reads it several times."""

    __slots__ = ("tau", "t0", "scaled", "_at", "_up")

    def __init__(self, tau: float, now: float) -> None:
        self.tau = tau
        self.t0 = now
        self.scaled: dict[Any, float] = {}  # (typed: compiled, its values add unboxed)
        self._at = math.nan  # the clock `_up` is for (NaN: none; it equals no time)
        self._up = 1.0

    def factor(self, now: float) -> float:
        """exp((now - t0) / tau), renormalising first when it grows large."""
        if now == self._at:
            return self._up
        x = (now - self.t0) / self.tau
        if x > _RESCALE_AFTER:
            shrink = math.exp(-x)
            self.scaled = {k: v * shrink for k, v in self.scaled.items() if v * shrink > 1e-6}
            self.t0, x = now, 0.0
        self._at = now
        self._up = up = math.exp(x)
        return up

    def add(self, key, now: float, up: float | None = None) -> None:
        if up is None:
            up = self.factor(now)  # first: it may renormalise (replace) `scaled`
        scaled = self.scaled
        scaled[key] = scaled.get(key, 0.0) + up

    def count(self, key, up: float) -> None:
        """An event of `key`, counted in the total (key None) too; `up` from `factor` (after it:
        it may renormalise)."""
        scaled = self.scaled
        scaled[key] = scaled.get(key, 0.0) + up
        scaled[None] = scaled.get(None, 0.0) + up

    def value(self, key, now: float) -> float:
        up = self._up if now == self._at else self.factor(now)  # first: it may renormalise (replace) `scaled`
        return self.scaled.get(key, 0.0) / up

    def snapshot(self, now: float) -> dict:
        down = 1.0 / self.factor(now)
        return {k: v * down for k, v in self.scaled.items()}
