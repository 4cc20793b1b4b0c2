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
there only a few at a time; measured on that scenario over seeds 0-6 (nine runs), 0.35 (the
default) kept more of the pooled cache bound than 0.5 on the weak shape (mean 0.954 against 0.947)
and as much on the strong one (0.964 / 0.963), with the TTFT p99 below least_loaded's in every
run; 0.25 lost share on strong. Single runs spread by ±0.02.
"""
from __future__ import annotations

import logging
from typing import Iterable, Sequence

from proxy.routing.backends import Backend

log = logging.getLogger("vllm_proxy.routing")

_SLOW = 1.5
_SAME = 1.3
_CONFIRM = 2  # readings (proxy/scrape.py: each over 2 s or more) in a row a replica must look slower (or alike again) before it counts so
_MAX = 4.0


def counted(factor: float, strength: float) -> float:
    """What one request counts as on a replica of load `factor`, at `speed_balance` `strength`."""
    return 1.0 + strength * (factor - 1.0)


def shares(candidates: Sequence[Backend], strength: float) -> list[float] | None:
    """Each candidate's part of their summed speed, times their number (1 each while all count
    alike: then None), as the balance guard and the packing repair split traffic."""
    speeds = [1.0 / counted(b.load_factor, strength) for b in candidates]
    total = sum(speeds)
    if not strength or total >= len(candidates):
        return None
    return [len(candidates) * v / total for v in speeds]


def factor(ratio: float, current: float) -> float:
    """The load factor of a replica `ratio` times slower than the fastest, now at `current`."""
    if ratio >= _SLOW or (current > 1.0 and ratio > _SAME):
        return min(max(round(ratio * 4) / 4, 1.0), _MAX)
    return 1.0


class Speeds:
    """The load factors of one fleet, set after each scrape round (`update`). Entering or leaving
    the slow state takes _CONFIRM readings in a row: one reading over a busy moment (a stalled
    process, a burst of long contexts) is no speed. A round that brings no new reading of a
    replica (its span is still short: proxy/scrape.py) neither confirms nor breaks its streak."""

    def __init__(self) -> None:
        self._streak: dict[str, int] = {}  # backend -> readings in a row it looked slow / alike against its state
        self._counted: dict[str, float | None] = {}  # backend -> the reading its streak counted last

    def update(self, backends: Iterable[Backend]) -> None:
        """Set each backend's `load_factor` from the latest decode times; `Backend.speed_version`
        moves on when any changed, for the parts that cache them."""
        groups: dict[frozenset[str], list[Backend]] = {}
        for backend in backends:
            groups.setdefault(backend.models, []).append(backend)
        changed = False
        for group in groups.values():
            times = [b.itl_s for b in group if b.healthy and b.itl_s]
            fastest = min(times) if len(times) > 1 else None
            for b in group:
                ratio = b.itl_s / fastest if fastest and b.healthy and b.itl_s else 1.0
                new = factor(ratio, b.load_factor) if b.healthy else 1.0
                if (new > 1.0) != (b.load_factor > 1.0) and b.healthy:  # a change of state: confirm it
                    if b.itl_s is not None and self._counted.get(b.name) == b.itl_s:
                        continue  # the reading it already counted (no reading at all counts each round)
                    self._counted[b.name] = b.itl_s
                    streak = self._streak[b.name] = self._streak.get(b.name, 0) + 1
                    if streak < _CONFIRM:
                        continue
                self._streak.pop(b.name, None)
                self._counted.pop(b.name, None)
                if new != b.load_factor:
                    log.info("replica %s decodes %.2fx slower than the fastest: one request counts %.2f in the "
                             "balance", b.name, ratio, new)
                    b.load_factor = new
                    changed = True
        if changed:
            Backend.speed_version += 1
