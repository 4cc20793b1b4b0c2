"""The balance guard: a hard cap on each replica's part of the last requests routed.

The load bound the placement works with is soft on purpose (a smoothed count, a noise slack, a
looser bound for continuations, no spill before warm-up): it saves prefix hits, but over any few
hundred requests after the workload changed (a new population placed blind to popularity, a hot
tenant before its set grew) one replica took 1.2-1.7x the mean. This guard is the last word on
every decision: over the last `balance_window_requests` x replicas requests (counted over all
proxies, like every memory of the policy), no replica takes more than
(1 + balance_epsilon) x mean + 10 of them. While some replica decodes markedly slower
(proxy/routing/speed.py) each replica's cap is its part of the mean by speed, with the headroom
`speed_balance_epsilon` (0.1): that part is an estimate (a scraped ratio rounded to quarters, at
a strength that trades cache for latency), and at 0.03 the slow replica sat at its cap, which
overflowed 3-4x as many requests to replicas without their prompt (loadtest.affinity_replay,
heterogeneous fleet: 88 overflows against 24 on replicas alike). A request whose choice would
break that goes to a replica of its tenant's set under the cap, else to the replica this tenant
overflowed (or spilled: placement.py `_spill`) to last (so its prompt is cached in one more place,
not scattered; first where the prefix index says its prompt is), else to the replica with the
fewest. A tenant capped twice whose traffic is a large part of its replicas, or pays for the room
a copy of its prompt takes, grows by the overflow replica (`settled`, placement.py `overflowed`).
A continuation is allowed `continuation_slack` more (its own turns are cached where it goes).
Which requests the cap turns away matters more than how many: one whose prompt is cached nowhere
else is a cold prompt where it goes, one whose prompt is also on another member of its set (or
where its tenant overflowed before) is not. So a capped request of the first kind may pass, up to
_LEND of them a replica (over all proxies) and _LEND_OVER over the cap, and the next requests of
the second kind near the cap are turned away in their place (`_lend`; not while some replica is
slower: its cap by speed has its own headroom). After a popularity rotation among 60 tenants the
tail tenants on the replicas the new hot ones filled were most of the misses; offline over ten
sequences of phases, 12 seeds, the later phases under 0.97 went from 24 to 5 of 336 and the
fresh-start replays rose (strong 0.9652 -> 0.9669, weak 0.9676 -> 0.9704), max/mean within 1.10
(docs/BENCHMARKS.md).
Within `_NEAR` requests of the cap, a new conversation whose prompt the prefix index places on a
replica well under its own cap goes there instead: the cap then meets fewer requests whose prompt
is cached nowhere else.

With several proxies the window is the fleet's: this proxy's decisions as they happen plus the
others' windows as they last published them, for the same replicas: on each entry of the change
stream they write (`streamed`; a stream read brings it in a few ms) and at their load sync (Redis,
every `busy_sync_interval_s` while routing; proxy/shared.py). Each proxy capping its own third with a
third of the slack capped on the chance excursions of its sample (a third as many requests),
which sent 2-3x the 1-proxy count of overflows to replicas without the prompt. The overflows of
the last FRESH_S go out with the window, so a tenant capped anywhere overflows to the same
replica everywhere. Without the others' windows (Redis down, a proxy that sees another fleet)
each proxy holds its own part to the cap with its part of the slack, as before.

The window starts empty when the route's replicas change (the mean changes with them) and is
looser while it fills, so a fresh start is not forced round-robin before anything is known.
When the tenants change (most of the last requests come from tenants that just arrived:
proxy/routing/affinity/tenants.py `changed`) it keeps only the new tenants' decisions (`restart`):
held to the last population's traffic, a replica that took much of its final stretch was capped
for the new one's first requests, where its hot tenants are placed, and ran light all phase, while
one that took little could take much. Three proxies at 10x the rate, 800-request phases, 5 runs of
seeds 0-7: 5 of 240 cells over 1.10 max/mean (`swap` and `join`, where the tenants stay, and one
fresh start), against 14 of 240 before; one proxy, 600-request phases, offline: 19 of 96 against 39.

The window bounds one length of stretch: its own. Over a shorter one a replica that ran light
earlier in the window may take what it did not (credit): with phases of 400 requests on 4
replicas one took 66 in one and 152 in the next, max/mean 1.52 (loadtest.affinity_drift --offline
--requests 400). So a second bound holds for every stretch of consecutive requests however long:
no replica takes more than (1 + _STRETCH_EPSILON) x its share of the stretch + `balance_burst`.
That is a walk per replica, reflected at zero: `Window.level` less the stretch's allowance so far
(`ticks` x `rate`), O(1) a decision. With several proxies each folds in the others' decisions
(their cumulative counts, published with the window) when their sync brings them. While some
replica is slower (speed shares) only the window bounds it.
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Final, Sequence

from proxy.routing.backends import Backend
from proxy.routing import speed

if TYPE_CHECKING:
    from proxy.shared import LocalWindow, RemoteWindow, SharedState

_SLACK: Final = 10.0  # requests above (1 + eps) x mean: a cap at small counts is not a round robin
FRESH_S: Final = 1.0  # overflows published this long (the other proxies read them within a sync or two)
_FRESH_MAX: Final = 256  # and at most this many of them
# a new conversation within this many requests of its replica's cap goes where its prompt is cached
# if that replica has more than _NEAR_ROOM requests of room (replayed, 16 seeds x 3000 requests:
# weak 0.9647 -> 0.9668 of the bound, worst 0.937 -> 0.941; strong 0.9618 -> 0.9649, worst 0.926 ->
# 0.948; at 4-10 requests of the cap strong lost up to 0.006: it balanced more than the cap needs)
_NEAR: Final = 2.0
_NEAR_ROOM: Final = 2.0 * _SLACK
# the cap lets through up to this many requests (over all proxies) whose prompt is cached nowhere
# else, up to this far over it, and makes them up with requests cached elsewhere too (`_lend`)
_LEND: Final = 3.0
_LEND_OVER: Final = 0.02
_RESTART_KEEPS: Final = 64  # `restart` keeps at most this many of a window's last decisions
# extra relative headroom while a fresh start's window fills (falls linearly to 0 when full). At
# 0.3, with hot tenants held off growing until the window was full (`settled`), the drift
# benchmark's fresh start went over 1.10 max/mean in 7-12 of 32 seeds with three proxies at 10x;
# at 0.15, growing as soon as the cap meets them: 2, at +0.004 of the share (docs/BENCHMARKS.md)
_FILLING: Final = 0.15
# the stretch bound's headroom. A replica whose traffic is exactly its share has a walk whose level
# is about exponential with mean p(1-p) / (2 x eps / n): at the window's 0.03, 12 requests, so it
# sat above a burst of 20 a fifth of the time and the bound capped chance (3 proxies at 10x the
# rate, 800-request phases: worst share 0.965 against 0.971 without it); at 0.1, 4 requests (0.5 %
# of the time above 20), and it caps what it is for: credit (400-request phases <= 1.28 offline)
_STRETCH_EPSILON: Final = 0.1


class Window:
    """One route's recent decisions: replica name -> how many of the last `size`."""

    __slots__ = ("names", "key", "fleet", "recent", "counts", "overflow", "spills", "fresh", "filling", "size", "again",
                 "speeds", "shares", "decided", "published", "rate", "level", "ticks", "picks", "folded", "seen",
                 "tenants", "lent", "streamed", "streamed_at")

    def __init__(self, names: tuple[str, ...], before: "Window | None" = None, route: str = "",
                 epsilon: float = 0.0) -> None:
        self.names = names
        # what the other proxies' windows of the same route and replicas are found by (replicas
        # sorted: proxies list them in the order they found them)
        self.key = (route, tuple(sorted(set(names))))
        self.decided = 0  # decisions so far, and as of the last snapshot (an idle window is not republished)
        self.published = -1
        self.streamed = -1  # the same for the change stream (`Balance.streamed`), and when it last went
        self.streamed_at = 0.0
        self.fleet: tuple[Backend, ...] = ()
        self.counts: dict[str, int] = dict.fromkeys(names, 0)
        self.recent: deque[str] = deque()
        self.tenants: deque[int] = deque()  # each decision's tenant, beside `recent` (`restart`)
        # the stretch bound: allowance a decision (1 + eps) / n, each replica's walk level on the
        # `ticks` clock (decisions here and folded in from the others), this proxy's own picks so
        # far (published), the others' picks last folded in (by identity: a dict keeps it where the
        # compiled build boxes the view's tuple anew at each read) and their (decisions, picks)
        self.rate = (1.0 + epsilon) / len(names) if names else 0.0
        self.level: dict[str, float] = dict.fromkeys(names, 0.0)
        self.ticks = 0.0
        self.picks: dict[str, int] = dict.fromkeys(names, 0)
        self.folded: dict[str, int] | None = None
        self.seen: tuple[int, dict[str, int]] = (0, {})
        # a fresh start knows nothing yet: looser while the window fills; after a change of the
        # route's replicas the placement already knows its tenants
        self.filling = _FILLING if before is None else 0.0
        self.overflow: dict[int, str] = {}  # tenant pin -> replica it last overflowed to
        self.spills: dict[int, str] = {}  # tenant pin -> replica the placement last spilled it to (`_spill`)
        self.fresh: dict[int, tuple[str, float]] = {}  # this proxy's overflows of late: pin -> (replica, wall)
        self.size = 0  # this proxy's part of the window, as of the last decision
        self.again: int | None = None  # the tenant of the last overflow, if it had overflowed before
        # replica -> requests let past its cap (prompt cached nowhere else) not yet made up (`_lend`)
        self.lent: dict[str, int] = {}
        self.speeds = -1  # the Backend.speed_version `shares` was computed for
        self.shares: dict[str, float] | None = None  # name -> n x its part of the speed (None: all alike)


class Balance:
    """The guard, with one window per route (each route has its own replicas)."""

    def __init__(self, per_replica: float, epsilon: float, continuation_slack: float, speed_balance: float = 0.0,
                 shared: "SharedState | None" = None, wall: Callable[[], float] = time.time,
                 speed_epsilon: float | None = None, burst: float = 0.0) -> None:
        self.per_replica = per_replica
        self.burst = burst  # the stretch bound's slack (0: no stretch bound)
        self.speed_epsilon = epsilon if speed_epsilon is None else speed_epsilon  # while some replica is slower
        self.shared = shared  # the other proxies' windows (`remote_guard`), published by its sync
        self.wall = wall
        self.speed_balance = speed_balance
        self.epsilon = epsilon
        self.continuation_slack = continuation_slack
        self._routes: dict[str, Window] = {}

    def check(self, route: str, candidates: Sequence[Backend], chosen: Backend, pin: int,
              members: Sequence[str], continuation: bool, proxies: float,
              cached: str | None = None) -> tuple[Backend, bool]:
        """`chosen`, or the replica that takes this request instead; True when it was capped.
        `cached`: the replica the prefix index says holds the tenant's prompt, if any."""
        window = self._routes.get(route)
        n = len(candidates)
        # the same replica objects (compared by identity); usually the route's own tuple
        if window is None or (window.fleet is not candidates and window.fleet != tuple(candidates)):
            names = tuple(b.name for b in candidates)
            if window is None or window.names != names:
                window = self._routes[route] = Window(names, window, route, _STRETCH_EPSILON)
            window.fleet = tuple(candidates)
        counts = window.counts
        proxies = 1.0 if 1.0 > proxies else proxies  # (max and min as conditionals: this runs on every request)
        size = _part(self.per_replica, n, proxies)
        filled = len(window.recent)
        window.size = size
        others = self._others(window)
        shares = None
        epsilon = self.epsilon
        if Backend.speed_version and self.speed_balance:
            shares = self._shares(window, candidates)
            if shares:
                epsilon = self.speed_epsilon
        fair, slack = _cap(window, epsilon, filled, size, n, others, proxies)
        if others is not None:
            remote = others[1]
        limit = fair * shares[chosen.name] + slack if shares else fair + slack
        count = counts[chosen.name]
        if others is not None:
            count += remote.get(chosen.name, 0)
            if others[3] is not window.folded:
                _fold(window, others)
        capped = count + 1 > limit * (1.0 + self.continuation_slack if continuation else 1.0)
        # which requests the window's cap turns away: one whose prompt is cached nowhere else rather not
        # (not while some replica is slower: its cap by speed has its own headroom)
        lend = _LEND / proxies
        if not shares and (capped or (count + 1 > limit - lend and window.lent.get(chosen.name))):
            capped = _lend(window, chosen.name, capped, len(members) > 1 or pin in window.overflow,
                           count + 1 <= limit * (1.0 + _LEND_OVER), lend)
        burst = 0.0
        if self.burst and not shares:  # (the window's looseness while it fills applies here too)
            burst = self.burst + _loose(window, filled, size, n)
            if _above(window, chosen.name) + 1.0 > burst:
                capped = True
        if capped or (cached is not None and cached != chosen.name and count + 1 > limit - _NEAR
                      and not continuation):
            # each replica's count over the fleet's window, raised to where the window's room is no
            # more than the stretch bound's
            held: dict[str, float] = {}
            for key, c in counts.items():
                held[key] = float(c + remote.get(key, 0)) if others is not None else float(c)
                if burst:
                    least = fair + slack - burst + _above(window, key)
                    if held[key] < least:
                        held[key] = least
            if capped:
                chosen = self._instead(window, held, candidates, pin, members, fair, slack, shares, cached)
            else:
                chosen, capped = self._near_cap(window, held, candidates, chosen, fair, slack, shares, cached)
        name = chosen.name
        if self.burst:
            base = window.ticks * window.rate
            level = window.level[name]
            window.level[name] = (level if level > base else base) + 1.0
            window.ticks += 1.0
            window.picks[name] += 1
        counts = window.counts
        counts[name] += 1
        window.decided += 1
        recent = window.recent
        recent.append(name)
        tenants = window.tenants
        tenants.append(pin)
        while len(recent) > size:  # (size follows the estimate of the number of proxies)
            counts[recent.popleft()] -= 1
            tenants.popleft()
        return chosen, capped

    def restart(self, current: Callable[[int], bool]) -> int:
        """Keep in each window only the decisions for `current` tenants (the stretch bound's walks
        go on): the tenants changed (proxy/routing/affinity/tenants.py `changed`). A window full of
        the last population's traffic held a replica that took much of its final requests to few
        of the new one's first (the new hot tenants were placed elsewhere) and let one that took
        few take many: each phase's max/mean carried the last one's. Returns how many windows restarted."""
        restarted = 0
        for window in self._routes.values():
            # (among its last decisions: the change was seen within a few dozen of them)
            tail = list(zip(window.recent, window.tenants))[-_RESTART_KEEPS:]
            kept = [(name, pin) for name, pin in tail if current(pin)]
            if len(kept) == len(window.recent):  # (a fresh start's: it holds only the new tenants)
                continue
            restarted += 1
            window.recent = deque(name for name, _ in kept)
            window.tenants = deque(pin for _, pin in kept)
            counts = window.counts
            for name in counts:
                counts[name] = 0
            for name in window.recent:
                counts[name] += 1
            window.filling = 0.0  # (not a fresh start: the cap is the real one as it fills)
            window.published = window.streamed = -1
        return restarted

    def recent_counts(self) -> tuple[dict[int, float], float]:
        """Each tenant's decisions in this proxy's windows (every route's), and all of them: what
        the packing repair weighs a newcomer by (Repair `shares`)."""
        counts: dict[int, float] = {}
        total = 0
        for window in self._routes.values():
            for pin in window.tenants:
                counts[pin] = counts.get(pin, 0.0) + 1.0
            total += len(window.tenants)
        return counts, float(total)

    def full(self, route: str, proxies: float) -> tuple[str, ...]:
        """The route's replicas that would cap a new conversation now (by the window or the stretch
        bound), unless all would: a new tenant is placed elsewhere. Placed by its load and cache
        terms alone onto a replica at its cap, its first requests overflowed, each computing its
        prompt on a second replica: after a population change, when the window still holds the
        last population's traffic, half of the guard's cold prompts (three populations of 80
        tenants, Zipf 0.8, caches overcommitted 1.25x: docs/BENCHMARKS.md)."""
        window = self._routes.get(route)
        if window is None or not window.recent:
            return ()
        names = window.names
        n = len(names)
        proxies = 1.0 if 1.0 > proxies else proxies
        size = _part(self.per_replica, n, proxies)
        filled = len(window.recent)
        others = self._others(window)
        shares = window.shares if Backend.speed_version and self.speed_balance else None
        fair, slack = _cap(window, self.speed_epsilon if shares else self.epsilon, filled, size, n, others, proxies)
        burst = self.burst + _loose(window, filled, size, n) if self.burst and not shares else 0.0
        if others is not None and others[3] is not window.folded:
            _fold(window, others)
        out = []
        for name in names:
            count = window.counts[name] + (others[1].get(name, 0) if others is not None else 0)
            limit = fair * shares[name] + slack if shares else fair + slack
            if count + 1 > limit or (burst and _above(window, name) + 1.0 > burst):
                out.append(name)
        return tuple(out) if len(out) < n else ()

    def _others(self, window: Window) -> "RemoteWindow | None":
        """The other proxies' window of the same route and replicas, as their sync last published it."""
        shared = self.shared
        return shared.remote_guard.get(window.key) if shared is not None and shared.remote_guard else None

    def snapshot(self) -> dict[str, "LocalWindow"]:
        """Every route's window that decided since the last snapshot, as the other proxies read
        it: (replicas sorted, decisions, their counts, the overflows of the last FRESH_S:
        (pin, replica, wall time), and for the stretch bound the decisions and each replica's
        picks since the window began). A window left out keeps its last entry, which ages out."""
        out = {}
        old = self.wall() - FRESH_S
        for route, w in self._routes.items():
            if w.fresh:
                for pin in [pin for pin, (_, at) in w.fresh.items() if at < old]:
                    del w.fresh[pin]
                _trim(w.fresh, _FRESH_MAX)
            if (w.recent or w.published < 0) and w.decided != w.published:  # (-1: restarted, `restart`)
                w.published = w.decided
                out[route] = _local(w, -1.0)
        return out

    def streamed(self) -> dict[str, "LocalWindow"]:
        """The same for the change stream (proxy/shared.py `flush`), with the overflows since the
        last call: each entry a proxy writes carries its windows that decided since, so the others'
        guard sees its decisions within a stream read (a few ms) rather than a load sync. Measured
        live, three proxies at 10x the rate: the guard's view of the others was 25 ms old at the
        median, 50-60 ms at p90, one sync plus the publisher's own; a stream entry reached the
        others in 4 ms (p90 18 ms). Offline, the same lag (a sync every 16 requests of each proxy)
        made three proxies cap 1.3x as many requests as with the others' windows current, half of
        the difference in a new population's second hundred requests, where its hot tenants grew
        late. Live, three proxies at 10x the rate (seeds 0-15): 0.9834 of the pooled bound over eight
        runs against 0.9820 over three of the release before, 12 % fewer overflows (docs/BENCHMARKS.md)."""
        out = {}
        now = self.wall()
        for route, w in self._routes.items():
            if (w.recent or w.streamed < 0) and w.decided != w.streamed:
                w.streamed = w.decided
                since, w.streamed_at = w.streamed_at, now
                out[route] = _local(w, since)
        return out

    def adopt(self, route: str, names: tuple[str, ...], overflows: list[tuple[int, str, float]]) -> None:
        """Another proxy's recent overflows: a tenant capped anywhere overflows to the same
        replica everywhere (its prompt is cached there), unless this proxy chose since."""
        window = self._routes.get(route)
        if window is None or window.key[1] != names:
            return
        old = self.wall() - FRESH_S  # (an idle proxy's last list stays readable longer)
        for pin, name, at in overflows:
            mine = window.fresh.get(pin)
            if at >= old and (mine is None or mine[1] < at):
                _remember(window.overflow, pin, name, len(window.names))

    def settled(self, route: str, pin: int) -> bool:
        """The tenant overflowed before: its traffic, not chance, meets the cap. Also while a
        fresh start's window fills: held back until it was full, a fresh start's hot tenants
        overflowed one request at a time and their replicas took 1.1-1.2x the mean over the
        first 800 requests; growing them, the fresh-start cells at full length kept or gained
        share (strong shape, three proxies +0.01: docs/BENCHMARKS.md)."""
        window = self._routes.get(route)
        return window is not None and window.again == pin

    def _shares(self, window: Window, candidates: Sequence[Backend]) -> dict[str, float] | None:
        """Each replica's part of the window by speed, times the replicas (1 each while all run
        alike: then None), recomputed when some load factor changed."""
        if window.speeds != Backend.speed_version:
            window.speeds = Backend.speed_version
            parts = speed.shares(candidates, self.speed_balance)
            window.shares = None if parts is None else {b.name: v for b, v in zip(candidates, parts)}
        return window.shares

    def _near_cap(self, window: Window, counts: dict[str, float], candidates: Sequence[Backend], chosen: Backend,
                  fair: float, slack: float, shares: dict[str, float] | None,
                  cached: str | None) -> tuple[Backend, bool]:
        """A new conversation about to take the last requests under its replica's cap goes where
        the prefix index says its whole prompt is, if that replica is well under its own cap: the
        cap then meets fewer requests whose prompt is cached nowhere else, each a cold prompt where
        it overflows (the guard's main cost: 29-60 in 2000 requests of the weak shape)."""
        there = next((b for b in candidates if b.name == cached), None)
        if there is not None and _room(counts, fair, slack, shares)(there) > _NEAR_ROOM:
            window.again = None  # (not an overflow: no growth from it)
            return there, True
        return chosen, False

    def _instead(self, window: Window, counts: dict[str, float], candidates: Sequence[Backend], pin: int,
                 members: Sequence[str], fair: float, slack: float, shares: dict[str, float] | None,
                 cached: str | None) -> Backend:
        room = _room(counts, fair, slack, shares)
        under = [b for b in candidates if room(b) >= 1.0]
        if not under:
            return max(candidates, key=room)
        own = [b for b in under if b.name in members]
        if own:
            return max(own, key=room)
        last = window.overflow.get(pin)
        window.again = pin if last is not None else None
        if last is None:  # (a spill's replica holds its prompt too; it counts for no growth)
            last = window.spills.get(pin)
        # where its prompt is (every proxy's index agrees through Redis; its overflow memory is its own)
        last = cached if any(b.name == cached for b in under) else last
        chosen = next((b for b in under if b.name == last), None) or max(under, key=room)
        _remember(window.overflow, pin, chosen.name, len(candidates))
        self._publish(window, pin, chosen.name)
        return chosen

    def _publish(self, window: Window, pin: int, name: str) -> None:
        """Where this proxy sent the tenant outside its set, for the other proxies (`snapshot`),
        newest last."""
        if self.shared is not None:
            fresh = window.fresh
            fresh.pop(pin, None)
            fresh[pin] = (name, self.wall())
            if len(fresh) > 2 * _FRESH_MAX:  # bounded also while nothing publishes (Redis down)
                _trim(fresh, _FRESH_MAX)

    def spilled_to(self, route: str, pin: int) -> str | None:
        """Where the placement last spilled this tenant, else where the guard overflowed it last."""
        window = self._routes.get(route)
        if window is None:
            return None
        return window.spills.get(pin) or window.overflow.get(pin)

    def spilled(self, route: str, pin: int, name: str) -> None:
        """The placement spilled a request of this tenant to `name` (outside its set, over the
        load bound): its next spill goes there too while there is room, and its overflows if
        it has none of its own."""
        window = self._routes.get(route)
        if window is not None:
            _remember(window.spills, pin, name, len(window.names))
            self._publish(window, pin, name)


def _local(w: Window, since: float) -> "LocalWindow":
    """The window as the other proxies read it (`snapshot`), with its overflows after `since`."""
    names = w.key[1]
    return (names, len(w.recent), [w.counts[name] for name in names],
            [(pin, name, at) for pin, (name, at) in w.fresh.items() if at > since],
            w.decided, [w.picks[name] for name in names])


def _lend(window: Window, name: str, capped: bool, elsewhere: bool, within: bool, most: float) -> bool:
    """Whether the cap turns this request away, given what it lent the replica: a capped request
    whose tenant's prompt is cached nowhere else (one replica, never overflowed) passes, within
    _LEND_OVER of the cap and `most` such requests outstanding; the next requests near the cap whose
    prompt is cached elsewhere too (another member of the set, the replica the tenant overflowed
    to) are turned away in their place. The cap holds the same load and costs fewer cold prompts."""
    lent = window.lent.get(name, 0)
    if capped and not elsewhere and within and lent < most:
        window.lent[name] = lent + 1
        return False
    if not capped and elsewhere and lent > 0:
        window.lent[name] = lent - 1
        return True
    return capped


def _part(per_replica: float, n: int, proxies: float) -> int:
    """This proxy's part of the window: `per_replica` requests a replica over all proxies."""
    size = int(per_replica * n / proxies)
    return n if n > size else size


def _loose(window: Window, filled: int, size: int, n: int) -> float:
    """A replica's extra allowance while a fresh start's window fills."""
    return window.filling * (1.0 - filled / size) * filled / n


def _cap(window: Window, epsilon: float, filled: int, size: int, n: int, others: "RemoteWindow | None",
         proxies: float) -> tuple[float, float]:
    """(a replica's fair part, the slack over it): of this proxy's window (looser while it fills)
    with its part of the slack, or, with the others' windows, of the whole fleet's with all of it
    (the looseness only for this proxy's own part)."""
    if others is None:
        return (1.0 + epsilon) * filled / n + _loose(window, filled, size, n), _SLACK / proxies
    return ((1.0 + epsilon) * (filled + others[0])) / n + _loose(window, filled, size, n), _SLACK


def _above(window: Window, name: str) -> float:
    """How far the replica's worst stretch ending now is over its allowance (0 when none is):
    the stretch bound caps this plus the request at hand."""
    level = window.level[name] - window.ticks * window.rate
    return level if level > 0.0 else 0.0


def _fold(window: Window, others: "RemoteWindow") -> None:
    """Fold the other proxies' decisions since their last sync into the stretch walks: each
    replica's new picks first, then the clock (their order within the interval is unknown; this
    one lets the fewest of them count twice). The first sight of them, or a fall in what they
    made since first seen (the shared view lost them for a while), is a starting point only."""
    first = window.folded is None
    decided, picks = others[2], others[3]
    window.folded = picks
    before, seen = window.seen
    window.seen = (decided, picks)
    if first or decided < before or any(n < seen.get(name, 0) for name, n in picks.items()):
        return
    level, base = window.level, window.ticks * window.rate
    for name, n in picks.items():
        new = n - seen.get(name, 0)
        if new and name in level:
            old = level[name]
            level[name] = (old if old > base else base) + new
    window.ticks += decided - before


def _room(counts: dict[str, float], fair: float, slack: float,
          shares: dict[str, float] | None) -> Callable[[Backend], float]:
    """Requests a replica may still take under its cap (each replica's by its share of the speed
    while some replica is slower)."""
    if shares:
        def room(b: Backend) -> float:
            return fair * shares[b.name] + slack - counts[b.name]
    else:
        def room(b: Backend) -> float:
            return fair + slack - counts[b.name]
    return room


def _remember(overflow: dict[int, str], pin: int, name: str, replicas: int) -> None:
    """The tenant's overflow replica, in a memory bounded by clearing it: the tenants of long
    ago need none."""
    if len(overflow) > 4 * replicas + 1024:
        overflow.clear()
    overflow[pin] = name


def _trim(entries: dict, keep: int) -> None:
    """Drop all but the `keep` newest (last inserted) entries."""
    for key in list(entries)[:len(entries) - keep]:
        del entries[key]
