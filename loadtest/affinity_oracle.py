"""What fixed layouts reach on one phase of the drift benchmark, knowing the phase in advance.

For a phase of `loadtest.affinity_drift` (fresh caches, so compare with a fresh start of the
policy: `--phases NAME`), every request goes where a static layout sends its tenant, and each
replica's requests are replayed through the sim's own cache:

    striped   tenant of popularity rank k on replica k mod n (ignores load)
    hashed    each tenant on a random replica (ignores load and room)
    balanced  the phase's tenants, heaviest first, each on the replica with the least traffic among
              those with the fewest tenants (its real request counts: an oracle)

`balanced` is the target a router that keeps load even can aim at: equal prompts per cache and
equal traffic. On caches that hold a fifth of a population's prompts (60-90 tenants) it kept
0.98-1.00 of the pooled bound at max/mean 1.01-1.02, where prefix_affinity kept 0.92-0.95
(docs/BENCHMARKS.md).

    python -m loadtest.affinity_oracle --sequence random --seeds 16 --phases p4-new
"""
from __future__ import annotations

import asyncio
import random
import sys
from collections import Counter
from typing import Callable

from loadtest.affinity_bound import token_hit_rate
from loadtest.affinity_drift import Caches, blocks_per_replica, parse_args, pooled, workloads
from loadtest.affinity_replay import seeds


def layouts(tenants: Counter, n: int) -> dict[str, Callable[[int], int]]:
    """name -> tenant -> replica; `tenants`: the phase's requests per tenant."""
    heaviest = sorted(tenants, key=lambda t: (-tenants[t], t))
    most = -(-len(heaviest) // n)
    load, held, balanced = [0] * n, [0] * n, {}
    for t in heaviest:
        i = min((i for i in range(n) if held[i] < most), key=load.__getitem__)
        balanced[t], load[i], held[i] = i, load[i] + tenants[t], held[i] + 1
    return {"striped": lambda t: t % n, "hashed": lambda t: random.Random(t).randrange(n),
            "balanced": balanced.__getitem__}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(["--offline", *(sys.argv[1:] if argv is None else argv)])
    for seed in seeds(args.seeds):
        for ph, workload in workloads(args, seed):
            n = len(ph.replicas)
            bound = token_hit_rate(pooled([(ph, workload, list(range(len(workload.turns))))], args)[0])
            for name, home in layouts(Counter(t.tenant for t in workload.turns), n).items():
                caches = Caches(workload.spec.model, args.block_size)
                for i in range(n):
                    caches.reset(i, blocks_per_replica(args))

                async def replay() -> list[tuple[int, int]]:
                    return [await caches.feed(home(turn.tenant), turn.body(workload.spec)) for turn in workload.turns]

                hits = asyncio.run(replay())
                per = Counter(home(turn.tenant) for turn in workload.turns)
                counts = [per[i] for i in range(n)]
                hit = token_hit_rate(hits)
                print(f"seed {seed} {ph.name:<9} {name:<9} hit {hit:.3f} bound {bound:.3f} share {hit / bound:.3f} "
                      f"max/mean {max(counts) * n / sum(counts):.2f}  {counts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
