"""Live reload of the policy YAML: on file change (polled), on SIGHUP, or on request.

A new config is validated first and swapped in whole; an invalid one changes nothing but a
logged error (with key paths) and the `vllm_proxy_config_reloads_total{result="error"}` count.
Settings read only at startup (RESTART_KEYS: the listening socket, worker count, …) are named in
a warning when they change: the rest of the new config applies, they wait for a restart. A policy
file that disappears is logged once (the running config stays). Under `serve --workers N` every
worker reloads, and worker 0 alone logs and counts it (proxy/logsetup.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Awaitable, Callable

from proxy.checks import startup_problems
from proxy.config import ConfigError, ProxyConfig, load_config
from proxy.logsetup import is_leader
from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.reload")

# Read once at startup (by the server, the worker supervisor, the shared upstream client, the
# metrics registry or the access-log handler): a reload cannot change them.
RESTART_KEYS = (
    "server.host", "server.port", "server.workers", "server.keep_alive_s", "server.drain_timeout_s",
    "server.upstream_keep_alive_s", "metrics.enabled", "logging.file",
)


def _value(config: ProxyConfig, dotted: str) -> object:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def restart_required(old: ProxyConfig, new: ProxyConfig) -> list[str]:
    """The RESTART_KEYS whose value differs between `old` and `new`, as `key: old -> new`."""
    return [f"{k}: {_value(old, k)!r} -> {_value(new, k)!r}" for k in RESTART_KEYS if _value(old, k) != _value(new, k)]


class ConfigWatcher:
    def __init__(
        self,
        path: str | Path,
        apply: Callable[[ProxyConfig], Awaitable[None]],
        counted: Callable[[str], None],
        interval_s: float = 1.0,
        running: Callable[[], ProxyConfig] | None = None,
    ) -> None:
        self.path = Path(path)
        self.apply = apply
        self.counted = counted if is_leader() else (lambda result: None)
        self.running = running  # the config in use, to tell which changed keys need a restart
        self.interval = interval_s
        self._seen = self._stamp()
        self._missing = False
        self._tasks = Supervisor("config watch")  # a child of the process's, from start()
        self._lock = asyncio.Lock()
        self._sighup = False

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the symlink a Kubernetes ConfigMap volume swaps
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    async def reload(self, reason: str) -> tuple[bool, str]:
        async with self._lock:
            self._seen = self._stamp()
            try:
                config = load_config(self.path)
                startup_problems(config, str(self.path))
            except ConfigError as exc:
                log.error("config reload (%s) refused, keeping the running config:\n%s", reason, exc)
                self.counted("error")
                return False, str(exc)
            pending = restart_required(self.running(), config) if self.running is not None else []
            try:
                await self.apply(config)
            except Exception as exc:  # a config that validates but cannot start
                log.exception("config reload (%s) failed, keeping the running config", reason)
                self.counted("error")
                return False, f"{self.path}: {exc}"
            log.info("config reloaded from %s (%s)", self.path, reason)
            if pending:
                log.warning("config reloaded, but these keys take effect only after a restart (still running "
                            "on the old values): %s", "; ".join(pending))
            self.counted("success")
            return True, "reloaded"

    def start(self, tasks: Supervisor | None = None) -> None:
        if tasks is not None:
            self._tasks = tasks.child("config watch")
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: self._tasks.spawn(self.reload("SIGHUP"), "SIGHUP reload"))
            self._sighup = True
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (tests), or no SIGHUP
            pass
        self._tasks.spawn(self._watch(), "config file watch")

    async def stop(self) -> None:
        if self._sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await self._tasks.stop()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            stamp = self._stamp()
            if stamp is None:
                if not self._missing:
                    self._missing = True
                    log.error("config file %s is missing or unreadable; still running the last loaded config", self.path)
            elif stamp != self._seen:
                self._missing = False
                await self.reload("file changed")
