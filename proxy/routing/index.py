"""The local prefix index: block hash -> the replica that last served it, with a per-replica
LRU sized like that replica's prefix cache, so the index forgets what the replica evicted."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class PrefixIndex:
    def __init__(self, capacity_per_backend: int) -> None:
        self.capacity = capacity_per_backend
        self.owner: dict[int, str] = {}
        self._lru: dict[str, OrderedDict[int, float]] = {}

    def __len__(self) -> int:
        return len(self.owner)

    def longest(self, chain: Sequence[int]) -> tuple[int, str | None]:
        """(number of leading blocks matched, replica) for the longest known prefix."""
        return longest_match(self.owner, chain)

    def record(self, chain: Sequence[int], backend: str, now: float, shared_ttl: float, limit: int = 0) -> list[int]:
        """Remember that `backend` now holds `chain`, keeping at most `limit` entries for it when
        that is below the index's capacity; returns the hashes whose shared (Redis) entry is
        missing or older than half its TTL, so writes are deduplicated."""
        lru = self._lru.get(backend)
        if lru is None:
            lru = self._lru[backend] = OrderedDict()
        owner = self.owner
        owned = owner.get
        touch = lru.move_to_end
        stale: list[int] = []
        refresh_before = now - shared_ttl / 2
        for h in chain:
            previous = owned(h)
            if previous == backend:
                touch(h)
                if lru[h] < refresh_before:
                    lru[h] = now
                    stale.append(h)
                continue
            if previous is not None:
                self._lru[previous].pop(h, None)
            owner[h] = backend
            lru[h] = now
            stale.append(h)
        cap = limit if 0 < limit < self.capacity else self.capacity
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            if owner.get(h) == backend:
                del owner[h]
        return stale

    def forget(self, backend: str) -> None:
        """A replica left or restarted: its cache is gone."""
        for h in self._lru.pop(backend, ()):
            if self.owner.get(h) == backend:
                del self.owner[h]


def longest_match(owner: dict[int, str], chain: Sequence[int]) -> tuple[int, str | None]:
    """(number of leading blocks of `chain` matched, replica) for the longest prefix that `owner`
    (block hash -> replica) knows: this index's, or the shared mirror's (proxy/shared.py)."""
    for i in range(len(chain) - 1, -1, -1):
        found = owner.get(chain[i])
        if found is not None:
            return i + 1, found
    return 0, None
