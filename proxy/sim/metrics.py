"""The replica's /metrics: vLLM's current (V1) metric names and labels (`model_name`, `engine`),
in a registry of its own.

State gauges (running/waiting, KV usage, LoRA info) are produced by a collector at scrape
time, so they always show the engine as it is, never a stale copy.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from proxy.sim.engine import Engine

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
ENGINE = "0"  # vLLM labels metrics with the engine-core index


class SimMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, names, values = self.registry, ["model_name", "engine"], [model_name, ENGINE]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*values)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             E2E_BUCKETS)

    def watch(self, engine: "Engine") -> None:
        self.registry.register(_EngineCollector(engine))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def collect(self):
        engine, config = self.engine, self.engine.config
        name = config.model_id

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name", "engine"])
            family.add_metric([name, ENGINE], value)
            return family

        def info(metric: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
            """vLLM's info gauges carry only their own labels."""
            family = GaugeMetricFamily(metric, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    len(engine.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    len(engine.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage())
        running, waiting = engine.adapters_in_use()
        yield info("vllm:lora_requests_info", "Running stats on lora requests.", time.time(),
                   max_lora=str(config.max_loras), running_lora_adapters=",".join(running),
                   waiting_lora_adapters=",".join(waiting))
        yield info("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0,
                   block_size=str(config.block_size), num_gpu_blocks=str(config.num_gpu_blocks),
                   enable_prefix_caching="True", cache_dtype="auto", gpu_memory_utilization="0.9")
