"""The floor of a Python forwarder: the least a proxy in this language can do per request.

A reference contender for loadtest/overhead.py (`--only ...,floor`), not a proxy: one upstream,
no routing, no metrics, no log, no timeouts, no error handling. uvloop and httptools as the
proxy uses them; a pool of keep-alive upstream connections; the client's request bytes written
to the upstream as received, the upstream's response bytes written back as they arrive (the
parser only finds where each message ends), so plain and streamed answers pass alike. What the
proxy spends per request beyond this contender is the cost of its own Python layers, not of the
language or the event loop.

    python -m loadtest.floor --port 8300 --upstream http://127.0.0.1:8100
"""
from __future__ import annotations

import argparse
import asyncio
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import httptools
import uvloop


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the upstream, serving one client request at a time."""

    def __init__(self, pool: list["Upstream"]) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None:
            client.transport.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if not self.transport.is_closing():  # type: ignore[union-attr]
            self.pool.append(self)
        if client is not None:
            client.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        if self.client is not None:  # (an upstream that closed mid-answer: so does the client's connection)
            self.client.transport.close()  # type: ignore[union-attr]


class Client(asyncio.Protocol):
    """One client connection: each complete request goes to a pooled upstream connection."""

    def __init__(self, pool: list[Upstream], host: str, port: int) -> None:
        self.pool, self.host, self.port = pool, host, port
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.raw: list[bytes] = []
        self.queued: list[bytes] = []  # complete requests not yet sent (pipelined)
        self.busy = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.raw.append(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.queued.append(b"".join(self.raw))
        self.raw.clear()
        if not self.busy:
            self.resume()

    def resume(self) -> None:
        self.busy = False
        if self.queued:
            self.busy = True
            request = self.queued.pop(0)
            if self.pool:
                self.send(self.pool.pop(), request)
            else:
                asyncio.ensure_future(self.connect(request))

    async def connect(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(lambda: Upstream(self.pool), self.host, self.port)
        self.send(upstream, request)

    def send(self, upstream: Upstream, request: bytes) -> None:
        upstream.client = self
        upstream.transport.write(request)  # type: ignore[union-attr]


async def serve(port: int, upstream: str) -> None:
    url = urlsplit(upstream)
    pool: list[Upstream] = []
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(pool, url.hostname or "127.0.0.1", url.port or 80),
                                      "127.0.0.1", port)
    await server.serve_forever()


def run(serve_on: Callable[[int, str], Awaitable[None]], doc: str | None) -> None:
    """The command line of a reference contender: `--port` to listen on, `--upstream` to forward to."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="base URL of the one upstream, e.g. http://127.0.0.1:8100")
    args = ap.parse_args()
    uvloop.run(serve_on(args.port, args.upstream))


def main() -> None:
    run(serve, __doc__)


if __name__ == "__main__":
    main()
