"""Prometheus metrics of the proxy. Label values come only from the config (or `unknown`/`none`)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # the *_created series double the exposition for no operator value

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """One registry per app instance, so several proxies can live in one test process."""

    def __init__(self) -> None:
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
        self.in_flight = Gauge(
            "vllm_proxy_in_flight_requests", "Requests being forwarded, per backend.", ["backend"], registry=r
        )
        self.backend_up = Gauge("vllm_proxy_backend_up", "1 if the backend is healthy.", ["backend"], registry=r)
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
        self.redis_up = Gauge("vllm_proxy_redis_up", "1 while the shared Redis state is reachable.", registry=r)
        self._children: dict[tuple, object] = {}

    def child(self, family, *labels: str):
        """Cached labelled child: `labels()` costs a lock and a dict build on every call."""
        key = (id(family), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = family.labels(*labels)
        return found

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
