"""The balance guard: a hard cap on each replica's part of the last requests routed.

The load bound the placement works with is soft on purpose (a smoothed count, a noise slack, a
looser bound for continuations, no spill before warm-up): it saves prefix hits, but over any few
hundred requests after the workload changed (a new population placed blind to popularity, a hot
tenant before its set grew) one replica took 1.2-1.7x the mean. This guard is the last word on
every decision: over the last `balance_window_requests` x replicas requests (counted over all
proxies, like every memory of the policy), no replica takes more than
(1 + balance_epsilon) x mean + 10 of them. A request whose choice would break that goes to a replica
of its tenant's set under the cap, else to the replica this tenant overflowed to last (so its
prompt is cached in one more place, not scattered), else to the replica with the fewest.
A continuation is allowed `continuation_slack` more (its own turns are cached where it goes).

With several proxies the cap applies to the fleet's window: this proxy's decisions plus what the
others routed over the same span, read as the increments of their smoothed counts between two
syncs (proxy/shared.py). Capping each proxy's third of the requests alone capped its sampling
noise: with three proxies a third of the requests overflowed while the fleet was balanced.

The window starts empty when the route's replicas change (the mean changes with them) and is
looser while it fills, so a fresh start is not forced round-robin before anything is known.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Sequence

from proxy.routing.backends import Backend

_SLACK = 10.0  # requests above (1 + eps) x mean: a cap at small counts is not a round robin
_FILLING = 0.3  # extra relative headroom while the window fills (falls linearly to 0 when full)


class Window:
    """One route's recent decisions: replica name -> how many of the last `size`."""

    __slots__ = ("names", "fleet", "recent", "counts", "overflow", "filling", "seen", "seen_at", "others",
                 "other_counts", "other_total", "size", "again")

    def __init__(self, names: tuple[str, ...], before: "Window | None" = None) -> None:
        self.names = names
        self.fleet: tuple[Backend, ...] = ()
        self.counts: dict[str, int] = dict.fromkeys(names, 0)
        self.recent: deque[str] = deque()
        # a fresh start knows nothing yet: looser while the window fills; after a change of the
        # route's replicas the placement already knows its tenants
        self.filling = _FILLING if before is None else 0.0
        self.size = 0  # this proxy's part of the window, as of the last decision
        self.again: int | None = None  # the tenant of the last overflow, if it had overflowed before
        self.overflow: dict[int, str] = {}  # tenant pin -> replica it last overflowed to
        self.seen: dict[str, float] | None = None  # the other proxies' smoothed counts last read...
        self.seen_at = 0.0  # ... at this clock
        self.others: deque[tuple[float, dict[str, float]]] = deque()  # (clock, what they routed since the reading before)
        self.other_counts: dict[str, float] = dict.fromkeys(names, 0.0)  # their sum: the others' part of the window
        self.other_total = 0.0  # ... over all replicas


class Balance:
    """The guard, with one window per route (each route has its own replicas)."""

    def __init__(self, per_replica: float, epsilon: float, continuation_slack: float, tau: float) -> None:
        self.per_replica = per_replica
        self.tau = tau  # time constant (requests) of the smoothed counts the other proxies publish
        self.epsilon = epsilon
        self.continuation_slack = continuation_slack
        self._routes: dict[str, Window] = {}

    def check(self, route: str, candidates: Sequence[Backend], chosen: Backend, pin: int,
              members: Sequence[str], continuation: bool, proxies: float, now: float = 0.0,
              remote: dict[str, float] | None = None, cached: str | None = None) -> tuple[Backend, bool]:
        """`chosen`, or the replica that takes this request instead; True when it was capped.
        `remote`: the other proxies' smoothed routed counts (proxy/shared.py) as of `now` (clock);
        `cached`: the replica the prefix index says holds the tenant's prompt, if any."""
        window = self._routes.get(route)
        n = len(candidates)
        fleet = tuple(candidates)
        if window is None or window.fleet != fleet:  # (the same replica objects: compared by identity)
            names = tuple(b.name for b in candidates)
            if window is None or window.names != names:
                window = self._routes[route] = Window(names, window)
            window.fleet = fleet
        counts = window.counts
        proxies = max(proxies, 1.0)
        size = max(int(self.per_replica * n / proxies), n)  # this proxy's part of the window
        filled = len(window.recent)
        window.size = size
        loose = 1.0 + self.epsilon + window.filling * (1.0 - filled / size)
        if remote and proxies > 1.05:
            if remote is not window.seen:  # a new reading (proxy/shared.py replaces the dict on each sync)
                self._read(window, remote, now, size * proxies)
            # what the others routed since the last reading is not in it yet (a sync interval:
            # a dozen requests at 150/s): counted as spread like the rest of their window
            total = window.other_total
            lag = max(now - window.seen_at, 0.0) * (proxies - 1.0) / proxies
            scale = 1.0 + lag / total if total > 0.0 else 1.0
            others = window.other_counts
            limit = loose * (filled + total * scale) / n + _SLACK
            mine = counts[chosen.name] + max(others[chosen.name], 0.0) * scale
        else:
            # one proxy, or nothing heard from the others: each holds its own part to the cap
            if window.seen is not None:
                self._forget(window)
            others = None
            limit = loose * filled / n + _SLACK / proxies
            mine = counts[chosen.name]
        capped = mine + 1 > limit * (1.0 + self.continuation_slack if continuation else 1.0)
        if capped:
            load = counts if others is None else {k: counts[k] + max(others[k], 0.0) * scale for k in window.names}
            chosen = self._instead(window, load, candidates, pin, members, limit, cached)
        name = chosen.name
        counts[name] += 1
        recent = window.recent
        recent.append(name)
        while len(recent) > size:  # (size follows the estimate of the number of proxies)
            counts[recent.popleft()] -= 1
        return chosen, capped

    def settled(self, route: str, pin: int) -> bool:
        """The tenant overflowed before, and the route's window is past a fresh start's filling
        (its cap is the real one): its traffic, not chance, meets the cap."""
        window = self._routes.get(route)
        return (window is not None and window.again == pin
                and (not window.filling or len(window.recent) >= window.size))

    def _read(self, window: Window, remote: dict[str, float], now: float, span: float) -> None:
        """Add what the other proxies routed since the last reading (their smoothed counts now,
        less the last reading decayed over the requests since) to the window; drop what is older
        than the window's span (requests over all proxies). The first reading is only a baseline."""
        seen, window.seen = window.seen, remote
        if seen is not None:
            decay = math.exp(-max(now - window.seen_at, 0.0) / self.tau)
            added = {name: remote.get(name, 0.0) - seen.get(name, 0.0) * decay for name in window.names}
            window.others.append((now, added))
            other = window.other_counts
            for name, k in added.items():
                other[name] += k
        window.seen_at = now
        others = window.others
        while others and others[0][0] < now - span:
            for name, k in others.popleft()[1].items():
                window.other_counts[name] -= k
        window.other_total = sum(max(k, 0.0) for k in window.other_counts.values())

    @staticmethod
    def _forget(window: Window) -> None:
        """No reading from the others (one proxy left, or Redis is down): start over when one comes."""
        window.seen = None
        window.others.clear()
        window.other_counts = dict.fromkeys(window.names, 0.0)
        window.other_total = 0.0

    @staticmethod
    def _instead(window: Window, counts: dict, candidates: Sequence[Backend], pin: int, members: Sequence[str],
                 limit: float, cached: str | None) -> Backend:
        under = [b for b in candidates if counts[b.name] + 1 <= limit]
        if not under:
            return min(candidates, key=lambda b: counts[b.name])
        own = [b for b in under if b.name in members]
        if own:
            return min(own, key=lambda b: counts[b.name])
        # where its prompt is (every proxy's index agrees through Redis; its own overflow memory does not)
        last = window.overflow.get(pin)
        window.again = pin if last is not None else None
        last = cached if any(b.name == cached for b in under) else last
        chosen = next((b for b in under if b.name == last), None) or min(under, key=lambda b: counts[b.name])
        if len(window.overflow) > 4 * len(candidates) + 1024:
            window.overflow.clear()  # bounded: the tenants of long ago need no memory here
        window.overflow[pin] = chosen.name
        return chosen
