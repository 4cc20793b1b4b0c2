"""Prometheus metrics of the proxy. Label values come only from the config (or `unknown`/`none`).

One registry per app instance, so several proxies can live in one test process. Under
`vllm-proxy serve --workers N` (N > 1) the CLI sets PROMETHEUS_MULTIPROC_DIR before the workers
start: every worker then writes its values to mmap files there and /metrics (answered by any
worker) merges them with prometheus_client's MultiProcessCollector.

Hot-path cost: labelled children are cached (`child`, `series`) and deferred (plain-Python
arithmetic, flushed into prometheus_client before each exposition), and with
`metrics.enabled: false` the per-request families hand out no-op children.
"""
from __future__ import annotations

import asyncio
import bisect
import glob
import importlib.metadata
import os
import platform
import time
import shutil
import tempfile
from typing import Any, Callable, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from proxy.tasks import Supervisor

disable_created_metrics()  # the *_created series double the exposition for no operator value

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

# End-to-end: LLM requests run from milliseconds (embeddings) to minutes (long generations).
DURATION_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Time to first token: fine where interactive targets live (< 500 ms), coarse up to a minute.
TTFT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2,
                       3, 5, 10, 20, 30, 60)
# Gaps between SSE data events: decode steps are ~5-100 ms, so 2.5-5 ms resolution there.
ITL_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05,
                      0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
# Proxy overhead: tens of microseconds normally; milliseconds mean trouble (GC, a stalled loop).
OVERHEAD_BUCKETS: Final = (0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
                           0.01, 0.025, 0.05, 0.1, 0.25, 1)


def _version() -> str:
    try:
        return importlib.metadata.version("vllm-proxy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def multiprocess_mode() -> bool:
    """True in a worker of `serve --workers N`: values live in PROMETHEUS_MULTIPROC_DIR."""
    return bool(os.environ.get(MULTIPROC_ENV))


def prepare_multiprocess_dir() -> Callable[[], None]:
    """For `serve --workers N`: point PROMETHEUS_MULTIPROC_DIR at an empty directory before the
    workers start (they inherit the environment) and return the cleanup to run after they stop.
    A directory the operator set is reused, emptied of the previous run's files."""
    existing = os.environ.get(MULTIPROC_ENV)
    if existing:
        os.makedirs(existing, exist_ok=True)
        for stale in glob.glob(os.path.join(existing, "*.db")):
            os.remove(stale)
        return lambda: None
    path = tempfile.mkdtemp(prefix="vllm-proxy-metrics-")
    os.environ[MULTIPROC_ENV] = path
    return lambda: shutil.rmtree(path, ignore_errors=True)


class Sink:
    """What a per-request family's child is: deferred (below), or this base itself, which does
    nothing, while metrics are disabled. One typed base, so that compiled callers call these
    methods natively rather than by name."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def flush(self) -> None:
        pass


NOOP: Final = Sink()
bisect_left: Final = bisect.bisect_left  # (compiled: a static, not a dict lookup at each call)


# Per-request families are written through these deferred children: plain-Python arithmetic on
# the hot path (~0.1 us instead of ~0.3 us per counter increment and ~0.8 us per histogram
# observation with their per-call locks and bucket scans), pushed into the prometheus_client
# children by `Metrics.flush()`: before every exposition, and every second in a worker of
# `serve --workers N` (whose values other workers' /metrics read from the shared files).
# Everything runs on the event loop thread, so no locking is needed.

class DeferredCounter(Sink):
    __slots__ = ("child", "pending")

    def __init__(self, child) -> None:
        self.child = child
        self.pending = 0.0

    def inc(self, amount: float = 1) -> None:
        self.pending += amount

    def flush(self) -> None:
        if self.pending:
            self.child.inc(self.pending)
            self.pending = 0.0


class DeferredGauge(Sink):
    __slots__ = ("child", "value", "shown")

    def __init__(self, child) -> None:
        self.child = child
        self.value = 0.0
        self.shown: float | None = None

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value

    def flush(self) -> None:
        if self.value != self.shown:
            self.child.set(self.value)
            self.shown = self.value


class DeferredHistogram(Sink):
    """`counts[i]` counts observations in bucket i = bisect_left(bounds, x); the stream relay
    increments `counts` itself (see proxy/forward.py) and adds its total to `sum`."""

    __slots__ = ("child", "bounds", "counts", "sum")

    def __init__(self, child, bounds: list[float]) -> None:
        self.child = child
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def flush(self) -> None:
        counts = self.counts
        if not any(counts):
            return
        buckets = self.child._buckets  # prometheus_client internals (one value per bucket), stable since 0.4
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)
                counts[i] = 0  # in place: a relay in progress holds this list
        self.child._sum.inc(self.sum)
        self.sum = 0.0


class Series:
    """The children one (deployment, backend, endpoint) records into, looked up once and cached."""

    __slots__ = ("metrics", "labels", "statuses", "duration", "ttft", "itl", "overhead", "in_flight")

    def __init__(self, metrics: "Metrics", deployment: str, backend: str, endpoint: str) -> None:
        self.metrics = metrics
        self.labels = (deployment, backend, endpoint)
        self.statuses: dict[str, Sink] = {}
        self.duration = metrics.sink(metrics.duration, deployment, backend, endpoint)
        self.ttft = metrics.sink(metrics.ttft, deployment, backend)
        self.itl = metrics.sink(metrics.itl, deployment, backend)
        self.overhead = metrics.sink(metrics.overhead, endpoint)
        self.in_flight = metrics.sink(metrics.in_flight, backend)

    @property
    def stream_sink(self) -> Any:
        """Where a stream relay counts its inter-token gaps (None: do not time streams)."""
        return self.itl if self.metrics.enabled else self.metrics.discard

    def status(self, code: str) -> Sink:
        found = self.statuses.get(code)
        if found is None:
            m = self.metrics
            found = self.statuses[code] = m.sink(m.requests, *self.labels, code)
        return found


class Metrics:
    """One registry per app instance, so several proxies can live in one test process."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.multiprocess = multiprocess_mode()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "vllm_proxy_requests", "Requests answered, by outcome.",
            ["deployment", "backend", "endpoint", "status_code"], registry=r,
        )
        self.duration = Histogram(
            "vllm_proxy_request_duration_seconds", "Request duration to the last byte.",
            ["deployment", "backend", "endpoint"], buckets=DURATION_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "vllm_proxy_time_to_first_token_seconds",
            "Streaming only: time from request arrival to the first SSE data event relayed.",
            ["deployment", "backend"], buckets=TTFT_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "vllm_proxy_inter_token_latency_seconds",
            "Streaming only: gaps between consecutive SSE data events (one per upstream chunk).",
            ["deployment", "backend"], buckets=ITL_BUCKETS, registry=r,
        )
        self.overhead = Histogram(
            "vllm_proxy_overhead_seconds",
            "Time spent in the proxy per request, excluding waiting on the upstream.",
            ["endpoint"], buckets=OVERHEAD_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "vllm_proxy_in_flight_requests", "Requests being forwarded, per backend.", ["backend"], registry=r,
            multiprocess_mode="livesum",
        )
        self.backend_up = Gauge(
            "vllm_proxy_backend_up", "1 if the backend is healthy.", ["backend"], registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.decisions = Counter(
            "vllm_proxy_routing_decisions", "Routing decisions by policy and reason.", ["policy", "reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "vllm_proxy_upstream_errors", "Failed upstream exchanges.", ["backend", "kind"], registry=r
        )
        self.disconnects = Counter(
            "vllm_proxy_client_disconnects", "Clients that went away before the response ended.",
            ["deployment", "phase"], registry=r,
        )
        self.config_reloads = Counter(
            "vllm_proxy_config_reloads", "Config reloads by result.", ["result"], registry=r
        )
        self.redis_up = Gauge(
            "vllm_proxy_redis_up", "1 while the shared Redis state is reachable.", registry=r,
            multiprocess_mode="livemin",
        )
        self.multimodal = Counter(
            "vllm_proxy_multimodal_requests", "Multimodal requests by deployment and policy decision.",
            ["deployment", "decision"], registry=r,
        )
        self.retries = Counter(
            "vllm_proxy_retries", "Requests retried on another replica, by the first failure's kind.",
            ["deployment", "kind"], registry=r,
        )
        self.lora_ops = Counter(
            "vllm_proxy_lora_operations", "LoRA adapter loads and unloads made by the proxy.",
            ["adapter", "backend", "op", "reason", "outcome"], registry=r,
        )
        # Per client key (auth.keys[].name, or `none`) and token usage (proxy/auth.py, proxy/accesslog.py).
        self.key_requests = Counter(
            "vllm_proxy_key_requests", "Requests by client key name (`none`: no or a refused key) and status.",
            ["key", "status_code"], registry=r,
        )
        self.tokens = Counter(
            "vllm_proxy_tokens", "Tokens the replicas reported in `usage`, by deployment, client key and kind.",
            ["deployment", "key", "kind"], registry=r,
        )
        self.last_reload_success = Gauge(
            "vllm_proxy_config_last_reload_success", "1 if the last config reload succeeded, 0 if it was refused.",
            registry=r, multiprocess_mode="livemostrecent",
        )
        self.last_reload_time = Gauge(
            "vllm_proxy_config_last_reload_timestamp_seconds", "When the last config reload was attempted.",
            registry=r, multiprocess_mode="livemostrecent",
        )
        self.build_info = Gauge(
            "vllm_proxy_build_info", "Always 1; the labels name the running version.", ["version", "python"],
            registry=r, multiprocess_mode="max",
        )
        self.build_info.labels(_version(), platform.python_version()).set(1)
        # Scraped from each backend's /metrics (proxy/scrape.py), on the discovery interval.
        self.backend_hit_ratio = Gauge(
            "vllm_proxy_backend_prefix_cache_hit_ratio",
            "Backend prefix-cache hit ratio (token hits / queries) since the previous scrape.",
            ["backend"], registry=r, multiprocess_mode="livemostrecent",
        )
        self.backend_waiting = Gauge(
            "vllm_proxy_backend_requests_waiting", "Requests queued in the backend (vllm:num_requests_waiting).",
            ["backend"], registry=r, multiprocess_mode="livemostrecent",
        )
        self.backend_kv_usage = Gauge(
            "vllm_proxy_backend_kv_cache_usage", "Backend KV-cache usage, 0..1 (vllm:kv_cache_usage_perc).",
            ["backend"], registry=r, multiprocess_mode="livemostrecent",
        )
        self.backend_load_factor = Gauge(
            "vllm_proxy_backend_load_factor", "How many times slower the backend decodes than the fastest serving its models, "
            "as prefix_affinity's balance sees it (1 = alike; proxy/routing/speed.py).",
            ["backend"], registry=r, multiprocess_mode="livemostrecent",
        )
        # Families whose children are touched per request: no-ops when metrics are disabled.
        self._per_request = {
            id(f) for f in (self.requests, self.duration, self.ttft, self.itl, self.overhead, self.in_flight,
                            self.decisions, self.upstream_errors, self.disconnects, self.key_requests, self.tokens)
        }
        self._children: dict[tuple, object] = {}
        self._deferred: list = []
        self._series: dict[tuple[str, str, str], Series] = {}
        self._decisions: dict[tuple[str, str], Sink] = {}  # (policy, reason) -> its decisions child
        self._key_series: dict[tuple, tuple] = {}  # (key, status, deployment) -> count_key's children
        self._exposition_registry: CollectorRegistry | None = None
        self._flusher: asyncio.Task | None = None
        # the stream sink when metrics are off but the access log wants TTFT (never flushed)
        self._discard_sink = DeferredHistogram(NOOP, self.itl._upper_bounds)
        self.discard: DeferredHistogram | None = self._discard_sink

    def child(self, family, *labels: str):
        """Cached labelled child: `labels()` costs a lock and a dict build on every call."""
        key = (id(family), labels)
        found = self._children.get(key)
        if found is None:
            if id(family) not in self._per_request:
                found = family.labels(*labels)
            elif not self.enabled:
                found = NOOP
            else:
                child = family.labels(*labels)
                if isinstance(family, Histogram):
                    found = DeferredHistogram(child, family._upper_bounds)
                elif isinstance(family, Gauge):
                    found = DeferredGauge(child)
                else:
                    found = DeferredCounter(child)
                self._deferred.append(found)
            self._children[key] = found
        return found

    def decision(self, policy: str, reason: str) -> Sink:
        """The routing decisions' counter, found by a key of two strings (`child` builds and
        compares the family's labelled key: ~3k instructions a request)."""
        key = (policy, reason)
        found = self._decisions.get(key)
        if found is None:
            found = self._decisions[key] = self.sink(self.decisions, policy, reason)
        return found

    def sink(self, family, *labels: str) -> Sink:
        """`child` of a per-request family (`_per_request`), typed."""
        found = self.child(family, *labels)
        assert isinstance(found, Sink), family
        return found

    def forget(self, family, *labels: str) -> None:
        """Drop a labelled series of a state gauge (a discovered replica that left for good)."""
        self._children.pop((id(family), labels), None)
        try:
            family.remove(*labels)
        except KeyError:
            pass

    def count_key(self, key: str | None, status: str, deployment: str, tokens: tuple[int | None, int | None]) -> None:
        """One answered request of client `key` (None: no key or a refused one) and its token usage."""
        children = self._key_series.get((key, status, deployment))
        if children is None:
            name = key or "none"
            children = self._key_series[(key, status, deployment)] = (
                self.child(self.key_requests, name, status), self.child(self.tokens, deployment, name, "prompt"),
                self.child(self.tokens, deployment, name, "completion"),
            )
        requests, prompt_tokens, completion_tokens = children
        requests.inc()
        prompt, completion = tokens
        if prompt:
            prompt_tokens.inc(prompt)
        if completion:
            completion_tokens.inc(completion)

    def reload_result(self, result: str) -> None:
        """A config reload attempt ended: `success` or `error`."""
        self.config_reloads.labels(result).inc()
        self.last_reload_success.set(1 if result == "success" else 0)
        self.last_reload_time.set(time.time())

    def time_streams_for_access_log(self, wanted: bool) -> None:
        """With metrics off, streams are timed only for an access log (set on every (re)load)."""
        self.discard = self._discard_sink if wanted else None

    def flush(self) -> None:
        """Push what the request path recorded into the prometheus_client children."""
        for deferred in self._deferred:
            deferred.flush()

    def series(self, deployment: str, backend: str, endpoint: str) -> Series:
        key = (deployment, backend, endpoint)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = Series(self, deployment, backend, endpoint)
        return found

    def exposition(self) -> bytes:
        self.flush()
        if not self.multiprocess:
            return generate_latest(self.registry)
        if self._exposition_registry is None:
            from prometheus_client import multiprocess

            self._exposition_registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._exposition_registry)
        return generate_latest(self._exposition_registry)

    def start(self, tasks: Supervisor) -> None:
        """In a worker of `serve --workers N`: flush every second, for the other workers' /metrics."""
        if self.multiprocess and self.enabled:
            self._flusher = tasks.every(1.0, self._flush, "metrics flush", wait_first=True)

    async def _flush(self) -> None:
        self.flush()

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        self.flush()
        if self.multiprocess:  # this worker's live gauges (in-flight, backend state) leave the shared files
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid())
