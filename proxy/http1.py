"""A lean HTTP/1.1 keep-alive client for the data path: asyncio Protocol + httptools' parser.

Measured on the overhead benchmark, aiohttp's ClientSession spent ~60 % of the proxy's CPU per
forwarded request building and tracking request objects we do not need. This client writes one
pre-formatted request in one call, parses the answer with httptools (chunked decoding in C), and
hands body bytes over as they arrive — batched when several arrive between two reads of ours.
Timeouts: connect, first byte (headers), the idle gap between body chunks and a total deadline.

The upstream is not trusted to speak HTTP well (a broken replica, an intermediary), and a reply
read for the wrong request would hand one user's completion to another. So, as nginx and Envoy
do: interim 1xx responses are skipped (101 was never asked for: 502), a status outside 100-599
is a 502, bytes past the end of a response are discarded and retire the connection, a body
delimited by the connection's end is complete at that end, a plain body is buffered only up to
a limit, and a request already written is never sent again (the upstream may have run it).
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any, Callable, Final, Optional

import httptools

_HIGH_WATER: Final = 1 << 20  # pause reading the upstream when this much is buffered for a slow client
_MAX_HEAD: Final = 1 << 20  # an upstream's status line and headers beyond this are a protocol error
PING: Final = b": ping\n\n"  # an SSE comment: clients ignore it, idle-timeout proxies see traffic

log: Final = logging.getLogger("vllm_proxy.upstream")


class UpstreamError(Exception):
    """`kind`: connect | timeout | reset | protocol — as the metrics and the error mapping name
    them. `protocol`: the upstream broke HTTP (bad status, unasked upgrade, oversized answer)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing the rest of the data."""


class Response:
    __slots__ = ("status", "content_type", "content_length", "_conn", "_buf", "_size", "_waiter", "done", "_error",
                 "_idle_timeout", "_deadline", "keep_alive", "got_bytes", "_boundary", "unsent", "notify")

    def __init__(self, conn: "_Connection", idle_timeout: float, deadline: float) -> None:
        self.status = 0
        self.content_type = b"application/json"
        self.content_length = -1  # -1: not given (chunked, or delimited by the connection's end)
        self._conn = conn
        self._buf: list[bytes] = []
        self._size = 0
        self._waiter: Optional[asyncio.Future] = None
        self.done = False
        self._error: Optional[UpstreamError] = None
        self._idle_timeout = idle_timeout
        self._deadline = deadline  # loop.time() by which the whole exchange must be over
        self.keep_alive = False
        self.got_bytes = False
        self._boundary = True  # the body handed out so far ends between two SSE events
        self.unsent = False  # the connection died before the request was written: nothing reached the upstream
        # Called instead of waking a waiter, for an exchange driven by callbacks (proxy/fastpath.py):
        # at the end of the read that made progress (never inside the parser), or at once otherwise.
        self.notify: Callable[[], None] | None = None

    # -- fed by the protocol --------------------------------------------------------------
    def _wake(self) -> None:
        if self.notify is not None:
            if not self._conn.feeding:
                self.notify()
            return
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
        loop = self._conn.loop  # (the running one: its connection's callbacks wake this waiter)
        left = self._deadline - loop.time()
        if left < timeout:
            if left <= 0:
                raise UpstreamError("timeout", "the upstream exceeded the total deadline")
            timeout, what = left, "the upstream exceeded the total deadline"
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
                if self._conn.loop.time() >= self._deadline:
                    raise
                if self._boundary and not self._buf and time.monotonic() - silent_since < self._idle_timeout:
                    return PING
        data = self.take()
        self._boundary = data.endswith(b"\n\n")
        return data

    def buffered(self) -> bool:
        """Body bytes wait to be taken: `next_chunk` returns them without waiting."""
        return bool(self._buf)

    def ended(self) -> bool:
        """The whole body arrived and was taken: `next_chunk` returns None."""
        return self.done and not self._buf and self._error is None

    def take(self) -> bytes:
        """The body bytes buffered so far (b"" if none), reading resumed if they had paused it."""
        buf = self._buf
        if not buf:
            return b""
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        if self._size > _HIGH_WATER:
            self._conn.transport.resume_reading()
        self._size = 0
        return data

    async def read(self, limit: Optional[int] = None) -> bytes:
        """The whole body; more than `limit` bytes is an UpstreamError (nothing is buffered past it)."""
        if limit is not None and self.content_length > limit:
            raise UpstreamError("protocol", f"the upstream's response body ({self.content_length} bytes) exceeds {limit} bytes")
        parts = []
        size = 0
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                raise body_too_large(limit)
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


def body_too_large(limit: int) -> UpstreamError:
    return UpstreamError("protocol", f"the upstream's response body exceeds {limit} bytes")


def _expire(waiter: asyncio.Future, what: str) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamError("timeout", what))


class _Connection(asyncio.Protocol):
    __slots__ = ("pool", "key", "loop", "transport", "parser", "response", "closed", "idle_since", "_interim",
                 "_framed", "_head_bytes", "_request", "feeding")

    def __init__(self, pool: "Pool", key: tuple, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.key = key
        # its event loop, kept: asyncio.get_running_loop() is a getpid() system call on Python < 3.12
        self.loop = loop
        self.transport: Any = None  # (uvloop's or asyncio's; None until connected)
        self.parser: Any = None
        self.response: Optional[Response] = None
        self.closed = False
        self.idle_since = 0.0
        self._interim = False  # the message being parsed is a 1xx interim response
        self._framed = False  # the final response has a Content-Length or is chunked
        self._head_bytes = 0
        self._request: Optional[bytes] = None  # queued for the pool's next write pass
        self.feeding = False  # inside data_received: a callback-driven response is notified after it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def start(self, request: bytes, idle_timeout: float, deadline: float) -> Response:
        self.response = response = Response(self, idle_timeout, deadline)
        if self.parser is None:  # (a pooled connection's parser stands between two responses)
            self.parser = httptools.HttpResponseParser(self)
        self._interim = self._framed = False
        self._head_bytes = 0
        if self.transport.is_closing():
            self.response = None
            self.abort()
            raise UpstreamError("connect", "the connection closed before the request was written")
        self._request = request
        self.pool._queue(self)
        return response

    def _write(self) -> None:
        """Write the queued request (the pool's write pass)."""
        request, self._request = self._request, None
        if request is None or self.closed:  # (the exchange was abandoned before its write)
            return
        try:
            if self.transport.is_closing():
                raise RuntimeError
            self.transport.write(request)
        except RuntimeError:  # uvloop: the handle closed (a reset) before connection_lost ran
            self._unwritten()
        except Exception:  # (anything else: this request fails, the pass goes on with the others)
            log.exception("writing a request to %s:%s failed", *self.key[1:])
            self._unwritten()

    def _unwritten(self) -> None:
        response = self.response
        self.abort()
        if response is not None:
            response.unsent = True
            response._fail(UpstreamError("connect", "the connection closed before the request was written"))

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.done:
            self._excess(len(data))  # bytes nobody asked for: the connection is not reusable
            return
        response.got_bytes = True
        self.feeding = True
        try:
            self._parse(response, data)
        finally:
            self.feeding = False
        if response.notify is not None:
            response.notify()

    def _parse(self, response: Response, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if response.done:  # bytes after the end of the response: discarded
                self._excess(-1)
                return
            if not isinstance(exc.__context__, _Stop):
                response._fail(UpstreamError("protocol", f"malformed response from the upstream: {exc}"))
            self.abort()
            return
        except httptools.HttpParserUpgrade:
            self.abort()  # on_headers_complete refused the 101 already
            return
        if not response.status:  # a head still incomplete after this read (rare): bound it
            self._head_bytes += len(data)
            if self._head_bytes > _MAX_HEAD:
                response._fail(UpstreamError("protocol", f"the upstream's response head exceeds {_MAX_HEAD} bytes"))
                self.abort()

    def _excess(self, size: int) -> None:
        log.warning("upstream %s:%s sent %s bytes past the end of its response; discarded, connection closed",
                    self.key[1], self.key[2], size if size >= 0 else "more")
        self.abort()

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name)
        response: Response = self.response  # type: ignore[assignment]  # (parser callbacks run while it is set)
        if size == 12 and name.lower() == b"content-type":
            response.content_type = value
        elif size == 14 and name.lower() == b"content-length":
            self._framed = True
            try:
                response.content_length = int(value)
            except ValueError:
                pass  # llhttp refuses it
        elif size == 17 and name.lower() == b"transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        response: Response = self.response  # type: ignore[assignment]
        if response.done:
            raise _Stop  # a second response to one request: never read it as the next request's answer
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:  # we never ask for an upgrade
                response._fail(UpstreamError("protocol", "the upstream switched protocols unasked (101)"))
                raise _Stop
            self._interim = True  # 100 Continue, 102, 103 Early Hints: the real answer follows
            self._framed = False
            response.content_type = b"application/json"
            response.content_length = -1
            return
        if not 200 <= status <= 599:
            response._fail(UpstreamError("protocol", f"the upstream answered with status {status}"))
            raise _Stop
        response.status = status
        response._wake()

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)  # type: ignore[union-attr]  # (set while the parser runs)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        response: Response = self.response  # type: ignore[assignment]
        response.keep_alive = self.parser.should_keep_alive()
        response.done = True
        response._wake()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        if self._request is not None:  # closed before its write pass: nothing was sent
            self._request = None
            self._unwritten()
            return
        response = self.response
        if response is not None and not response.done:
            if response.status and not self._framed and response._error is None:
                response.done = True  # a body delimited by the connection's end is complete now
                response._wake()
            else:
                response._fail(UpstreamError("reset", "the upstream closed the connection"))

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.abort()


class Pool:
    """Keep-alive connections per upstream origin, most recently used first.

    Requests are written in one pass per event-loop turn, after every request of the turn was
    routed, not one by one as each is: a replica sharing the proxy's CPU (a co-located server,
    a small host) is woken by the first write and would otherwise preempt the proxy once per
    request, costing a context switch pair and the cold caches after it (measured: 0.93 forced
    switches a request, 0.78 in passes; 4-33 % more plain throughput at 32 connections in four
    interleaved runs, no change at one: loadtest/overhead.py --taskset, docs/BENCHMARKS.md)."""

    def __init__(self, keep_alive_s: float, max_body_bytes: Optional[int] = None):
        self.keep_alive_s = keep_alive_s
        self.max_body_bytes = max_body_bytes  # the most Response.read() buffers (None: no limit)
        self._idle: dict[tuple, list[_Connection]] = {}
        self._ssl: Optional[ssl.SSLContext] = None
        self._unsent: list[_Connection] = []  # started this turn, written by `_write_all`
        self._after: list[Callable[[], None]] = []  # run by `_write_all` once it has written them

    def _queue(self, conn: _Connection) -> None:
        if not self._unsent:
            conn.loop.call_soon(self._write_all)
        self._unsent.append(conn)

    def after_writes(self, callback: Callable[[], None]) -> bool:
        """Run `callback` right after this turn's write pass: work that can wait until the
        requests are on their way (the pick's bookkeeping). False: no pass is pending."""
        if not self._unsent:
            return False
        after = self._after
        if not after or after[-1] is not callback:  # (every request of a turn passes the same one)
            after.append(callback)
        return True

    def _write_all(self) -> None:
        batch, self._unsent = self._unsent, []
        for conn in batch:
            conn._write()
        if self._after:
            after, self._after = self._after, []
            for callback in after:
                callback()

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
                loop.create_connection(lambda: _Connection(self, key, loop), host, port, ssl=context), timeout
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
            # `closed` follows connection_lost, which uvloop runs a moment after the transport
            # closed: a connection closing in between is as dead
            if not conn.closed and conn.idle_since > deadline and not conn.transport.is_closing():
                return conn
            conn.abort()
        return None

    def start_pooled(self, key: tuple, request: bytes, timeouts, now: float) -> Optional[Response]:
        """`request` started on an idle pooled connection (written in this turn's pass), or None
        when none is idle or the one found closed before the write (nothing was sent)."""
        conn = self._reuse(key)
        if conn is None:
            return None
        try:
            return conn.start(request, timeouts.idle, now + timeouts.total)
        except UpstreamError:
            return None

    async def request(self, key: tuple, head: bytes, body: bytes, timeouts) -> Response:
        """Send `head` (request line and headers, ending in a blank line) and `body`; return once
        the response headers arrived. `timeouts` has `connect`, `first_byte`, `idle` and `total`
        seconds. A request is written once: if a pooled connection turns out dead after the
        write, that is an error, never a second send (the upstream may have started it: an LLM
        call is not idempotent)."""
        request = head + body
        loop = asyncio.get_running_loop()
        now = loop.time()
        response = self.start_pooled(key, request, timeouts, now)
        reused = response is not None
        if response is not None:
            conn = response._conn
        else:
            conn, response, now = await self._start_fresh(key, request, timeouts)
        # The head must be complete by `by`: one dripping in byte by byte (or interim responses)
        # does not extend it.
        left = timeouts.first_byte
        by = now + left
        try:
            while not response.status:
                if response._error is not None:
                    if not (response.unsent and reused):
                        raise response._error
                    # the pooled connection died before the write: nothing was sent, a fresh one takes it
                    reused = False
                    conn, response, now = await self._start_fresh(key, request, timeouts)
                    left = timeouts.first_byte
                    by = now + left
                    continue
                if left <= 0:
                    raise UpstreamError("timeout", "the upstream did not answer in time")
                await response._wait(left, "the upstream did not answer in time")
                left = by - loop.time()
        except BaseException:
            conn.abort()
            raise
        return response

    async def _start_fresh(self, key: tuple, request: bytes, timeouts) -> tuple[_Connection, Response, float]:
        """A new connection with `request` started on it, and the loop time it started."""
        conn = await self._connect(key, timeouts.connect)
        now = asyncio.get_running_loop().time()
        return conn, conn.start(request, timeouts.idle, now + timeouts.total), now

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
