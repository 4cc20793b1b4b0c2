"""The HTTP edge cases of our lean inference cycle (proxy/server.py), on raw sockets: pipelining,
chunked and large uploads, HTTP/1.0, Expect: 100-continue, a client leaving mid-upload."""
from __future__ import annotations

import socket
import threading
import time

import orjson
import pytest

from tests.conftest import MODEL, Servers


def chat_body(content: str = "hello") -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 5})


def request(body: bytes, *, version: str = "1.1", extra: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n%s" % (version.encode(), len(body), extra, body))


def read_response(f) -> tuple[int, dict, bytes]:
    """One response from a buffered socket file: status, headers (lower-case), body."""
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = f.read(int(headers["content-length"]))
    else:
        body = b""
        while (size := int(f.readline().strip(), 16)) > 0:
            body += f.read(size)
            f.readline()
        f.readline()
    return status, headers, body


def connect(proxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    return sock


def test_pipelined_requests_are_answered_in_order(servers: Servers) -> None:
    proxy = servers.proxy_for(servers.sim())
    sock = connect(proxy)
    ids = [b"first-0001", b"second-002", b"third-0003"]
    sock.sendall(b"".join(request(chat_body(), extra=b"X-Request-ID: %s\r\n" % i) for i in ids))
    f = sock.makefile("rb")
    for rid in ids:
        status, headers, body = read_response(f)
        assert status == 200 and headers["x-request-id"] == rid.decode()
        assert orjson.loads(body)["object"] == "chat.completion"
    sock.close()


def test_chunked_and_large_uploads(servers: Servers) -> None:
    proxy = servers.proxy_for(servers.sim(max_model_len=400_000))
    sock = connect(proxy)
    f = sock.makefile("rb")
    # chunked, in several writes
    body = chat_body("chunked " * 50)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    sock.sendall(head)
    for i in range(0, len(body), 100):
        piece = body[i:i + 100]
        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
    sock.sendall(b"0\r\n\r\n")
    status, _, answer = read_response(f)
    assert status == 200, answer
    # 1 MB: past the 64 KiB mark where reading pauses until the handler takes the body
    big = chat_body("word " * 200_000)
    assert len(big) > 1_000_000
    sock.sendall(request(big))
    status, _, answer = read_response(f)
    assert status == 200, answer
    # and the connection is still good for another request
    sock.sendall(request(chat_body()))
    assert read_response(f)[0] == 200
    sock.close()


def test_http_1_0_closes_and_expect_continue_works(servers: Servers) -> None:
    proxy = servers.proxy_for(servers.sim())
    sock = connect(proxy)
    sock.sendall(request(chat_body(), version="1.0"))
    f = sock.makefile("rb")
    status, headers, _ = read_response(f)
    assert status == 200 and headers.get("connection") == "close"
    assert f.read() == b""  # the server closed the connection
    sock.close()

    sock = connect(proxy)
    body = chat_body()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body))
    f = sock.makefile("rb")
    assert f.readline().startswith(b"HTTP/1.1 100")
    f.readline()
    sock.sendall(body)
    assert read_response(f)[0] == 200
    sock.close()


def test_client_leaving_mid_upload_leaves_the_proxy_healthy(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim)
    for _ in range(5):
        sock = connect(proxy)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{\"model\":")
        sock.close()
    sock = connect(proxy)
    sock.sendall(request(chat_body()))
    assert read_response(sock.makefile("rb"))[0] == 200
    sock.close()
    assert sum(sim.server.config.app.stats()["requests"].values()) == 1  # nothing half-sent reached the replica


def test_requests_leave_no_cyclic_garbage(servers: Servers) -> None:
    """Per-request reference cycles would leave the work to the cyclic collector, whose passes
    cost throughput and tail latency (measured on loadtest/overhead.py): none in the proxy's code."""
    import gc

    import httpx

    proxy = servers.proxy_for(servers.sim())
    body = orjson.loads(chat_body())
    with httpx.Client(base_url=proxy.url) as client:
        for _ in range(20):  # warm up: caches and pools fill once
            client.post("/v1/chat/completions", json=body)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for i in range(60):
                client.post("/v1/chat/completions", json={**body, "stream": i % 2 == 0})
            client.post("/v1/chat/completions", content=b"{not json")  # an error answer too
            gc.collect()
            ours = [type(o).__qualname__ for o in gc.garbage
                    if getattr(type(o), "__module__", "").startswith("proxy.")
                    and not type(o).__module__.startswith("proxy.sim")]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert ours == [], sorted(set(ours))


def test_pipelined_client_leaving_cancels_the_running_stream(servers: Servers, caplog) -> None:
    """Two pipelined requests, then the client leaves while the first streams: the first's
    upstream request is closed (the replica aborts it) without an error in the proxy's log.
    (While a request is queued behind another, reading pauses, as in uvicorn, so the departure
    is noticed on the next write: at once for a stream, at the end for a plain response.)"""
    import logging
    import time

    from tests.conftest import eventually, sim_of

    caplog.set_level(logging.ERROR, logger="vllm_proxy")
    sim = servers.sim(time_scale=1.0, itl_ms=50.0, prefill_ms_per_token=0.0)  # 20 s unless cut off
    proxy = servers.proxy_for(sim)
    for _ in range(2):
        long = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 400, "stream": True})
        sock = connect(proxy)
        sock.sendall(request(long) + request(chat_body()))
        assert eventually(lambda: sim_of(sim).stats()["running"] == 1, timeout=10)
        aborted = sim_of(sim).stats()["aborted"]
        sock.close()
        assert eventually(lambda: sim_of(sim).stats()["running"] == 0, timeout=10), "replica still generating"
        assert sim_of(sim).stats()["aborted"] == aborted + 1
    time.sleep(0.1)
    assert not [r for r in caplog.records if r.name.startswith("vllm_proxy")], caplog.records


def test_stream_head_is_sent_before_the_first_token_and_responses_carry_date(servers: Servers) -> None:
    from tests.conftest import sim_of
    from tests.support import held

    sim = servers.sim()
    proxy = servers.proxy_for(sim)
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}],
                         "max_tokens": 2, "stream": True})
    sock = connect(proxy)
    f = sock.makefile("rb")
    with held(sim.url):  # the prefill lasts until released
        sock.sendall(request(body))
        assert f.readline().startswith(b"HTTP/1.1 200")
        assert sim_of(sim).engine.held == 1  # headers did not wait for prefill
        headers = {}
        while (line := f.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
    first_event = f.readline()
    assert first_event.strip(), first_event
    assert "date" in headers and headers["content-type"].startswith("text/event-stream")
    sock.close()


def test_a_handler_that_forgets_to_answer_gets_a_500_not_a_hang() -> None:
    from proxy.server import ProxyProtocol
    from tests.support import ServerThread

    async def forgetful(scope, receive, send) -> None:
        if scope["type"] == "http":
            await receive()  # reads the body, returns without a response

    with ServerThread(forgetful, http=ProxyProtocol, lifespan="off") as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(request(chat_body()))
        status, headers, body = read_response(sock.makefile("rb"))
        assert status == 500 and orjson.loads(body)["error"]["type"] == "server_error"
        assert headers.get("connection") == "close"
        sock.close()


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(servers: Servers) -> None:
    """A connection that served several requests is still closed once it idles past the
    keep-alive timeout."""
    from proxy.app import ProxyApp
    from proxy.config import parse_config
    from proxy.server import ProxyProtocol
    from tests.support import ServerThread

    sim = servers.sim()
    app = ProxyApp(parse_config({"backends": [{"name": "gpu-0", "url": sim.url}]}))
    proxy = ServerThread(app, loop="uvloop", http=ProxyProtocol, timeout_keep_alive=0.3).start()
    servers.running.append(proxy)
    sock = connect(proxy)
    f = sock.makefile("rb")
    for _ in range(3):
        sock.sendall(request(chat_body()))
        status, headers, _ = read_response(f)
        assert status == 200 and "connection" not in headers  # kept alive
    assert f.read(1) == b""  # the server closed it (the socket's 10 s timeout would raise instead)
    sock.close()


# --- keep-alive and send timeouts on the watchdog (a review's reproductions) --------------------

_SLEEPING = threading.Event()  # set when a /sleep/ request reached the app


async def _timed_app(scope, receive, send) -> None:
    """GET /sleep/S answers "ok" after S seconds; GET /big answers 8 MiB."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    import asyncio

    path = scope["path"]
    if path.startswith("/sleep/"):
        _SLEEPING.set()
        await asyncio.sleep(float(path.rsplit("/", 1)[1]))
    body = b"x" * (8 << 20) if path == "/big" else b"ok"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def _limited(**changes):
    from proxy.server import ProxyProtocol

    return type("Limited", (ProxyProtocol,), {"header_timeout_s": 5.0, "body_timeout_s": 5.0, "send_timeout_s": 60.0,
                                              **changes})


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_request_whose_head_began_during_the_previous_answer_is_not_cut_off_by_keep_alive(loop: str) -> None:
    """B's first bytes arrive while A runs, the rest after A's answer, and B outlasts the
    keep-alive timeout: before, the idle clock started at A's answer and closed B mid-way."""
    from tests.support import ServerThread

    with ServerThread(_timed_app, loop=loop, http=_limited(), timeout_keep_alive=0.5) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        f = sock.makefile("rb")
        _SLEEPING.clear()
        sock.sendall(b"GET /sleep/0.3 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _SLEEPING.wait(10)  # A is in the app: B's first bytes come in a read of their own
        sock.sendall(b"GET /sleep/1.5 HTTP/1.1\r\n")
        assert read_response(f)[0] == 200
        sock.sendall(b"Host: x\r\n\r\n")
        assert read_response(f)[0] == 200, "B was cut off by the keep-alive close"
        sock.close()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_an_unread_answer_is_dropped_by_the_send_timeout_after_the_keep_alive_close(loop: str) -> None:
    """The keep-alive timeout (0.3 s) passes before the send timeout (1 s) while the client reads
    nothing of an 8 MiB answer: the connection must still be dropped, not held for good."""
    from tests.support import ServerThread

    with ServerThread(_timed_app, loop=loop, http=_limited(send_timeout_s=1.0), timeout_keep_alive=0.3) as server:
        state = server.server.server_state
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(10)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            deadline = time.monotonic() + 30  # (far beyond the 1 s send timeout: a bound, not a guess)
            while not state.connections and time.monotonic() < deadline:
                time.sleep(0.01)
            while state.connections and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not state.connections, "the unread answer is held past the send timeout"
