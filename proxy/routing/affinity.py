"""`prefix_affinity`: send a request where its prefix is cached, without overloading anyone.

The unit of placement is the tenant: the **pin key** (the leading system part of the prompt).

1. A continuation (the longest known prefix match reaches past the pin part) goes back to the
   replica that computed its earlier turns, unless that replica is clearly over the bound or is
   no longer in its tenant's set (the tenant moved, or this conversation spilled): then it goes
   where the tenant's prompt now lives. Keeping a moved tenant's conversations where they were
   kept its prompt in two caches for as long as they lasted (seconds to minutes for a light
   tenant), crowding both; recomputing a conversation's own turns once is cheaper.
2. Every tenant has a small ordered **replica set** (its home first). A new conversation goes
   to the member under the bound with the least recent traffic, so a hot tenant's traffic is
   shared by replicas that all hold its prompt instead of spilling to arbitrary ones.
3. The set **grows** (by the replica with the least load and the fewest tenants) as soon as the
   tenant's own traffic needs it (the lower confidence bound of its share, over the window or
   over its last quarter, x N >= grow_fill x set size) and the fleet is past warm-up
   (`grow_min_requests`), also when every member is over the bound;
   with Redis the growth is a compare-and-set on the shared table, so proxies growing one tenant
   at once agree. A smaller tenant instead stays up to the looser (continuation) bound, else
   spills that one request and brings the packing repair forward (step 5 re-homes it); before
   warm-up only a real queue makes it spill. When the tenant cools (its traffic would fit in one
   replica less, `cool_down_requests` after the set last changed) the last member is dropped.
4. A tenant never seen is **placed** on the replica with the least recent traffic and cache
   pressure (active tenants placed there), ties broken by rendezvous hashing. With Redis the placement is
   written with set-if-absent (the first proxy wins, the others adopt its choice) into a hash
   every proxy mirrors, so all proxies agree on every tenant's set; while the table is small
   the script also skips a first choice that other proxies filled since this proxy's mirror was
   read (at a cold start proxies placing tenants at once stacked them on one replica). When Redis is down, known
   tenants keep their mirrored sets and unknown ones fall back to rendezvous order (stateless
   agreement); without Redis at all, this process's table is the authority.
5. Placement is online bin packing with two limits, traffic (the bound) and cache room (the
   tenants' system prompts each replica's cache must hold, sized from `vllm:cache_config_info`),
   and warm-up placements are blind to popularity. So every `rebalance_every_requests` a **packing
   repair** (proxy/routing/packing.py, in the background) makes up to two changes, each a move
   of a single-replica tenant or a swap of two, that spread the prompts evenly over the caches
   without pushing traffic past (1 + eps/2) x mean. With Redis one proxy at a time plans (a
   lease it renews), so a single estimate of the tenants' shares decides, and it writes by
   compare-and-set on the shared table.

The bound (consistent hashing with bounded loads, Mirrokni et al. 2017) applies to a
**smoothed** load: the exponentially decayed count of requests routed to each replica summed over
all proxies via the shared load view. A replica is eligible when
smoothed + 1 <= (1 + eps) x mean + load_slack x sqrt(mean), so noise in the instantaneous in-flight
counts does not make tenants spill; in-flight counts only act as a guard against a real queue
(more than ceil((1 + eps) x mean) + queue_slack in flight).

**The policy's time is requests, not seconds.** Its clock advances by one per request routed over
all proxies (each proxy advances it by the number of proxies it estimates from the shared load
view), and every memory is counted on it: the smoothed load (`load_window_requests`), the
tenants' shares (`window_requests`), warm-up, growth and cool-down, the packing repair's period and its hold on
recently moved tenants. So the same request sequence behaves the same at 0.1x or 10x the rate,
and a benchmark's compressed minutes agree with production's hours. Wall time is used only to
age what other proxies published (at the observed request rate) and for Redis TTLs.

**Forgetting.** A tenant with no request for 6 of its mean gaps between requests (at most
`forget_requests`) is idle: it no longer counts in the tenants per replica that placement, the
cache-room limit and the packing repair look at (its prompt is on its way out of the LRU caches),
and when it returns it is placed anew by current load and room unless one of its replicas still
has both. A tenant's share is estimated over the requests since it appeared, so a new tenant's
share is right after a few dozen requests, not after a window's worth.

**Fleet changes.** A replica that leaves takes its index entries with it and its tenants are
re-homed (compare-and-set with Redis) on their next request, dropping it from their sets, so it
gets nothing back when it returns. A replica that joins (or returns) counts as carrying the mean
load and tenants at first, falling linearly to its own over load_window_requests, so the others do not all look
over the bound at once (which made every tenant spill onto the cold cache); placement and the
packing repair (brought forward by the change) fill it.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Sequence

from proxy.config import AffinityConfig
from proxy.parse import CHAT, ParsedRequest
from proxy.prefix import prefix_key
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.index import PrefixIndex
from proxy.routing.packing import Layout, Packing
from proxy.shared import SharedState

log = logging.getLogger("vllm_proxy.affinity")

_MASK = (1 << 64) - 1
_RESCALE_AFTER = 40.0  # time constants; renormalise the scaled rate accumulators past it
_CHARS_PER_TOKEN = 4  # to size a system prompt (pin blocks x block_chars) in cache tokens
_SPILL_REPAIR = 40.0  # a spill brings the packing repair forward to at most this many requests away
_PLACE_CHOICES = 8  # equally acceptable replicas offered to the shared table for a new tenant
_PUBLISH_TENANTS = 16384  # tenants up to which this proxy shares its counts with the others' planner
_GROW_SIGMAS = 2.5  # a set grows on the lower confidence bound of the tenant's share (Poisson)
_IDLE_GAPS = 6.0  # a tenant is idle after this many of its mean gaps without a request (P ~ e^-6 by chance)
_IDLE_SIGMAS = 2.0  # ... of its mean gaps at the low end of its share (Poisson), so a light one is not dropped early
_PRESENT_GAPS = 3.0  # the packing repair weighs a tenant silent for more of its mean gaps than this down
_SETTLED = 12.0  # requests of a tenant (decayed, over all proxies) before the packing repair trusts its share
_FAST = 10.0  # tenant_fast's window is this much shorter than window_requests
_SHIFTED_SIGMAS = 3.0  # a share over the short window this far from the long one means the tenant changed
_RATE_EVERY_S = 1.0  # the request rate is measured over this much wall time...
_RATE_EVERY_REQUESTS = 64.0  # ... or this many requests, whichever comes first
_START_RATE = 100.0  # requests a second assumed before the first measurement


def rendezvous_weight(key: int, salt: int) -> int:
    """A 64-bit mix of (key, replica salt): cheap, stable across processes."""
    x = ((key ^ salt) * 0x9E3779B97F4A7C15) & _MASK
    x ^= x >> 32
    x = (x * 0xD6E8FEB86659FD93) & _MASK
    return x ^ (x >> 29)


def rendezvous_order(key: int, candidates: Sequence[Backend]) -> list[Backend]:
    return sorted(candidates, key=lambda b: rendezvous_weight(key, b.salt), reverse=True)


class DecayedCounts:
    """Exponentially decayed event counts per key with O(1) updates: each event adds
    exp((t - t0) / tau) and a read multiplies by exp(-(t - t0) / tau). `t` is the policy's
    request clock."""

    __slots__ = ("tau", "t0", "scaled")

    def __init__(self, tau: float, now: float) -> None:
        self.tau = tau
        self.t0 = now
        self.scaled: dict = {}

    def factor(self, now: float) -> float:
        """exp((now - t0) / tau), renormalising first when it grows large."""
        x = (now - self.t0) / self.tau
        if x > _RESCALE_AFTER:
            shrink = math.exp(-x)
            self.scaled = {k: v * shrink for k, v in self.scaled.items() if v * shrink > 1e-6}
            self.t0, x = now, 0.0
        return math.exp(x)

    def add(self, key, now: float, up: float | None = None) -> None:
        if up is None:
            up = self.factor(now)  # first: it may renormalise (replace) `scaled`
        self.scaled[key] = self.scaled.get(key, 0.0) + up

    def value(self, key, now: float) -> float:
        return self.scaled.get(key, 0.0) / self.factor(now)

    def snapshot(self, now: float) -> dict:
        down = 1.0 / self.factor(now)
        return {k: v * down for k, v in self.scaled.items()}


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, config: AffinityConfig, shared: SharedState | None = None) -> None:
        self.config = config
        self.index = PrefixIndex(config.index_blocks_per_backend)
        self.shared = shared
        window = config.window_requests
        # the policy's clock: requests routed over all proxies (estimated), see the module doc
        self.clock = 0.0
        self._proxies = 1.0  # proxies sharing the traffic (estimated): the clock's step per request here
        self._rate = _START_RATE  # clock units per wall second, measured
        self._rate_mark = (time.time(), 0.0)  # (wall, clock) where the current measurement started
        self.routed = DecayedCounts(config.load_window_requests, 0.0)  # per backend name, and None = all
        # the same over a quarter of the window, this proxy only: where traffic goes now (placement)
        self.recent = DecayedCounts(config.load_window_requests / 4, 0.0)
        self.tenant_rate = DecayedCounts(window, 0.0)  # per pin, and None = all requests
        # the same over a tenth of the window: a tenant turning hot or cold shows here first
        self.tenant_fast = DecayedCounts(window / _FAST, 0.0)
        self.pins: dict[int, tuple[tuple[str, ...], float]] = shared.pins if shared is not None else {}
        # pin -> (first request, last request, low share estimate at the last, decayed requests before the
        # first in tenant_rate, in tenant_fast)
        self._seen: dict[int, tuple[float, float, float, float, float]] = {}
        self._changed: dict[int, float] = {}  # pin -> clock when its set last changed (as seen here)
        self._came_from: dict[int, tuple[str, float]] = {}  # pin -> (replica, clock) of its last repair move
        self._fleets: dict[str, tuple[str, ...]] = {}  # route -> replica names of its last request
        self._joined: dict[str, float] = {}  # replica -> clock when it joined (its load is ramped up)
        self._forget_at = min(1024, config.max_tenants)  # rate-table size that triggers `_forget`
        self._epoch = 0  # bumped on every local table change
        self._counts: dict[str, int] = {}  # active tenants per replica, cached for `_counts_version`
        self._all_counts: dict[str, int] = {}  # every placed tenant per replica (what the shared table holds)
        self._counts_version: tuple = ()
        self._recount_at = 0.0
        self._fleet_rate = 0.0  # smoothed requests routed over all proxies, as of the last decision
        # (old set, new set, reason) for _change: a set change the shared table must accept first
        self._growing: tuple[tuple[str, ...], tuple[str, ...], str] = ((), (), "")
        self._placing: list[tuple[str, int]] = []  # (replica, its tenants) choices for _place, best first
        self._returning = False  # the tenant of the request being routed was idle until now
        self._prompt_chars = 0.0  # request-weighted moving mean of the system prompt's size
        self._next_repair = 0.0
        self._repairing: asyncio.Task | None = None  # the packing repair in progress (a reference keeps it alive)
        if shared is not None:
            shared.rate_tau = config.load_window_requests / self._rate
            shared.local_rates = lambda wall: self.routed.snapshot(self.clock)
            shared.local_tenants = lambda wall: self._tenant_requests(self.clock)

    def load(self, backend: Backend) -> int:
        """Instantaneous in-flight requests over all proxies (also used by the LoRA manager)."""
        return self.loads((backend,))[0]

    def loads(self, candidates: Sequence[Backend]) -> list[int]:
        """`load` of each candidate, in one pass (this runs on every request)."""
        remote = self.shared.remote_load if self.shared is not None else None
        if not remote:
            return [b.in_flight for b in candidates]
        return [b.in_flight + remote.get(b.name, 0) for b in candidates]

    def smoothed(self, candidates: Sequence[Backend], now: float) -> list[float]:
        """Decayed routed counts over all proxies, per candidate; a replica that joined lately
        counts at least a share of the others' mean that falls to zero over window / 2."""
        down = 1.0 / self.routed.factor(now)
        mine = self.routed.scaled
        shared = self.shared
        if shared is not None and shared.remote_rate:
            remote = shared.remote_rate
            age = max(time.time() - shared.remote_rate_at, 0.0)
            decay = math.exp(-age * self._rate / self.config.load_window_requests)
            rates = [mine.get(b.name, 0.0) * down + remote.get(b.name, 0.0) * decay for b in candidates]
        else:
            rates = [mine.get(b.name, 0.0) * down for b in candidates]
        if self._joined:
            self._ramp(candidates, rates, now)
        return rates

    def _recent(self, candidates: Sequence[Backend]) -> list[float]:
        """Requests this proxy routed to each candidate over the last quarter load window (ramped
        up for a replica that joined, as `smoothed`): where traffic goes now."""
        down = 1.0 / self.recent.factor(self.clock)
        recent = [self.recent.scaled.get(b.name, 0.0) * down for b in candidates]
        if self._joined:
            self._ramp(candidates, recent, self.clock)
        return recent

    def _ramp(self, candidates: Sequence[Backend], values: list[float], now: float, into: dict | None = None) -> None:
        """Raise each lately joined replica's value to the others' mean times the part of its
        ramp (load_window_requests) still to go; in `values`, or in `into` by name."""
        ramp = self.config.load_window_requests
        for name, at in list(self._joined.items()):
            if now - at >= ramp:
                del self._joined[name]
        old = [v for b, v in zip(candidates, values) if b.name not in self._joined]
        if not old:
            return
        mean = sum(old) / len(old)
        for i, backend in enumerate(candidates):
            at = self._joined.get(backend.name)
            if at is not None:
                floor = max(values[i], mean * (1.0 - (now - at) / ramp))
                if into is None:
                    values[i] = floor
                else:
                    into[backend.name] = floor

    async def pick(self, candidates: Sequence[Backend], request: ParsedRequest, route: Route) -> tuple[Backend, str]:
        if request.endpoint not in (CHAT, "/v1/completions"):
            return min(candidates, key=self.load), "least-loaded"
        cfg = self.config
        key = prefix_key(request.endpoint == CHAT, request.data, route.upstream_id, cfg.block_chars, cfg.max_blocks)
        shared = self.shared
        match = None
        if shared is not None:
            match = shared.longest(key.chain)
        if match is None:
            match = self.index.longest(key.chain)
        wall = time.time()
        now = self._tick(wall)
        names = self._fleets.get(route.name)
        if names is None or len(names) != len(candidates) or any(a != b.name for a, b in zip(names, candidates)):
            self._membership(route.name, candidates, now)
        chars = max(key.pin_blocks, 1) * cfg.block_chars
        self._prompt_chars += (chars - self._prompt_chars) * (0.01 if self._prompt_chars else 1.0)
        if now >= self._next_repair and (self._repairing is None or self._repairing.done()):
            # in the background: this request does not wait for it
            self._next_repair = now + cfg.rebalance_every_requests
            self._repairing = asyncio.get_running_loop().create_task(self._repair(list(candidates), now))
        pin = key.pin
        self._returning = pin in self.pins and self._idle(pin, now, wall)
        chosen, reason = self._choose(candidates, pin, key.pin_blocks, match, now)
        if reason == "place":
            chosen, reason = await self._place(candidates, pin, chosen, now)
        elif reason == "grow":
            chosen, reason = await self._change(candidates, pin, chosen, now)
        up = self.routed.factor(now)
        self.routed.add(chosen.name, now, up)
        self.routed.add(None, now, up)
        self.recent.add(chosen.name, now)
        self._note(pin, now)
        if len(self.tenant_rate.scaled) > self._forget_at:
            self._forget(now)
        stale = self.index.record(key.chain, chosen.name, time.monotonic(), cfg.shared_ttl_s)
        if shared is not None and stale:
            shared.remember(stale, chosen.name)
        return chosen, reason

    # -- the request clock ------------------------------------------------------------------------
    def _tick(self, wall: float) -> float:
        """Advance the clock by one request over all proxies; measure its rate in wall time (only
        used to age what other proxies published)."""
        self.clock += self._proxies
        since, at = self._rate_mark
        if wall - since >= _RATE_EVERY_S or (self.clock - at >= _RATE_EVERY_REQUESTS and wall > since):
            self._rate = max((self.clock - at) / (wall - since), 1e-3)
            self._rate_mark = (wall, self.clock)
            if self.shared is not None:
                self.shared.rate_tau = self.config.load_window_requests / self._rate
        return self.clock

    def _note(self, pin: int, now: float) -> None:
        """Count this request for its tenant and remember when it was seen, with a low estimate
        of its share (`_idle` waits for that many of its mean gaps)."""
        rates, fast = self.tenant_rate, self.tenant_fast
        up, up_fast = rates.factor(now), fast.factor(now)
        if self._returning or pin not in self._seen:  # (again) new: its old rate says nothing now
            rates.scaled.pop(pin, None)
            fast.scaled.pop(pin, None)
            self._seen[pin] = (now, now, 0.0, rates.scaled.get(None, 0.0) / up, fast.scaled.get(None, 0.0) / up_fast)
        for counts, step in ((rates, up), (fast, up_fast)):
            counts.add(pin, now, step)
            counts.add(None, now, step)
        total = rates.scaled[None] * self._exposure(pin, now)
        mine = rates.scaled[pin] / up  # decayed requests of this tenant
        low = max(mine - _IDLE_SIGMAS * math.sqrt(mine), 0.0) * up / total
        first, _, _, before, before_fast = self._seen[pin]
        self._seen[pin] = (first, now, low, before, before_fast)

    def _membership(self, route: str, candidates: Sequence[Backend], now: float) -> None:
        """The route's healthy replicas changed: a replica that left takes its index entries (its
        cache is gone or going); one that joined gets its load ramped up (`smoothed`)."""
        names = tuple(b.name for b in candidates)
        known = self._fleets.get(route)
        self._fleets[route] = names
        if known is None:
            return
        for name in set(known) - set(names):
            self.index.forget(name)
            self._joined.pop(name, None)
            log.info("replica %s left: its tenants are re-homed on their next request", name)
        for name in set(names) - set(known):
            self._joined[name] = now
            log.info("replica %s joined: placement and the packing repair fill it", name)
        self._next_repair = min(self._next_repair, now + _SPILL_REPAIR)

    # -- decision ---------------------------------------------------------------------------------
    def _choose(
        self, candidates: Sequence[Backend], pin: int, pin_blocks: int, match: tuple[int, str | None], now: float
    ) -> tuple[Backend, str]:
        cfg = self.config
        n = len(candidates)
        rates = self.smoothed(candidates, now)
        flights = self.loads(candidates)
        self._fleet_rate = total = sum(rates)
        local = self.routed.value(None, now)  # all this proxy routed, on the same window as `rates`
        if local >= 16.0:  # proxies sharing the traffic: the fleet's routed count over this proxy's
            self._proxies += (min(max(total / local, 1.0), 64.0) - self._proxies) * 0.02
        mean = (total + 1.0) / n
        cap = (1.0 + cfg.epsilon) * mean + cfg.load_slack * math.sqrt(mean)  # slack: the count's own noise
        qcap = math.ceil((1.0 + cfg.epsilon) * (sum(flights) + 1) / n) + cfg.queue_slack

        matched, owner = match
        entry = self.pins.get(pin)
        if entry is not None and not entry[0]:
            entry = None
        # a continuation follows its conversation only while that replica is one of its tenant's:
        # after the tenant moved (or this conversation spilled) it goes where the tenant's prompt
        # is, recomputing its own turns once, rather than keep the prompt alive in a second cache
        # for as long as its conversations last
        if owner is not None and matched > pin_blocks and (entry is None or owner in entry[0]):
            # (before warm-up, as for a tenant's own replicas below, only a real queue stops it)
            loose = cap + cfg.continuation_slack * mean if self._warm(now) else math.inf
            for i, backend in enumerate(candidates):
                if backend.name == owner:
                    if rates[i] + 1 <= loose and flights[i] + 1 <= qcap:
                        return backend, "prefix-hit"
                    break

        if entry is None:
            ranked = self._ranked(candidates, rates, flights, cap, qcap, pin, ())
            # the shared table may correct the first choice to an equally good one (see _place)
            every = self._all_counts
            self._placing = [(b.name, every.get(b.name, 0)) for k, _, b in ranked[:_PLACE_CHOICES]
                             if k[:3] == ranked[0][0][:3]]
            return ranked[0][2], "place"
        members, stamp = entry
        here = [i for name in members for i, b in enumerate(candidates) if b.name == name]
        # among its replicas, the one with the least traffic now (the smoothed load lags behind a
        # set that just changed, and would send it all to the newest member for a while)
        now_load = self._recent(candidates) if len(here) > 1 else rates
        if self._returning or len(here) < len(members):
            # an idle tenant came back, or a replica of its set left: place it anew (keeping the
            # replicas it has that still have room), and never back onto a replica that left
            return self._rehome(candidates, rates, flights, cap, qcap, pin, members, here, now)
        best = -1
        for i in here:
            if rates[i] + 1 <= cap and flights[i] + 1 <= qcap and (best < 0 or now_load[i] < now_load[best]):
                best = i
        self._refresh(pin, members, stamp, time.time())
        if best >= 0:
            # a tenant whose own traffic needs another replica grows now, not once the smoothed
            # load of its replicas has caught up with it (half a load window later)
            if len(members) < n and self._may_grow(pin, len(members), n, now):
                chosen = self._best(candidates, rates, flights, cap, qcap, pin, members, grow=True)
                if chosen.name not in members and rates[candidates.index(chosen)] + 1 <= cap:
                    return self._propose(pin, members, members + (chosen.name,), chosen, "pinned", now)
            if len(members) > 1:
                self._maybe_shrink(pin, members, n, now)
            return candidates[best], "pinned"
        # A tenant grows only when its own traffic needs more replicas than it has (a copy of its
        # prompt elsewhere costs misses and cache space) and once enough history says so: while
        # warming up, or when others' traffic makes its replicas busy, it stays on them up to the
        # looser (continuation) bound, beyond that single requests spill without changing its set.
        if not self._may_grow(pin, len(members), n, now):
            # before warm-up ends (shares unknown) only a real queue makes it spill: a spilled
            # conversation copies the prompt elsewhere and its later turns stay there
            hard = cap + cfg.continuation_slack * mean if self._warm(now) else math.inf
            for i in here:
                if rates[i] + 1 <= hard and flights[i] + 1 <= qcap and (best < 0 or now_load[i] < now_load[best]):
                    best = i
            if best >= 0:
                return candidates[best], "pinned"
            # a spilled conversation copies the prompt and stays where it went: the packing
            # repair should look at this soon rather than at its next period
            self._next_repair = min(self._next_repair, now + _SPILL_REPAIR)
            return self._best(candidates, rates, flights, cap, qcap, pin, members, grow=True), "spill"
        # every member is over the bound: grow the set by the best other replica
        chosen = self._best(candidates, rates, flights, cap, qcap, pin, members, grow=True)
        return self._propose(pin, members, members + (chosen.name,), chosen, "spill", now)

    def _rehome(
        self, candidates: Sequence[Backend], rates: list[float], flights: list[int], cap: float, qcap: int,
        pin: int, members: tuple[str, ...], here: list[int], now: float,
    ) -> tuple[Backend, str]:
        """The set of a tenant that came back from idle, or lost a replica: the members still
        present that have load and cache room left, else the best replica for a new tenant."""
        if here and not self._returning:  # a replica left: the others stay as they are
            room = here
        else:
            counts = self._tenant_counts()
            slots = math.ceil((sum(counts.get(b.name, 0) for b in candidates) + 1) / len(candidates))
            room = [i for i in here if rates[i] + 1 <= cap and flights[i] + 1 <= qcap
                    and counts.get(candidates[i].name, 0) + 1 <= self._capacity(candidates[i], slots)]
        if room:
            chosen = candidates[min(room, key=rates.__getitem__)]
            keep = tuple(candidates[i].name for i in room)
        else:
            chosen = self._ranked(candidates, rates, flights, cap, qcap, pin, ())[0][2]
            keep = (chosen.name,)
        if keep == members:
            return chosen, "pinned"
        log.info("tenant %016x %s: %s -> %s", pin, "returns" if self._returning else "lost a replica",
                 ",".join(members), ",".join(keep))
        return self._propose(pin, members, keep, chosen, "pinned", now)

    def _propose(self, pin: int, old: tuple[str, ...], new: tuple[str, ...], chosen: Backend, reason: str,
                 now: float) -> tuple[Backend, str]:
        """Change a tenant's set: here at once without Redis; with it through the shared table's
        compare-and-set in `_change` (so proxies changing one tenant at once agree), or not at all
        while Redis is down (this request still goes to `chosen`)."""
        shared = self.shared
        if shared is None:
            self._set(pin, new, now)
            return chosen, reason
        if shared.up:
            self._growing = (old, new, reason)
            return chosen, "grow"
        return chosen, "spill"

    def _best(
        self, candidates: Sequence[Backend], rates: list[float], flights: list[int], cap: float, qcap: int,
        pin: int, exclude: Sequence[str], grow: bool = False,
    ) -> Backend:
        """The replica for a new placement: under the bound, least (load share + tenant share),
        ties by rendezvous order; outside `exclude` when possible."""
        return self._ranked(candidates, rates, flights, cap, qcap, pin, exclude, grow)[0][2]

    def _ranked(
        self, candidates: Sequence[Backend], rates: list[float], flights: list[int], cap: float, qcap: int,
        pin: int, exclude: Sequence[str], grow: bool = False,
    ) -> list[tuple[tuple, int, Backend]]:
        """`_best`'s order of every candidate: (sort key, tenants it holds, replica), best first."""
        n = len(candidates)
        counts = self._tenant_counts()
        # scored by where traffic goes now (a population that changed left the smoothed load behind)
        recent = self._recent(candidates)
        mean_rate = (sum(recent) + n) / n
        if self._joined:  # a replica that joined counts as holding the mean of tenants at first, too
            counts = dict(counts)
            self._ramp(candidates, [counts.get(b.name, 0) for b in candidates], self.clock, counts)
        mean_count = (sum(counts.get(b.name, 0) for b in candidates) + n) / n
        # cache room: no replica takes more than its share of tenants' prompts (rounded up)
        slots = math.ceil((sum(counts.get(b.name, 0) for b in candidates) + (0 if exclude and not grow else 1)) / n)
        ranked = []
        for i, backend in enumerate(candidates):
            fits = rates[i] + 1 <= cap and flights[i] + 1 <= qcap
            count = counts.get(backend.name, 0)
            score = (recent[i] + 1) / mean_rate + (0.5 if grow else 1.0) * (count + 1) / mean_count
            k = (backend.name in exclude, not fits, count + 1 > self._capacity(backend, slots), round(score, 6),
                 -rendezvous_weight(pin, backend.salt))
            ranked.append((k, count, backend))
        ranked.sort(key=lambda r: r[0])
        return ranked

    # -- packing repair ---------------------------------------------------------------------------
    async def _repair(self, candidates: Sequence[Backend], now: float) -> None:
        """Every `rebalance_every_requests` (sooner after a spill or a fleet change, and while it
        finds work), in a task of its own, apply `_plan`'s changes. With Redis only one proxy plans
        (it holds a lease while it lives, so one estimate of the tenants' shares decides and
        proxies never undo each other's moves), through compare-and-set on the shared table."""
        cfg = self.config
        shared = self.shared
        if not self._warm(now) or (shared is not None and not shared.up):
            return
        if shared is not None:
            hold_s = max(3 * cfg.rebalance_every_requests / self._rate, 1.0)
            if not await shared.lease("repair", hold_s):
                return
        others = await shared.other_tenants() if shared is not None else None
        share = self._fleet_share(now, others)
        plan = self._plan(candidates, now, share)
        for pin, old, new in plan:
            log.info("packing repair: tenant %016x (share %.3f) %s -> %s", pin, share(pin), old[0], new[0])
            self._came_from[pin] = (old[0], now)
            if shared is None:
                self._set(pin, new, now)
            elif shared.grow(pin, old, new) is not None:
                self._changed[pin] = now
                self._epoch += 1

    def _plan(self, candidates: Sequence[Backend], now: float, share=None) -> list[tuple[int, tuple[str], tuple[str]]]:
        """The packing repair's changes (proxy/routing/packing.py) for the current table, with
        `share(pin)` the tenant's share of the traffic (default: of this proxy's). Idle tenants
        are left out: they neither hold cache room nor carry traffic."""
        share_of = share or (lambda p: self._current(p, now))
        n = len(candidates)
        where = {b.name: i for i, b in enumerate(candidates)}
        counts, fixed = [0] * n, [0.0] * n
        flex: list[tuple[float, list[int]]] = []
        singles: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        hold = now - self.config.move_after_requests
        wall = time.time()
        hold_wall = wall - self.config.move_after_requests / self._rate
        for pin, (members, stamp) in self.pins.items():
            inside = [where[m] for m in members if m in where]
            if not inside or self._idle(pin, now, wall):
                continue
            share = share_of(pin) * self._presence(pin, now)
            for i in inside:
                counts[i] += 1
            if len(inside) > 1:
                flex.append((share, inside))
                continue
            fixed[inside[0]] += share
            if (len(members) == 1 and stamp < hold_wall and self._changed.get(pin, -math.inf) < hold
                    and self.tenant_rate.value(pin, now) * self._proxies >= _SETTLED):
                singles[inside[0]].append((share, pin))
        for side in singles:
            side.sort()
        # each replica's fair part of the prompts (by cache size), and how much a deviation from it
        # matters: fully once its prompts would fill `cache_fill` of the cache, less when they fit easily
        sizes = [b.cache_tokens or 0 for b in candidates]
        whole = sum(sizes) if all(sizes) else 0
        fair = [sum(counts) * (size / whole if whole else 1.0 / n) for size in sizes]
        pressure = [min(1.0, fair[i] / max(self._capacity(b, fair[i]), 1e-9)) for i, b in enumerate(candidates)]
        packing = Packing(fair, pressure, (1.0 + self.config.epsilon / 2) / n, flex)
        undo = now - self.config.cool_down_requests
        banned = frozenset((pin, where[name]) for pin, (name, at) in self._came_from.items()
                           if at > undo and name in where)
        names = [b.name for b in candidates]
        moves = packing.plan(Layout(counts, fixed, singles, banned))
        if moves:
            log.debug("packing repair: tenants per replica %s (fair %s), traffic %s", counts,
                      [round(f, 1) for f in fair], [round(x, 3) for x in packing.loads(fixed)])
        return [(pin, (names[a],), (names[b],)) for _, pin, a, b in moves]

    def _capacity(self, backend: Backend, default):
        """Tenant prompts the replica's cache keeps: `cache_fill` of its size over the mean system
        prompt, once scraped; else `default`."""
        if backend.cache_tokens and self._prompt_chars:
            return self.config.cache_fill * backend.cache_tokens * _CHARS_PER_TOKEN / self._prompt_chars
        return default

    async def _place(self, candidates: Sequence[Backend], pin: int, chosen: Backend, now: float) -> tuple[Backend, str]:
        shared = self.shared
        if shared is None:
            self._set(pin, (chosen.name,), now)
            return chosen, "pinned"
        if not shared.up:
            return self._rendezvous(candidates, pin, now)
        members = shared.place(pin, self._placing)
        if members is None:
            return self._rendezvous(candidates, pin, now)
        self._changed[pin] = now
        if chosen.name not in members:  # another proxy placed it first, or filled `chosen`: follow the table
            for backend in candidates:
                if backend.name in members:
                    return backend, "pinned"
        return chosen, "pinned"

    async def _change(self, candidates: Sequence[Backend], pin: int, chosen: Backend, now: float) -> tuple[Backend, str]:
        """Change the set through the shared table (compare-and-set): when another proxy changed it
        first, follow its set: its least-loaded member, or `chosen` if it is a member."""
        old, new, reason = self._growing
        members = self.shared.grow(pin, old, new)  # type: ignore[union-attr]
        self._changed[pin] = now
        self._epoch += 1
        if members == new and len(new) > len(old):
            log.info("tenant %016x (share %.3f) grows to %s", pin, self._estimate(pin, now)[0], ",".join(new))
        if members is None or chosen.name in members:
            return chosen, reason
        inside = [b for b in candidates if b.name in members]
        if not inside:
            return chosen, "spill"
        rates = self.smoothed(inside, now)
        return inside[min(range(len(inside)), key=rates.__getitem__)], "pinned"

    def _rendezvous(self, candidates: Sequence[Backend], pin: int, now: float) -> tuple[Backend, str]:
        """Stateless fallback: the pin's rendezvous order, first replica under the bound."""
        cfg = self.config
        rates = self.smoothed(candidates, now)
        mean = (sum(rates) + 1.0) / len(candidates)
        cap = (1.0 + cfg.epsilon) * mean + cfg.load_slack * math.sqrt(mean)
        order = rendezvous_order(pin, candidates)
        idx = {b.name: i for i, b in enumerate(candidates)}
        for rank, backend in enumerate(order):
            if rates[idx[backend.name]] + 1 <= cap:
                return backend, "pinned" if rank == 0 else "spill"
        return order[0], "pinned"

    # -- the replica-set table ----------------------------------------------------------------------
    def _set(self, pin: int, members: Sequence[str], now: float) -> None:
        self._epoch += 1
        self._changed[pin] = now
        if self.shared is not None:
            self.shared.set_pin(pin, members)
        else:
            self.pins[pin] = (tuple(members), time.time())

    def _refresh(self, pin: int, members: tuple[str, ...], stamp: float, wall: float) -> None:
        """Rewrite a used placement before the shared table's TTL (wall time) expires it."""
        if wall - stamp > self.config.shared_ttl_s / 2 and (self.shared is None or self.shared.up):
            self._set(pin, members, self.clock)

    def _maybe_shrink(self, pin: int, members: tuple[str, ...], n: int, now: float) -> None:
        """Drop the last member once the tenant's traffic fits in one replica less (with
        hysteresis below the growth threshold), and its set has not changed for cool_down_requests."""
        changed = self._changed.get(pin)
        if changed is None:
            self._changed[pin] = now
            return
        if now - changed < self.config.cool_down_requests:
            return
        share = min(self._estimate(pin, now)[0], self._estimate(pin, now, True)[0])  # cooling shows in either
        if share * n < (len(members) - 1) * self.config.grow_fill * 0.75:
            log.info("tenant %016x (share %.3f) shrinks to %s", pin, share, ",".join(members[:-1]))
            self._set(pin, members[:-1], now)

    def _forget(self, now: float) -> None:
        """Bound the per-tenant tables, which grow with every distinct system prompt a client
        sends: drop idle placements (the Redis mirror expires its own) and, beyond `max_tenants`,
        the least recently used; then the rates and stamps of tenants not placed. Amortised: runs
        again only once the rate table has doubled (capped just above the limit)."""
        cfg, pins, seen = self.config, self.pins, self._seen
        if self.shared is None:
            wall = time.time()
            for pin in [p for p in pins if self._idle(p, now, wall)]:
                del pins[pin]
        if len(pins) > cfg.max_tenants:
            recent = sorted(pins, key=lambda p: seen[p][1] if p in seen else -math.inf)
            for pin in recent[:len(pins) - cfg.max_tenants * 9 // 10]:
                del pins[pin]
        self._changed = {p: t for p, t in self._changed.items() if p in pins}
        self._came_from = {p: v for p, v in self._came_from.items() if p in pins}
        self._seen = {p: v for p, v in seen.items() if p in pins}
        for counts in (self.tenant_rate, self.tenant_fast):
            counts.scaled = {k: v for k, v in counts.scaled.items() if k is None or k in pins}
        self._epoch += 1
        self._forget_at = min(max(2 * len(self.tenant_rate.scaled), 1024), cfg.max_tenants * 11 // 10)

    def _idle(self, pin: int, now: float, wall: float) -> bool:
        """No request of this tenant for 6 of its mean gaps (as this proxy sees them: 1/N of its
        requests with N proxies), or for `forget_requests`. A tenant this proxy has not seen is
        idle once its placement is older than `forget_requests` at the current rate."""
        seen = self._seen.get(pin)
        if seen is None:
            entry = self.pins.get(pin)
            return entry is None or (wall - entry[1]) * self._rate > self.config.forget_requests
        gap = now - seen[1]
        return gap >= self.config.forget_requests or gap * seen[2] >= _IDLE_GAPS * self._proxies

    def _presence(self, pin: int, now: float) -> float:
        """How likely the tenant still sends, from the gap since its last request: 1 within three of
        its mean gaps, falling as exp(-gaps) beyond. The packing repair weighs its share by this,
        so when a population changes it does not make room for tenants that just left."""
        seen = self._seen.get(pin)
        if seen is None:
            return 1.0
        gaps = (now - seen[1]) * seen[2] / self._proxies
        return 1.0 if gaps <= _PRESENT_GAPS else math.exp(_PRESENT_GAPS - gaps)

    def _local_total(self, now: float) -> float:
        """Requests this proxy routed (decayed)."""
        return self.tenant_rate.value(None, now)

    def _warm(self, now: float) -> bool:
        """Enough traffic over all proxies (and some here) for the tenants' shares to mean something."""
        need = self.config.grow_min_requests
        return self._fleet_rate >= need and self._local_total(now) >= need / 4

    def _exposure(self, pin: int, now: float, fast: bool = False) -> float:
        """Share of this proxy's decayed request count that arrived since the tenant appeared."""
        seen = self._seen.get(pin)
        counts = self.tenant_fast if fast else self.tenant_rate
        if seen is None or seen[4 if fast else 3] <= 0.0:
            return 1.0
        total = counts.value(None, now)
        before = seen[4 if fast else 3] * math.exp(-(now - seen[0]) / counts.tau)
        return max(1.0 - before / total, 1e-9) if total > 0.0 else 1.0

    def _estimate(self, pin: int, now: float, fast: bool = False) -> tuple[float, float]:
        """(this tenant's share of the requests routed here, the decayed requests it rests on),
        counted since the tenant appeared: a new tenant's share is not diluted by the window."""
        counts = self.tenant_fast if fast else self.tenant_rate
        scaled = counts.scaled
        total = scaled.get(None, 0.0) * self._exposure(pin, now, fast)
        if total <= 0.0:
            return 0.0, 0.0
        return min(scaled.get(pin, 0.0) / total, 1.0), total / counts.factor(now)

    def _current(self, pin: int, now: float) -> float:
        """The tenant's share over the window, or over its short window when that is clearly
        different (the tenant turned hot or cold): stable while nothing changes, quick when it does."""
        share, _ = self._estimate(pin, now)
        fast, seen = self._estimate(pin, now, True)
        if abs(fast - share) * math.sqrt(max(seen, 1.0)) > _SHIFTED_SIGMAS * math.sqrt(max(share, 1e-3)):
            return fast
        return share

    def _may_grow(self, pin: int, size: int, n: int, now: float) -> bool:
        """Enough history, and the tenant alone nearly fills the replicas it has, even at the low
        end of what its share could be, over the window or over its last quarter (a tenant
        turning hot shows there first): estimated from this proxy's requests (a third of them
        with three proxies), a 10 % tenant often looks like 25 % early on, and a needless copy of
        its prompt costs every replica involved cache room for good."""
        if not self._warm(now):
            return False
        for fast in (False, True):
            share, seen = self._estimate(pin, now, fast)
            mine = share * seen  # its requests (decayed); Poisson bound: a first request is not "100 %"
            low = max(mine - _GROW_SIGMAS * math.sqrt(mine), 0.0) / max(seen, 1.0)
            if low * n >= size * self.config.grow_fill:
                return True
        return False

    def _tenant_requests(self, now: float) -> tuple[dict[int, float], float] | None:
        """(tenant -> decayed requests routed here, all of them), published for the other proxies'
        packing repair; None past _PUBLISH_TENANTS (copying and ranking them each second would
        stall the event loop; the planner then counts this proxy's requests out of its shares)."""
        if len(self.tenant_rate.scaled) > _PUBLISH_TENANTS:
            return None
        snapshot = self.tenant_rate.snapshot(now)
        return snapshot, snapshot.pop(None, 0.0)

    def _fleet_share(self, now: float, others: tuple[dict[int, float], float] | None):
        """share(pin) over every proxy's requests: this proxy's counts plus the others' published
        ones, counted since the tenant appeared."""
        if not others or others[1] <= 0:
            return lambda pin: self._current(pin, now)
        rates, total = others
        down = 1.0 / self.tenant_rate.factor(now)
        scaled = self.tenant_rate.scaled
        whole = scaled.get(None, 0.0) * down + total
        def share(pin: int) -> float:
            fleet = min((scaled.get(pin, 0.0) * down + rates.get(pin, 0.0)) / max(whole * self._exposure(pin, now), 1e-9), 1.0)
            here = self._estimate(pin, now)[0]
            current = self._current(pin, now)  # this proxy's view of a change scales the fleet's
            return fleet if current == here or here <= 0.0 else min(fleet * current / here, 1.0)

        return share

    def _tenant_counts(self) -> dict[str, int]:
        """Active (not idle) tenants per replica; recomputed when the table changed, and every
        quarter repair period as tenants go idle."""
        shared = self.shared
        version = (len(self.pins), self._epoch, shared.pins_changed if shared is not None else 0)
        now = self.clock
        if version != self._counts_version or now >= self._recount_at:
            wall = time.time()
            counts: dict[str, int] = {}
            every: dict[str, int] = {}
            for pin, (members, _) in self.pins.items():
                for name in members:
                    every[name] = every.get(name, 0) + 1
                if not self._idle(pin, now, wall):
                    for name in members:
                        counts[name] = counts.get(name, 0) + 1
            self._counts, self._all_counts, self._counts_version = counts, every, version
            self._recount_at = now + max(self.config.rebalance_every_requests / 4, len(self.pins) / 64)
        return self._counts
