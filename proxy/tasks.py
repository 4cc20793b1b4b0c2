"""One supervisor for background work (discovery, scraping, probes, Redis sync, LoRA loads,
config watch): a bare `create_task` can be garbage-collected mid-run, dies silently and
outlives what started it. Every background task is spawned here instead: held until it ends,
its failure logged, cancelled and awaited on `stop()`.

A Runtime's supervisor is a child of the process's (`child()`): a reload stops the old config's
tasks, the process-wide ones (metrics flush, response records, config watch) go on, and the
process's final `stop()` also ends any child nobody stopped (a reload whose start failed).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Coroutine

log = logging.getLogger("vllm_proxy.tasks")


class Supervisor:
    __slots__ = ("name", "_tasks", "_children", "_parent")

    def __init__(self, name: str = "tasks", parent: "Supervisor | None" = None) -> None:
        self.name = name
        self._tasks: dict[asyncio.Task, tuple] = {}  # task -> (what, expected exception types)
        self._children: set[Supervisor] = set()
        self._parent = parent
        if parent is not None:
            parent._children.add(self)

    def child(self, name: str) -> "Supervisor":
        return Supervisor(f"{self.name}/{name}", self)

    def move_to(self, parent: "Supervisor") -> None:
        """Go on running under `parent` (a reload hands work that outlives its config over to the
        next one without stopping it)."""
        if self._parent is not None:
            self._parent._children.discard(self)
        self._parent = parent
        parent._children.add(self)

    def spawn(self, coro: Coroutine, what: str, expected: tuple[type[BaseException], ...] = ()) -> asyncio.Task:
        """Run `coro` in the background. A failure is logged unless it is one of `expected` (an
        outcome whoever awaits the task handles)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks[task] = (what, expected)
        task.add_done_callback(self._ended)
        return task

    def every(
        self, interval_s: float, step: Callable[[], Awaitable[None]], what: str,
        logger: logging.Logger | None = None, wait_first: bool = False,
    ) -> asyncio.Task:
        """Run `step` every `interval_s`; a failing step is logged, and the loop goes on."""
        return self.spawn(_every(interval_s, step, what, logger or log, wait_first), what)

    def _ended(self, task: asyncio.Task) -> None:
        what, expected = self._tasks.pop(task, ("?", ()))
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, expected):
            log.error("background task %s (%s) failed", what, self.name, exc_info=exc)

    def running(self) -> list[str]:
        """What runs now, children included (for tests and debugging)."""
        return [what for what, _ in self._tasks.values()] + [w for c in self._children for w in c.running()]

    async def stop(self) -> None:
        """Cancel every task (and every child's) and wait until they ended."""
        for child in list(self._children):
            await child.stop()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._parent is not None:
            self._parent._children.discard(self)


async def _every(
    interval_s: float, step: Callable[[], Awaitable[None]], what: str, logger: logging.Logger, wait_first: bool
) -> None:
    if wait_first:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await step()
        except Exception:  # never let the loop die
            logger.exception("%s failed", what)
        await asyncio.sleep(interval_s)
