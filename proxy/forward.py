"""The upstream exchange: one shared aiohttp session per process, bytes relayed as they arrive.

aiohttp, not httpx's default transport: measured, httpx's pool collapses under concurrency
(ANCHORS.md). Streams are relayed chunk by chunk, never re-parsed or re-serialized.
"""
from __future__ import annotations

import asyncio
import aiohttp

from proxy.asgi import Headers, Send
from proxy.config import ServerConfig
from proxy.errors import ProxyError, normalise_upstream_error

JSON = b"application/json"
SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class UpstreamFailure(ProxyError):
    """The replica failed before any byte reached the client (so another replica may be tried)."""

    def __init__(self, kind: str, status: int, message: str) -> None:
        super().__init__(status, message, code=f"upstream_{kind}")
        self.kind = kind  # connect | timeout | reset | status_5xx


class Progress:
    """What the client has seen of one exchange (for disconnect phases and latency metrics)."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False


class Upstream:
    """The process-wide upstream client and its timeouts."""

    def __init__(self, server: ServerConfig) -> None:
        self.server = server
        t = server.timeouts
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect, sock_read=t.first_byte)
        self.idle_timeout = t.idle
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=self.server.upstream_keep_alive_s, ttl_dns_cache=60
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=self.timeout,
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def exchange(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        send: Send,
        response_headers: Headers,
        progress: Progress,
        rename: tuple[bytes, bytes] | None = None,
    ) -> int:
        """POST `body` to `url` and relay the answer to the client. Returns the status sent.

        `rename` swaps the upstream model id for the deployment name in the `model` field (as
        vLLM's --served-model-name would): a byte substitution, never a re-serialization.

        Raises UpstreamFailure only while nothing has been sent to the client yet; after the first
        byte of a stream, a failure ends the stream with an SSE error event instead.
        """
        assert self.session is not None
        try:
            resp = await self.session.post(url, data=body, headers=headers)
        except asyncio.TimeoutError:
            raise UpstreamFailure("timeout", 504, "The model server did not answer in time.") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamFailure("connect", 502, f"Cannot connect to the model server: {exc.strerror or exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamFailure("reset", 502, f"The model server closed the connection: {exc}") from None
        try:
            status = resp.status
            ctype = resp.headers.get("Content-Type", "application/json").encode("latin-1")
            if status < 400 and ctype.startswith(b"text/event-stream"):
                progress.started = True
                await self._relay_stream(resp, send, [(b"content-type", ctype), *SSE_HEADERS, *response_headers], rename)
                return status
            try:
                payload = await resp.read()
            except asyncio.TimeoutError:
                raise UpstreamFailure("timeout", 504, "The model server stopped answering.") from None
            except aiohttp.ClientError as exc:
                raise UpstreamFailure("reset", 502, f"The model server broke off its answer: {exc}") from None
            if status >= 400:
                payload, ctype = normalise_upstream_error(status, payload), JSON
            elif rename is not None:
                payload = payload.replace(*rename)
            headers_out = [(b"content-type", ctype), (b"content-length", b"%d" % len(payload)), *response_headers]
            progress.started = True
            await send({"type": "http.response.start", "status": status, "headers": headers_out})
            await send({"type": "http.response.body", "body": payload})
            return status
        except BaseException:
            resp.close()  # drops the connection: vLLM sees the disconnect and aborts the request
            raise
        finally:
            resp.release()

    async def _relay_stream(
        self, resp: aiohttp.ClientResponse, send: Send, headers: Headers, rename: tuple[bytes, bytes] | None
    ) -> None:
        if resp.connection is not None:
            resp.connection.protocol.read_timeout = self.idle_timeout  # first byte came; now the idle gap
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        try:
            async for chunk in resp.content.iter_any():
                if rename is not None:
                    chunk = chunk.replace(*rename)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "reset"
            failure = UpstreamFailure(kind, 502, f"The model server failed mid-stream ({kind}).")
            resp.close()
            await send({"type": "http.response.body", "body": failure.sse_event(), "more_body": False})
            raise StreamBroken(failure) from None
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class StreamBroken(Exception):
    """A stream that failed after its first byte; the client already got an SSE error event."""

    def __init__(self, failure: UpstreamFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure
