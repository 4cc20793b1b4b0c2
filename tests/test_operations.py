"""Operations with a real proxy process: hot reload (file change, SIGHUP, admin endpoint, a bad
file mid-run) and graceful shutdown on SIGTERM with live streams."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import yaml

from tests.conftest import MODEL, Servers, eventually
from tests.support import held

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProxyProcess:
    def __init__(self, path: Path, env: dict | None = None, args: tuple[str, ...] = ()) -> None:
        self.port = yaml.safe_load(path.read_text())["server"]["port"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = path.with_suffix(".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(path), *args],
            cwd=ROOT, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )
        assert eventually(self._ready, timeout=40), self.log.read_text()

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, line_start: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def write(path: Path, config: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config))
    os.replace(tmp, path)


def base_config(port: int, *sims) -> dict:
    return {
        "server": {"host": "127.0.0.1", "port": port, "drain_timeout_s": 20},
        "backends": [{"name": f"gpu-{i}", "url": s.url} for i, s in enumerate(sims)],
        "discovery": {"interval_s": 0.5, "timeout_s": 1},
        "auth": {"admin_key_env": "VP_ADMIN"},
    }


def stream(url: str, model: str, results: list, max_tokens: int = 30) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
            text = "".join(resp.iter_text())
        results.append((resp.status_code, text.rstrip().endswith("data: [DONE]")))
    except httpx.HTTPError as exc:
        results.append((0, repr(exc)))


def test_hot_reload_file_sighup_admin_and_bad_file(servers: Servers, tmp_path: Path) -> None:
    a, b = (servers.sim(time_scale=1.0, itl_ms=100.0, prefill_ms_per_token=0.0) for _ in range(2))
    path = tmp_path / "policy.yaml"
    config = base_config(free_port(), a)
    write(path, config)
    proxy = ProxyProcess(path, {"VP_ADMIN": "let-me-in"})
    try:
        assert [m["id"] for m in httpx.get(proxy.url + "/v1/models").json()["data"]] == [MODEL]
        live: list = []
        streamer = threading.Thread(target=stream, args=(proxy.url, MODEL, live, 25))
        streamer.start()  # ~2.5 s stream that must survive the reloads below
        # 1. file change: a deployment name appears (the watcher looks every second; slack for a busy machine)
        config["deployments"] = [{"name": "llama", "model": MODEL}]
        write(path, config)
        assert eventually(lambda: '"id":"llama"' in httpx.get(proxy.url + "/v1/models").text, timeout=15)
        # 2. a broken file changes nothing but a log line and the error count
        path.write_text("backends:\n  - {name: gpu-0, url: ftp://nowhere}\n")
        assert eventually(lambda: proxy.metric('vllm_proxy_config_reloads_total{result="error"}') >= 1, timeout=15)
        assert httpx.post(proxy.url + "/v1/chat/completions",
                          json={"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).status_code == 200
        assert "backends[0].url" in proxy.log.read_text()
        # 3. SIGHUP and the admin endpoint reload a good file (adding backend b)
        config["backends"].append({"name": "gpu-1", "url": b.url})
        path.write_text(yaml.safe_dump(config))
        proxy.proc.send_signal(signal.SIGHUP)
        assert eventually(lambda: proxy.metric('vllm_proxy_backend_up{backend="gpu-1"}') == 1.0, timeout=15)
        denied = httpx.post(proxy.url + "/admin/reload", headers={"authorization": "Bearer wrong"})
        assert denied.status_code == 401
        ok = httpx.post(proxy.url + "/admin/reload", headers={"authorization": "Bearer let-me-in"})
        assert ok.status_code == 200 and ok.json()["reloaded"] is True
        streamer.join(timeout=10)
        assert live == [(200, True)]
        assert proxy.metric('vllm_proxy_config_reloads_total{result="success"}') >= 3
    finally:
        proxy.stop()


def test_sigterm_drains_live_streams(servers: Servers, tmp_path: Path) -> None:
    sim = servers.sim(time_scale=1.0, itl_ms=20.0, prefill_ms_per_token=0.0, max_num_seqs=128)
    path = tmp_path / "policy.yaml"
    write(path, base_config(free_port(), sim))
    proxy = ProxyProcess(path)
    sigterm_drains_streams(proxy, sim, MODEL, 50)


def sigterm_drains_streams(proxy: ProxyProcess, sim, model: str, n: int) -> None:
    """`n` live streams, then SIGTERM to the proxy process: every stream ends whole, exit 0."""
    results: list = []
    threads = [threading.Thread(target=stream, args=(proxy.url, model, results, 30)) for _ in range(n)]
    with held(sim.url):  # every stream stays live until the proxy is draining
        for t in threads:
            t.start()
        assert eventually(lambda: sim.server.config.app.stats()["running"] == n, timeout=30)
        proxy.proc.send_signal(signal.SIGTERM)
        assert eventually(lambda: draining(proxy.url), timeout=30)  # /ready says 503 while it drains
    for t in threads:
        t.join(timeout=30)
    assert proxy.proc.wait(timeout=30) == 0
    assert len(results) == n and all(r == (200, True) for r in results), results[:3]


def draining(url: str) -> bool:
    """The proxy got SIGTERM: it still listens, and /ready answers 503 so balancers stop sending."""
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 503
    except httpx.HTTPError:
        return False


def worker_pids(supervisor: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(supervisor)], capture_output=True, text=True).stdout
    pids = set()
    for pid in map(int, out.split()):  # the spawn context also starts a resource tracker: skip it
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:  # exited between ps and here (a worker being replaced)
            continue
        if b"resource_tracker" not in cmdline:
            pids.add(pid)
    return pids


def test_workers_supervisor_restarts_reloads_and_drains(servers: Servers, tmp_path: Path) -> None:
    sim = servers.sim(time_scale=1.0, itl_ms=20.0, prefill_ms_per_token=0.0, max_num_seqs=128)
    path = tmp_path / "policy.yaml"
    config = base_config(free_port(), sim)
    write(path, config)
    proxy = ProxyProcess(path, args=("--workers", "2"))
    try:
        workers = worker_pids(proxy.proc.pid)
        assert len(workers) == 2, workers
        # a worker that dies is replaced, and the port keeps answering meanwhile
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        assert eventually(lambda: len(worker_pids(proxy.proc.pid) - {victim}) == 2, timeout=15), proxy.log.read_text()
        assert eventually(proxy._ready, timeout=15)
        # SIGHUP to the supervisor is passed on, not fatal: the workers stay (no restart) and all
        # end up on the new policy (their file watchers would see it as well)
        workers = worker_pids(proxy.proc.pid)
        config["deployments"] = [{"name": "renamed", "model": MODEL}]
        path.write_text(yaml.safe_dump(config))
        proxy.proc.send_signal(signal.SIGHUP)

        def renamed_everywhere() -> bool:  # fresh connections: either worker may answer
            return all(httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"] == "renamed" for _ in range(8))

        assert eventually(renamed_everywhere, timeout=10)
        assert worker_pids(proxy.proc.pid) == workers and proxy.proc.poll() is None
        # SIGTERM to the supervisor alone: both workers drain their live streams, exit 0
        sigterm_drains_streams(proxy, sim, "renamed", 20)
    finally:
        for pid in worker_pids(proxy.proc.pid) if proxy.proc.poll() is None else ():
            os.kill(pid, signal.SIGKILL)
        proxy.stop()


def test_workers_exit_when_the_supervisor_is_killed(servers: Servers, tmp_path: Path) -> None:
    sim = servers.sim()
    path = tmp_path / "policy.yaml"
    write(path, base_config(free_port(), sim))
    proxy = ProxyProcess(path, args=("--workers", "2"))
    workers = worker_pids(proxy.proc.pid)
    assert len(workers) == 2
    proxy.proc.kill()  # SIGKILL: no chance to pass anything on
    proxy.proc.wait()

    def running(pid: int) -> bool:
        """Not exited (a zombie has exited); its /proc entry may vanish between any two reads."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return False
        return stat.rsplit(b")", 1)[-1].split()[:1] != [b"Z"]  # (the state follows the command's name)

    def gone() -> bool:
        return not any(running(pid) for pid in workers)

    try:
        assert eventually(gone, timeout=15), "workers outlived their supervisor"
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
