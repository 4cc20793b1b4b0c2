"""Instructions per routing decision (valgrind callgrind): what a policy's `pick` costs, per
workload and replica count, without the server around it (no sockets, no event-loop turns, no
wall-clock tasks), so counts repeat to a few hundred instructions: the measure for A/B work on
the policy itself (loadtest.instructions measures whole requests). Each `--refs` entry runs the
same picks on the `proxy` package of that git commit ('.' = the working tree).

    python -m loadtest.pick_cost --refs .,HEAD~3
    python -m loadtest.pick_cost --policies prefix_affinity+mirror --workloads long --replicas 4

Workloads: `wrk` (the overhead benchmark's body: a short system prompt and one question, every
request alike), `tenants` (200 tenants with ~2 KB system prompts, in turn), `long` (600 distinct
conversations of ~15 KB: most of their blocks hashed and indexed per request). Policies as in
loadtest.routing_decision: least_loaded, prefix_affinity, prefix_affinity+mirror (with the
shared-state mirror a Redis-backed proxy reads). A run counts the instructions of a process that
makes `--warmup` picks, then `--picks` more, minus those of one that stops after the warm-up.

`--cold KEYS` measures wall time instead (no valgrind): microseconds per pick when `KEYS` dict
entries (a comma list, ~60 bytes each) are walked between picks, as the rest of a request cycle and
the processes sharing the core evict the policy's code and state from the CPU caches. In the
proxy under load a pick costs what it costs here at 10-20k keys, not what it costs at 0:

    python -m loadtest.pick_cost --cold 0,2000,20000,100000 --policies least_loaded,prefix_affinity
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("wrk", "tenants", "long")


def workload(kind: str, count: int) -> list:
    """`count` parsed requests of one workload (cycling over its distinct ones)."""
    import orjson

    from loadtest.instructions import WRK_CHAT
    from loadtest.routing_decision import MODEL, requests
    from proxy.parse import CHAT, parse_request

    if kind == "wrk":
        return [parse_request(CHAT, orjson.dumps({**WRK_CHAT, "model": MODEL}))] * count
    if kind == "tenants":
        distinct = requests(600)
    else:
        system = "You are a careful assistant. " * 70
        distinct = []
        for i in range(600):
            turns = [{"role": "system", "content": system}]
            turns += [{"role": "user" if t % 2 == 0 else "assistant",
                       "content": f"turn {t} of conversation {i}: " + "words and more words " * 50} for t in range(12)]
            distinct.append(parse_request(CHAT, orjson.dumps({"model": MODEL, "messages": turns})))
    return [distinct[i % len(distinct)] for i in range(count)]


def child(policy_name: str, kind: str, replicas: int, warmup: int, picks: int) -> None:
    """The measured process: `warmup` picks, then `picks` more (the part the parent counts)."""
    from loadtest.routing_decision import MODEL, fleet, make
    from proxy.routing.catalog import Route

    policy = make(policy_name, replicas)
    route = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(fleet(replicas)))
    reqs = workload(kind, warmup + picks)
    shared = getattr(policy, "shared", None)

    async def run(batch: list) -> None:
        for parsed in batch:
            await policy.pick(route.backends, parsed, route)  # (the route's own tuple, as the scheduler passes)
            if shared is not None:  # what the flusher would have sent
                shared._ops.clear()
                shared._pending.clear()

    asyncio.run(run(reqs[:warmup]))
    if picks:
        asyncio.run(run(reqs[warmup:]))


def cold(policy_name: str, kind: str, replicas: int, warmup: int, picks: int, keys: int) -> float:
    """Median microseconds per pick (over batches of 100) with `keys` dict entries walked before each pick."""
    import statistics
    import time

    from loadtest.routing_decision import MODEL, fleet, make
    from proxy.routing.catalog import Route

    policy = make(policy_name, replicas)
    route = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(fleet(replicas)))
    reqs = workload(kind, warmup + picks)
    shared = getattr(policy, "shared", None)
    junk = [dict.fromkeys(range(i, i + 50)) for i in range(0, keys, 50)]

    async def run(batch: list) -> list[float]:
        spent, samples, clock = 0.0, [], time.perf_counter
        for i, parsed in enumerate(batch, 1):
            for d in junk:
                for _ in d:
                    pass
            t = clock()
            await policy.pick(route.backends, parsed, route)
            spent += clock() - t
            if shared is not None:
                shared._ops.clear()
                shared._pending.clear()
            if i % 100 == 0:
                samples.append(spent / 100 * 1e6)
                spent = 0.0
        return samples

    asyncio.run(run(reqs[:warmup]))
    return statistics.median(asyncio.run(run(reqs[warmup:])))


def tree(ref: str, tmp: Path) -> Path:
    if ref == ".":
        return ROOT
    out = tmp / ref.replace("/", "_")
    if not out.exists():
        out.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "proxy"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def counted(code: Path, args: list[str]) -> int:
    """Instructions of one child run under callgrind, with `proxy` imported from `code`."""
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT}", "PYTHONHASHSEED": "0"}
    run = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                          "-m", "loadtest.pick_cost", "--child", *args], cwd=code, env=env, capture_output=True, text=True)
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode or not found:
        raise RuntimeError(f"child failed ({run.returncode}): {run.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refs", default=".", help="comma list of git commits ('.' = working tree)")
    ap.add_argument("--policies", default="least_loaded,prefix_affinity+mirror")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--replicas", default="1,4", help="comma list of replica counts")
    ap.add_argument("--picks", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=3000)
    ap.add_argument("--cold", help="comma list of dict entries walked between picks: wall time, not instructions")
    ap.add_argument("--child", nargs=3, metavar=("POLICY", "WORKLOAD", "REPLICAS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        policy, kind, replicas = args.child
        child(policy, kind, int(replicas), args.warmup, args.picks)
        return
    if args.cold is not None:
        sizes = [int(k) for k in args.cold.split(",")]
        print(f"microseconds per pick (median of batches of 100; {args.picks} picks after {args.warmup}), "
              "by dict entries walked between picks")
        print(f"| {'policy':24} | {'workload':8} | {'replicas':8} | " + " | ".join(f"{k:>8}" for k in sizes) + " |")
        for policy in args.policies.split(","):
            for kind in args.workloads.split(","):
                for replicas in args.replicas.split(","):
                    cells = [cold(policy, kind, int(replicas), args.warmup, args.picks, k) for k in sizes]
                    print(f"| {policy:24} | {kind:8} | {replicas:>8} | " + " | ".join(f"{c:>8.2f}" for c in cells)
                          + " |", flush=True)
        return
    if not shutil.which("valgrind"):
        sys.exit("valgrind is missing: apt-get install -y valgrind")
    refs = [r.strip() for r in args.refs.split(",") if r.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="pick-cost-"))
    print(f"instructions per pick ({args.picks} picks after {args.warmup})")
    print(f"| {'policy':24} | {'workload':8} | {'replicas':8} | " + " | ".join(f"{r:>10}" for r in refs) + " |")
    for policy in args.policies.split(","):
        for kind in args.workloads.split(","):
            for replicas in args.replicas.split(","):
                cells = []
                for ref in refs:
                    code = tree(ref, tmp)
                    common = [policy, kind, replicas, "--warmup", str(args.warmup)]
                    base = counted(code, common + ["--picks", "0"])
                    cells.append((counted(code, common + ["--picks", str(args.picks)]) - base) / args.picks)
                print(f"| {policy:24} | {kind:8} | {replicas:>8} | " + " | ".join(f"{c:>10,.0f}" for c in cells) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
