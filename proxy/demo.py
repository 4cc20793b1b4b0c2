"""`vllm-proxy demo`: a simulated vLLM fleet plus the proxy, as real processes, until Ctrl-C.

The fleet is read off the policy: one simulated replica per backend, on the backend's port;
the second one preloads the adapters that deployments name; `trust_request_mm_kwargs`
backends start with --trust-request-mm-kwargs. Once up, a short walkthrough sends a
conversation through the proxy and prints where each turn went and why (the
`x-vllm-proxy-route` header: `pinned` for the new tenant, then `prefix-hit` for the next turn),
with the replica's cached tokens.

The default policy ships inside the package (proxy/policies/demo.yaml in a wheel, built from
the checkout's policies/ by setup.py), so a regular install runs it too. `--port P` moves the
proxy to P and the replicas to P+1, P+2, …
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from proxy.config import ConfigError, ProxyConfig, load_config

SIM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def default_policy() -> Path:
    """The packaged demo policy of an installed proxy, else the checkout's (editable install)."""
    packaged = Path(__file__).resolve().parent / "policies" / "demo.yaml"
    return packaged if packaged.exists() else Path(__file__).resolve().parent.parent / "policies" / "demo.yaml"


def moved(path: Path, port: int) -> Path:
    """A copy of the policy at `path` with the proxy on `port` and backend i on `port + 1 + i`."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data.setdefault("server", {})["port"] = port
    for i, backend in enumerate(data.get("backends") or []):
        url = urlsplit(backend["url"])
        backend["url"] = f"{url.scheme}://{url.hostname}:{port + 1 + i}"
    fd, name = tempfile.mkstemp(prefix="vllm-proxy-demo-", suffix=".yaml")
    with os.fdopen(fd, "w") as out:
        yaml.safe_dump(data, out, sort_keys=False)
    return Path(name)


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


_SYSTEM = (
    "You are the support assistant of ACME Rockets. Answer questions about orders, deliveries, launch "
    "permits and the safe handling of solid-fuel model rockets. Be brief and precise, quote order numbers "
    "exactly, never promise a delivery date the warehouse has not confirmed, and send anything about "
    "injuries, fires or legal disputes to a human agent at once. Our opening hours are 8:00 to 18:00 CET, "
    "Monday to Friday; outside them, take a message. "
)
_QUESTION = (
    "Hello! I ordered the Falcon Mini starter kit three weeks ago (order 55-1027) together with two spare "
    "igniters and a parachute pack. The tracking page has said 'label created' for ten days now and nobody "
    "answers the phone. Could you tell me where the parcel is, and whether the igniters can be sent by normal "
    "post at all, or if that is why it is stuck somewhere?"
)


def _ask(base: str, model: str, messages: list[dict]) -> tuple[str, str, str, dict]:
    """One chat completion: (route header, backend header, answer text, usage)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 24}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        data = json.loads(resp.read())
        route = resp.headers.get("x-vllm-proxy-route", "?")
        backend = resp.headers.get("x-vllm-proxy-backend", "?")
    return route, backend, data["choices"][0]["message"]["content"], data.get("usage") or {}


def walkthrough(base: str, model: str) -> str:
    """Prefix affinity, live: a conversation's turns and a second conversation of the same tenant."""
    system = {"role": "system", "content": _SYSTEM}
    first = [system, {"role": "user", "content": _QUESTION}]
    steps = []
    route, backend, answer, usage = _ask(base, model, first)
    steps.append(("a new conversation (a system prompt never seen)", route, backend, usage))
    second = [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": "Thanks. And can I pick it up at the warehouse instead?"}]
    route, backend, _, usage = _ask(base, model, second)
    steps.append(("its next turn (the whole history again)", route, backend, usage))
    route, backend, _, usage = _ask(base, model, [system, {"role": "user", "content": "Are you open on Saturday?"}])
    steps.append(("another conversation with the same system prompt", route, backend, usage))
    lines = ["", "Prefix affinity, live (x-vllm-proxy-route / -backend headers of three requests just sent):"]
    for i, (what, route, backend, usage) in enumerate(steps, 1):
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        tokens = f"{cached or 0} of {usage.get('prompt_tokens', '?')} prompt tokens cached"
        lines.append(f"  {i}. {what:<52} route: {route:<11} backend: {backend}  ({tokens})")
    lines += [
        "  1: a new tenant (system prompt) is placed on the least-loaded replica and pinned there;",
        "  2: `prefix-hit`: the next turn goes back to the replica that computed the earlier turns (its prefix",
        "  cache holds them); 3: the tenant's other conversations stay on its replica (`pinned`).",
        "  See the headers yourself with `curl -si … | grep x-vllm-proxy`.",
    ]
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    path = Path(args.config) if args.config else default_policy()
    temporary = None
    try:
        if args.port is not None:
            temporary = path = moved(path, args.port)
        config = load_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (OSError, ValueError, yaml.YAMLError, AttributeError, KeyError, TypeError) as exc:
        print(f"demo: cannot use {path}: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, path, config)
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)


def _run(args: argparse.Namespace, path: Path, config: ProxyConfig) -> int:
    host, port = config.server.host, config.server.port
    wanted = [(host, port)] + [(urlsplit(b.url).hostname or host, urlsplit(b.url).port or 80) for b in config.backends]
    busy = [f"{h}:{p}" for h, p in wanted if not _port_free(h, p)]
    if busy:
        print(f"demo: port(s) already in use: {', '.join(busy)} (another demo running?)", file=sys.stderr)
        return 1
    children: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupt)  # before any child starts: a SIGTERM stops them all
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
        model = next((d.name for d in config.deployments or [] if d.adapter is None), SIM_MODEL)
        try:
            text = walkthrough(base, model)
            time.sleep(0.3)  # cosmetic: the proxy's access-log lines of those requests (batched) come out first
            print(text, flush=True)
        except (OSError, ValueError, KeyError, IndexError) as exc:  # the demo still runs without it
            print(f"demo: the walkthrough failed: {exc}", file=sys.stderr)
        print(examples(base, config), flush=True)
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
