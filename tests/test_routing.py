"""The routing framework (proxy/routing/): profiles of filters, scorers, a picker and hooks; the
scheduler's lease; the built-in policies as profiles with their old behaviour; the new scorers."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from proxy.admission import Admission
from proxy.config import BackendConfig, ConfigError, RoutingConfig, parse_config
from proxy.errors import ProxyError
from proxy.parse import CHAT, parse_request
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.clock import ManualClock
from proxy.routing.plugins import REGISTRY, Env, Hook, Scorer, register
from proxy.routing.profiles import build
from proxy.routing.scheduler import Scheduler
from proxy.runtime import Runtime
from tests.conftest import MODEL, Servers

REQUEST = parse_request(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')


def fleet(n: int, **settings) -> list[Backend]:
    out = []
    for i in range(n):
        b = Backend(BackendConfig(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", models=["m"], **settings))
        b.healthy = True
        out.append(b)
    return out


def route_of(backends: list[Backend], adapter: str | None = None) -> Route:
    return Route(name="m", model="m", adapter=adapter, backends=tuple(backends))


def scheduler(routing: dict | None = None, clock=None, lora=None, admission=None) -> Scheduler:
    config = RoutingConfig.model_validate(routing or {"policy": "least_loaded"})
    clock = clock or ManualClock()
    profile = build(config, Env(config, clock, None, lora))
    return Scheduler(profile, admission or Admission(8, 1.0), clock)


def run(coro):
    return asyncio.run(coro)


# -- the built-in policies are profiles with their old behaviour ---------------------------------

class OldLeastLoaded:
    """The least_loaded policy before the framework (proxy/routing/policies.py), as the reference."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates):
        self._next += 1
        n = len(candidates)
        start = self._next % n
        best = candidates[start]
        for i in range(1, n):
            backend = candidates[(start + i) % n]
            if backend.in_flight < best.in_flight:
                best = backend
        return best


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
def test_builtin_profiles_pick_as_the_old_policies_did(policy: str) -> None:
    rng = random.Random(7)
    backends = fleet(5)
    sched = scheduler({"policy": policy})
    old_next = 0
    reference = OldLeastLoaded()

    async def go() -> None:
        nonlocal old_next
        for _ in range(400):
            for b in backends:
                b.in_flight = rng.choice((0, 0, 1, 2, 3))
            candidates = [b for b in backends if rng.random() < 0.8] or backends[:1]
            backend, reason = await sched.policy.pick(candidates, REQUEST, route_of(backends))
            if policy == "least_loaded":
                assert (backend, reason) == (reference.pick(candidates), "least-loaded")
            else:
                old_next += 1
                assert (backend, reason) == (candidates[old_next % len(candidates)], "round-robin")

    run(go())
    assert sched.policy.name == policy


def test_prefix_affinity_alone_is_its_own_pick_step() -> None:
    sched = scheduler({"policy": "prefix_affinity"})
    assert type(sched.policy).__name__ == "PrefixAffinity" and sched.policy.name == "prefix_affinity"
    assert hasattr(sched.policy, "load")  # what the LoRA manager reads
    mixed = scheduler({"policy": "p", "profiles": {"p": {"scorers": ["prefix_affinity", "queue_depth"]}}})
    assert hasattr(mixed.policy, "load") and hasattr(mixed.policy, "serve")  # its packing repair runs too


# -- the scheduler: filters, admission, lease ----------------------------------------------------

def test_filters_leave_out_down_ejected_untrusted_and_tried_replicas() -> None:
    clock = ManualClock(100.0)
    backends = fleet(4)
    backends[0].healthy = False
    backends[1].ejected_until = 150.0
    sched = scheduler(clock=clock)

    async def pick(**kw) -> Backend:
        with await sched.schedule(route_of(backends), REQUEST, **kw) as lease:
            return lease.backend

    assert run(pick()) in backends[2:]
    assert run(pick(tried=[backends[2]])) is backends[3]
    clock.advance(60)  # the ejection is over
    assert {run(pick(tried=[backends[2], backends[3]])) for _ in range(2)} == {backends[1]}
    with pytest.raises(ProxyError) as err:
        run(pick(trusted_only=True))
    assert err.value.status == 503 and err.value.code == "no_healthy_backend"


def test_the_lease_counts_from_the_pick_until_the_with_ends() -> None:
    backends = fleet(2)
    for b in backends:
        b.adapters = {"sql": "m"}
    sched = scheduler({"policy": "p", "profiles": {"p": {"scorers": ["least_loaded"], "hooks": []}}})

    async def go() -> None:
        lease = await sched.schedule(route_of(backends, adapter="sql"), REQUEST)
        assert lease.backend.in_flight == 1 and lease.backend.adapter_in_flight == {"sql": 1}
        with pytest.raises(RuntimeError):
            with lease:
                raise RuntimeError("the exchange failed")
        assert lease.backend.in_flight == 0 and lease.backend.adapter_in_flight == {"sql": 0}
        lease.__exit__(None, None, None)  # released once only
        assert lease.backend.in_flight == 0

    run(go())


def test_a_full_fleet_waits_for_a_slot_then_takes_it() -> None:
    backends = fleet(2, max_in_flight=1)
    admission = Admission(8, 5.0)
    sched = scheduler(admission=admission)

    async def go() -> None:
        first = await sched.schedule(route_of(backends), REQUEST)
        second = await sched.schedule(route_of(backends), REQUEST)
        waiting = asyncio.ensure_future(sched.schedule(route_of(backends), REQUEST))
        await asyncio.sleep(0)
        assert not waiting.done() and admission.queued == 1
        with first:
            pass
        third = await waiting
        assert third.backend is first.backend and third.backend.in_flight == 1
        for lease in (second, third):
            lease.__exit__(None, None, None)

    run(go())


def test_an_after_pick_hook_that_refuses_makes_the_scheduler_pick_again() -> None:
    class Draining(Hook):
        name = "test_draining"

        def after_pick(self, backend, lease):
            return backend.name != "r0"

    register(Draining)
    try:
        backends = fleet(2)
        sched = scheduler({"policy": "p", "profiles": {"p": {"picker": "round_robin", "hooks": ["test_draining"]}}})

        async def go() -> None:
            for _ in range(4):
                with await sched.schedule(route_of(backends), REQUEST) as lease:
                    assert lease.backend.name == "r1" and backends[0].in_flight == 0

        run(go())
    finally:
        del REGISTRY[("hook", "test_draining")]


# -- scorers: one small class plus one YAML line ------------------------------------------------

def test_queue_depth_prefers_the_shorter_scraped_queue() -> None:
    backends = fleet(3)
    for b, waiting in zip(backends, (4.0, 0.0, 9.0)):
        b.waiting = waiting
    sched = scheduler({"policy": "q", "profiles": {"q": {"scorers": ["queue_depth"]}}})
    picks = {run(sched.policy.pick(backends, REQUEST, route_of(backends)))[0].name for _ in range(6)}
    assert picks == {"r1"}
    backends[1].waiting = None  # not scraped: `unknown` (0) waiting, still the shortest
    assert run(sched.policy.pick(backends, REQUEST, route_of(backends)))[0].name == "r1"


def test_a_small_queue_difference_counts_in_proportion() -> None:
    """One request more waiting is a quarter of queue_depth's weight (full_spread 4), not all of
    it: a replica with much more free KV cache still wins; with full_spread 0 (llm-d's
    normalisation) any difference is the whole weight."""
    backends = fleet(2)
    backends[0].waiting, backends[0].kv_usage = 1.0, 0.1
    backends[1].waiting, backends[1].kv_usage = 0.0, 0.7

    def winner(full_spread: float) -> str:
        sched = scheduler({"policy": "w", "profiles": {"w": {"scorers": [
            {"type": "queue_depth", "weight": 2, "params": {"full_spread": full_spread}}, "kv_cache"]}}})
        return run(sched.policy.pick(backends, REQUEST, route_of(backends)))[0].name

    assert winner(4) == "r0" and winner(0) == "r1"
    backends[0].waiting = 5.0  # past the full spread: the whole weight
    assert winner(4) == "r1"


def test_kv_cache_prefers_free_kv_cache() -> None:
    backends = fleet(3)
    for b, usage in zip(backends, (0.9, 0.2, None)):
        b.kv_usage = usage
    sched = scheduler({"policy": "k", "profiles": {"k": {"scorers": [{"type": "kv_cache", "weight": 2}]}}})
    assert {run(sched.policy.pick(backends, REQUEST, route_of(backends)))[0].name for _ in range(6)} == {"r1"}
    backends[1].kv_usage = 0.95  # now the unscraped one (assumed half full) is best
    assert run(sched.policy.pick(backends, REQUEST, route_of(backends)))[0].name == "r2"


def test_weights_decide_between_scorers() -> None:
    backends = fleet(2)
    backends[0].waiting, backends[0].kv_usage = 0.0, 0.9  # short queue, full cache
    backends[1].waiting, backends[1].kv_usage = 5.0, 0.1

    def winner(queue: float, kv: float) -> str:
        sched = scheduler({"policy": "w", "profiles": {"w": {"scorers": [
            {"type": "queue_depth", "weight": queue}, {"type": "kv_cache", "weight": kv}]}}})
        return run(sched.policy.pick(backends, REQUEST, route_of(backends)))[0].name

    assert winner(2, 1) == "r0" and winner(1, 2) == "r1"


def test_a_new_scorer_is_one_class_and_one_yaml_line() -> None:
    class Named(Scorer):
        """Prefers replicas whose name ends in an even digit."""

        name = "test_even"

        def score(self, backend, request):
            return 1.0 if int(backend.name[-1]) % 2 == 0 else 0.0

    register(Named)
    try:
        config = parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:1"}],
                               "routing": {"policy": "even", "profiles": {"even": {"scorers": ["test_even"]}}}})
        profile = build(config.routing, Env(config.routing))
        backends = fleet(4)
        assert {run(profile.policy.pick(backends, REQUEST, route_of(backends)))[0].name for _ in range(8)} == {"r0", "r2"}
    finally:
        del REGISTRY[("scorer", "test_even")]


# -- configuration -------------------------------------------------------------------------------

def test_profile_errors_name_their_key_path() -> None:
    def problems(routing: dict) -> str:
        with pytest.raises(ConfigError) as err:
            parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:1"}], "routing": routing})
        return "\n".join(err.value.problems)

    assert "routing.policy: unknown policy 'mine'" in problems({"policy": "mine"})
    assert "routing.profiles.p.scorers[1].type: unknown scorer 'nope'" in problems(
        {"policy": "p", "profiles": {"p": {"scorers": ["kv_cache", "nope"]}}})
    assert "routing.profiles.p.scorers[0]: params.unknown: Input should be less than or equal to 1" in problems(
        {"policy": "p", "profiles": {"p": {"scorers": [{"type": "kv_cache", "params": {"unknown": 3}}]}}})
    assert "routing.profiles.p.filters[0].weight: unknown key" in problems(
        {"policy": "p", "profiles": {"p": {"filters": [{"type": "available", "weight": 2}]}}})
    assert "routing.profiles: 'least_loaded' is a built-in" in problems({"profiles": {"least_loaded": {}}})


def test_prefix_affinity_params_in_a_profile_override_the_routing_section() -> None:
    config = RoutingConfig.model_validate({"policy": "p", "prefix_affinity": {"epsilon": 0.3, "queue_slack": 2},
                                           "profiles": {"p": {"scorers": [{"type": "prefix_affinity", "params": {"epsilon": 0.5}}]}}})
    knobs = build(config, Env(config)).policy.config
    assert (knobs.epsilon, knobs.queue_slack) == (0.5, 2)


# -- reload: the routing state is handed over when its config is unchanged ----------------------

def test_a_reload_keeps_the_routing_state_when_routing_is_unchanged() -> None:
    base = {"backends": [{"name": "a", "url": "http://127.0.0.1:1", "models": ["m"]}]}
    first = Runtime(parse_config(base))
    same = Runtime(parse_config({**base, "server": {"max_queue": 3}}), previous=first)
    assert same.profile is first.profile and same.policy is first.policy and same.routing_kept
    assert same.profile.env.lora is same.lora  # re-pointed at the new services
    other = Runtime(parse_config({**base, "routing": {"policy": "least_loaded"}}), previous=same)
    assert other.profile is not same.profile and not other.routing_kept


# -- end to end: a profile from YAML serving through the proxy ----------------------------------

def test_a_profile_from_yaml_routes_by_the_scraped_queue(servers: Servers) -> None:
    sims = [servers.sim(), servers.sim()]
    proxy = servers.proxy_for(*sims, metrics={"scrape_backends": True}, routing={
        "policy": "by_queue", "profiles": {"by_queue": {"scorers": ["queue_depth", "kv_cache"]}}})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    resp = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.headers["x-vllm-proxy-route"] in ("scored", "retry")
    metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
    assert 'vllm_proxy_routing_decisions_total{policy="by_queue"' in metrics

