"""The non-inference endpoints under Starlette's routing (proxy/app.py, proxy/endpoints.py): the
exact bytes of /v1/models (the Tokios connector probes it), HEAD, 404 and 405 with `Allow` as
OpenAI envelopes, and the lean dispatch still serving the inference POSTs."""
from __future__ import annotations

import re
import socket

import httpx
import orjson

from proxy.endpoints import _CREATED
from tests.conftest import MODEL


def raw(url_port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", url_port), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head).group(1))
        while len(body) < length:
            body += sock.recv(65536)
        return head + b"\r\n\r\n" + body


def test_models_listing_bytes_are_pinned(servers) -> None:
    proxy = servers.proxy_for(servers.sim())
    card = {"id": MODEL, "object": "model", "created": _CREATED, "owned_by": "vllm-proxy", "root": MODEL, "parent": None}
    body = orjson.dumps({"object": "list", "data": [card]})
    for path in (b"/v1/models", b"/models"):
        answer = raw(proxy.port, b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path)
        answer = re.sub(rb"date: [^\r]+\r\n", b"date: *\r\n", answer)
        assert answer == (b"HTTP/1.1 200 OK\r\ndate: *\r\nserver: uvicorn\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                          % (len(body), body))


def test_routing_errors_are_envelopes_with_allow(servers) -> None:
    proxy = servers.proxy_for(servers.sim())
    url = proxy.url
    head = httpx.head(url + "/health")
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == "15"
    for method, path, allow in [("POST", "/health", "GET, HEAD"), ("DELETE", "/v1/models", "GET, HEAD"),
                                ("PUT", f"/v1/models/{MODEL}", "GET, HEAD"), ("GET", "/v1/embeddings", "POST"),
                                ("GET", "/admin/reload", "POST"), ("GET", "/v1/rerank", "POST")]:
        r = httpx.request(method, url + path)
        assert r.status_code == 405 and r.headers["allow"] == allow, (method, path)
        assert r.json()["error"] == {"message": f"Method {method} is not allowed for {path}.",
                                     "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}
    for path in ("/health/", "/v1/models/", "/nothing", "/v1"):
        r = httpx.get(url + path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url", path
    r = httpx.get(url + "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert httpx.post(url + "/admin/reload").json()["error"]["code"] == "unknown_url"  # reload not enabled
    chat = httpx.post(url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
