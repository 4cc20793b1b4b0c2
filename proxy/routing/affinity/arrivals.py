"""A new tenant's first requests at several proxies at once: one proxy places it, the others wait
a moment for its placement before placing it themselves.

A new tenant's placement is first-writer-wins in the shared table (proxy/shared.py), but the
first request of a proxy that lost the race has gone to its own choice already: it computed the
prompt in a second cache, and the requests that followed it there computed it again rather than
wait for the winner's leader, whose "being computed" had not reached them
(proxy/routing/affinity/coalesce.py). When a population changes, its busy tenants' first requests
reach every proxy within the same milliseconds, so they raced: three proxies at concurrency 64
placed 0.5 % of the pooled bound's hits in a second cache this way (loadtest.affinity_drift, the
new conversations sent within 64 requests of their tenant's first to another replica).

So the proxies rank themselves per tenant by rendezvous hashing of their ids (each computes the
same order without talking): the first places at once; the k-th holds the request up to k
delivery times for a placement to arrive, and places it itself if none did. A delivery time is
the 90th percentile of this proxy's own placements', from the write to their return on the
change stream (`SharedState.delivery_s`), at most `placement_hold_s` (0: never hold). Only
proxies that routed within the last second rank (one that takes no traffic would hold every
newcomer for nothing), and only while newcomers come back: a tenant seen once (a unique prompt)
is never raced for, so when most of this proxy's recent newcomers got no second request within
`_BACK` requests, nothing waits; and only while holds pay: where each tenant's requests reach one
proxy only (an L4 balancer that keeps a client on one proxy), no placement ever comes, and once
nearly all of the last holds ran out, one newcomer in _PROBE_EVERY is held to see whether that
changed. Redis down, or no other proxy routing: nothing waits either.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Final

from proxy.routing.affinity.ranking import rendezvous_weight
from proxy.routing.backends import rendezvous_salt
from proxy.routing.affinity.tenants import TenantStats
from proxy.shared import SharedState

_MAX_WAITING: Final = 1024  # tenants held at once (beyond: placed at once)
_BACK: Final = 256.0  # requests (over all proxies) within which a newcomer's second request counts as coming back
_JUDGED: Final = 32  # newcomers the gate weighs (the last ones older than _BACK)
_MIN_JUDGED: Final = 8  # holds are allowed until this many were weighed
_BACK_SHARE: Final = 0.25  # holds go on while at least this share of them came back
_PAID_SHARE: Final = 0.125  # ... and this share of the last _JUDGED holds ended with another proxy's placement
_PROBE_EVERY: Final = 16  # else every this many-th newcomer is held all the same
_SPACING: Final = 1.0  # the wait per rank, in delivery times (their 90th percentile)
_MIN_SPACING_S: Final = 0.001


class Arrivals:
    def __init__(self, shared: SharedState, tenants: TenantStats, most_s: float) -> None:
        self.shared = shared
        self.tenants = tenants
        self._waiting: dict[int, asyncio.Future] = {}
        self._peers: tuple[str, ...] | None = None
        self._salts: list[int] = []
        self._own = -1
        # this proxy's newcomers not judged yet, (pin, clock when seen) oldest first, and their pins
        self._newcomers: deque[tuple[int, float]] = deque()
        self._unjudged: set[int] = set()
        self._judged: deque[bool] = deque(maxlen=_JUDGED)  # came back?
        self._paid: deque[bool] = deque(maxlen=_JUDGED)  # the last holds: did another proxy's placement end them?
        self._unpaid = 0  # newcomers not held since holds stopped paying
        self.most_s = most_s  # the longest wait a rank, however slow the stream (`placement_hold_s`)
        shared.on_placed = self.placed

    def hold_s(self, pin: int, now: float) -> float:
        """How long this proxy holds a new tenant's request (0: it places it now). `now`: the
        policy's clock."""
        if pin not in self._unjudged:
            self._unjudged.add(pin)
            self._newcomers.append((pin, now))
        peers = self.shared.peer_ids
        if not peers or not self.most_s or len(self._waiting) >= _MAX_WAITING or not self._coming_back(now):
            return 0.0
        if peers is not self._peers:
            self._peers, self._salts = peers, [rendezvous_salt(p) for p in peers]
            self._own = rendezvous_salt(self.shared.proxy_id)
        mine = rendezvous_weight(pin, self._own)
        rank = 0
        for salt in self._salts:
            if rendezvous_weight(pin, salt) > mine:
                rank += 1
        if not rank or not self._paying():
            return 0.0
        spacing = _SPACING * self.shared.delivery_s
        return rank * min(max(spacing, _MIN_SPACING_S), self.most_s)

    def _coming_back(self, now: float) -> bool:
        """Whether enough of this proxy's recent newcomers got a second request soon after."""
        newcomers, judged, seen = self._newcomers, self._judged, self.tenants.seen
        while newcomers and now - newcomers[0][1] >= _BACK:
            pin = newcomers.popleft()[0]
            self._unjudged.discard(pin)
            stats = seen.get(pin)
            judged.append(stats is not None and stats.last > stats.first)
        if len(newcomers) > 4 * _MAX_WAITING:  # (bounded, whatever the clock does)
            newcomers.clear()
            self._unjudged.clear()
        return len(judged) < _MIN_JUDGED or sum(judged) >= _BACK_SHARE * len(judged)

    def _paying(self) -> bool:
        """Whether holds end with another proxy's placement often enough (or this is a probe)."""
        paid = self._paid
        if len(paid) < _MIN_JUDGED or sum(paid) >= _PAID_SHARE * len(paid):
            return True
        self._unpaid += 1
        if self._unpaid >= _PROBE_EVERY:
            self._unpaid = 0
            return True
        return False

    @property
    def waiting(self) -> int:
        """Tenants whose requests are held now."""
        return len(self._waiting)

    async def wait(self, pin: int, seconds: float) -> None:
        """Until a placement of `pin` is in the mirror (another proxy's, or this one's), at most
        `seconds`."""
        future = self._waiting.get(pin)
        first = future is None  # (the first request held for this tenant here: its hold is the one judged)
        if future is None:
            future = self._waiting[pin] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait((future,), timeout=seconds)
        finally:
            if first:
                self._paid.append(future.done())
            if self._waiting.get(pin) is future and not future.done():
                del self._waiting[pin]

    def placed(self, pin: int) -> None:
        future = self._waiting.pop(pin, None)
        if future is not None and not future.done():
            future.set_result(None)
