"""The upstream exchange: one shared client per process, bytes relayed as they arrive.

Not httpx's default transport (its pool collapses under concurrency, ANCHORS.md), and not
aiohttp on the data path either: measured, our httptools-based pool (proxy/http1.py) costs a
quarter of aiohttp's CPU per request. Streams are relayed chunk by chunk, never re-parsed.

Every exchange in flight is registered with its replica's `Track` (what proxy/watchdog.py reads
to notice a hung replica) and can be cut from outside (`Progress.cut`): one that sent nothing to
the client yet fails over as an `UpstreamFailure`, a stream ends with an SSE error event.
"""
from __future__ import annotations

import asyncio
import bisect
import time
from typing import Callable, Final

import httpx

from proxy import control
from proxy.accesslog import fixed3
from proxy.asgi import BODY_FOLLOWS, Headers, Send
from proxy.config import ServerConfig, Timeouts
from proxy.errors import ProxyError, normalise_upstream_error
from proxy.http1 import PING, Pool, Response, UpstreamError
from proxy.routing.backends import Backend

JSON: Final = b"application/json"
SSE_HEADERS: Final = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


RETRY_STATUSES: Final = (502, 503, 504)
# (compiled: statics, not dict lookups at each call; bisect_left runs once a streamed chunk)
perf_counter: Final = time.perf_counter
bisect_left: Final = bisect.bisect_left


class UpstreamFailure(ProxyError):
    """The replica failed before any byte reached the client (so another replica may be tried).
    `payload`: the replica's own (normalised) error body, sent as is if no retry happens."""

    def __init__(self, kind: str, status: int, message: str, payload: bytes | None = None) -> None:
        super().__init__(status, message, code=f"upstream_{kind}")
        self.kind = kind  # connect | timeout | reset | status_5xx | down
        self.payload = payload
        self.retryable = True  # False: another replica must not get this request (proxy/watchdog.py: poison)

    def body(self) -> bytes:
        return self.payload if self.payload is not None else super().body()


SHUTTING_DOWN: Final = ProxyError(
    503, "The proxy is shutting down: the stream was ended at its drain deadline; retry the request.",
    code="proxy_shutting_down", type="service_unavailable",
)


class Track:
    """One replica as the data path sees it: the exchanges in flight on it, and a counter of what
    they received (response heads and stream chunks; our own `: ping` comments excluded). The
    watchdog compares `beats` between its ticks; `seen` and `quiet_since` are its bookkeeping."""

    __slots__ = ("active", "beats", "seen", "quiet_since")

    def __init__(self) -> None:
        self.active: set[Progress] = set()
        self.beats = 0
        self.seen = 0
        self.quiet_since = 0.0


class Progress:
    """What the client has seen of one exchange (for disconnect phases and latency metrics).

    Timestamps are time.perf_counter() values. `itl` (a DeferredHistogram of proxy/metrics.py:
    `bounds`, `counts`, `sum`) asks the stream relay to time SSE data events and count the gaps
    between them into it; None relays without looking at the chunks.
    """

    __slots__ = ("started", "arrival", "itl", "proxy_s", "relay_at", "first_at", "tail", "body", "marker", "task",
                 "abort", "on_first")

    def __init__(self, arrival: float = 0.0, itl=None, marker: bytes = b"data:") -> None:
        self.started = False
        self.on_first: Callable[[], None] | None = None  # called when the first SSE data event is relayed (a coalescing leader's release)
        self.arrival = arrival  # request arrival
        self.itl = itl
        self.proxy_s = 0.0  # proxy time so far: arrival -> upstream request, upstream headers -> our headers
        self.relay_at = 0.0  # non-streaming: when the upstream body was read (proxy time runs from there)
        self.first_at = 0.0  # streaming: when the first SSE data event was relayed (0: none yet)
        self.tail: bytes | None = None  # streaming: the last chunk with a data event other than [DONE]
        self.body: bytes | None = None  # non-streaming: the body relayed
        self.marker = marker  # what a chunk carrying a token contains (Responses: its text delta event)
        self.task: asyncio.Task | None = None  # the request's task while the exchange runs
        self.abort: str | None = None  # why the exchange was cut (`cut`)

    def usage(self, stream: bool) -> bytes | None:
        """Where the replica's `usage` object is: a stream's last token chunk, else the body (the
        chat/completions/embeddings answers'; proxy/spec.py `Spec.usage`)."""
        return self.tail if stream else self.body

    def cut(self, reason: str) -> None:
        """End the exchange from outside (its replica is down): it fails over if nothing reached
        the client yet, else its stream ends with an SSE error event; the upstream is closed."""
        if self.abort is None and self.task is not None:
            self.abort = reason
            self.task.cancel()

    def ttft(self) -> float | None:
        return self.first_at - self.arrival if self.first_at else None

    def overhead(self, ended: float) -> float:
        """Seconds spent in the proxy, not waiting on the upstream: until the upstream request went
        out, from its response headers to ours and, for a plain body, from reading it to the end."""
        return self.proxy_s + (ended - self.relay_at if self.relay_at else 0.0)


class Upstream:
    """The process-wide upstream clients: the lean HTTP/1.1 pool (proxy/http1.py) for the data
    path, and one httpx client for the control plane (discovery, scraping, probes, LoRA admin;
    proxy/control.py)."""

    def __init__(self, server: ServerConfig) -> None:
        self.server = server
        self.pool = Pool(server.upstream_keep_alive_s, server.max_response_bytes)
        self.tracks: dict[Backend, Track] = {}  # per replica, across config reloads (proxy/watchdog.py)
        self.keepalive = server.sse_keepalive_s
        self.session: httpx.AsyncClient | None = None

    async def open(self) -> None:
        t = self.server.timeouts
        self.session = control.client(self.server.upstream_keep_alive_s, t.connect, t.first_byte)

    async def close(self) -> None:
        self.pool.close()
        if self.session is not None:
            await self.session.aclose()
            self.session = None

    async def exchange(
        self,
        backend: Backend,
        endpoint: str,
        body: bytes,
        request_id: bytes,
        send: Send,
        response_headers: Headers,
        progress: Progress,
        rename: tuple[bytes, bytes] | None = None,
        retryable: bool = False,
        timeouts: Timeouts | None = None,
        head: bytes | None = None,
    ) -> int:
        """POST `body` to `backend` and relay the answer to the client. Returns the status sent.

        `rename` swaps the upstream model id for the deployment name in the `model` field (as
        vLLM's --served-model-name would): a byte substitution, never a re-serialization.

        Raises UpstreamFailure only while nothing has been sent to the client yet (and, when
        `retryable`, for a 502/503/504 answer, which another replica may serve instead); after
        the first byte of a stream, a failure ends the stream with an SSE error event.
        `head`: the request line and headers to send instead of the endpoint's usual POST.
        """
        track = self.begin(backend, progress, asyncio.current_task())
        try:
            try:
                resp = await self.pool.request(
                    backend.origin, backend.request_head(endpoint, len(body), request_id, head), body,
                    timeouts or self.server.timeouts,
                )
            except UpstreamError as exc:
                raise as_failure(exc) from None
            track.beats += 1
            headers_at = perf_counter()
            try:
                status = resp.status
                ctype = resp.content_type
                if status < 400 and ctype.startswith(b"text/event-stream"):
                    headers_out = [(b"content-type", ctype), *SSE_HEADERS, *response_headers]
                    await self._relay_stream(resp, send, headers_out, rename, progress, headers_at, track)
                    return status
                try:
                    payload = await resp.read(self.pool.max_body_bytes)
                except UpstreamError as exc:
                    raise as_failure(exc) from None
                payload, headers_out = plain_answer(status, ctype, payload, progress, response_headers, rename, retryable)
                await send({"type": "http.response.start", "status": status, "headers": headers_out})
                await send({"type": "http.response.body", "body": payload})
                return status
            except BaseException:
                resp.close()  # drops the connection: vLLM sees the disconnect and aborts the request
                raise
            finally:
                resp.release()
        except asyncio.CancelledError:
            if progress.abort is None or progress.started:
                raise  # the client left, or the server is shutting down (or a cut came as the answer went out)
            _uncancel()
            raise UpstreamFailure("down", 502, progress.abort) from None
        finally:
            track.active.discard(progress)
            progress.task = None

    def begin(self, backend: Backend, progress: Progress, task) -> Track:
        """An exchange with `backend` starts: counted on its track (the watchdog's view) until it ends
        (`track.active.discard(progress)`). `task`: what `Progress.cut` cancels."""
        progress.proxy_s = perf_counter() - progress.arrival
        track = self.tracks.get(backend)
        if track is None:
            track = self.tracks[backend] = Track()
        progress.task = task
        track.active.add(progress)
        return track

    async def _relay_stream(
        self, resp: Response, send: Send, headers: Headers, rename: tuple[bytes, bytes] | None,
        progress: Progress, headers_at: float, track: Track,
    ) -> None:
        # The head goes out before the first token (clients see the status during the prefill), with
        # it when that is at hand; the last bytes go out with the stream's end (fewer writes a stream)
        await send({"type": "http.response.start", "status": resp.status, "headers": headers,
                    BODY_FOLLOWS: resp.buffered()})
        progress.started = True
        progress.proxy_s += perf_counter() - headers_at
        try:
            if progress.itl is None:
                while (chunk := await resp.next_chunk(self.keepalive)) is not None:
                    if chunk is not PING:
                        track.beats += 1
                    if rename is not None:
                        chunk = chunk.replace(*rename)
                    ended = resp.ended()
                    await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                    if ended:
                        return
            elif await _relay_timed(resp, send, rename, progress, self.keepalive, track):
                return
        except UpstreamError as exc:
            failure = UpstreamFailure(exc.kind, 502, f"The model server failed mid-stream ({exc}).")
            await _end_stream(resp, send, failure)
            raise StreamBroken(failure) from None
        except asyncio.CancelledError:
            reason = progress.abort
            await _end_stream(resp, send, SHUTTING_DOWN if reason is None else UpstreamFailure("down", 502, reason))
            if reason is None:
                raise  # the client left (it sees nothing), or the drain deadline passed
            _uncancel()
            raise StreamBroken(UpstreamFailure("down", 502, reason)) from None
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def plain_answer(
    status: int, ctype: bytes, payload: bytes, progress: Progress, response_headers: Headers,
    rename: tuple[bytes, bytes] | None, retryable: bool,
) -> tuple[bytes, list]:
    """The body and headers of a plain answer read whole from the replica (its error normalised to
    OpenAI's envelope, its model renamed); a 502/503/504 is raised as UpstreamFailure when
    `retryable`, since another replica may serve the request instead."""
    read_at = perf_counter()
    if status >= 400:
        payload, ctype = normalise_upstream_error(status, payload), JSON
        if retryable and status in RETRY_STATUSES:
            raise UpstreamFailure("status_5xx", status, "", payload=payload)
    elif rename is not None:
        payload = payload.replace(*rename)
    # headers go out before the body: the header counts proxy time up to this point
    overhead_ms = fixed3((progress.proxy_s + perf_counter() - read_at) * 1000.0)
    progress.relay_at = read_at
    progress.body = payload
    progress.started = True
    return payload, [(b"content-type", ctype), (b"content-length", str(len(payload)).encode()),
                     (b"x-vllm-proxy-overhead-ms", overhead_ms), *response_headers]


async def _end_stream(resp: Response, send: Send, error: ProxyError) -> None:
    """Close the upstream (vLLM aborts the request) and end the client's stream with `error` as
    an SSE event (no [DONE]: the openai SDK raises it)."""
    resp.close()
    try:
        await send({"type": "http.response.body", "body": error.sse_event(), "more_body": False})
    except Exception:  # noqa: BLE001 - the client is gone: nobody to tell
        pass


def _uncancel() -> None:
    """After catching a cancellation the proxy asked for (`Progress.cut`), the task goes on:
    clear it from the task's count so later awaits are not cancelled (Python >= 3.11)."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


def as_failure(exc: UpstreamError) -> UpstreamFailure:
    if exc.kind == "timeout":
        return UpstreamFailure("timeout", 504, f"The model server did not answer in time: {exc}.")
    return UpstreamFailure(exc.kind, 502, f"The model server failed: {exc}.")


class StreamBroken(Exception):
    """A stream that failed after its first byte; the client already got an SSE error event."""

    def __init__(self, failure: UpstreamFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


async def _relay_timed(
    resp: Response, send: Send, rename: tuple[bytes, bytes] | None, progress: Progress, keepalive: float | None,
    track: Track,
) -> bool:
    """The relay loop, timing SSE data events without parsing them: a substring test per chunk,
    one clock read and one bisect per chunk that carries a data event, no allocation.

    One gap is counted per upstream chunk, however many events it carries: events that arrive
    together were flushed by one engine step (the n choices of a step, or output the engine
    coalesced), and counting the zero gaps between them would drag the distribution to 0.
    `data: [DONE]` carries no token and is skipped; each gap is committed when the next data
    chunk arrives, and the last one only if its chunk is not the usage-only event
    (`"choices":[]`, sent with stream_options.include_usage), which is no token either.
    True: its last message ended the client's stream (the upstream's end had arrived with its bytes).
    """
    itl = progress.itl
    marker = progress.marker
    bounds, counts = itl.bounds, itl.counts
    started = False
    last = total = gap = 0.0
    pending = -1  # bucket of the gap not yet committed
    tail = None
    try:
        while (chunk := await resp.next_chunk(keepalive)) is not None:
            if chunk is not PING:
                track.beats += 1
            if rename is not None:
                chunk = chunk.replace(*rename)
            if started:
                if marker in chunk and not chunk.startswith(b"data: [DONE]"):
                    if pending >= 0:
                        counts[pending] += 1
                        total += gap
                    now = perf_counter()
                    gap = now - last
                    last = now
                    pending = bisect_left(bounds, gap)
                    tail = chunk
            elif marker in chunk:
                last = progress.first_at = perf_counter()
                started = True
                tail = chunk
                if progress.on_first is not None:
                    progress.on_first()
            ended = resp.ended()
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if ended:
                return True  # (the client's stream is complete)
        return False
    finally:
        if pending >= 0 and not _usage_first(tail):
            counts[pending] += 1
            total += gap
        itl.sum += total
        progress.tail = tail


def _usage_first(chunk: bytes | None) -> bool:
    """Whether the chunk's first event is the usage-only one (`"choices":[]`), not a token event."""
    if chunk is None:
        return False
    at = chunk.find(b'"choices":[]')
    if at < 0:
        return False
    second = chunk.find(b"data:", 5)
    return second < 0 or second > at
