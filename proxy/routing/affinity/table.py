"""The tenant table: each tenant's replica set (in a store, local or shared) and what the
policy remembers about it: when its set last changed, where the packing repair last moved it
from, and the active tenants per replica (cached: counting walks the whole table)."""
from __future__ import annotations

import math
from collections import deque
from typing import Callable, Final, Sequence

from proxy.config import AffinityConfig
from proxy.routing.backends import Backend
from proxy.routing.affinity.store import TenantStore
from proxy.routing.affinity.tenants import TenantStats

CHARS_PER_TOKEN: Final = 4  # to size a system prompt (pin blocks x block_chars) in cache tokens
# a placement reaches the other proxies' mirrors in ~1 ms (proxy/shared.py: flushed at once, read
# from the stream); until well after that, this proxy's own placements stand for the others' of the
# same moment too (`TenantTable.herd`). Far below the gap between newcomers outside a burst
_HERD_S: Final = 0.05
_HERD_MAX: Final = 64


class TenantTable:
    def __init__(self, config: AffinityConfig, store: TenantStore, tenants: TenantStats,
                 wall: Callable[[], float]) -> None:
        self.config = config
        self.block_chars: int = config.block_chars  # (read on every request: typed)
        self.shared_ttl_s: float = config.shared_ttl_s
        self.store = store
        self.pins = store.pins
        self.tenants = tenants
        self.changed: dict[int, float] = {}  # pin -> clock when its set last changed (as seen here)
        self.shrink_seen: dict[int, tuple[str, ...]] = {}  # pin -> its set as the shrink check saw it last
        self.came_from: dict[int, tuple[str, float]] = {}  # pin -> (replica, clock) of its last repair move
        self.epoch = 0  # bumped on every table change made here
        self.forget_at = min(1024, config.max_tenants)  # rate-table size that triggers `forget`
        self.prompt_chars = 0.0  # request-weighted moving mean of the system prompt's size
        self._counts: dict[str, int] = {}  # active tenants per replica, cached for `_version`
        self._version: tuple = ()
        self._recount_at = 0.0
        self._wall = wall
        # (replica, wall time) of the tenants this proxy placed within the last _HERD_S: placed
        # before the other proxies' placements of the same moment reached this one (`herd`)
        self.placed: deque[tuple[str, float]] = deque()

    def set(self, pin: int, members: Sequence[str], now: float) -> None:
        self.epoch += 1
        self.changed[pin] = now
        self.store.set(pin, members)

    def changed_by_store(self, pin: int, now: float, restart: bool = True) -> None:
        """The store took a change (a placement or a set change through it). `restart` False: a
        member of a multi-replica set was replaced in place, which restarts neither the set's
        cool-down nor the repair's hold on it (`came_from` holds it)."""
        if restart:
            self.changed[pin] = now
        self.epoch += 1

    def refresh(self, pin: int, members: tuple[str, ...], stamp: float, wall: float, now: float) -> None:
        """Rewrite a used placement before the shared table's TTL (wall time) expires it."""
        if wall - stamp > self.shared_ttl_s / 2 and self.store.up:
            self.set(pin, members, now)

    def note_prompt(self, pin_blocks: int) -> None:
        chars = (1 if 1 > pin_blocks else pin_blocks) * self.block_chars  # (max without the call)
        self.prompt_chars += (chars - self.prompt_chars) * (0.01 if self.prompt_chars else 1.0)

    def capacity(self, backend: Backend, default):
        """Tenant prompts the replica's cache keeps: `cache_fill` of its size over the mean system
        prompt, once scraped; else `default`."""
        if backend.cache_tokens and self.prompt_chars:
            return self.config.cache_fill * backend.cache_tokens * CHARS_PER_TOKEN / self.prompt_chars
        return default

    def crowded(self, backends: Sequence[Backend], now: float) -> bool:
        """Whether these replicas hold more active tenants' prompts than their caches keep
        (`capacity`; never before their cache sizes are scraped)."""
        counts = self.counts(now)
        held = 0
        room = 0.0
        for backend in backends:
            held += counts.get(backend.name, 0)
            room += self.capacity(backend, math.inf)
        return held > room

    def counts(self, now: float) -> dict[str, int]:
        """Active (not idle) tenants per replica; recomputed when the table changed, and every
        quarter repair period as tenants go idle."""
        pins = self.pins
        version = (len(pins), self.epoch, self.store.changes)
        if version != self._version or now >= self._recount_at:
            wall = self._wall()
            idle = self.tenants.idle
            counts: dict[str, int] = {}
            for pin, (members, _) in pins.items():
                if not idle(pin, now, wall):
                    for name in members:
                        counts[name] = counts.get(name, 0) + 1
            self._counts, self._version = counts, version
            self._recount_at = now + max(self.config.rebalance_every_requests / 4, len(pins) / 64)
        return self._counts

    def note_placed(self, name: str) -> None:
        """This proxy placed a new tenant on `name` (`herd`)."""
        placed = self.placed
        placed.append((name, self._wall()))
        if len(placed) > _HERD_MAX:
            placed.popleft()

    def herd(self, proxies: float) -> dict[str, float]:
        """The tenants the other proxies are likely placing beside this one's latest placements,
        per replica: (proxies - 1) for each tenant this proxy placed in the last _HERD_S. When a
        population changes, every proxy places its share of the newcomers within the same
        milliseconds, before any sees the others' choices (a placement reaches them in ~1 ms);
        deciding on the same counts, each stacked its newcomers on the same replica (three
        proxies: up to 8 of the first 13 newcomers on one replica of five, where one proxy placed
        3-4 there). Counted so, this proxy's next newcomer goes where the fleet's likely did not."""
        out: dict[str, float] = {}
        if proxies <= 1.5:  # (one proxy: its own counts are the fleet's)
            return out
        placed = self.placed
        old = self._wall() - _HERD_S
        while placed and placed[0][1] < old:
            placed.popleft()
        for name, _ in placed:
            out[name] = out.get(name, 0.0) + proxies - 1.0
        return out

    def forget(self, now: float) -> None:
        """Bound the per-tenant tables, which grow with every distinct system prompt a client
        sends: drop idle placements (the Redis mirror expires its own) and, beyond `max_tenants`,
        the least recently used; then the rates and stamps of tenants not placed. Amortised: runs
        again only once the rate table has doubled (capped just above the limit)."""
        cfg, pins, tenants = self.config, self.pins, self.tenants
        wall = self._wall()
        self.store.forget_idle(lambda p: tenants.idle(p, now, wall))
        if len(pins) > cfg.max_tenants:
            seen = tenants.seen
            recent = sorted(pins, key=lambda p: seen[p].last if p in seen else -math.inf)
            for pin in recent[:len(pins) - cfg.max_tenants * 9 // 10]:
                del pins[pin]
        self.changed = {p: t for p, t in self.changed.items() if p in pins}
        self.shrink_seen = {p: m for p, m in self.shrink_seen.items() if p in pins}
        self.came_from = {p: v for p, v in self.came_from.items() if p in pins}
        tenants.keep(pins)
        self.epoch += 1
        self.forget_at = min(max(2 * len(tenants.rate.scaled), 1024), cfg.max_tenants * 11 // 10)
