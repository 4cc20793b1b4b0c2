"""A fake vLLM server on uvicorn: a Python ASGI backend, as slow per request as real servers are.

`loadtest.fast_backend` answers in microseconds, which measures a forwarder's CPU cost in
isolation; this one costs the CPU a uvicorn-based server costs (≈ what ../shared/ANCHORS.md's
fake backend cost: 12-13 k RPS direct on 2 cores), so the benchmark also shows how a forwarder
does when it shares the machine with a realistic Python backend. Same canned bodies.

    python -m loadtest.asgi_backend --port 8100
"""
from __future__ import annotations

import argparse
import asyncio

from loadtest import fast_backend as fb


def _split(raw: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and body of one of fast_backend's precomputed responses."""
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    headers = [tuple(ln.split(b": ", 1)) for ln in lines[1:] if not ln.lower().startswith(b"content-length")]
    return int(lines[0].split()[1]), headers, body


_GET = {path.decode(): _split(raw) for path, raw in fb.GET_ROUTES.items()}
_CHAT = _split(fb.CHAT)
_NOT_FOUND = _split(fb.NOT_FOUND)
_EVENTS = fb.STREAM_EVENTS
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def _read(receive) -> bytes:
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if scope["method"] == "POST" and path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        body = await _read(receive)
        if b'"stream":true' in body.replace(b" ", b""):
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            for event in _EVENTS:
                await send({"type": "http.response.body", "body": event, "more_body": True})
                await asyncio.sleep(0)  # one loop turn per token, as a server emitting tokens
            await send({"type": "http.response.body", "body": b""})
            return
        status, headers, payload = _CHAT
    else:
        status, headers, payload = _GET.get(path, _NOT_FOUND) if scope["method"] == "GET" else _NOT_FOUND
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    args = ap.parse_args()
    import uvicorn
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", http="httptools",
                access_log=False, log_level="warning", backlog=4096)


if __name__ == "__main__":
    main()
