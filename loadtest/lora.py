"""LoRA placement benchmark: many adapters with skewed popularity over replicas with --max-loras 2.

Every mode runs on a fresh fleet of simulated replicas with the same flags (--max-loras, the
resident set --max-cpu-loras, --lora-load-ms), a closed loop of streaming chat requests whose
adapter is drawn from a Zipf distribution, and reports throughput, client TTFT p50/p99, the
adapter loads/unloads the proxy made (/v1/load_lora_adapter) and the replicas' own reloads
(an adapter outside the resident set paid --lora-load-ms at schedule time), per minute, plus
requests that reached a replica without their adapter (must be 0).

Modes:
  round_robin   baseline: every adapter registered on every replica at start (--lora-modules),
                since round robin may send any adapter anywhere; the replicas' resident-set LRU
                then reloads adapters as the mix churns (what vLLM does with --max-cpu-loras).
  least_loaded  same fleet, fewest in-flight requests.
  lora_aware    cold fleet; deployments give adapter_path; the proxy loads adapters on demand,
                at most --max-adapters per replica (LRU eviction), replicates hot ones,
                prefix_affinity among the replicas holding the adapter.

    python -m loadtest.lora                       # 20 adapters, 4 replicas, 30 s per mode
    python -m loadtest.lora --duration 60 --concurrency 48 --modes round_robin,lora_aware
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.lora", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--modes", default="round_robin,least_loaded,lora_aware")
    add("--adapters", type=int, default=20)
    add("--skew", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    add("--replicas", type=int, default=4)
    add("--max-loras", type=int, default=2)
    add("--max-cpu-loras", type=int, default=4, help="replica resident set (the rest reload on use)")
    add("--max-adapters", type=int, default=4, help="lora_aware: lora.max_adapters_per_replica")
    add("--lora-load-ms", type=float, default=400.0, help="simulated adapter load time (before time scale)")
    add("--itl-ms", type=float, default=25.0)
    add("--prefill-ms-per-token", type=float, default=0.1)
    add("--max-num-seqs", type=int, default=32)
    add("--time-scale", type=float, default=0.2, help="multiplies every simulated delay")
    add("--concurrency", type=int, default=32)
    add("--max-tokens", type=int, default=32)
    add("--duration", type=float, default=30.0, help="seconds of load per mode")
    add("--seed", type=int, default=0)
    add("--json", help="write the results here")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


class Fleet:
    """Child processes in their own sessions, stopped by their process group at exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, args: list[str], ready_url: str) -> None:
        log = open(self.tmp / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "proxy", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited:\n{(self.tmp / f'{name}.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(ready_url, timeout=1).read()
                return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError(f"{name} did not become ready")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                except ProcessLookupError:
                    pass


def adapter_names(n: int) -> list[str]:
    return [f"lora-{i:02d}" for i in range(n)]


def start_cell(args: argparse.Namespace, mode: str, fleet: Fleet) -> tuple[str, list[str]]:
    names = adapter_names(args.adapters)
    sims = []
    for i in range(args.replicas):
        port = free_port()
        cmd = ["sim", "--port", str(port), "--model", MODEL, "--max-loras", str(args.max_loras),
               "--max-cpu-loras", str(args.max_cpu_loras), "--lora-load-ms", str(args.lora_load_ms),
               "--itl-ms", str(args.itl_ms), "--prefill-ms-per-token", str(args.prefill_ms_per_token),
               "--max-num-seqs", str(args.max_num_seqs), "--time-scale", str(args.time_scale), "--seed", str(i)]
        if mode != "lora_aware":
            cmd += ["--lora-modules", *(f"{n}=/adapters/{n}" for n in names)]
        fleet.spawn(f"sim-{i}", cmd, f"http://{HOST}:{port}/health")
        sims.append(f"http://{HOST}:{port}")
    port = free_port()
    config: dict = {
        "server": {"host": HOST, "port": port},
        "backends": [{"name": f"gpu-{i}", "url": url} for i, url in enumerate(sims)],
        "deployments": [{"name": "llama", "model": MODEL}],
        "discovery": {"interval_s": 2.0},
    }
    if mode == "lora_aware":
        config["routing"] = {"policy": "prefix_affinity"}
        config["lora"] = {"max_adapters_per_replica": args.max_adapters}
        config["deployments"] += [{"name": n, "model": MODEL, "adapter": n, "adapter_path": f"/adapters/{n}"}
                                  for n in names]
    else:
        config["routing"] = {"policy": mode}
        config["deployments"] += [{"name": n, "model": MODEL, "adapter": n} for n in names]
    from proxy.config import ProxyConfig

    if "logging" in ProxyConfig.model_fields:
        config["logging"] = {"access_log": False}
    path = fleet.tmp / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(config))
    fleet.spawn("proxy", ["--log-level", "warning", "serve", "--config", str(path)], f"http://{HOST}:{port}/ready")
    return f"http://{HOST}:{port}", sims


async def run_load(args: argparse.Namespace, url: str) -> dict:
    names = adapter_names(args.adapters)
    weights = [1.0 / (k + 1) ** args.skew for k in range(len(names))]
    total = sum(weights)
    cumulative = []
    acc = 0.0
    for w in weights:
        acc += w / total
        cumulative.append(acc)
    rng = random.Random(args.seed)
    ttfts: list[float] = []
    errors: dict[str, int] = {}
    done = 0
    deadline = time.monotonic() + args.duration

    async def worker(session: aiohttp.ClientSession, w: int) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < deadline:
            adapter = names[min(bisect.bisect_left(cumulative, rng.random()), len(names) - 1)]
            body = {"model": adapter, "stream": True, "max_tokens": args.max_tokens,
                    "messages": [{"role": "user", "content": f"worker {w} request {i}: summarise the ticket " * 8}]}
            i += 1
            sent = time.perf_counter()
            first = None
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        await resp.read()
                        errors[str(resp.status)] = errors.get(str(resp.status), 0) + 1
                        continue
                    async for line in resp.content:
                        if first is None and line.startswith(b"data: "):
                            first = time.perf_counter() - sent
                if first is not None:
                    ttfts.append(first)
                    done += 1
            except Exception as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session, w) for w in range(args.concurrency)))
    elapsed = time.monotonic() - started
    ttfts.sort()

    def q(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] * 1000 if ttfts else float("nan")

    return {"completed": done, "elapsed_s": elapsed, "rps": done / elapsed, "ttft_p50_ms": q(0.5),
            "ttft_p99_ms": q(0.99), "ttft_mean_ms": statistics.fmean(ttfts) * 1000 if ttfts else float("nan"),
            "errors": errors}


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"lora-{mode}-") as tmp:
        fleet = Fleet(Path(tmp))
        try:
            url, sims = start_cell(args, mode, fleet)
            result = asyncio.run(run_load(args, url))
            stats = [get_json(s + "/sim/stats") for s in sims]
            with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                ops: dict[str, float] = {}
                for line in r.read().decode().splitlines():
                    if line.startswith("vllm_proxy_lora_operations_total{"):
                        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
                        key = f"{labels['op'].strip(chr(34))}:{labels['reason'].strip(chr(34))}"
                        ops[key] = ops.get(key, 0) + float(line.rsplit(" ", 1)[1])
        finally:
            fleet.stop()
    minutes = result["elapsed_s"] / 60
    result.update(
        mode=mode,
        loads_per_min=sum(s["lora_loads"] for s in stats) / minutes,
        unloads_per_min=sum(s["lora_unloads"] for s in stats) / minutes,
        reloads_per_min=sum(s["lora_reloads"] for s in stats) / minutes,
        misrouted=sum(sum(s["not_found"].values()) for s in stats),
        per_replica=[sum(v for k, v in s["requests"].items() if k != MODEL) for s in stats],
        proxy_ops=ops,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"{args.adapters} adapters (Zipf {args.skew}) over {args.replicas} replicas, --max-loras {args.max_loras}, "
          f"--max-cpu-loras {args.max_cpu_loras}, --lora-load-ms {args.lora_load_ms:g}, itl {args.itl_ms:g} ms, "
          f"time scale {args.time_scale:g}; concurrency {args.concurrency}, {args.max_tokens} tokens, "
          f"{args.duration:g} s per mode; lora_aware max_adapters_per_replica={args.max_adapters}", flush=True)
    results = []
    for mode in args.modes.split(","):
        results.append(run_mode(args, mode))
        r = results[-1]
        print(f"  {mode}: {r['completed']} requests, errors {r['errors'] or 0}, proxy LoRA ops {r['proxy_ops'] or '-'}",
              flush=True)
    head = (f"{'mode':<13} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'loads/min':>9} {'unloads/min':>11} "
            f"{'reloads/min':>11} {'misrouted':>9}  requests per replica")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['mode']:<13} {r['rps']:>7.1f} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms "
              f"{r['loads_per_min']:>9.1f} {r['unloads_per_min']:>11.1f} {r['reloads_per_min']:>11.1f} "
              f"{r['misrouted']:>9}  {r['per_replica']}")
    print("(times are wall clock at the given time scale; reloads = the replica's own resident-set misses)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
