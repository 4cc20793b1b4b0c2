"""Where a new tenant (or a growing set's next member) goes: the candidates ranked by fit
under the bound, cache room, and recent traffic plus tenants held; ties by rendezvous hashing,
which every proxy computes alike without talking."""
from __future__ import annotations

import math
from typing import Final, Mapping, Sequence

from proxy.routing.backends import Backend
from proxy.routing.affinity.load import LoadView
from proxy.routing.affinity.table import TenantTable

_MASK: Final = (1 << 64) - 1


def rendezvous_weight(key: int, salt: int) -> int:
    """A 64-bit mix of (key, replica salt): cheap, stable across processes."""
    x = ((key ^ salt) * 0x9E3779B97F4A7C15) & _MASK
    x ^= x >> 32
    x = (x * 0xD6E8FEB86659FD93) & _MASK
    return x ^ (x >> 29)


def rendezvous_order(key: int, candidates: Sequence[Backend]) -> list[Backend]:
    return sorted(candidates, key=lambda b: rendezvous_weight(key, b.salt), reverse=True)


def ranked(
    load: LoadView, table: TenantTable, candidates: Sequence[Backend], rates: list[float], flights: list[int],
    cap: float, qcap: int, pin: int, exclude: Sequence[str], grow: bool = False, avoid: Sequence[str] = (),
) -> list[tuple[tuple, float, Backend]]:
    """Every candidate as (sort key, tenants it holds, replica), best first: outside `exclude`,
    outside `avoid` (the balance guard would cap it), under the bound, (placed anew) not slower,
    with cache room, then least (load share + tenant share)."""
    n = len(candidates)
    counts: Mapping[str, float] = table.counts(load.clock)  # (float: a ramped-up replica's is the mean)
    # scored by where traffic goes now (a population that changed left the smoothed load behind)
    recent = load.recent_loads(candidates)
    mean_rate = (sum(recent) + n) / n
    if load.joined:  # a replica that joined counts as holding the mean of tenants at first, too
        ramped = dict(counts)
        load.ramp(candidates, [float(ramped.get(b.name, 0)) for b in candidates], load.clock, ramped)
        counts = ramped
    if table.placed:  # and with several proxies, the newcomers they are likely placing beside this one's
        herd = table.herd(load.proxies)
        if herd:
            counts = {name: counts.get(name, 0) + herd.get(name, 0.0) for name in set(counts) | set(herd)}
    held = sum(counts.get(b.name, 0) for b in candidates)
    mean_count = (held + n) / n
    # cache room: no replica takes more than its share of tenants' prompts (rounded up)
    slots = math.ceil((held + (0 if exclude and not grow else 1)) / n)
    weight = 0.5 if grow else 1.0
    out = []
    for i, backend in enumerate(candidates):
        fits = rates[i] + 1 <= cap and flights[i] + 1 <= qcap
        count = counts.get(backend.name, 0)
        score = (recent[i] + 1) / mean_rate + weight * (count + 1) / mean_count
        # a tenant placed anew goes to a faster replica while one fits: its first request computes
        # its prompt wherever it goes, at a fraction of the time there (the packing repair moves
        # settled tenants onto a slower replica, up to its share by speed)
        k = (backend.name in exclude, backend.name in avoid, not fits, not grow and backend.load_factor > 1.0,
             count + 1 > table.capacity(backend, slots), round(score, 6), -rendezvous_weight(pin, backend.salt))
        out.append((k, count, backend))
    out.sort(key=lambda r: r[0])
    return out
