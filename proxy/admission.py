"""Admission control: per-replica in-flight limits with one bounded, timed wait queue.

When every eligible replica is at its `max_in_flight`, a request waits (FIFO) for a slot; when
the queue is full or the wait times out it gets 429 with Retry-After, which the OpenAI SDK
honours. Replicas without a limit never make anyone wait.
"""
from __future__ import annotations

import asyncio
from collections import deque

from proxy.errors import ProxyError


class Admission:
    def __init__(self, max_queue: int, timeout_s: float) -> None:
        self.max_queue = max_queue
        self.timeout = timeout_s
        self._waiters: deque[asyncio.Future] = deque()

    async def wait(self) -> None:
        """Wait until some replica frees a slot (or raise the 429)."""
        if len(self._waiters) >= self.max_queue:
            raise saturated("The model servers are saturated and the wait queue is full; retry shortly.")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, self.timeout)
        except asyncio.TimeoutError:
            raise saturated("Timed out waiting for a free model server slot; retry shortly.") from None
        except asyncio.CancelledError:  # the client left: a slot handed to us goes to the next waiter
            if waiter.done() and not waiter.cancelled():
                self.released()
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass

    @property
    def queued(self) -> int:
        """Requests waiting for a slot right now."""
        return sum(not w.done() for w in self._waiters)

    def released(self) -> None:
        """A slot freed: wake the oldest waiter (it re-checks the replicas itself)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def saturated(message: str) -> ProxyError:
    return ProxyError(
        429, message, code="server_saturated", type="rate_limit_error",
        headers=[(b"retry-after", b"1"), (b"retry-after-ms", b"1000")],
    )
