"""What a fixed tenant layout could reach: an upper bound for any router on a workload shape.

Given which replicas hold each tenant, every request goes where a static router would send it
(a continuation to its conversation's replica, a new conversation to the tenant's least-used
replica), and each replica's request sequence is replayed through the sim's own cache (of one
replica's size); the result is compared with the pooled bound (one cache of the fleet's size).
No timing, no concurrency: the best case for that layout.

    python -m loadtest.affinity_layouts "0,7,10|0,6,11|1,4,8|2,3,5,9"   # tenants per replica
    python -m loadtest.affinity_layouts --shape tight "0,7,10|0,6,11|1,4,8|2,3,5,9"

A tenant listed on several replicas is split over them. Takes the knobs of loadtest.affinity.
"""
from __future__ import annotations

import sys

from loadtest import affinity
from loadtest.affinity_bound import pooled_hit_rate


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[-1].startswith("-"):
        raise SystemExit(__doc__)
    layout = [[int(t) for t in group.split(",") if t] for group in argv.pop().split("|")]
    args = affinity.parse_args(argv + ["--replicas", str(len(layout))])
    workload, sizing = affinity.build_shape(args.shape.split(",")[0], args)
    spec = workload.spec
    homes: dict[int, list[int]] = {}
    for replica, tenants in enumerate(layout):
        for tenant in tenants:
            homes.setdefault(tenant, []).append(replica)
    missing = set(range(spec.tenants)) - set(homes)
    if missing:
        raise SystemExit(f"tenants without a replica: {sorted(missing)}")
    served: list[int] = []
    counts = [0] * len(layout)
    for turn in workload.turns:  # sent in index order: a continuation always follows its turn
        replica = served[turn.after] if turn.after is not None else min(homes[turn.tenant], key=counts.__getitem__)
        served.append(replica)
        counts[replica] += 1
    bodies = [t.body(spec) for t in workload.turns]
    model, block = spec.model, args.block_size
    pooled = pooled_hit_rate(bodies, model=model, block_size=block, num_blocks=sizing["fleet_blocks"])["hit_rate"]
    hits = queries = 0
    for replica, tenants in enumerate(layout):
        mine = [b for b, r in zip(bodies, served) if r == replica]
        result = pooled_hit_rate(mine, model=model, block_size=block, num_blocks=sizing["blocks_per_replica"])
        hits, queries = hits + result["hits"], queries + result["queries"]
        print(f"  replica {replica}: tenants {tenants}, {len(mine)} requests, hit {result['hit_rate']:.3f}")
    hit = hits / queries if queries else 0.0
    mean = sum(counts) / len(counts)
    print(f"layout hit {hit:.3f}, pooled bound {pooled:.3f}, share {hit / pooled:.3f}, max/mean {max(counts) / mean:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
