"""Everything a running proxy holds for one config: backends, catalog, policy, client, metrics."""
from __future__ import annotations

import asyncio
import logging

from proxy import native
from proxy.auth import Authenticator
from proxy.config import ProxyConfig
from proxy.discovery.fleet import Fleet
from proxy.discovery.sources import make_source
from proxy.forward import Upstream
from proxy.health import Discovery
from proxy.lora import LoraManager
from proxy.accesslog import AccessLog
from proxy.metrics import Metrics
from proxy.admission import Admission
from proxy.multimodal import MultimodalGate
from proxy.response_owners import ResponseOwners
from proxy.tracing import Tracing
from proxy.outlier import Outliers
from proxy.retry import RetryBudget
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route, build_catalog
from proxy.routing.clock import SYSTEM, Clock
from proxy.routing.plugins import Env
from proxy.routing.profiles import build as build_profile
from proxy.routing.scheduler import Scheduler
from proxy.scrape import BackendScraper
from proxy.shared import SharedState
from proxy.tasks import Supervisor
from proxy.watchdog import Watchdog

log = logging.getLogger("vllm_proxy.runtime")


class Runtime:
    """Built from one config. A hot reload builds the next Runtime from the previous one: it takes
    over the process-wide parts (metrics, upstream client) and every replica whose settings did
    not change (with its health, discovered models and in-flight counts)."""

    def __init__(self, config: ProxyConfig, previous: "Runtime | None" = None, clock: Clock = SYSTEM) -> None:
        self.config = config
        self.clock = clock
        # background tasks (proxy/tasks.py): the process's, and this config's (stopped with it)
        self.supervisor = previous.supervisor if previous else Supervisor("process")
        self.tasks = self.supervisor.child("runtime")
        self.metrics = previous.metrics if previous else Metrics(enabled=config.metrics.enabled)
        # observability (proxy/metrics.py, proxy/accesslog.py, proxy/scrape.py)
        self.access = AccessLog(config.logging) if config.logging.access_log else None
        self.metrics.time_streams_for_access_log(self.access is not None)
        kept = {b.config.model_dump_json(): b for b in previous.backends} if previous else {}
        self.backends = [kept.get(b.model_dump_json()) or Backend(b) for b in config.backends]
        # the routing profile's learned state (placements, rates, rotations, the Redis mirror)
        # outlives a reload that leaves `routing` and `redis` as they were
        keep = previous is not None and (previous.config.routing, previous.config.redis) == (config.routing, config.redis)
        self.routing_kept = keep
        self.shared: SharedState | None = previous.shared if keep else None
        self.owns_shared = not keep  # its loops run under the owner's tasks (hand_over moves them)
        if config.redis is not None and not keep:
            self.shared = SharedState(
                config.redis.url,
                ttl_s=config.routing.prefix_affinity.shared_ttl_s,
                timeout_s=config.redis.timeout_s,
                sync_interval_s=config.redis.sync_interval_s,
                busy_sync_interval_s=config.redis.busy_sync_interval_s,
                max_connections=config.redis.max_connections,
                local_load=self._local_load,
                on_status=lambda up: self.metrics.redis_up.set(1 if up else 0),
            )
        # optional OpenTelemetry: wraps the policy and the upstream client (proxy/tracing.py)
        self.tracing = Tracing(config.tracing) if config.tracing.enabled else None
        self.profile = previous.profile if keep else build_profile(config.routing, Env(config.routing, clock, self.shared))
        self.policy = self.profile.policy
        if self.tracing is not None:
            self.policy = self.tracing.policy(self.policy)
        self.catalog: dict[str, Route] = {}
        self.rebuild_catalog()
        # (Any: the tracing wrapper stands in for it when tracing is on)
        self.upstream: Any = getattr(previous.upstream, "inner", previous.upstream) if previous else Upstream(config.server)
        if self.tracing is not None:
            self.upstream = self.tracing.upstream(self.upstream)
        self.owner = previous is None  # opens the process-wide parts; the owner at the end closes them (hand_over)
        self.draining = previous.draining if previous else False  # SIGTERM received (proxy/drain.py)
        self.watchdog = Watchdog(  # hung replicas (proxy/watchdog.py)
            config.server.hung_replicas, self.upstream.tracks, lambda: self.upstream.session, self._health_changed
        )
        # Responses API: response id -> replica, kept across reloads (proxy/response_owners.py)
        self.response_owners = previous.response_owners if previous else ResponseOwners(
            config.responses.max_local_records, config.redis.url if config.redis else None,
            config.responses.owner_ttl_s, config.redis.timeout_s if config.redis else 0.05,
        )
        self.discovery = Discovery(
            lambda: self.upstream.session, self.backends, config.discovery, self.rebuild_catalog, self._health_changed
        )
        self.multimodal = MultimodalGate(
            config, lambda deployment, decision: self.metrics.child(self.metrics.multimodal, deployment, decision).inc()
        )
        # replicas from backends_from (proxy/discovery/): added to and removed from self.backends
        self.fleet = Fleet(
            self.backends, self.rebuild_catalog, self.discovery.poll, self._health_changed, self._retired,
            entry_window_s=config.discovery.interval_s, adopt=previous.fleet.known if previous else None,
            tasks=self.tasks,
        )
        self.sources = [make_source(s, self.fleet) for s in config.backends_from]
        self.scraper = None
        if config.metrics.scrape_backends:
            self.scraper = BackendScraper(lambda: self.upstream.session, self.backends, config.discovery, self.metrics)
        self.lora = LoraManager(
            config, self.backends, lambda: self.upstream.session, self.rebuild_catalog,
            self.metrics.lora_ops, getattr(self.profile.policy, "load", None), clock,
        )
        self.profile.env.lora = self.lora
        self.auth = Authenticator(config.auth) if config.auth.keys else None
        self.outliers = Outliers(config.server.outlier, self._groups_of, clock)
        self.retries = RetryBudget(config.server.retries)
        self.admission = Admission(config.server.max_queue, config.server.queue_timeout_s)
        self.scheduler = Scheduler(self.profile, self.admission, clock)
        self.scheduler.policy = self.policy  # (traced, if tracing is on)
        self.max_body_bytes = config.server.max_body_bytes
        self.explain = config.server.explain_headers

    def rebuild_catalog(self) -> None:
        """Swapped whole, so a request sees one consistent catalog."""
        self.catalog = build_catalog(self.config, self.backends)

    def _groups_of(self, backend: Backend) -> list[tuple[Backend, ...]]:
        """The replica sets of every deployment `backend` serves."""
        return [r.backends for r in self.catalog.values() if backend in r.backends]

    def _health_changed(self, backend: Backend) -> None:
        self.metrics.child(self.metrics.backend_up, backend.name).set(1 if backend.healthy else 0)

    def _retired(self, backend: Backend) -> None:
        """A discovered replica is gone for good: drop its per-backend series."""
        self.metrics.forget(self.metrics.backend_up, backend.name)

    def _local_load(self) -> dict[str, int]:
        return {b.name: b.in_flight for b in self.backends}

    def ready(self) -> bool:
        return any(b.healthy for b in self.backends)

    async def start(self) -> None:
        if self.owner:
            await self.upstream.open()
            self.metrics.start(self.supervisor)
            self.response_owners.start(self.supervisor)
        for backend in self.backends:
            self._health_changed(backend)
        tasks = self.tasks
        for source in self.sources:
            await source.start(tasks)
        await self.discovery.poll_all()
        self.discovery.start(tasks)
        self.watchdog.start(tasks)
        self.lora.start(tasks)
        if self.scraper is not None:
            self.scraper.start(tasks)
        if self.shared is not None and self.owns_shared:
            self.shared.start(tasks)
        policy = self.profile.policy  # (not the tracing wrapper)
        if hasattr(policy, "serve"):  # the policy's background work (prefix_affinity's packing repair)
            tasks.spawn(policy.serve(), "packing repair")
        log.info(
            "serving %d deployments over %d backends (%d healthy); routing decision and request path %s",
            len(self.catalog), len(self.backends), sum(b.healthy for b in self.backends), native.describe(),
        )

    async def stop(self) -> None:
        for source in self.sources:
            await source.stop()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)
        if self.shared is not None and self.owns_shared:
            await self.shared.stop()
        await self.tasks.stop()  # discovery, scraping, probes, LoRA operations
        if self.owner:
            await self.upstream.close()
            await self.metrics.stop()
            await self.response_owners.stop()
            await self.supervisor.stop()

    def hand_over(self, successor: "Runtime") -> None:
        """`successor` owns the process-wide parts now (it closes them when it stops: the last
        config's stop ends the process's tasks too); stopping this one leaves them open. A kept
        Redis mirror's loops move to `successor`'s tasks."""
        self.owner, successor.owner = False, True
        if successor.shared is not None and successor.shared is self.shared and self.owns_shared:
            self.owns_shared, successor.owns_shared = False, True
            successor.shared.move_to(successor.tasks, successor._local_load)
