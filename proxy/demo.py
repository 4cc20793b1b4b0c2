"""`vllm-proxy demo`: a simulated vLLM fleet plus the proxy, as real processes, until Ctrl-C.

The fleet is read off the policy: one simulated replica per backend, on the backend's port;
the second one preloads the adapters that deployments name; `trust_request_mm_kwargs`
backends start with --trust-request-mm-kwargs.
"""
from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from proxy.config import ConfigError, ProxyConfig, load_config

DEFAULT_POLICY = Path(__file__).resolve().parent.parent / "policies" / "demo.yaml"
SIM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def sim_commands(config: ProxyConfig, time_scale: float) -> list[list[str]]:
    adapters = sorted({d.adapter for d in config.deployments or [] if d.adapter})
    base = next((d.model for d in config.deployments or [] if d.adapter is None), SIM_MODEL)
    commands = []
    for i, backend in enumerate(config.backends):
        port = str(urlsplit(backend.url).port or 80)
        cmd = [sys.executable, "-m", "proxy", "--log-level", "warning", "sim", "--port", port, "--model", base,
               "--time-scale", str(time_scale), "--max-loras", "2"]
        if i == 1 and adapters:
            cmd += ["--lora-modules", *(f"{a}=/adapters/{a}" for a in adapters)]
        if backend.trust_request_mm_kwargs:
            cmd.append("--trust-request-mm-kwargs")
        commands.append(cmd)
    return commands


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def _wait_http(url: str, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def examples(base: str, config: ProxyConfig) -> str:
    names = [d.name for d in config.deployments or []] or ["<model id from /v1/models>"]
    model = names[0]
    adapter = next((d.name for d in config.deployments or [] if d.adapter), None)
    lines = [
        "",
        f"vllm-proxy demo is up: {base}/v1  (deployments: {', '.join(names)})",
        "",
        "Try it:",
        f"  curl -s {base}/v1/models",
        f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
        f"  curl -sN {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"stream\": true, \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
    ]
    if adapter:
        lines += [
            f"  curl -s {base}/v1/completions -H 'Content-Type: application/json' \\",
            f"    -d '{{\"model\": \"{adapter}\", \"prompt\": \"SELECT\", \"max_tokens\": 8}}'",
        ]
    lines += [
        f"  curl -s {base}/tokenize -H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"prompt\": \"Hello!\"}}'",
        f"  curl -s {base}/metrics | grep vllm_proxy_requests_total",
        "",
        "With the openai SDK (pip install openai):",
        "  from openai import OpenAI",
        f"  client = OpenAI(base_url='{base}/v1', api_key='unused')",
        f"  r = client.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}])",
        "  print(r.choices[0].message.content)",
        f"  first = client.responses.create(model='{model}', input='Hello!')",
        f"  print(client.responses.create(model='{model}', input='And then?', previous_response_id=first.id).output_text)",
        "",
        "Ctrl-C stops the proxy and the simulated fleet.",
    ]
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    path = Path(args.config) if args.config else DEFAULT_POLICY
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    host, port = config.server.host, config.server.port
    wanted = [(host, port)] + [(urlsplit(b.url).hostname or host, urlsplit(b.url).port or 80) for b in config.backends]
    busy = [f"{h}:{p}" for h, p in wanted if not _port_free(h, p)]
    if busy:
        print(f"demo: port(s) already in use: {', '.join(busy)} (another demo running?)", file=sys.stderr)
        return 1
    children: list[subprocess.Popen] = []
    try:
        for cmd in sim_commands(config, args.time_scale):
            children.append(subprocess.Popen(cmd))
        deadline = time.monotonic() + 30
        for backend in config.backends:
            if not _wait_http(backend.url + "/health", deadline):
                print(f"demo: simulated replica {backend.name} did not start", file=sys.stderr)
                return 1
        children.append(subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--config", str(path)]))
        base = f"http://{host}:{port}"
        if not _wait_http(base + "/ready", time.monotonic() + 30):
            print("demo: the proxy did not become ready", file=sys.stderr)
            return 1
        print(examples(base, config), flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        while all(child.poll() is None for child in children):
            time.sleep(0.5)
        print("demo: a process exited unexpectedly; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndemo: stopping", flush=True)
        return 0
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
