"""Cold-prompt coalescing: one request computes a system prompt, the others wait for it.

A new tenant's first requests, or a set's newest member's, often arrive together (a release
shipped a new system prompt; sixteen clients started at once). Sent at once they all compute
the same prompt side by side: vLLM caches a prompt's blocks only once computed, so each of them
pays the whole prefill, and a batch of them takes GPU time from everyone. Here the first
*streamed* request whose prompt the prefix index does not place on its replica leads; a later
request of the same tenant to the same replica, while the leader has not relayed its first token,
waits for that (until `coalesce_wait_s` after the leader began) and then finds the prompt
cached. Its time to first token is about what computing the prompt itself would have taken. The
leader is released by the data path (`ParsedRequest.warmed`: on its first SSE data event, and
when its exchange ends, whatever happened); a non-streamed request never leads (its first byte is
its last). A follower waits in the data path (`ParsedRequest.wait_for`) once its lease counts it
in flight, so it counts against its replica's `max_in_flight` and load meanwhile, and a client
that leaves while it waits is a disconnect before the first byte.

With shared state (Redis) the proxies tell each other: a leader's start and release go out in the
change stream at once (`publish`, proxy/shared.py `warming`), and a follower at another proxy
waits for it alike (`remote`), so a new tenant's first requests spread over three proxies compute
its prompt once, not three times. A request that arrives within the stream's delivery time
(~1 ms) of the leader still computes beside it.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from proxy.parse import ParsedRequest

_MAX = 4096  # prompts being computed at once that are tracked (beyond: all released, tracking restarts)


class Coalescer:
    def __init__(self, wait_s: float, publish: Callable[[int, str, bool], None] | None = None) -> None:
        self.wait_s = wait_s
        self.publish = publish  # (pin, replica, computing) to the other proxies: a leader began / ended
        self._mine: set[tuple[int, str]] = set()  # the leaders of this proxy
        self._remote: set[tuple[int, str]] = set()  # the other proxies' leaders followed here
        # another proxy's leader on a key this proxy leads too (both placed the tenant at once): when
        # it began (`yield_lead`)
        self._shadowed: dict[tuple[int, str], float] = {}
        # (tenant pin, replica) -> (released when the leader's first token is relayed, when it began)
        self.warming: dict[tuple[int, str], tuple[asyncio.Future, float]] = {}
        self.waiting = 0  # requests waiting for a leader now

    def check(self, pin: int, replica: str, known: bool, request: ParsedRequest) -> tuple | None:
        """Before `request` goes to `replica`: the leader to wait for while another request computes
        its tenant's prompt there; or None, after making this request the leader when it is the one
        to compute it (`known`: the prefix index already places the prompt there). A leader older
        than `wait_s` is no leader any more (its exchange may never have started: a failed pick)."""
        key = (pin, replica)
        leader = self.warming.get(key)
        if leader is not None:
            if self._live(leader):
                return leader
            self._release(key)
        if not known and request.stream:
            if request.warmed is not None:  # picked again (a hook refused its first replica): lead here
                request.warmed()
            future = self._track(key)
            request.warmed = lambda: self._release(key, future)
            if self.publish is not None:
                self._mine.add(key)
                self.publish(pin, replica, True)
        return None

    def remote(self, pin: int | None, replica: str, computing: bool, age: float) -> None:
        """Another proxy's leader began computing this tenant's prompt on `replica` `age` seconds
        ago, or relayed its first token: followers here wait for it (as long as for a leader of
        this proxy's, from its start), or go now. `pin` None: the others' leaders will not be
        heard of any more (Redis went away): every follower of theirs goes now."""
        if pin is None:
            for key in list(self._remote):
                self._release(key)
            return
        key = (pin, replica)
        if not computing:
            self._shadowed.pop(key, None)
            if key in self._remote:
                self._release(key)
            return
        leader = self.warming.get(key)
        if leader is None or not self._live(leader):
            self._release(key)
            self._track(key, age)
            self._remote.add(key)
        elif key in self._mine:
            if len(self._shadowed) >= _MAX:
                self._shadowed.clear()
            self._shadowed[key] = asyncio.get_running_loop().time() - age

    def yield_lead(self, pin: int, replica: str, request: ParsedRequest) -> tuple | None:
        """Another proxy placed `request`'s tenant first (arrivals.py) and it goes to `replica`:
        it stops leading where it was decided and follows the leader computing the prompt on
        `replica` (another proxy's, also when both led there: theirs came first), else leads there."""
        if request.warmed is not None:
            request.warmed()
            request.warmed = None
        request.wait_for = None
        key = (pin, replica)
        began = self._shadowed.pop(key, None)
        if began is not None and key not in self.warming:
            self.warming[key] = (asyncio.get_running_loop().create_future(), began)
            self._remote.add(key)
        return self.check(pin, replica, False, request)

    async def follow(self, leader: tuple) -> None:
        """Wait for `leader` (from `check`) to relay its first token, at most `wait_s` from its start."""
        future, began = leader
        self.waiting += 1
        try:
            await asyncio.wait((future,), timeout=max(began + self.wait_s - asyncio.get_running_loop().time(), 0.0))
        finally:
            self.waiting -= 1

    def _live(self, leader: tuple[asyncio.Future, float]) -> bool:
        """Still computing, and begun less than `wait_s` ago."""
        return not leader[0].done() and asyncio.get_running_loop().time() - leader[1] < self.wait_s

    def _track(self, key: tuple[int, str], age: float = 0.0) -> asyncio.Future:
        """A prompt being computed since `age` seconds ago (bounded: past _MAX all are released)."""
        if len(self.warming) >= _MAX:
            for other in list(self.warming):
                self._release(other)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.warming[key] = (future, loop.time() - age)
        return future

    def _release(self, key: tuple[int, str], future: asyncio.Future | None = None) -> None:
        """Followers of the leader of `key` go now (only if it is still `future`'s, when given:
        a leader released late does not release its successor)."""
        leader = self.warming.get(key)
        if leader is None or future is not None and leader[0] is not future:
            return
        del self.warming[key]
        if not leader[0].done():
            leader[0].set_result(None)
        self._remote.discard(key)
        if key in self._mine:
            self._mine.discard(key)
            if self.publish is not None:
                self.publish(key[0], key[1], False)
