"""Cold-prompt coalescing (proxy/routing/affinity/coalesce.py): a request for a system prompt
that another request is computing on the same replica waits for that one's first token."""
from __future__ import annotations

import concurrent.futures

import openai

from tests.conftest import MODEL, Servers, eventually, sim_of
from tests.support import held

SYSTEM = "You are the assistant of the coalescing test, and you answer briefly. " * 30


def client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=60)


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def lead(proxy) -> str:
    stream = client(proxy).chat.completions.create(model=MODEL, messages=messages("first"), stream=True, max_tokens=4)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def follow(proxy) -> int:
    answer = client(proxy).chat.completions.create(model=MODEL, messages=messages("second"), max_tokens=4)
    return answer.usage.prompt_tokens_details.cached_tokens


def test_a_prompt_being_computed_is_waited_for_not_computed_again(servers: Servers) -> None:
    sim = servers.sim()
    # (a wait bound far beyond the test: the hold, not the clock, decides when the leader goes on)
    proxy = servers.proxy_for(sim, routing={"policy": "prefix_affinity", "prefix_affinity": {"coalesce_wait_s": 600}})
    runtime = proxy.server.config.app.runtime
    coalescer = runtime.profile.policy.coalescer
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with held(sim.url):  # the leader stays before its prefill for as long as the test needs
            first = pool.submit(lead, proxy)
            assert eventually(lambda: sim_of(sim).stats()["held"] == 1, timeout=30)
            second = pool.submit(follow, proxy)
            assert eventually(lambda: coalescer.waiting == 1, timeout=30)
            assert sim_of(sim).stats()["held"] == 1  # the follower is not at the replica
            assert runtime.backends[0].in_flight == 2  # but it counts there (max_in_flight, load) while it waits
        # released: the leader computes the prompt and streams; then the follower finds it cached
        assert first.result()
        cached = second.result()
    assert cached >= 0.9 * len(SYSTEM) / 4, cached  # (the sim's tokens: ~4 characters each)
    assert coalescer.waiting == 0 and not coalescer.warming


def test_a_slow_leader_is_waited_for_at_most_coalesce_wait_s(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, routing={"policy": "prefix_affinity", "prefix_affinity": {"coalesce_wait_s": 0.2}})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with held(sim.url):
            first = pool.submit(lead, proxy)
            assert eventually(lambda: sim_of(sim).stats()["held"] == 1, timeout=30)
            second = pool.submit(follow, proxy)
            # the follower gave up waiting and computes the prompt beside the leader
            assert eventually(lambda: sim_of(sim).stats()["held"] == 2, timeout=30)
        assert first.result() and second.result() >= 0


def test_a_follower_at_another_proxy_waits_for_the_leader_too(servers: Servers, redis_url: str) -> None:
    """Two proxies sharing Redis: the leader's start reaches the other proxy through the change
    stream, and a request there for the same prompt waits for the leader's first token."""
    sim = servers.sim()
    routing = {"policy": "prefix_affinity", "prefix_affinity": {"coalesce_wait_s": 600}}
    a = servers.proxy_for(sim, routing=routing, redis={"url": redis_url})
    b = servers.proxy_for(sim, routing=routing, redis={"url": redis_url})
    runtime_b = b.server.config.app.runtime
    coalescer_b = runtime_b.profile.policy.coalescer
    assert eventually(lambda: runtime_b.shared.up and a.server.config.app.runtime.shared.up, timeout=30)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with held(sim.url):
            first = pool.submit(lead, a)
            assert eventually(lambda: sim_of(sim).stats()["held"] == 1, timeout=30)
            assert eventually(lambda: coalescer_b.warming, timeout=30)  # a's leader, as b knows it
            second = pool.submit(follow, b)
            assert eventually(lambda: coalescer_b.waiting == 1, timeout=30)
            assert sim_of(sim).stats()["held"] == 1  # the follower is not at the replica
        assert first.result()
        cached = second.result()
    assert cached >= 0.9 * len(SYSTEM) / 4, cached
    assert eventually(lambda: not coalescer_b.warming, timeout=30)  # a's release reached b


def test_the_other_proxies_leaders_are_bounded_and_dropped_with_redis() -> None:
    """A remote leader is waited for at most coalesce_wait_s from when it began (its age in the
    stream counts), and not at all once Redis went away (its release cannot arrive); a leader
    released late does not release the one that followed it."""
    import asyncio

    from proxy.parse import CHAT, parse_request
    from proxy.routing.affinity.coalesce import Coalescer

    async def scenario() -> None:
        sent: list = []
        c = Coalescer(600.0, lambda *args: sent.append(args))
        request = parse_request(CHAT, b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}')
        c.remote(1, "r0", True, 0.0)
        follower = c.check(1, "r0", False, request)
        assert follower is not None  # waits for the other proxy's leader
        c.remote(None, "", False, 0.0)  # Redis went away
        await asyncio.wait_for(c.follow(follower), 5)  # released, not after 600 s
        c.remote(2, "r0", True, 600.0)  # began as long ago as the wait bound: no one waits
        assert c.check(2, "r0", True, parse_request(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')) is None
        # a local leader's late release leaves its successor alone
        first = parse_request(CHAT, b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}')
        assert c.check(3, "r1", False, first) is None and sent[-1] == (3, "r1", True)
        stale = first.warmed
        c._release((3, "r1"))  # (expired: the next request leads)
        second = parse_request(CHAT, b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}')
        assert c.check(3, "r1", False, second) is None
        stale()
        assert (3, "r1") in c.warming  # the second leader still holds its followers
        second.warmed()
        assert (3, "r1") not in c.warming and sent[-1] == (3, "r1", False)

    asyncio.run(scenario())
