"""A new tenant's first request waits for the shared table's answer to its placement
(proxy/routing/affinity/arrivals.py): proxies placing one tenant at once send its requests to one
replica, whatever the change stream's delay."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import orjson

from proxy.config import AffinityConfig
from proxy.parse import CHAT, parse_request
from proxy.prefix import prefix_key
from proxy.routing.affinity import PrefixAffinity
from proxy.routing.affinity.arrivals import Arrivals
from proxy.routing.catalog import Route
from proxy.shared import SharedState
from tests.conftest import MODEL
from tests.test_shared import fleet, run_now, tenant


def streamed(system: str, question: str = "hi"):
    body = {"model": MODEL, "stream": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return parse_request(CHAT, orjson.dumps(body))


async def two_proxies(redis_url: str, **knobs) -> tuple[list[SharedState], list[PrefixAffinity]]:
    """Two proxies' shared state and policies, no background loops: the test flushes and reads
    the change stream itself. Each has read one entry of the other's (neither is alone)."""
    states = [SharedState(redis_url, local_load=dict) for _ in range(2)]
    for k, state in enumerate(states):
        await state._join()
        state.remember([1000 + k], "gpu-0")
        await state.flush()
    for state in states:
        await state.catch_up()
        assert not state.alone()
    config = AffinityConfig(block_chars=64, coalesce_wait_s=30.0, **knobs)
    return states, [PrefixAffinity(config, state) for state in states]


def test_a_new_tenant_at_two_proxies_at_once_goes_where_the_first_placed_it(redis_url: str) -> None:
    """Proxy a places a new tenant, then proxy b, before either has read the other's placement,
    each on the replica its own view prefers. Each request waits for the answer to its own
    placement; a's came first, so b's request goes where a placed the tenant, as a follower of a's
    request computing its prompt there (a's "being computed" is in the stream before b's answer).
    With `placement_hold_s: 0` b's request goes to its own choice: the race this closes."""
    async def scenario(hold: float, system: str) -> tuple[str, str, bool, int]:
        (sa, sb), (a, b) = await two_proxies(redis_url, placement_hold_s=hold)
        fa, fb = fleet(), fleet()
        ra, rb = (Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(f)) for f in (fa, fb))
        pin = prefix_key(True, streamed(system).data, MODEL, 64, 64).pin
        try:
            at_a = asyncio.ensure_future(a.pick(fa, streamed(system, "from a"), ra))
            await asyncio.sleep(0)
            choice_a = sa.pins[pin][0][0]  # placed at a (not yet answered)
            for _ in range(20):  # b's view: its own traffic went there of late
                b.view.count(choice_a, b.clock)
            request_b = streamed(system, "from b")
            at_b = asyncio.ensure_future(b.pick(fb, request_b, rb))
            await asyncio.sleep(0)
            assert sb.pins[pin][0][0] != choice_a  # b placed it elsewhere: a real race
            assert at_a.done() == at_b.done() == (hold == 0)  # each waits for its answer (or not)
            await sa.flush()  # a's placement reaches the table first
            await sb.flush()
            await sb.catch_up()  # (b's answer waits for its reader to reach it)
            (backend_a, _), (backend_b, _) = await at_a, await at_b
            return backend_a.name, backend_b.name, request_b.wait_for is not None, b.arrivals.lost
        finally:
            for state in (sa, sb):
                await state.close()

    chosen_a, chosen_b, follows, lost = asyncio.run(scenario(60.0, tenant(7)))  # (the answer ends the wait)
    assert chosen_b == chosen_a and follows and lost == 1
    chosen_a, chosen_b, follows, lost = asyncio.run(scenario(0.0, tenant(8)))  # (a tenant the table has not seen)
    assert chosen_b != chosen_a and lost == 0


def test_two_proxies_placing_a_new_tenant_on_one_replica_at_once_compute_its_prompt_once(redis_url: str) -> None:
    """Both proxies place a new tenant on the same replica before either has read the other's
    placement (their views agree), and each request would lead the computing of its prompt there.
    The second placement's answer says another proxy's came first: b's request stops leading and
    follows a's, so the prompt is computed once."""
    async def scenario() -> None:
        (sa, sb), (a, b) = await two_proxies(redis_url, placement_hold_s=60.0)  # (the answer ends the wait)
        fa, fb = fleet(), fleet()
        ra, rb = (Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(f)) for f in (fa, fb))
        system = tenant(9)
        pin = prefix_key(True, streamed(system).data, MODEL, 64, 64).pin
        try:
            request_a, request_b = streamed(system, "from a"), streamed(system, "from b")
            at_a = asyncio.ensure_future(a.pick(fa, request_a, ra))
            at_b = asyncio.ensure_future(b.pick(fb, request_b, rb))
            await asyncio.sleep(0)
            assert sa.pins[pin] and sb.pins[pin][0] == sa.pins[pin][0]  # the same choice, each its own
            assert request_a.warmed is not None and request_b.warmed is not None  # each would lead
            await sa.flush()
            await sb.flush()
            await sb.catch_up()
            (backend_a, _), (backend_b, _) = await at_a, await at_b
            assert backend_a.name == backend_b.name
            assert request_a.warmed is not None and request_a.wait_for is None  # a leads
            assert request_b.warmed is None and request_b.wait_for is not None  # b follows
            assert b.arrivals.lost == 1 and a.arrivals.lost == 0
        finally:
            for state in (sa, sb):
                await state.close()

    asyncio.run(scenario())


def test_nothing_waits_for_a_proxy_alone_or_after_redis_went_away(redis_url: str) -> None:
    """A proxy that shares Redis with no other routes a new tenant's request at once; a request
    waiting for its answer goes to its own choice as soon as Redis is found down."""
    async def scenario() -> None:
        state = SharedState(redis_url, local_load=dict)
        await state._join()
        policy = PrefixAffinity(AffinityConfig(block_chars=64, placement_hold_s=60.0), state)  # (Redis lost ends it)
        bs = fleet()
        route = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(bs))
        try:
            assert state.alone()
            run_now(policy.pick(bs, streamed(tenant(1)), route))  # (returns without suspending)
            state.peers_at = time.monotonic()  # (as when another proxy's entry was read)
            waiting = asyncio.ensure_future(policy.pick(bs, streamed(tenant(2)), route))
            await asyncio.sleep(0)
            assert not waiting.done() and policy.arrivals.waiting == 1
            state._down(ConnectionError("gone"))
            backend, _ = await waiting
            assert backend.name == state.pins[prefix_key(True, streamed(tenant(2)).data, MODEL, 64, 64).pin][0][0]
            assert policy.arrivals.waiting == 0
        finally:
            await state.close()

    asyncio.run(scenario())


def test_waits_stop_while_newcomers_do_not_come_back() -> None:
    """Unique prompts (a tenant seen once) are never raced for: once most recent newcomers got no
    second request, nothing waits; waits resume when newcomers come back again."""
    shared = SimpleNamespace(alone=lambda: False)
    tenants = SimpleNamespace(seen={})
    arrivals = Arrivals(shared, tenants, 0.1)  # type: ignore[arg-type]
    clock = 1000.0
    waits = []
    for pin in range(1, 41):  # newcomers seen once each, far apart (each judged once the next comes)
        tenants.seen[pin] = SimpleNamespace(first=clock, last=clock)
        waits.append(arrivals.wait_s(pin, clock))
        clock += 1000.0
    assert waits[0] == 0.1 and waits[-1] == 0.0
    for pin in range(41, 81):  # newcomers that come back
        tenants.seen[pin] = SimpleNamespace(first=clock, last=clock + 1.0)
        last = arrivals.wait_s(pin, clock)
        clock += 1000.0
    assert last == 0.1
    arrivals.most_s = 0.0  # placement_hold_s: 0
    assert arrivals.wait_s(81, clock) == 0.0
    arrivals.most_s = 0.1
    shared.alone = lambda: True  # no other proxy: nobody to race with
    assert arrivals.wait_s(82, clock) == 0.0
