"""Soak benchmark: does the proxy stay flat (memory, fds, threads) and correct under hours of mixed traffic?

Leaks in a long-lived proxy hide in the odd paths: clients that hang up mid-stream or before the
first byte, refused bodies, unknown models, prefix-index growth from many tenants. This starts N
simulated replicas and one proxy (prefix_affinity, with a private Redis of its own), drives all of
those paths at once from C client coroutines, samples the proxy's RSS/fds/threads every --sample-s,
and ends with PASS only if RSS grew < 10 % after warm-up and there were no 5xx and no transport
errors.
It stops by itself (--minutes, --max-requests); children are stopped on exit and on Ctrl-C.

    .venv/bin/python -m loadtest.soak --minutes 30 --concurrency 16 --replicas 3 --json soak.json
"""
from __future__ import annotations

import argparse, asyncio, collections, contextlib, json, os, random, shutil, signal, socket, subprocess, sys
import tempfile, time, urllib.request
from pathlib import Path

import aiohttp
import orjson

from loadtest.private_redis import PrivateRedis

HOST, MODEL = "127.0.0.1", "soak/llama-8b"
ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta kernel cache token route replica shard query index tensor batch".split()
TENANTS = [f"You are the assistant of tenant {t}. " + " ".join(random.Random(t).choices(WORDS, k=150 + 10 * t))
           for t in range(20)]
BIG = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]})  # > 1 MiB limit
# kind, weight, expected status class
MIX = [("chat", 22, 2), ("chat_stream", 22, 2), ("completion", 8, 2), ("completion_stream", 6, 2),
       ("embedding", 10, 2), ("abort_mid_stream", 6, 2), ("abort_before_first_byte", 5, 2),
       ("bad_json", 3, 4), ("unknown_model", 3, 4), ("missing_messages", 2, 4), ("too_large", 1, 4),
       ("models", 2, 2), ("metrics", 1, 2)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_http(url: str, procs: list[subprocess.Popen], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"soak: {url} did not answer 200 (a child exited, or {timeout:.0f} s passed)")


def private_redis() -> PrivateRedis | None:
    """A redis-server of the soak's own (never one it did not start), or None without redis-server."""
    try:
        return PrivateRedis().start()
    except RuntimeError:
        return None


def proc_sample(proc: subprocess.Popen) -> dict:
    if proc.poll() is not None:
        raise ChildProcessError(f"the proxy exited with status {proc.returncode}")
    lines = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    return {"rss_mb": int(status["VmRSS"].split()[0]) / 1024, "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{proc.pid}/fd"))}


class Soak:
    def __init__(self, args: argparse.Namespace, base: str, proxy: subprocess.Popen, redis: str | None) -> None:
        self.args, self.base, self.proxy, self.redis = args, base, proxy, redis
        self.counts, self.detail = collections.Counter(), collections.Counter()  # by outcome; by "kind status"
        self.errors, self.samples = [], []  # the first transport errors and bad responses; the samples
        self.issued, self.stop, self.interrupted = 0, asyncio.Event(), False

    def record(self, kind: str, outcome: str, expect: int, status: int | None = None, err: str = "") -> None:
        self.detail[f"{kind} {status or outcome}"] += 1
        if outcome == "aborted" and status and status >= 500:  # answered 5xx before the client hung up
            outcome = "5xx"
        elif outcome not in ("aborted", "transport", "bad_response") and status // 100 != expect:
            self.counts["unexpected"] += 1
        self.counts[outcome] += 1
        if err and len(self.errors) < 10:
            self.errors.append(f"{kind}: {err}")

    async def one(self, http: aiohttp.ClientSession, rng: random.Random, convo: list) -> None:
        kind, expect = rng.choices([(k, e) for k, _, e in MIX], [w for _, w, _ in MIX])[0]
        path, body, data, stream = "/v1/chat/completions", None, None, kind.endswith("stream")
        if kind.startswith(("chat", "abort")):
            if not convo or len(convo) > 11 or rng.random() < 0.3:  # new conversation of a random tenant
                convo[:] = [{"role": "system", "content": rng.choice(TENANTS)}]
            convo.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))})
            body = {"model": MODEL, "messages": convo, "stream": stream,
                    "max_tokens": 200 if kind == "abort_mid_stream" else rng.randint(10, 60)}  # long: hang up mid-way
        elif kind.startswith("completion"):
            path, body = "/v1/completions", {"model": MODEL, "prompt": rng.choice(TENANTS)[:400] + " Q:",
                                             "max_tokens": rng.randint(10, 60), "stream": stream}
        elif kind == "embedding":
            path, body = "/v1/embeddings", {"model": MODEL, "input": rng.choices(WORDS, k=rng.randint(1, 8))}
        else:
            body = {"unknown_model": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
                    "missing_messages": {"model": MODEL}}.get(kind)
            data = {"bad_json": b'{"model": "x", "messages": [{"role": ', "too_large": BIG}.get(kind)
            path = {"models": "/v1/models", "metrics": "/metrics"}.get(kind, path)
        request = http.get(self.base + path) if body is None and data is None else \
            http.post(self.base + path, data=data or orjson.dumps(body), headers={"content-type": "application/json"})
        try:
            if kind == "abort_before_first_byte":  # cancelling the request closes its connection
                try:
                    async with asyncio.timeout(rng.uniform(0.005, 0.04)), request as resp:
                        return self.record(kind, "aborted", expect, resp.status)  # answered in time after all
                except TimeoutError:
                    return self.record(kind, "aborted", expect)
            async with request as resp:
                if kind == "abort_mid_stream":
                    await resp.content.readany()  # first bytes, then hang up
                    resp.close()
                    return self.record(kind, "aborted", expect, resp.status)
                if not (stream and resp.status == 200):
                    raw = await resp.read()
                    if kind == "chat" and resp.status == 200:
                        convo.append(orjson.loads(raw)["choices"][0]["message"])
                    return self.record(kind, f"{resp.status // 100}xx", expect, resp.status)
                tail, bad = b"", False
                async for chunk in resp.content.iter_any():
                    window, tail = tail + chunk, (tail + chunk)[-64:]
                    bad = bad or b'data: {"error"' in window
                if bad or b"data: [DONE]" not in tail:
                    return self.record(kind, "bad_response", expect, resp.status, f"stream ended badly: {tail[-60:]!r}")
                if kind == "chat_stream":
                    convo.append({"role": "assistant", "content": "(streamed answer)"})
                return self.record(kind, "2xx", expect, resp.status)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.record(kind, "transport", expect, err=f"{type(exc).__name__}: {exc}")
        except (ValueError, KeyError, IndexError, TypeError) as exc:  # a 200 whose body is not what it should be
            self.record(kind, "bad_response", expect, 200, f"{type(exc).__name__}: {exc}")

    async def client(self, http: aiohttp.ClientSession, seed: int, deadline: float) -> None:
        rng, convo = random.Random(seed), []
        while not self.stop.is_set() and time.monotonic() < deadline and self.issued < self.args.max_requests:
            self.issued += 1
            await self.one(http, rng, convo)

    def sample(self, t0: float, label: str = "") -> None:
        s = {"t_s": round(time.monotonic() - t0, 1), **proc_sample(self.proxy), **self.counts}
        prev = self.samples[-1] if self.samples else {"t_s": 0, "n": 0}
        s["n"] = sum(v for k, v in self.counts.items() if k != "unexpected")
        rate = (s["n"] - prev["n"]) / max(s["t_s"] - prev["t_s"], 1e-9)
        self.samples.append(s)
        print(f"t={s['t_s']:6.0f}s rss={s['rss_mb']:6.1f}MB fds={s['fds']:4d} thr={s['threads']:3d} "
              f"req={s['n']:7d} ({rate:5.1f}/s) " + " ".join(f"{k}={self.counts[k]}" for k in
              ("2xx", "4xx", "5xx", "aborted", "transport", "bad_response", "unexpected")) + label, flush=True)

    async def run(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):  # stop the traffic, still print the summary
            asyncio.get_running_loop().add_signal_handler(sig, self.stop.set)
        t0 = time.monotonic()
        deadline = t0 + self.args.minutes * 60
        self.sample(t0, "  (before traffic)")
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as http:
            clients = [asyncio.create_task(self.client(http, i, deadline)) for i in range(self.args.concurrency)]
            try:
                while not self.stop.is_set() and not all(c.done() for c in clients):
                    with contextlib.suppress(TimeoutError):
                        left = max(deadline - time.monotonic(), 0.1)
                        await asyncio.wait_for(self.stop.wait(), min(self.args.sample_s, left))
                    if self.stop.is_set() or time.monotonic() >= deadline or self.issued >= self.args.max_requests:
                        break
                    self.sample(t0)
                self.interrupted = self.stop.is_set()  # by a signal
                self.stop.set()
                self.sample(t0, "  (end of traffic, interrupted)" if self.interrupted else "  (end of traffic)")
                await asyncio.wait(clients, timeout=35)  # in flight requests finish (30 s client timeout)
                for c in (c for c in clients if c.done() and c.exception()):
                    raise c.exception()
            finally:  # on a failure too: no client may outlive the session
                for c in clients:
                    c.cancel()
        await asyncio.sleep(6)  # the proxy sees the clients go and its upstream pool (4 s keep-alive) expires
        self.sample(t0, "  (clients closed)")


def summarize(soak: Soak, args: argparse.Namespace) -> dict:
    warm = args.warmup_min if args.warmup_min is not None else min(3.0, args.minutes * 0.1)
    first, end, idle = soak.samples[0], soak.samples[-2], soak.samples[-1]
    base = next((s for s in soak.samples[1:] if s["t_s"] >= warm * 60), end)
    end_rss = max(end["rss_mb"], idle["rss_mb"])  # under load and idle: the larger counts
    growth = (end_rss - base["rss_mb"]) / base["rss_mb"] * 100
    c = soak.counts
    checks = {"rss_growth_lt_10pct": growth < 10, "no_5xx": c["5xx"] == 0, "no_transport_errors": c["transport"] == 0,
              "no_bad_responses": c["bad_response"] == 0, "no_unexpected_status": c["unexpected"] == 0,
              "ran_to_the_end": not soak.interrupted}
    ok = all(checks.values())
    print(f"\n--- soak summary: {idle['t_s']:.0f} s, concurrency {args.concurrency}, {args.replicas} replicas, "
          f"redis {'on' if soak.redis else 'off'} ---")
    print(f"RSS: before traffic {first['rss_mb']:.1f} MB; after warm-up ({warm:.2f} min, t={base['t_s']:.0f}s) "
          f"{base['rss_mb']:.1f} MB; at end {end['rss_mb']:.1f} MB, idle {idle['rss_mb']:.1f} MB; "
          f"growth {growth:+.1f} %")
    print(f"fds: start {first['fds']}, after warm-up {base['fds']}, end {end['fds']}, idle {idle['fds']}; "
          f"threads: start {first['threads']}, end {idle['threads']}")
    print(f"requests: {idle['n']}  2xx={c['2xx']} 4xx={c['4xx']} 5xx={c['5xx']} client-aborts={c['aborted']} "
          f"transport-errors={c['transport']} bad-responses={c['bad_response']} unexpected-status={c['unexpected']}")
    for e in soak.errors:
        print("  error:", e)
    print(("PASS" if ok else "FAIL") + ": " + ", ".join(f"{k}={'ok' if v else 'NO'}" for k, v in checks.items()))
    return {"args": vars(args), "redis": soak.redis, "warmup_sample": base, "end_sample": end, "idle_sample": idle,
            "rss_growth_pct": round(growth, 2), "counts": dict(c), "by_kind_status": dict(soak.detail),
            "errors": soak.errors, "checks": checks, "pass": ok, "samples": soak.samples}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--sample-s", type=float, default=10)
    p.add_argument("--warmup-min", type=float, default=None, help="default: min(3, 10 %% of --minutes)")
    p.add_argument("--max-requests", type=int, default=5_000_000, help="stop after this many requests")
    p.add_argument("--time-scale", type=float, default=0.5, help="sim delays: ~50-300 ms per request")
    p.add_argument("--json", help="write samples and summary here")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM during start-up: clean up too
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    procs: list[subprocess.Popen] = []
    passed = False
    py = [sys.executable, "-m", "proxy", "--log-level", "warning"]

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen:  # own session: stopping it stops its children
        with open(tmp / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        return procs[-1]

    redis = None
    try:
        ports = [free_port() for _ in range(args.replicas + 1)]
        for i, port in enumerate(ports[1:]):
            spawn(f"sim-{i}", py + ["sim", "--port", str(port), "--model", MODEL, "--time-scale", str(args.time_scale),
                                   "--itl-ms", "10", "--prefill-ms-per-token", "0.05", "--seed", str(i)])
        for port in ports[1:]:
            wait_http(f"http://{HOST}:{port}/health", procs)
        config = {"server": {"host": HOST, "port": ports[0], "max_body_bytes": 1048576},
                  "backends": [{"name": f"sim-{i}", "url": f"http://{HOST}:{pt}"} for i, pt in enumerate(ports[1:])],
                  "routing": {"policy": "prefix_affinity"}}
        if redis := private_redis():
            config["redis"] = {"url": redis.url}
        url = redis.url if redis else None
        (tmp / "soak.yaml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        proxy = spawn("proxy", py + ["serve", "--config", str(tmp / "soak.yaml")])
        base = f"http://{HOST}:{ports[0]}"
        wait_http(base + "/ready", procs)
        print(f"soak: proxy pid {proxy.pid} at {base}, {args.replicas} sims, redis {url or 'off'}, logs in {tmp}",
              flush=True)
        soak = Soak(args, base, proxy, url)
        try:
            asyncio.run(soak.run())
        except ChildProcessError as exc:
            print(f"soak: FAIL: {exc}; see {tmp / 'proxy.log'}", file=sys.stderr)
            return 1
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # the loop's handlers are gone again
        result = summarize(soak, args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        passed = result["pass"]
        return 0 if passed else 1
    except KeyboardInterrupt:
        print("\nsoak: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
        for proc in procs:
            if proc.poll() is None:  # not reaped yet: its pid (= its group) is still ours
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if redis:
            redis.stop()
        if passed:  # keep the logs only when something went wrong
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
