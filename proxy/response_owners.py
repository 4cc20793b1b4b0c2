"""Which replica holds each response of the Responses API (vLLM keeps them in its own memory).

A bounded local LRU answers on the request path. With Redis, every new record is written and
published in the background (a batch per wake-up: SET with a TTL, one PUBLISH), and each proxy's
subscriber copies the others' records into its LRU, so a follow-up reaching another proxy finds
its owner locally without a round trip. A record not known locally (a proxy that started later,
a publish still in flight) costs one GET, bounded by the Redis timeout; Redis being away only
leaves the local records (and the caller's probe of the replicas, proxy/responses.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import redis.asyncio as redis

from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.responses")

KEY_PREFIX = "vp:resp:"
CHANNEL = "vp:resp"


class ResponseOwners:
    def __init__(self, max_local: int, redis_url: str | None = None, ttl_s: float = 86400.0,
                 timeout_s: float = 0.05) -> None:
        self.max_local = max_local
        self.local: OrderedDict[str, str] = OrderedDict()  # response id -> "backend\tdeployment"
        self.ttl = max(1, int(ttl_s))
        self.timeout = timeout_s
        self.client = None
        if redis_url is not None:
            self.client = redis.Redis.from_url(
                redis_url, socket_timeout=max(timeout_s, 1.0), socket_connect_timeout=max(timeout_s, 0.2),
                decode_responses=True, health_check_interval=0, retry=None,
            )
        self._pending: list[tuple[str, str]] = []
        self._wake: asyncio.Event | None = None
        self._tasks = Supervisor("response records")  # a child of the process's, from start()
        self.subscribed: asyncio.Event | None = None  # set once the subscriber listens (tests wait on it)
        # replicas asked at once about ids no record names (proxy/responses.py): a client sending
        # made-up ids cannot multiply itself into a flood of requests to every replica
        self.probe_slots = asyncio.Semaphore(8)

    def start(self, tasks: Supervisor | None = None) -> None:
        if tasks is not None:
            self._tasks = tasks.child("response records")
        if self.client is not None:
            self._wake = asyncio.Event()
            self.subscribed = asyncio.Event()
            self._tasks.spawn(self._write_loop(), "response records: Redis writer")
            self._tasks.spawn(self._listen_loop(), "response records: Redis listener")

    async def stop(self) -> None:
        await self._tasks.stop()
        if self.client is not None:
            await self.client.aclose()

    # -- request path ----------------------------------------------------------------------
    def remember(self, response_id: str, backend: str, deployment: str) -> None:
        value = f"{backend}\t{deployment}"
        self._put(response_id, value)
        if self._wake is not None:
            self._pending.append((response_id, value))
            self._wake.set()

    def known(self, response_id: str) -> tuple[str, str] | None:
        """(backend, deployment) from this proxy's memory."""
        value = self.local.get(response_id)
        if value is None:
            return None
        self.local.move_to_end(response_id)
        backend, _, deployment = value.partition("\t")
        return backend, deployment

    async def lookup(self, response_id: str) -> tuple[str, str] | None:
        """(backend, deployment) from memory, else from Redis (one bounded GET), else None."""
        found = self.known(response_id)
        if found is not None or self.client is None:
            return found
        try:
            value = await asyncio.wait_for(self.client.get(KEY_PREFIX + response_id), self.timeout)
        except Exception:  # noqa: BLE001 (Redis away or slow: the caller probes the replicas)
            return None
        if not value:
            return None
        self._put(response_id, value)
        return self.known(response_id)

    def _put(self, response_id: str, value: str) -> None:
        local = self.local
        local[response_id] = value
        local.move_to_end(response_id)
        while len(local) > self.max_local:
            local.popitem(last=False)

    # -- background ------------------------------------------------------------------------
    async def _write_loop(self) -> None:
        wake = self._wake
        while True:
            await wake.wait()
            wake.clear()
            batch, self._pending = self._pending, []
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    for response_id, value in batch:
                        pipe.set(KEY_PREFIX + response_id, value, ex=self.ttl)
                    pipe.publish(CHANNEL, "\n".join(f"{r}\t{v}" for r, v in batch))
                    await pipe.execute()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (records stay local; the next batch tries again)
                log.warning("could not share %d response owner records: %s", len(batch), exc)
                await asyncio.sleep(0.5)

    async def _listen_loop(self) -> None:
        while True:
            try:
                async with self.client.pubsub() as pubsub:
                    await pubsub.subscribe(CHANNEL)
                    self.subscribed.set()
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            for line in message["data"].split("\n"):
                                response_id, _, value = line.partition("\t")
                                if value:
                                    self._put(response_id, value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (reconnect; GET covers what was missed)
                self.subscribed.clear()
                log.warning("response owner subscription lost: %s", exc)
                await asyncio.sleep(1.0)
