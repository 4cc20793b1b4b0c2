"""The control-plane HTTP client (discovery, scraping, probes, LoRA admin): httpx, with one small
connection pool per replica.

httpx's pool (httpcore) looks at every pooled connection for each request it places, polling each
idle one's socket: one pool shared by N replicas costs O(N) per request, a round over all of them
O(N^2). Measured with loadtest/control_plane.py at 64 replicas (a discovery and a scrape round):
1.9 ms of CPU per request, a quarter-second of the serving event loop per round. With a pool per
replica each placement looks at one connection: ~0.5 ms per request (32 KiB /metrics parse
included; aiohttp's session, before, ~0.19 ms), ~65 ms of CPU per 5 s round at 64 replicas.
"""
from __future__ import annotations

import asyncio
import ssl
import time
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from proxy.routing.backends import Backend

# A replica's pool unused this long is closed when a new replica appears (pods come and go: their
# pools must not pile up). Longer than any control-plane call and any discovery interval.
IDLE_CLOSE_S = 900.0
# The most a control-plane answer (/v1/models, /metrics, LoRA admin) may be: a replica that
# sends more is broken or hostile; reading it whole would take the proxy's memory with it, and
# parsing it blocks the event loop (4 MiB of metric lines: ~0.2 s; vLLM's own are ~100 KiB).
CONTROL_BODY_LIMIT = 4 << 20


async def read_capped(resp: httpx.Response, limit: int = CONTROL_BODY_LIMIT) -> bytes:
    """The body of a streamed `resp` as sent (never decompressed: we ask for identity, and a 1 MiB
    gzip can hold 1 GiB), or a ValueError once it is known to exceed `limit`."""
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ValueError(f"answer of {declared} bytes exceeds {limit}")
    body = bytearray()
    async for chunk in resp.aiter_raw():
        body += chunk
        if len(body) > limit:
            raise ValueError(f"answer exceeds {limit} bytes")
    return bytes(body)


class PerReplica(httpx.AsyncBaseTransport):
    """Routes each request to the transport of its origin (scheme, host, port)."""

    def __init__(self, keep_alive_s: float) -> None:
        self.keep_alive_s = keep_alive_s
        self._pools: dict[tuple, list] = {}  # origin -> [transport, last used (monotonic)]
        self._context: ssl.SSLContext | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin = (url.scheme, url.host, url.port)
        now = time.monotonic()
        entry = self._pools.get(origin)
        if entry is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=self.keep_alive_s)
            transport = httpx.AsyncHTTPTransport(limits=limits, verify=self._tls() if url.scheme == "https" else False)
            entry = self._pools[origin] = [transport, now]  # before any await: one pool per origin
            await self._close_idle(now)
        entry[1] = now
        return await entry[0].handle_async_request(request)

    def _tls(self) -> ssl.SSLContext:
        """One context for every https replica: building one reads the CA store (~50 ms of CPU)."""
        if self._context is None:
            self._context = ssl.create_default_context()
        return self._context

    async def _close_idle(self, now: float) -> None:
        for origin in [o for o, (_, used) in self._pools.items() if now - used > IDLE_CLOSE_S]:
            await self._pools.pop(origin)[0].aclose()

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for transport, _ in pools.values():
            await transport.aclose()


def client(keep_alive_s: float, connect_s: float, read_s: float) -> httpx.AsyncClient:
    """Every call also passes its own total timeout (`fetch`, LoraManager._post)."""
    return httpx.AsyncClient(
        transport=PerReplica(keep_alive_s),
        timeout=httpx.Timeout(None, connect=connect_s, read=read_s),
        headers={"user-agent": "vllm-proxy", "accept-encoding": "identity"},
        trust_env=False,  # no HTTP(S)_PROXY detour: replicas are reached directly
    )


async def fetch(backend: "Backend", client: httpx.AsyncClient, path: str, timeout_s: float) -> bytes:
    """GET a control-plane path (`/v1/models`, `/metrics`) of `backend` with the replica's key,
    within `timeout_s` in all; the body of a 200, else an exception (any failure means "no answer
    now"; running out of time is an asyncio.TimeoutError)."""
    headers = backend.headers
    auth = {"Authorization": headers["Authorization"]} if "Authorization" in headers else None
    try:
        return await asyncio.wait_for(_get(client, backend.url + path, auth, timeout_s), timeout_s)
    except httpx.TimeoutException:
        raise asyncio.TimeoutError() from None


async def _get(client: httpx.AsyncClient, url: str, auth: dict | None, timeout_s: float) -> bytes:
    async with client.stream("GET", url, headers=auth, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            raise ValueError(f"HTTP {resp.status_code}")
        return await read_capped(resp)
