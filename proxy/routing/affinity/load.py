"""The load estimate of `prefix_affinity`: the request clock and the per-replica loads it bounds.

The clock advances by one request over all proxies (each proxy steps it by the number of
proxies it infers from the shared load view). The bound applies to the **smoothed** load: the
decayed count of requests routed to each replica, this proxy's plus the others' (published
through Redis, aged at the observed request rate); placement scores by the **recent** count
(a quarter of the window: where traffic goes now), this proxy's plus the others' as their sync
last published them; in-flight counts only guard against a real queue. A replica that
joined counts at least the others' mean at first, falling linearly to its own over
`load_window_requests`, so the others do not all look over the bound.
A replica markedly slower than the fastest counts more per request (proxy/routing/speed.py).
"""
from __future__ import annotations

import math
from typing import Callable, Final, Sequence

from proxy.config import AffinityConfig
from proxy.routing.backends import Backend
from proxy.routing.speed import counted
from proxy.routing.affinity.counts import DecayedCounts
from proxy.shared import SharedState

_RATE_EVERY_S: Final = 1.0  # the request rate is measured over this much wall time...
_RATE_EVERY_REQUESTS: Final = 64.0  # ... or this many requests, whichever comes first
_START_RATE: Final = 100.0  # requests a second assumed before the first measurement


class LoadView:
    def __init__(self, config: AffinityConfig, shared: SharedState | None, wall: Callable[[], float]) -> None:
        self.config = config
        # the bound's knobs, typed (compiled, they are read as unboxed numbers)
        self.epsilon: float = config.epsilon
        self.load_slack: float = config.load_slack
        self.queue_slack: int = config.queue_slack
        self.shared = shared
        self.clock = 0.0  # requests routed over all proxies (estimated)
        self.proxies = 1.0  # proxies sharing the traffic (estimated): the clock's step per request here
        self.rate = _START_RATE  # clock units per wall second, measured
        self._rate_mark = (wall(), 0.0)  # (wall, clock) where the current measurement started
        self.routed = DecayedCounts(config.load_window_requests, 0.0)  # per backend name, and None = all
        # the same over a quarter of the window, this proxy only: where traffic goes now (placement;
        # published by the sync with the busy tenants, and the others' added in `recent_loads`)
        self.recent = DecayedCounts(config.load_window_requests / 4, 0.0)
        self.joined: dict[str, float] = {}  # replica -> clock when it joined (its load is ramped up)
        self.fleet_rate = 0.0  # smoothed requests routed over all proxies, as of the last decision
        self._wall = wall
        self.speed_balance = config.speed_balance
        if shared is not None:
            shared.rate_tau = config.load_window_requests / self.rate
            shared.local_rates = lambda wall: self.routed.snapshot(self.clock)
            shared.local_recent = lambda: self.recent.snapshot(self.clock)

    def tick(self, wall: float) -> float:
        """Advance the clock by one request over all proxies; measure its rate in wall time (only
        used to age what other proxies published)."""
        self.clock += self.proxies
        since, at = self._rate_mark
        if wall - since >= _RATE_EVERY_S or (self.clock - at >= _RATE_EVERY_REQUESTS and wall > since):
            self.rate = max((self.clock - at) / (wall - since), 1e-3)
            self._rate_mark = (wall, self.clock)
            if self.shared is not None:
                self.shared.rate_tau = self.config.load_window_requests / self.rate
        return self.clock

    def count(self, name: str, now: float) -> None:
        """This request went to `name`."""
        self.routed.count(name, self.routed.factor(now))
        self.recent.add(name, now)

    def load(self, backend: Backend) -> int:
        """Instantaneous in-flight requests over all proxies (also used by the LoRA manager)."""
        return self.loads((backend,))[0]

    def loads(self, candidates: Sequence[Backend]) -> list[int]:
        """`load` of each candidate, in one pass (this runs on every request: loops, as a
        comprehension is a call, and one using locals of this function builds a closure)."""
        remote = self.shared.remote_load if self.shared is not None else None
        out = []
        if not remote:
            for b in candidates:
                out.append(b.in_flight)
        else:
            for b in candidates:
                out.append(b.in_flight + remote.get(b.name, 0))
        return out

    def smoothed(self, candidates: Sequence[Backend], now: float, weigh: bool = True) -> list[float]:
        """Decayed routed counts over all proxies, per candidate (`weigh`: by speed); a replica
        that joined lately counts at least a share of the others' mean that falls to zero over
        window / 2."""
        down = 1.0 / self.routed.factor(now)
        mine = self.routed.scaled
        shared = self.shared
        rates = []  # (loops, as in `loads`)
        if shared is not None and shared.remote_rate:
            remote = shared.remote_rate
            age = self._wall() - shared.remote_rate_at
            age = 0.0 if 0.0 > age else age  # (max without the call)
            decay = math.exp(-age * self.rate / self.config.load_window_requests)
            for b in candidates:
                rates.append(mine.get(b.name, 0.0) * down + remote.get(b.name, 0.0) * decay)
        else:
            for b in candidates:
                rates.append(mine.get(b.name, 0.0) * down)
        if self.joined:
            self.ramp(candidates, rates, now)
        if weigh and Backend.speed_version:  # (the call only once some replica was ever slower)
            self.weigh(candidates, rates)
        return rates

    def weigh(self, candidates: Sequence[Backend], values: list[float]) -> list[float]:
        """`values` (loads of `candidates`), each scaled by what a request to its replica counts
        (proxy/routing/speed.py `counted`); as they were while all run alike."""
        strength = self.speed_balance
        if Backend.speed_version and strength:
            i = 0
            for b in candidates:
                f = b.load_factor
                if f != 1.0:
                    values[i] *= counted(f, strength)
                i += 1
        return values

    def bounds(self, candidates: Sequence[Backend], now: float) -> tuple[list[float], list[int], float, float, int]:
        """(smoothed loads weighed by speed, in-flight loads, mean, the bound on the smoothed load,
        the in-flight guard) for this decision; updates the fleet's rate and the proxies estimate on
        the way (from the requests, unweighed)."""
        n = len(candidates)
        rates = self.smoothed(candidates, now, False)
        flights = self.loads(candidates)
        total = 0.0  # (sums as loops: compiled, they add unboxed)
        for rate in rates:
            total += rate
        in_flight = 0
        for flight in flights:
            in_flight += flight
        self.fleet_rate = total
        local = self.routed.value(None, now)  # all this proxy routed, on the same window as `rates`
        if local >= 16.0:  # proxies sharing the traffic: the fleet's routed count over this proxy's
            ratio = total / local  # clamped to [1, 64] (as min(max(...)), without two calls)
            ratio = 1.0 if 1.0 > ratio else 64.0 if 64.0 < ratio else ratio
            self.proxies += (ratio - self.proxies) * 0.02
        if Backend.speed_version and self.speed_balance:
            total = sum(self.weigh(candidates, rates))
        mean = (total + 1.0) / n
        cap = (1.0 + self.epsilon) * mean + self.load_slack * math.sqrt(mean)  # slack: the count's own noise
        qcap = math.ceil((1.0 + self.epsilon) * (in_flight + 1) / n) + self.queue_slack
        return rates, flights, mean, cap, qcap

    def restart(self, now: float) -> None:
        """The tenants changed (proxy/routing/affinity/tenants.py `changed`): where traffic went
        of late starts from nothing, as at a fresh start, so newcomers are placed by where the new
        population's traffic goes. Where the last one's went says nothing about that: a replica
        its hot tenants had kept busy scored as loaded for a quarter load window after they left,
        so the newcomers went around it; it ran light while the others met the balance guard's
        cap, which sent their newcomers' conversations to replicas without their prompt. (The
        smoothed load the bound applies to is shared with the other proxies and sets the proxies
        estimate: it forgets at its own pace.)"""
        self.recent = DecayedCounts(self.config.load_window_requests / 4, now)

    def recent_loads(self, candidates: Sequence[Backend]) -> list[float]:
        """Requests routed to each candidate over the last quarter load window, by this proxy and
        the others (as they last published them, aged at the observed rate; ramped up for a
        replica that joined, as `smoothed`): where traffic goes now. This proxy's alone are every
        proxy's only while clients spread their requests over the proxies evenly; where each
        client stays on one proxy (an L4 balancer), they show only its own tenants' traffic: it
        placed newcomers, and chose its tenants' set members, onto replicas the others' tenants
        kept busy. Three proxies, each tenant's requests to one (`loadtest.affinity_drift
        --clients tenant`, 10x the rate, seeds 0-15): the guard overflowed 6.2 % of requests, 3.9 %
        with the others' counts; phases over 1.10 max/mean 22 -> 17; the same with requests spread
        in turn (docs/BENCHMARKS.md)."""
        recent = self.recent
        down = 1.0 / recent.factor(self.clock)
        scaled = recent.scaled
        values = []  # (a loop, as in `loads`)
        shared = self.shared
        if shared is not None and shared.remote_recent:
            remote = shared.remote_recent
            age = self._wall() - shared.remote_recent_at
            age = 0.0 if 0.0 > age else age
            decay = math.exp(-4.0 * age * self.rate / self.config.load_window_requests)
            for b in candidates:
                values.append(scaled.get(b.name, 0.0) * down + remote.get(b.name, 0.0) * decay)
        else:
            for b in candidates:
                values.append(scaled.get(b.name, 0.0) * down)
        if self.joined:
            self.ramp(candidates, values, self.clock)
        if Backend.speed_version:
            self.weigh(candidates, values)
        return values

    def ramp(self, candidates: Sequence[Backend], values: list[float], now: float,
             into: dict[str, float] | None = None) -> None:
        """Raise each lately joined replica's value to the others' mean times the part of its
        ramp (load_window_requests) still to go; in `values`, or in `into` by name."""
        ramp = self.config.load_window_requests
        joined = self.joined
        for name, at in list(joined.items()):
            if now - at >= ramp:
                del joined[name]
        old = [v for b, v in zip(candidates, values) if b.name not in joined]
        if not old:
            return
        mean = sum(old) / len(old)
        for i, backend in enumerate(candidates):
            since = joined.get(backend.name)
            if since is not None:
                floor = max(values[i], mean * (1.0 - (now - since) / ramp))
                if into is None:
                    values[i] = floor
                else:
                    into[backend.name] = floor
