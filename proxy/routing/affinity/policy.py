"""`PrefixAffinity`: the `prefix_affinity` policy object, wiring its parts for one request
(design: proxy/routing/affinity/__init__.py). The packing repair runs in a background task that
the runtime's task supervisor runs (`serve`), never from inside `pick`."""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Final, Sequence

from proxy.config import AffinityConfig, plain
from proxy.parse import CHAT, ParsedRequest
from proxy.prefix import prefix_key
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.index import PrefixIndex, longest_match
from proxy.routing.affinity.arrivals import Arrivals
from proxy.routing.affinity.balance import Balance
from proxy.routing.affinity.coalesce import Coalescer
from proxy.routing.affinity.counts import DecayedCounts
from proxy.routing.affinity.load import LoadView
from proxy.routing.affinity.placement import Placement
from proxy.routing.affinity.ranking import rendezvous_order
from proxy.routing.affinity.repair import Repair
from proxy.routing.affinity.store import LocalStore, SharedStore, TenantStore
from proxy.routing.affinity.table import CHARS_PER_TOKEN, TenantTable
from proxy.routing.affinity.tenants import YOUNG, TenantStats
from proxy.shared import SharedState

log: Final = logging.getLogger("vllm_proxy.affinity")

_COMPLETIONS: Final = "/v1/completions"
# tenths of a slower replica's cache (in characters, CHARS_PER_TOKEN a token) its index entries
# stand for: the cache also holds the replies and the tails past max_blocks that the index does
# not see. Replayed on the heterogeneous weak shape (seeds 0-15, with the packing's `slower_held`):
# 9 and 8 left as many cold prompts on the slow replica (~28 a run), 9 kept a little more of the
# pooled bound (0.963 against 0.960 over seeds 0-7); at 10 a quarter of the evictions went unseen.
_INDEXED_TENTHS: Final = 9


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, config: AffinityConfig, shared: SharedState | None = None, *, timer: Any = time) -> None:
        """`timer`: where wall and monotonic time are read (`time()`, `monotonic()`): the time
        module, or a simulated clock in the offline benchmarks."""
        self.config = config
        config = plain(config)  # (the parts read it on every request)
        # what every request reads, typed (compiled, unboxed)
        self._block_chars: int = config.block_chars
        self._max_blocks: int = config.max_blocks
        self._shared_ttl_s: float = config.shared_ttl_s
        self.shared = shared
        self.index = PrefixIndex(config.index_blocks_per_backend)
        self._wall = timer.time
        self._monotonic = timer.monotonic
        self.store: TenantStore = SharedStore(shared) if shared is not None else LocalStore(timer.time)
        self.pins = self.store.pins
        self.view = LoadView(config, shared, timer.time)
        self.tenants = TenantStats(config, self.view, self.pins)
        self.table = TenantTable(config, self.store, self.tenants, timer.time)
        self.balance = (Balance(config.balance_window_requests, config.balance_epsilon, config.continuation_slack,
                                config.speed_balance, shared, timer.time, config.speed_balance_epsilon,
                                config.balance_burst)
                        if config.balance_window_requests else None)
        self.repair = Repair(config, self.view, self.tenants, self.table, self.store, timer.time,
                             self.balance.recent_counts if self.balance is not None else None)
        if shared is not None and self.balance is not None:
            shared.local_guard, shared.adopt_overflows = self.balance.snapshot, self.balance.adopt
            shared.stream_guard = self.balance.streamed
        self.coalescer = None
        if config.coalesce_wait_s > 0:
            self.coalescer = Coalescer(config.coalesce_wait_s, shared.warming if shared is not None else None)
            if shared is not None:
                shared.on_warming = self.coalescer.remote
                shared.warm_ttl = config.coalesce_wait_s
        self.placement = Placement(config, self.view, self.tenants, self.table, self.store, self.repair.soon,
                                   self.balance)
        # route -> replica names of its last request; and (its replicas, name -> position) to
        # skip comparing names while the candidates are the same objects
        self._fleets: dict[str, tuple[str, ...]] = {}
        self._where: dict[str, tuple[tuple[Backend, ...], dict[str, int]]] = {}
        # the last decision's bookkeeping, until `settle` (`pick_now`); `_due` None: nothing due
        self._due: Backend | None = None
        self._due_pin = 0
        self._due_now = 0.0
        self._due_returning = False
        self._due_chain: tuple[int, ...] = ()
        # a new tenant's first request waits for the shared table's answer to its placement
        # (`pick`): its pin and how long at most; `_placing` set while that request decides
        self.arrivals = Arrivals(shared, self.tenants, config.placement_hold_s) if shared is not None else None
        self._hold_pin = 0
        self._hold_s = 0.0
        self._placing = False
        if shared is not None:
            shared.local_tenants = lambda wall: self.tenants.requests(self.view.clock)
            # each proxy weighs a busy tenant's growth and shrinking on every proxy's requests
            self.tenants.sharing = True
            shared.local_hot, shared.on_hot = lambda: self.tenants.hot(self.view.clock), self.tenants.adopt

    # -- lifecycle: the packing repair's background task ---------------------------------------------
    async def serve(self) -> None:
        """Run the packing repairs requests mark due, until cancelled (the runtime's supervisor
        runs it as a task)."""
        await self.repair.serve()

    async def maintain(self) -> None:
        """Run the packing repair if a request marked it due (what the background task does;
        for callers that route without it, like the offline benchmarks and tests)."""
        await self.repair.run_due()

    # -- what other parts read -----------------------------------------------------------------------
    @property
    def clock(self) -> float:
        """The policy's clock: requests routed over all proxies (estimated)."""
        return self.view.clock

    @property
    def routed(self) -> DecayedCounts:
        return self.view.routed

    @property
    def tenant_rate(self) -> DecayedCounts:
        return self.tenants.rate

    def load(self, backend: Backend) -> int:
        """Instantaneous in-flight requests over all proxies (also used by the LoRA manager)."""
        return self.view.loads((backend,))[0]

    def loads(self, candidates: Sequence[Backend]) -> list[int]:
        return self.view.loads(candidates)

    def smoothed(self, candidates: Sequence[Backend], now: float) -> list[float]:
        return self.view.smoothed(candidates, now)

    # -- the decision --------------------------------------------------------------------------------
    async def pick(self, candidates: Sequence[Backend], request: ParsedRequest, route: Route) -> tuple[Backend, str]:
        backend, reason = self.pick_now(candidates, request, route)
        if backend is None:  # a new tenant other proxies may be placing at once: confirm its placement
            backend, reason = await self._confirmed(candidates, request, route)
        if self._due is not None:
            self.settle()
        return backend, reason

    async def _confirmed(self, candidates: Sequence[Backend], request: ParsedRequest,
                         route: Route) -> tuple[Backend, str]:
        """Decide a new tenant's request (placing it), then wait for the shared table's answer to
        that placement before it goes: where another proxy wrote first, it goes there instead
        (arrivals.py). The decision's bookkeeping waits aside meanwhile (decisions made in the
        meantime settle theirs), and is settled on the replica the request goes to."""
        arrivals = self.arrivals
        assert arrivals is not None
        pin, wait = self._hold_pin, self._hold_s
        self._placing = True
        try:
            backend, reason = self.pick_now(candidates, request, route)
        finally:
            self._placing = False
        assert backend is not None
        due = (self._due_pin, self._due_now, self._due_returning, self._due_chain)
        self._due = None
        answer = await arrivals.confirm(pin, wait)
        if answer is not None and not answer[1]:  # another proxy placed it first
            members = answer[0]
            to = backend if backend.name in members else next((b for b in candidates if b.name in members), None)
            if to is not None:
                arrivals.lost += 1
                self._redirect(request, pin, to)
                backend = to
        if self._due is not None:
            self.settle()
        self._due = backend
        self._due_pin, self._due_now, self._due_returning, self._due_chain = due
        return backend, reason

    def _redirect(self, request: ParsedRequest, pin: int, to: Backend) -> None:
        """`request`'s tenant was placed first by another proxy: it goes to `to`, following the
        leader computing the prompt there rather than leading where it was decided."""
        coalescer = self.coalescer
        if coalescer is None:
            return
        leader = coalescer.yield_lead(pin, to.name, request)
        if leader is not None:
            request.wait_for = partial(coalescer.follow, leader)

    def pick_now(self, candidates: Sequence[Backend], request: ParsedRequest,
                 route: Route) -> tuple[Backend | None, str]:
        """The decision, its bookkeeping (the tenant's and the replica's counts, the index entry)
        left for `settle`: the data path sends the request first and settles then (Scheduler.settle),
        so at one request at a time that work overlaps the replica's instead of preceding it. What a
        decision left is settled before the next one decides. (None, "hold"): a new tenant another
        proxy may be placing now; nothing was decided or counted, and `pick` decides it and waits
        for the shared table's answer to its placement."""
        if self._due is not None:
            self.settle()
        endpoint = request.endpoint
        if endpoint != CHAT and endpoint != _COMPLETIONS:
            return min(candidates, key=self.load), "least-loaded"
        block_chars = self._block_chars
        pin, chain, pin_blocks = prefix_key(endpoint == CHAT, request.data, route.upstream_id, block_chars,
                                            self._max_blocks)
        shared = self.shared
        if (shared is not None and pin_blocks and not self._placing and (pin not in self.pins or pin in shared.claims)
                and shared.up):
            arrivals = self.arrivals
            wait = arrivals.wait_s(pin, self.view.clock) if arrivals is not None else 0.0
            if wait > 0.0:  # nothing counted yet: `pick` decides, then waits for the placement's answer
                self._hold_pin, self._hold_s = pin, wait
                return None, "hold"
        match: tuple[int, str | None] | None = None
        if shared is not None:
            shared.busy = True
            shared.routed += 1
            # (SharedState.longest, without an interpreted call: the mirror once filled, else the local index)
            if chain and shared.mirrored:
                match = longest_match(shared.owner, chain)
        if match is None:
            match = self.index.longest(chain)
        wall = self._wall()
        now = self.view.tick(wall)
        where = self._positions(route.name, candidates, now)
        self.table.note_prompt(pin_blocks)
        if now >= self.repair.next_at:  # (the check itself: an interpreted call)
            self.repair.check(candidates, now)
        tenants = self.tenants
        returning = self.placement.returning = pin in self.pins and tenants.idle(pin, now, wall)
        chosen, reason = self.placement.decide(route.name, candidates, where, pin, pin_blocks, match, now, wall)
        if self.balance is not None:
            entry = self.pins.get(pin)
            owner = match[1] if match[0] >= pin_blocks else None  # where its prompt is cached, if known
            chosen, capped = self.balance.check(route.name, candidates, chosen, pin, entry[0] if entry else (),
                                                owner == chosen.name and match[0] > pin_blocks, self.view.proxies,
                                                owner)
            if capped:
                reason = "balance"
                if entry is not None and chosen.name not in entry[0] and self.balance.settled(route.name, pin):
                    self.placement.overflowed(pin, entry[0], chosen, len(candidates), now)
        self._due = chosen
        self._due_pin = pin
        self._due_now = now
        self._due_returning = returning
        self._due_chain = chain
        if chain:
            coalescer = self.coalescer
            known = match[0] >= pin_blocks and match[1] == chosen.name
            # (no call while nothing is being computed and this request will not lead)
            if coalescer is not None and pin_blocks and (coalescer.warming or not known and request.stream):
                leader = coalescer.check(pin, chosen.name, known, request)
                if leader is not None:  # (awaited by the data path, counted in flight: not here)
                    request.wait_for = partial(coalescer.follow, leader)
        return chosen, reason

    def settle(self) -> None:
        """Count the last decision (`pick_now`): on its replica's load, in its tenant's rates, and
        its prompt's blocks in the index (and the shared mirror)."""
        chosen = self._due
        if chosen is None:
            return
        self._due = None
        name, now, chain = chosen.name, self._due_now, self._due_chain
        self.view.count(name, now)
        tenants = self.tenants
        tenants.note(self._due_pin, now, self._due_returning)
        if len(tenants.rate.scaled) > self.table.forget_at:
            self.table.forget(now)
        balance = self.balance
        # (a fresh start's first tenants change nothing: all this proxy counted is theirs)
        if tenants.changed() and now >= YOUNG:
            self.view.restart(now)
            if balance is not None and balance.restart(lambda pin: tenants.young(pin, now)):
                log.info("the tenants changed: the balance guard starts its windows anew")
        if chain:
            # a slower replica's entries are sized like its scraped cache, so that the index knows
            # when a tenant's prompt left it (proxy/routing/affinity/placement.py: `_off_slower`)
            limit = 0
            if chosen.load_factor > 1.0 and chosen.cache_tokens:
                limit = chosen.cache_tokens * CHARS_PER_TOKEN * _INDEXED_TENTHS // (10 * self._block_chars)
            stale = self.index.record(chain, name, self._monotonic(), self._shared_ttl_s, limit)
            shared = self.shared
            if shared is not None and stale:
                shared.remember(stale, name)

    def _positions(self, route: str, candidates: Sequence[Backend], now: float) -> dict[str, int]:
        """Replica name -> position in `candidates`; notes a change of the route's replicas."""
        known = self._where.get(route)
        # the same replica objects (compared by identity); usually the route's own tuple
        if known is not None and (known[0] is candidates or known[0] == tuple(candidates)):
            return known[1]
        fleet = tuple(candidates)
        names = self._fleets.get(route)
        if names is None or len(names) != len(candidates) or any(a != b.name for a, b in zip(names, candidates)):
            self._membership(route, candidates, now)
        where: dict[str, int] = {}
        for i, backend in enumerate(candidates):
            where.setdefault(backend.name, i)
        self._where[route] = (fleet, where)
        return where

    def _membership(self, route: str, candidates: Sequence[Backend], now: float) -> None:
        """The route's healthy replicas changed: a replica that left takes its index entries (its
        cache is gone or going); one that joined gets its load ramped up (`LoadView.smoothed`)."""
        names = tuple(b.name for b in candidates)
        known = self._fleets.get(route)
        self._fleets[route] = names
        if known is None:
            return
        for name in set(known) - set(names):
            self.index.forget(name)
            self.view.joined.pop(name, None)
            log.info("replica %s left: its tenants are re-homed on their next request", name)
        for name in set(names) - set(known):
            self.view.joined[name] = now
            moved = self._share_out(candidates, name, now)
            log.info("replica %s joined: %d light tenants moved to it; placement and the packing repair fill it",
                     name, moved)
        self.repair.soon(now)

    def _share_out(self, candidates: Sequence[Backend], name: str, now: float) -> int:
        """A replica joined while the others hold more tenants' prompts than a cache keeps: it
        takes its part of their light tenants at once (those under `join_share` of a replica's part
        of the traffic whose rendezvous choice among the new fleet is it: every proxy picks the same).
        Left to the packing repair (two changes every few hundred requests; then only of tenants with
        settled rates) the old replicas stayed as crowded as before and the new one held the hot
        tenants the repair moved to fill its traffic: a join under a running population of 60-90
        tenants whose caches hold a fifth of their prompts kept 0.87-0.94 of the pooled bound for
        the rest of that population (docs/BENCHMARKS.md). Returns how many moved."""
        joined = next(b for b in candidates if b.name == name)  # (`name` is one of theirs)
        if not self.config.join_share or not self.table.crowded([b for b in candidates if b is not joined], now):
            return 0
        names = {b.name for b in candidates}
        wall = self._wall()
        light = self.config.join_share / len(candidates)
        moved = 0
        for pin, (members, _) in list(self.pins.items()):
            if len(members) != 1 or members[0] == name or members[0] not in names:
                continue
            if self.tenants.idle(pin, now, wall) or self.tenants.current(pin, now) > light:
                continue
            if rendezvous_order(pin, candidates)[0] is joined and self.store.change(pin, members, (name,)) is not None:
                self.table.changed_by_store(pin, now)
                self.table.came_from[pin] = (members[0], now)  # (the repair does not move it straight back)
                moved += 1
        return moved
