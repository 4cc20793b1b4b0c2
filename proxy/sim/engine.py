"""Scheduler and latency model: a FIFO waiting queue in front of a bounded running batch.

At most `max_num_seqs` requests run at once and the batch holds at most `max_loras` distinct
adapters; a request whose adapter does not fit is skipped (not blocking those behind it), as in
vLLM's scheduler. A scheduled request looks up the prefix cache, sleeps for its uncached prefill,
inserts its blocks, then emits one token per inter-token interval. Cancelling `execute` (client
disconnect) removes the request from the queue or batch at once and counts it as aborted.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from proxy.sim.cache import PrefixCache
from proxy.sim.config import SimConfig
from proxy.sim.faults import Faults
from proxy.sim.metrics import SimMetrics
from proxy.sim.models import Models
from proxy.sim.tokenizer import token_id

WAITING, RUNNING, DONE = 0, 1, 2


@dataclass(eq=False, slots=True)
class Request:
    """One API request as the engine sees it. Choice i answers prompts[i // n]."""

    kind: str  # "chat" | "completion" | "embedding"
    model: str  # the name the client sent, echoed back
    adapter: str | None
    prompts: list[list[int]]
    n: int = 1
    outputs: list[list[str]] = field(default_factory=list)  # text pieces (one token each) per choice
    finish: list[str] = field(default_factory=list)  # finish_reason per choice
    stream: bool = False
    include_usage: bool = False
    tool: str | None = None  # function name when the answer is a tool call
    multimodal: bool = False
    options: dict = field(default_factory=dict)  # endpoint-specific extras (e.g. encoding_format)
    # filled in by the engine
    state: int = WAITING
    admitted: asyncio.Future | None = None
    cached_tokens: int = 0
    steps_done: int = 0
    hashes: list[list[int]] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def completion_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def steps(self) -> int:
        return max(map(len, self.outputs), default=0)


@dataclass
class Stats:
    """Counters for tests and /sim/stats."""

    requests: Counter = field(default_factory=Counter)  # by served model id (adapter names too)
    not_found: Counter = field(default_factory=Counter)  # requests for a model id it does not serve
    multimodal: int = 0
    completed: int = 0
    aborted: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


Emit = Callable[[int], Awaitable[None]]


class Engine:
    def __init__(self, config: SimConfig, models: Models, metrics: SimMetrics, faults: Faults | None = None) -> None:
        self.config = config
        self.faults = faults or Faults()
        self.held = 0  # requests waiting at the `hold` gate (fault injection)
        self.models = models
        self.metrics = metrics
        self.cache = PrefixCache(config.block_size, config.num_gpu_blocks)
        self.stats = Stats()
        self.running: set[Request] = set()
        self.waiting: deque[Request] = deque()
        self._running_adapters: Counter[str] = Counter()
        self._seeds: dict[str | None, int] = {}
        metrics.watch(self)

    async def execute(self, req: Request, emit: Emit | None = None) -> None:
        """Run `req` to completion, awaiting `emit(step)` after each decoding step."""
        config, metrics = self.config, self.metrics
        arrival = time.perf_counter()
        if self._fits(req) and not self.waiting:
            self._start(req)
        else:
            req.admitted = asyncio.get_running_loop().create_future()
            self.waiting.append(req)
        ok = False
        try:
            if req.admitted is not None:
                await req.admitted
            if self.faults.hold:
                await self._hold(req.adapter or config.model_id)
            delay = config.delay(self._prefill(req))
            if delay:
                await asyncio.sleep(delay)
            for hashes in req.hashes:
                self.cache.insert(hashes)
            itl = config.delay(config.itl_ms)
            last = time.perf_counter()
            metrics.ttft.observe(last - arrival)
            for step in range(req.steps):
                if step:
                    if itl:
                        await asyncio.sleep(itl)
                    now = time.perf_counter()
                    metrics.itl.observe(now - last)
                    last = now
                if self.faults.steps >= 0:
                    await self.faults.take_step()
                req.steps_done = step + 1
                if emit is not None:
                    await emit(step)
            ok = True
        finally:
            self._finish(req, ok)
            metrics.e2e.observe(time.perf_counter() - arrival)

    async def _hold(self, name: str) -> None:
        self.held += 1
        try:
            await self.faults.wait_unheld(name)
        finally:
            self.held -= 1

    # --- scheduling -------------------------------------------------------------------------

    def _fits(self, req: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        adapter = req.adapter
        return (adapter is None or adapter in self._running_adapters
                or len(self._running_adapters) < self.config.max_loras)

    def _start(self, req: Request) -> None:
        req.state = RUNNING
        self.running.add(req)
        if req.adapter is not None:
            self._running_adapters[req.adapter] += 1

    def _schedule(self) -> None:
        """Admit waiting requests in FIFO order, skipping those whose adapter does not fit."""
        waiting = self.waiting
        skipped: deque[Request] = deque()
        while waiting and len(self.running) < self.config.max_num_seqs:
            req = waiting.popleft()
            if req.admitted is not None and req.admitted.done():  # cancelled while queued
                req.state = DONE
            elif self._fits(req):
                self._start(req)
                req.admitted.set_result(None)
            else:
                skipped.append(req)
        if skipped:
            skipped.extend(waiting)
            self.waiting = skipped

    def _finish(self, req: Request, ok: bool) -> None:
        if req.state == RUNNING:
            self.running.discard(req)
            if req.adapter is not None:
                counts = self._running_adapters
                counts[req.adapter] -= 1
                if counts[req.adapter] <= 0:
                    del counts[req.adapter]
        elif req.state == WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.state = DONE
        metrics = self.metrics
        if ok:
            self.stats.completed += 1
            for reason in req.finish:
                metrics.success["length" if reason == "length" else "stop"].inc()
            generated = req.completion_tokens
            if req.tool is None:
                self._cache_outputs(req)
        else:
            self.stats.aborted += 1
            metrics.success["abort"].inc()
            generated = sum(min(len(o), req.steps_done) for o in req.outputs)
        if generated:
            metrics.generation_tokens.inc(generated)
        self._schedule()

    # --- prefix cache -----------------------------------------------------------------------

    def _seed(self, adapter: str | None) -> int:
        seed = self._seeds.get(adapter)
        if seed is None:
            seed = self._seeds[adapter] = PrefixCache.seed(adapter or self.config.model_id)
        return seed

    def _prefill(self, req: Request) -> float:
        """Look the prompts up in the prefix cache; the simulated prefill time in ms."""
        cache, seed = self.cache, self._seed(req.adapter)
        req.hashes = [cache.chain(p, seed) for p in req.prompts]
        cached = sum(cache.lookup(h, len(p)) for h, p in zip(req.hashes, req.prompts))
        total = req.prompt_tokens
        req.cached_tokens = cached
        self.stats.prefix_queries += total
        self.stats.prefix_hits += cached
        m = self.metrics
        m.prompt_tokens.inc(total)
        m.prefix_queries.inc(total)
        if cached:
            m.prefix_hits.inc(cached)
        ms = (total - cached) * self.config.prefill_ms_per_token
        adapter = req.adapter
        if adapter is not None and adapter in self.models.adapters and self.models.make_resident(adapter):
            self.models.reloads += 1
            ms += self.config.lora_load_ms
        return ms

    def _cache_outputs(self, req: Request) -> None:
        """Cache the full blocks of prompt + output, as vLLM does for finished sequences."""
        cache, bs = self.cache, self.config.block_size
        for i, pieces in enumerate(req.outputs):
            prompt, hashes = req.prompts[i // req.n], req.hashes[i // req.n]
            if not pieces or (len(prompt) + len(pieces)) // bs <= len(hashes):
                continue
            start = len(hashes) * bs
            tail = prompt[start:] + [token_id(p) for p in pieces]
            cache.insert(cache.chain(tail, hashes[-1] if hashes else self._seed(req.adapter)))

    # --- observation ------------------------------------------------------------------------

    def kv_usage(self) -> float:
        bs = self.config.block_size
        used = sum(-(-(r.prompt_tokens + r.steps_done * len(r.outputs)) // bs) for r in self.running)
        return min(used / self.config.num_gpu_blocks, 1.0)

    def adapters_in_use(self) -> tuple[list[str], list[str]]:
        running = sorted(self._running_adapters)
        waiting = sorted({r.adapter for r in self.waiting if r.adapter is not None})
        return running, waiting

    def reset(self) -> None:
        self.cache.clear()
        self.stats = Stats()
