"""uvicorn's HTTP protocol with a lean request cycle for the inference POSTs.

uvicorn's generic cycle costs about as much CPU per request as everything the proxy itself does
(measured on loadtest/overhead.py): it validates every response header with two regexes, writes
the head and the body of a response in two system calls, and the disconnect watch the proxy needs
costs a second task per request, blocked in `receive()`. For POST /v1/chat/completions,
/v1/completions and /v1/embeddings, `ProxyProtocol` runs the app with `LeanCycle`
(proxy/cycle.py) instead: the same ASGI scope, receive and send, but a plain response leaves in
one write (head and body), headers are trusted (the proxy builds them), and the client's
disconnect cancels the request task directly (`scope[DISCONNECT].arm()`, see proxy/inference.py). The task
starts only once the body is complete: a plain request may be served without one, in callbacks
(the app's `serve_in_callbacks`, proxy/fastpath.py), with `LeanCycle.respond` writing its answer.
The reads and the parser callbacks go to the connection's `Intake` (proxy/intake.py, compiled),
which starts these cycles and hands every other request to uvicorn's (`generic_*` below).

Everything else (other paths, pipelined requests, `Expect: 100-continue`, upgrades, keep-alive,
flow control, graceful shutdown) stays uvicorn's. Use it with `uvicorn.Config(http=ProxyProtocol)`
(or `http=ProxyProtocol.configured(server_config)`).

uvicorn's httptools protocol has no read timeouts and no header limits: a socket that never sends,
or drips a byte every few seconds, stays open for good, and a 256 MiB header is buffered (and
concatenated piece by piece) before the app ever sees it. As nginx and Envoy do, a request's
head must be complete within `header_timeout_s` of its first byte (of the connection, for the
first request: an idle connection is closed then), a body may not stall for `body_timeout_s`,
and a head larger than `max_header_bytes` or with more than `max_headers` fields is a 431; the
client gets an OpenAI error envelope and the connection is closed. As nginx's `send_timeout`, a
client that reads nothing of its answer for `send_timeout_s` is dropped: else it holds the
answer's bytes (up to `max_response_bytes`) and a stream's upstream request for good. One
watchdog timer per connection checks these, and the keep-alive timeout of an idle connection, a
few times per timeout; a request pays a few attribute writes.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import resource
from typing import Any

import httptools
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from proxy.cycle import LeanCycle
from proxy.errors import ProxyError
from proxy.intake import BODY, HEAD, LINGER, REST, Intake

log = logging.getLogger("vllm_proxy")


# uvicorn options the lean cycle cannot honour (it bypasses the code that applies them), with
# their defaults: refused rather than silently ignored (`refuse_unsupported`)
UNSUPPORTED_OPTIONS = {"limit_concurrency": None, "root_path": "", "reset_contextvars": False}


def refuse_unsupported(config: Any) -> None:
    """Raise ValueError naming every UNSUPPORTED_OPTIONS entry `config` (a uvicorn.Config) sets."""
    found = [f"{name}={getattr(config, name)!r}" for name, default in UNSUPPORTED_OPTIONS.items()
             if getattr(config, name, default) != default]
    if found:
        raise ValueError(
            f"uvicorn option(s) {', '.join(found)} not supported with vllm-proxy's HTTP protocol "
            "(proxy/server.py): its inference cycle bypasses them. Leave them unset (concurrency: "
            "server.max_queue and backends[].max_in_flight)."
        )


_LINGER_S = 2.0  # after a refusal, read and discard this long so the client sees the answer, not a reset
# Requests parsed ahead of the one being answered. uvicorn queues every request a read holds (a
# 256 KiB read of `GET /health` is 10 000 of them, ~17 MB) and reads on after each answer, so one
# connection could grow without bound. nginx and Envoy parse the next request only when the
# current one is answered; we answer what is queued and close (RFC 9112 9.3.2: the client retries
# the rest).
MAX_PIPELINED = 64
_PIPELINE_FULL = (0, "", "")


def in_callbacks_hook(app: Any) -> Any:
    """The app's `serve_in_callbacks(cycle) -> bool` (proxy/app.py), or None. uvicorn's
    X-Forwarded-* middleware is looked through: what it rewrites (the client address, the scheme)
    is read by no inference request."""
    if isinstance(app, ProxyHeadersMiddleware):
        app = app.app
    return getattr(app, "serve_in_callbacks", None)


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request that gets a 431 instead."""


class ProxyProtocol(HttpToolsProtocol):
    lean: "LeanCycle | None" = None  # the lean cycle in progress (self.cycle may be a queued one)
    # defaults as in ServerConfig; `configured()` makes a subclass with a config's values
    header_timeout_s = 30.0
    body_timeout_s = 30.0
    send_timeout_s = 60.0
    max_header_bytes = 64 * 1024
    max_headers = 100
    # Beyond this many open connections (default: 3/4 of the fd limit), connections that hold a
    # slot without a request in progress (idle, or a head or body stalled for a second) are
    # closed, at most every half second, so that new clients still get a file descriptor.
    shed_above: int | None = None
    _last_shed = 0.0

    _LIMITS = ("header_timeout_s", "body_timeout_s", "max_header_bytes", "max_headers", "send_timeout_s")

    @classmethod
    def configured(cls, server: Any) -> "functools.partial[ProxyProtocol]":
        """The protocol factory with the read timeouts and header limits of `server` (a
        ServerConfig); a partial, not a subclass, so uvicorn options still pickle to workers."""
        return functools.partial(cls, limits=tuple(getattr(server, name) for name in cls._LIMITS))

    def __init__(self, *args: Any, limits: tuple | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.limit_concurrency is not None or self.root_path or self.config.reset_contextvars:
            refuse_unsupported(self.config)  # under a server other than DrainingServer (which refuses at startup)
        if limits is not None:
            for name, value in zip(self._LIMITS, limits):
                setattr(self, name, value)
        # the parser reports to the compiled intake, and uvloop hands it the reads (it takes the
        # protocol's `data_received` when the transport is made, after this)
        if "draining" not in vars(self.server_state):  # (proxy/drain.py sets it; the intake reads it)
            self.server_state.draining = False  # type: ignore[attr-defined]
        self.intake = Intake(self, self.max_headers, self.max_header_bytes)
        self.parser = self.intake.parser = httptools.HttpRequestParser(self.intake)
        self.data_received = self.intake.data_received  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.intake.connected(in_callbacks_hook(self.app))
        self._refusal: tuple[int, str, str] | None = None
        self._unsent = 0  # the write buffer's size at the last tick, while the client left it unread
        self._unsent_since = 0.0  # since when (0: the client is reading, or nothing is pending)
        self._watch = self.loop.call_later(self._tick_s(), self._watchdog)
        if len(self.connections) > self._shed_threshold():
            self._shed()

    @classmethod
    def _shed_threshold(cls) -> int:
        if cls.shed_above is None:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            cls.shed_above = soft * 3 // 4 if soft != resource.RLIM_INFINITY else 1 << 30
        return cls.shed_above

    def _shed(self) -> None:
        now = self.loop.time()
        if now - ProxyProtocol._last_shed < 0.5:
            return
        ProxyProtocol._last_shed = now
        shed = 0
        for conn in list(self.connections):
            if conn is not self and isinstance(conn, ProxyProtocol) and conn._idle_for(now) > 1.0:
                conn.transport.close()
                shed += 1
        log.warning("%d open connections exceed %d: closed %d idle or stalled ones",
                    len(self.connections), self.shed_above, shed)

    def _idle_for(self, now: float) -> float:
        """How long this connection has held its slot without a request making progress."""
        intake = self.intake
        phase = intake.phase
        if phase == HEAD or phase == BODY:
            return now - intake.since if intake.since else 0.0
        if phase == REST and intake.idle_since:
            return now - intake.idle_since
        return 0.0

    def _tick_s(self) -> float:
        return min(self.header_timeout_s, self.body_timeout_s, self.timeout_keep_alive) / 4

    def _watchdog(self) -> None:
        if self._send_stalled():
            self.transport.abort()  # its unsent bytes are dropped
            return
        if self.transport.is_closing():
            if self._unsent:  # a close waits for the client to read the rest: bounded by the send timeout
                self._watch = self.loop.call_later(self._tick_s(), self._watchdog)
            return
        intake = self.intake
        phase = intake.phase
        waited = self.loop.time() - intake.since
        if phase == HEAD and waited > self.header_timeout_s:
            if intake.head_bytes:
                self.refuse(408, "The request head was not received in time.", "request_timeout")
            else:
                self.transport.close()  # an idle connection: nothing to answer
            return
        if phase == BODY and waited > self.body_timeout_s:
            self.refuse(408, "The request body stalled.", "request_timeout")
            return
        if phase == REST and intake.idle_since and self.loop.time() - intake.idle_since > self.timeout_keep_alive:
            # idle past the keep-alive timeout (within a tick of it); the ticks go on, as a close
            # waits for the client to read the rest (bounded by the send timeout)
            self.transport.close()
        self._watch = self.loop.call_later(self._tick_s(), self._watchdog)

    def _send_stalled(self) -> bool:
        """Whether bytes for the client have waited `send_timeout_s` with no sign it reads them
        (the buffer shrinking between two ticks, or flow control resuming writes)."""
        unsent = self.transport.get_write_buffer_size()
        if not unsent:
            self._unsent = 0
            self._unsent_since = 0.0
            return False
        now = self.loop.time()
        if not self._unsent_since or unsent < self._unsent:
            self._unsent_since = now
        self._unsent = unsent
        return now - self._unsent_since > self.send_timeout_s

    def resume_writing(self) -> None:
        self._unsent_since = 0.0  # the client read down to the low-water mark
        super().resume_writing()

    def refuse(self, status: int, message: str, code: str) -> None:
        """Answer `status` with an error envelope and close (the request is not read further). A
        request whose app already answered in part is only cut off; one whose app still waits for
        the body (a malformed chunk after a valid head) sees a disconnect and we answer for it."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle._started if type(cycle) is LeanCycle else cycle.response_started:
                self.transport.close()
                return
            cycle.disconnected = cycle.response_complete = True  # the app answers nothing more
            cycle.message_event.set()
        body = ProxyError(status, message, code=code).body()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        # Lingering close (as nginx): closing with unread request bytes would send a reset that can
        # destroy the answer in flight; half-close, discard what still comes, close soon after.
        self.intake.phase = LINGER
        try:
            self.transport.write_eof()
        except (NotImplementedError, AttributeError, RuntimeError, OSError):
            self.transport.close()
            return
        self.loop.call_later(_LINGER_S, self.transport.close)

    def send_400_response(self, msg: str) -> None:
        refusal = self._refusal
        if refusal is _PIPELINE_FULL:
            self.intake.phase = LINGER  # the rest of what the client sends is discarded
            self.cycle.keep_alive = False  # type: ignore[union-attr] # the last queued answer closes the connection
        elif refusal is not None:
            self.refuse(*refusal)
        else:
            self.refuse(400, msg, "invalid_http_request")

    def feed_failed(self, exc: Exception) -> None:
        """What uvicorn's data_received does when the parser raises (the intake's feed_data)."""
        if isinstance(exc, httptools.HttpParserError):  # (a refusal raised in a callback too)
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        elif isinstance(exc, httptools.HttpParserUpgrade):
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        else:
            raise exc

    def refuse_head(self) -> None:
        """Header count and size limits, checked in on_headers_complete (raises _Refused)."""
        if len(self.headers) > self.max_headers:
            self._refusal = (431, f"More than {self.max_headers} request header fields.", "headers_too_large")
            raise _Refused
        # the read held more than the head (its body, say): measure the head itself
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.max_header_bytes:
            self._refusal = (431, f"Request header fields exceed {self.max_header_bytes} bytes.", "headers_too_large")
            raise _Refused

    def _refuse_upgrade(self) -> None:
        """We serve no other protocol (WebSocket, h2c), so an upgrade request is answered as plain
        HTTP, as nginx does; but httptools hands what follows its head to the new protocol, so a
        body would be lost (the request answered as if empty): such a request is a 400 instead."""
        for name, value in self.headers:
            if (name == b"content-length" and value.strip(b" \t0")) or name == b"transfer-encoding":
                self._refusal = (400, "Upgrade is not supported: send the request without the Upgrade header "
                                      "(for HTTP/2 without TLS, use prior knowledge).", "upgrade_not_supported")
                raise _Refused

    def on_response_complete(self) -> None:
        """(uvicorn's cycles call this; the lean cycle calls the intake's directly)"""
        self.intake.response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        # With a pipelined request queued behind it, `self.cycle` is that one, not the running
        # lean cycle: tell the running one too, so its upstream request is closed.
        lean = self.lean
        if lean is not None and lean is not self.cycle and not lean.response_complete:
            lean.disconnected = True
            lean.set()
        super().connection_lost(exc)

    # uvicorn's cycle, for every request but the inference POSTs (the intake calls these)
    generic_on_body = HttpToolsProtocol.on_body
    generic_on_message_complete = HttpToolsProtocol.on_message_complete

    def generic_headers_complete(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            self._refusal = _PIPELINE_FULL
            raise _Refused
        upgrade = self.parser.should_upgrade()
        if upgrade:
            self._refuse_upgrade()
        super().on_headers_complete()
        if upgrade and self.cycle is not None:
            self.cycle.keep_alive = False  # the parser stops at an upgrade: nothing after it is read

    def start_pending(self) -> None:
        """A request whose body is still arriving gets its task now (the drain waits for tasks)."""
        lean = self.lean
        if lean is not None and lean.task is None and not lean.response_complete:
            lean.spawn(self.app)

