"""The floor plus the proxy's own per-request work, in protocol callbacks only: what a callback-driven
request cycle could reach (issue 17's plain c=32 target).

A reference contender for loadtest/overhead.py (`--only ...,floor,floor_routed,proxy`), not a
proxy. Like loadtest/floor.py it is uvloop and httptools with pooled keep-alive upstream
connections and no task, future or ASGI message per request; unlike it, each request goes
through the proxy's real layers: the body parsed by proxy/parse.py, a replica chosen by
`prefix_affinity` (proxy/routing/affinity, no Redis), the upstream head built by `Backend`, a
first-byte timer, the response head with the request id and overhead header, the request's
metrics series (proxy/metrics.py) and its access-log line (proxy/accesslog.py). It leaves out
what the proxy does around them: timeouts beyond that one timer, client disconnects, retries,
the outlier and watchdog bookkeeping, error answers. A streamed answer is buffered and sent whole,
so only the plain columns mean anything.

    python -m loadtest.floor_routed --port 8301 --upstream http://127.0.0.1:8100
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from time import perf_counter
from urllib.parse import urlsplit

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from loadtest import floor
from loadtest.floor import run
from proxy.accesslog import LOGGER, AccessLog, usage_tokens
from proxy.config import AffinityConfig, BackendConfig, LoggingConfig
from proxy.metrics import Metrics
from proxy.parse import CHAT, parse_request
from proxy.routing.affinity import PrefixAffinity
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route

MODEL = "bench-model"
_PATH = CHAT.encode()
_PREFIX = os.urandom(6).hex().encode()  # request ids as the proxy makes them (a counter after a per-process prefix)
_ids = itertools.count()
_TIMEOUT_S = 30.0


class Upstream(floor.Upstream):
    """The floor's upstream connection, whose answer is parsed, then handed to the client whole."""

    def __init__(self, pool: list["Upstream"]) -> None:
        super().__init__(pool)  # type: ignore[arg-type]
        self.client: Client | None = None  # type: ignore[assignment]
        self.body: list[bytes] = []
        self.ctype = b"application/json"
        self.timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.ctype = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        payload = b"".join(self.body)
        self.body.clear()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.transport.is_closing():  # type: ignore[union-attr]
            self.pool.append(self)
        if client is not None:
            client.respond(self.parser.get_status_code(), self.ctype, payload)


class Client(asyncio.Protocol):
    """One client connection: a complete POST to the chat path is routed and forwarded; anything
    else (the benchmark's readiness probe) gets `{}`."""

    def __init__(self, app: "App") -> None:
        self.app = app
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.started = 0.0
        self.rid = b""
        self.backend: Backend | None = None
        self.series = None
        self.stream = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))  # (unread: kept because the proxy pays for collecting them)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.body.clear()
        if self.url != _PATH:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")  # type: ignore[union-attr]
            return
        app = self.app
        self.started = perf_counter()
        self.rid = b"%s%012x" % (_PREFIX, next(_ids))
        parsed = parse_request(CHAT, body)
        route = app.routes[parsed.model]
        pick = app.policy.pick(route.backends, parsed, route)
        try:  # (prefix_affinity's pick awaits nothing without Redis or a prompt being computed)
            pick.send(None)
        except StopIteration as done:
            backend, reason = done.value
        else:
            raise RuntimeError("the pick suspended")
        self.backend = backend
        self.stream = parsed.stream
        backend.in_flight += 1
        metrics = app.metrics
        metrics.child(metrics.decisions, app.policy.name, reason).inc()
        self.series = metrics.series(route.name, backend.name, CHAT)
        app.forward(self, backend.request_head(CHAT, len(body), self.rid) + body)

    def respond(self, status: int, ctype: bytes, payload: bytes) -> None:
        app, backend = self.app, self.backend
        backend.in_flight -= 1  # type: ignore[union-attr]
        if self.transport.is_closing():  # type: ignore[union-attr]
            return
        overhead = perf_counter() - self.started
        self.transport.write(  # type: ignore[union-attr]
            STATUS_LINE[status] + b"content-type: " + ctype + b"\r\ncontent-length: %d\r\n" % len(payload)
            + b"x-vllm-proxy-overhead-ms: %.3f\r\nx-request-id: %s\r\n\r\n" % (overhead * 1000.0, self.rid) + payload)
        ended = perf_counter()
        series = self.series
        series.status(str(status)).inc()  # type: ignore[union-attr]
        series.duration.observe(ended - self.started)  # type: ignore[union-attr]
        series.overhead.observe(overhead)  # type: ignore[union-attr]
        tokens = usage_tokens(payload)
        app.metrics.count_key(None, str(status), MODEL, tokens)
        if app.access.wanted():
            app.access.write(self.rid.decode(), CHAT, MODEL, backend.name, "pinned", str(status),  # type: ignore[union-attr]
                             self.stream, ended - self.started, None, overhead, tokens, None)


class App:
    def __init__(self, upstream: str) -> None:
        url = urlsplit(upstream)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.pool: list[Upstream] = []
        backend = Backend(BackendConfig(name="b0", url=upstream, models=[MODEL]))
        backend.healthy = True
        backend.heads[CHAT] = backend.head_prefix("POST", CHAT)
        self.routes = {MODEL: Route(name=MODEL, model=MODEL, adapter=None, backends=(backend,))}
        self.policy = PrefixAffinity(AffinityConfig())
        self.metrics = Metrics()
        logging.getLogger(LOGGER).setLevel(logging.INFO)  # (what the proxy's log setup does)
        self.access = AccessLog(LoggingConfig())

    def forward(self, client: Client, request: bytes) -> None:
        if self.pool:
            self._send(self.pool.pop(), client, request)
        else:
            asyncio.ensure_future(self._connect(client, request))

    async def _connect(self, client: Client, request: bytes) -> None:
        _, upstream = await asyncio.get_running_loop().create_connection(lambda: Upstream(self.pool), self.host, self.port)
        self._send(upstream, client, request)

    @staticmethod
    def _send(upstream: Upstream, client: Client, request: bytes) -> None:
        upstream.client = client
        upstream.timer = asyncio.get_running_loop().call_later(_TIMEOUT_S, upstream.transport.close)  # type: ignore[union-attr]
        upstream.transport.write(request)  # type: ignore[union-attr]


async def serve(port: int, upstream: str) -> None:
    app = App(upstream)
    server = await asyncio.get_running_loop().create_server(lambda: Client(app), "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    run(serve, __doc__)
