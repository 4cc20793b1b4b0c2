"""A new tenant seen at several proxies at once (proxy/routing/affinity/arrivals.py): the proxy
ranked first for it places it, the others hold its request for that placement."""
from __future__ import annotations

import concurrent.futures
import threading
from types import SimpleNamespace

import openai

from proxy.prefix import prefix_key
from proxy.routing.affinity.arrivals import Arrivals
from proxy.routing.affinity.ranking import rendezvous_weight
from proxy.routing.backends import rendezvous_salt
from tests.conftest import MODEL, Servers, eventually


def client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(proxy, system: str, question: str = "hi") -> str:
    """The replica that served one chat request (the proxy's header)."""
    raw = client(proxy).chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    return raw.headers["x-vllm-proxy-backend"]


def first_for(policy, first: str, second: str, tag: str) -> str:
    """A system prompt whose tenant ranks proxy `first` above `second`."""
    for i in range(1000):
        system = f"You are the assistant of tenant {tag}-{i}. " * 40
        data = {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
        pin = prefix_key(True, data, MODEL, policy._block_chars, policy._max_blocks)[0]
        if rendezvous_weight(pin, rendezvous_salt(first)) > rendezvous_weight(pin, rendezvous_salt(second)):
            return system
    raise AssertionError("no such prompt")


def test_a_new_tenant_at_two_proxies_at_once_is_placed_by_the_first_ranked(servers: Servers, redis_url: str) -> None:
    sims = [servers.sim(), servers.sim()]
    routing = {"policy": "prefix_affinity"}
    a = servers.proxy_for(*sims, routing=routing, redis={"url": redis_url})
    b = servers.proxy_for(*sims, routing=routing, redis={"url": redis_url})
    ra, rb = a.server.config.app.runtime, b.server.config.app.runtime
    assert eventually(lambda: ra.shared.up and rb.shared.up, timeout=30)
    # both route some other tenant's traffic all along, so each counts the other as routing now
    stop = threading.Event()

    def background() -> None:
        k = 0
        while not stop.is_set():
            ask((a, b)[k % 2], "You are the background tenant. " * 40, f"q{k}")
            k += 1

    worker = threading.Thread(target=background, daemon=True)
    worker.start()
    try:
        assert eventually(lambda: rb.shared.peer_ids == (ra.shared.proxy_id,), timeout=30)
        assert eventually(lambda: ra.shared.peer_ids == (rb.shared.proxy_id,), timeout=30)
        policy_b = rb.profile.policy
        system = first_for(policy_b, ra.shared.proxy_id, rb.shared.proxy_id, "ab")
        # b ranks second: it holds the tenant's request until a placement arrives (as long as the
        # test needs: the placement, not the clock, ends the hold here)
        policy_b.arrivals.most_s = 600.0
        rb.shared.delivery_s = 600.0
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            at_b = pool.submit(ask, b, system)
            assert eventually(lambda: policy_b.arrivals.waiting == 1, timeout=30)
            assert not at_b.done()
            at_a = pool.submit(ask, a, system)  # a ranks first: it places the tenant at once
            assert at_b.result() == at_a.result()  # b's request went where a placed it
        assert policy_b.arrivals.waiting == 0
    finally:
        stop.set()
        worker.join(timeout=60)


def test_holds_stop_while_newcomers_do_not_come_back() -> None:
    """Unique prompts (a tenant seen once) are never raced for: once most recent newcomers got no
    second request, nothing is held; holds resume when newcomers come back again. The first-ranked
    proxy never holds; the k-th holds k delivery times."""
    shared = SimpleNamespace(proxy_id="this", peer_ids=("other",), delivery_s=0.01, on_placed=None)
    tenants = SimpleNamespace(seen={})
    arrivals = Arrivals(shared, tenants, 0.1)  # type: ignore[arg-type]
    ranked_second = [p for p in range(1, 4000) if rendezvous_weight(p, rendezvous_salt("other")) > rendezvous_weight(p, rendezvous_salt("this"))]
    ranked_first = [p for p in range(1, 4000) if rendezvous_weight(p, rendezvous_salt("other")) < rendezvous_weight(p, rendezvous_salt("this"))]
    assert arrivals.hold_s(ranked_first[0], 0.0) == 0.0
    clock = 1000.0
    assert arrivals.hold_s(ranked_second[0], clock) == 0.01
    pins = iter(ranked_second[1:])
    # newcomers seen once each, far apart (each judged once the next comes)
    held = []
    for _ in range(40):
        pin = next(pins)
        tenants.seen[pin] = SimpleNamespace(first=clock, last=clock)
        held.append(arrivals.hold_s(pin, clock))
        clock += 1000.0
    assert held[0] > 0.0 and held[-1] == 0.0
    # newcomers that come back: holds resume
    for _ in range(40):
        pin = next(pins)
        tenants.seen[pin] = SimpleNamespace(first=clock, last=clock + 1.0)
        last = arrivals.hold_s(pin, clock)
        clock += 1000.0
    assert last == 0.01
    arrivals.most_s = 0.0  # placement_hold_s: 0
    assert arrivals.hold_s(next(pins), clock) == 0.0
    arrivals.most_s = 0.1
    shared.peer_ids = ()  # no other proxy routing: nothing to wait for
    assert arrivals.hold_s(next(pins), clock) == 0.0


def test_holds_stop_while_no_placement_ends_them() -> None:
    """Where each tenant's requests reach one proxy only, no other proxy's placement ever ends a
    hold: once most of the last holds ran out, only every 16th newcomer is held (to see whether that
    changed); when placements end holds again, every newcomer is held again."""
    import asyncio

    shared = SimpleNamespace(proxy_id="this", peer_ids=("other",), delivery_s=0.01, on_placed=None)
    tenants = SimpleNamespace(seen={})
    arrivals = Arrivals(shared, tenants, 0.1)  # type: ignore[arg-type]
    pins = iter(p for p in range(1, 100000)
                if rendezvous_weight(p, rendezvous_salt("other")) > rendezvous_weight(p, rendezvous_salt("this")))

    async def newcomers(count: int, placed: bool) -> list[float]:
        held = []
        for _ in range(count):
            pin = next(pins)
            tenants.seen[pin] = SimpleNamespace(first=0.0, last=1.0)  # (they come back)
            wait = arrivals.hold_s(pin, 0.0)
            held.append(wait)
            if wait:
                if placed:  # another proxy's placement arrives while this one holds
                    asyncio.get_running_loop().call_soon(arrivals.placed, pin)
                await arrivals.wait(pin, 60.0 if placed else 0.0)
        return held

    unpaid = asyncio.run(newcomers(56, placed=False))
    assert all(unpaid[:8])
    assert [k for k, wait in enumerate(unpaid) if wait][8:] == [23, 39, 55]  # probes only
    paid = asyncio.run(newcomers(80, placed=True))
    assert all(paid[-16:])
