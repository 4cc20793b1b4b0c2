"""`prefix_affinity`: send a request where its prefix is cached, without overloading anyone.

1. Follow the longest known prefix match when it reaches past the pinned (system) part,
   i.e. a conversation continues where its earlier turns were computed.
2. Otherwise place the pin key by rendezvous (highest-random-weight) hashing: every proxy
   process computes the same order of replicas for a key, with no coordination, and adding or
   removing a replica moves only the keys that must move.
3. Never let a replica go above ceil((1 + epsilon) x mean load) of the eligible set (consistent
   hashing with bounded loads, Mirrokni et al. 2017): walk the key's rendezvous order to the
   first replica under the bound, so a hot prefix spreads over the fewest replicas that carry it.
Load = this process's in-flight requests plus other proxies' (from the shared view).
"""
from __future__ import annotations

import math
import time
from typing import Sequence

from proxy.config import AffinityConfig
from proxy.parse import CHAT, ParsedRequest
from proxy.prefix import prefix_key
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.index import PrefixIndex
from proxy.shared import SharedState

_MASK = (1 << 64) - 1


def rendezvous_weight(key: int, salt: int) -> int:
    """A 64-bit mix of (key, replica salt): cheap, stable across processes."""
    x = ((key ^ salt) * 0x9E3779B97F4A7C15) & _MASK
    x ^= x >> 32
    x = (x * 0xD6E8FEB86659FD93) & _MASK
    return x ^ (x >> 29)


def rendezvous_order(key: int, candidates: Sequence[Backend]) -> list[Backend]:
    return sorted(candidates, key=lambda b: rendezvous_weight(key, b.salt), reverse=True)


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, config: AffinityConfig, shared: SharedState | None = None) -> None:
        self.config = config
        self.index = PrefixIndex(config.index_blocks_per_backend)
        self.shared = shared

    def load(self, backend: Backend) -> int:
        remote = self.shared.remote_load.get(backend.name, 0) if self.shared is not None else 0
        return backend.in_flight + remote

    async def pick(self, candidates: Sequence[Backend], request: ParsedRequest, route: Route) -> tuple[Backend, str]:
        if request.endpoint not in (CHAT, "/v1/completions"):
            return min(candidates, key=self.load), "least-loaded"
        cfg = self.config
        key = prefix_key(request.endpoint == CHAT, request.data, route.upstream_id, cfg.block_chars, cfg.max_blocks)
        match = None
        if self.shared is not None:
            match = await self.shared.longest(key.chain)
        if match is None:
            match = self.index.longest(key.chain)
        chosen, reason = self._choose(candidates, key.pin, key.pin_blocks, match)
        stale = self.index.record(key.chain, chosen.name, time.monotonic(), cfg.shared_ttl_s)
        if self.shared is not None and stale:
            self.shared.remember(stale, chosen.name)
        return chosen, reason

    def _choose(
        self, candidates: Sequence[Backend], pin: int, pin_blocks: int, match: tuple[int, str | None]
    ) -> tuple[Backend, str]:
        loads = [self.load(b) for b in candidates]
        cap = math.ceil((1.0 + self.config.epsilon) * (sum(loads) + 1) / len(candidates))
        matched, owner = match
        if owner is not None and matched > pin_blocks:
            for backend, load in zip(candidates, loads):
                if backend.name == owner:
                    if load + 1 <= cap:
                        return backend, "prefix-hit"
                    break
        order = sorted(range(len(candidates)), key=lambda i: rendezvous_weight(pin, candidates[i].salt), reverse=True)
        for rank, i in enumerate(order):
            if loads[i] + 1 <= cap:
                return candidates[i], "pinned" if rank == 0 else "spill"
        return candidates[order[0]], "pinned"  # unreachable: the bound always leaves room
