"""The decision of `prefix_affinity` for one request: continuation, the tenant's set, growth,
shrinking, re-homing, a new tenant's placement (see proxy/routing/affinity/__init__.py)."""
from __future__ import annotations

import logging
import math
from typing import Callable, Final, Sequence

from proxy.config import AffinityConfig
from proxy.routing.backends import Backend
from proxy.routing.affinity.balance import Balance
from proxy.routing.affinity.load import LoadView
from proxy.routing.affinity.ranking import ranked, rendezvous_order
from proxy.routing.affinity.store import TenantStore
from proxy.routing.affinity.table import TenantTable
from proxy.routing.affinity.tenants import TenantStats

log: Final = logging.getLogger("vllm_proxy.affinity")

_OVERFLOW_GROW: Final = 0.75  # a tenant over the balance cap grows when its share x replicas is this much of its set,
# or this many times over the part of the overflow replica's cache its prompt takes, if less (`overflowed`)
_OVERFLOW_ROOM: Final = 4.0
# a tenant on several replicas, all at or over the mean, grows by one outside its set that took
# under this part of the mean over the last quarter load window (`_light`)
_LIGHT: Final = 0.75
_LIGHT_MIN: Final = 10.0  # requests a replica in that window before "light" means anything


class Placement:
    def __init__(self, config: AffinityConfig, load: LoadView, tenants: TenantStats, table: TenantTable,
                 store: TenantStore, spilled: Callable[[float], None], balance: Balance | None = None) -> None:
        self.config = config
        self.balance = balance  # the guard: a new tenant is placed where it would not cap its first request
        # read on every request: typed
        self.continuation_slack: float = config.continuation_slack
        self.cool_down_requests: float = config.cool_down_requests
        self.grow_fill: float = config.grow_fill
        self.load = load
        self.tenants = tenants
        self.table = table
        self.store = store
        self.spilled = spilled  # a spill brings the packing repair forward
        self.returning = False  # the tenant of the request being routed was idle until now
        # (old set, new set, reason) for `change`: a set change the store must accept first
        self._growing: tuple[tuple[str, ...], tuple[str, ...], str] = ((), (), "")
        self._filled: dict[str, float] = {}

    def decide(self, route: str, candidates: Sequence[Backend], where: dict[str, int], pin: int, pin_blocks: int,
               match: tuple[int, str | None], now: float, wall: float) -> tuple[Backend, str]:
        chosen, reason = self._choose(route, candidates, where, pin, pin_blocks, match, now, wall)
        if reason == "place":
            return self._place(candidates, pin, chosen, now)
        if reason == "grow":
            return self._change(candidates, pin, chosen, now)
        return chosen, reason

    def _choose(self, route: str, candidates: Sequence[Backend], where: dict[str, int], pin: int, pin_blocks: int,
                match: tuple[int, str | None], now: float, wall: float) -> tuple[Backend, str]:
        n = len(candidates)
        rates, flights, mean, cap, qcap = self.load.bounds(candidates, now)
        matched, owner = match
        entry = self.table.pins.get(pin)
        if entry is not None and not entry[0]:
            entry = None
        # a continuation follows its conversation only while that replica is one of its tenant's:
        # after the tenant moved (or this conversation spilled) it goes where the tenant's prompt
        # is, recomputing its own turns once, rather than keep the prompt alive in a second cache
        # for as long as its conversations last
        if owner is not None and matched > pin_blocks and (entry is None or owner in entry[0]):
            i = where.get(owner)
            if i is not None:
                # (before warm-up, as for a tenant's own replicas below, only a real queue stops it)
                loose = cap + self.continuation_slack * mean if self.tenants.warm(now) else math.inf
                if rates[i] + 1 <= loose and flights[i] + 1 <= qcap:
                    return candidates[i], "prefix-hit"

        if entry is None:
            full = self.balance.full(route, self.load.proxies) if self.balance is not None else ()
            return ranked(self.load, self.table, candidates, rates, flights, cap, qcap, pin, (), avoid=full)[0][2], "place"
        members, stamp = entry
        here = []  # its replicas among the candidates (a loop: a comprehension costs a call here)
        for name in members:
            i = where.get(name)
            if i is not None:
                here.append(i)
        if matched < pin_blocks and len(here) == 1 and candidates[here[0]].load_factor > 1.0:
            moved = self._off_slower(candidates, rates, flights, cap, qcap, pin, members, candidates[here[0]], now)
            if moved is not None:
                return moved
        # among its replicas, the one with the least traffic now (the smoothed load lags behind a
        # set that just changed, and would send it all to the newest member for a while)
        now_load = self.load.recent_loads(candidates) if len(here) > 1 else rates
        if self.returning or len(here) < len(members):
            # an idle tenant came back, or a replica of its set left: place it anew (keeping the
            # replicas it has that still have room), and never back onto a replica that left
            return self._rehome(candidates, rates, flights, cap, qcap, pin, members, here, now)
        best = -1
        for i in here:
            if rates[i] + 1 <= cap and flights[i] + 1 <= qcap and (best < 0 or now_load[i] < now_load[best]):
                best = i
        self.table.refresh(pin, members, stamp, wall, now)
        if best >= 0 and len(here) > 1 and len(members) < n:
            light = self._light(candidates, rates, flights, cap, qcap, now_load, members, best, pin, now)
            if light is not None:
                return self._propose(pin, members, members + (light.name,), light, "pinned")
        if best >= 0:
            # a tenant whose own traffic needs another replica grows now, not once the smoothed
            # load of its replicas has caught up with it (half a load window later)
            if len(members) < n and self.tenants.may_grow(pin, len(members), n, now):
                chosen = self._best(candidates, rates, flights, cap, qcap, pin, members, grow=True)
                if chosen.name not in members and rates[where[chosen.name]] + 1 <= cap:
                    return self._propose(pin, members, members + (chosen.name,), chosen, "pinned")
            if len(members) > 1:
                self._maybe_shrink(pin, members, n, now)
            return candidates[best], "pinned"
        # A tenant grows only when its own traffic needs more replicas than it has (a copy of its
        # prompt elsewhere costs misses and cache space) and once enough history says so: while
        # warming up, or when others' traffic makes its replicas busy, it stays on them up to the
        # looser (continuation) bound, beyond that single requests spill without changing its set.
        if not self.tenants.may_grow(pin, len(members), n, now):
            # before warm-up ends (shares unknown) only a real queue makes it spill: a spilled
            # conversation copies the prompt elsewhere and its later turns stay there
            hard = cap + self.continuation_slack * mean if self.tenants.warm(now) else math.inf
            for i in here:
                if rates[i] + 1 <= hard and flights[i] + 1 <= qcap and (best < 0 or now_load[i] < now_load[best]):
                    best = i
            if best >= 0:
                return candidates[best], "pinned"
            # a spilled conversation copies the prompt and stays where it went: the packing
            # repair should look at this soon rather than at its next period
            self.spilled(now)
            return self._spill(route, candidates, where, rates, flights, cap, qcap, pin, members, now)
        # every member is over the bound: grow the set by the best other replica
        chosen = self._best(candidates, rates, flights, cap, qcap, pin, members, grow=True)
        return self._propose(pin, members, members + (chosen.name,), chosen, "spill")

    def _light(self, candidates: Sequence[Backend], rates: list[float], flights: list[int], cap: float, qcap: int,
               now_load: list[float], members: tuple[str, ...], best: int, pin: int, now: float) -> Backend | None:
        """A replica outside this tenant's set that took under _LIGHT of the mean over the last
        quarter load window while every member took the mean or more, if the tenant's traffic can
        make up the difference: its set grows by it (each replica once a quarter load window, so
        tenants do not pile onto it together). Such a replica holds light tenants only: the guard
        caps nobody (the others stay within its cap) and nothing else pulls traffic to it, so the
        others ran at 1.05-1.1x the mean all phase; in the drift benchmark's phases over 1.10
        max/mean a replica outside the hot tenant's set ran at 0.5-0.9 of the mean. Three proxies
        at 10x the rate (loadtest.affinity_drift --sequence random, seeds 0-31): phases over 1.10
        28 and 28 -> 9 and 14 of 192, share +0.0003 to +0.0015; one proxy 11 -> 8; at 1x and 0.1x
        the rate 10 -> 8 of 96 and 3 -> 1 of 24 (docs/BENCHMARKS.md). It buys balance with cache
        where the guard would have allowed more: the fresh-start cell of 12 tenants, 600 requests,
        one proxy, max/mean 1.098 -> 1.060 for -0.012 of the bound (within noise at 3000 requests).
        At 0.8 of the mean a tenant between the growth and shrink thresholds regrew on chance
        once a cool-down (`_maybe_shrink` drops what it added)."""
        total = 0.0
        for v in now_load:
            total += v
        n = len(candidates)
        mean = total / n
        if total < _LIGHT_MIN * n or now_load[best] < mean or not self.tenants.warm(now):
            return None
        j = -1
        for i, b in enumerate(candidates):
            if (b.name not in members and rates[i] + 1 <= cap and flights[i] + 1 <= qcap
                    and (j < 0 or now_load[i] < now_load[j])):
                j = i
        if j < 0 or now_load[j] >= _LIGHT * mean:
            return None
        light = candidates[j]
        if now - self._filled.get(light.name, -math.inf) < self.config.load_window_requests / 4:
            return None
        if self.tenants.current(pin, now) * total < mean - now_load[j]:
            return None
        if len(self._filled) > 1024:  # (replicas come and go over weeks: keep it bounded)
            self._filled.clear()
        self._filled[light.name] = now
        log.info("tenant %016x fills the light replica %s", pin, light.name)
        return light

    def _rehome(
        self, candidates: Sequence[Backend], rates: list[float], flights: list[int], cap: float, qcap: int,
        pin: int, members: tuple[str, ...], here: list[int], now: float,
    ) -> tuple[Backend, str]:
        """The set of a tenant that came back from idle, or lost a replica: the members still
        present that have load and cache room left, else the best replica for a new tenant."""
        table = self.table
        if here and not self.returning:  # a replica left: the others stay as they are
            room = here
        else:
            counts = table.counts(self.load.clock)
            slots = math.ceil((sum(counts.get(b.name, 0) for b in candidates) + 1) / len(candidates))
            room = [i for i in here if rates[i] + 1 <= cap and flights[i] + 1 <= qcap
                    and counts.get(candidates[i].name, 0) + 1 <= table.capacity(candidates[i], slots)]
        if room:
            chosen = candidates[min(room, key=rates.__getitem__)]
            keep = tuple(candidates[i].name for i in room)
        else:
            chosen = self._best(candidates, rates, flights, cap, qcap, pin, ())
            keep = (chosen.name,)
        if keep == members:
            return chosen, "pinned"
        log.info("tenant %016x %s: %s -> %s", pin, "returns" if self.returning else "lost a replica",
                 ",".join(members), ",".join(keep))
        return self._propose(pin, members, keep, chosen, "pinned")

    def _off_slower(
        self, candidates: Sequence[Backend], rates: list[float], flights: list[int], cap: float, qcap: int,
        pin: int, members: tuple[str, ...], slow: Backend, now: float,
    ) -> tuple[Backend, str] | None:
        """A tenant on a slower replica whose prompt no replica holds any more (evicted, as the
        index sized like that cache says) moves to a faster one: the prefill it needs anyway
        costs a fraction there, and a move at a miss costs no second one. Such cold prompts on
        the slow replica were the TTFT p99 of the heterogeneous scenario (3.5-4 % of all
        requests, each twice the prefill); the slow replica keeps the tenants its cache holds,
        and the packing repair may not move this one back for cool_down_requests."""
        slower = [b.name for b in candidates if b.load_factor >= slow.load_factor]
        chosen = self._best(candidates, rates, flights, cap, qcap, pin, slower)
        if chosen.load_factor >= slow.load_factor:
            return None
        self.table.came_from[pin] = (slow.name, now)
        log.info("tenant %016x: its prompt left the slower replica %s; it moves to %s", pin, slow.name, chosen.name)
        return self._propose(pin, members, (chosen.name,), chosen, "pinned")

    def _propose(self, pin: int, old: tuple[str, ...], new: tuple[str, ...], chosen: Backend,
                 reason: str) -> tuple[Backend, str]:
        """Change a tenant's set through the store (`_change`: with Redis a compare-and-set, so
        proxies changing one tenant at once agree), or not at all while it is down (this request
        still goes to `chosen`)."""
        if self.store.up:
            self._growing = (old, new, reason)
            return chosen, "grow"
        return chosen, "spill"

    def _spill(self, route: str, candidates: Sequence[Backend], where: dict[str, int], rates: list[float],
               flights: list[int], cap: float, qcap: int, pin: int, members: tuple[str, ...],
               now: float) -> tuple[Backend, str]:
        """Where a request of a tenant whose replicas are all over the bound goes: where it
        spilled last (at this proxy, else where it spilled or overflowed at any proxy: the balance
        guard's memory, published with its overflows) while that replica is under the bound, so its
        prompt is cached in one more place; else the best replica outside its set. Sent each time
        to the best replica of the moment, a tenant that spilled three times or more did so onto
        2.1-2.2 replicas, each a cold prompt: after a popularity rotation the new hot tenants,
        before their sets grew. Three proxies at concurrency 64 (loadtest.affinity_drift --sequence
        random, the two variants interleaved): spills lost 0.42 % of the pooled bound against 0.33 %
        (1.5 replicas a tenant), share 0.9782 -> 0.9795, worst cell 0.902 -> 0.934 (seeds 0-15, 10x
        the rate); at 1x 0.9756 -> 0.9782 (seeds 0-5). Offline (one proxy) the same within 0.0005.
        A tenant that spills there again grows by that replica when even the low end of its share
        (`TenantStats.surely`) pays for the copy, as one the guard overflows twice does (`overflowed`):
        until then a new hot tenant (after a popularity rotation, before `may_grow`'s evidence for a
        fuller set came in) spilled request after request, and was moved whole.
        Offline (one proxy, deterministic), rotations in 60 tenants, seeds 0-47: 0.9791 -> 0.9822 of
        the pooled bound, cells under 0.97 12 -> 7; the settled population 0.9838 -> 0.9857, 3 -> 1;
        random sequences (seeds 0-63) 0.9856 -> 0.9861 (docs/BENCHMARKS.md)."""
        balance = self.balance
        last = balance.spilled_to(route, pin) if balance is not None else None
        i = where.get(last, -1) if last is not None else -1
        if i >= 0 and last not in members and rates[i] + 1 <= cap and flights[i] + 1 <= qcap:
            there = candidates[i]
            n = len(candidates)
            if self.store.up and self.tenants.surely(pin, now, self._copy_pays(there) * len(members) / n):
                return self._propose(pin, members, members + (there.name,), there, "spill")
            return there, "spill"
        chosen = self._best(candidates, rates, flights, cap, qcap, pin, members, grow=True)
        if balance is not None:
            balance.spilled(route, pin, chosen.name)
        return chosen, "spill"

    def _best(
        self, candidates: Sequence[Backend], rates: list[float], flights: list[int], cap: float, qcap: int,
        pin: int, exclude: Sequence[str], grow: bool = False,
    ) -> Backend:
        """The replica for a new placement: under the bound, least (load share + tenant share),
        ties by rendezvous order; outside `exclude` when possible."""
        return ranked(self.load, self.table, candidates, rates, flights, cap, qcap, pin, exclude, grow)[0][2]

    def _place(self, candidates: Sequence[Backend], pin: int, chosen: Backend, now: float) -> tuple[Backend, str]:
        """A new tenant, on `chosen` unless another proxy placed it first: then where the shared
        table says. Rendezvous order while it is down."""
        members = self.store.place(pin, chosen.name)
        if members is None:
            return self._rendezvous(candidates, pin, now)
        self.table.changed[pin] = now
        if chosen.name not in members:
            for backend in candidates:
                if backend.name in members:
                    return backend, "pinned"
        self.table.note_placed(chosen.name)
        return chosen, "pinned"

    def _change(self, candidates: Sequence[Backend], pin: int, chosen: Backend, now: float) -> tuple[Backend, str]:
        """Change the set through the store: when another proxy changed it first, follow its set:
        its least-loaded member, or `chosen` if it is a member."""
        old, new, reason = self._growing
        members = self.store.change(pin, old, new)
        self.table.changed_by_store(pin, now)
        if members == new and len(new) > len(old):
            log.info("tenant %016x (share %.3f) grows to %s", pin, self.tenants.estimate(pin, now)[0], ",".join(new))
        if members is None or chosen.name in members:
            return chosen, reason
        inside = [b for b in candidates if b.name in members]
        if not inside:
            return chosen, "spill"
        rates = self.load.smoothed(inside, now)
        return inside[min(range(len(inside)), key=rates.__getitem__)], "pinned"

    def overflowed(self, pin: int, members: tuple[str, ...], to: Backend, n: int, now: float) -> None:
        """The balance guard sent this tenant's request to `to`, outside its set: a tenant whose own
        traffic is a large part of what its replicas take grows by it, so its later requests share two
        caches holding its prompt instead of overflowing one at a time to wherever there is room.
        "Large" weighs the traffic against the room the copy costs: where prompts are small beside
        the caches (many per replica), a tenant of a tenth of a replica's traffic pays for its copy.
        After a popularity rotation among 60 tenants, the new hot ones of 12 % and 7.5 % (0.75 asks
        for 19 % on 4 replicas) overflowed one request at a time from the replicas they had as cold
        tenants: 520 of the guard's 865 overflows over 12 seeds. Growing them took the share of the
        bound from 0.962 to 0.971 (`loadtest.affinity_drift --sequence rotate --offline`); the
        fresh-start replays are unchanged: there a prompt takes a fifth of a cache, and 0.75 holds
        (docs/BENCHMARKS.md)."""
        if self.store.up and self.tenants.current(pin, now) * n >= self._copy_pays(to) * len(members):
            new = self.store.change(pin, members, members + (to.name,))
            if new is not None:
                self.table.changed_by_store(pin, now)
                log.info("tenant %016x overflows: its set is now %s", pin, ",".join(new))

    def _copy_pays(self, to: Backend) -> float:
        """The share x replicas per member of its set at which a tenant's traffic pays for a copy of
        its prompt on `to`: _OVERFLOW_GROW, or _OVERFLOW_ROOM times the part of that cache its
        prompt takes, if less."""
        need = _OVERFLOW_GROW
        room = self.table.capacity(to, 0.0)  # prompts its cache keeps (0: not known yet)
        if room > 0.0 and _OVERFLOW_ROOM / room < need:
            need = _OVERFLOW_ROOM / room
        return need

    def _rendezvous(self, candidates: Sequence[Backend], pin: int, now: float) -> tuple[Backend, str]:
        """Stateless fallback: the pin's rendezvous order, first replica under the bound."""
        cfg = self.config
        rates = self.load.smoothed(candidates, now)
        mean = (sum(rates) + 1.0) / len(candidates)
        cap = (1.0 + cfg.epsilon) * mean + cfg.load_slack * math.sqrt(mean)
        order = rendezvous_order(pin, candidates)
        idx = {b.name: i for i, b in enumerate(candidates)}
        for rank, backend in enumerate(order):
            if rates[idx[backend.name]] + 1 <= cap:
                return backend, "pinned" if rank == 0 else "spill"
        return order[0], "pinned"

    def _maybe_shrink(self, pin: int, members: tuple[str, ...], n: int, now: float) -> None:
        """Drop the last members the tenant's traffic no longer needs (with hysteresis below the
        growth threshold), all at once, once its set has not changed for cool_down_requests
        as this proxy saw it: a set other than the one seen last, or seen here for the first time
        (another proxy grew it), counts as changed now; one member replaced by this proxy's packing
        repair does not. (Not by the table's wall-time stamp: wall time over the current request
        rate is no request count when the rate varies, and a refresh of the same set rewrites the
        stamp.)"""
        table = self.table
        changed, seen = table.changed.get(pin), table.shrink_seen.get(pin)
        if changed is None or seen != members:
            left = table.came_from.get(pin, ("",))[0]  # (this proxy's repair replaced a member in place)
            replaced = (changed is not None and seen is not None and len(seen) == len(members)
                        and left in seen and left not in members)
            table.shrink_seen[pin] = members
            if not replaced:
                table.changed[pin] = now
                return
        if changed is None or now - changed < self.cool_down_requests:  # (None: returned above)
            return
        tenants = self.tenants
        step = self.grow_fill * 0.75  # share x replicas an extra member needs to stay
        if tenants.share_floor(pin, now) * n >= (len(members) - 1) * step:  # (the estimates can only be higher)
            return
        share = tenants.high(pin, now)
        keep = len(members)
        while keep > 1 and share * n < (keep - 1) * step:
            keep -= 1
        if keep < len(members):
            log.info("tenant %016x (share %.3f) shrinks to %s", pin, share, ",".join(members[:keep]))
            self.table.set(pin, members[:keep], now)
