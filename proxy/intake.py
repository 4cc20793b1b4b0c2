"""`Intake`: the request side of proxy/server.py's `ProxyProtocol`, compiled (proxy/native.py).

uvloop calls `data_received` once a read and httptools calls six parser callbacks a request. As
methods of the protocol (interpreted: it subclasses uvicorn's Python class) they cost ~7 % of a
plain request's instructions (loadtest.instructions, lab configuration: 194.9k with them, 181.2k
compiled here). So the parser reports to this object instead, and uvloop calls
its `data_received`: it keeps the read-timeout bookkeeping the protocol's watchdog checks, reads
the head, and runs an inference POST (`LEAN_PATHS`) from its head to its dispatch: the lean cycle
(proxy/cycle.py), served in callbacks or in a task. Every other request goes to uvicorn's cycle,
through the protocol's `generic_*` methods, as before.
"""
from __future__ import annotations

from typing import Any, Final

from proxy.cycle import HIGH_WATER_LIMIT, LeanCycle
from proxy.parse import INFERENCE

LEAN_PATHS: Final = frozenset(path.encode() for path in INFERENCE)  # the inference POSTs' paths
# reading a head, a body; neither (app or keep-alive); refused
HEAD: Final = 0
BODY: Final = 1
REST: Final = 2
LINGER: Final = 3


class Intake:
    """The parser's protocol object of one connection (`httptools.HttpRequestParser(intake)`)."""

    def __init__(self, protocol: Any, max_headers: int, max_header_bytes: int) -> None:
        self.protocol: Any = protocol  # a ProxyProtocol
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes
        self.app: Any = protocol.app
        self.state: Any = protocol.server_state  # (its `draining` is set: ProxyProtocol.__init__)
        self.parser: Any = None  # the connection's httptools parser (the protocol makes it)
        self.loop: Any = protocol.loop
        self.pipeline: Any = protocol.pipeline  # uvicorn's queue of pipelined requests (a deque)
        self.transport: Any = None  # (set when connected)
        self.flow: Any = None
        self.in_callbacks: Any = None  # the app's `serve_in_callbacks`, or None (set when connected)
        # what every request's scope has of the connection (set when connected)
        self.asgi_version: Any = protocol.asgi_version
        self.app_state: Any = protocol.app_state
        self.server: Any = None
        self.client: Any = None
        self.scheme: Any = None
        self.root_path: Any = protocol.root_path
        # the read-timeout bookkeeping (ProxyProtocol's watchdog reads it)
        self.phase = HEAD
        self.since = 0.0  # when the head began, or the body last made progress (0: not yet)
        self.head_bytes = 0  # received since the current head began (>= its size, bounded by one read)
        self.idle_since = 0.0  # when the last answer completed, while the connection idles (0: it does not)
        # the head being read
        self.url = b""
        self.expect = False
        self.headers: list[tuple[bytes, bytes]] = []
        self.scope: dict[str, Any] = {}

    def connected(self, in_callbacks: Any) -> None:
        """After the protocol's connection_made: the connection's part of every scope."""
        p = self.protocol
        self.in_callbacks = in_callbacks
        self.server, self.client, self.scheme = p.server, p.client, p.scheme
        self.transport = p.transport
        self.flow = p.flow
        self.since = self.loop.time()  # an idle new connection waits for a head: the header timeout applies

    def data_received(self, data: bytes) -> None:
        # The common request arrives whole in one read: no clock is read for it. The clock starts
        # only for a head or body that a read leaves incomplete. (uvicorn's data_received also
        # cancels its keep-alive timer: ProxyProtocol never arms it, its watchdog does that job.)
        p = self.protocol
        self.idle_since = 0.0  # (whatever arrives ends an idle spell, as uvicorn's timer did)
        phase = self.phase
        if phase == REST:  # the next head begins (with its first byte, even a CRLF llhttp skips)
            self.phase = phase = HEAD
            self.head_bytes = 0
            self.since = 0.0
        elif phase == BODY:
            self.since = self.loop.time()
        elif phase == LINGER:
            return
        if phase == HEAD:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # (a parser error, a refusal raised in a callback, an upgrade)
            p.feed_failed(exc)
        lean = p.lean
        if lean is not None and lean.size > HIGH_WATER_LIMIT:
            p.start_pending()  # a large body, reading paused: the task reads the rest (bounded)
        phase = self.phase
        if phase != REST:
            if not self.since:
                self.since = self.loop.time()
            if phase == HEAD and self.head_bytes > self.max_header_bytes and not self.transport.is_closing():
                p.refuse(431, f"Request header fields exceed {self.max_header_bytes} bytes.", "headers_too_large")

    # -- parser callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url = b""
        self.expect = False
        headers: list[tuple[bytes, bytes]] = []
        self.headers = headers
        self.scope = {  # as uvicorn's
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": headers,
            "state": self.app_state.copy(),
        }

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        p = self.protocol
        if len(self.headers) > self.max_headers or self.head_bytes > self.max_header_bytes:
            self.hand_over()
            p.refuse_head()  # raises
        self.phase = BODY
        self.since = 0.0
        parser = self.parser
        cycle = p.cycle
        if (
            self.url in LEAN_PATHS
            and parser.get_method() == b"POST"
            and not self.expect
            and (cycle is None or cycle.response_complete)
            and not parser.should_upgrade()
        ):
            self._start_lean(p, parser)
        else:
            self.hand_over()
            p.generic_headers_complete()
        if self.state.draining and p.cycle is not None:
            p.cycle.keep_alive = False  # draining (proxy/drain.py): clients reconnect elsewhere

    def hand_over(self) -> None:
        """The head as uvicorn's protocol keeps it, for its cycle (and the refusals) to read."""
        p = self.protocol
        p.url = self.url
        p.headers = self.headers
        p.scope = self.scope
        p.expect_100_continue = self.expect

    def _start_lean(self, p: Any, parser: Any) -> None:
        version = parser.get_http_version()
        url = self.url
        scope = self.scope
        scope["method"] = "POST"
        scope["path"] = url.decode("ascii")
        scope["raw_path"] = url
        scope["query_string"] = b""
        if version != "1.1":
            scope["http_version"] = version
        # Its task starts once the body is complete, or at once for a declared body larger than
        # HIGH_WATER_LIMIT, or once more than that is buffered of a chunked one (reading pauses; the
        # task reads on, within the body limit, or refuses it before reading). A plain request may
        # be served in callbacks instead (`ProxyApp.serve_in_callbacks`, proxy/fastpath.py). Until
        # then the body timeout bounds a stall, and a client that leaves leaves nothing to cancel.
        cycle = LeanCycle(p, scope, version != "1.0" and parser.should_keep_alive(), self.transport, self.flow)
        p.cycle = p.lean = cycle
        if self.state.draining:
            cycle.spawn(self.app)  # draining (proxy/drain.py) waits for tasks: this is one from its start
            return
        for name, value in self.headers:
            if name == b"content-length":
                if not value.isdigit() or int(value) > HIGH_WATER_LIMIT:
                    cycle.spawn(self.app)  # a large body: the task refuses it early or reads it bounded
                break

    def on_body(self, body: bytes) -> None:
        p = self.protocol
        cycle = p.cycle
        if not isinstance(cycle, LeanCycle):
            p.generic_on_body(body)
        elif not cycle.response_complete:
            cycle.body.append(body)
            cycle.size += len(body)
            if cycle.size > HIGH_WATER_LIMIT:
                self.flow.pause_reading()  # receive() resumes it
            cycle.wake()

    def response_complete(self) -> None:
        """A response went out whole: uvicorn's on_response_complete, except that an idle
        connection's keep-alive timeout is the watchdog's (uvicorn arms and cancels a timer a
        request), and reading resumes only if it had paused."""
        self.state.total_requests += 1
        if self.transport.is_closing():
            return
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self.protocol._start_asgi_task(cycle, app)
        elif self.phase == REST:  # (not when the next head has begun: it is no idle connection)
            self.idle_since = self.loop.time()

    def on_message_complete(self) -> None:
        p = self.protocol
        self.phase = REST
        cycle = p.cycle
        if not isinstance(cycle, LeanCycle):
            p.generic_on_message_complete()
        elif not cycle.response_complete:
            cycle.more_body = False
            if cycle.task is None:
                serve = self.in_callbacks
                if serve is None or not serve(cycle):
                    cycle.spawn(self.app)
            else:
                cycle.wake()
