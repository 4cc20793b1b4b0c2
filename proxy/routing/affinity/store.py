"""The tenant table's storage: pin -> (replica set, wall time of its last write).

Two stores behind one interface, so the placement logic has no "with Redis / without" branches:
`LocalStore` (this process is the authority: writes land at once, nothing is shared) and
`SharedStore` (proxy/shared.py's mirror of the Redis table: writes land in the mirror at once
and reach Redis in the background; a new tenant's placement is first-writer-wins, a set change a
compare-and-set, so proxies agree). `changes` bumps whenever the table changed behind the
caller's back or by a write here, so cached per-replica tenant counts know when to recount.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

from proxy.shared import Others, SharedState

Pins = dict[int, tuple[tuple[str, ...], float]]


class TenantStore(Protocol):
    pins: Pins

    @property
    def up(self) -> bool:
        """Writes are accepted now (a shared store while Redis answers; a local one always)."""

    @property
    def changes(self) -> int: ...

    def place(self, pin: int, replica: str) -> tuple[str, ...] | None:
        """A new tenant on `replica`, unless another proxy placed it first; the set in force, or
        None when the store cannot take it now."""

    def change(self, pin: int, old: Sequence[str], new: Sequence[str]) -> tuple[str, ...] | None:
        """Grow, re-home or move a tenant from `old` to `new`; the set in force, or None."""

    def set(self, pin: int, members: Sequence[str]) -> None:
        """Write a set unconditionally (shrink, refresh)."""

    def forget_idle(self, idle: Callable[[int], bool]) -> None:
        """Drop idle placements (a shared mirror expires its own by TTL)."""

    async def lease(self, name: str, seconds: float) -> bool:
        """True while this process is the one that may plan (the packing repair)."""

    async def other_tenants(self) -> Others | None:
        """The other proxies' published tenant request counts and their total, if any."""


class LocalStore:
    """This process's own table: the authority when there is no Redis."""

    up = True

    def __init__(self, wall: Callable[[], float]) -> None:
        self.pins: Pins = {}
        self.changes = 0
        self._wall = wall

    def place(self, pin: int, replica: str) -> tuple[str, ...] | None:
        members = (replica,)
        self.set(pin, members)
        return members

    def change(self, pin: int, old: Sequence[str], new: Sequence[str]) -> tuple[str, ...] | None:
        self.set(pin, new)
        return tuple(new)

    def set(self, pin: int, members: Sequence[str]) -> None:
        self.pins[pin] = (tuple(members), self._wall())
        self.changes += 1

    def forget_idle(self, idle: Callable[[int], bool]) -> None:
        pins = self.pins
        for pin in [p for p in pins if idle(p)]:
            del pins[pin]

    async def lease(self, name: str, seconds: float) -> bool:
        return True

    async def other_tenants(self) -> None:
        return None


class SharedStore:
    """The Redis-backed table through proxy/shared.py's mirror (its protocol and keys)."""

    def __init__(self, shared: SharedState) -> None:
        self.shared = shared
        self.pins: Pins = shared.pins

    @property
    def up(self) -> bool:
        return self.shared.up

    @property
    def changes(self) -> int:
        return self.shared.pins_changed

    def place(self, pin: int, replica: str) -> tuple[str, ...] | None:
        return self.shared.place(pin, replica) if self.shared.up else None

    def change(self, pin: int, old: Sequence[str], new: Sequence[str]) -> tuple[str, ...] | None:
        return self.shared.grow(pin, old, new)

    def set(self, pin: int, members: Sequence[str]) -> None:
        self.shared.set_pin(pin, members)

    def forget_idle(self, idle: Callable[[int], bool]) -> None:
        pass

    async def lease(self, name: str, seconds: float) -> bool:
        return await self.shared.lease(name, seconds)

    async def other_tenants(self) -> Others | None:
        return await self.shared.other_tenants()
