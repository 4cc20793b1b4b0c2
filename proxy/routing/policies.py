"""Routing policies: given the eligible healthy replicas, pick one and say why."""
from __future__ import annotations

from typing import Protocol, Sequence

from proxy.config import RoutingConfig
from proxy.parse import ParsedRequest
from proxy.routing.affinity import PrefixAffinity
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.shared import SharedState


class Policy(Protocol):
    name: str

    async def pick(self, candidates: Sequence[Backend], request: ParsedRequest, route: Route) -> tuple[Backend, str]:
        """`candidates`: the healthy replicas able to serve `route` (never empty)."""


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    async def pick(self, candidates: Sequence[Backend], request: ParsedRequest, route: Route) -> tuple[Backend, str]:
        self._next += 1
        return candidates[self._next % len(candidates)], "round-robin"


class LeastLoaded:
    """Fewest in-flight requests; ties rotate so equal replicas share the work."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._next = 0

    async def pick(self, candidates: Sequence[Backend], request: ParsedRequest, route: Route) -> tuple[Backend, str]:
        self._next += 1
        n = len(candidates)
        start = self._next % n
        best = candidates[start]
        for i in range(1, n):
            backend = candidates[(start + i) % n]
            if backend.in_flight < best.in_flight:
                best = backend
        return best, "least-loaded"


def make_policy(config: RoutingConfig, shared: SharedState | None = None) -> Policy:
    if config.policy == "prefix_affinity":
        return PrefixAffinity(config.prefix_affinity, shared)
    return RoundRobin() if config.policy == "round_robin" else LeastLoaded()
