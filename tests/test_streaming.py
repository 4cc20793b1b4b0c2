"""Streaming relays chunks as they arrive; disconnects free the replica; mid-stream failures end
the stream with an SSE error event."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import orjson
import pytest

from proxy.server import ProxyProtocol
from tests.conftest import MODEL, Servers, eventually, sim_of
from tests.support import held

LONG_PROMPT = "word " * 2000


def chat(stream: bool, max_tokens: int = 50, content: str = "hello") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": stream}


def running(sim) -> int:
    return sim_of(sim).stats()["running"] + sim_of(sim).stats()["waiting"]


def test_chunks_arrive_unbuffered(servers: Servers) -> None:
    sim = servers.sim(time_scale=1.0, itl_ms=40.0, prefill_ms_per_token=0.0)
    proxy = servers.proxy_for(sim)
    arrivals = []
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=chat(True, max_tokens=10)) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-accel-buffering"] == "no"
        assert "content-encoding" not in resp.headers
        for line in resp.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) >= 11
    # tokens come ~40 ms apart: the first one reached us long before the last was generated
    assert arrivals[-1] - arrivals[1] > 0.25


# Disconnects are caught by our lean cycle under `vllm-proxy serve` (proxy/server.py) and by a
# watcher task under any other ASGI server (stock uvicorn here): both must free the replica.
SERVERS = pytest.mark.parametrize("http", [ProxyProtocol, "httptools"], ids=["lean", "stock-uvicorn"])


@SERVERS
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_prefill_frees_the_replica(servers: Servers, stream: bool, http) -> None:
    sim = servers.sim()
    proxy = servers.proxy({"backends": [{"name": "gpu-0", "url": sim.url}]}, http=http)
    body = orjson.dumps(chat(stream, content=LONG_PROMPT))
    with held(sim.url):  # a prefill that never ends unless the request is aborted
        sock = socket.create_connection(("127.0.0.1", proxy.port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert eventually(lambda: sim_of(sim).engine.held == 1, timeout=30), "request never reached the replica"
        sock.close()  # the client goes away before the first byte
        assert eventually(lambda: running(sim) == 0, timeout=30), "replica slot still busy after the disconnect"
    assert sim_of(sim).stats()["aborted"] == 1 and sim_of(sim).stats()["completed"] == 0


@SERVERS
def test_disconnect_mid_stream_frees_the_replica(servers: Servers, http) -> None:
    sim = servers.sim(time_scale=1.0, prefill_ms_per_token=0.0, itl_ms=100.0)  # 40 s unless cut off
    proxy = servers.proxy({"backends": [{"name": "gpu-0", "url": sim.url}]}, http=http)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", proxy.url + "/v1/chat/completions", json=chat(True, max_tokens=400)) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert running(sim) == 1
    assert eventually(lambda: running(sim) == 0, timeout=20)
    assert sim_of(sim).stats()["aborted"] == 1
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'vllm_proxy_client_disconnects_total{deployment="%s",phase="streaming"} 1.0' % MODEL in metrics


class BrokenStreamServer:
    """Answers one SSE chunk, then drops the connection: an upstream dying mid-stream."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if conn.recv(65536).startswith(b"GET"):  # discovery probe
                models = b'{"object":"list","data":[{"id":"%s","object":"model"}]}' % MODEL.encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(models), models))
                conn.close()
                continue
            chunk = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n" % len(chunk) + chunk + b"\r\n"
            )
            time.sleep(0.05)
            conn.close()


def test_upstream_failure_mid_stream_ends_with_sse_error(servers: Servers) -> None:
    broken = BrokenStreamServer()
    proxy = servers.proxy({"backends": [{"name": "flaky", "url": broken.url, "models": [MODEL]}]})
    resp = httpx.post(proxy.url + "/v1/chat/completions", json=chat(True))
    assert resp.status_code == 200
    events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[0].startswith('data: {"id":"x"')
    assert events[-1].startswith('data: {"error":')
    assert "[DONE]" not in resp.text
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True):
            pass
    broken.sock.close()
