"""The routing-quality benchmark without timing: prefix_affinity's own code on a simulated clock.

    python -m loadtest.affinity_replay --shape strong --seeds 0-7 [--requests 3000] [--knobs '{"epsilon": 0.2}']

Each request of the workload goes, in index order, through `PrefixAffinity.pick` (one proxy, no
Redis) on a clock advancing `--rate` requests a second, with a closed loop of `--concurrency`
requests in flight; the packing repair runs to completion where it starts. Each replica's request
sequence is then replayed through the sim's cache (one replica's size), as the pooled bound is.
Deterministic and ~1 s per 3000-request seed, so a policy change can be compared over many seeds
in the time one live cell takes (`python -m loadtest.affinity`). It leaves out what timing does:
concurrent requests holding cache blocks (live shares run ~0.005 below this replay), Redis, several
proxies.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections import Counter, deque

import orjson

from loadtest import affinity
from loadtest.affinity_bound import pooled_hit_rate, token_hit_rate
from proxy.config import AffinityConfig, BackendConfig
from proxy.parse import CHAT, parse_request
from proxy.routing.affinity import PrefixAffinity
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route


_COLD = 800  # uncached tokens that make a request a cold prompt (the workloads' system prompts are longer)


class SimulatedClock:
    """Stands in for the `time` module the policy reads (time() and monotonic()): its `timer`."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def replay(shape: str, seed: int, requests: int, knobs: dict, rate: float, concurrency: int,
           slow: int = 0, slowdown: float = 2.0, known_after: int = 200) -> dict:
    args = affinity.parse_args(["--shape", shape, "--seed", str(seed), "--requests", str(requests)])
    workload, sizing = affinity.build_shape(shape, args)
    backends = []
    for i in range(args.replicas):
        backend = Backend(BackendConfig(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}"))
        backend.healthy, backend.cache_tokens = True, sizing["blocks_per_replica"] * args.block_size
        backends.append(backend)
    route = Route(name=workload.spec.model, model=workload.spec.model, adapter=None, backends=tuple(backends))
    clock = SimulatedClock()
    # (no exchange runs here to release a coalescing leader: requests are routed, never sent)
    policy = PrefixAffinity(AffinityConfig(**{"coalesce_wait_s": 0.0, **knobs}), timer=clock)
    served: list[int] = []
    reasons: list[str] = []
    in_flight: deque[Backend] = deque()

    async def route_all() -> None:
        start = clock.now
        for i, turn in enumerate(workload.turns):
            clock.now = start + i / rate
            if slow and i == known_after:  # the scrape has seen the slow replicas' decode times
                for backend in backends[len(backends) - slow:]:
                    backend.load_factor = slowdown
                Backend.speed_version += 1
            if len(in_flight) >= concurrency:
                in_flight.popleft().in_flight -= 1
            request = parse_request(CHAT, orjson.dumps(turn.body(workload.spec)))
            backend, reason = await policy.pick(backends, request, route)
            await policy.maintain()  # the packing repair runs to completion where it starts
            backend.in_flight += 1
            in_flight.append(backend)
            served.append(backends.index(backend))
            reasons.append(reason)

    try:
        asyncio.run(route_all())
    finally:
        for backend in backends:
            backend.load_factor = 1.0
        Backend.speed_version += 1
    bodies = [t.body(workload.spec) for t in workload.turns]
    model, block = workload.spec.model, args.block_size
    bound = pooled_hit_rate(bodies, model=model, block_size=block, num_blocks=sizing["fleet_blocks"])["per_request"]
    mine: list[tuple[int, int]] = [(0, 0)] * len(bodies)
    for r in range(len(backends)):
        idx = [i for i, s in enumerate(served) if s == r]
        result = pooled_hit_rate([bodies[i] for i in idx], model=model, block_size=block,
                                 num_blocks=sizing["blocks_per_replica"])
        for i, pair in zip(idx, result["per_request"]):
            mine[i] = pair

    def share(lo: int, hi: int) -> float:
        return token_hit_rate(mine[lo:hi]) / max(token_hit_rate(bound[lo:hi]), 1e-9)

    n = len(bodies)
    counts = Counter(served)
    # the prefill each request needs where it went, in tokens of a fast replica's time: what the
    # TTFT tail of a heterogeneous fleet is made of (a cold prompt on the slow replica), queues aside
    factor = [slowdown if r >= len(backends) - slow else 1.0 for r in range(len(backends))]
    work = sorted((q - h) * factor[served[i]] for i, (h, q) in enumerate(mine))
    cold_slow = sum(1 for i, (h, q) in enumerate(mine) if factor[served[i]] > 1 and q - h > _COLD)
    # the hits the fleet lost against the bound (net of those it gained), by the pick's reason
    lost: Counter = Counter()
    for i, reason in enumerate(reasons):
        lost[reason] += bound[i][0] - mine[i][0]
    return {"seed": seed, "share": share(0, n), "lost": lost, "bound_hits": sum(h for h, _ in bound),
            "reasons": Counter(reasons), "quarters": [share(k * n // 4, (k + 1) * n // 4) for k in range(4)],
            "max_over_mean": max(counts.values()) * len(backends) / n,
            "prefill_p99": work[min(n - 1, int(0.99 * n))], "cold_slow": cold_slow}


def seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if hi else [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.affinity_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="strong")
    p.add_argument("--seeds", default="0-7", help="a range (0-7) or a comma list")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--knobs", default="{}", help="routing.prefix_affinity settings as JSON")
    p.add_argument("--rate", type=float, default=160.0, help="requests a second on the simulated clock")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--slow-replicas", type=int, default=0, help="the last this many replicas decode --slowdown "
                   "times slower (their load factor, as the scrape would set it, from --known-after requests on)")
    p.add_argument("--slowdown", type=float, default=2.0)
    p.add_argument("--known-after", type=int, default=200)
    p.add_argument("--by-reason", action="store_true", help="also print the hits lost against the bound (net, "
                   "in parts of the bound's hits) by the reason of each request's pick")
    args = p.parse_args(argv)
    results = []
    for seed in seeds(args.seeds):
        r = replay(args.shape, seed, args.requests, json.loads(args.knobs), args.rate, args.concurrency,
                   args.slow_replicas, args.slowdown, args.known_after)
        results.append(r)
        print(f"seed {seed}: share {r['share']:.3f}, by quarter {' '.join(f'{q:.3f}' for q in r['quarters'])}, "
              f"max/mean {r['max_over_mean']:.2f}, prefill p99 {r['prefill_p99']:.0f} tok"
              + (f", cold on slow {r['cold_slow']}" if args.slow_replicas else ""), flush=True)
    shares = [r["share"] for r in results]
    print(f"{args.shape}: mean share {statistics.mean(shares):.4f}, min {min(shares):.3f}, "
          f"worst max/mean {max(r['max_over_mean'] for r in results):.2f} over {len(results)} seeds")
    if args.by_reason:
        lost, picks, hits = Counter(), Counter(), sum(r["bound_hits"] for r in results)
        for r in results:
            lost.update(r["lost"])
            picks.update(r["reasons"])
        for reason, tokens in lost.most_common():
            print(f"  {reason:12s} {picks[reason]:7d} picks, lost {tokens / max(hits, 1):.4f} of the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
