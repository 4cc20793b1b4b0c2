"""A new tenant's first request at this proxy waits for the shared table to confirm its placement.

A new tenant's placement is first-writer-wins in the shared table (proxy/shared.py). Each proxy
places a tenant it has not seen yet by its own view, at once; when another proxy wrote first, this
one adopts that placement, but its request has gone to its own choice already: it computed the
prompt in a second cache, and the conversations it started there stayed there. When a population
changes, its busy tenants' first requests reach every proxy within the same milliseconds (a
closed loop of 64 clients sends 64 requests at once), faster than the change stream carries one
proxy's placement to another. Ranking the proxies per tenant and holding the later-ranked ones'
requests for the first's placement, for a few stream delivery times, did not cover that burst:
on two cores the first-ranked proxy's placement took longer to arrive than the hold (three
proxies at 1x the rate: the first 128 requests of a new population lost 0.59 % of the pooled
bound against 0.14 % with one proxy, its busy tenants placed on two or three replicas).

So the request waits for the answer to its own placement instead: the placement goes out at
once (the flusher batches whatever is queued), the shared table answers with the placement in
force, and the request goes there: this proxy's choice, or the one another proxy wrote first.
Proxies placing a tenant at once then agree before any of them sends its request, whatever the
stream's delay. The wait is one Redis round trip, at most `placement_hold_s` (0: never wait).

Nothing waits without Redis, while no other proxy shares it (`SharedState.alone`), when the
tenant has no system prompt, or while this proxy's recent newcomers mostly got no second request
within `_BACK` requests: a unique prompt is never raced for.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Final

from proxy.routing.affinity.tenants import TenantStats
from proxy.shared import SharedState

_MAX_WAITING: Final = 1024  # requests waiting for an answer at once (beyond: placed without one)
_BACK: Final = 256.0  # requests (over all proxies) within which a newcomer's second request counts as coming back
_JUDGED: Final = 32  # newcomers the gate weighs (the last ones older than _BACK)
_MIN_JUDGED: Final = 8  # waits are allowed until this many were weighed
_BACK_SHARE: Final = 0.25  # waits go on while at least this share of them came back


class Arrivals:
    def __init__(self, shared: SharedState, tenants: TenantStats, most_s: float) -> None:
        self.shared = shared
        self.tenants = tenants
        self.waiting = 0  # requests waiting for their placement's answer now
        self.lost = 0  # placements another proxy had written first (their requests went there)
        # this proxy's newcomers not judged yet, (pin, clock when seen) oldest first, and their pins
        self._newcomers: deque[tuple[int, float]] = deque()
        self._unjudged: set[int] = set()
        self._judged: deque[bool] = deque(maxlen=_JUDGED)  # came back?
        self.most_s = most_s  # the longest wait, however slow Redis (`placement_hold_s`)

    def wait_s(self, pin: int, now: float) -> float:
        """How long a new tenant's request may wait for its placement's answer (0: it goes at
        once). `now`: the policy's clock."""
        if not self.most_s or self.shared.alone():  # (nobody to race with: newcomers are not judged either)
            return 0.0
        if pin not in self._unjudged:
            self._unjudged.add(pin)
            self._newcomers.append((pin, now))
        if self.waiting >= _MAX_WAITING or not self._coming_back(now):
            return 0.0
        return self.most_s

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

    async def confirm(self, pin: int, seconds: float) -> tuple[tuple[str, ...], bool] | None:
        """(The members in force, whether this proxy's placement made them) once the shared table
        answered this proxy's placement of `pin` (None: no placement of it queued, no answer within
        `seconds`, or Redis went away)."""
        future = self.shared.claim(pin)
        if future is None:
            return None
        self.waiting += 1
        try:
            await asyncio.wait((future,), timeout=seconds)
        finally:
            self.waiting -= 1
        return future.result() if future.done() else None
