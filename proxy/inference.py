"""The hot path for /v1/chat/completions, /v1/completions and /v1/embeddings:
read the body (bounded), parse once, resolve the deployment, pick a replica, relay."""
from __future__ import annotations

import asyncio
import itertools
import os
import time

import orjson

from proxy.accesslog import usage_tokens
from proxy.asgi import DISCONNECT, Receive, Scope, Send, header, send_error
from proxy.auth import CLIENT, key_name
from proxy.errors import ProxyError, model_not_found
from proxy.forward import Progress, StreamBroken, UpstreamFailure
from proxy.parse import ParsedRequest, parse_request
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.scheduler import Lease
from proxy.runtime import Runtime
from proxy.watchdog import poisoned

CLIENT_CLOSED = "499"


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


class Spec:
    """How an endpoint other than chat/completions/embeddings differs on this same path (proxy/passthrough.py,
    proxy/responses.py, proxy/audio.py): its parse, its choice of replica, its body rewrite, its request head."""

    marker = b"data:"  # what a streamed chunk carrying a token contains (for TTFT/ITL)

    def parse(self, scope: Scope, body: bytes) -> ParsedRequest:
        raise NotImplementedError

    async def choose(self, rt: Runtime, route: Route, parsed: ParsedRequest, trusted_only: bool = False,
                     exclude: list[Backend] | None = None) -> Lease:
        return await rt.scheduler.schedule(route, parsed, trusted_only, exclude)

    def rewrite(self, parsed: ParsedRequest, body: bytes, route: Route) -> bytes:
        parsed.data["model"] = route.upstream_id
        return orjson.dumps(parsed.data)

    def usage(self, progress: Progress, stream: bool) -> bytes | None:
        """Where the replica's `usage` object is: a stream's last token chunk, else the body."""
        return progress.tail if stream else progress.body

    def head(self, backend: Backend, endpoint: str) -> bytes | None:
        head = backend.heads.get(endpoint)
        if head is None:  # kept per endpoint path (a fixed, small set)
            head = backend.heads[endpoint] = backend.head_prefix("POST", endpoint)
        return head


_JSON_BODY = Spec()  # the chat/completions/embeddings behaviour of the rarely taken steps


async def handle(rt: Runtime, scope: Scope, receive: Receive, send: Send, endpoint: str, spec: Spec | None = None) -> None:
    started = time.perf_counter()
    request_id = _request_id(scope)
    rid = request_id.encode("ascii")
    id_header = [(b"x-request-id", rid)]
    metrics = rt.metrics
    route = None
    watch = None
    try:
        body = await read_body(scope, receive, rt.max_body_bytes)
        # From here a client that leaves cancels this task (also while it waits for a slot).
        lean = scope.get(DISCONNECT)
        watch = lean.arm() if lean is not None else DisconnectWatch(receive)
        parsed = parse_request(endpoint, body) if spec is None else spec.parse(scope, body)
        route = rt.catalog.get(parsed.model)
        if route is None or (CLIENT in scope and not scope[CLIENT].may_use(route.name)):
            raise model_not_found(parsed.model)
        trusted_only = changed = False
        if parsed.multimodal:
            trusted_only, changed = await rt.multimodal.check(parsed, route)
        if route.rewrite or changed:
            body = (spec or _JSON_BODY).rewrite(parsed, body, route)
        # counted in flight from here: released by `with lease` below (no await in between)
        lease = await (rt.scheduler.schedule(route, parsed, trusted_only) if spec is None else
                       spec.choose(rt, route, parsed, trusted_only))
    except ClientGone:
        return
    except asyncio.CancelledError:
        if watch is None or not watch.gone:
            raise
        deployment = _unrouted(rt, request_id, endpoint, route, CLIENT_CLOSED, started, key_name(scope))
        metrics.child(metrics.disconnects, deployment, "before_first_byte").inc()
        return
    except ProxyError as err:
        if watch is not None:
            watch.stop()
        await send_error(send, err, id_header)
        _unrouted(rt, request_id, endpoint, route, str(err.status), started, key_name(scope))
        return

    rt.retries.deposit()
    tried: list[Backend] = []
    try:
        while True:
            with lease:
                status, progress, series, failure = await _attempt(
                    rt, route, endpoint, body, rid, send, id_header, lease, started, watch, spec
                )
            backend, reason = lease.backend, lease.reason
            if failure is None:
                break
            tried.append(backend)
            retry = (failure.retryable and not watch.gone and len(tried) < rt.retries.max_attempts
                     and rt.retries.withdraw())
            if retry:
                try:
                    lease = await (rt.scheduler.schedule(route, parsed, trusted_only, tried) if spec is None else
                                   spec.choose(rt, route, parsed, trusted_only, tried))
                except ProxyError:
                    retry = False
                except asyncio.CancelledError:
                    if not watch.gone:
                        raise
                    status = CLIENT_CLOSED
                    break
            if not retry:
                await send_error(send, failure, _response_headers(rt, id_header, backend, reason))
                break
            metrics.child(metrics.retries, route.name, failure.kind).inc()
            lease.reason = "retry"
    finally:
        watch.stop()
    # metrics and the access log (proxy/metrics.py, proxy/accesslog.py)
    ended = time.perf_counter()
    series.status(status).inc()
    series.duration.observe(ended - started)
    overhead = ttft = None
    if progress.started:
        overhead = progress.overhead(ended)
        series.overhead.observe(overhead)
        ttft = progress.ttft()
        if ttft is not None:
            series.ttft.observe(ttft)
    key = key_name(scope)
    tokens = usage_tokens((spec or _JSON_BODY).usage(progress, parsed.stream))
    metrics.count_key(key, status, route.name, tokens)
    access = rt.access
    if access is not None and access.wanted():
        access.write(request_id, endpoint, route.name, backend.name, reason, status, parsed.stream, ended - started,
                     ttft, overhead, tokens, key)


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


async def _attempt(
    rt: Runtime, route: Route, endpoint: str, body: bytes, rid: bytes, send: Send, id_header: list,
    lease: Lease, started: float, watch: "DisconnectWatch", spec: Spec | None = None,
) -> tuple[str, Progress, object, UpstreamFailure | None]:
    """One exchange with the leased replica. Returns (status, progress, series, failure): `failure`
    is set only when nothing reached the client and another replica may be tried."""
    metrics = rt.metrics
    backend, reason = lease.backend, lease.reason
    metrics.child(metrics.decisions, rt.policy.name, reason).inc()
    status = "502"
    failure = None
    in_flight = metrics.child(metrics.in_flight, backend.name)
    in_flight.inc()
    series = metrics.series(route.name, backend.name, endpoint)
    progress = Progress(started, series.stream_sink) if spec is None else Progress(started, series.stream_sink, spec.marker)
    parsed = lease.request
    warmed = progress.on_first = parsed.warmed if parsed is not None else None
    try:
        if parsed is not None and parsed.wait_for is not None:  # its prompt is being computed there
            follow, parsed.wait_for = parsed.wait_for, None
            await follow()
        code = await rt.upstream.exchange(
            backend, endpoint, body, rid, send, _response_headers(rt, id_header, backend, reason), progress,
            route.rename, retryable=True, timeouts=route.timeouts, head=None if spec is None else spec.head(backend, endpoint),
        )
        status = str(code)
        if code >= 500:
            rt.outliers.failure(backend)
        else:
            rt.outliers.success(backend)
    except asyncio.CancelledError:
        if not watch.gone:
            raise
        status = CLIENT_CLOSED
        phase = "streaming" if progress.started else "before_first_byte"
        metrics.child(metrics.disconnects, route.name, phase).inc()
    except UpstreamFailure as exc:
        metrics.child(metrics.upstream_errors, backend.name, exc.kind).inc()
        if exc.kind == "timeout" and await rt.watchdog.answers(backend):
            exc = poisoned(exc, backend)  # the replica is fine: the request is the likely cause
        elif exc.kind != "down":  # (a replica marked down is out of rotation already)
            rt.outliers.failure(backend)
        status, failure = str(exc.status), exc
    except StreamBroken as broken:
        metrics.child(metrics.upstream_errors, backend.name, broken.failure.kind).inc()
        if broken.failure.kind != "down":
            rt.outliers.failure(backend)
    finally:
        in_flight.dec()
        lease.status = status
        if warmed is not None:  # a coalescing leader: whoever waits for its prompt goes now
            warmed()
    return status, progress, series, failure


def _response_headers(rt: Runtime, id_header: list, backend: Backend, reason: str) -> list:
    if not rt.explain:
        return id_header
    return [*id_header, (b"x-vllm-proxy-backend", backend.name.encode()), (b"x-vllm-proxy-route", reason.encode())]


_ID_PREFIX = os.urandom(6).hex()  # per process: ids of several workers and restarts never collide
_id_counter = itertools.count()


def _request_id(scope: Scope) -> str:
    """The client's X-Request-ID if usable, else a new one (a counter: os.urandom per request was
    a system call's worth of CPU on the hot path, and ids need to be unique, not secret)."""
    value = header(scope, b"x-request-id")
    if value is not None and 0 < len(value) <= 128 and value.isascii():
        return value.decode("ascii")
    return "%s%012x" % (_ID_PREFIX, next(_id_counter))
