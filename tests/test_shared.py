"""Shared routing state (proxy/shared.py): the request path reads a local mirror and never waits
on Redis; placements are made locally and reconciled (first writer wins, the others adopt);
prefix entries and placements reach the other proxies through the change stream; a slow Redis
(a delaying relay, loadtest/delay_relay.py) or none at all adds nothing to a request."""
from __future__ import annotations

import asyncio
import statistics
import time
from typing import Callable

import httpx
import pytest

from loadtest.delay_relay import DelayRelay
from loadtest.private_redis import PrivateRedis
from proxy.config import AffinityConfig, BackendConfig
from proxy.parse import CHAT, parse_request
from proxy.prefix import prefix_key
from proxy.routing.affinity import PrefixAffinity
from proxy.routing.affinity.balance import Balance
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy import shared as shared_module
from proxy.shared import GUARD_KEY, SharedState
from tests.conftest import MODEL, Servers, eventually

import orjson


def fleet(n: int = 4) -> list[Backend]:
    out = [Backend(BackendConfig(name=f"gpu-{i}", url=f"http://127.0.0.1:{9000 + i}", models=[MODEL])) for i in range(n)]
    for b in out:
        b.healthy = True
    return out


def chat(system: str, *turns: str):
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return parse_request(CHAT, orjson.dumps({"model": MODEL, "messages": messages}))


def run_now(coro):
    """Run a coroutine that must finish without ever suspending (no I/O awaited)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the routing decision waited on I/O")


async def until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Yield to the event loop until `predicate` holds (generous timeout: a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def tenant(i: int) -> str:
    return f"You are assistant number {i}. " + "Answer carefully and briefly. " * 20


def test_routing_never_waits_on_a_slow_or_absent_redis(redis_url: str, private_redis: PrivateRedis) -> None:
    """Behind a relay adding 100 ms each way, a new tenant, a known one and a continuation are
    routed without the decision awaiting anything; so they are with Redis gone."""
    async def scenario() -> None:
        with DelayRelay("127.0.0.1", private_redis.port, 0.1) as relay:
            shared = SharedState(relay.url, local_load=dict)
            policy = PrefixAffinity(AffinityConfig(block_chars=64), shared)
            bs = fleet()
            route = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(bs))
            shared.start()
            try:
                await until(lambda: shared.up and shared.mirrored)
                first, why = run_now(policy.pick(bs, chat(tenant(1), "hello " * 30), route))
                assert why == "pinned" and shared.pins  # placed locally at once
                assert run_now(policy.pick(bs, chat(tenant(1), "other " * 30), route))[0] is first
                follow = chat(tenant(1), "hello " * 30, "answer " * 20, "more " * 20)
                assert run_now(policy.pick(bs, follow, route)) == (first, "prefix-hit")
                # the write reaches Redis in the background, through the relay
                await until(lambda: not shared._ops)
                relay.stop()
                await until(lambda: not shared.up)
                assert run_now(policy.pick(bs, chat(tenant(1), "again " * 30), route))[0].name == first.name
                assert run_now(policy.pick(bs, chat(tenant(2), "hi " * 30), route))[1] in ("pinned", "spill")
            finally:
                await shared.stop()

    asyncio.run(scenario())


def test_a_new_tenant_is_agreed_on_within_a_few_requests(redis_url: str) -> None:
    """Two proxies that see different loads place one new tenant on different replicas at once;
    the first write wins and the other adopts it without any request waiting. Counts the
    requests routed before both agree (each proxy routes one request per event-loop turn)."""
    async def scenario() -> None:
        a_state, b_state = SharedState(redis_url, local_load=dict), SharedState(redis_url, local_load=dict)
        config = AffinityConfig(block_chars=64, load_slack=100)
        a, b = PrefixAffinity(config, a_state), PrefixAffinity(config, b_state)
        fa, fb = fleet(), fleet()
        ra = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(fa))
        rb = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(fb))
        for s in (a_state, b_state):
            s.start()
        try:
            await until(lambda: a_state.up and b_state.up and a_state.mirrored and b_state.mirrored)
            # the race: each proxy places the new tenant at once on the replica its own view prefers
            pin = prefix_key(True, chat(tenant(5)).data, MODEL, 64, 64).pin
            first_a = a_state.place(pin, "gpu-0")[0]
            first_b = b_state.place(pin, "gpu-1")[0]
            assert first_a != first_b  # a real race
            before = 2
            for i in range(1, 2000):
                pa = run_now(a.pick(fa, chat(tenant(5), f"q{i} " * 30), ra))[0].name
                pb = run_now(b.pick(fb, chat(tenant(5), f"q{i} " * 30), rb))[0].name
                if pa == pb:
                    break
                before += 2
                await asyncio.sleep(0.001)
            assert pa == pb and pa in (first_a, first_b)
            await until(lambda: a_state.pins[pin][0] == b_state.pins[pin][0])
            assert a_state.adopted + b_state.adopted >= 1
            print(f"\nrequests routed before both proxies agreed: {before}")
        finally:
            await a_state.stop()
            await b_state.stop()

    asyncio.run(scenario())


def test_prefix_entries_reach_other_proxies_and_late_joiners(redis_url: str) -> None:
    """Entries one proxy records are in another's mirror shortly after; a proxy that starts
    later reads the stream's retained past (conversations begun before it started)."""
    async def scenario() -> None:
        a, b = SharedState(redis_url, local_load=dict), SharedState(redis_url, local_load=dict)
        for s in (a, b):
            s.start()
        late = None
        try:
            await until(lambda: a.up and b.up)
            assert a.longest([1, 2, 3]) == (0, None)
            a.remember([11, 12, 13], "gpu-2")
            assert a.longest([11, 12, 13, 14]) == (3, "gpu-2")  # its own entries: at once
            await until(lambda: b.longest([11, 12, 13, 14]) == (3, "gpu-2"))
            b.remember([13], "gpu-1")  # the conversation moved: the last writer wins everywhere
            await until(lambda: a.longest([11, 12, 13]) == (3, "gpu-1"))
            late = SharedState(redis_url, local_load=dict)
            late.start()
            await until(lambda: late.longest([11, 12, 13]) == (3, "gpu-1") and late.longest([11, 12]) == (2, "gpu-2"))
        finally:
            for s in (a, b, late):
                if s is not None:
                    await s.stop()

    asyncio.run(scenario())


def test_a_busy_proxy_shares_its_load_at_the_busy_interval(redis_url: str) -> None:
    """While requests are routed, the load view and prefix entries go out every
    busy_sync_interval_s, not every sync_interval_s: the others' view lags by fewer requests at a
    higher rate. (A 60 s idle period here: only the busy cadence can deliver within the test.)"""
    async def scenario() -> None:
        loads = {"gpu-0": 0}
        a = SharedState(redis_url, local_load=lambda: dict(loads), sync_interval_s=60.0, busy_sync_interval_s=0.01)
        b = SharedState(redis_url, local_load=dict, sync_interval_s=60.0, busy_sync_interval_s=0.01)
        for s in (a, b):
            s.start()
        try:
            await until(lambda: a.up and b.up)

            def b_sees(load: int) -> bool:
                a.busy = b.busy = True  # both route requests (the policy sets it on every decision)
                return b.remote_load.get("gpu-0") == load

            await until(lambda: b_sees(0), timeout=30.0)
            await until(lambda: not a.busy)  # a's sync round took its load (before its first await)
            loads["gpu-0"] = 7
            for _ in range(50):  # idle, a keeps it to itself (b, busy, reads every 10 ms meanwhile)
                b.busy = True
                await asyncio.sleep(0.01)
            assert b.remote_load.get("gpu-0") == 0
            await until(lambda: b_sees(7), timeout=30.0)
            a.remember([21, 22], "gpu-3")  # prefix entries go out at the busy interval too
            await until(lambda: b.longest([21, 22]) == (2, "gpu-3"), timeout=30.0)
        finally:
            for s in (a, b):
                await s.stop()

    asyncio.run(scenario())


def test_each_proxy_shares_where_its_traffic_goes_now(redis_url: str) -> None:
    """Each proxy publishes its routed counts over the last quarter load window (`local_recent`)
    beside its busy tenants (an older release, which reads only those, ignores them); every other
    proxy reads them summed per replica (`remote_recent`), so placement weighs the fleet's recent
    traffic, not this proxy's part of it."""
    async def scenario() -> None:
        states = []
        for recent in ({"gpu-0": 12.0, "gpu-1": 1.0}, {"gpu-0": 2.0, "gpu-1": 0.0}, {}):
            s = SharedState(redis_url, local_load=lambda: {"gpu-0": 0, "gpu-1": 0}, sync_interval_s=0.05,
                            busy_sync_interval_s=0.01)
            s.local_recent = lambda recent=recent: dict(recent)
            s.local_hot, s.on_hot = list, lambda entries: None  # (as the policy sets them)
            states.append(s)
            s.start()
        a, b, c = states
        try:
            def c_sees() -> bool:
                for s in states:
                    s.busy = True
                return 13.0 < c.remote_recent.get("gpu-0", 0.0) <= 14.0 and 0.9 < c.remote_recent.get("gpu-1", 0.0) <= 1.0

            await until(c_sees, timeout=30.0)
            await until(lambda: 1.9 < a.remote_recent.get("gpu-0", 0.0) <= 2.0, timeout=30.0)  # not its own
        finally:
            for s in states:
                await s.stop()

    asyncio.run(scenario())


def test_where_a_proxys_traffic_goes_now_rides_its_change_stream_entries(redis_url: str) -> None:
    """Each stream entry a proxy writes (its index entries, every busy interval) carries its recent
    routed counts: another proxy reads them at its next stream read, not its next load sync, so
    two proxies placing newcomers at once see each other's within the stream's lag (three proxies
    offline, seeds 0-15: phases meeting both 0.97 and 1.10, 74 -> 79 of 96; docs/BENCHMARKS.md).
    Its own entries do not count; a newer entry replaces an older one; an entry without counts
    (an older release) changes nothing."""
    async def scenario() -> None:
        a, b = (SharedState(redis_url, local_load=lambda: {}, sync_interval_s=60.0) for _ in range(2))
        counts = {"gpu-0": 9.0, "gpu-1": 3.0}
        a.local_recent = lambda: dict(counts)
        try:
            for s in (a, b):
                await s._join()
            a.remember([1, 2, 3], "gpu-0")
            await a.flush()
            await b.catch_up()
            await a.catch_up()
            assert b.remote_recent == pytest.approx(counts, rel=0.01)
            assert a.remote_recent == {}
            counts["gpu-0"] = 1.0
            a.remember([4], "gpu-1")
            await a.flush()
            await b._flush_client.xadd(shared_module.LOG_KEY, {"p": a.proxy_id, "i": ""})  # (older release)
            await b.catch_up()
            assert b.remote_recent == pytest.approx({"gpu-0": 1.0, "gpu-1": 3.0}, rel=0.01)
        finally:
            for s in (a, b):
                await s.close()

    asyncio.run(scenario())


def test_a_proxys_balance_windows_ride_its_change_stream_entries(redis_url: str) -> None:
    """Each stream entry a proxy writes carries its balance windows that decided since its last
    entry (and its overflows since): another proxy's guard counts them at its next stream read,
    not its next load sync. Its own entries do not count; a newer window replaces an older one,
    and a load sync's older copy does not replace what the stream brought; an entry that is not
    ours changes nothing."""
    async def scenario() -> None:
        bs = fleet(4)
        key = ("m", tuple(sorted(b.name for b in bs)))
        a, b = (SharedState(redis_url, local_load=lambda: {}, sync_interval_s=60.0) for _ in range(2))
        ga = Balance(200, 10.0, 0.1, shared=a)  # (never caps: a huge epsilon)
        a.stream_guard = ga.streamed
        try:
            for s in (a, b):
                await s._join()
            for i in range(40):
                ga.check("m", bs, bs[0], 100 + i, (), False, 2.0)
            a.remember([1, 2, 3], "gpu-0")
            await a.flush()
            await b.catch_up()
            await a.catch_up()
            assert b.remote_guard[key][:2] == (40, {"gpu-0": 40, "gpu-1": 0, "gpu-2": 0, "gpu-3": 0})
            assert a.remote_guard == {}
            for i in range(10):
                ga.check("m", bs, bs[1], 200 + i, (), False, 2.0)
            a.remember([4], "gpu-1")
            await a.flush()
            await b._flush_client.xadd(shared_module.LOG_KEY, {"p": "x", "i": "", "g": "not json"})
            await b.catch_up()
            assert b.remote_guard[key][:2] == (50, {"gpu-0": 40, "gpu-1": 10, "gpu-2": 0, "gpu-3": 0})
            # a load sync's copy from before the stream's (its stamp older) does not replace it
            old = orjson.dumps({"at": time.time() - 1.0, "names": list(key[1]), "filled": 40,
                                "counts": [40, 0, 0, 0], "overflow": [], "decided": 40, "picks": [40, 0, 0, 0]})
            assert b._other_windows({f"{a.proxy_id}|m": old.decode()}, time.time())[key][0] == 50
        finally:
            for s in (a, b):
                await s.close()

    asyncio.run(scenario())


def test_a_proxy_alone_syncs_at_a_longer_interval_until_another_shares_the_state(redis_url: str) -> None:
    """Nobody reads the view of a proxy that is alone: its busy rounds (load sync, index flush)
    go five busy intervals apart, at most sync_interval_s. Another proxy's load entries bring
    both back to the busy interval as soon as each reads the other's."""
    async def scenario() -> None:
        a = SharedState(redis_url, local_load=lambda: {"gpu-0": 0}, sync_interval_s=60.0, busy_sync_interval_s=0.01)
        a.start()
        b = None
        try:
            await until(lambda: a.up)
            a.busy = True
            await until(lambda: not a.busy)  # a sync round ran: no other proxy's entry in it
            assert a.interval() == 0.05
            b = SharedState(redis_url, local_load=lambda: {"gpu-0": 1}, sync_interval_s=60.0,
                            busy_sync_interval_s=0.01)
            b.start()

            def both_see_each_other() -> bool:
                a.busy = b.busy = True
                return a.interval() == b.interval() == 0.01

            await until(both_see_each_other)
            assert a.remote_load == {"gpu-0": 1} and b.remote_load == {"gpu-0": 0}
        finally:
            for s in (a, b):
                if s is not None:
                    await s.stop()

    asyncio.run(scenario())


def test_the_balance_guard_counts_every_proxys_decisions_and_shares_overflows(redis_url: str) -> None:
    """Each proxy's balance guard caps a replica by the whole fleet's window (its own decisions
    plus the others' as last published), not by its own third of the traffic, whose chance
    excursions would cap on noise; and a tenant one proxy overflowed goes to the same replica
    from every proxy (its prompt is cached there)."""
    async def scenario() -> None:
        bs = fleet(4)
        route = "m"
        # a never caps (a huge epsilon); b caps at the default. One wall time for both: what is
        # published stays recent however slowly the test runs
        ga, gb = Balance(200, 10.0, 0.1, wall=lambda: 1000.0), Balance(200, 0.03, 0.1, wall=lambda: 1000.0)
        a = SharedState(redis_url, local_load=dict, sync_interval_s=60.0, busy_sync_interval_s=0.01)
        b = SharedState(redis_url, local_load=dict, sync_interval_s=60.0, busy_sync_interval_s=0.01)
        ga.shared, gb.shared = a, b
        for s, g in ((a, ga), (b, gb)):
            s.local_guard, s.adopt_overflows = g.snapshot, g.adopt
            s.start()
        try:
            await until(lambda: a.up and b.up)
            # entries no proxy wrote are ignored (and dropped), never taken for an outage
            await a.client.hset(GUARD_KEY, mapping={
                "x|m": "not json", "y|m": "[1, 2]", "z|m": orjson.dumps({"at": 1e18, "names": [[1]], "filled": 1,
                                                                         "counts": ["a"]}),
                "w|m": orjson.dumps({"at": time.time(), "names": ["gpu-0"], "filled": 1, "counts": [1],
                                     "overflow": [["zz", "gpu-0", 0]]})})
            assert gb.check(route, bs, bs[3], 1, (), False, 2.0) == (bs[3], False)  # b's own window
            # a lists the replicas in another order: the same fleet all the same
            shuffled = [bs[2], bs[0], bs[3], bs[1]]
            for i in range(100):  # 25 each: gpu-0 is at the fleet's mean, nothing to cap
                assert ga.check(route, shuffled, shuffled[i % 4], 100 + i, (), False, 2.0)[1] is False

            def b_sees_a(total: int) -> bool:
                a.busy = b.busy = True  # both route requests (the policy sets it on every decision)
                return b.remote_guard.get((route, tuple(sorted(x.name for x in bs))), (0,))[0] == total

            await until(lambda: b_sees_a(100), timeout=30.0)
            assert gb.check(route, bs, bs[0], 6, ("gpu-0",), False, 2.0) == (bs[0], False)
            for i in range(100):
                assert ga.check(route, shuffled, bs[0], 200 + i, ("gpu-0",), False, 2.0) == (bs[0], False)
            # alone, b's first request for gpu-0 is far under its cap (its part of the window holds one)
            alone = Balance(200, 0.03, 0.1)
            alone.check(route, bs, bs[3], 1, (), False, 2.0)
            assert alone.check(route, bs, bs[0], 7, ("gpu-0",), False, 2.0) == (bs[0], False)
            await until(lambda: b_sees_a(200), timeout=30.0)
            assert a.up and b.up
            chosen, capped = gb.check(route, bs, bs[0], 7, ("gpu-0",), False, 2.0)
            assert capped and chosen.name != "gpu-0"

            def a_adopted() -> bool:
                a.busy = b.busy = True
                return ga._routes[route].overflow.get(7) == chosen.name

            await until(a_adopted, timeout=30.0)
        finally:
            for s in (a, b):
                await s.stop()

    asyncio.run(scenario())


def test_the_stretch_bound_sees_what_other_proxies_decided_since_it_first_saw_them(redis_url: str) -> None:
    """The other proxies' totals are cumulative since each began its window: a proxy seen for the
    first time (this one restarted, or it came back), or one whose totals fell (a new window), is
    a starting point, never thousands of decisions at once; an older proxy that publishes no
    totals adds nothing. What the others made since is summed per (route, replicas)."""
    state = SharedState(redis_url, local_load=dict)
    names = ["gpu-0", "gpu-1"]

    def entry(decided: int | None, picks: list[int] | None) -> bytes:
        body: dict = {"at": 1000.0, "names": names, "filled": 10, "counts": [5, 5], "overflow": []}
        if picks is not None:
            body.update(decided=decided, picks=picks)
        return orjson.dumps(body)

    def made(table: dict) -> tuple[int, dict]:
        return state._other_windows(table, 1000.0)[("m", tuple(names))][2:]

    assert made({"a|m": entry(20000, [16000, 4000]), "old|m": entry(None, None)}) == (0, {})
    assert made({"a|m": entry(20010, [16006, 4004]), "old|m": entry(None, None)}) == (10, {"gpu-0": 6, "gpu-1": 4})
    # a starts a new window, b appears with a long history: neither is decisions
    assert made({"a|m": entry(2, [1, 1]), "b|m": entry(9000, [0, 9000])}) == (10, {"gpu-0": 6, "gpu-1": 4})
    assert made({"a|m": entry(4, [3, 1]), "b|m": entry(9003, [0, 9003])}) == (15, {"gpu-0": 8, "gpu-1": 7})


def test_tenant_counts_go_out_after_a_few_dozen_requests_at_any_rate(redis_url: str, monkeypatch) -> None:
    """A busy proxy publishes its tenants' counts (for the others' packing repair) every
    _TENANTS_EVERY_REQUESTS requests it routes, not only every _TENANTS_EVERY_S: at ten times
    the rate one second is ten times as many requests of a new population unseen. (The time
    cadence is an hour here: only the request count can deliver within the test.)"""
    monkeypatch.setattr(shared_module, "_TENANTS_EVERY_S", 3600.0)

    async def scenario() -> None:
        totals = {"n": 1.0}
        a = SharedState(redis_url, local_load=dict, sync_interval_s=60.0, busy_sync_interval_s=0.01)
        b = SharedState(redis_url, local_load=dict, sync_interval_s=60.0, busy_sync_interval_s=0.01)
        a.local_tenants = lambda wall: ({5: totals["n"]}, totals["n"], {})
        b.rate_tau = 1e9  # (no decay of what b reads: a slow read must not change the total)
        for s in (a, b):
            s.start()
        try:
            await until(lambda: a.up and b.up)

            async def b_reads(total: float) -> bool:
                a.busy = True
                others = await b.other_tenants()
                return others is not None and abs(others[1] - total) < 0.5

            async def wait_for_total(total: float) -> None:
                deadline = time.monotonic() + 30.0
                while not await b_reads(total):
                    assert time.monotonic() < deadline, "tenant counts not published"
                    await asyncio.sleep(0.01)

            await wait_for_total(1.0)  # the first round publishes
            totals["n"] = 50.0
            a.routed += shared_module._TENANTS_EVERY_REQUESTS - 1
            for _ in range(30):  # one request short: nothing new goes out
                a.busy = True
                await asyncio.sleep(0.01)
            assert not await b_reads(50.0)
            a.routed += 1
            await wait_for_total(50.0)
        finally:
            for s in (a, b):
                await s.stop()

    asyncio.run(scenario())


def test_a_kept_lease_answer_still_passes_the_lease_on(redis_url: str) -> None:
    """The packing repair asks for its lease every few hundred requests (70 times a second at 20k
    requests a second): each answer is kept for half the lease. The holder keeps it without asking
    Redis, and once it stops renewing another proxy takes it over."""
    async def scenario() -> None:
        a = SharedState(redis_url, local_load=dict, timeout_s=0.5)
        b = SharedState(redis_url, local_load=dict, timeout_s=0.5)
        a.up = b.up = True
        try:
            assert await a.lease("t", 0.4) and not await b.lease("t", 0.4)
            await a.client.delete("vp:lease:t")  # (gone from Redis: a's kept answer still says it holds it)
            assert await a.lease("t", 0.4)
            deadline = time.monotonic() + 30.0
            while not await b.lease("t", 0.4):  # a no longer renews: b takes the lease once its answer is due
                assert time.monotonic() < deadline, "the lease never passed on"
                await asyncio.sleep(0.02)
            a._leases.clear()  # a asks Redis again: the lease is b's now
            assert not await a.lease("t", 0.4)
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_a_placement_change_reaches_every_mirror_and_queued_writes_win(redis_url: str) -> None:
    """set_pin (shrink, re-home) is in the other proxies' mirrors shortly after; a change this
    proxy has queued but not sent yet is not overwritten by an older entry arriving meanwhile."""
    async def scenario() -> None:
        a, b = SharedState(redis_url, local_load=dict), SharedState(redis_url, local_load=dict)
        a.up = b.up = a.mirrored = b.mirrored = True
        try:
            a.set_pin(9, ("gpu-1", "gpu-2"))
            await a.flush()
            b._reading.set()
            b._reader_task = asyncio.get_running_loop().create_task(b._reader())
            await until(lambda: b.pins.get(9, ((),))[0] == ("gpu-1", "gpu-2"))
            b.set_pin(9, ("gpu-3",))  # queued in b, not sent
            a.set_pin(9, ("gpu-1",))
            await a.flush()
            await until(lambda: b._cursor_key >= a._last_sent)
            assert b.pins[9][0] == ("gpu-3",)
            await b.flush()
            assert b.pins[9][0] == ("gpu-3",)
            b._reader_task.cancel()
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


@pytest.fixture
def slow_redis(private_redis: PrivateRedis, redis_url: str):
    """The suite's Redis behind a relay adding 100 ms each way (requested before `servers`, so
    it outlives the proxies using it)."""
    with DelayRelay("127.0.0.1", private_redis.port, 0.1) as relay:
        yield relay


def test_a_slow_redis_adds_nothing_to_a_request(slow_redis: DelayRelay, servers: Servers) -> None:
    """Two proxies share state through a relay adding 100 ms each way: no request fails, a
    request takes no longer than through a proxy without Redis (any round trip on the request
    path would add 200 ms), and a conversation started on one proxy continues on the other."""
    sims = [servers.sim() for _ in range(3)]
    relay, delay_s = slow_redis, slow_redis.delay
    config = {"redis": {"url": relay.url}, "routing": {"prefix_affinity": {"block_chars": 64, "load_slack": 100}}}
    a, b = servers.proxy_for(*sims, **config), servers.proxy_for(*sims, **config)
    plain = servers.proxy_for(*sims, routing={"prefix_affinity": {"block_chars": 64, "load_slack": 100}})
    states = [p.server.config.app.runtime.shared for p in (a, b)]
    assert eventually(lambda: all(s.up and s.mirrored for s in states), timeout=30)
    with httpx.Client(timeout=30) as client:
        def timed(proxy, i: int) -> tuple[float, httpx.Response]:
            body = {"model": MODEL, "max_tokens": 2,
                    "messages": [{"role": "system", "content": tenant(i % 3)}, {"role": "user", "content": f"q{i} " * 30}]}
            t = time.perf_counter()
            resp = client.post(proxy.url + "/v1/chat/completions", json=body)
            return time.perf_counter() - t, resp

        slow, fast = [], []
        for i in range(30):
            for proxy, out in ((a, slow), (plain, fast)):
                elapsed, resp = timed(proxy, i)
                assert resp.status_code == 200
                out.append(elapsed)
        assert statistics.median(slow) < statistics.median(fast) + delay_s, (slow, fast)
        # a conversation through a, continued through b once b's mirror shows a's entries
        first = [{"role": "system", "content": tenant(7)}, {"role": "user", "content": "first question " * 8}]
        resp = client.post(a.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": first})
        home = resp.headers["x-vllm-proxy-backend"]
        chain = prefix_key(True, {"messages": first}, MODEL, 64, 64).chain
        assert eventually(lambda: states[1].longest(chain) == (len(chain), home), timeout=30)
        more = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then? " * 8}]
        resp = client.post(b.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": more})
        assert resp.headers["x-vllm-proxy-backend"] == home and resp.headers["x-vllm-proxy-route"] == "prefix-hit"
