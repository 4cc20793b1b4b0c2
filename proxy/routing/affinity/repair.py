"""The packing repair of `prefix_affinity`, run in the background.

Every `rebalance_every_requests` (sooner after a spill or a fleet change) a request marks the
repair due; `run_due` (from `serve`, the loop the runtime's task supervisor runs, or from a
caller that wants it now, like the offline benchmarks) applies up to two changes planned by proxy/routing/packing.py. With Redis
one proxy at a time plans (a lease it renews, so a single estimate of the tenants' shares decides
and proxies never undo each other's moves) and writes by compare-and-set on the shared table.
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable, Sequence

from proxy.config import AffinityConfig
from proxy.routing.backends import Backend
from proxy.routing.speed import shares
from proxy.routing.packing import Layout, Packing
from proxy.routing.affinity.load import LoadView
from proxy.routing.affinity.store import TenantStore
from proxy.routing.affinity.table import TenantTable
from proxy.routing.affinity.tenants import TenantStats

log = logging.getLogger("vllm_proxy.affinity")

_SPILL_REPAIR = 40.0  # a spill or a fleet change brings the repair forward to at most this many requests away
_MIN_ROOM = 0.05  # least part of a cache counted as room for prompts
_SETTLED = 12.0  # requests of a tenant (decayed, over all proxies) before the repair trusts its share
# the same while the fleet's caches keep fewer prompts than it has tenants (`TenantTable.crowded`):
# there a light tenant's prompt is mostly evicted between its requests, so moving it costs little,
# and only moving light tenants evens the prompts per cache without moving the traffic (at 12 the
# repair could move only the heavy ones; offline, the random sequences' seeds 4-35: 17 cells up by
# more than 0.005 of the bound, 3 down; the weak replay's seeds 8-15 0.9704 -> 0.9730; docs/BENCHMARKS.md)
_CROWDED_SETTLED = 1.0
_COUNTED_MIN = 100.0  # decisions in this proxy's windows below which a newcomer's part of them is noise (`shares`)
_SLOWER_HELD = 0.9  # most prompts a slower replica's fair part holds, in parts of what its cache keeps


def slower_held(fair: list[float], sizes: list[float], candidates: Sequence[Backend],
                capacity: Callable[[Backend, float], float]) -> list[float]:
    """The fair parts with a slower replica's at most _SLOWER_HELD of the prompts its cache keeps
    (`TenantTable.capacity`), the rest over the others by size. A prompt evicted there between its
    tenant's requests comes back as a cold prefill at k times the time, the TTFT p99 of the
    heterogeneous scenario: its light tenants went cold, moved off at that miss (placement's
    `_off_slower`) and the repair refilled it with others. Holding fewer, the load term fills it
    with hotter tenants, whose prompts stay cached. Replayed over seeds 0-15 of the weak shape
    (`loadtest.affinity_replay --slow-replicas 1`), share mean / worst and cold prompts on the slow
    replica a run: 1 (no cap) 0.9725 / 0.960, 42; 0.9 0.9711 / 0.961, 39; 0.8 0.9704 / 0.961, 34; 0.65
    0.9631 / 0.951, 28. Live (docs/BENCHMARKS.md) 0.9 kept every weak seed >= 0.963 of the bound,
    0.65 one at 0.9499, with the TTFT p99 13-38 ms under least_loaded's at 0.9 and at 0.65 alike."""
    held = [min(f, _SLOWER_HELD * capacity(b, f)) if b.load_factor > 1.0 else f
            for f, b in zip(fair, candidates)]
    spare = sum(fair) - sum(held)
    rest = sum(size for size, b in zip(sizes, candidates) if b.load_factor <= 1.0)
    if spare <= 0 or rest <= 0:
        return fair
    return [h + (spare * size / rest if b.load_factor <= 1.0 else 0.0) for h, size, b in zip(held, sizes, candidates)]


class Repair:
    def __init__(self, config: AffinityConfig, load: LoadView, tenants: TenantStats, table: TenantTable,
                 store: TenantStore, wall: Callable[[], float],
                 recent: Callable[[], tuple[dict[int, float], float]] | None = None) -> None:
        """`recent`: each tenant's count among this proxy's last decisions, and all of them (the
        balance guard's windows, `Balance.recent_counts`): see `shares`."""
        self.config = config
        self.recent = recent
        self.load = load
        self.tenants = tenants
        self.table = table
        self.store = store
        self.next_at = 0.0  # clock at which the next repair is due
        self.due: tuple[list[Backend], float] | None = None  # (candidates, clock) of the repair to run
        self.running = False
        self._wake = asyncio.Event()
        self._wall = wall

    def check(self, candidates: Sequence[Backend], now: float) -> None:
        """On every request: mark the repair due when its time came and none is pending or running."""
        if now >= self.next_at and self.due is None and not self.running:
            self.next_at = now + self.config.rebalance_every_requests
            self.due = (list(candidates), now)
            self._wake.set()

    def soon(self, now: float) -> None:
        """A spill or a fleet change: repair within _SPILL_REPAIR requests."""
        self.next_at = min(self.next_at, now + _SPILL_REPAIR)

    async def run_due(self) -> None:
        """Run the repair marked due, if any."""
        due, self.due = self.due, None
        self._wake.clear()
        if due is None:
            return
        self.running = True
        try:
            await self.run(*due)
        finally:
            self.running = False

    async def serve(self) -> None:
        """Run due repairs until cancelled: the body of the task the runtime's supervisor runs."""
        while True:
            await self._wake.wait()
            try:
                await self.run_due()
            except Exception:  # never let the loop die
                log.exception("packing repair failed")

    async def run(self, candidates: Sequence[Backend], now: float) -> None:
        """Apply `plan`'s changes, as the one proxy holding the lease."""
        cfg, store, table = self.config, self.store, self.table
        if not self.tenants.warm(now) or not store.up:
            return
        if not await store.lease("repair", max(3 * cfg.rebalance_every_requests / self.load.rate, 1.0)):
            return
        share = await self.shares(now)
        for pin, old, new in self.plan(candidates, now, share):
            left = next(m for m in old if m not in new)
            log.info("packing repair: tenant %016x (share %.3f) %s -> %s%s", pin, share(pin), left,
                     next(m for m in new if m not in old), f" (its set is now {','.join(new)})" if len(new) > 1 else "")
            table.came_from[pin] = (left, now)
            if store.change(pin, old, new) is not None:
                table.changed_by_store(pin, now, restart=len(old) == 1)

    async def shares(self, now: float) -> Callable[[int], float]:
        """The weight of each tenant's traffic in the plan: its share over all proxies (this
        proxy's rates and the others' published ones), weighed down as it falls silent
        (`presence`). With the balance guard, once this proxy's windows hold _COUNTED_MIN
        decisions, a tenant that arrived within a few hundred requests weighs its part of them
        instead: its rate, counted since it appeared, makes one request in ten since then 10 % of
        the traffic. After a new population of 80 small tenants the weights summed to 1.3-3.6
        of the traffic, and the repair moved tenants onto the replicas the cap held back
        (`loadtest.affinity_drift --sequence small --offline`, 32 seeds: the later populations
        0.972 of the pooled bound on average, 24 of 64 phases under 0.97, against 0.979 and 9
        with the recent loads' restart: docs/BENCHMARKS.md)."""
        tenants = self.tenants
        rate = tenants.fleet_share(now, await self.store.other_tenants())
        counts, decided = self.recent() if self.recent is not None else ({}, 0.0)
        counted = decided >= _COUNTED_MIN

        def share(pin: int) -> float:
            if counted and tenants.young(pin, now):
                return counts.get(pin, 0.0) / decided
            return rate(pin) * tenants.presence(pin, now)

        return share

    def plan(self, candidates: Sequence[Backend], now: float,
             share=None) -> list[tuple[int, tuple[str, ...], tuple[str, ...]]]:
        """The packing repair's changes (proxy/routing/packing.py) for the current table, with
        `share(pin)` the weight of the tenant's traffic (`shares`; default: its share of this
        proxy's, by its rate and presence). Idle tenants are left out: they neither hold cache
        room nor carry traffic. A member of a multi-replica
        set may move only while some replica runs markedly slower: on replicas alike its members
        are interchangeable (the water-fill evens them out), and replacing one only costs misses
        (on the drift benchmark's popularity swap it raised max/mean from 1.03-1.08 to 1.09-1.12)."""
        tenants, table, cfg = self.tenants, self.table, self.config
        share_of = share or (lambda p: tenants.current(p, now) * tenants.presence(p, now))
        n = len(candidates)
        where = {b.name: i for i, b in enumerate(candidates)}
        counts, fixed = [0] * n, [0.0] * n
        flex: list[tuple[float, list[int]]] = []
        singles: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        hold = now - cfg.move_after_requests
        wall = self._wall()
        hold_wall = wall - cfg.move_after_requests / self.load.rate
        changed, proxies = table.changed, self.load.proxies
        movable: list[tuple[float, int, tuple[int, ...]]] = []
        speed = shares(candidates, cfg.speed_balance)
        least = _CROWDED_SETTLED if table.crowded(candidates, now) else _SETTLED
        for pin, (members, stamp) in table.pins.items():
            inside = [where[m] for m in members if m in where]
            if not inside or tenants.idle(pin, now, wall):
                continue
            weight = share_of(pin)
            for i in inside:
                counts[i] += 1
            settled = (stamp < hold_wall and changed.get(pin, -math.inf) < hold
                       and tenants.rate.value(pin, now) * proxies >= least)
            if len(inside) > 1:
                moved = table.came_from.get(pin)
                if speed and settled and len(inside) == len(members) and (moved is None or moved[1] < hold):
                    # one of its members may move (its set's cool-down runs on: came_from holds it)
                    movable.append((weight, pin, tuple(inside)))
                else:
                    flex.append((weight, inside))
                continue
            fixed[inside[0]] += weight
            if len(members) == 1 and settled:
                singles[inside[0]].append((weight, pin))
        for side in singles:
            side.sort()
        # each replica's fair part of the prompts (by cache size), and how much a deviation from it
        # matters: fully once its prompts would fill `cache_fill` of the cache, less when they fit easily
        sizes = [b.cache_tokens or 0 for b in candidates]
        if not all(sizes):
            sizes = [1.0] * n
        if speed:  # a replica taking less traffic holds fewer conversations: more room for prompts
            # (floored: a replica whose conversations alone would fill its cache still gets a few)
            sizes = [size * max(_MIN_ROOM, 1.0 - (1.0 - cfg.cache_fill) * part) for size, part in zip(sizes, speed)]
        whole = sum(sizes)
        fair = [sum(counts) * size / whole for size in sizes]
        if speed:
            fair = slower_held(fair, sizes, candidates, table.capacity)
        pressure = [min(1.0, fair[i] / max(table.capacity(b, fair[i]), 1e-9)) for i, b in enumerate(candidates)]
        packing = Packing(fair, pressure, (1.0 + cfg.epsilon / 2) / n, flex, speed)
        undo = now - cfg.cool_down_requests
        banned = frozenset((pin, where[name]) for pin, (name, at) in table.came_from.items()
                           if at > undo and name in where)
        names = [b.name for b in candidates]
        layout = Layout(counts, fixed, singles, banned, tuple(movable))
        moves = packing.plan(layout)
        if moves:
            log.debug("packing repair: tenants per replica %s (fair %s), traffic %s", counts,
                      [round(f, 1) for f in fair], [round(x, 3) for x in packing.loads(fixed, layout.flex)])
        plan = []
        for _, pin, a, b in moves:
            old = table.pins[pin][0]  # (a moved tenant's one replica, or the whole set: a member is replaced in place)
            plan.append((pin, old, tuple(names[b] if m == names[a] else m for m in old)))
        return plan
