"""Routing-quality benchmark: how much of the pooled prefix-cache bound a router reaches.

A multi-tenant chat workload (loadtest.affinity_workload) runs against N simulated vLLM
replicas whose prefix caches each hold only part of the tenants' system prompts, while the
fleet as a whole holds most of them. Per cell (shape x policy x router count) everything starts
cold, and we report the fleet's prefix-cache hit rate from the replicas' own counters, the
bound (one pooled LRU cache of the fleet's total size replaying the same sequence in send
order, loadtest.affinity_bound), the share of the bound reached, max/mean requests per replica,
client-side TTFT and errors.

    python -m loadtest.affinity                                  # 2 shapes x 3 policies x {1,3} proxies
    python -m loadtest.affinity --quick
    python -m loadtest.affinity --policies round_robin,sglang:cache_aware --proxies 1,3 --json out.json
    python -m loadtest.affinity --hetero --proxies 1     # one of four replicas half as fast (TTFT p99 matters)

Policies: our proxy's `routing.policy` values, optionally with knobs of the policy's YAML section
to compare variants side by side (`prefix_affinity+rebalance_every_requests=100+move_after_requests=100`; a
policy `python -m proxy check` rejects is skipped with its message), or `sglang:<policy>` /
`vllm-router:<policy>` for peer routers installed in --peers-venv, or a routing profile of
--profiles (JSON: name -> routing.profiles entry).

Heterogeneous fleet (`--slow-replicas 1 --slowdown 2`, or `--hetero` for that plus the
`cache_queue` profile below and a 0.5 s scrape of the replicas' /metrics): the last replica runs
at half speed (its sim's time scale doubled), which a request-count balance cannot see:
prefix_affinity reads it from the replicas' scraped decode time (proxy/routing/speed.py), the
queue_depth / kv_cache scorers (proxy/routing/scorers.py) from their queue and cache gauges.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loadtest.affinity_bound import pooled_hit_rate, token_hit_rate
from loadtest.affinity_client import run_load
from loadtest.affinity_fleet import (PEERS, Fleet, SimSettings, check_policy,
                                     peer_available)
from loadtest.affinity_workload import SHAPES, Workload, WorkloadSpec, generate, prompt_tokens, system_blocks


DEFAULT_POLICIES = "round_robin,least_loaded,prefix_affinity"
HETERO_PROFILE = "cache_queue"
PROFILES = {  # profiles the scenarios use (routing.profiles entries)
    HETERO_PROFILE: {"scorers": [{"type": "prefix_affinity", "weight": 3}, {"type": "queue_depth", "weight": 2},
                                 {"type": "kv_cache", "weight": 2}]},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.affinity", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--shape", default="strong,weak",
        help=f"comma list of {', '.join(SHAPES)} (tenants, skew, cache factor): "
        + "; ".join(f"{k}={v}" for k, v in SHAPES.items()))
    add("--tenants", type=int, help="override the shape's tenant count")
    add("--skew", type=float, help="override the shape's Zipf exponent of tenant popularity")
    add("--system-chars", type=int, default=4000, help="length of each tenant's system prompt")
    add("--user-chars", type=int, default=400, help="length of each user turn")
    add("--multi-turn", type=float, default=0.5, help="share of requests continuing an open conversation")
    add("--max-turns", type=int, default=6)
    add("--requests", type=int, default=3000)
    add("--concurrency", type=int, default=16)
    add("--max-tokens", type=int, default=8)
    add("--seed", type=int, default=0)
    add("--policies", default=DEFAULT_POLICIES)
    add("--proxies", default="1,3", help="router instances per cell (comma list)")
    add("--replicas", type=int, default=4)
    add("--fleet-cache-factor", type=float,
        help="fleet prefix-cache blocks / all tenants' system-prompt blocks (default: the shape's)")
    add("--num-gpu-blocks", type=int, help="per-replica cache blocks (default: from --fleet-cache-factor)")
    add("--block-size", type=int, default=16)
    add("--prefill-ms-per-token", type=float, default=0.05)
    add("--itl-ms", type=float, default=10.0)
    add("--time-scale", type=float, default=1.0)
    add("--max-num-seqs", type=int, help="per-replica batch limit (default: 2 x concurrency / replicas), so "
        "piling load on one replica costs queueing")
    add("--redis", default="", help="Redis DB shared by proxy instances, FLUSHED per cell (opt-in: someone's "
        "data may live there); default: a private redis-server per cell on a free port")
    add("--peers-venv", default="/tmp/peers-venv")
    add("--slow-replicas", type=int, default=0, help="this many replicas (the last ones) run --slowdown times slower")
    add("--slowdown", type=float, default=2.0)
    add("--profiles", default="", help="routing profiles as JSON (name -> routing.profiles entry), or @file")
    add("--scrape-interval", type=float, help="the proxies' discovery.interval_s (also their /metrics scrape)")
    add("--hetero", action="store_true", help="the heterogeneous-fleet scenario: --slow-replicas 1 --slowdown 2, "
        f"--scrape-interval 0.5, policies round_robin,least_loaded,prefix_affinity,{HETERO_PROFILE}")
    add("--quick", action="store_true", help="600 requests per cell")
    add("--json", help="write all results to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 600)
    text = args.profiles
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    args.profiles = json.loads(text) if text else {}
    if args.hetero:
        args.slow_replicas = args.slow_replicas or 1
        args.scrape_interval = args.scrape_interval or 0.5
        args.profiles = {HETERO_PROFILE: PROFILES[HETERO_PROFILE], **args.profiles}
        if args.policies == DEFAULT_POLICIES:
            args.policies += "," + HETERO_PROFILE
    return args


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def build_shape(name: str, args: argparse.Namespace) -> tuple[Workload, dict]:
    """The shape's workload and a fleet cache sized from it."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    tenants, skew, factor = SHAPES[name]
    factor = args.fleet_cache_factor or factor
    spec = WorkloadSpec(tenants=args.tenants or tenants, skew=args.skew if args.skew is not None else skew,
                        system_chars=args.system_chars, user_chars=args.user_chars, multi_turn=args.multi_turn,
                        max_turns=args.max_turns, requests=args.requests, max_tokens=args.max_tokens, seed=args.seed)
    workload = generate(spec)
    blocks = system_blocks(workload, args.block_size)
    total = sum(blocks)
    per_replica = args.num_gpu_blocks or math.ceil(factor * total / args.replicas)
    tokens = prompt_tokens(workload)
    sizing = {"tenants": spec.tenants, "skew": spec.skew, "fleet_cache_factor": factor,
              "system_blocks_per_tenant": round(total / spec.tenants, 1),
              "system_blocks_total": total, "blocks_per_replica": per_replica,
              "fleet_blocks": per_replica * args.replicas,
              "tenants_per_replica": round(per_replica / (total / spec.tenants), 1),
              "continuation_share": round(workload.continuation_share, 3),
              "prompt_tokens_mean": round(statistics.mean(tokens)), "prompt_tokens_max": max(tokens),
              "top_tenant_share": round(max(workload.per_tenant) / spec.requests, 3)}
    if per_replica >= total:
        print(f"warning: shape {name}: one replica ({per_replica} blocks) holds every tenant's system prompt "
              f"({total} blocks); routing cannot matter much", file=sys.stderr)
    return workload, sizing


def usable_policies(args: argparse.Namespace, tmp: Path) -> list[str]:
    usable = []
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        peer, _, _ = policy.partition(":")
        if peer in PEERS:
            why = peer_available(peer, args.peers_venv)
        else:
            why = check_policy(policy, tmp, args.redis or "redis://127.0.0.1:1/0", args.profiles)
        if why:
            print(f"[skip] policy {policy}: {why.splitlines()[-1] if why else ''}", file=sys.stderr)
        else:
            usable.append(policy)
    return usable


def run_cell(shape: str, workload: Workload, sizing: dict, policy: str, routers: int,
             args: argparse.Namespace, tmp: Path) -> dict:
    spec = workload.spec
    sims = SimSettings(model=spec.model, num_gpu_blocks=sizing["blocks_per_replica"], block_size=args.block_size,
                       prefill_ms_per_token=args.prefill_ms_per_token, itl_ms=args.itl_ms,
                       time_scale=args.time_scale, max_num_seqs=args.max_num_seqs)
    cell_dir = Path(tempfile.mkdtemp(prefix=f"{shape}-{policy.replace(':', '_')}-{routers}-", dir=tmp))
    with Fleet(cell_dir) as fleet:
        slow = {args.replicas - 1 - k: args.slowdown for k in range(args.slow_replicas)}
        fleet.start_replicas(args.replicas, sims, slow)
        peer, _, peer_policy = policy.partition(":")
        if peer in PEERS:
            fleet.start_peers(routers, peer, peer_policy, args.peers_venv)
        else:
            extra = f"discovery: {{interval_s: {args.scrape_interval}}}\n" if args.scrape_interval else ""
            fleet.start_proxies(routers, policy, fleet.redis_url(args.redis), extra=extra, profiles=args.profiles)
        before = fleet.replica_counters()
        load = asyncio.run(run_load(workload, fleet.routers, args.concurrency))
        after = fleet.replica_counters()
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    hits, queries = sum(d["hits"] for d in delta), sum(d["queries"] for d in delta)
    if (hits, queries) != (sum(d["stats_hits"] for d in delta), sum(d["stats_queries"] for d in delta)):
        print(f"warning: {shape} {policy} x{routers}: /metrics and /sim/stats prefix counters disagree",
              file=sys.stderr)
    requests = [d["requests"] for d in delta]
    bodies = [workload.turns[i].body(spec) for i in load.sent_order]
    bound = pooled_hit_rate(bodies, model=spec.model, block_size=args.block_size, num_blocks=sizing["fleet_blocks"])
    hit_rate = hits / queries if queries else 0.0
    mean = statistics.mean(requests) if requests else 0.0
    quarters = quarter_shares(load.sent_order, load.cached, bound["per_request"])
    return {
        "shape": shape, "policy": policy, "routers": routers, "hit_rate": hit_rate, "bound": bound["hit_rate"],
        "share_of_bound": hit_rate / bound["hit_rate"] if bound["hit_rate"] else float("nan"),
        "requests_per_replica": requests, "max_over_mean": max(requests) / mean if mean else float("nan"),
        "ttft_p50_ms": percentile(load.ttft, 0.5) * 1000, "ttft_p99_ms": percentile(load.ttft, 0.99) * 1000,
        "wall_s": load.wall_s, "errors": load.errors, "error_samples": load.error_samples,
        "reply_mismatches": load.reply_mismatches, "routes": load.routes,
        "evictions": sum(d["evictions"] for d in delta), "bound_evictions": bound["evictions"],
        "sent": len(load.sent_order), "quarter_shares": quarters,
        "trace": [(i, *load.served.get(i, ("", "")), *load.cached.get(i, (0, 0)), *bound["per_request"][k],
                   load.ttft_of.get(i)) for k, i in enumerate(load.sent_order)],
    }


def quarter_shares(sent_order: list[int], cached: dict[int, tuple[int, int]],
                   pooled: list[tuple[int, int]], parts: int = 4) -> list[float]:
    """Share of the bound in each quarter of the run (by send order), from the cached-token counts
    the replicas report per request (usage.prompt_tokens_details): warm-up against steady state."""
    n = len(sent_order)
    shares = []
    for p in range(parts):
        lo, hi = p * n // parts, (p + 1) * n // parts
        hit = token_hit_rate(cached.get(sent_order[k], (0, 0)) for k in range(lo, hi))
        best = token_hit_rate(pooled[lo:hi])
        shares.append(hit / best if best else float("nan"))
    return shares


def print_table(cells: list[dict]) -> None:
    head = (f"{'shape':<7}{'policy':<28}{'rt':>3}{'hit':>7}{'bound':>7}{'share':>7}{'max/mean':>9}"
            f"{'ttft50':>8}{'ttft99':>8}{'wall_s':>7}{'err':>5}")
    print(head)
    print("-" * len(head))
    for c in cells:
        print(f"{c['shape']:<7}{c['policy']:<28}{c['routers']:>3}{c['hit_rate']:>7.3f}{c['bound']:>7.3f}"
              f"{c['share_of_bound']:>7.3f}{c['max_over_mean']:>9.2f}{c['ttft_p50_ms']:>8.1f}{c['ttft_p99_ms']:>8.1f}"
              f"{c['wall_s']:>7.1f}{c['errors']:>5}")
    print("(hit: fleet prefix-cache hit rate from replica counters; bound: pooled LRU of the fleet's size; "
          "ttft in ms, client side)")
    base = {(c["shape"], c["routers"]): c for c in cells if c["policy"] == "round_robin"}
    lines = []
    for c in cells:
        b = base.get((c["shape"], c["routers"]))
        if b is None or c is b:
            continue
        lines.append(f"  {c['shape']:<7}{c['policy']:<28} x{c['routers']}: share {c['share_of_bound']:.3f} vs "
                     f"{b['share_of_bound']:.3f} round robin ({c['share_of_bound'] / b['share_of_bound']:.2f}x), "
                     f"TTFT p50 {c['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x")
    one = {(c["shape"], c["policy"]): c for c in cells if c["routers"] == 1}
    for c in cells:
        o = one.get((c["shape"], c["policy"]))
        if c["routers"] > 1 and o is not None:
            lines.append(f"  {c['shape']:<7}{c['policy']:<28} x{c['routers']} vs x1: share "
                         f"{c['share_of_bound'] / o['share_of_bound']:.2f}x, max/mean {c['max_over_mean']:.2f} vs "
                         f"{o['max_over_mean']:.2f}")
    if lines:
        print("ratios:")
        print("\n".join(lines))
    for c in cells:
        if c["errors"] or c["reply_mismatches"]:
            print(f"  ! {c['shape']} {c['policy']} x{c['routers']}: {c['errors']} errors "
                  f"{c['error_samples'][:2]}, {c['reply_mismatches']} replies differ from the sim's expected text")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(2, math.ceil(2 * args.concurrency / args.replicas))
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="affinity-"))
    policies = usable_policies(args, tmp)
    counts = [int(x) for x in args.proxies.split(",") if x.strip()]
    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    print(f"fleet: {args.replicas} replicas, block {args.block_size}, prefill {args.prefill_ms_per_token} ms/token, "
          f"itl {args.itl_ms} ms, time scale {args.time_scale}, max-num-seqs {args.max_num_seqs}"
          + (f", {args.slow_replicas} replica(s) {args.slowdown}x slower" if args.slow_replicas else "") + "; "
          f"load: {args.requests} requests, concurrency {args.concurrency}, max_tokens {args.max_tokens}; logs {tmp}")
    cells, sizings = [], {}
    for shape in shapes:
        workload, sizing = build_shape(shape, args)
        sizings[shape] = sizing
        print(f"shape {shape}: " + ", ".join(f"{k} {v}" for k, v in sizing.items()), flush=True)
        for policy in policies:
            for routers in counts:
                try:
                    cell = run_cell(shape, workload, sizing, policy, routers, args, tmp)
                except Exception as exc:  # noqa: BLE001 - report the cell and go on
                    print(f"[fail] {shape} {policy} x{routers}: {exc}", file=sys.stderr)
                    continue
                cells.append(cell)
                print(f"  {policy} x{routers}: hit {cell['hit_rate']:.3f} / bound {cell['bound']:.3f} = "
                      f"{cell['share_of_bound']:.3f}, max/mean {cell['max_over_mean']:.2f}, "
                      f"TTFT p50 {cell['ttft_p50_ms']:.1f} ms, {cell['wall_s']:.1f} s, {cell['errors']} errors; "
                      f"share by quarter {' '.join(f'{q:.3f}' for q in cell['quarter_shares'])}",
                      flush=True)
    print()
    print_table(cells)
    total = time.perf_counter() - started
    print(f"total run time {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "sizing": sizings, "cells": cells,
                                               "run_time_s": total}, indent=1))
    return 1 if any(c["errors"] for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
