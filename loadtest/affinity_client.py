"""The load driver: C client coroutines sending the workload's streaming chat requests in order.

Workers take the next request in workload order; a continuation waits until the previous turn
of its conversation has completed (a user reads the answer first). The order requests were
actually sent is recorded, since the pooled bound must replay exactly that order. Each request
goes to the next router round-robin (by send sequence), as a plain L4 balancer in front of
several proxy instances would spread it, so turns of one conversation land on different proxies.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from loadtest.affinity_workload import Workload

ROUTE_HEADERS = ("x-vllm-proxy-backend", "x-vllm-proxy-route")


@dataclass
class LoadResult:
    sent_order: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # seconds to first content chunk, per success
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    reply_mismatches: int = 0  # streamed text differs from the sim reply the workload assumed
    routes: dict[str, int] = field(default_factory=dict)  # x-vllm-proxy-route reason -> count
    cached: dict[int, tuple[int, int]] = field(default_factory=dict)  # turn -> (cached, prompt) tokens, from usage
    served: dict[int, tuple[str, str]] = field(default_factory=dict)  # turn -> (backend, route reason) headers
    ttft_of: dict[int, float] = field(default_factory=dict)  # turn -> its ttft (for the trace)
    wall_s: float = 0.0

    def fail(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(message)


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, expected: str, out: LoadResult,
               index: int) -> None:
    start = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    finished = False
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                out.fail(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return
            reason = resp.headers.get("x-vllm-proxy-route")
            out.served[index] = (resp.headers.get("x-vllm-proxy-backend", ""), reason or "")
            if reason is not None:
                key = reason.split(":", 1)[0]
                out.routes[key] = out.routes.get(key, 0) + 1
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    finished = True
                    break
                event = orjson.loads(payload)
                if "error" in event:
                    out.fail(f"stream error: {payload[:200]!r}")
                    return
                usage = event.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached[index] = (details.get("cached_tokens") or 0, usage.get("prompt_tokens") or 0)
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        pieces.append(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        out.fail(f"{type(exc).__name__}: {exc}")
        return
    if not finished or ttft is None:
        out.fail("stream ended without [DONE] or without content")
        return
    out.ttft.append(ttft)
    out.ttft_of[index] = ttft
    if "".join(pieces) != expected:
        out.reply_mismatches += 1


async def run_load(workload: Workload, routers: list[str], concurrency: int, timeout_s: float = 120.0,
                   out: LoadResult | None = None, by_tenant: bool = False) -> LoadResult:
    """Send the workload; `out` (optional) is filled as requests go, for a watcher in another thread.
    Requests go to the routers in turn, or (`by_tenant`) each tenant's always to the same one (an
    L4 balancer that keeps a client on one proxy)."""
    turns, spec = workload.turns, workload.spec
    bodies = [orjson.dumps(t.body(spec)) for t in turns]
    completed = [asyncio.Event() for _ in turns]
    urls = [r + "/v1/chat/completions" for r in routers]
    out = out if out is not None else LoadResult()
    cursor = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal cursor
        while cursor < len(turns):
            i = cursor
            cursor += 1
            turn = turns[i]
            try:
                if turn.after is not None:
                    await completed[turn.after].wait()
                seq = len(out.sent_order)
                out.sent_order.append(i)
                await _one(session, urls[(turn.tenant if by_tenant else seq) % len(urls)], bodies[i], turn.reply, out, i)
            finally:
                completed[i].set()

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3)  # below the servers' 5 s keep-alive
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    out.wall_s = time.perf_counter() - start
    return out
