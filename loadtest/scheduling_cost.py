"""Micro-benchmark of the whole routing decision per request: filters, admission check, pick,
and counting the request in flight and out again (no network, no Redis).

    python -m loadtest.scheduling_cost [--requests 20000]
    cd <another checkout> && python <this file>    # the same measure of that code, side by side

Per built-in policy and replica count (4, 64), the median µs per request in batches of 100 (the
overhead benchmark's short chat request, all replicas healthy, some requests in flight). On a
checkout from before the routing framework it times `inference.choose` plus the in-flight
bookkeeping `_attempt` did, so the two numbers compare the same work.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import orjson

sys.path.insert(0, os.getcwd())  # run as a file from another checkout: its loadtest and proxy

from loadtest.routing_decision import MODEL, fleet  # noqa: E402
from proxy.config import RoutingConfig  # noqa: E402
from proxy.parse import CHAT, parse_request  # noqa: E402
from proxy.routing.catalog import Route  # noqa: E402

BODY = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                     {"role": "user", "content": "Say hello in one short sentence."}]}


def decide(policy: str):
    """An async `one(route, parsed)` doing one request's routing and its in-flight bookkeeping."""
    routing = RoutingConfig(policy=policy)
    try:
        from proxy.admission import Admission
        from proxy.routing.plugins import Env
        from proxy.routing.profiles import build
        from proxy.routing.scheduler import Scheduler
    except ImportError:  # before the framework
        return _before(routing)
    scheduler = Scheduler(build(routing, Env(routing)), Admission(8, 1.0))

    async def one(route, parsed) -> None:
        with await scheduler.schedule(route, parsed):
            pass

    return one


def _before(routing: RoutingConfig):
    from proxy import inference
    from proxy.admission import Admission
    from proxy.routing.policies import make_policy

    class Rt:
        policy = make_policy(routing)
        admission = Admission(8, 1.0)

    rt = Rt()

    async def one(route, parsed) -> None:
        backend, _ = await inference.choose(rt, route, parsed)
        backend.in_flight += 1
        try:
            pass
        finally:
            backend.in_flight -= 1
            rt.admission.released()

    return one


async def per_request(one, route: Route, parsed, count: int) -> float:
    batch = 100
    samples = []
    for _ in range(count // batch):
        t = time.perf_counter()
        for _ in range(batch):
            await one(route, parsed)
        samples.append((time.perf_counter() - t) / batch)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    parsed = parse_request(CHAT, orjson.dumps(BODY))
    print(f"{'policy':<16}{'replicas':>9}{'median µs':>11}")
    for policy in ("round_robin", "least_loaded", "prefix_affinity"):
        for n in (4, 64):
            bs = fleet(n)
            route = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(bs))
            cost = asyncio.run(per_request(decide(policy), route, parsed, args.requests))
            print(f"{policy:<16}{n:>9}{cost * 1e6:>11.2f}")


if __name__ == "__main__":
    main()
