"""Real servers for tests: any ASGI app under uvicorn on an ephemeral loopback port, in a thread."""
from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class ServerThread:
    """Runs `app` under a real uvicorn server in a background thread; `url` is its base URL."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", **config: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
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
