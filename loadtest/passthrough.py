"""Minimal Starlette + aiohttp passthrough: the sanity baseline of the overhead benchmark.

ANCHORS.md has a row for exactly this shape; if the harness reproduces it, the harness is sound.
It does nothing a proxy must do (no routing, no metrics, no errors): it only forwards.

    python -m loadtest.passthrough --port 8300 --upstream http://127.0.0.1:8100
"""
from __future__ import annotations

import argparse
import contextlib

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

UPSTREAM = "http://127.0.0.1:8100"
HOP = {"content-length", "transfer-encoding", "connection", "keep-alive"}


@contextlib.asynccontextmanager
async def lifespan(app: Starlette):
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    app.state.session = aiohttp.ClientSession(UPSTREAM, connector=connector, auto_decompress=False)
    yield
    await app.state.session.close()


async def forward(request: Request) -> Response:
    body = await request.body()
    upstream = await request.app.state.session.post(
        request.url.path, data=body, headers={"content-type": "application/json"})
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        async def relay():
            async with upstream:
                async for chunk in upstream.content.iter_any():
                    yield chunk
        return StreamingResponse(relay(), upstream.status, headers)
    async with upstream:
        return Response(await upstream.read(), upstream.status, headers)


async def health(request: Request) -> Response:
    return Response()


app = Starlette(routes=[Route("/v1/chat/completions", forward, methods=["POST"]), Route("/health", health)],
                lifespan=lifespan)


def main() -> None:
    global UPSTREAM
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--upstream", default=UPSTREAM)
    args = ap.parse_args()
    UPSTREAM = args.upstream
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
