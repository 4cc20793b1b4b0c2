"""Background loops (discovery, scraping, Redis sync, config watch): started once with the
server, cancelled and awaited on shutdown, so none outlives its Runtime."""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Coroutine


class Background:
    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None

    def start(self, loop: Coroutine) -> None:
        self._task = asyncio.get_running_loop().create_task(loop)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def every(
        self, interval_s: float, step: Callable[[], Awaitable[None]], what: str, log: logging.Logger,
        wait_first: bool = False,
    ) -> None:
        """Run `step` every `interval_s`; a failing step is logged, and the loop goes on."""
        self.start(_every(interval_s, step, what, log, wait_first))


async def _every(
    interval_s: float, step: Callable[[], Awaitable[None]], what: str, log: logging.Logger, wait_first: bool
) -> None:
    if wait_first:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await step()
        except Exception:  # never let the loop die
            log.exception("%s failed", what)
        await asyncio.sleep(interval_s)
