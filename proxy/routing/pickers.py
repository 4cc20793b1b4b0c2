"""Pickers: one candidate from the scorers' weighted sums."""
from __future__ import annotations

from typing import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from proxy.parse import ParsedRequest
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.plugins import Picker, register


class PickParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str = Field("scored", min_length=1, description="the route reason (metrics, explain header) of its picks")


class Rotating(Picker):
    """A picker with a rotating start (ties, turns) and a configured route reason."""

    def __init__(self, params, env) -> None:
        super().__init__(params, env)
        self.reason = params.reason
        self._next = 0


@register
class MaxScore(Rotating):
    """The highest sum; ties rotate, so equal replicas share the work."""

    name = "max_score"
    Params = PickParams

    def choose(self, candidates: Sequence[Backend], totals: list[float] | None) -> int:
        self._next += 1
        n = len(candidates)
        best = self._next % n
        if totals is None:
            return best
        top = totals[best]
        for i in range(best + 1, best + n):
            j = i % n
            if totals[j] > top:
                best, top = j, totals[j]
        return best

    async def pick_lowest(self, key: Callable[[Backend], float], candidates: Sequence[Backend], request: ParsedRequest,
                          route: Route) -> tuple[Backend, str]:
        """The pick step for a scorer alone in its profile that gives its order as a key (lower is
        better): what `choose` would pick, without summing scores."""
        self._next += 1
        start = self._next % len(candidates)
        # the first lowest from the rotating start (min keeps the first of equals)
        rotated = candidates[start:] + candidates[:start] if start else candidates
        return min(rotated, key=key), self.reason


class RoundRobinParams(PickParams):
    reason: str = Field("round-robin", min_length=1, description="the route reason of its picks")


@register
class RoundRobin(Rotating):
    """Each candidate in turn, whatever the scores."""

    name = "round_robin"
    Params = RoundRobinParams

    def choose(self, candidates: Sequence[Backend], totals: list[float] | None) -> int:
        self._next += 1
        return self._next % len(candidates)

    async def pick(self, candidates: Sequence[Backend], request: ParsedRequest, route: Route) -> tuple[Backend, str]:
        self._next += 1  # (`choose`, inlined: this runs on every request of a round_robin profile)
        return candidates[self._next % len(candidates)], self.reason
