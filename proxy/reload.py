"""Live reload of the policy YAML: on file change (polled), on SIGHUP, or on request.

A new config is validated first and swapped in whole; an invalid one changes nothing but a
logged error (with key paths) and the `vllm_proxy_config_reloads_total{result="error"}` count.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Awaitable, Callable

from proxy.config import ConfigError, ProxyConfig, load_config
from proxy.tasks import Background

log = logging.getLogger("vllm_proxy.reload")


class ConfigWatcher:
    def __init__(
        self,
        path: str | Path,
        apply: Callable[[ProxyConfig], Awaitable[None]],
        counted: Callable[[str], None],
        interval_s: float = 1.0,
    ) -> None:
        self.path = Path(path)
        self.apply = apply
        self.counted = counted
        self.interval = interval_s
        self._seen = self._stamp()
        self._loop = Background()
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
            except ConfigError as exc:
                log.error("config reload (%s) refused, keeping the running config:\n%s", reason, exc)
                self.counted("error")
                return False, str(exc)
            try:
                await self.apply(config)
            except Exception as exc:  # a config that validates but cannot start
                log.exception("config reload (%s) failed, keeping the running config", reason)
                self.counted("error")
                return False, f"{self.path}: {exc}"
            log.info("config reloaded from %s (%s)", self.path, reason)
            self.counted("success")
            return True, "reloaded"

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload("SIGHUP")))
            self._sighup = True
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (tests), or no SIGHUP
            pass
        self._loop.start(self._watch())

    async def stop(self) -> None:
        if self._sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await self._loop.stop()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            stamp = self._stamp()
            if stamp is not None and stamp != self._seen:
                await self.reload("file changed")
