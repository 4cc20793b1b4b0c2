"""The background-task supervisor (proxy/tasks.py) and what the Runtime starts through it."""
from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.config import parse_config
from proxy.runtime import Runtime
from proxy.tasks import Supervisor


async def test_a_failure_is_logged_an_expected_one_is_not_and_stop_cancels_everything(caplog) -> None:
    sup = Supervisor("test")
    child = sup.child("runtime")
    forever = asyncio.Event()

    async def boom() -> None:
        raise RuntimeError("kaput")

    async def expected() -> None:
        raise KeyError("handled by whoever awaits it")

    with caplog.at_level(logging.ERROR, logger="vllm_proxy.tasks"):
        failing = sup.spawn(boom(), "the failing one")
        quiet = sup.spawn(expected(), "the expected one", expected=(KeyError,))
        await asyncio.gather(failing, quiet, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run
    assert [r.getMessage() for r in caplog.records] == ["background task the failing one (test) failed"]
    assert caplog.records[0].exc_info[1].args == ("kaput",)

    waiting = child.spawn(forever.wait(), "a child's waiter")
    looping = sup.every(0.001, lambda: asyncio.sleep(0), "a loop")
    assert sorted(sup.running()) == ["a child's waiter", "a loop"]
    await sup.stop()
    assert waiting.cancelled() and looping.cancelled() and sup.running() == []


async def test_a_loop_step_that_fails_is_logged_and_the_loop_goes_on(caplog) -> None:
    sup = Supervisor("test")
    steps = []
    again = asyncio.Event()

    async def step() -> None:
        steps.append(1)
        if len(steps) == 1:
            raise ValueError("first step fails")
        again.set()

    with caplog.at_level(logging.ERROR):
        sup.every(0.001, step, "flaky step", logging.getLogger("vllm_proxy.test"))
        await asyncio.wait_for(again.wait(), 5)
    await sup.stop()
    assert any(r.getMessage() == "flaky step failed" for r in caplog.records)


@pytest.mark.parametrize("managed", [False, True])
async def test_a_runtime_stops_every_task_it_started_and_a_reload_keeps_the_process_ones(managed: bool) -> None:
    """Discovery, scraping, the watchdog, LoRA: on the Runtime's supervisor, gone after stop();
    a reload's predecessor stops only its own, the process's (metrics flush) go on."""
    deployments = [{"name": "a", "model": "m", "adapter": "x", "adapter_path": "/p"}] if managed else None
    config = parse_config({
        "backends": [{"name": "gpu-0", "url": "http://127.0.0.1:9", "models": ["m"]}],
        "deployments": deployments,
        "discovery": {"interval_s": 30, "timeout_s": 0.2},
    })
    first = Runtime(config)
    await first.start()
    started = first.tasks.running()
    assert {"discovery round", "backend scrape round", "hung-replica check", "packing repair"} <= set(started)
    assert ("LoRA rebalance" in started) == managed
    process_task = first.supervisor.spawn(asyncio.Event().wait(), "process-wide")
    second = Runtime(config, previous=first)
    await second.start()
    first.hand_over(second)
    await first.stop()
    assert first.tasks.running() == [] and not process_task.done()
    assert second.supervisor is first.supervisor and "discovery round" in second.tasks.running()
    await second.stop()
    assert process_task.cancelled() and second.supervisor.running() == []


async def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Wait for a condition the background loops bring about (bounded, generous: CI is loaded).
    `condition` may be async."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        met = condition()
        if asyncio.iscoroutine(met):
            met = await met
        if met:
            return
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_reload_hands_the_redis_mirror_over_with_its_loops_running(redis_url: str) -> None:
    """Routing and Redis unchanged: the next config keeps the profile and the shared mirror, whose
    sync, flush and stream reader go on under the next config's tasks (no reconnect, no resync);
    stopping the previous config leaves them running, stopping the last one ends them."""
    import redis.asyncio as redis

    from proxy.shared import PINS_KEY

    base = {"backends": [{"name": "gpu-0", "url": "http://127.0.0.1:9", "models": ["m"]}],
            "discovery": {"interval_s": 30, "timeout_s": 0.2}, "redis": {"url": redis_url}}
    first = Runtime(parse_config(base))
    await first.start()
    shared = first.shared
    await _until(lambda: shared.up, "Redis up")
    second = Runtime(parse_config({**base, "server": {"max_queue": 3}}), previous=first)
    assert second.routing_kept and second.shared is shared and second.profile is first.profile
    await second.start()
    first.hand_over(second)
    await first.stop()
    assert first.tasks.running() == []
    assert {"Redis sync", "Redis flush", "Redis stream reader"} <= set(second.tasks.running())
    assert shared.local_load() == {"gpu-0": 0} and shared.local_load.__self__ is second

    client = redis.Redis.from_url(redis_url)
    try:  # the flusher still writes: a placement made after the hand-over reaches Redis
        shared.place(0xABC, "gpu-0")
        await _until(lambda: client.hget(PINS_KEY, f"{0xABC:016x}"), "the placement reaching Redis")

        third = Runtime(parse_config({**base, "routing": {"policy": "least_loaded"}}), previous=second)
        assert not third.routing_kept and third.shared is not shared
        await third.start()
        second.hand_over(third)
        await second.stop()  # it owned the mirror: its loops end with it
        assert not any(w.startswith("Redis") for w in second.tasks.running())
        await third.stop()
        assert third.supervisor.running() == []
    finally:
        await client.aclose()
