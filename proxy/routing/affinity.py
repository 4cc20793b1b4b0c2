"""`prefix_affinity`: send a request where its prefix is cached, without overloading anyone.

The unit of placement is the tenant: the **pin key** (the leading system part of the prompt).

1. A continuation (the longest known prefix match reaches past the pin part) goes back to the
   replica that computed its earlier turns, unless that replica is clearly over the bound or is
   no longer in its tenant's set (the tenant moved, or this conversation spilled): then it goes
   where the tenant's prompt now lives. Keeping a moved tenant's conversations where they were
   kept its prompt in two caches for as long as they lasted (seconds to minutes for a light
   tenant), crowding both; recomputing a conversation's own turns once is cheaper.
2. Every tenant has a small ordered **replica set** (its home first). A new conversation goes
   to the least-loaded member under the bound, so a hot tenant's traffic is shared by replicas
   that all hold its prompt instead of spilling to arbitrary ones.
3. When every member is over the bound, the set **grows** (by the replica with the least load
   and the fewest tenants) only if the tenant's own traffic needs it (the lower confidence bound
   of its share x N >= grow_fill x set size) and the fleet is past warm-up (`grow_min_requests`);
   with Redis the growth is a compare-and-set on the shared table, so proxies growing one tenant
   at once agree. A smaller tenant instead stays up to the looser (continuation) bound, else
   spills that one request and brings the packing repair forward (step 5 re-homes it); before
   warm-up only a real queue makes it spill. When the tenant cools (its traffic would fit in one
   replica less, for `cool_down_s`) the last member is dropped.
4. A tenant never seen is **placed** on the replica with the least load and cache pressure
   (tenants placed there), ties broken by rendezvous hashing. With Redis the placement is
   written with set-if-absent (the first proxy wins, the others adopt its choice) into a hash
   every proxy mirrors, so all proxies agree on every tenant's set; while the table is small
   the script also skips a first choice that other proxies filled since this proxy's mirror was
   read (at a cold start proxies placing tenants at once stacked them on one replica). When Redis is down, known
   tenants keep their mirrored sets and unknown ones fall back to rendezvous order (stateless
   agreement); without Redis at all, this process's table is the authority.
5. Placement is online bin packing with two limits, traffic (the bound) and cache room (the
   tenants' system prompts each replica's cache must hold, sized from `vllm:cache_config_info`),
   and warm-up placements are blind to popularity. So every `rebalance_interval_s` a **packing
   repair** (proxy/routing/packing.py, in the background) makes up to two changes, each a move
   of a single-replica tenant or a swap of two, that spread the prompts evenly over the caches
   without pushing traffic past (1 + eps/2) x mean. With Redis one proxy at a time plans (a
   lease it renews), so a single estimate of the tenants' shares decides, and it writes by
   compare-and-set on the shared table.

The bound (consistent hashing with bounded loads, Mirrokni et al. 2017) applies to a
**smoothed** load: the exponentially decayed count of requests routed to each replica (time
constant `load_window_s`) summed over all proxies via the shared load view. A replica is
eligible when smoothed + 1 <= (1 + eps) x (total + 1) / N + load_slack, so noise in the
instantaneous in-flight counts does not make tenants spill; in-flight counts only act as a
guard against a real queue (more than ceil((1 + eps) x mean) + queue_slack in flight).
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
_SPILL_REPAIR_S = 0.25  # a spill brings the packing repair forward to at most this far away
_PLACE_CHOICES = 8  # equally acceptable replicas offered to the shared table for a new tenant
_PUBLISH_TENANTS = 16384  # tenants up to which this proxy shares its counts with the others' planner
_GROW_SIGMAS = 2.5  # a set grows on the lower confidence bound of the tenant's share (binomial)


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
    exp((t - t0) / tau) and a read multiplies by exp(-(t - t0) / tau)."""

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
        self.scaled[key] = self.scaled.get(key, 0.0) + (up if up is not None else self.factor(now))

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
        now = time.time()
        self.routed = DecayedCounts(config.load_window_s, now)  # per backend name
        self.tenant_rate = DecayedCounts(config.load_window_s, now)  # per pin, and None = all requests
        self.pins: dict[int, tuple[tuple[str, ...], float]] = shared.pins if shared is not None else {}
        self._changed: dict[int, float] = {}  # pin -> when its set last changed (as seen here)
        self._came_from: dict[int, tuple[str, float]] = {}  # pin -> (replica, when) of its last repair move
        self._forget_at = min(1024, config.max_tenants)  # rate-table size that triggers `_forget`
        self._epoch = 0  # bumped on every local table change
        self._counts: dict[str, int] = {}  # tenants per replica, cached for `_counts_version`
        self._counts_version: tuple = ()
        self._slots_total = 0
        self._fleet_rate = 0.0  # smoothed requests routed over all proxies, as of the last decision
        self._growing: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())  # (old set, new set) for _grow
        self._placing: list[tuple[str, int]] = []  # (replica, its tenants) choices for _place, best first
        self._prompt_chars = 0.0  # request-weighted moving mean of the system prompt's size
        self._next_repair = now
        self._repairing: asyncio.Task | None = None  # the packing repair in progress (a reference keeps it alive)
        if shared is not None:
            shared.rate_tau = config.load_window_s
            shared.local_rates = self.routed.snapshot
            shared.local_tenants = self._tenant_requests

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
        """Decayed routed counts over all proxies, per candidate."""
        down = 1.0 / self.routed.factor(now)
        mine = self.routed.scaled
        shared = self.shared
        if shared is not None and shared.remote_rate:
            remote = shared.remote_rate
            decay = math.exp(-max(now - shared.remote_rate_at, 0.0) / self.config.load_window_s)
            return [mine.get(b.name, 0.0) * down + remote.get(b.name, 0.0) * decay for b in candidates]
        return [mine.get(b.name, 0.0) * down for b in candidates]

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
        now = time.time()
        chars = max(key.pin_blocks, 1) * cfg.block_chars
        self._prompt_chars += (chars - self._prompt_chars) * (0.01 if self._prompt_chars else 1.0)
        if now >= self._next_repair and (self._repairing is None or self._repairing.done()):
            # in the background: this request does not wait for it
            self._next_repair = now + cfg.rebalance_interval_s
            self._repairing = asyncio.get_running_loop().create_task(self._repair(list(candidates), now))
        chosen, reason = self._choose(candidates, key.pin, key.pin_blocks, match, now)
        if reason == "place":
            chosen, reason = await self._place(candidates, key.pin, chosen, now)
        elif reason == "grow":
            chosen, reason = await self._grow(candidates, key.pin, chosen, now)
        self.routed.add(chosen.name, now)
        up = self.tenant_rate.factor(now)
        self.tenant_rate.add(key.pin, now, up)
        self.tenant_rate.add(None, now, up)
        if len(self.tenant_rate.scaled) > self._forget_at:
            self._forget(now)
        stale = self.index.record(key.chain, chosen.name, time.monotonic(), cfg.shared_ttl_s)
        if shared is not None and stale:
            shared.remember(stale, chosen.name)
        return chosen, reason

    # -- decision ---------------------------------------------------------------------------------
    def _choose(
        self, candidates: Sequence[Backend], pin: int, pin_blocks: int, match: tuple[int, str | None], now: float
    ) -> tuple[Backend, str]:
        cfg = self.config
        n = len(candidates)
        rates = self.smoothed(candidates, now)
        flights = self.loads(candidates)
        self._fleet_rate = total = sum(rates)
        mean = (total + 1.0) / n
        cap = (1.0 + cfg.epsilon) * mean + cfg.load_slack
        qcap = math.ceil((1.0 + cfg.epsilon) * (sum(flights) + 1) / n) + cfg.queue_slack

        matched, owner = match
        entry = self.pins.get(pin)
        # a continuation follows its conversation only while that replica is one of its tenant's:
        # after the tenant moved (or this conversation spilled) it goes where the tenant's prompt
        # is, recomputing its own turns once, rather than keep the prompt alive in a second cache
        # for as long as its conversations last
        if owner is not None and matched > pin_blocks and (entry is None or owner in entry[0]):
            for i, backend in enumerate(candidates):
                if backend.name == owner:
                    if rates[i] + 1 <= cap + cfg.continuation_slack * mean and flights[i] + 1 <= qcap:
                        return backend, "prefix-hit"
                    break

        if entry is None:
            ranked = self._ranked(candidates, rates, flights, cap, qcap, pin, ())
            # the shared table may correct the first choice to an equally good one (see _place)
            self._placing = [(b.name, count) for k, count, b in ranked[:_PLACE_CHOICES] if k[:3] == ranked[0][0][:3]]
            return ranked[0][2], "place"
        members, stamp = entry
        best = -1
        present = 0
        for name in members:
            for i, backend in enumerate(candidates):
                if backend.name == name:
                    present += 1
                    if rates[i] + 1 <= cap and flights[i] + 1 <= qcap and (best < 0 or rates[i] < rates[best]):
                        best = i
                    break
        self._refresh(pin, members, stamp, now)
        if best >= 0:
            if len(members) > 1:
                self._maybe_shrink(pin, members, n, now)
            return candidates[best], "pinned"
        # A tenant grows only when its own traffic needs more replicas than it has (a copy of its
        # prompt elsewhere costs misses and cache space) and once enough history says so: while
        # warming up, or when others' traffic makes its replicas busy, it stays on them up to the
        # looser (continuation) bound, beyond that single requests spill without changing its set.
        if present and not self._may_grow(pin, len(members), n):
            # before warm-up ends (shares unknown) only a real queue makes it spill: a spilled
            # conversation copies the prompt elsewhere and its later turns stay there
            hard = cap + cfg.continuation_slack * mean if self._warm(now) else math.inf
            for name in members:
                for i, backend in enumerate(candidates):
                    if backend.name == name:
                        if rates[i] + 1 <= hard and flights[i] + 1 <= qcap and (best < 0 or rates[i] < rates[best]):
                            best = i
                        break
            if best >= 0:
                return candidates[best], "pinned"
            # a spilled conversation copies the prompt and stays where it went: the packing
            # repair should look at this soon rather than at its next period
            self._next_repair = min(self._next_repair, now + _SPILL_REPAIR_S)
            return self._best(candidates, rates, flights, cap, qcap, pin, members, grow=True), "spill"
        # every member is over the bound (or gone): grow the set by the best other replica
        chosen = self._best(candidates, rates, flights, cap, qcap, pin, members, grow=present > 0)
        if present and self.shared is not None:
            if self.shared.up:
                self._growing = (members, members + (chosen.name,))
                return chosen, "grow"
            return chosen, "spill"
        self._set(pin, members + (chosen.name,) if present else (chosen.name,), now)
        return chosen, "spill" if present else "pinned"

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
        mean_rate = (sum(rates) + n) / n
        mean_count = (sum(counts.get(b.name, 0) for b in candidates) + n) / n
        # cache room: no replica takes more than its share of tenants' prompts (rounded up)
        slots = math.ceil((sum(counts.get(b.name, 0) for b in candidates) + (0 if exclude and not grow else 1)) / n)
        ranked = []
        for i, backend in enumerate(candidates):
            fits = rates[i] + 1 <= cap and flights[i] + 1 <= qcap
            count = counts.get(backend.name, 0)
            score = (rates[i] + 1) / mean_rate + (0.5 if grow else 1.0) * (count + 1) / mean_count
            k = (backend.name in exclude, not fits, count + 1 > self._capacity(backend, slots), round(score, 6),
                 -rendezvous_weight(pin, backend.salt))
            ranked.append((k, count, backend))
        ranked.sort(key=lambda r: r[0])
        return ranked

    # -- packing repair ---------------------------------------------------------------------------
    async def _repair(self, candidates: Sequence[Backend], now: float) -> None:
        """Every `rebalance_interval_s` (sooner after a spill), in a task of its own, apply `_plan`'s
        changes. With Redis only one proxy plans (it holds a lease while it lives, so one estimate
        of the tenants' shares decides and proxies never undo each other's moves), through
        compare-and-set on the shared table."""
        cfg = self.config
        shared = self.shared
        if not self._warm(now) or (shared is not None and not shared.up):
            return
        if shared is not None and not await shared.lease("repair", 3 * cfg.rebalance_interval_s):
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
        `share(pin)` the tenant's share of the traffic (default: of this proxy's)."""
        share_of = share or self._share
        n = len(candidates)
        where = {b.name: i for i, b in enumerate(candidates)}
        counts, fixed = [0] * n, [0.0] * n
        flex: list[tuple[float, list[int]]] = []
        singles: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        hold = now - self.config.move_after_s
        for pin, (members, stamp) in self.pins.items():
            inside = [where[m] for m in members if m in where]
            if not inside:
                continue
            share = share_of(pin)
            for i in inside:
                counts[i] += 1
            if len(inside) > 1:
                flex.append((share, inside))
                continue
            fixed[inside[0]] += share
            if len(members) == 1 and max(stamp, self._changed.get(pin, 0.0)) < hold:
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
        undo = now - self.config.cool_down_s
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

    async def _grow(self, candidates: Sequence[Backend], pin: int, chosen: Backend, now: float) -> tuple[Backend, str]:
        """Grow the set through the shared table (compare-and-set): when another proxy changed it
        first, follow its set: its least-loaded member, or `chosen` if it is a member."""
        old, new = self._growing
        members = self.shared.grow(pin, old, new)  # type: ignore[union-attr]
        self._changed[pin] = now
        self._epoch += 1
        if members == new:
            log.info("tenant %016x (share %.3f) grows to %s", pin, self._share(pin), ",".join(new))
        if members is None or chosen.name in members:
            return chosen, "spill"
        inside = [b for b in candidates if b.name in members]
        if not inside:
            return chosen, "spill"
        rates = self.smoothed(inside, now)
        return inside[min(range(len(inside)), key=rates.__getitem__)], "pinned"

    def _rendezvous(self, candidates: Sequence[Backend], pin: int, now: float) -> tuple[Backend, str]:
        """Stateless fallback: the pin's rendezvous order, first replica under the bound."""
        cfg = self.config
        rates = self.smoothed(candidates, now)
        cap = (1.0 + cfg.epsilon) * (sum(rates) + 1.0) / len(candidates) + cfg.load_slack
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
            self.pins[pin] = (tuple(members), now)

    def _refresh(self, pin: int, members: tuple[str, ...], stamp: float, now: float) -> None:
        if now - stamp > self.config.shared_ttl_s / 2 and (self.shared is None or self.shared.up):
            self._set(pin, members, now)

    def _maybe_shrink(self, pin: int, members: tuple[str, ...], n: int, now: float) -> None:
        """Drop the last member once the tenant's traffic fits in one replica less (with
        hysteresis below the growth threshold), and its set has not changed for cool_down_s."""
        changed = self._changed.get(pin)
        if changed is None:
            self._changed[pin] = now
            return
        if now - changed < self.config.cool_down_s:
            return
        if self._share(pin) * n < (len(members) - 1) * self.config.grow_fill * 0.75:
            log.info("tenant %016x (share %.3f) shrinks to %s", pin, self._share(pin), ",".join(members[:-1]))
            self._set(pin, members[:-1], now)

    def _forget(self, now: float) -> None:
        """Bound the per-tenant tables, which grow with every distinct system prompt a client
        sends: drop expired placements (the Redis mirror expires its own) and, beyond
        `max_tenants`, the stalest (a used placement is rewritten every shared_ttl_s / 2); then the
        rates and stamps of tenants not placed. Amortised: runs again only once the rate table has
        doubled (capped just above the limit)."""
        cfg, pins = self.config, self.pins
        if self.shared is None:
            for pin in [p for p, (_, stamp) in pins.items() if now - stamp > cfg.shared_ttl_s]:
                del pins[pin]
        if len(pins) > cfg.max_tenants:
            for pin, _ in sorted(pins.items(), key=lambda kv: kv[1][1])[:len(pins) - cfg.max_tenants * 9 // 10]:
                del pins[pin]
        self._changed = {p: t for p, t in self._changed.items() if p in pins}
        self._came_from = {p: v for p, v in self._came_from.items() if p in pins}
        rates = self.tenant_rate.scaled
        self.tenant_rate.scaled = {k: v for k, v in rates.items() if k is None or k in pins}
        self._epoch += 1
        self._forget_at = min(max(2 * len(self.tenant_rate.scaled), 1024), cfg.max_tenants * 11 // 10)

    def _seen(self, now: float) -> float:
        """Requests this proxy routed (decayed)."""
        return self.tenant_rate.scaled.get(None, 0.0) / self.tenant_rate.factor(now)

    def _warm(self, now: float) -> bool:
        """Enough traffic over all proxies (and some here) for the tenants' shares to mean something."""
        need = self.config.grow_min_requests
        return self._fleet_rate >= need and self._seen(now) >= need / 4

    def _may_grow(self, pin: int, size: int, n: int) -> bool:
        """Enough history, and the tenant alone nearly fills the replicas it has, even at the low
        end of what its share could be: estimated from this proxy's requests (a third of them
        with three proxies), a 10 % tenant often looks like 25 % early on, and a needless copy of
        its prompt costs every replica involved cache room for good."""
        if not self._warm(time.time()):
            return False
        share = self._share(pin)
        low = share - _GROW_SIGMAS * math.sqrt(share * (1.0 - share) / max(self._seen(time.time()), 1.0))
        return low * n >= size * self.config.grow_fill

    def _tenant_requests(self, now: float) -> tuple[dict[int, float], float] | None:
        """(tenant -> decayed requests routed here, all of them), published for the other proxies'
        packing repair; None past _PUBLISH_TENANTS (copying and ranking them each second would
        stall the event loop; the planner then counts this proxy's requests out of its shares)."""
        if len(self.tenant_rate.scaled) > _PUBLISH_TENANTS:
            return None
        snapshot = self.tenant_rate.snapshot(now)
        return snapshot, snapshot.pop(None, 0.0)

    def _fleet_share(self, now: float, others: tuple[dict[int, float], float] | None):
        """share(pin) over every proxy's requests: this proxy's counts plus the others' published ones."""
        if not others or others[1] <= 0:
            return self._share
        rates, total = others
        down = 1.0 / self.tenant_rate.factor(now)
        scaled = self.tenant_rate.scaled
        whole = scaled.get(None, 0.0) * down + total
        return lambda pin: (scaled.get(pin, 0.0) * down + rates.get(pin, 0.0)) / whole

    def _share(self, pin: int) -> float:
        """This tenant's share of the requests routed here (decayed)."""
        scaled = self.tenant_rate.scaled
        return scaled.get(pin, 0.0) / max(scaled.get(None, 0.0), 1e-9)

    def _tenant_counts(self) -> dict[str, int]:
        """Tenants per replica, recomputed only when the table changed."""
        shared = self.shared
        version = (len(self.pins), self._epoch, shared.pins_changed if shared is not None else 0)
        if version != self._counts_version:
            counts: dict[str, int] = {}
            for members, _ in self.pins.values():
                for name in members:
                    counts[name] = counts.get(name, 0) + 1
            self._counts, self._counts_version = counts, version
            self._slots_total = sum(counts.values())
        return self._counts
