"""Real servers for tests: any ASGI app under uvicorn on an ephemeral loopback port, in a thread."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import uvicorn

from proxy.sim.app import read_body


def reuse_default_ssl_context() -> None:
    """httpx builds a new SSL context for every client (reading certifi's bundle: ~20 ms of CPU),
    and `httpx.post` or `openai.OpenAI()` make one client each, thousands of times in this suite,
    which only speaks plain HTTP on loopback: build the default context once. (httpx >= 0.28;
    older versions keep their own behaviour.)"""
    from httpx._transports import default

    create = getattr(default, "create_ssl_context", None)
    if create is None or getattr(create, "reused", False):
        return
    built: dict[bool, Any] = {}

    def create_once(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in built:
            built[trust_env] = create(verify=verify, cert=cert, trust_env=trust_env)
        return built[trust_env]

    create_once.reused = True  # type: ignore[attr-defined]
    default.create_ssl_context = create_once


class ServerThread:
    """Runs `app` under a real uvicorn server in a background thread; `url` is its base URL."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, **config: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))  # a given port: a replica restarted where it was
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config.setdefault("log_level", "warning")
        config.setdefault("lifespan", "on")
        config.setdefault("timeout_graceful_shutdown", 2)
        self.server = uvicorn.Server(uvicorn.Config(app, **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CaptureBackend:
    """A minimal OpenAI-shaped upstream that records every request body it receives, for checking
    what the proxy actually forwarded."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.bodies: list[bytes] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if scope["method"] == "GET":
            payload = b'{"object":"list","data":[{"id":"%s","object":"model","parent":null}]}' % self.model.encode()
        else:
            self.bodies.append(body)
            payload = (
                b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"%s","choices":[{"index":0,'
                b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
                b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}' % self.model.encode()
            )
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


def sim_faults(url: str, **changes: Any) -> dict:
    """Set fault-injection fields of the simulated replica at `url` (POST /sim/faults)."""
    resp = httpx.post(url + "/sim/faults", json=changes, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


@contextlib.contextmanager
def held(url: str, *models: str) -> Iterator[None]:
    """While the block runs, every inference request the simulated replica at `url` schedules (for
    one of `models`, if given: model ids or adapter names) waits before its prefill (the `hold`
    gate): a test observes an in-flight state for as long as it needs, instead of racing the wall
    clock. `sim_faults(url, hold_only=[...])` changes the set inside; leaving releases them all."""
    sim_faults(url, hold=True, hold_only=list(models))
    try:
        yield
    finally:
        sim_faults(url, hold=False, hold_only=[])
