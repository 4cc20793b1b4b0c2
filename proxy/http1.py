"""A lean HTTP/1.1 keep-alive client for the data path: asyncio Protocol + httptools' parser.

Measured on the overhead benchmark, aiohttp's ClientSession spent ~60 % of the proxy's CPU per
forwarded request building and tracking request objects we do not need. This client writes one
pre-formatted request in one call, parses the answer with httptools (chunked decoding in C), and
hands body bytes over as they arrive — batched when several arrive between two reads of ours.
Timeouts: connect, first byte (headers) and the idle gap between body chunks.
"""
from __future__ import annotations

import asyncio
import ssl
import time
from typing import Optional

import httptools

_HIGH_WATER = 1 << 20
PING = b": ping\n\n"  # an SSE comment: clients ignore it, idle-timeout proxies see traffic  # pause reading the upstream when this much is buffered for a slow client


class UpstreamError(Exception):
    """`kind`: connect | timeout | reset — as the metrics and the error mapping name them."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Response:
    __slots__ = ("status", "content_type", "_conn", "_buf", "_size", "_waiter", "done", "_error", "_idle_timeout",
                 "keep_alive", "got_bytes", "_boundary")

    def __init__(self, conn: "_Connection", idle_timeout: float) -> None:
        self.status = 0
        self.content_type = b"application/json"
        self._conn = conn
        self._buf: list[bytes] = []
        self._size = 0
        self._waiter: Optional[asyncio.Future] = None
        self.done = False
        self._error: Optional[UpstreamError] = None
        self._idle_timeout = idle_timeout
        self.keep_alive = False
        self.got_bytes = False
        self._boundary = True  # the body handed out so far ends between two SSE events

    # -- fed by the protocol --------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER:
            self._conn.transport.pause_reading()
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if not self.done and self._error is None:
            self._error = error
            self._wake()

    # -- used by the proxy ----------------------------------------------------------------
    async def _wait(self, timeout: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter, what)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def next_chunk(self, keepalive: Optional[float] = None) -> Optional[bytes]:
        """Everything that arrived since the last call; None at the end of the body. With
        `keepalive`, a silence that long between two SSE events yields an SSE comment instead."""
        silent_since = 0.0
        while not self._buf:
            if self._error is not None:
                raise self._error
            if self.done:
                return None
            if keepalive is None:
                await self._wait(self._idle_timeout, "the upstream went silent mid-body")
                continue
            now = time.monotonic()
            silent_since = silent_since or now
            left = self._idle_timeout - (now - silent_since)
            if left <= 0:
                raise UpstreamError("timeout", "the upstream went silent mid-body")
            try:
                await self._wait(min(keepalive, left), "the upstream went silent mid-body")
            except UpstreamError:
                if self._boundary and not self._buf and time.monotonic() - silent_since < self._idle_timeout:
                    return PING
        data = self._buf[0] if len(self._buf) == 1 else b"".join(self._buf)
        self._boundary = data.endswith(b"\n\n")
        self._buf.clear()
        if self._size > _HIGH_WATER:
            self._conn.transport.resume_reading()
        self._size = 0
        return data

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Drop the connection (the upstream sees the disconnect and aborts the request)."""
        self._conn.abort()

    def release(self) -> None:
        """Return the connection to the pool if the exchange ended cleanly, else drop it."""
        conn = self._conn
        if self.done and self.keep_alive and self._error is None and not conn.closed:
            conn.pool._put(conn)
        else:
            conn.abort()


def _expire(waiter: asyncio.Future, what: str) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamError("timeout", what))


class _Connection(asyncio.Protocol):
    __slots__ = ("pool", "key", "transport", "parser", "response", "closed", "idle_since")

    def __init__(self, pool: "Pool", key: tuple) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = None
        self.response: Optional[Response] = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, request: bytes, idle_timeout: float) -> Response:
        self.response = response = Response(self, idle_timeout)
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(request)
        return response

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.done:
            self.abort()  # bytes nobody asked for: the connection is not reusable
            return
        response.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(UpstreamError("reset", f"malformed response from the upstream: {exc}"))
            self.abort()

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"content-type":
            self.response.content_type = value  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        response = self.response
        response.status = self.parser.get_status_code()  # type: ignore[union-attr]
        response._wake()  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        response = self.response
        response.keep_alive = self.parser.should_keep_alive()  # type: ignore[union-attr]
        response.done = True  # type: ignore[union-attr]
        response._wake()  # type: ignore[union-attr]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response.done:
            if response.status and self.parser is not None:
                try:
                    self.parser.feed_data(b"")  # a body delimited by the connection's end is complete now
                except httptools.HttpParserError:
                    pass
            if not response.done:
                response._fail(UpstreamError("reset", "the upstream closed the connection"))

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.abort()


class Pool:
    """Keep-alive connections per upstream origin, most recently used first."""

    def __init__(self, keep_alive_s: float):
        self.keep_alive_s = keep_alive_s
        self._idle: dict[tuple, list[_Connection]] = {}
        self._ssl: Optional[ssl.SSLContext] = None

    def _put(self, conn: _Connection) -> None:
        conn.response = None
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    async def _connect(self, key: tuple, timeout: float) -> _Connection:
        scheme, host, port = key
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key), host, port, ssl=context), timeout
            )
        except asyncio.TimeoutError:
            raise UpstreamError("connect", f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        return conn

    def _reuse(self, key: tuple) -> Optional[_Connection]:
        idle = self._idle.get(key)
        deadline = time.monotonic() - self.keep_alive_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > deadline:
                return conn
            conn.abort()
        return None

    async def request(self, key: tuple, head: bytes, body: bytes, timeouts) -> Response:
        """Send `head` (request line and headers, ending in a blank line) and `body`; return once
        the response headers arrived. `timeouts` has `connect`, `first_byte` and `idle` seconds.
        A pooled connection that turns out closed before any byte of the answer is retried once
        on a fresh one (the upstream never saw that request)."""
        conn = self._reuse(key)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(key, timeouts.connect)
        response = conn.start(head + body, timeouts.idle)
        try:
            await self._headers(response, timeouts.first_byte)
        except UpstreamError as exc:
            if not (reused and exc.kind == "reset" and not response.got_bytes):
                conn.abort()
                raise
            conn = await self._connect(key, timeouts.connect)
            response = conn.start(head + body, timeouts.idle)
            try:
                await self._headers(response, timeouts.first_byte)
            except BaseException:
                conn.abort()
                raise
        except BaseException:
            conn.abort()
            raise
        return response

    async def _headers(self, response: Response, timeout: float) -> None:
        while not response.status:
            if response._error is not None:
                raise response._error
            await response._wait(timeout, "the upstream did not answer in time")

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
