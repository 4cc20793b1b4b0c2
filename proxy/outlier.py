"""Passive health: replicas that keep failing are ejected for a growing backoff, then probed.

Signals are what the data path sees (connect errors, first-byte timeouts, 5xx). A replica comes
back half-open: one more failure ejects it again for twice as long; a success clears its record.
A deployment's last available replica is never ejected, so passive signals alone cannot turn
a slow fleet into an empty one.
"""
from __future__ import annotations

import logging
from typing import Callable, Final, Iterable

from proxy.config import OutlierConfig
from proxy.routing.backends import Backend
from proxy.routing.clock import SYSTEM, Clock
from proxy.routing.filters import Available
from proxy.routing.plugins import Env, NoParams

log: Final = logging.getLogger("vllm_proxy.outlier")


class Outliers:
    def __init__(self, config: OutlierConfig, peers: Callable[[Backend], Iterable[tuple[Backend, ...]]],
                 clock: Clock = SYSTEM) -> None:
        self.config = config
        self.clock = clock
        # healthy and not ejected (the routing filter: one definition of "in rotation")
        self.available = Available(NoParams(), Env(None, clock))
        self.peers = peers  # the replica sets (one per deployment) that `backend` belongs to

    def success(self, backend: Backend) -> None:
        if backend.errors_in_row:
            backend.errors_in_row = 0
            backend.ejections = 0

    def failure(self, backend: Backend) -> None:
        backend.errors_in_row += 1
        if backend.errors_in_row < self.config.consecutive_failures:
            return
        now = self.clock.monotonic()
        if backend.ejected_until > now:
            return
        for group in self.peers(backend):
            if not any(b is not backend for b in self.available.apply(group)):
                return  # the last replica of some deployment: keep it
        seconds = min(self.config.base_ejection_s * 2 ** backend.ejections, self.config.max_ejection_s)
        backend.ejections += 1
        backend.ejected_until = now + seconds
        backend.errors_in_row = self.config.consecutive_failures - 1  # half-open when it returns
        log.warning("backend %s ejected for %.0f s after repeated failures", backend.name, seconds)
