"""`vllm-proxy demo` from the checkout (what `make demo` runs) and from a wheel installed into a
fresh venv outside the checkout: the packaged demo policy is found, the fleet comes up, and the
printed walkthrough shows prefix affinity (`prefix-hit` on a conversation's next turn)."""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import eventually

ROOT = Path(__file__).resolve().parent.parent


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports (the demo puts its replicas after the proxy),
    below Linux's ephemeral range (32768+): the servers other test processes start on port 0, and
    their outgoing connections, cannot take one between this probe and the demo's bind."""
    for _ in range(200):
        base = random.randrange(20000, 32000)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port range")


def run_demo(command: list[str], cwd: Path, env: dict | None = None) -> str:
    """Start the demo, wait for its printed walkthrough, stop it with SIGTERM; returns its stdout."""
    proc = subprocess.Popen([*command, "--port", str(free_ports(4))], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        assert eventually(lambda: any("Ctrl-C stops" in line for line in out) or proc.poll() is not None,
                          timeout=120, interval=0.2), "".join(out)
        assert proc.poll() is None, "".join(out)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    return "".join(out)


def assert_walkthrough(text: str) -> None:
    lines = text.splitlines()
    first = next(line for line in lines if line.lstrip().startswith("1. a new conversation"))
    second = next(line for line in lines if line.lstrip().startswith("2. its next turn"))
    assert "route: pinned" in first and "route: prefix-hit" in second, text
    assert first.split("backend: ")[1].split()[0] == second.split("backend: ")[1].split()[0]  # the same replica
    assert "Traceback" not in text


def test_demo_from_the_checkout_shows_prefix_affinity() -> None:
    assert_walkthrough(run_demo([sys.executable, "-m", "proxy", "demo"], ROOT))


# builds a wheel (compiled: ~1 min on a quiet machine, over 5 on a loaded one) and installs it
# with its dependencies; the timeouts are hang guards only
@pytest.mark.timeout(1200)
def test_wheel_in_a_fresh_venv_runs_demo_and_check(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: the build leaves nothing in (and races nothing of) the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "results"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
                   check=True, timeout=600, capture_output=True)
    (wheel,) = wheels.glob("vllm_proxy-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([venv / "bin" / "pip", "install", "-q", str(wheel)], check=True, timeout=400, capture_output=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    located = subprocess.run([venv / "bin" / "python", "-c", "import proxy.demo as d; print(d.default_policy())"],
                             cwd=outside, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert located.startswith(str(venv)) and located.endswith("proxy/policies/demo.yaml"), located

    assert_walkthrough(run_demo([str(venv / "bin" / "vllm-proxy"), "demo"], outside, env))

    ok = subprocess.run([venv / "bin" / "vllm-proxy", "check", "--config", located], cwd=outside, env=env,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stderr
    bad = outside / "bad.yaml"
    bad.write_text("backends: [{name: a, url: 'http://127.0.0.1:9', models: [m]}]\n"
                   "deployments: [{name: x, model: n}]\n")
    refused = subprocess.run([venv / "bin" / "vllm-proxy", "check", "--config", str(bad)], cwd=outside, env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "deployments[0].model: no backend serves 'n'" in refused.stderr
