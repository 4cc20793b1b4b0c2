"""A live proxy against hostile clients and broken upstreams (issue 16's review cases).

Clients: idle and slow-drip sockets are closed, oversized heads are 431s, stalled bodies end.
Upstreams: interim 1xx, impossible statuses, bytes past the body and close-delimited bodies reach
the client as the upstream's one real answer, or as a 502. Media: every place vLLM reads a URL
from is guarded.
"""
from __future__ import annotations

import socket
import socketserver
import threading
import time
from types import SimpleNamespace

import httpx
import orjson
import pytest

from proxy.server import ProxyProtocol
from tests.conftest import MODEL, Servers
from tests.support import ServerThread

CHAT = "/v1/chat/completions"
WAIT = 10.0  # generous bound on any single step; the timeouts under test are 0.5 s


def limits(**changes) -> type[ProxyProtocol]:
    values = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "max_header_bytes": 64 * 1024, "max_headers": 100}
    return type("Limited", (ProxyProtocol,), {**values, **changes})  # as ProxyProtocol.configured() makes it


def connect(proxy: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the proxy closes the connection (socket.timeout if it never does)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def chat(content: str = "hi") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def request(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s\r\n%s" % (len(body), extra, body))


@pytest.fixture
def guarded(servers: Servers):
    sim = servers.sim()
    return servers.proxy({"backends": [{"name": "gpu-0", "url": sim.url}]}, http=limits())


# -- clients ------------------------------------------------------------------------------------

def test_idle_connection_is_closed(guarded) -> None:
    """Before: a socket that never sent a byte stayed open forever (20 k of them exhausted fds)."""
    with connect(guarded) as sock:
        assert read_all(sock) == b""


def test_slow_drip_head_is_closed_with_408(guarded) -> None:
    with connect(guarded) as sock:
        head = request(orjson.dumps(chat()))
        answer = b""
        try:
            for i in range(len(head)):
                sock.sendall(head[i:i + 1])
                time.sleep(0.05)  # the drip under test, not a barrier
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer


def test_keep_alive_connection_dripping_blank_lines_is_closed(guarded) -> None:
    """Blank lines between requests start no request in the parser: they must not hold a
    keep-alive connection open forever either."""
    with connect(guarded) as sock:
        sock.sendall(request(orjson.dumps(chat())))
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        try:
            for _ in range(400):
                sock.sendall(b"\r\n")
                time.sleep(0.05)  # the drip under test, not a barrier
        except (BrokenPipeError, ConnectionResetError):
            return
        raise AssertionError("the connection stayed open")


def test_idle_connections_are_shed_when_connections_run_short(servers: Servers) -> None:
    """Before: idle sockets held their file descriptors until the fd limit was reached, and then
    /health itself could not connect. The header timeout here is long: only shedding closes them."""
    sim = servers.sim()
    proxy = servers.proxy({"backends": [{"name": "gpu-0", "url": sim.url}]},
                          http=limits(header_timeout_s=60.0, shed_above=40))
    idle = [connect(proxy) for _ in range(60)]
    try:
        time.sleep(1.2)  # they must be idle for over a second to be shed: the condition under test
        assert httpx.get(proxy.url + "/health", timeout=WAIT).status_code == 200
        closed = 0
        for sock in idle:
            sock.settimeout(WAIT)
            try:
                closed += read_all(sock) == b""
            except socket.timeout:
                pass
        assert closed >= 50
        assert httpx.post(proxy.url + CHAT, json=chat(), timeout=WAIT).status_code == 200
    finally:
        for sock in idle:
            sock.close()


def test_stalled_body_is_closed(guarded) -> None:
    with connect(guarded) as sock:
        sock.sendall(request(b"x" * 100)[:-90])  # head and 10 of 100 body bytes, then nothing
        assert b"HTTP/1.1 200" not in read_all(sock)


def test_two_mib_header_is_431_and_health_stays_up(guarded) -> None:
    """Before: a 2 MiB header got a 200 (and 256 MiB stalled the event loop)."""
    with connect(guarded) as sock:
        try:
            sock.sendall(request(orjson.dumps(chat()), b"x-big: " + b"a" * (2 << 20) + b"\r\n"))
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b'"code":"headers_too_large"' in answer
    assert httpx.get(guarded.url + "/health", timeout=WAIT).status_code == 200


def test_large_head_in_one_read_is_431(guarded) -> None:
    """A head over the limit that arrives (with its body) in one read is measured exactly."""
    resp = httpx.post(guarded.url + CHAT, json=chat(), headers={f"x-h{i}": "a" * 1000 for i in range(70)}, timeout=WAIT)
    assert resp.status_code == 431
    assert resp.json()["error"]["code"] == "headers_too_large"


def test_too_many_headers_is_431(guarded) -> None:
    resp = httpx.post(guarded.url + CHAT, json=chat(), headers={f"x-h{i}": "1" for i in range(150)}, timeout=WAIT)
    assert resp.status_code == 431


def test_heads_under_the_limits_pass_and_keep_alive_outlives_the_header_timeout(guarded) -> None:
    with httpx.Client(timeout=WAIT) as client:
        resp = client.post(guarded.url + CHAT, json=chat(), headers={f"x-h{i}": "a" * 500 for i in range(90)})
        assert resp.status_code == 200
        time.sleep(1.0)  # idle between two requests longer than header_timeout_s: keep-alive rules there
        assert client.post(guarded.url + CHAT, json=chat()).status_code == 200


def test_malformed_request_is_an_error_envelope(guarded) -> None:
    with connect(guarded) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost x\r\n\r\n")
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400") and b'"error"' in answer


@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/v1/unknown"])
def test_malformed_chunk_after_a_valid_head_is_an_error_envelope(guarded, path: bytes) -> None:
    """Before: the app already ran for the valid head, so a bad chunk size closed the connection
    without an answer. `path`: the lean inference cycle and uvicorn's own cycle."""
    with connect(guarded) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n5\r\n{\"a\":\r\nzz\r\n" % path)
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400") and b'"invalid_http_request"' in answer
    assert answer.count(b"HTTP/1.1") == 1  # the app's own answer (a 404, a 500) never follows


# -- upstreams ----------------------------------------------------------------------------------

class Scripted(socketserver.ThreadingTCPServer):
    """A replica that answers GETs properly and each POST with `answer(n, body)` (raw bytes, and
    whether to close the connection after)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, answer) -> None:
        self.answer = answer
        self.posts = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: Scripted = self.server  # type: ignore[assignment]
        while True:
            line = self.rfile.readline()
            if not line:
                return
            length = 0
            while (header := self.rfile.readline()) not in (b"\r\n", b""):
                if header.lower().startswith(b"content-length:"):
                    length = int(header.split(b":")[1])
            body = self.rfile.read(length)
            if line.startswith(b"GET"):
                payload = b'{"object":"list","data":[{"id":"%s","object":"model"}]}' % MODEL.encode()
                self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
                continue
            with server.lock:
                n = server.posts
                server.posts += 1
            for piece in server.answer(n, orjson.loads(body)["messages"][0]["content"].encode()):
                if piece is None:
                    return
                if isinstance(piece, float):
                    time.sleep(piece)  # the upstream's pacing under test
                    continue
                self.wfile.write(piece)
                self.wfile.flush()


def completion(text: bytes) -> bytes:
    return (b'{"id":"c","object":"chat.completion","created":1,"model":"%s","choices":[{"index":0,'
            b'"message":{"role":"assistant","content":"%s"},"finish_reason":"stop"}]}' % (MODEL.encode(), text))


def ok(text: bytes) -> bytes:
    body = completion(text)
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


@pytest.fixture
def scripted(servers: Servers):
    def start(answer) -> ServerThread:
        upstream = Scripted(answer)
        servers.running.append(SimpleNamespace(stop=upstream.shutdown))  # type: ignore[arg-type]
        return servers.proxy({"backends": [{"name": "odd", "url": upstream.url, "models": [MODEL]}]})
    return start


def content_of(resp: httpx.Response) -> str:
    return resp.json()["choices"][0]["message"]["content"]


def test_interim_100_never_hands_one_clients_answer_to_another(scripted) -> None:
    """Before: the 100 went to the first client, and its real answer to the second."""
    proxy = scripted(lambda n, text: [b"HTTP/1.1 100 Continue\r\n\r\n", 0.2, ok(text)] if n == 0 else [ok(text)])
    with httpx.Client(timeout=WAIT) as client:
        first = client.post(proxy.url + CHAT, json=chat("first"))
        second = client.post(proxy.url + CHAT, json=chat("second"))
    assert (first.status_code, content_of(first)) == (200, "first")
    assert (second.status_code, content_of(second)) == (200, "second")


def test_upstream_103_early_hints_are_skipped(scripted) -> None:
    proxy = scripted(lambda n, text: [b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n" + ok(text)])
    resp = httpx.post(proxy.url + CHAT, json=chat("hinted"), timeout=WAIT)
    assert (resp.status_code, content_of(resp)) == (200, "hinted")


@pytest.mark.parametrize("status", [b"999", b"600", b"101"])
def test_impossible_upstream_status_is_a_502(scripted, status: bytes) -> None:
    """Before: a 999 raised inside the response path and the client got an empty reply."""
    proxy = scripted(lambda n, text: [b"HTTP/1.1 " + status + b" Odd\r\ncontent-length: 2\r\n\r\n{}"])
    resp = httpx.post(proxy.url + CHAT, json=chat(), timeout=WAIT)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "upstream_protocol"


def test_bytes_past_content_length_are_not_appended(scripted) -> None:
    proxy = scripted(lambda n, text: [ok(text) + ok(b"someone else") if n == 0 else ok(text)])
    with httpx.Client(timeout=WAIT) as client:
        first = client.post(proxy.url + CHAT, json=chat("first"))
        second = client.post(proxy.url + CHAT, json=chat("second"))
    assert (first.status_code, content_of(first)) == (200, "first")
    assert orjson.loads(first.content)  # exactly one JSON document
    assert content_of(second) == "second"


def test_close_delimited_upstream_body_is_relayed(scripted) -> None:
    """Before: a body delimited by the connection's end was a 502, counted against the replica."""
    proxy = scripted(lambda n, text: [b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n" + completion(text), None])
    resp = httpx.post(proxy.url + CHAT, json=chat("closed"), timeout=WAIT)
    assert (resp.status_code, content_of(resp)) == (200, "closed")


def test_huge_plain_upstream_body_is_a_502(servers: Servers, scripted) -> None:
    big = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 300000000\r\n\r\n"
    upstream = Scripted(lambda n, text: [big, b"a" * 65536, 5.0, None])
    servers.running.append(SimpleNamespace(stop=upstream.shutdown))  # type: ignore[arg-type]
    proxy = servers.proxy({"backends": [{"name": "odd", "url": upstream.url, "models": [MODEL]}],
                           "server": {"max_response_bytes": 1 << 20}})
    resp = httpx.post(proxy.url + CHAT, json=chat(), timeout=WAIT)
    assert resp.status_code == 502


# -- media URLs ---------------------------------------------------------------------------------

@pytest.fixture
def trusted(servers: Servers):
    sim = servers.sim(trust_request_mm_kwargs=True)
    return servers.proxy({"backends": [{"name": "t", "url": sim.url, "trust_request_mm_kwargs": True}],
                          "multimodal": {"max_data_url_bytes": 1000}})


def mm(*parts: dict) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, *parts]}],
            "max_tokens": 2}


METADATA = "http://169.254.169.254/latest/meta-data/"


@pytest.mark.parametrize("part", [
    {"type": "input_image", "image_url": METADATA},  # the review's case: input_image reads image_url
    {"type": "input_image", "image_url": "https://169.254.169.254/x"},
    {"type": "input_image", "image_url": {"url": "https://127.0.0.1/x"}},
    {"type": "text", "text": "hi", "uuid": "u1", "image_url": "https://127.0.0.1/x"},  # uuid: vLLM reads keys
    {"type": "image_url", "uuid": "u1", "image_url": "https://10.0.0.1/x"},
    {"type": "video_url", "uuid": "u1", "video_url": "https://10.0.0.1/x"},
    {"type": "audio_url", "audio_url": "https://10.0.0.1/x.wav"},  # bare string form
    {"type": "video_url", "video_url": "https://10.0.0.1/x.mp4"},
    {"type": "image_url", "image_url": {"url": "https://example.com/ok.png"}, "video_url": "https://10.0.0.1/x"},
    {"type": "image_url", "image_url": {"url": "https://kubernetes.default.svc/api"}},
    {"type": "image_url", "image_url": {"url": "https://redis.prod.svc.cluster.local/"}},
    {"type": "image_url", "image_url": {"url": "https://metadata/computeMetadata/v1/"}},
])
def test_every_url_vllm_reads_is_guarded(trusted, part: dict) -> None:
    resp = httpx.post(trusted.url + CHAT, json=mm(part), timeout=WAIT)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "media_url_forbidden"


@pytest.mark.parametrize("part", [
    {"type": "input_file", "input_file": {"file_url": METADATA}},
    {"type": "Image_URL", "Image_URL": {"url": METADATA}},
    {"type": "image", "image": METADATA},
    {"type": "image_pil", "image_pil": METADATA},
    {"type": "text", "text": "x", "uuid": "u1"},  # vLLM finds no media key: its own error
])
def test_unknown_part_types_are_refused(trusted, part: dict) -> None:
    resp = httpx.post(trusted.url + CHAT, json=mm(part), timeout=WAIT)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "unsupported_content_part"


@pytest.mark.parametrize("scheme", ["DATA", "Data", "dAtA"])
def test_data_urls_in_any_case_are_size_limited(trusted, scheme: str) -> None:
    """Before: `DATA:` skipped the inline-media size limits."""
    url = scheme + ":image/png;base64," + "A" * 5000
    resp = httpx.post(trusted.url + CHAT, json=mm({"type": "image_url", "image_url": {"url": url}}), timeout=WAIT)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "media_too_large"


def test_legitimate_media_still_passes(trusted) -> None:
    for part in (
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "input_image", "image_url": "https://example.com/a.png"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}, "uuid": "u1"},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    ):
        resp = httpx.post(trusted.url + CHAT, json=mm(part), timeout=WAIT)
        assert resp.status_code == 200, (part, resp.text)


# -- metrics ------------------------------------------------------------------------------------

def test_metrics_do_not_name_deployments_that_keys_hide(servers: Servers, monkeypatch) -> None:
    """Before: with keys limited to some deployments, /metrics was open and its labels named all."""
    import hashlib

    sim = servers.sim()
    proxy = servers.proxy({
        "backends": [{"name": "gpu-0", "url": sim.url, "models": [MODEL]}],
        "deployments": [{"name": "public", "model": MODEL}, {"name": "secret-project", "model": MODEL}],
        "auth": {"keys": [
            {"name": "ops", "sha256": hashlib.sha256(b"ops-key").hexdigest()},
            {"name": "team", "sha256": hashlib.sha256(b"team-key").hexdigest(), "deployments": ["public"]},
        ]},
    })
    assert httpx.post(proxy.url + CHAT, json={**chat(), "model": "secret-project"},
                      headers={"authorization": "Bearer ops-key"}, timeout=WAIT).status_code == 200
    anonymous = httpx.get(proxy.url + "/metrics", timeout=WAIT)
    assert anonymous.status_code == 401 and b"secret-project" not in anonymous.content
    limited = httpx.get(proxy.url + "/metrics", headers={"authorization": "Bearer team-key"}, timeout=WAIT)
    assert limited.status_code == 403 and b"secret-project" not in limited.content
    full = httpx.get(proxy.url + "/metrics", headers={"authorization": "Bearer ops-key"}, timeout=WAIT)
    assert full.status_code == 200 and b"secret-project" in full.content


def test_serve_passes_the_configured_limits_to_the_protocol() -> None:
    import pickle

    from proxy.cli import uvicorn_options
    from proxy.config import parse_config

    config = parse_config({"backends": [{"name": "b", "url": "http://127.0.0.1:1"}],
                           "server": {"header_timeout_s": 7, "body_timeout_s": 9, "max_header_bytes": 4096, "max_headers": 20}})
    factory = pickle.loads(pickle.dumps(uvicorn_options(config)["http"]))  # workers get it pickled
    assert factory.keywords["limits"] == (7, 9, 4096, 20, 60.0)
