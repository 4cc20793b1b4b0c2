"""Redis outage in the middle of an affinity run: no failed request, and the quality comes back.

Three proxies (`prefix_affinity`) share a private `redis-server` on a free port. The same workload
runs twice on fresh fleets: once with Redis up throughout, once with Redis killed (SIGKILL) after
the first third of the requests and started again, empty, after the second third. Per phase
(before / during / after the outage) it prints the fleet's prefix-cache hit rate from the
replicas' own counters, the pooled bound of the same requests (one LRU of the fleet's size
replaying the whole sequence), their ratio, and failed requests.

    python -m loadtest.affinity_outage                 # strong shape, 3000 requests, 3 proxies
    python -m loadtest.affinity_outage --shape weak --requests 1500
"""
from __future__ import annotations

import asyncio
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

from loadtest import affinity
from loadtest.affinity_bound import pooled_hit_rate, token_hit_rate
from loadtest.affinity_client import LoadResult, run_load
from loadtest.affinity_fleet import Fleet, SimSettings
from loadtest.private_redis import PrivateRedis
from loadtest.affinity_workload import Workload

PHASES = ("before", "outage", "after")


def run(workload: Workload, sizing: dict, args, outage: bool, tmp: Path) -> dict:
    spec = workload.spec
    n = len(workload.turns)
    marks = (n // 3, 2 * n // 3)
    redis = PrivateRedis()
    redis.start()
    sims = SimSettings(model=spec.model, num_gpu_blocks=sizing["blocks_per_replica"], block_size=args.block_size,
                       prefill_ms_per_token=args.prefill_ms_per_token, itl_ms=args.itl_ms,
                       time_scale=args.time_scale, max_num_seqs=args.max_num_seqs)
    out = LoadResult()
    snapshots: list[list[dict]] = []
    errors_at: list[int] = []
    try:
        with Fleet(Path(tempfile.mkdtemp(prefix=f"outage-{outage}-", dir=tmp))) as fleet:
            fleet.start_replicas(args.replicas, sims)
            fleet.start_proxies(args.proxies, "prefix_affinity", redis.url)
            snapshots.append(fleet.replica_counters())
            done = threading.Event()

            def watch() -> None:  # at each mark: counters, then the outage starts or ends
                for i, mark in enumerate(marks):
                    while len(out.sent_order) < mark and not done.is_set():
                        time.sleep(0.01)
                    if done.is_set():
                        return
                    snapshots.append(fleet.replica_counters())
                    errors_at.append(out.errors)
                    if outage:
                        redis.kill() if i == 0 else redis.start()

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            asyncio.run(run_load(workload, fleet.routers, args.concurrency, out=out))
            done.set()
            watcher.join()
            snapshots.append(fleet.replica_counters())
            errors_at.append(out.errors)
    finally:
        redis.stop()
    if len(snapshots) != 4:
        raise RuntimeError("the load ended before every phase mark was reached")
    bodies = [workload.turns[i].body(spec) for i in out.sent_order]
    bound = pooled_hit_rate(bodies, model=spec.model, block_size=args.block_size, num_blocks=sizing["fleet_blocks"])
    phases = []
    for p, name in enumerate(PHASES):
        hits = sum(b["hits"] - a["hits"] for a, b in zip(snapshots[p], snapshots[p + 1]))
        queries = sum(b["queries"] - a["queries"] for a, b in zip(snapshots[p], snapshots[p + 1]))
        lo, hi = (0, *marks, n)[p], (0, *marks, n)[p + 1]
        bound_rate = token_hit_rate(bound["per_request"][lo:hi])
        hit = hits / queries if queries else 0.0
        phases.append({"phase": name, "hit": hit, "bound": bound_rate, "share": hit / bound_rate if bound_rate else 0.0,
                       "errors": errors_at[p] - (errors_at[p - 1] if p else 0)})
    return {"outage": outage, "phases": phases, "errors": out.errors, "error_samples": out.error_samples}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = affinity.parse_args(argv)  # the affinity benchmark's knobs; --proxies: the last count given
    args.proxies = int(args.proxies.split(",")[-1]) if "--proxies" in argv else 3
    args.shape = args.shape.split(",")[0]
    if args.max_num_seqs is None:
        args.max_num_seqs = max(2, math.ceil(2 * args.concurrency / args.replicas))
    workload, sizing = affinity.build_shape(args.shape, args)
    print(f"shape {args.shape}: {len(workload.turns)} requests, {args.proxies} proxies sharing a private Redis; "
          f"outage: Redis SIGKILLed after request {len(workload.turns) // 3}, restarted empty after "
          f"{2 * len(workload.turns) // 3}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="affinity-outage-"))
    results = [run(workload, sizing, args, outage, tmp) for outage in (False, True)]
    print(f"\n{'run':<14}{'phase':<8}{'hit':>7}{'bound':>7}{'share':>7}{'failed':>8}")
    for r in results:
        for ph in r["phases"]:
            print(f"{'Redis outage' if r['outage'] else 'Redis up':<14}{ph['phase']:<8}{ph['hit']:>7.3f}"
                  f"{ph['bound']:>7.3f}{ph['share']:>7.3f}{ph['errors']:>8}")
    for r in results:
        if r["errors"]:
            print(f"! {r['errors']} failed requests ({'outage' if r['outage'] else 'no outage'}): {r['error_samples'][:2]}")
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
