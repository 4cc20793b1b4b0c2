"""SIGTERM drains the real `vllm-proxy serve` process (proxy/drain.py): /ready answers 503 for the
whole drain, requests still arriving are served (their connections close), streams that finish
in time finish, streams still open at the deadline end with an SSE error event, exit status 0."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from proxy.config import ServerConfig
from tests.conftest import MODEL, Servers, eventually
from tests.test_deploy_kit import DRAIN_DEADLINE_S
from tests.test_hung_replicas import LONG, Stream
from tests.test_operations import draining

CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(tmp_path: Path, sims, **server) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = {"server": {"port": port, **server}, "backends": [{"name": f"gpu-{i}", "url": s.url} for i, s in enumerate(sims)],
              "discovery": {"interval_s": 0.5}}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "proxy.log").open("wb"))
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(url + "/ready").status_code == 200
        except httpx.HTTPError:
            return False

    assert eventually(ready, timeout=60), (tmp_path / "proxy.log").read_text()
    return proc, url


def test_drain_default_matches_the_deploy_kits() -> None:
    assert ServerConfig().drain_timeout_s == DRAIN_DEADLINE_S


def test_sigterm_during_streams(servers: Servers, tmp_path: Path) -> None:
    sims = [servers.sim(time_scale=1.0, itl_ms=20.0, prefill_ms_per_token=0.0) for _ in range(2)]
    proc, url = serve(tmp_path, sims, drain_timeout_s=6)
    try:
        long = [Stream(url, f"long story {i}", max_tokens=5000) for i in range(3)]  # ~100 s: outlive the drain
        short = [Stream(url, f"short story {i}", max_tokens=100) for i in range(2)]  # ~2 s: finish in it
        for s in long + short:
            assert s.first.wait(30) and s.error is None
        proc.send_signal(signal.SIGTERM)
        assert eventually(lambda: draining(url), timeout=30)  # (a connection open as it began may be closed)
        ready = httpx.get(url + "/ready").json()
        assert ready["draining"] is True and ready["ready"] is False
        late = httpx.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 3}, timeout=LONG)
        assert late.status_code == 200 and late.headers["connection"] == "close"  # served; go elsewhere next time
        for s in short:
            s.join(LONG)
            assert s.completed, s.events[-2:]
        for s in long:
            s.join(LONG)
            assert not s.is_alive() and s.ended_with_error, s.events[-2:]
            assert "proxy_shutting_down" in s.events[-1]
        assert proc.wait(LONG) == 0
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_when_idle_exits_without_waiting_for_the_deadline(servers: Servers, tmp_path: Path) -> None:
    proc, url = serve(tmp_path, [servers.sim()], drain_timeout_s=3600)
    try:
        assert httpx.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(LONG) == 0  # nothing in flight: no reason to wait an hour
    finally:
        proc.kill()
        proc.wait()
