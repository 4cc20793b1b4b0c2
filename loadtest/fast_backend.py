"""A fake vLLM OpenAI server fast enough that it is never the bottleneck.

Forwarding overhead is measured as "proxy in front of backend" vs "backend alone", so the
backend must answer in microseconds: a raw asyncio Protocol with httptools' parser on uvloop,
HTTP/1.1 keep-alive and pipelining-safe, every response body precomputed. No framework.

    python -m loadtest.fast_backend --port 8100
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httptools

MODEL = "bench-model"
N_CHUNKS = 16


def _response(status: str, ctype: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _json(obj: object, status: str = "200 OK") -> bytes:
    return _response(status, "application/json", json.dumps(obj, separators=(",", ":")).encode())


_NOW = int(time.time())
_USAGE = {"prompt_tokens": 24, "completion_tokens": N_CHUNKS, "total_tokens": 24 + N_CHUNKS}
CHAT = _json({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": _NOW, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello from the fast backend!"},
                 "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
    "usage": _USAGE,
})


def _sse_events() -> list[bytes]:
    """The stream's SSE events: 16 chunks (the last has finish_reason), then [DONE]."""
    events = []
    for i in range(N_CHUNKS):
        delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f" tok{i}"}
        chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": _NOW,
                 "model": MODEL, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                 "finish_reason": "stop" if i == N_CHUNKS - 1 else None}]}
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def _chunked(events: list[bytes]) -> list[bytes]:
    parts = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
    return [head + parts[0], *parts[1:-1], parts[-1] + b"0\r\n\r\n"]


STREAM_EVENTS = _sse_events()
STREAM_PARTS = _chunked(STREAM_EVENTS)  # separate writes: head + first chunk, ..., last + end
STREAM_BURST = b"".join(STREAM_PARTS)
MODELS = _json({"object": "list", "data": [{
    "id": MODEL, "object": "model", "created": _NOW, "owned_by": "vllm", "root": MODEL,
    "parent": None, "max_model_len": 4096, "permission": []}]})
OK = _response("200 OK", "text/plain", b"")
METRICS = _response("200 OK", "text/plain; version=0.0.4", "".join(
    f'{name}{{model_name="{MODEL}"}} {val}\n' for name, val in [
        ("vllm:num_requests_running", 0), ("vllm:num_requests_waiting", 0),
        ("vllm:kv_cache_usage_perc", 0.0)]).encode()
    + f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="8192",model_name="{MODEL}"}} 1.0\n'.encode())
# Endpoints some routers probe before they accept a worker (sglang-router, vllm-router).
MODEL_INFO = _json({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True})
SERVER_INFO = _json({"model_path": MODEL, "served_model_name": MODEL, "version": "bench"})
NOT_FOUND = _json({"error": {"message": "not found", "type": "NotFoundError", "param": None, "code": 404}},
                  "404 Not Found")

GET_ROUTES = {b"/health": OK, b"/v1/models": MODELS, b"/metrics": METRICS, b"/get_model_info": MODEL_INFO,
              b"/get_server_info": SERVER_INFO, b"/health_generate": OK, b"/version": _json({"version": "bench"})}


class HttpProtocol(asyncio.Protocol):
    """One connection: parse with httptools, answer each complete request from the tables above.

    A stream is written event by event, one loop iteration apart (each its own TCP segment, as
    vLLM emits tokens), so a proxy really handles 16 reads; `--burst` sends it in one write.
    Reading pauses while a stream is in flight, which keeps responses in request order.
    """

    burst = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.loop = asyncio.get_running_loop()
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(_response("400 Bad Request", "text/plain", b"bad request"))
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        keep_alive = self.parser.should_keep_alive()
        path = self.url.split(b"?", 1)[0]
        if self.parser.get_method() == b"POST":
            if path in (b"/v1/chat/completions", b"/v1/completions", b"/generate"):
                # Substring check, not a JSON parse: we measure forwarding, not the backend.
                if b'"stream":true' in b"".join(self.body).replace(b" ", b""):
                    if self.burst:
                        resp = STREAM_BURST
                    else:
                        self.transport.pause_reading()
                        self._stream(0, keep_alive)
                        return
                else:
                    resp = CHAT
            else:
                resp = NOT_FOUND
        else:
            resp = GET_ROUTES.get(path, NOT_FOUND)
        self.transport.write(resp)
        if not keep_alive:
            self.transport.close()

    def _stream(self, i: int, keep_alive: bool) -> None:
        if self.closed:
            return
        self.transport.write(STREAM_PARTS[i])
        if i + 1 < len(STREAM_PARTS):
            self.loop.call_soon(self._stream, i + 1, keep_alive)
        elif keep_alive:
            self.transport.resume_reading()
        else:
            self.transport.close()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(HttpProtocol, host, port, backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--burst", action="store_true", help="send each SSE stream in a single write")
    args = ap.parse_args()
    HttpProtocol.burst = args.burst
    import uvloop
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
