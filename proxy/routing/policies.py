"""Routing policies: given the eligible healthy replicas, pick one and say why."""
from __future__ import annotations

from typing import Protocol, Sequence

from proxy.parse import ParsedRequest
from proxy.routing.backends import Backend


class Policy(Protocol):
    name: str

    def pick(self, candidates: Sequence[Backend], request: ParsedRequest) -> tuple[Backend, str]: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[Backend], request: ParsedRequest) -> tuple[Backend, str]:
        self._next += 1
        return candidates[self._next % len(candidates)], "round-robin"


class LeastLoaded:
    """Fewest in-flight requests; ties rotate so equal replicas share the work."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[Backend], request: ParsedRequest) -> tuple[Backend, str]:
        self._next += 1
        n = len(candidates)
        start = self._next % n
        best = candidates[start]
        for i in range(1, n):
            backend = candidates[(start + i) % n]
            if backend.in_flight < best.in_flight:
                best = backend
        return best, "least-loaded"


POLICIES: dict[str, type[RoundRobin] | type[LeastLoaded]] = {p.name: p for p in (RoundRobin, LeastLoaded)}


def make_policy(name: str) -> Policy:
    return POLICIES[name]()
