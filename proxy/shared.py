"""State shared by every proxy process through Redis: the prefix index and the load view.

The request path makes at most one Redis round trip (an MGET of the prompt's block hashes),
bounded by a short timeout. Writes are batched by a background flusher, and each proxy
publishes its per-replica in-flight counts a few times a second. When Redis is unreachable the
proxy routes on local state (rendezvous hashing keeps replicas in agreement), logs once, shows
it in `vllm_proxy_redis_up`, and reconnects by itself.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable, Sequence

import redis.asyncio as redis

log = logging.getLogger("vllm_proxy.shared")

INDEX_PREFIX = "vp:px:"
LOAD_KEY = "vp:load"


class SharedState:
    def __init__(
        self,
        url: str,
        *,
        ttl_s: float = 600.0,
        timeout_s: float = 0.05,
        sync_interval_s: float = 0.1,
        local_load: Callable[[], dict[str, int]],
        on_status: Callable[[bool], None] = lambda up: None,
    ) -> None:
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=max(timeout_s, 0.2), decode_responses=True,
            retry=None, health_check_interval=0,
        )
        self.ttl = int(ttl_s)
        self.timeout = timeout_s
        self.sync_interval = sync_interval_s
        self.local_load = local_load
        self.on_status = on_status
        self.proxy_id = f"{os.uname().nodename}:{os.getpid()}:{id(self):x}"
        self.up = False
        self._said_down = False
        self.remote_load: dict[str, int] = {}
        self._pending: dict[int, str] = {}
        self._task: asyncio.Task | None = None

    # -- request path -------------------------------------------------------------------------
    async def longest(self, chain: Sequence[int]) -> tuple[int, str | None] | None:
        """Longest shared prefix match, or None when Redis cannot answer now (use local state)."""
        if not self.up or not chain:
            return (0, None) if self.up else None
        try:
            owners = await asyncio.wait_for(
                self.client.mget([f"{INDEX_PREFIX}{h:016x}" for h in chain]), self.timeout
            )
        except Exception as exc:  # timeouts, resets, refused: all mean "local mode for now"
            self._down(exc)
            return None
        for i in range(len(owners) - 1, -1, -1):
            if owners[i]:
                return i + 1, owners[i]
        return 0, None

    def remember(self, hashes: Sequence[int], backend: str) -> None:
        """Queue index writes; the flusher sends them in one pipeline."""
        if self.up:
            for h in hashes:
                self._pending[h] = backend

    # -- background ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self.client.hdel(LOAD_KEY, *[f"{self.proxy_id}|{b}" for b in self.local_load()])
        except Exception:
            pass
        await self.client.aclose()

    async def _run(self) -> None:
        while True:
            try:
                await self._sync()
                if not self.up:
                    self.up, self._said_down = True, False
                    log.info("redis reachable: sharing the prefix index and load view")
                    self.on_status(True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._down(exc)
            await asyncio.sleep(self.sync_interval if self.up else 1.0)

    async def _sync(self) -> None:
        """Flush index writes, publish our in-flight counts, read everyone else's."""
        now = time.time()
        pending, self._pending = self._pending, {}
        pipe = self.client.pipeline(transaction=False)
        for h, backend in pending.items():
            pipe.set(f"{INDEX_PREFIX}{h:016x}", backend, ex=self.ttl)
        mine = {f"{self.proxy_id}|{b}": f"{n}|{now:.3f}" for b, n in self.local_load().items()}
        if mine:
            pipe.hset(LOAD_KEY, mapping=mine)
        pipe.hgetall(LOAD_KEY)
        results = await asyncio.wait_for(pipe.execute(), max(self.timeout * 4, 0.5))
        self.remote_load = self._others(results[-1], now)

    def _others(self, table: dict[str, str], now: float) -> dict[str, int]:
        totals: dict[str, int] = {}
        stale = []
        for field, value in table.items():
            proxy, _, backend = field.rpartition("|")
            count, _, stamp = value.partition("|")
            try:
                age = now - float(stamp)
                n = int(count)
            except ValueError:
                stale.append(field)
                continue
            if age > 5.0:
                stale.append(field)
            elif proxy != self.proxy_id and age <= max(1.0, 10 * self.sync_interval):
                totals[backend] = totals.get(backend, 0) + n
        if stale:
            asyncio.get_running_loop().create_task(self._drop(stale))
        return totals

    async def _drop(self, fields: list[str]) -> None:
        try:
            await self.client.hdel(LOAD_KEY, *fields)
        except Exception:
            pass

    def _down(self, exc: BaseException) -> None:
        if self.up or not self._said_down:
            self._said_down = True
            log.warning("redis unreachable (%s): routing on local state until it returns", exc or type(exc).__name__)
            self.up = False
            self.remote_load = {}
            self._pending = {}
            self.on_status(False)
