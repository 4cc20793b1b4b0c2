"""Attack cases beyond issue 16's review, each found against a live proxy (the adversarial pass).

Clients: a read full of pipelined requests; a client that never reads its answer; a multipart
upload that the proxy and vLLM's form parser would read as two different forms; upgrade requests
(WebSocket, h2c) to a server that speaks neither.
Upstreams: a replica whose control-plane answers (/v1/models, /metrics) never end, or inflate.
"""
from __future__ import annotations

import struct
import asyncio
import resource
import socket
import socketserver
import threading
import time
import zlib
from types import SimpleNamespace

import httpx
import orjson
import pytest

from proxy.server import MAX_PIPELINED
from tests.conftest import MODEL, Servers
from tests.test_hardening import limits
from tests.test_server import read_response

WAIT = 10.0
MIB = 1 << 20


# -- clients ------------------------------------------------------------------------------------

def test_a_pipelined_flood_is_answered_in_part_then_closed(servers: Servers) -> None:
    """Before: 256 KiB of pipelined `GET /health` queued ~10 000 requests per read, and reading
    resumed after each answer: 50 such connections took the proxy from 65 to 900 MB of RSS and
    /health to 5.8 s. Now what was queued is answered in order, then the connection closes."""
    proxy = servers.proxy_for(servers.sim())
    flood = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * ((256 << 10) // 35)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT) as sock:
        sock.sendall(flood)
        f = sock.makefile("rb")
        answered = 0
        while True:
            status, headers, body = read_response(f)
            assert (status, body) == (200, b'{"status":"ok"}')
            answered += 1
            if headers.get("connection") == "close":
                break
        assert f.read() == b""  # closed after the last queued answer, nothing more
    assert MAX_PIPELINED < answered <= 4 * MAX_PIPELINED
    assert httpx.get(proxy.url + "/health", timeout=WAIT).status_code == 200


def test_a_client_that_never_reads_its_answer_is_dropped(servers: Servers) -> None:
    """Before: a 16 MB answer nobody read stayed in the proxy's memory for good (ten such
    clients: +170 MB of RSS, still held minutes later); nginx drops them after `send_timeout`."""
    proxy = servers.proxy({"backends": [{"name": "gpu-0", "url": servers.sim().url}]},
                          http=limits(send_timeout_s=1.0))
    body = orjson.dumps({"model": MODEL, "input": ["a"] * 20000})  # ~16 MB of embeddings
    state = proxy.server.server_state
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(WAIT)
        sock.connect(("127.0.0.1", proxy.port))
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + WAIT
        while not state.connections and time.monotonic() < deadline:
            time.sleep(0.01)  # until the proxy accepted it
        while state.connections and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the condition under test: the proxy dropping the connection
        assert not state.connections, "the unread answer is still held"
        received = 0
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert received < 16_000_000  # cut off, not delivered late
    assert httpx.post(proxy.url + "/v1/embeddings", json={"model": MODEL, "input": "a"}, timeout=WAIT).status_code == 200


def form(boundary: bytes, model: bytes) -> bytes:
    return (b'--%s\r\nContent-Disposition: form-data; name="model"\r\n\r\n%s\r\n--%s\r\nContent-Disposition: '
            b'form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n--%s--\r\n' % (boundary, model, boundary, boundary))


@pytest.mark.parametrize("content_type, body", [
    # vLLM (python-multipart) takes the last boundary, and reads the form before the proxy's
    (b"multipart/form-data; boundary=one; boundary=two", form(b"two", b"other-model") + form(b"one", MODEL.encode())),
    # a preamble the proxy skipped: vLLM refuses it, but it must not be read as another form either
    (b"multipart/form-data; boundary=one", b"x\r\n" + form(b"one", MODEL.encode())),
])
def test_an_upload_read_as_two_different_forms_is_refused(servers: Servers, content_type: bytes, body: bytes) -> None:
    """Before: the proxy routed (and checked the key for) the model of the form at its boundary,
    vLLM ran the model of the other one."""
    proxy = servers.proxy_for(servers.sim())
    resp = httpx.post(proxy.url + "/v1/audio/transcriptions", content=body, headers={"content-type": content_type.decode()},
                      timeout=WAIT)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_multipart", resp.text
    # blank lines before the boundary are fine (python-multipart skips them too)
    ok = httpx.post(proxy.url + "/v1/audio/transcriptions", content=b"\r\n" + form(b"one", MODEL.encode()),
                    headers={"content-type": "multipart/form-data; boundary=one"}, timeout=WAIT)
    assert ok.status_code == 200, ok.text


@pytest.fixture
def served(servers: Servers):
    """The proxy with the uvicorn options `vllm-proxy serve` uses."""
    from proxy.app import ProxyApp
    from proxy.cli import uvicorn_options
    from proxy.config import parse_config
    from tests.support import ServerThread

    config = parse_config({"backends": [{"name": "gpu-0", "url": servers.sim().url}],
                           "discovery": {"interval_s": 0.2, "timeout_s": 5.0, "failures_to_down": 1}})
    options = {**uvicorn_options(config), "timeout_graceful_shutdown": 2, "log_level": "error"}
    proxy = ServerThread(ProxyApp(config), **options).start()
    servers.running.append(proxy)
    return proxy


WS = b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
CHAT_BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def exchange(proxy, data: bytes) -> tuple[list[tuple[int, dict, bytes]], bytes]:
    """Every answer to `data` until the proxy closes the connection (a hang fails on the timeout)."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT) as sock:
        sock.sendall(data)
        f = sock.makefile("rb")
        answers = [read_response(f)]
        while answers[-1][1].get("connection") != "close":
            answers.append(read_response(f))
        return answers, f.read()


def test_a_websocket_upgrade_is_answered_as_plain_http(served) -> None:
    """Before: a 500 (text/plain, "ASGI callable returned without completing handshake")."""
    answers, rest = exchange(served, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + WS + b"\r\n")
    assert [a[0] for a in answers] == [200] and orjson.loads(answers[0][2])["object"] == "list" and rest == b""


@pytest.mark.parametrize("upgrade", [WS, H2C], ids=["websocket", "h2c"])
def test_an_upgrade_request_with_a_body_is_a_clear_400(served, upgrade: bytes) -> None:
    """Before: the body went to the protocol we do not speak: h2c (`curl --http2 http://...`) got
    "body is empty" and a connection that answered nothing more; websocket hung for good."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answers, rest = exchange(served, head + upgrade + b"Content-Length: %d\r\n\r\n" % len(CHAT_BODY) + CHAT_BODY)
    assert [a[0] for a in answers] == [400] and rest == b""
    assert orjson.loads(answers[0][2])["error"]["code"] == "upgrade_not_supported"
    assert httpx.post(served.url + "/v1/chat/completions", content=CHAT_BODY, timeout=WAIT).status_code == 200


def test_after_an_upgrade_request_the_connection_closes_instead_of_going_deaf(served) -> None:
    """Before: the parser stopped at the upgrade, so the next request on the connection was never
    answered (the client waited for the keep-alive timeout). Now it closes: the client retries."""
    answers, rest = exchange(served, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: foo\r\n\r\n"
                                     b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [a[0] for a in answers] == [200] and rest == b""


# -- upstreams ----------------------------------------------------------------------------------


class ControlPlane(socketserver.ThreadingTCPServer):
    """A replica whose GET `path` answers with `answer(write)`; other GETs list MODEL, POSTs 404.
    Counts the bytes written for `path` until the proxy hung up (`hung_up` is then set)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, path: bytes, answer) -> None:
        self.path, self.answer = path, answer
        self.sent = 0
        self.hung_up = threading.Event()
        super().__init__(("127.0.0.1", 0), _ControlHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ControlHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: ControlPlane = self.server  # type: ignore[assignment]
        while (line := self.rfile.readline()):
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
            if line.split()[1] == server.path:
                def write(data: bytes) -> None:
                    self.wfile.write(data)
                    server.sent += len(data)
                try:
                    server.answer(write)
                except OSError:
                    server.hung_up.set()
                    return
                continue
            body = b'{"object":"list","data":[{"id":"%s","object":"model"}]}' % MODEL.encode()
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))


def endless(write) -> None:
    write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
    write(b'10\r\n{"data":[{"id":"\r\n')
    chunk = b"%x\r\n%s\r\n" % (MIB, b"a" * MIB)
    while True:
        write(chunk)


def control(servers: Servers, path: bytes, answer) -> tuple[ControlPlane, object]:
    upstream = ControlPlane(path, answer)
    servers.running.append(SimpleNamespace(stop=upstream.shutdown))  # type: ignore[arg-type]
    proxy = servers.proxy({"backends": [{"name": "odd", "url": upstream.url}],
                           "discovery": {"interval_s": 0.2, "timeout_s": 5.0, "failures_to_down": 1}})
    return upstream, proxy


def gzip_bomb(head: bytes, spaces: int, tail: bytes) -> bytes:
    """gzip of head + `spaces` spaces (a multiple of 1 MiB) + tail, built without compressing it
    all: after a full flush each 1 MiB of spaces deflates to the same bytes."""
    block = b" " * MIB
    d = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = d.compress(head) + d.flush(zlib.Z_FULL_FLUSH)
    piece = d.compress(block) + d.flush(zlib.Z_FULL_FLUSH)
    last = d.compress(tail) + d.flush()
    crc = zlib.crc32(head)
    for _ in range(spaces // MIB):
        crc = zlib.crc32(block, crc)
    size = len(head) + spaces + len(tail)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + first + piece * (spaces // MIB) + last
            + struct.pack("<II", zlib.crc32(tail, crc), size & 0xFFFFFFFF))


def test_a_gzip_bomb_from_a_replica_is_never_inflated(servers: Servers) -> None:
    """Control-plane answers are read as sent (we ask for no encoding): 1 GiB of JSON whitespace in
    1 MiB of gzip stays 1 MiB. Runs first in this file: the peak RSS only ever grows."""
    bomb = gzip_bomb(b'{"object":"list","data":[{"id":"%s"}]' % MODEL.encode(), 1 << 30, b"}")
    served = threading.Event()

    def answer(write) -> None:
        write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
              b"content-length: %d\r\n\r\n" % len(bomb) + bomb)
        served.set()

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    upstream, proxy = control(servers, b"/v1/models", answer)
    assert served.wait(WAIT)
    assert httpx.get(proxy.url + "/health", timeout=WAIT).status_code == 200
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown_mib < 256, f"peak RSS grew by {grown_mib:.0f} MiB"


def test_a_replica_listing_thousands_of_models_is_not_served(servers: Servers) -> None:
    """Before: a replica listing 400 000 models (16 MB) had every one served; each poll stalled
    the event loop for about a second (/health p99 1.2 s) and the listing grew to 43 MB."""
    import orjson as _orjson

    body = _orjson.dumps({"object": "list", "data": [{"id": f"m{i}", "object": "model"} for i in range(5000)]})
    polls = threading.Semaphore(0)

    def answer(write) -> None:
        write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        polls.release()

    upstream, proxy = control(servers, b"/v1/models", answer)
    for _ in range(3):  # the first round ran at startup; two more are past any race with it
        assert polls.acquire(timeout=WAIT)
    assert httpx.get(proxy.url + "/v1/models", timeout=WAIT).json()["data"] == []


@pytest.mark.parametrize("path", [b"/v1/models", b"/metrics"])
def test_an_endless_control_plane_answer_is_cut_off(servers: Servers, path: bytes) -> None:
    """Before: discovery and the metrics scrape read a replica's answer whole, for up to their
    timeout: 1.6 GB of RSS from one replica streaming /v1/models."""
    upstream, proxy = control(servers, path, endless)
    assert upstream.hung_up.wait(WAIT), f"the proxy read {upstream.sent >> 20} MiB and kept reading"
    assert upstream.sent < 64 * MIB, f"{upstream.sent >> 20} MiB read"
    assert httpx.get(proxy.url + "/health", timeout=WAIT).status_code == 200


# -- the media guard's DNS check ------------------------------------------------------------------

async def test_dns_lookups_that_never_end_cannot_take_the_resolver_threads(monkeypatch) -> None:
    """Before: each media URL under a DNS server that never answers held a getaddrinfo thread
    (libuv has 4, shared with upstream connects) long after the 0.5 s check gave up: a few
    requests a second starved the data path's own name lookups. Now at most 2 run at once."""
    from proxy.urlguard import Forbidden, Resolver

    loop = asyncio.get_running_loop()
    answer = asyncio.Event()
    started: list[str] = []

    async def silent_dns(host, *args, **kwargs):
        started.append(host)
        await answer.wait()
        raise OSError("no answer")

    monkeypatch.setattr(loop, "getaddrinfo", silent_dns)
    resolver = Resolver(timeout_s=0.05)
    for i in range(10):
        with pytest.raises(Forbidden):
            await resolver.check(f"host{i}.example.net")
    assert len(started) == 2 and resolver.running == 2  # the others were refused without a lookup
    answer.set()
    while resolver.running:
        await asyncio.sleep(0)
    with pytest.raises(Forbidden, match="could not be resolved"):
        await resolver.check("host9.example.net")  # a slot again (its earlier refusal was not cached)
    assert started[-1] == "host9.example.net"
