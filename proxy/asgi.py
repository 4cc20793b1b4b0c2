"""Tiny raw-ASGI helpers shared by every endpoint (no framework on the hot path)."""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Final

from proxy.errors import ProxyError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

# Scope key set by our own server (proxy/server.py): an object with arm() -> watch (`gone`, `stop()`)
# that cancels the request task when the client disconnects. Under other ASGI servers the handler
# watches `receive()` itself.
DISCONNECT: Final = "vllm_proxy.disconnect"
# an http.response.start key of ours: a body message follows at once (no await in between), so a
# server may send the head with it, in one write (our own does: proxy/cycle.py; others ignore it)
BODY_FOLLOWS: Final = "vllm_proxy.body_follows"


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes, headers: Headers = ()) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *headers],
    })
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: ProxyError, headers: Headers = ()) -> None:
    await send_bytes(send, error.status, error.body(), b"application/json", [*error.headers, *headers])


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a (lower-case) request header."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def bearer(scope: Scope) -> bytes | None:
    """The token of `Authorization: Bearer <token>`, if one was sent."""
    value = header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None
