"""Processes of one benchmark cell: simulated replicas and the routers in front of them.

Every cell starts from fresh processes so prefix caches start cold and counters start at zero.
Each child runs in its own session and is stopped by its process group; logs go to a temp dir
and are shown when something fails to start. Everything listens on 127.0.0.1 only.
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson

from loadtest.private_redis import PrivateRedis
from loadtest.procs import Proc, spawn, wait_ready

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
OUR_POLICIES = ("round_robin", "least_loaded", "prefix_affinity")
PEERS = {  # policy prefix -> how to launch one peer router
    "sglang": lambda venv: [str(Path(venv) / "bin" / "python"), "-m", "sglang_router.launch_router"],
    "vllm-router": lambda venv: [str(Path(venv) / "bin" / "vllm-router")],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def hold_port(port: int = 0) -> socket.socket:
    """A loopback socket bound to `port` (0: a free one) and not listening: connections to it are
    refused, and no process started meanwhile takes the port. A replica that joins later keeps its
    port this way until it starts (close the socket first): a free port merely noted was once taken
    by another run's process, which answered as that replica for a minute."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((HOST, port))
    except OSError:  # (taken again already: nothing to hold)
        s.close()
    return s


def http_get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


@dataclass
class SimSettings:
    model: str
    num_gpu_blocks: int
    block_size: int = 16
    prefill_ms_per_token: float = 0.05
    itl_ms: float = 10.0
    time_scale: float = 1.0
    max_num_seqs: int = 8


@dataclass
class Fleet:
    """Replicas plus routers of one cell; use as a context manager so everything is stopped."""

    tmp: Path
    procs: list[Proc] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)  # base URLs
    routers: list[str] = field(default_factory=list)  # base URLs clients use
    redis: PrivateRedis | None = None

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def redis_url(self, given: str = "") -> str:
        """`given` (flushed: the user opted in) or a fresh private redis-server for this cell."""
        if given:
            flush_redis(given)
            return given
        if self.redis is None:
            self.redis = PrivateRedis().start()
        return self.redis.url

    def spawn(self, name: str, cmd: list[str]) -> Proc:
        proc = spawn(name, cmd, self.tmp)
        self.procs.append(proc)
        return proc

    wait_ready = staticmethod(wait_ready)

    # --- replicas ----------------------------------------------------------------------------
    def start_replicas(self, count: int, s: SimSettings, slowdown: dict[int, float] | None = None) -> None:
        """`slowdown`: replica index -> how many times slower it runs (its sim's time scale)."""
        started = []
        for i in range(count):
            port = free_port()
            si = replace(s, time_scale=s.time_scale * slowdown[i]) if slowdown and i in slowdown else s
            started.append((self.spawn(f"sim{i}", replica_cmd(port, si)), f"http://{HOST}:{port}"))
        for proc, url in started:
            self.wait_ready(proc, url + "/health")
            self.replicas.append(url)

    def replica_counters(self) -> list[dict]:
        """Per replica: prefix-cache token counters from /metrics, request counts from /sim/stats."""
        out = []
        for url in self.replicas:
            metrics = http_get(url + "/metrics").decode()
            stats = orjson.loads(http_get(url + "/sim/stats"))
            out.append({"queries": _counter(metrics, "vllm:prefix_cache_queries_total"),
                        "hits": _counter(metrics, "vllm:prefix_cache_hits_total"),
                        "requests": sum(stats["requests"].values()),
                        "stats_hits": stats["prefix_cache"]["hits"], "stats_queries": stats["prefix_cache"]["queries"],
                        "evictions": stats["prefix_cache"]["evictions"]})
        return out

    # --- routers -----------------------------------------------------------------------------
    def start_proxies(self, count: int, policy: str, redis_url: str, replicas: list[str] | None = None,
                      extra: str = "", profiles: dict | None = None) -> None:
        started = []
        for i in range(count):
            port = free_port()
            cfg = self.tmp / f"proxy{i}.yaml"
            cfg.write_text(proxy_config(port, replicas or self.replicas, policy, redis_url, profiles) + extra)
            cmd = [sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--port", str(port)]
            started.append((self.spawn(f"proxy{i}", cmd), f"http://{HOST}:{port}"))
        for proc, url in started:
            self.wait_ready(proc, url + "/ready")
            self.routers.append(url)

    def start_peers(self, count: int, peer: str, policy: str, venv: str) -> None:
        started = []
        for i in range(count):
            port = free_port()
            cmd = PEERS[peer](venv) + ["--worker-urls", *self.replicas, "--host", HOST, "--port", str(port),
                                       "--policy", policy, "--prometheus-port", str(free_port()),
                                       "--log-level", "warn" if peer == "sglang" else "warning"]
            started.append((self.spawn(f"{peer}{i}", cmd), f"http://{HOST}:{port}"))
        for proc, url in started:
            self.wait_ready(proc, url + "/readiness", timeout=60)
            self.routers.append(url)


def replica_cmd(port: int, s: SimSettings) -> list[str]:
    return [sys.executable, "-m", "proxy", "sim", "--port", str(port), "--model", s.model,
            "--num-gpu-blocks", str(s.num_gpu_blocks), "--block-size", str(s.block_size),
            "--prefill-ms-per-token", str(s.prefill_ms_per_token), "--itl-ms", str(s.itl_ms),
            "--time-scale", str(s.time_scale), "--max-num-seqs", str(s.max_num_seqs)]


def proxy_config(port: int, replicas: list[str], policy: str, redis_url: str, profiles: dict | None = None) -> str:
    """`policy` may carry knobs of its YAML section: "prefix_affinity+move_after_requests=100+epsilon=0.2",
    and of the redis section ("+redis.busy_sync_interval_s=0.005"); or name one of `profiles` (routing.profiles)."""
    name, *knobs = policy.split("+")
    shared = "".join(f", {k[len('redis.'):].replace('=', ': ', 1)}" for k in knobs if k.startswith("redis."))
    section = ", ".join(k.replace("=", ": ", 1) for k in knobs if not k.startswith("redis."))
    routing = f"{{policy: {name}, {name}: {{{section}}}}}" if section else f"{{policy: {name}}}"
    if profiles and name in profiles:
        routing = orjson.dumps({"policy": name, "profiles": {name: profiles[name]}}).decode()  # (JSON is YAML)
    backends = "".join(f'  - {{name: r{i}, url: "{u}"}}\n' for i, u in enumerate(replicas))
    return (f"server: {{host: {HOST}, port: {port}}}\nbackends:\n{backends}"
            f"routing: {routing}\nredis: {{url: \"{redis_url}\"{shared}}}\n")


def check_policy(policy: str, tmp: Path, redis_url: str, profiles: dict | None = None) -> str | None:
    """None if `python -m proxy check` accepts a config with this policy, else its complaint."""
    cfg = tmp / f"check-{policy}.yaml"
    cfg.write_text(proxy_config(free_port(), [f"http://{HOST}:1", f"http://{HOST}:2"], policy, redis_url, profiles))
    r = subprocess.run([sys.executable, "-m", "proxy", "check", "--config", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    return None if r.returncode == 0 else (r.stderr or r.stdout).strip()


def peer_available(peer: str, venv: str) -> str | None:
    """None if the peer router can be launched from `venv`, else why not."""
    cmd = PEERS[peer](venv)
    if not Path(cmd[0]).exists():
        return f"{cmd[0]} not found"
    if peer == "sglang" and subprocess.run(cmd[:1] + ["-c", "import sglang_router"],
                                           capture_output=True).returncode:
        return f"sglang_router not importable in {venv}"
    return None


def flush_redis(url: str) -> None:
    """Empty the benchmark's Redis DB so shared routing state starts cold, like the caches."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()


def _counter(text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
        total += float(m.group(1))
    return total
