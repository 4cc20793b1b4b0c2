"""How much slower each replica decodes than the fastest serving the same models, for the
balance of `prefix_affinity` (`routing.prefix_affinity.speed_balance`).

A count balance gives a replica half as fast a full share of the requests: its batch runs twice
as long, its queue builds and its cache misses cost twice the prefill (the heterogeneous-fleet
scenario of loadtest/affinity.py). Each replica's own decode time per token (`Backend.itl_s`,
scraped from its /metrics, so it covers every proxy's traffic) against the fastest's gives its
`load_factor`, k for a replica k times slower. Identical GPUs differ by some percent (batch
sizes, context lengths, noise): a replica counts 1 until it is _SLOW times slower, and again
once it is back within _SAME; factors are rounded to quarters, at most _MAX.

What one request to it counts as in the load bound, the balance guard and the packing repair is
`counted`: 1 + speed_balance x (k - 1). Fully (speed_balance 1) a replica half as fast takes 1/7
of four replicas' requests and leaves most of its cache to cold tenants the packing repair moves
there only a few at a time; measured on that scenario, half (the default) kept the share of the
pooled cache bound of the count balance and still took the TTFT p99 below least_loaded's.
"""
from __future__ import annotations

import logging
from typing import Iterable

from proxy.routing.backends import Backend

log = logging.getLogger("vllm_proxy.routing")

_SLOW = 1.25
_SAME = 1.15
_MAX = 4.0


def factor(ratio: float, current: float) -> float:
    """The load factor of a replica `ratio` times slower than the fastest, now at `current`."""
    if ratio >= _SLOW or (current > 1.0 and ratio > _SAME):
        return min(max(round(ratio * 4) / 4, 1.0), _MAX)
    return 1.0


def counted(factor: float, strength: float) -> float:
    """What one request counts as on a replica of load `factor`, at `speed_balance` `strength`."""
    return 1.0 + strength * (factor - 1.0)


def update(backends: Iterable[Backend]) -> None:
    """Set each backend's `load_factor` from the latest decode times (after a scrape round);
    `Backend.speed_version` moves on when any changed, for the parts that cache them."""
    groups: dict[frozenset[str], list[Backend]] = {}
    for backend in backends:
        groups.setdefault(backend.models, []).append(backend)
    changed = False
    for group in groups.values():
        times = [b.itl_s for b in group if b.healthy and b.itl_s]
        fastest = min(times) if len(times) > 1 else None
        for b in group:
            new = factor(b.itl_s / fastest, b.load_factor) if fastest and b.healthy and b.itl_s else 1.0
            if new != b.load_factor:
                log.info("replica %s decodes %.2fx slower than the fastest: one request counts %.2f in the balance",
                         b.name, b.itl_s / fastest if fastest and b.itl_s else 1.0, new)
                b.load_factor = new
                changed = True
    if changed:
        Backend.speed_version += 1
