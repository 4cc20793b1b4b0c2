"""Micro-benchmark of the prefix_affinity routing decision (no network, no Redis).

    python -m loadtest.routing_decision [--requests 20000] [--profile]

First, the per-request cost of each policy's `pick` side by side (least_loaded, prefix_affinity
alone, and prefix_affinity with the shared-state mirror a Redis-backed proxy reads), for the
overhead benchmark's short chat request and for a tenant chat request (a ~2 KB system prompt,
a short user turn), on one and on four replicas: what prefix_affinity adds over least_loaded.
`--profile` prints where prefix_affinity's time goes (cProfile, sorted by own time).

Then, per backend count (4, 16, 64) and index size (10 k, 1 M indexed prefix blocks), the median
and p99 cost of `PrefixAffinity.pick` for the tenant request, plus the resident memory the index
holds. The index is bounded by its per-replica LRU capacity, so filling it past capacity shows
that memory stays flat.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import statistics
import time

import orjson

from proxy.config import AffinityConfig, BackendConfig, RoutingConfig
from proxy.parse import CHAT, parse_request
from proxy.routing.affinity import PrefixAffinity
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.plugins import Env
from proxy.routing.profiles import build
from proxy.shared import SharedState

MODEL = "bench-model"


def fleet(n: int) -> list[Backend]:
    out = [Backend(BackendConfig(name=f"r{i}", url=f"http://127.0.0.1:{10000 + i}", models=[MODEL])) for i in range(n)]
    for i, b in enumerate(out):
        b.healthy = True
        b.in_flight = i % 3
    return out


def requests(count: int, tenants: int = 200) -> list:
    out = []
    for i in range(count):
        system = f"Tenant {i % tenants} system prompt. " + "Follow the policy carefully. " * 70
        body = {"model": MODEL, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": f"question {i}"}]}
        out.append(parse_request(CHAT, orjson.dumps(body)))
    return out


def short_requests(count: int) -> list:
    """The overhead benchmark's request (loadtest/wrk_chat.lua): one short user message."""
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                         {"role": "user", "content": "Say hello in one short sentence."}]}
    return [parse_request(CHAT, orjson.dumps(body)) for _ in range(count)]


def mirrored_state() -> SharedState:
    """A SharedState as the request path sees it once connected (never started: no I/O)."""
    state = SharedState("redis://127.0.0.1:1/0", local_load=dict)
    state.up = state.mirrored = True
    return state


def make(policy: str, backends: int):
    if policy == "least_loaded":
        config = RoutingConfig(policy="least_loaded")
        return build(config, Env(config)).policy
    return PrefixAffinity(AffinityConfig(), mirrored_state() if policy == "prefix_affinity+mirror" else None)


async def per_request(policy, bs: list[Backend], reqs: list) -> float:
    """Median seconds per pick, in batches (timer overhead amortised)."""
    route = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(bs))
    batch = 100
    samples = []
    for start in range(0, len(reqs) - batch + 1, batch):
        t = time.perf_counter()
        for parsed in reqs[start:start + batch]:
            await policy.pick(bs, parsed, route)
        samples.append((time.perf_counter() - t) / batch)
        shared = getattr(policy, "shared", None)
        if shared is not None:  # what the flusher would have sent
            shared._ops.clear()
            shared._pending.clear()
    return statistics.median(samples)


POLICIES = ("least_loaded", "prefix_affinity", "prefix_affinity+mirror")


def compare(count: int) -> None:
    print(f"{'request':>8} {'replicas':>8} " + " ".join(f"{p:>22}" for p in POLICIES) + f" {'added µs':>9}")
    for kind, reqs in (("short", short_requests(count)), ("tenant", requests(count))):
        for n in (1, 4):
            costs = {p: asyncio.run(per_request(make(p, n), fleet(n), reqs)) * 1e6 for p in POLICIES}
            added = costs["prefix_affinity+mirror"] - costs["least_loaded"]
            print(f"{kind:>8} {n:>8} " + " ".join(f"{costs[p]:>22.1f}" for p in POLICIES) + f" {added:>9.1f}")


def profile(count: int) -> None:
    import cProfile
    import pstats

    policy, bs, reqs = make("prefix_affinity+mirror", 4), fleet(4), requests(count)
    asyncio.run(per_request(policy, bs, reqs[:1000]))  # warm
    prof = cProfile.Profile()
    prof.enable()
    asyncio.run(per_request(policy, bs, reqs))
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def fill(policy: PrefixAffinity, names: list[str], entries: int) -> None:
    """Index `entries` distinct block hashes spread over the replicas."""
    chunk = 64
    for start in range(0, entries, chunk):
        hashes = range(start * 7919 + 1, start * 7919 + 1 + chunk)
        policy.index.record(list(hashes), names[(start // chunk) % len(names)], 0.0, 600.0)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def measure(backends: int, indexed: int, reqs: list) -> dict:
    bs = fleet(backends)
    capacity = max(indexed // backends, 1)
    policy = PrefixAffinity(AffinityConfig(index_blocks_per_backend=capacity))
    fill(policy, [b.name for b in bs], indexed)
    route = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(bs))
    gc.collect()
    samples = []
    for parsed in reqs:
        t = time.perf_counter()
        await policy.pick(bs, parsed, route)
        samples.append(time.perf_counter() - t)
    samples.sort()
    return {
        "backends": backends, "indexed": indexed, "index_len": len(policy.index),
        "median_us": statistics.median(samples) * 1e6, "p99_us": samples[int(len(samples) * 0.99)] * 1e6,
        "max_rss_mb": rss_mb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--profile", action="store_true", help="profile prefix_affinity's pick and stop")
    args = parser.parse_args()
    if args.profile:
        profile(args.requests)
        return
    compare(args.requests)
    print()
    reqs = requests(args.requests)
    print(f"{'backends':>8} {'indexed':>9} {'index len':>9} {'median µs':>10} {'p99 µs':>8} {'max RSS MB':>10}")
    for indexed in (10_000, 1_000_000):
        for backends in (4, 16, 64):
            r = asyncio.run(measure(backends, indexed, reqs))
            print(f"{r['backends']:>8} {r['indexed']:>9} {r['index_len']:>9} {r['median_us']:>10.1f} {r['p99_us']:>8.1f} {r['max_rss_mb']:>10.0f}")
    # boundedness: 3 M insertions into an index capped at 1 M entries
    bs = fleet(4)
    policy = PrefixAffinity(AffinityConfig(index_blocks_per_backend=250_000))
    fill(policy, [b.name for b in bs], 3_000_000)
    print(f"bounded: 3,000,000 blocks recorded into a 4 x 250,000 index -> {len(policy.index):,} entries, max RSS {rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
