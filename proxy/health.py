"""Discovery and health: poll each replica's /v1/models for liveness and what it serves."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import httpx
import orjson

from proxy.config import DiscoveryConfig
from proxy.control import fetch
from proxy.routing.backends import Backend
from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.health")


# A replica listing more models and adapters than this is broken or hostile: every entry becomes a
# route the proxy serves and rebuilds on each change (400 000 of them stalled the event loop for
# seconds per poll). vLLM lists its base model and its loaded LoRA adapters.
MAX_MODELS = 4096
MAX_ID_CHARS = 1024


def read_models(payload: bytes) -> tuple[frozenset[str], dict[str, str | None]]:
    """Base models and adapters (entries with a `parent`) of a vLLM /v1/models answer."""
    data = orjson.loads(payload)
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError("no `data` list")
    if len(entries) > MAX_MODELS:
        raise ValueError(f"lists {len(entries)} models, more than {MAX_MODELS}")
    models: set[str] = set()
    adapters: dict[str, str | None] = {}
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and len(entry["id"]) <= MAX_ID_CHARS:
            parent = entry.get("parent")
            if isinstance(parent, str) and parent:
                adapters[entry["id"]] = parent
            else:
                models.add(entry["id"])
    return frozenset(models), adapters


class Discovery:
    """Keeps each Backend's `healthy`, `models` and `adapters` current; calls `on_change` when
    what the fleet serves changed (so the catalog is rebuilt)."""

    def __init__(
        self,
        session: Callable[[], httpx.AsyncClient],
        backends: list[Backend],
        config: DiscoveryConfig,
        on_change: Callable[[], None],
        on_health: Callable[[Backend], None] = lambda b: None,
    ) -> None:
        self._session = session
        self.backends = backends
        self.config = config
        self.on_change = on_change
        self.on_health = on_health

    async def poll_all(self) -> None:
        changed = any(await asyncio.gather(*(self.poll(b) for b in self.backends)))
        if changed:
            self.on_change()

    async def poll(self, backend: Backend) -> bool:
        """One probe; returns True if the backend's served set changed."""
        epoch = backend.adapter_epoch
        try:
            models, adapters = read_models(await fetch(backend, self._session(), "/v1/models", self.config.timeout_s))
        except Exception as exc:  # any failure of the probe means "not healthy now"
            backend.failures += 1
            if backend.healthy and backend.failures >= self.config.failures_to_down:
                log.warning("backend %s is down: %s", backend.name, exc or type(exc).__name__)
                backend.healthy = False
                self.on_health(backend)
            return False
        backend.failures = 0
        if not backend.healthy:
            log.info("backend %s is up", backend.name)
            backend.healthy = True
            self.on_health(backend)
        changed = False
        if backend.config.models is None and models != backend.models:
            backend.models, changed = models, True
        # an answer that raced the proxy's own load/unload on this replica is stale: skip it
        fresh = backend.adapter_ops == 0 and backend.adapter_epoch == epoch
        if backend.config.adapters is None and adapters != backend.adapters and fresh:
            backend.adapters, changed = adapters, True
        return changed

    def start(self, tasks: Supervisor) -> None:
        """Poll every interval; the first round ran already in `Runtime.start`."""
        tasks.every(self.config.interval_s, self.poll_all, "discovery round", log, wait_first=True)
