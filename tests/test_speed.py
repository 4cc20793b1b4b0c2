"""Balance by speed: a replica that decodes markedly slower takes proportionally fewer requests
under prefix_affinity (proxy/routing/speed.py, the scraped inter-token latency)."""
from __future__ import annotations

from collections import Counter

import pytest

from proxy.config import AffinityConfig
from proxy.routing import speed
from proxy.routing.affinity import PrefixAffinity
from proxy.routing.affinity.balance import Balance
from proxy.routing.affinity.repair import slower_held
from proxy.routing.backends import Backend
from proxy.routing.clock import ManualClock
from proxy.scrape import _MIN_SPAN_S, Reading, _Previous, decode_time, parse_vllm_metrics
from tests.conftest import Servers, eventually
from tests.test_metrics import gauge
from tests.test_affinity import backends, chat_request, chats, pick, tenant


def exposition(itl_sum: float, itl_count: int) -> bytes:
    return (b'# TYPE vllm:inter_token_latency_seconds histogram\n'
            b'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0\n'
            b'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} %f\n'
            b'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} %d\n' % (itl_sum, itl_count))


def test_decode_time_is_the_mean_between_two_scrapes() -> None:
    reading = parse_vllm_metrics(exposition(1.5, 100))
    assert (reading.itl_sum, reading.itl_count) == (1.5, 100)
    legacy = parse_vllm_metrics(b'vllm:time_per_output_token_seconds_sum{model_name="m"} 2.0\n'
                                b'vllm:time_per_output_token_seconds_count{model_name="m"} 40\n')
    assert (legacy.itl_sum, legacy.itl_count) == (2.0, 40)
    prev = _Previous()
    assert decode_time(prev, Reading(itl_sum=1.5, itl_count=100), 0.0) is None  # one scrape: no interval yet
    assert abs(decode_time(prev, Reading(itl_sum=3.5, itl_count=200), 5.0) - 0.02) < 1e-12
    assert abs(decode_time(prev, Reading(itl_sum=3.6, itl_count=205), 10.0) - 0.02) < 1e-12  # too few tokens: the last
    assert abs(decode_time(prev, Reading(itl_sum=4.6, itl_count=300), 15.0) - 1.1 / 100) < 1e-12  # since 200, not 205
    # a span shorter than _MIN_SPAN_S is the machine's moment: the last reading until the span is long enough
    assert abs(decode_time(prev, Reading(itl_sum=9.6, itl_count=400), 15.0 + _MIN_SPAN_S / 2) - 0.011) < 1e-12
    assert abs(decode_time(prev, Reading(itl_sum=9.6, itl_count=500), 15.0 + _MIN_SPAN_S) - 5.0 / 200) < 1e-12
    assert decode_time(prev, Reading(itl_sum=0.1, itl_count=10), 30.0) is None  # restarted
    assert decode_time(prev, Reading(), 35.0) is None  # no such metric
    assert decode_time(prev, Reading(itl_sum=1.0, itl_count=100), 40.0) is None
    assert decode_time(prev, Reading(itl_sum=float("inf"), itl_count=200), 45.0) is None  # a broken replica's answer
    assert parse_vllm_metrics(b'vllm:inter_token_latency_seconds_sum{model_name="m"} +Inf\n').itl_sum == float("inf")


def test_only_a_marked_lasting_difference_counts_and_it_holds_until_back_within_a_smaller_one() -> None:
    bs = backends(4)
    speeds = speed.Speeds()

    def update(*itl: float | None) -> list[float]:
        for b, value in zip(bs, itl):
            b.itl_s = value
        speeds.update(bs)
        return [b.load_factor for b in bs]

    before = Backend.speed_version
    assert update(0.010, 0.0105, 0.014, 0.020) == [1.0] * 4  # 1.4x is noise; 2x once is a busy moment
    assert update(0.010, 0.0105, 0.010, 0.010) == [1.0] * 4
    assert update(0.010, 0.0105, 0.014, 0.020) == [1.0] * 4
    assert Backend.speed_version == before
    assert update(0.010, 0.0105, 0.014, 0.020) == [1.0] * 4  # the same reading again (its span not over): once
    assert update(0.010, 0.0105, 0.014, 0.019) == [1.0, 1.0, 1.0, 2.0]  # two readings in a row: slow (in quarters)
    assert Backend.speed_version > before
    assert update(0.010, 0.010, 0.010, 0.0135) == [1.0, 1.0, 1.0, 1.25]  # 1.35x: still slow, by less
    assert update(0.010, 0.010, 0.010, 0.012) == [1.0, 1.0, 1.0, 1.25]  # within 1.3x once: not yet alike
    assert update(0.010, 0.010, 0.010, 0.0121) == [1.0] * 4
    update(0.010, 0.010, 0.010, 0.019)
    assert update(0.010, 0.010, 0.010, 0.0191) == [1.0, 1.0, 1.0, 2.0]
    assert update(0.010, 0.010, 0.010, None) == [1.0, 1.0, 1.0, 2.0]  # no reading (restarted): alike on the
    assert update(0.010, 0.010, 0.010, None) == [1.0] * 4  # second round without one, as on two alike readings
    bs[3].healthy = False  # a replica that is down is no measure of the others, and counts 1
    assert update(0.010, None, 0.010, 0.5) == [1.0] * 4
    bs[3].healthy = True
    update(0.010, 0.010, 0.010, 1.0)
    assert update(0.010, 0.010, 0.010, 0.9)[3] == 4.0  # at most


@pytest.mark.parametrize("strength", [0.5, 1.0])
def test_a_replica_half_as_fast_takes_a_smaller_share_and_the_others_stay_even(strength: float) -> None:
    def served(strength: float) -> list[int]:
        bs = backends(4)
        bs[3].load_factor = 2.0
        Backend.speed_version += 1
        clock = ManualClock()  # decisions must not depend on how fast a loaded machine runs
        policy = PrefixAffinity(AffinityConfig(speed_balance=strength), timer=clock)
        tenants = [f"tenant s{i} " * 40 for i in range(16)]
        chats(policy, bs, tenants, [1.0] * 16, 600, 1, clock)  # warm up: placed, repaired
        counts = Counter(name for name, _ in chats(policy, bs, tenants, [1.0] * 16, 1400, 2, clock))
        return [counts[b.name] for b in bs]

    weighed = served(strength)
    fast, slow = weighed[:3], weighed[3]
    part = 1.0 / speed.counted(2.0, strength)  # its part of a fair share: 1/2 fully, 2/3 at half strength
    assert abs(slow / sum(weighed) - part / (3 + part)) <= 0.04, weighed
    # whole tenants (16 of them) on three fast replicas; the guard caps each at its part by speed x
    # (1 + speed_balance_epsilon 0.1) + 10 per window of 200 a replica: 1.15 of the fast mean
    assert max(fast) / (sum(fast) / 3) <= 1.16, weighed
    alike = served(0.0)
    assert alike[3] / sum(alike) >= 0.22, alike


def test_the_scrape_finds_the_slow_replica(servers: Servers) -> None:
    sims = [servers.sim(time_scale=1.0, itl_ms=4.0, prefill_ms_per_token=0.0) for _ in range(2)]
    # 15x slower: a loaded machine's late wake-ups (a few ms per token) cannot blur it below 2x
    sims.append(servers.sim(time_scale=1.0, itl_ms=60.0, prefill_ms_per_token=0.0))
    proxy = servers.proxy_for(*sims, routing={"policy": "round_robin"})
    runtime = proxy.server.config.app.runtime
    import httpx

    def slow_is_found() -> bool:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            for _ in range(3):
                client.post("/v1/completions", json={"model": sims[0].server.config.app.config.model,
                                                     "prompt": "hi", "max_tokens": 8})
        factors = {b.name: b.load_factor for b in runtime.backends}
        return factors["gpu-2"] >= 2.0 and factors["gpu-2"] > max(factors["gpu-0"], factors["gpu-1"])

    assert eventually(slow_is_found, timeout=30, interval=0.1)
    # and operators see it (the gauge follows the next scrape round)
    assert eventually(lambda: (gauge(proxy, "vllm_proxy_backend_load_factor", "gpu-2") or 0) >= 2.0, timeout=10)


@pytest.mark.parametrize("slow", [False, True])
def test_the_balance_guard_caps_by_speed_with_its_own_headroom(slow: bool) -> None:
    """While some replica is slower, each replica's cap is its part of the mean by speed times
    (1 + speed_balance_epsilon); on replicas alike the headroom stays balance_epsilon."""
    def cap_reached(speed_epsilon: float) -> int:
        """The last replica's count in the window when a request to it is first capped."""
        bs = backends(4)
        bs[3].load_factor = 2.0 if slow else 1.0
        Backend.speed_version += 1
        guard = Balance(100, 0.03, 0.0, 0.35, speed_epsilon=speed_epsilon)
        for i in range(400):  # a full window (4 x 100)
            guard.check("m", bs, bs[i % 4], i, (), False, 1.0)
        both = (bs[3].name, bs[0].name)  # (its prompt cached elsewhere too: the cap lends it nothing)
        for i in range(400):
            count = guard._routes["m"].counts[bs[3].name]
            if guard.check("m", bs, bs[3], 1000 + i, both, False, 1.0)[1]:
                return count
        raise AssertionError("never capped")

    bs = backends(4)
    bs[3].load_factor = 2.0
    part = speed.shares(bs, 0.35)[3]  # the slow one's share by speed, times the replicas
    for speed_epsilon in (0.03, 0.1):
        headroom = speed_epsilon if slow else 0.03
        assert cap_reached(speed_epsilon) == int((1 + headroom) * 100 * (part if slow else 1.0) + 10)


def test_a_new_tenant_goes_to_a_faster_replica_while_one_fits() -> None:
    """Its first request computes its prompt wherever it goes: on the slower replica at twice the
    time. (On replicas alike the same tenants do land there.)"""
    def placed(slow: float) -> Counter:
        bs = backends(4)
        bs[3].load_factor = slow
        Backend.speed_version += 1
        clock = ManualClock()
        policy = PrefixAffinity(AffinityConfig(), timer=clock)
        out = Counter()
        for i in range(12):
            out[pick(policy, bs, chat_request(f"tenant n{i} " * 40, "hi"))[0]] += 1
            clock.advance(0.01)
        return out

    assert placed(1.0)["gpu-3"] >= 2
    assert placed(2.0)["gpu-3"] == 0


def test_a_tenant_whose_prompt_left_the_slower_replica_moves_to_a_faster_one() -> None:
    """A slower replica's index entries are sized like its scraped cache, so the proxy knows when a
    tenant's prompt was evicted there; its next request, a miss wherever it goes, goes to a faster
    replica and the tenant with it. While the prompt is still cached it stays."""
    bs = backends(4)
    for b in bs:
        b.cache_tokens = 1120  # 15 index entries of 256 characters, at 0.9 x 4 characters a token
    clock = ManualClock()
    policy = PrefixAffinity(AffinityConfig(), timer=clock)
    home: dict[int, str] = {}
    for i in range(12):  # placed while the replicas look alike
        home[i] = pick(policy, bs, chat_request(tenant(i), "hi"))[0]
        clock.advance(0.01)
    a, b = [i for i in home if home[i] == "gpu-3"][:2]
    bs[3].load_factor = 2.0  # the scrape found it slower
    Backend.speed_version += 1
    assert pick(policy, bs, chat_request(tenant(a), "hello"))[0] == "gpu-3"  # its prompt is cached there
    clock.advance(0.01)
    for k in range(3):  # b's long conversations fill the slower replica's cache
        assert pick(policy, bs, chat_request(tenant(b), f"question {k} " * 180))[0] == "gpu-3"
        clock.advance(0.01)
    moved, _ = pick(policy, bs, chat_request(tenant(a), "hello again"))
    assert moved != "gpu-3"
    clock.advance(0.01)
    assert pick(policy, bs, chat_request(tenant(a), "and again"))[0] == moved  # its set moved with it


def test_a_slower_replica_holds_fewer_prompts_in_the_packing_and_the_others_take_the_rest() -> None:
    """Its fair part of the tenants' prompts is at most 0.9 of what its cache keeps, so that the
    repair fills its share of the traffic with hotter tenants, whose prompts stay cached there."""
    bs = backends(4)
    keeps = {b.name: 15.0 for b in bs}
    fair, sizes = [20.0] * 4, [1.0] * 4
    assert slower_held(fair, sizes, bs, lambda b, default: keeps[b.name]) == fair  # replicas alike
    bs[3].load_factor = 2.0
    held = slower_held(fair, sizes, bs, lambda b, default: keeps[b.name])
    assert held[3] == pytest.approx(0.9 * 15.0)
    assert held[:3] == pytest.approx([20.0 + (20.0 - 0.9 * 15.0) / 3] * 3) and sum(held) == pytest.approx(80.0)
    keeps["gpu-3"] = 40.0  # a cache that keeps them all: its fair part stays
    assert slower_held(fair, sizes, bs, lambda b, default: keeps[b.name]) == fair
