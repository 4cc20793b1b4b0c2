"""Hung replicas: noticed within seconds, without a short first-byte timeout.

A GPU replica can hang with its port still open (a driver or NCCL hang, a SIGSTOPped engine):
connections are accepted, nothing answers. A first-byte timeout short enough to notice that
would also cut legitimate long prefills, so the signal is silence instead: a replica with
requests in flight that delivered nothing to any of them (no response head, no stream chunk)
for `suspect_after_s` is probed on its health endpoint with a short timeout. A busy replica
answers the probe (vLLM's API server stays responsive during a long prefill) and keeps its
requests; one that does not answer is marked down until discovery sees it answer again
(proxy/health.py), and every exchange on it is cut (`Progress.cut`): those that sent nothing to
the client fail over to another replica within the retry budget, streams end with an SSE error
event. The same probe tells a poison request apart from a hung replica (`answers`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import httpx

from proxy.config import HungReplicaConfig
from proxy.control import fetch
from proxy.forward import Track, UpstreamFailure
from proxy.routing.backends import Backend
from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.watchdog")


class Watchdog:
    def __init__(
        self,
        config: HungReplicaConfig,
        tracks: dict[Backend, Track],
        session: Callable[[], httpx.AsyncClient],
        on_down: Callable[[Backend], None],
    ) -> None:
        self.config = config
        self.tracks = tracks
        self._session = session
        self.on_down = on_down
        self._probes: dict[Backend, asyncio.Task] = {}
        self._tasks = Supervisor("watchdog")  # the Runtime's, from start()

    def start(self, tasks: Supervisor) -> None:
        self._tasks = tasks
        if self.config.enabled:
            tick = min(0.25, self.config.suspect_after_s / 4)
            tasks.every(tick, self.check, "hung-replica check", log, wait_first=True)

    async def check(self) -> None:
        """One tick: probe each replica whose in-flight requests all went silent."""
        now = time.monotonic()
        suspect = self.config.suspect_after_s
        for backend, track in self.tracks.items():
            if not track.active:
                track.quiet_since = 0.0
            elif track.beats != track.seen or not track.quiet_since:
                track.seen = track.beats
                track.quiet_since = now
            elif now - track.quiet_since < suspect:
                continue
            elif not backend.healthy:  # discovery found it down, and its requests went silent: cut them
                self.mark_down(backend, "its health checks fail")
            elif backend not in self._probes:
                self._probe(backend)

    async def answers(self, backend: Backend) -> bool:
        """Whether `backend` is in rotation and answers a probe now (one probe per replica at a
        time, shared by whoever asks; a probe that fails marks it down)."""
        if not backend.healthy:
            return False
        return await asyncio.shield(self._probes.get(backend) or self._probe(backend))

    def _probe(self, backend: Backend) -> asyncio.Task:
        task = self._probes[backend] = self._tasks.spawn(self._run_probe(backend), f"probe of {backend.name}")
        return task

    async def _run_probe(self, backend: Backend) -> bool:
        config = self.config
        try:
            await fetch(backend, self._session(), config.probe_path, config.probe_timeout_s)
            ok = True
        except Exception as exc:  # any failure means "no answer now"
            ok = False
            why = f"no answer to GET {config.probe_path} within {config.probe_timeout_s:g} s"
            if not isinstance(exc, asyncio.TimeoutError):
                why = f"GET {config.probe_path} failed: {exc or type(exc).__name__}"
        finally:
            self._probes.pop(backend, None)
        track = self.tracks.get(backend)
        if ok:
            if track is not None:
                track.quiet_since = time.monotonic()  # alive: suspect it again only after another silence
        else:
            self.mark_down(backend, why)
        return ok

    def mark_down(self, backend: Backend, why: str) -> None:
        """Take `backend` out of rotation (discovery brings it back) and cut its exchanges."""
        if backend.healthy:
            backend.healthy = False
            log.warning("backend %s is down: it stopped answering (%s)", backend.name, why)
            self.on_down(backend)
        track = self.tracks.get(backend)
        if track is not None:
            for progress in list(track.active):
                progress.cut(f"The model server {backend.name} stopped answering ({why}).")


def poisoned(failure: UpstreamFailure, backend: Backend) -> UpstreamFailure:
    """The timeout of a request on a replica that answers otherwise: the request is the likely
    cause (say, an enormous `n` or prompt), so it must not wedge another replica as well."""
    poison = UpstreamFailure(
        "timeout", 504,
        f"The request timed out on model server {backend.name}, which is otherwise healthy: the request "
        "itself is the likely cause, so it was not retried on another replica.",
    )
    poison.retryable = False
    return poison
