"""Background loops (discovery, scraping, Redis sync, config watch): started once with the
server, cancelled and awaited on shutdown, so none outlives its Runtime."""
from __future__ import annotations

import asyncio
from typing import Coroutine


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
