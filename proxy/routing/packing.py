"""The packing repair of `prefix_affinity`: which tenants to move so the caches are used evenly.

Each replica's prefix cache holds its tenants' system prompts and their conversations; its hit
rate falls fast once they outgrow it, and an under-used cache is room the fleet wastes. Replayed
layouts (loadtest.affinity_layouts) rank by how evenly tenants spread over the caches far more
than by small load differences. So a layout costs, per replica:

    room:  _ROOM_COST x pressure x (tenants - fair part)^2   (fair part: by cache size; pressure:
           1 once its prompts fill `cache_fill` of the cache, less while they fit easily)
    load:  _LOAD_WEIGHT x traffic share beyond the target ((1 + eps/2) x mean; shares in parts of
           the replica's speed when some replica decodes markedly slower, proxy/routing/speed.py)
           + _SPREAD_COST x (traffic share - mean share)^2: the target alone let a replica sit
           just past it for good (the fleet's max/mean over a run ended at 1.11-1.12 on the weak
           shape, for 1.03-1.07 with this term in replays)

A change is a move of a single-replica tenant or a swap of two (or a member replaced, below).
Getting out of a crowded corner often needs two changes where the first alone costs more (move a
heavy tenant out, then a light one in), so the search looks two changes deep, keeping the best
few first changes (a beam).
A tenant on several replicas absorbs imbalance (new conversations fill its least-loaded member:
its traffic is water-filled into its members, in parts of their speed). When the caller marks
it movable (`Layout.flex`), one of its members may be replaced by another replica, alone or in a
swap with a single-replica tenant there: on a fleet with a slower replica, a hot tenant that
grew onto it (before its speed was known, or by load alone) fills that replica's small part of
the traffic by itself, leaving its cache nearly empty while the fast ones crowd; the slow
replica serves the fleet best holding many light tenants. A tenant is not moved back where it
came from for a while: share estimates are noisy (with three proxies the planner sees a third of
the traffic) and the load term is steep, so undoing is mostly noise.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from typing import Iterator

# costs in shares of all traffic; a change must save _MIN_GAIN after paying _MOVE_COST per tenant
# moved (its next conversation misses once; the estimates are noisy)
_ROOM_COST = 0.02
_LOAD_WEIGHT = 5.0
_SPREAD_COST = 50.0
_MOVE_COST = 0.005
_MIN_GAIN = 0.02
_WORK = 4000  # layouts evaluated per repair x replicas (each costs O(replicas)): bounds its time
_BEAM = 6  # first changes explored a second step deep

Move = tuple[float, int, int, int]  # (tenant share, pin, from replica, to replica)


Flex = tuple[tuple[float, int, tuple[int, ...]], ...]  # movable multi-replica tenants (share, pin, replicas)


@dataclass
class Layout:
    counts: list[int]  # tenants (prompts) per replica
    fixed: list[float]  # traffic share of its single-replica tenants
    singles: list[list[tuple[float, int]]]  # its movable tenants (share, pin), sorted
    banned: frozenset[tuple[int, int]] = frozenset()  # (pin, replica) moves not to make: recent undos
    flex: Flex = ()  # multi-replica tenants one of whose members may move

    def __post_init__(self) -> None:
        self.multi = frozenset(pin for _, pin, _ in self.flex)

    def shifted(self, moves: tuple[Move, ...]) -> tuple[list[int], list[float]]:
        """Tenants and fixed traffic per replica after `moves`."""
        counts, fixed, multi = list(self.counts), list(self.fixed), self.multi
        for share, pin, a, b in moves:
            counts[a] -= 1
            counts[b] += 1
            if pin not in multi:  # (a member move leaves the traffic to the water-fill)
                fixed[a] -= share
                fixed[b] += share
        return counts, fixed

    def moved(self, moves: tuple[Move, ...]) -> Flex:
        """The movable multi-replica tenants after `moves`."""
        if not self.multi or not any(m[1] in self.multi for m in moves):
            return self.flex
        swap = {pin: (a, b) for _, pin, a, b in moves}
        out = []
        for share, pin, inside in self.flex:
            if pin in swap:
                a, b = swap[pin]
                inside = tuple(b if i == a else i for i in inside)
            out.append((share, pin, inside))
        return tuple(out)

    def after(self, moves: tuple[Move, ...]) -> Layout:
        singles = list(self.singles)
        for share, pin, a, b in moves:
            if pin not in self.multi:
                singles[a] = [t for t in singles[a] if t[1] != pin]
                singles[b] = sorted(singles[b] + [(share, pin)])
        return Layout(*self.shifted(moves), singles, self.banned, self.moved(moves))


class Packing:
    def __init__(self, fair: list[float], pressure: list[float], target: float,
                 flex: list[tuple[float, list[int]]], speed: list[float] | None = None) -> None:
        self.fair, self.target = fair, target
        self.speed = speed  # each replica's part of the fleet's speed x replicas (None: all alike)
        self.weight = [_ROOM_COST * p for p in pressure]
        self.flex = sorted(flex, reverse=True)  # (share, replicas) of multi-replica tenants that stay
        self.n = len(fair)

    def loads(self, fixed: list[float], flex: Flex = ()) -> list[float]:
        """Traffic per replica in parts of its speed: the fixed part, and each multi-replica
        tenant's water-filled into its members (the least loaded first, as new conversations go)."""
        speed = self.speed or [1.0] * self.n
        loads = [f / s for f, s in zip(fixed, speed)]
        tenants = self.flex if not flex else sorted(self.flex + [(share, list(inside)) for share, _, inside in flex],
                                                    reverse=True)
        for share, inside in tenants:
            # the level L with sum over members of speed x max(0, L - load) = share
            members = sorted(inside, key=loads.__getitem__)
            width, filled, level = 0.0, 0.0, 0.0
            for k, i in enumerate(members):
                width += speed[i]
                filled += speed[i] * loads[i]
                level = (filled + share) / width
                if k + 1 == len(members) or level <= loads[members[k + 1]]:
                    break
            for i in inside:
                if loads[i] < level:
                    loads[i] = level
        return loads

    def room(self, counts: list[int]) -> list[float]:
        return [w * (c - f) ** 2 for w, c, f in zip(self.weight, counts, self.fair)]

    def costs(self, counts: list[int], fixed: list[float], flex: Flex = ()) -> list[float]:
        target, loads = self.target, self.loads(fixed, flex)
        mean = sum(loads) / self.n
        return [room + _LOAD_WEIGHT * max(0.0, load - target) + _SPREAD_COST * (load - mean) ** 2
                for room, load in zip(self.room(counts), loads)]

    def changes(self, layout: Layout) -> Iterator[tuple[Move, ...]]:
        """Moves out of the costliest replicas first, each also as swaps with the tenants of the
        target whose shares come closest to evening out the two replicas' traffic."""
        costs = self.costs(layout.counts, layout.fixed, layout.flex)
        loads, banned = self.loads(layout.fixed, layout.flex), layout.banned
        for a in sorted(range(self.n), key=costs.__getitem__, reverse=True):
            if costs[a] <= 0:
                return
            # (traffic that leaves a, pin, the tenant's whole share, replicas it must not go to)
            movable = [(share, pin, share, ()) for share, pin in layout.singles[a]]
            movable += [(share / len(inside), pin, share, inside) for share, pin, inside in layout.flex if a in inside]
            for share, pin, whole, members in movable:
                for b in range(self.n):
                    if b == a or b in members or (pin, b) in banned:
                        continue
                    yield ((whole, pin, a, b),)
                    side = layout.singles[b]
                    at = bisect.bisect_left(side, (share - (loads[a] - loads[b]) / 2,))
                    for other, pin2 in side[max(at - 1, 0):at + 1]:
                        if (pin2, a) not in banned:
                            yield (whole, pin, a, b), (other, pin2, b, a)

    def plan(self, layout: Layout) -> tuple[Move, ...]:
        """The change, or pair of changes, that saves the most cost, if it saves enough. The second
        step starts from the first changes with the lowest cost, and from those that spread the
        prompts best whatever their traffic costs (the second change may even it out)."""
        best: tuple[Move, ...] = ()
        best_cost = sum(self.costs(layout.counts, layout.fixed, layout.flex)) - _MIN_GAIN
        first: list[tuple[float, float, int, tuple[Move, ...]]] = []
        budget = max(_WORK // self.n, 2 * _BEAM) // 2
        for k, moves in enumerate(itertools.islice(self.changes(layout), budget)):
            counts, fixed = layout.shifted(moves)
            cost = sum(self.costs(counts, fixed, layout.moved(moves))) + _MOVE_COST * len(moves)
            first.append((cost, round(sum(self.room(counts)), 9), k, moves))  # rounded: ties stay ties
            if cost < best_cost:
                best, best_cost = moves, cost
        beam = {k: moves for _, _, k, moves in heapq.nsmallest(_BEAM // 2, first)}
        spread = heapq.nsmallest(_BEAM // 2, first, key=lambda f: (f[1], f[0]))
        beam.update((k, moves) for _, _, k, moves in spread)
        for moves in beam.values():  # (empty when nothing is movable)
            step = layout.after(moves)
            done = {m[1] for m in moves}
            for more in itertools.islice(self.changes(step), budget // len(beam)):
                if any(m[1] in done for m in more):
                    continue
                both = moves + more
                cost = sum(self.costs(*step.shifted(more), step.moved(more))) + _MOVE_COST * len(both)
                if cost < best_cost:
                    best, best_cost = both, cost
        return best
