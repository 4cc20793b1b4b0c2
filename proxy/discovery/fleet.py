"""The one place that changes the backend list at runtime.

Each source reports its complete current set (`Fleet.update`); the Fleet reconciles it with what
it routes to. A replica that turns ready joins the list unhealthy and takes traffic once its first
health probe succeeds (probed at once, then with a short backoff, so a new pod serves within
about a second). A replica that turns not ready, terminating or disappears leaves the list: the
catalog is rebuilt without it, so no new request picks it, while requests already on it hold the
Backend and finish. A replica whose address or settings changed is a new Backend (the old drains).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from pydantic import ValidationError

from proxy.config import BackendConfig, BackendSource
from proxy.routing.backends import Backend
from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.discovery")

PROBE_FIRST_S = 0.05  # first retry of a new replica's health probe; doubles up to PROBE_MAX_S
PROBE_MAX_S = 1.0


@dataclass(frozen=True)
class Found:
    """One replica a source sees: a key unique within the source (pod name, address), where it
    listens, whether it may take new requests, and per-replica overrides of `backend` settings."""

    key: str
    host: str
    port: int
    ready: bool
    overrides: dict = field(default_factory=dict, compare=False)


class Fleet:
    def __init__(
        self,
        backends: list[Backend],
        on_change: Callable[[], None],
        probe: Callable[[Backend], Awaitable[object]],
        on_health: Callable[[Backend], None],
        on_retired: Callable[[Backend], None],
        entry_window_s: float,
        adopt: dict[str, Backend] | None = None,
        tasks: Supervisor | None = None,
    ) -> None:
        self.backends = backends  # the Runtime's list, shared with every component: changed in place
        self.on_change = on_change
        self.probe = probe
        self.on_health = on_health
        self.on_retired = on_retired
        self.entry_window_s = entry_window_s
        self.known: dict[str, Backend] = {}  # every discovered replica by name, routed or parked
        # a reload's predecessor: its replicas are taken over (health, in-flight counts) when unchanged
        self._adopt = dict(adopt or {})
        self._probes: dict[str, asyncio.Task] = {}
        self._tasks = tasks or Supervisor("fleet")

    def update(self, source: BackendSource, found: list[Found]) -> None:
        """Reconcile the replicas of `source` with its complete current set `found`."""
        prefix = source.name + "/"
        wanted: dict[str, tuple[BackendConfig, bool]] = {}
        for f in found:
            try:
                config = self._config(source, f)
            except ValidationError as exc:  # e.g. a malformed annotation: skip this replica, keep the rest
                log.warning("source %s: replica %s skipped: %s", source.name, f.key, exc.errors()[0]["msg"])
                continue
            ready = f.ready or (config.name in wanted and wanted[config.name][1])
            wanted[config.name] = (config, ready)
        changed = False
        for name in [n for n in self.known if n.startswith(prefix) and n not in wanted]:
            changed |= self._retire(self.known.pop(name), "gone")
        for name, (config, ready) in wanted.items():
            backend = self.known.get(name)
            if backend is not None and backend.config != config:
                changed |= self._retire(self.known.pop(name), "changed")
                backend = None
            if backend is None:
                backend = self._adopted(config) or Backend(config)
                self.known[name] = backend
            routed = backend in self.backends
            if ready and not routed:
                self._enter(backend)
                changed = True
            elif not ready and routed:
                self._leave(backend, "not ready")
                changed = True
        if changed:
            self.on_change()

    @staticmethod
    def _config(source: BackendSource, f: Found) -> BackendConfig:
        host = f"[{f.host}]" if ":" in f.host else f.host
        settings = source.backend.model_dump(exclude_unset=True) | f.overrides
        return BackendConfig(name=f"{source.name}/{f.key}", url=f"{source.scheme}://{host}:{f.port}", **settings)

    def _adopted(self, config: BackendConfig) -> Backend | None:
        backend = self._adopt.pop(config.name, None)
        return backend if backend is not None and backend.config == config else None

    def _enter(self, backend: Backend) -> None:
        self.backends.append(backend)
        if backend.healthy:  # taken over from the previous config, still serving
            return
        log.info("replica %s (%s) is ready: probing", backend.name, backend.url)
        self._probes[backend.name] = self._tasks.spawn(self._first_probe(backend), f"first probe of {backend.name}")

    async def _first_probe(self, backend: Backend) -> None:
        """Probe until healthy (or until the regular health loop takes over): the replica then
        takes traffic. Stops when the replica left meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.entry_window_s
        pause = PROBE_FIRST_S
        try:
            while backend in self.backends:
                await self.probe(backend)
                if backend.healthy:
                    self.on_change()
                    return
                if loop.time() + pause > deadline:
                    return
                await asyncio.sleep(pause)
                pause = min(pause * 2, PROBE_MAX_S)
        finally:
            self._probes.pop(backend.name, None)

    def _leave(self, backend: Backend, why: str) -> None:
        """Out of routing; requests in flight on it finish. Re-entering needs a fresh probe."""
        self.backends.remove(backend)
        task = self._probes.pop(backend.name, None)
        if task is not None:
            task.cancel()
        log.info("replica %s %s: draining %d requests in flight", backend.name, why, backend.in_flight)
        if backend.healthy:
            backend.healthy = False
            self.on_health(backend)

    def _retire(self, backend: Backend, why: str) -> bool:
        routed = backend in self.backends
        if routed:
            self._leave(backend, why)
        self.on_retired(backend)
        return routed

    async def stop(self) -> None:
        tasks = list(self._probes.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
