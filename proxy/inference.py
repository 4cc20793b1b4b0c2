"""The hot path for /v1/chat/completions, /v1/completions and /v1/embeddings:
read the body (bounded), parse once, resolve the deployment, pick a replica, relay."""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any, Final

from proxy.accesslog import usage_tokens
from proxy.asgi import DISCONNECT, Receive, Scope, Send, header, send_error
from proxy.auth import CLIENT
from proxy.errors import ProxyError, model_not_found
from proxy.forward import Progress, StreamBroken, UpstreamFailure
from proxy.metrics import Series
from proxy.parse import ParsedRequest, parse_request
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.scheduler import Lease
from proxy.runtime import Runtime
from proxy.spec import JSON_BODY, Spec
from proxy.watchdog import poisoned

CLIENT_CLOSED: Final = "499"
# scope key: the Call that proxy/fastpath.py resolved (its body parsed) before it left the request
# to this path (a stream, a multimodal request): `handle` goes on with it rather than parsing again
RESOLVED: Final = "vllm_proxy.resolved"


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` (from
    Content-Length before reading anything, else while reading): never buffered unbounded."""
    declared = header(scope, b"content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise _too_large(limit)
        except ValueError:
            raise ProxyError(400, "Invalid Content-Length header.", code="invalid_request") from None
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body = message.get("body", b"")
    if not message.get("more_body"):
        if len(body) > limit:
            raise _too_large(limit)
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limit: int) -> ProxyError:
    return ProxyError(
        413, f"Request body is larger than the limit of {limit} bytes.", code="request_too_large",
        headers=[(b"connection", b"close")],
    )


class DisconnectWatch:
    """Cancels the request's task when the client goes away, so the upstream request is closed
    (vLLM then aborts it) whether we are still waiting for the first byte or mid-stream. (Our own
    server does this without a task: proxy/server.py; this is for any other ASGI server.)

    The watcher is never cancelled: once the response is complete, uvicorn's `receive()` returns
    `http.disconnect` by itself and the watcher ends quietly. (Cancelling it left a cancelled
    exception, its traceback and frames in a reference cycle per request, and the cyclic garbage
    collector's passes cost a third of the throughput and most of the tail latency.)"""

    __slots__ = ("task", "gone", "done")

    def __init__(self, receive: Receive) -> None:
        self.task: asyncio.Task | None = asyncio.current_task()
        self.gone = False
        self.done = False
        _background.add(asyncio.get_running_loop().create_task(self._watch(receive)))

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not self.done:
                self.gone = True
                self.task.cancel()  # type: ignore[union-attr]
        finally:
            self.task = None
            _background.discard(asyncio.current_task())

    def stop(self) -> None:
        self.done = True


_background: set[asyncio.Task] = set()  # strong references to running watchers


class Call:
    """One request on this path, as its steps share it: the client's side (scope, id, endpoint,
    disconnect watch) and what was decided (parsed body, deployment, the body to forward)."""

    __slots__ = ("scope", "endpoint", "spec", "started", "request_id", "rid", "id_header", "parsed", "route",
                 "trusted_only", "body", "watch")

    def __init__(self, scope: Scope, endpoint: str, spec: Spec | None, started: float) -> None:
        self.scope = scope
        self.endpoint = endpoint
        self.spec = spec
        self.started = started
        self.request_id = request_id = _request_id(scope)
        self.rid = rid = request_id.encode("ascii")
        self.id_header = [(b"x-request-id", rid)]
        self.parsed: ParsedRequest | None = None  # (both found by `resolve`)
        self.route: Route | None = None
        self.trusted_only = False
        self.body = b""
        self.watch: Any = None  # a DisconnectWatch, or our server's own (LeanCycle.arm)

    def resolve(self, rt: Runtime, body: bytes) -> tuple[ParsedRequest, Route]:
        """Parse the body once and find its deployment (a 404 if the model is unknown or not the
        client's). Leaves `body` as read: the rewrite, if any, follows the multimodal check."""
        spec = self.spec
        parsed = self.parsed = parse_request(self.endpoint, body) if spec is None else spec.parse(self.scope, body)
        route = self.route = rt.catalog.get(parsed.model)  # (kept even when refused: the 404's label)
        scope = self.scope
        if route is None or (CLIENT in scope and not scope[CLIENT].may_use(route.name)):
            raise model_not_found(parsed.model)
        self.body = body
        return parsed, route

    def decided(self) -> tuple[ParsedRequest, Route]:
        """The parsed body and the deployment that `resolve` found."""
        parsed, route = self.parsed, self.route
        if parsed is None or route is None:
            raise RuntimeError("the request was not resolved")
        return parsed, route


def key_name(scope: Scope) -> str | None:
    """The configured name of the key this request authenticated with (None without auth; the
    access log's `key`, proxy/auth.py). Here, compiled: it runs for every answer."""
    client = scope.get(CLIENT)
    return client.name if client is not None else None


async def handle(rt: Runtime, scope: Scope, receive: Receive, send: Send, endpoint: str, spec: Spec | None = None) -> None:
    call: Call | None = scope.pop(RESOLVED, None)
    if call is None or call.endpoint != endpoint or call.spec is not spec:
        call = Call(scope, endpoint, spec, time.perf_counter())
    try:
        lease = await _decide(rt, call, receive)
    except ClientGone:
        return
    except asyncio.CancelledError:
        if call.watch is None or not call.watch.gone:
            raise
        metrics = rt.metrics
        deployment = _unrouted(rt, call.request_id, endpoint, call.route, CLIENT_CLOSED, call.started, key_name(scope))
        metrics.child(metrics.disconnects, deployment, "before_first_byte").inc()
        return
    except ProxyError as err:
        if call.watch is not None:
            call.watch.stop()
        await send_error(send, err, call.id_header)
        _unrouted(rt, call.request_id, endpoint, call.route, str(err.status), call.started, key_name(scope))
        return
    rt.retries.deposit()
    await serve(rt, call, send, lease)


async def _decide(rt: Runtime, call: Call, receive: Receive) -> Lease:
    """Read the body, parse it, check it, and lease a replica for it."""
    scope, spec = call.scope, call.spec
    body = await read_body(scope, receive, rt.max_body_bytes)
    # From here a client that leaves cancels this task (also while it waits for a slot).
    lean = scope.get(DISCONNECT)
    call.watch = lean.arm() if lean is not None else DisconnectWatch(receive)
    parsed, route = call.resolve(rt, body) if call.parsed is None else call.decided()
    changed = False
    if parsed.multimodal:
        call.trusted_only, changed = await rt.multimodal.check(parsed, route)
    if route.rewrite or changed:
        call.body = (spec or JSON_BODY).rewrite(parsed, body, route)
    # counted in flight from here: released by `with lease` in `serve` (no await in between)
    return await (rt.scheduler.schedule(route, parsed, call.trusted_only) if spec is None else
                  spec.choose(rt, route, parsed, call.trusted_only))


async def serve(rt: Runtime, call: Call, send: Send, lease: Lease, first: "Attempt | None" = None,
                begun: "Attempt | None" = None) -> None:
    """The attempts on `lease` and, after a failure that allows it, on other replicas; then the
    request's metrics and log line. Begun outside this task (proxy/fastpath.py): `first`, an
    attempt already over; `begun`, one counted whose request never reached the replica."""
    metrics = rt.metrics
    parsed, route = call.decided()
    spec, watch = call.spec, call.watch
    tried: list[Backend] = []
    attempt = first
    try:
        while True:
            if attempt is None:
                with lease:
                    attempt = await _attempt(rt, call, send, lease, begun)
                begun = None
            status, progress, series, failure = attempt.status, attempt.progress, attempt.series, attempt.failure
            attempt = None
            backend, reason = lease.backend, lease.reason
            if failure is None:
                break
            tried.append(backend)
            retry = (failure.retryable and not watch.gone and len(tried) < rt.retries.max_attempts
                     and rt.retries.withdraw())
            if retry:
                try:
                    lease = await (rt.scheduler.schedule(route, parsed, call.trusted_only, tried) if spec is None else
                                   spec.choose(rt, route, parsed, call.trusted_only, tried))
                except ProxyError:
                    retry = False
                except asyncio.CancelledError:
                    if not watch.gone:
                        raise
                    status = CLIENT_CLOSED
                    break
            if not retry:
                await send_error(send, failure, response_headers(rt, call.id_header, backend, reason))
                break
            metrics.child(metrics.retries, route.name, failure.kind).inc()
            lease.reason = "retry"
    finally:
        watch.stop()
    account(rt, call, status, progress, series, backend, reason)


def account(rt: Runtime, call: Call, status: str, progress: Progress, series: Series, backend: Backend,
            reason: str) -> None:
    """A request answered by a replica: its metrics (proxy/metrics.py) and access-log line."""
    ended = time.perf_counter()
    started = call.started
    series.status(status).inc()
    series.duration.observe(ended - started)
    overhead = ttft = None
    if progress.started:
        overhead = progress.overhead(ended)
        series.overhead.observe(overhead)
        ttft = progress.ttft()
        if ttft is not None:
            series.ttft.observe(ttft)
    key = key_name(call.scope)
    parsed, route = call.decided()
    spec = call.spec
    tokens = usage_tokens(progress.usage(parsed.stream) if spec is None else spec.usage(progress, parsed.stream))
    rt.metrics.count_key(key, status, route.name, tokens)
    access = rt.access
    if access is not None and access.wanted():
        access.write(call.request_id, call.endpoint, route.name, backend.name, reason, status, parsed.stream,
                     ended - started, ttft, overhead, tokens, key)


def _unrouted(
    rt: Runtime, request_id: str, endpoint: str, route: Route | None, status: str, started: float, key: str | None,
) -> str:
    """Count (and log) a request that ended before reaching a replica; returns its deployment label."""
    deployment = route.name if route is not None else "unknown"
    metrics = rt.metrics
    metrics.child(metrics.requests, deployment, "none", endpoint, status).inc()
    metrics.count_key(key, status, deployment, (None, None))
    if rt.access is not None and rt.access.wanted():
        rt.access.write(request_id, endpoint, deployment, "none", None, status, False, time.perf_counter() - started,
                        key=key)
    return deployment


def refused(rt: Runtime, scope: Scope, endpoint: str, status: int) -> None:
    """A request the key check turned away (401): counted and logged like every other answer."""
    _unrouted(rt, _request_id(scope), endpoint, None, str(status), time.perf_counter(), None)


class Attempt:
    """One exchange with the leased replica, as counted: in flight on it from construction to
    `end()`; `status`, and `failure` when nothing reached the client and another replica may be
    tried."""

    __slots__ = ("rt", "backend", "in_flight", "series", "progress", "warmed", "status", "failure")

    def __init__(self, rt: Runtime, call: Call, lease: Lease) -> None:
        self.rt = rt
        metrics = rt.metrics
        backend = self.backend = lease.backend
        self.status = "502"
        self.failure: UpstreamFailure | None = None
        series = self.series = metrics.series(lease.route.name, backend.name, call.endpoint)
        metrics.decision(rt.policy.name, lease.reason).inc()
        in_flight = self.in_flight = series.in_flight
        in_flight.inc()
        spec = call.spec
        self.progress = progress = (Progress(call.started, series.stream_sink) if spec is None else
                                    Progress(call.started, series.stream_sink, spec.marker))
        parsed = lease.request
        self.warmed = progress.on_first = parsed.warmed if parsed is not None else None

    def answered(self, code: int) -> None:
        """The replica's answer reached the client."""
        self.status = str(code)
        if code >= 500:
            self.rt.outliers.failure(self.backend)
        else:
            self.rt.outliers.success(self.backend)

    def gone(self, route: Route) -> None:
        """The client left during the exchange."""
        self.status = CLIENT_CLOSED
        metrics = self.rt.metrics
        phase = "streaming" if self.progress.started else "before_first_byte"
        metrics.child(metrics.disconnects, route.name, phase).inc()

    async def failed(self, exc: "UpstreamFailure | StreamBroken") -> None:
        """The exchange failed: before the client saw anything (UpstreamFailure), or mid-stream."""
        rt, backend = self.rt, self.backend
        metrics = rt.metrics
        if isinstance(exc, StreamBroken):
            metrics.child(metrics.upstream_errors, backend.name, exc.failure.kind).inc()
            if exc.failure.kind != "down":
                rt.outliers.failure(backend)
            return
        metrics.child(metrics.upstream_errors, backend.name, exc.kind).inc()
        if exc.kind == "timeout" and await rt.watchdog.answers(backend):
            exc = poisoned(exc, backend)  # the replica is fine: the request is the likely cause
        elif exc.kind != "down":  # (a replica marked down is out of rotation already)
            rt.outliers.failure(backend)
        self.status, self.failure = str(exc.status), exc

    def end(self, lease: Lease) -> None:
        self.in_flight.dec()
        lease.status = self.status
        if self.warmed is not None:  # a coalescing leader: whoever waits for its prompt goes now
            self.warmed()


async def after_failure(rt: Runtime, call: Call, send: Send, lease: Lease, attempt: Attempt,
                        exc: UpstreamFailure) -> None:
    """Serve on from a first attempt that failed before the client saw anything (proxy/fastpath.py)."""
    with lease:
        try:
            await attempt.failed(exc)
        finally:
            attempt.end(lease)
    await serve(rt, call, send, lease, attempt)


async def _attempt(rt: Runtime, call: Call, send: Send, lease: Lease, attempt: Attempt | None = None) -> Attempt:
    if attempt is None:
        attempt = Attempt(rt, call, lease)
    backend, reason, spec, route = lease.backend, lease.reason, call.spec, lease.route
    parsed = lease.request
    try:
        if parsed is not None and parsed.wait_for is not None:  # its prompt is being computed there
            follow, parsed.wait_for = parsed.wait_for, None
            await follow()
        code = await rt.upstream.exchange(
            backend, call.endpoint, call.body, call.rid, send, response_headers(rt, call.id_header, backend, reason),
            attempt.progress, route.rename, retryable=True, timeouts=route.timeouts,
            head=None if spec is None else spec.head(backend, call.endpoint),
        )
        attempt.answered(code)
    except asyncio.CancelledError:
        if not call.watch.gone:
            raise
        attempt.gone(route)
    except (UpstreamFailure, StreamBroken) as exc:
        await attempt.failed(exc)
    finally:
        attempt.end(lease)
    return attempt


def response_headers(rt: Runtime, id_header: list, backend: Backend, reason: str) -> list:
    if not rt.explain:
        return id_header
    return [*id_header, (b"x-vllm-proxy-backend", backend.name.encode()), (b"x-vllm-proxy-route", reason.encode())]


_ID_PREFIX: Final = os.urandom(6).hex()  # per process: ids of several workers and restarts never collide
_id_counter: Final = itertools.count()


def _request_id(scope: Scope) -> str:
    """The client's X-Request-ID if usable, else a new one (a counter: os.urandom per request was
    a system call's worth of CPU on the hot path, and ids need to be unique, not secret)."""
    value = header(scope, b"x-request-id")
    if value is not None and 0 < len(value) <= 128 and value.isascii():
        return value.decode("ascii")
    return "%s%012x" % (_ID_PREFIX, next(_id_counter))
