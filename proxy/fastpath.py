"""Plain inference requests served in protocol callbacks, without a task (issue 17).

The usual cycle of a request (proxy/server.py's LeanCycle running the app in a task, then
proxy/inference.py awaiting the pick and the upstream exchange's futures and timers) cost about
35 µs of CPU per request more than the same layers run in callbacks (loadtest/floor_routed.py):
at 32 connections the production configuration reached 0.6-0.7x of vllm-router's throughput.
For the common request (its body complete in the read that ended it, not streamed, no media, an
idle pooled connection to the chosen replica, no prompt being computed there) `start` takes the
same steps synchronously when the request's last byte arrives, and the answer goes out when the
replica's last byte arrives: the same parse (`Call.resolve`), scheduler, attempt bookkeeping
(`inference.Attempt`), answer (`forward.plain_answer`) and accounting (`inference.account`).

Anything else goes on as the usual task from where it stands, so each rare case keeps one
implementation: before a replica is leased, the whole request (it is parsed again), also when
the scheduler would wait (a full fleet, a LoRA adapter) or refuse (`Scheduler.schedule_now`);
`inference.serve` from the lease (a connection to open) or from the failed first attempt
(retries, the watchdog's verdict on a timeout). A client that leaves, a replica the watchdog cuts
and the drain deadline reach the exchange through `cancel`, as they would cancel the task.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Coroutine, Final

from proxy import inference
from proxy.auth import CLIENT
from proxy.cycle import LeanCycle
from proxy.errors import ProxyError
from proxy.forward import UpstreamFailure, as_failure, plain_answer
from proxy.http1 import Response, UpstreamError, body_too_large
from proxy.inference import Attempt, Call
from proxy.parse import INFERENCE, ParsedRequest
from proxy.routing.catalog import Route
from proxy.routing.scheduler import Lease
from proxy.runtime import Runtime
from proxy.spec import JSON_BODY

log: Final = logging.getLogger("vllm_proxy")


def serve_in_callbacks(app: Any, cycle: LeanCycle) -> bool:
    """`app.serve_in_callbacks` (proxy/app.py, a ProxyApp's): serve the request of `cycle` (its body
    complete) without a task when `start` can. False: run the app for it as usual."""
    rt = app.runtime
    if rt.tracing is not None:
        return False
    scope = cycle.scope
    if rt.auth is not None:
        try:
            scope[CLIENT] = rt.auth.client(scope)
        except ProxyError:
            return False  # the usual path answers it
    try:
        return start(rt, cycle, INFERENCE[scope["path"]], time.perf_counter())
    except Exception:  # noqa: BLE001 - a bug here must not take the connection's parser down
        log.exception("serving a request in callbacks failed")
        return False


def start(rt: Runtime, cycle: LeanCycle, endpoint: str, started: float) -> bool:
    """Serve `cycle`'s request (its body complete) without a task if it is the common case, else
    hand it to a task from where it stands. False: nothing was counted; run the app as usual."""
    body = cycle.peek_body()
    if len(body) > rt.max_body_bytes:
        return False
    call = Call(cycle.scope, endpoint, None, started)
    try:
        parsed, route = call.resolve(rt, body)
    except ProxyError:
        return False  # the usual path answers it
    if parsed.stream or parsed.multimodal:
        cycle.scope[inference.RESOLVED] = call  # the app's task goes on from here (inference.handle)
        return False
    if route.rewrite:
        call.body = JSON_BODY.rewrite(parsed, body, route)
    lease = rt.scheduler.schedule_now(route, parsed)
    if lease is None:  # it would wait (for a slot, an adapter), or answer a 503: the usual path
        return False
    cycle.take_body()  # (`body`: peeked already)
    call.watch = cycle.arm()
    try:
        _begin(rt, call, cycle, lease, endpoint, parsed, route)
    except Exception:  # noqa: BLE001 - a bug: answered as the task path answers one (500), never left hanging
        log.exception("a plain request served in callbacks failed")
        exchange = cycle.task
        if isinstance(exchange, _Exchange):
            exchange._crash()
        elif exchange is None:
            lease.__exit__(None, None, None)
            cycle.finish_unanswered()
            cycle.detach()
    # the pick's bookkeeping once the request is written (at one request at a time it overlaps
    # the replica's work), or now if it is not to be written in this turn's pass
    settle = rt.scheduler.settle
    if settle is not None and not rt.upstream.pool.after_writes(settle):
        settle()
    return True


def _begin(rt: Runtime, call: Call, cycle: LeanCycle, lease: Lease, endpoint: str, parsed: ParsedRequest,
           route: Route) -> None:
    rt.retries.deposit()
    response = None
    if parsed.wait_for is None:  # (else its prompt is being computed on that replica: wait in a task)
        backend = lease.backend
        timeouts = route.timeouts or rt.upstream.server.timeouts
        request = backend.request_head(endpoint, len(call.body), call.rid) + call.body
        now = cycle.protocol.loop.time()
        response = rt.upstream.pool.start_pooled(backend.origin, request, timeouts, now)
    if response is None:  # (or no idle connection: the task opens one)
        cycle.spawn(_app(inference.serve(rt, call, cycle.send, lease)))
        return
    _Exchange(rt, call, cycle, lease, response, timeouts, now)


class _Exchange:
    """The exchange with the leased replica, driven by the upstream connection's callbacks
    (`Response.notify`); it stands in for the request's task (`cancel`)."""

    __slots__ = ("rt", "call", "cycle", "lease", "attempt", "response", "timeouts", "bucket", "what", "deadline",
                 "parts", "size", "over", "closed", "track", "headed")

    def __init__(self, rt: Runtime, call: Call, cycle: LeanCycle, lease: Lease, response: Response, timeouts: Any,
                 now: float) -> None:
        self.rt = rt
        self.call = call
        self.cycle = cycle
        self.lease = lease
        self.attempt = attempt = Attempt(rt, call, lease)
        self.response = response
        self.timeouts = timeouts
        self.parts: list[bytes] = []
        self.size = 0
        self.over = False
        self.closed = False
        self.bucket: set | None = None
        self.deadline = now + timeouts.total
        self.headed = False
        self.track = rt.upstream.begin(lease.backend, attempt.progress, self)
        cycle.task = self  # what a disconnect cancels
        cycle.protocol.tasks.add(self)  # what the drain waits for
        self._expire_in(timeouts.first_byte, now, "the upstream did not answer in time")
        response.notify = self._progress

    # -- the replica's side --------------------------------------------------------------------
    def _progress(self) -> None:
        try:
            self._step()
        except Exception:  # noqa: BLE001 - a bug: answered as the task path answers one (500), never left hanging
            log.exception("a plain request served in callbacks failed")
            self._crash()

    def _crash(self) -> None:
        if not self.over:
            self.response.close()
            self._end()
        if not self.closed:
            if self.cycle.protocol is not None:
                self.cycle.finish_unanswered()
            self._close()

    def _step(self) -> None:
        if self.over:
            return
        response = self.response
        if response._error is not None:
            self._failed(response._error)
            return
        if not response.status:
            return  # (an interim 1xx answer; the first-byte timer runs on)
        if not self.headed:
            self.headed = True
            self.track.beats += 1  # the watchdog's sign of life
        data = response.take()
        if data:
            self.parts.append(data)
            self.size += len(data)
            limit = self.rt.upstream.pool.max_body_bytes
            if limit is not None and self.size > limit:
                self._failed(body_too_large(limit))
                return
        if not response.done:  # the head (or part of the body) came: the idle timeout runs from now
            self._expire_in(self.timeouts.idle, self.cycle.protocol.loop.time(), "the upstream went silent mid-body")
            return
        self._answered()

    def _expire_in(self, seconds: float, now: float, what: str) -> None:
        """Time the exchange out `seconds` from `now`, or at the total deadline if that is sooner."""
        if now + seconds > self.deadline:
            seconds, what = self.deadline - now, "the upstream exceeded the total deadline"
        if self.bucket is not None:
            self.bucket.discard(self)
        self.what = what
        self.bucket = None if seconds == math.inf else _deadlines(self.cycle.protocol).add(self, now + seconds, seconds)

    def expired(self) -> None:
        self.response._fail(UpstreamError("timeout", self.what))  # (notifies `_progress`)

    def _answered(self) -> None:
        rt, call, lease, attempt = self.rt, self.call, self.lease, self.attempt
        response = self.response
        parts = self.parts
        payload = parts[0] if len(parts) == 1 else b"".join(parts)
        backend, reason = lease.backend, lease.reason
        try:
            payload, headers = plain_answer(
                response.status, response.content_type, payload, attempt.progress,
                inference.response_headers(rt, call.id_header, backend, reason), lease.route.rename, True,
            )
        except UpstreamFailure as failure:  # a 502/503/504: another replica may take it
            response.close()
            self._end()
            self._fail_over(failure)
            return
        self._end()
        self.cycle.respond(response.status, headers, payload)
        response.release()
        attempt.answered(response.status)
        self._close()
        inference.account(rt, call, attempt.status, attempt.progress, attempt.series, backend, reason)

    def _failed(self, error: UpstreamError) -> None:
        response = self.response
        response.close()
        self._end()
        if response.unsent:  # the pooled connection died before the write: nothing was sent
            self._hand_over(inference.serve(self.rt, self.call, self.cycle.send, self.lease, begun=self.attempt))
            return
        self._fail_over(as_failure(error))

    # -- the client's side ---------------------------------------------------------------------
    def cancel(self, msg: Any = None) -> bool:
        """What cancelling the request's task would do: the client left (`cycle.gone`), the
        watchdog cut the replica (`progress.abort`: fail over), or the server is stopping."""
        if self.over:
            return False
        self.response.close()  # the replica sees the disconnect and aborts the request
        self._end(cancelled=True)
        abort = self.attempt.progress.abort
        if abort is not None and not self.cycle.gone:
            self._fail_over(UpstreamFailure("down", 502, abort))
            return True
        attempt = self.attempt
        if self.cycle.gone:
            attempt.gone(self.lease.route)
            self._close()
            inference.account(self.rt, self.call, attempt.status, attempt.progress, attempt.series,
                              self.lease.backend, self.lease.reason)
        else:  # the drain deadline: answered as the task's would be (proxy/server.py)
            self.cycle.finish_unanswered(cancelled=True)
            self._close()
        return True

    # -- the end ---------------------------------------------------------------------------------
    def _end(self, cancelled: bool = False) -> None:
        """The exchange is over (answered, failed or cut): no timer, off the watchdog's track and
        the server's tasks (after this loop turn when cancelled: the canceller may be iterating them)."""
        self.over = True
        if self.bucket is not None:
            self.bucket.discard(self)
        self.response.notify = None
        progress = self.attempt.progress
        self.track.active.discard(progress)
        progress.task = None
        protocol = self.cycle.protocol
        if cancelled:
            protocol.loop.call_soon(protocol.tasks.discard, self)
        else:
            protocol.tasks.discard(self)

    def _close(self) -> None:
        """The request is over: counted off its replica, its lease released, the cycle let go."""
        self.closed = True
        self.attempt.end(self.lease)
        self.lease.__exit__(None, None, None)
        self.call.watch.stop()
        self.cycle.detach()

    def _fail_over(self, failure: UpstreamFailure) -> None:
        """Nothing reached the client: the rest (the failure's bookkeeping, a retry) in a task."""
        self._hand_over(inference.after_failure(self.rt, self.call, self.cycle.send, self.lease, self.attempt, failure))

    def _hand_over(self, rest: Coroutine) -> None:
        self.cycle.task = None
        self.cycle.spawn(_app(rest))


def _app(coroutine: Coroutine) -> Any:
    """`coroutine` as the app a LeanCycle runs (which answers 500 or 503 for it if it fails)."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await coroutine

    return app


class _Deadlines:
    """The exchanges' timeouts in buckets, one loop timer per bucket: a timer per request
    (call_later, then cancel) cost ~2 % of a request's CPU. A bucket spans 1/16 s, or for a
    timeout over 16 s the power of two nearest above 1/256 of it: a timeout fires up to that late,
    and a timeout of T seconds keeps at most ~256 buckets pending (not 16 per second of it)."""

    __slots__ = ("loop", "buckets")

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.buckets: dict[tuple[float, int], set] = {}

    def add(self, exchange: _Exchange, at: float, seconds: float) -> set:
        step = 0.0625 if seconds <= 16.0 else 2.0 ** math.ceil(math.log2(seconds / 256.0))
        key = (step, int(at / step) + 1)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = set()
            self.loop.call_at(key[1] * step, self._fire, key)
        bucket.add(exchange)
        return bucket

    def _fire(self, key: tuple[float, int]) -> None:
        for exchange in list(self.buckets.pop(key, ())):
            exchange.expired()


def _deadlines(protocol: Any) -> _Deadlines:
    """The deadlines of the protocol's server (one per event loop)."""
    state = protocol.server_state
    found = getattr(state, "fastpath_deadlines", None)
    if found is None:
        found = state.fastpath_deadlines = _Deadlines(protocol.loop)
    return found
