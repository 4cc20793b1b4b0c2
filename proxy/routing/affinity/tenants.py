"""What `prefix_affinity` knows of each tenant's traffic: its share, whether it is idle.

A tenant's share is counted over the requests since it appeared (a new tenant's share is right
after a few dozen requests, not after a window's worth), over the window and over a thirtieth of it
(a tenant turning hot or cold shows there first). A tenant with no request for 6 of its mean gaps
(at most `forget_requests`) is idle: it no longer counts in placement, cache room or the packing
repair, and when it returns it is counted from scratch.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable, Final, Sequence

from proxy.config import AffinityConfig
from proxy.routing.affinity.counts import DecayedCounts
from proxy.routing.affinity.load import LoadView
from proxy.routing.affinity.store import Others, Pins

# a tenant of at least this share of this proxy's requests, on either window, is busy: its counts go to
# the other proxies at each sync (`hot`), so that every proxy weighs its growth and shrinking on the
# whole fleet's requests, not a third of them (`others`); until it falls under half of it
_HOT_SHARE: Final = 0.01
_HOT_TOP: Final = 64  # at most this many of them, the busiest on the short window
# a tenant counted here since at least this part of the window's requests is published without
# its own total (`requests`): the whole window's stands for it
_WHOLE_WINDOW: Final = 0.99
_PUBLISH_TENANTS: Final = 16384  # tenants up to which this proxy shares its counts with the others' planner
_GROW_SIGMAS: Final = 2.5  # a set grows on the lower confidence bound of the tenant's share (Poisson)
_FEW_TO_GROW: Final = 0.96 * _GROW_SIGMAS ** 2  # decayed requests below which that bound is 0 (with room for rounding)
_IDLE_GAPS: Final = 6.0  # a tenant is idle after this many of its mean gaps without a request (P ~ e^-6 by chance)
_IDLE_SIGMAS: Final = 2.0  # ... of its mean gaps at the low end of its share (Poisson), so a light one is not dropped early
_PRESENT_GAPS: Final = 3.0  # the packing repair weighs a tenant silent for more of its mean gaps than this down
# the short window is this much shorter than window_requests (3000 -> 100 requests). At a tenth
# (300), a tenant that went from 4 % to 45 % of the traffic between two phases grew its set 184
# requests into the second, overflowing one request at a time meanwhile; at a thirtieth, after 53
# (loadtest.affinity_drift --offline --requests 400, seed 0, `swap`). Its shares are noisier, but
# each use of them is guarded by a confidence bound on the requests they rest on
_FAST: Final = 30.0
_SHIFTED_SIGMAS: Final = 3.0  # a share over the short window this far from the long one means the tenant changed
# A population change: most of the last decisions' tenants appeared (or came back from idle) within
# YOUNG requests, far more than usual. The turnover is averaged over ~_TURNOVER_FAST decisions here
# (detected after ~10-15 of a new population's, at 1 to 3 proxies), its usual level over ~_TURNOVER_SLOW
YOUNG: Final = 400.0
_TURNOVER_FAST: Final = 16.0
_TURNOVER_SLOW: Final = 1000.0
_TURNOVER_HIGH: Final = 0.6  # the turnover that marks a change ...
_TURNOVER_RISE: Final = 0.4  # ... when this far above its usual level,
_TURNOVER_REARM: Final = 0.3  # and once it was below this since the last change


class Seen:
    """What `TenantStats` remembers of a tenant besides its counts (a mutable record: compiled, its
    fields are unboxed, and a request updates it in place instead of building a tuple)."""

    __slots__ = ("first", "last", "low", "before", "before_fast", "arrived")

    def __init__(self, first: float, before: float, before_fast: float) -> None:
        self.first = first  # its first request (policy clock)
        self.arrived = first  # ... unless it was idle less than YOUNG requests before (`young`)
        self.last = first  # its last request
        self.low = 0.0  # a low estimate of its share at the last
        self.before = before  # decayed requests before its first, in `rate`
        self.before_fast = before_fast  # ... in `fast`


class TenantStats:
    def __init__(self, config: AffinityConfig, load: LoadView, pins: Pins) -> None:
        self.config = config
        # read on every request: typed
        self.forget_requests: float = config.forget_requests
        self.grow_min_requests: float = config.grow_min_requests
        self.grow_fill: float = config.grow_fill
        self.load = load
        self.pins = pins
        window = config.window_requests
        self.rate = DecayedCounts(window, 0.0)  # per pin, and None = all requests
        # the same over a thirtieth of the window: a tenant turning hot or cold shows here first
        self.fast = DecayedCounts(window / _FAST, 0.0)
        self.seen: dict[int, Seen] = {}
        # share of the last decisions whose tenant is young, recently and usually (`changed`)
        self.turnover = 0.0
        self.turnover_usual = 0.0
        self._armed = True
        # busy tenants (`hot`), noted while other proxies may read them (`sharing`); the others'
        # counts of theirs: pin -> (long, short) decayed requests and (long, short) requests there
        # since it appeared there, summed over the proxies that counted it, as of the policy clock
        # `others_at`
        self.sharing = False
        self.busy: dict[int, None] = {}
        self.others: dict[int, tuple[float, float, float, float]] = {}
        self.others_at = 0.0

    def note(self, pin: int, now: float, returning: bool) -> None:
        """Count this request for its tenant and remember when it was seen, with a low estimate
        of its share (`idle` waits for that many of its mean gaps)."""
        rates, fast, seen = self.rate, self.fast, self.seen
        up, up_fast = rates.factor(now), fast.factor(now)
        rscaled, fscaled = rates.scaled, fast.scaled
        old = seen.get(pin)
        stats = None if returning else old
        if stats is None:  # (again) new: its old rate says nothing now
            rscaled.pop(pin, None)
            fscaled.pop(pin, None)
            seen[pin] = stats = Seen(now, rscaled.get(None, 0.0) / up, fscaled.get(None, 0.0) / up_fast)
            if old is not None and now - old.last < YOUNG:  # (a pause, not a new arrival)
                stats.arrived = old.arrived
        rates.count(pin, up)
        fast.count(pin, up_fast)
        whole = rscaled[None]
        if self.sharing and pin not in self.busy and (rscaled[pin] >= _HOT_SHARE * whole
                                                      or fscaled[pin] >= _HOT_SHARE * fscaled[None]):
            self.busy[pin] = None
        # (_exposure is 1 for a tenant that came first: skip the call)
        total = whole if stats.before <= 0.0 else whole * _exposure(stats, False, whole / up, rates.tau, now)
        mine = rscaled[pin] / up  # decayed requests of this tenant
        low = mine - _IDLE_SIGMAS * math.sqrt(mine)
        stats.low = (0.0 if 0.0 > low else low) * up / total  # (max(low, 0.0) without the call)
        stats.last = now
        young = 1.0 if now - stats.arrived < YOUNG else 0.0
        self.turnover += (young - self.turnover) / _TURNOVER_FAST
        self.turnover_usual += (young - self.turnover_usual) / _TURNOVER_SLOW
        if self.turnover < _TURNOVER_REARM:
            self._armed = True

    def young(self, pin: int, now: float) -> bool:
        """The tenant appeared (or came back from idle) within `YOUNG` requests."""
        seen = self.seen.get(pin)
        return seen is not None and now - seen.arrived < YOUNG

    def changed(self) -> bool:
        """The population changed (`YOUNG`): True once, then not before the turnover fell again."""
        if self._armed and self.turnover >= _TURNOVER_HIGH and self.turnover - self.turnover_usual >= _TURNOVER_RISE:
            self._armed = False
            return True
        return False

    def idle(self, pin: int, now: float, wall: float) -> bool:
        """No request of this tenant for 6 of its mean gaps (as this proxy sees them: 1/N of its
        requests with N proxies), or for `forget_requests`. A tenant this proxy has not seen is
        idle once its placement is older than `forget_requests` at the current rate."""
        seen = self.seen.get(pin)
        if seen is None:
            entry = self.pins.get(pin)
            return entry is None or (wall - entry[1]) * self.load.rate > self.forget_requests
        gap = now - seen.last
        return gap >= self.forget_requests or gap * seen.low >= _IDLE_GAPS * self.load.proxies

    def presence(self, pin: int, now: float) -> float:
        """How likely the tenant still sends, from the gap since its last request: 1 within three of
        its mean gaps, falling as exp(-gaps) beyond. The packing repair weighs its share by this,
        so when a population changes it does not make room for tenants that just left."""
        seen = self.seen.get(pin)
        if seen is None:
            return 1.0
        gaps = (now - seen.last) * seen.low / self.load.proxies
        return 1.0 if gaps <= _PRESENT_GAPS else math.exp(_PRESENT_GAPS - gaps)

    def warm(self, now: float) -> bool:
        """Enough traffic over all proxies (and some here) for the tenants' shares to mean something."""
        need = self.grow_min_requests
        return self.load.fleet_rate >= need and self.rate.value(None, now) >= need / 4

    def exposure(self, pin: int, now: float, fast: bool = False) -> float:
        """Share of this proxy's decayed request count that arrived since the tenant appeared."""
        counts = self.fast if fast else self.rate
        return _exposure(self.seen.get(pin), fast, counts.value(None, now), counts.tau, now)

    def estimate(self, pin: int, now: float, fast: bool = False) -> tuple[float, float]:
        """(this tenant's share of the requests routed here, and by the other proxies that count
        it among their busy ones, the decayed requests it rests on), counted since the tenant
        appeared: a new tenant's share is not diluted by the window."""
        if fast:
            return self._estimate(pin, now, self.fast, self.seen.get(pin), True)
        return self._estimate(pin, now, self.rate, self.seen.get(pin), False)

    def _estimate(self, pin: int, now: float, counts: DecayedCounts, stats: Seen | None,
                  fast: bool) -> tuple[float, float]:
        up = counts.factor(now)  # first: it may renormalise (replace) `scaled`
        scaled = counts.scaled
        whole = scaled.get(None, 0.0)
        mine = scaled.get(pin, 0.0)
        part = _exposure(stats, fast, whole / up, counts.tau, now)
        total = whole * part
        if self.others:  # (as `share_floor` adds them: it stays a lower bound)
            other = self._other(pin, now, fast)
            if other is not None:
                mine += other[0] * up
                total += other[1] * up
        if total <= 0.0:
            return 0.0, 0.0
        share = mine / total
        return 1.0 if 1.0 < share else share, total / up  # (min(share, 1.0): min and max are costly calls)

    def _other(self, pin: int, now: float, fast: bool) -> tuple[float, float] | None:
        """(the tenant's decayed requests, all requests since it appeared there) at the other
        proxies that count it among their busy tenants, on the short window or the long one; None
        when none does."""
        entry = self.others.get(pin)
        if entry is None:
            return None
        if fast:
            k = math.exp((self.others_at - now) / self.fast.tau)
            return entry[1] * k, entry[3] * k
        k = math.exp((self.others_at - now) / self.rate.tau)
        return entry[0] * k, entry[2] * k

    def hot(self, now: float) -> list[tuple[int, float, float, float, float]]:
        """This proxy's busy tenants, for the other proxies (`adopt`): (pin, its decayed requests on
        the long and the short window, and all requests there since it appeared here). Each proxy
        counts from when the tenant appeared there: all of its requests, scaled by when this one
        saw the tenant first, made a tenant new here look several times as busy at a fresh start."""
        up, up_fast = self.rate.factor(now), self.fast.factor(now)  # (first: they may renormalise)
        rates, fast = self.rate.scaled, self.fast.scaled
        long, short = rates.get(None, 0.0) / up, fast.get(None, 0.0) / up_fast
        out = []
        for pin in list(self.busy):
            r, f = rates.get(pin, 0.0) / up, fast.get(pin, 0.0) / up_fast
            if r < 0.5 * _HOT_SHARE * long and f < 0.5 * _HOT_SHARE * short:
                del self.busy[pin]
                continue
            stats = self.seen.get(pin)
            out.append((pin, r, f, long * _exposure(stats, False, long, self.rate.tau, now),
                        short * _exposure(stats, True, short, self.fast.tau, now)))
        if len(out) > _HOT_TOP:
            out = heapq.nlargest(_HOT_TOP, out, key=lambda e: e[2])
        return out

    def adopt(self, entries: Sequence[tuple[float, list[tuple[int, float, float, float, float]]]]) -> None:
        """The other proxies' busy tenants as they published them (proxy/shared.py `HotTenants`:
        age in seconds, counts), summed per tenant and aged to this proxy's clock at the measured
        request rate."""
        rate = self.load.rate
        others: dict[int, tuple[float, float, float, float]] = {}
        for age, hot in entries:
            k = math.exp(-age * rate / self.rate.tau)
            k_fast = math.exp(-age * rate / self.fast.tau)
            for pin, r, f, long, short in hot:
                was = others.get(pin, (0.0, 0.0, 0.0, 0.0))
                others[pin] = (was[0] + r * k, was[1] + f * k_fast, was[2] + long * k, was[3] + short * k_fast)
        self.others = others
        self.others_at = self.load.clock

    def share_floor(self, pin: int, now: float) -> float:
        """A lower bound on both `estimate`s' shares, without their exposure (an exp each): the
        tenant's requests over all of this proxy's, and the other proxies' that count it busy (an
        exposure is at most 1, so it only raises a share; every step is monotonic in floating point
        too)."""
        floor = 1.0
        for counts in (self.rate, self.fast):
            up = counts.factor(now)  # first: it may renormalise (replace) `scaled`
            scaled = counts.scaled
            whole = scaled.get(None, 0.0)
            if whole < 1.0:  # (no bound from next to nothing)
                return 0.0
            mine = scaled.get(pin, 0.0)
            if self.others:
                other = self._other(pin, now, counts is self.fast)
                if other is not None:
                    mine += other[0] * up
                    whole += other[1] * up
            share = mine / whole
            if share < floor:
                floor = share
        return floor

    def current(self, pin: int, now: float) -> float:
        """The tenant's share over the window, or over its short window when that is clearly
        different (the tenant turned hot or cold): stable while nothing changes, quick when it does."""
        share, _ = self.estimate(pin, now)
        fast, seen = self.estimate(pin, now, True)
        if abs(fast - share) * math.sqrt(max(seen, 1.0)) > _SHIFTED_SIGMAS * math.sqrt(max(share, 1e-3)):
            return fast
        return share

    def may_grow(self, pin: int, size: int, n: int, now: float) -> bool:
        """Enough history, and the tenant alone nearly fills the replicas it has, even at the low
        end of what its share could be (`surely`): estimated from this proxy's requests (a third
        of them with three proxies), a 10 % tenant often looks like 25 % early on, and a needless
        copy of its prompt costs every replica involved cache room for good."""
        return self.warm(now) and self.surely(pin, now, size * self.grow_fill / n)

    def surely(self, pin: int, now: float, share: float) -> bool:
        """The low end of what the tenant's share could be (a Poisson bound of _GROW_SIGMAS) is
        `share` or more, over the window or over its last quarter (a tenant turning hot shows
        there first)."""
        stats = self.seen.get(pin)
        for counts, fast in ((self.rate, False), (self.fast, True)):
            # most tenants have too few requests for a low bound above 0: no estimate needed
            # (`mine` below is at most its decayed requests, and mine - s sqrt(mine) <= 0 up to s^2)
            up = counts.factor(now)  # first: it may renormalise (replace) `scaled`
            mine = counts.scaled.get(pin, 0.0) / up
            if self.others:
                other = self._other(pin, now, fast)
                if other is not None:
                    mine += other[0]
            if mine < _FEW_TO_GROW:
                continue
            estimate, seen = self._estimate(pin, now, counts, stats, fast)
            mine = estimate * seen  # its requests (decayed); Poisson bound: a first request is not "100 %"
            low = mine - _GROW_SIGMAS * math.sqrt(mine)
            low = (0.0 if 0.0 > low else low) / (1.0 if 1.0 > seen else seen)
            if low >= share:
                return True
        return False

    def high(self, pin: int, now: float) -> float:
        """The tenant's share for shrinking its set: the lower of its share over the window and
        the high end of what its share over the short one could be (cooling shows in either). The
        short estimate rests on few requests: taken as it is, chance in it shrank and regrew the set
        of a tenant at a steady 23 % of the traffic (between the growth and shrink thresholds)
        12-15 times in 20000 requests; a set grows on the low end of its estimates too."""
        stats = self.seen.get(pin)
        share, _ = self._estimate(pin, now, self.rate, stats, False)
        fast, seen = self._estimate(pin, now, self.fast, stats, True)
        mine = fast * seen
        top = (mine + _GROW_SIGMAS * math.sqrt(mine)) / (1.0 if 1.0 > seen else seen)
        return top if top < share else share

    def requests(self, now: float) -> tuple[dict[int, float], float, dict[int, float]] | None:
        """(tenant -> decayed requests routed here, all of them, and tenant -> those of all that
        came since the tenant appeared here, for the tenants that appeared within the window),
        published for the other proxies' packing repair; None past _PUBLISH_TENANTS (copying and
        ranking them each second would stall the event loop; the planner then counts this proxy's
        requests out of its shares)."""
        if len(self.rate.scaled) > _PUBLISH_TENANTS:
            return None
        snapshot = self.rate.snapshot(now)
        total = snapshot.pop(None, 0.0)
        since = {}
        tau = self.rate.tau
        for pin, stats in self.seen.items():
            if stats.before > 0.0 and pin in snapshot:
                part = _exposure(stats, False, total, tau, now)
                if part < _WHOLE_WINDOW:
                    since[pin] = total * part
        return snapshot, total, since

    def fleet_share(self, now: float, others: Others | None) -> Callable[[int], float]:
        """share(pin) over every proxy's requests: this proxy's counts plus the others' published
        ones, each over the requests since the tenant appeared where it was counted. A tenant
        that came back from idle here is counted anew here (`note`) while the others may still
        count its old requests: over this proxy's time since it came back, their counts made a
        tenant of 6-14 % of the traffic 0.6-1.0 of it after a popularity rotation (three
        proxies, `--sequence settled`), and the repair moved tenants on shares summing to 1.6-2.4."""
        if not others or others[1] <= 0:
            return lambda pin: self.current(pin, now)
        rates, total, listed = others
        down = 1.0 / self.rate.factor(now)
        scaled = self.rate.scaled
        here = scaled.get(None, 0.0) * down

        def share(pin: int) -> float:
            exposure = self.exposure(pin, now)
            # the others' requests since the tenant appeared there, where they say; elsewhere
            # taken to have appeared when it did here
            entry = listed.get(pin)
            there = total * exposure if entry is None else (total - entry[0]) * exposure + entry[1]
            fleet = min((scaled.get(pin, 0.0) * down + rates.get(pin, 0.0)) / max(here * exposure + there, 1e-9), 1.0)
            mine = self.estimate(pin, now)[0]
            current = self.current(pin, now)  # this proxy's view of a change scales the fleet's
            return fleet if current == mine or mine <= 0.0 else min(fleet * current / mine, 1.0)

        return share

    def keep(self, pins: Pins) -> None:
        """Drop the rates and stamps of tenants no longer placed (the table's `forget`)."""
        self.seen = {p: v for p, v in self.seen.items() if p in pins}
        self.busy = {p: None for p in self.busy if p in pins}
        for counts in (self.rate, self.fast):
            counts.scaled = {k: v for k, v in counts.scaled.items() if k is None or k in pins}


def _exposure(stats: Seen | None, fast: bool, total: float, tau: float, now: float) -> float:
    """Share of `total` (this proxy's decayed request count, time constant `tau`) that arrived
    since the tenant (`stats`: its `seen` entry) appeared; `fast`: counted on the short window."""
    if stats is None:
        return 1.0
    before = stats.before_fast if fast else stats.before
    if before <= 0.0:
        return 1.0
    before = before * math.exp(-(now - stats.first) / tau)
    if total > 0.0:
        part = 1.0 - before / total
        return 1e-9 if 1e-9 > part else part
    return 1.0
