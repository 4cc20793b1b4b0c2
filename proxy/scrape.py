"""Backend state from each replica's own /metrics, read on the discovery interval.

vLLM exposes its scheduler and cache state in Prometheus text; we read three things and publish
them per backend (labels: the backend's configured name only):

- `vllm_proxy_backend_requests_waiting`  <- vllm:num_requests_waiting (summed over engines)
- `vllm_proxy_backend_kv_cache_usage`    <- vllm:kv_cache_usage_perc, legacy vllm:gpu_cache_usage_perc
                                            (mean over engines; 0..1)
- `Backend.cache_tokens` (for prefix_affinity's packing) <- vllm:cache_config_info labels
  num_gpu_blocks x block_size (summed over engines)
- `Backend.itl_s` (for prefix_affinity's balance by speed, proxy/routing/speed.py) <- delta
  vllm:inter_token_latency_seconds_sum / delta _count over at least _MIN_SPAN_S and _MIN_TOKENS
  (legacy: vllm:time_per_output_token_seconds): the replica's own decode step time, whoever sent
  its load
- `vllm_proxy_backend_load_factor` <- how many times slower it decodes than the fastest (speed.py)
- `vllm_proxy_backend_prefix_cache_hit_ratio` <- delta vllm:prefix_cache_hits / delta
  vllm:prefix_cache_queries between two scrapes (legacy: vllm:gpu_prefix_cache_hits/queries,
  or the V0 gauge vllm:gpu_prefix_cache_hit_rate). The first scrape, or one after a counter reset,
  uses the cumulative ratio; a scrape with no new queries keeps the previous ratio.

The exposition is scanned line by line for these names only (no full parse: a vLLM /metrics is
hundreds of lines of histograms, and this runs on the serving event loop). A backend that cannot
be scraped loses its series until it can be again (its health is `vllm_proxy_backend_up`).
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from proxy.config import DiscoveryConfig
from proxy.control import fetch
from proxy.metrics import Metrics
from proxy.routing import speed
from proxy.routing.backends import Backend
from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.scrape")

WAITING = {b"vllm:num_requests_waiting"}
KV_USAGE = {b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc"}
QUERIES = {b"vllm:prefix_cache_queries_total", b"vllm:prefix_cache_queries",
           b"vllm:gpu_prefix_cache_queries_total", b"vllm:gpu_prefix_cache_queries"}
HITS = {b"vllm:prefix_cache_hits_total", b"vllm:prefix_cache_hits",
        b"vllm:gpu_prefix_cache_hits_total", b"vllm:gpu_prefix_cache_hits"}
HIT_RATE = {b"vllm:gpu_prefix_cache_hit_rate"}  # V0 gauge, already a ratio
ITL_SUM = {b"vllm:inter_token_latency_seconds_sum", b"vllm:time_per_output_token_seconds_sum"}
ITL_COUNT = {b"vllm:inter_token_latency_seconds_count", b"vllm:time_per_output_token_seconds_count"}
CACHE_CONFIG = b"vllm:cache_config_info"
_LABEL = re.compile(rb'(\w+)="([^"]*)"')
WANTED = WAITING | KV_USAGE | QUERIES | HITS | HIT_RATE | ITL_SUM | ITL_COUNT
_MIN_TOKENS = 64  # tokens between two scrapes for a decode-time reading (fewer: keep the last)
# ... and seconds: a reading over a shorter span measures the machine's moment, not the replica.
# Five identical simulated replicas on a loaded 2-core machine (loadtest.affinity_drift, 3 proxies
# at 10x the rate, scraped every 0.2 s): the slowest read >= 1.5x the fastest in 14 % of 0.2 s
# spans, 1 % of 1 s spans, none of 2 s or longer; the 0.2 s readings made them "slower" by turns
# (21-41 changes of load factor a run), placement avoided those and the balance guard capped them
# by speed: 0.963 of the pooled bound in the join phase against 0.971-0.983 without
_MIN_SPAN_S = 2.0


@dataclass
class Reading:
    """One scrape of one backend; None where the backend did not expose the metric."""

    waiting: float | None = None
    kv_usage: float | None = None
    queries: float | None = None
    hits: float | None = None
    hit_rate: float | None = None
    cache_tokens: int | None = None
    itl_sum: float | None = None
    itl_count: float | None = None


def parse_vllm_metrics(text: bytes) -> Reading:
    """The values we publish, from a vLLM Prometheus text exposition."""
    sums: dict[bytes, float] = {}
    counts: dict[bytes, int] = {}
    cache_tokens = None
    for line in text.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue
        if line.startswith(CACHE_CONFIG):
            labels = dict(_LABEL.findall(line))
            try:
                cache_tokens = (cache_tokens or 0) + int(labels[b"num_gpu_blocks"]) * int(labels[b"block_size"])
            except (KeyError, ValueError):
                pass
            continue
        brace = line.find(b"{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rfind(b"}") + 1:]
        else:
            name, _, rest = line.partition(b" ")
        if name not in WANTED:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1

    def total(names: set[bytes]) -> float | None:
        found = [sums[n] for n in names if n in sums]
        return sum(found) if found else None

    def mean(names: set[bytes]) -> float | None:
        n = sum(counts.get(k, 0) for k in names)
        return sum(sums.get(k, 0.0) for k in names) / n if n else None

    return Reading(total(WAITING), mean(KV_USAGE), total(QUERIES), total(HITS), mean(HIT_RATE), cache_tokens,
                   total(ITL_SUM), total(ITL_COUNT))


class _Previous:
    __slots__ = ("queries", "hits", "ratio", "itl_sum", "itl_count", "itl", "itl_at")

    def __init__(self) -> None:
        self.queries: float | None = None
        self.hits: float | None = None
        self.ratio: float | None = None
        self.itl_sum: float | None = None
        self.itl_count: float | None = None
        self.itl: float | None = None
        self.itl_at = 0.0  # monotonic time of the scrape the current decode-time span starts at


def hit_ratio(prev: _Previous, reading: Reading) -> float | None:
    """Hit ratio since the previous scrape (updates `prev`)."""
    if reading.queries is None or reading.hits is None:
        return reading.hit_rate
    q, h = reading.queries, reading.hits
    if prev.queries is None or q < prev.queries or h < prev.hits:  # first scrape, or the backend restarted
        ratio = h / q if q > 0 else None
    else:
        dq = q - prev.queries
        ratio = (h - prev.hits) / dq if dq > 0 else prev.ratio
    prev.queries, prev.hits, prev.ratio = q, h, ratio
    return ratio


def decode_time(prev: _Previous, reading: Reading, now: float) -> float | None:
    """Mean inter-token latency (s) since the scrape the current span started at (updates `prev`;
    `now`: monotonic seconds): the last reading while the span is shorter than _MIN_SPAN_S or fewer
    than _MIN_TOKENS were generated, None before the first span or after a restart."""
    s, c = reading.itl_sum, reading.itl_count
    if s is None or c is None:
        prev.itl_sum = prev.itl_count = prev.itl = None
        return None
    if prev.itl_count is None or c < prev.itl_count or s < prev.itl_sum:
        prev.itl = None  # first scrape, or the backend restarted: no interval yet
    elif c - prev.itl_count >= _MIN_TOKENS and now - prev.itl_at >= _MIN_SPAN_S:
        itl = (s - prev.itl_sum) / (c - prev.itl_count)
        prev.itl = itl if 0.0 < itl < math.inf else None  # (a replica reporting infinities tells nothing)
    else:
        return prev.itl  # too short a span to tell: keep the last reading and its start
    prev.itl_sum, prev.itl_count, prev.itl_at = s, c, now
    return prev.itl


class BackendScraper:
    """Polls every backend's /metrics every `interval_s` and sets the backend-state gauges."""

    def __init__(
        self, session: Callable[[], httpx.AsyncClient], backends: list[Backend], config: DiscoveryConfig,
        metrics: Metrics,
    ) -> None:
        self._session = session
        self.backends = backends
        self.config = config
        self.metrics = metrics
        self._previous: dict[str, _Previous] = {}
        self.speeds = speed.Speeds()

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(b) for b in self.backends))
        self.speeds.update(self.backends)
        for backend in self.backends:
            if backend.name in self._previous:  # (scraped: a backend that cannot be has no series)
                self.metrics.backend_load_factor.labels(backend.name).set(backend.load_factor)

    async def scrape(self, backend: Backend) -> None:
        try:
            reading = parse_vllm_metrics(await fetch(backend, self._session(), "/metrics", self.config.timeout_s))
        except Exception as exc:  # a backend without /metrics, or down: its series go away
            log.debug("cannot scrape %s/metrics: %s", backend.url, exc or type(exc).__name__)
            self._forget(backend.name)
            backend.waiting = backend.kv_usage = backend.itl_s = None
            return
        m, name = self.metrics, backend.name
        backend.waiting, backend.kv_usage = reading.waiting, reading.kv_usage  # (routing: proxy/routing/scorers.py)
        if reading.cache_tokens:
            backend.cache_tokens = reading.cache_tokens
        prev = self._previous.setdefault(name, _Previous())
        ratio = hit_ratio(prev, reading)
        backend.itl_s = decode_time(prev, reading, time.monotonic())
        for family, value in ((m.backend_waiting, reading.waiting), (m.backend_kv_usage, reading.kv_usage),
                              (m.backend_hit_ratio, ratio)):
            if value is not None:
                family.labels(name).set(value)

    def _forget(self, name: str) -> None:
        self._previous.pop(name, None)
        if self.metrics.multiprocess:
            return  # series live in the shared files; the last value stays (see backend_up)
        m = self.metrics
        for family in (m.backend_waiting, m.backend_kv_usage, m.backend_hit_ratio, m.backend_load_factor):
            try:
                family.remove(name)
            except KeyError:
                pass

    def start(self, tasks: Supervisor) -> None:
        tasks.every(self.config.interval_s, self.scrape_all, "backend scrape round", log)
