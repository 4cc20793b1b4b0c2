"""`LeanCycle`: one request-response cycle of proxy/server.py's `ProxyProtocol` for the inference
POSTs (that module says why it replaces uvicorn's cycle). Compiled with the request path
(proxy/native.py): the data path calls it several times per request (`respond`, `take_body`,
`arm`, `wake`): interpreted, they cost 2 % of a production request's instructions (239.2 k
against 234.5 k compiled: `python -m loadtest.instructions --policy prefix_affinity --redis
--system`)."""
from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Final

from uvicorn.protocols.http import flow_control, httptools_impl

from proxy.asgi import BODY_FOLLOWS, DISCONNECT
from proxy.errors import ProxyError

log: Final = logging.getLogger("vllm_proxy")
# uvicorn's, bound once: compiled, a Final name is a static, an imported one a dict lookup at each use
HIGH_WATER_LIMIT: Final = flow_control.HIGH_WATER_LIMIT
STATUS_LINE: Final = httptools_impl.STATUS_LINE

_DISCONNECT_MESSAGE: Final = {"type": "http.disconnect"}
_INTERNAL: Final = ProxyError(500, "Internal proxy error.", code="internal_error", type="server_error")
_SHUTTING_DOWN: Final = ProxyError(503, "The proxy is shutting down; retry the request.", code="proxy_shutting_down",
                                   type="service_unavailable")


def cancel(task: Any, msg: Any = None) -> None:
    """Cancel a request's task; one that has not run its first step yet is cancelled right after
    it (cancelled before, its coroutine would never run, nor the cleanup in its `finally`)."""
    coro: Any = task.get_coro() if isinstance(task, asyncio.Task) else None
    # (a compiled coroutine, like LeanCycle.run's, has no frame to tell: cancelled after a step too)
    if coro is not None and (not hasattr(coro, "cr_frame") or inspect.getcoroutinestate(coro) == inspect.CORO_CREATED):
        asyncio.get_running_loop().call_soon(task.cancel, msg)
    else:
        task.cancel(msg)


class LeanCycle:
    """One request-response cycle on a ProxyProtocol connection; quacks like uvicorn's
    RequestResponseCycle where the protocol looks at it, and is its own disconnect watch."""

    __slots__ = ("protocol", "transport", "flow", "scope", "body", "size", "more_body", "keep_alive",
                 "response_complete", "disconnected", "delivered", "task", "armed", "gone", "_waiter", "_started", "_head",
                 "_chunked")

    def __init__(self, protocol: Any, scope: dict, keep_alive: bool, transport: Any, flow: Any) -> None:
        # (Any: the protocol is proxy/server.py's, the others uvloop's or asyncio's; None once detached)
        self.protocol: Any = protocol
        self.transport: Any = transport
        self.flow: Any = flow
        self.scope: Any = scope
        scope[DISCONNECT] = self
        self.body: list[bytes] = []
        self.size = 0
        self.more_body = True
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        self.delivered = False  # the whole body went to the app
        self.task: Any = None  # an asyncio.Task, once spawned
        self.armed = False
        self.gone = False
        self._waiter: Any = None  # a future while receive() waits
        self._started = False
        self._head: list[bytes] | None = None  # a plain response's head, sent with its body
        self._chunked = False

    # -- what uvicorn's protocol calls on its cycle (connection_lost, shutdown) ------------------
    @property
    def message_event(self) -> "LeanCycle":
        return self

    def set(self) -> None:
        """The protocol's `message_event.set()`: after connection_lost, this is the disconnect."""
        if self.disconnected and self.armed and not self.gone:
            self.gone = True
            cancel(self.task)
        self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the disconnect watch (proxy/inference.py) ----------------------------------------------
    def arm(self) -> "LeanCycle":
        """From now until stop(), a client disconnect cancels the request task."""
        self.armed = True
        if self.disconnected and not self.response_complete:
            self.set()
        return self

    def stop(self) -> None:
        self.armed = False

    # -- ASGI --------------------------------------------------------------------------------
    def spawn(self, app: Any) -> asyncio.Task:
        """Run `app` (an ASGI app, or any callable of scope, receive and send) for this cycle in a
        task of the server's (the drain waits for them); it becomes the task a disconnect cancels."""
        protocol = self.protocol
        self.task = task = protocol.loop.create_task(self.run(app))
        task.add_done_callback(protocol.tasks.discard)
        protocol.tasks.add(task)
        return task

    async def run(self, app: Any) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:  # noqa: BLE001 - the app's bug must not kill the connection silently
            cancelled = isinstance(exc, asyncio.CancelledError)
            if not cancelled:
                log.error("exception in the request handler", exc_info=exc)
            self.finish_unanswered(cancelled)
        else:
            if not self._started and not self.disconnected:
                log.error("the request handler returned without a response")
            self.finish_unanswered()
        finally:
            self.detach()

    def detach(self) -> None:
        """Leave no reference cycle behind (protocol <-> cycle, scope[DISCONNECT] <-> cycle,
        task -> coroutine -> cycle): per-request garbage that only the cyclic collector could
        free would cost throughput and tail latency."""
        protocol = self.protocol
        if protocol is not None and protocol.lean is self:
            protocol.lean = None
        self.protocol = None
        self.scope = None
        self.task = None

    def finish_unanswered(self, cancelled: bool = False) -> None:
        """After the app (or a request served in callbacks, proxy/fastpath.py): a response never
        started is a 500 (a 503 when the server cancelled it: the drain deadline passed,
        proxy/drain.py), one left unfinished is cut off, so a client is never left waiting."""
        if not self._started and not self.disconnected:
            err = _SHUTTING_DOWN if cancelled else _INTERNAL
            self.keep_alive = False
            body = err.body()
            self.respond(err.status, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
                         body)
        elif not self.response_complete:
            self.transport.close()

    async def receive(self) -> dict:
        if self.more_body or self.body or not self.delivered:
            while not self.body and self.more_body and not (self.disconnected or self.response_complete):
                await self._wait()
            if self.disconnected or self.response_complete:
                return _DISCONNECT_MESSAGE
            return {"type": "http.request", "body": self.take_body(), "more_body": self.more_body}
        # Body read: like uvicorn, answer "disconnect" once the response is done or the client left.
        while not (self.disconnected or self.response_complete):
            await self._wait()
        return _DISCONNECT_MESSAGE

    def peek_body(self) -> bytes:
        """The body bytes buffered so far, left in place (joined once, so `take_body` need not)."""
        body = self.body
        if len(body) != 1:
            body[:] = [b"".join(body)]
        return body[0]

    def take_body(self) -> bytes:
        """The body bytes buffered so far, handed over (reading resumed if they had paused it)."""
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        if self.size > HIGH_WATER_LIMIT:
            self.flow.resume_reading()
        self.size = 0
        self.delivered = not self.more_body
        return body

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if self.response_complete:
                raise RuntimeError("response already complete")
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected or self.transport.is_closing():
                return
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if not self._started:
                raise RuntimeError("response not started")
            out = self._head
            if out is None:
                out = []
            else:
                self._head = None
            if self._chunked:
                if body:
                    out += (b"%x\r\n" % len(body), body, b"\r\n")
                if not more:
                    out.append(b"0\r\n\r\n")
            elif body:
                out.append(body)
            if out:
                self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            if not more:
                self._complete()
        elif kind == "http.response.start":
            head = self._start(message["status"], message.get("headers", ()))
            # a stream's head goes out now (clients see the status before the first token), unless
            # its first body bytes are at hand; a plain body's head leaves with it, in one write
            if self._chunked and not message.get(BODY_FOLLOWS):
                if not self.disconnected and not self.transport.is_closing():
                    self.transport.write(head)
            else:
                self._head = [head]
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def _start(self, status: int, headers: Any) -> bytes:
        """The response head (chunked unless the headers give a Content-Length)."""
        if self._started:
            raise RuntimeError("response already started")
        self._started = True
        head = [STATUS_LINE[status]]
        chunked = True
        # (pairs read by index and appended one by one: compiled, unpacking an untyped pair and
        # `+=` of a tuple each went through the generic iterator protocol)
        for pair in headers:
            name = pair[0]
            if name == b"content-length":
                chunked = False
            elif name == b"connection" and b"close" in pair[1].lower():
                self.keep_alive = False
                continue
            head.append(name)
            head.append(b": ")
            head.append(pair[1])
            head.append(b"\r\n")
        for pair in self.protocol.server_state.default_headers:  # Date (and Server if on)
            head.append(pair[0])
            head.append(b": ")
            head.append(pair[1])
            head.append(b"\r\n")
        if chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self._chunked = chunked
        return b"".join(head)

    def respond(self, status: int, headers: Any, body: bytes) -> None:
        """A whole plain response at once, outside any task (proxy/fastpath.py): `headers` must
        give its Content-Length. The cycle is complete after it."""
        head = self._start(status, headers)
        if not self.disconnected and not self.transport.is_closing():
            self.transport.write(head + body)
        self._complete()

    def _complete(self) -> None:
        self.response_complete = True
        self.armed = False
        self.wake()
        protocol = self.protocol
        if not self.keep_alive:
            self.transport.close()
        if protocol is not None:
            protocol.intake.response_complete()
