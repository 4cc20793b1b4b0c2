"""Every failure a client can cause is a 4xx OpenAI envelope; no 500s, no hangs (raw HTTP)."""
from __future__ import annotations

import socket

import httpx
import orjson
import pytest

from tests.conftest import MODEL, Servers, sim_of

CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def assert_envelope(resp: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    assert error["param"] == param
    return error


@pytest.fixture
def proxy(shared_fleet):
    """None of the requests of the tests using this reach a replica: one fleet for all of them."""
    return shared_fleet[0]


@pytest.mark.parametrize(
    "body, code, param",
    [
        (b"", "invalid_json", None),
        (b"{not json", "invalid_json", None),
        (b"[1, 2]", "invalid_type", None),
        (b'"a string"', "invalid_type", None),
        (b"\xff\xfe{}", "invalid_encoding", None),
        (b'{"model": "\xed\xa0\x80"}', "invalid_encoding", None),
        (b'{"messages": []}', "missing_required_parameter", "model"),
        (b'{"model": 7, "messages": []}', "invalid_type", "model"),
        (b'{"model": "", "messages": []}', "invalid_type", "model"),
        (b'{"model": ["a"], "messages": []}', "invalid_type", "model"),
        (orjson.dumps({**GOOD, "stream": "yes"}), "invalid_type", "stream"),
        (orjson.dumps({**GOOD, "stream_options": 3}), "invalid_type", "stream_options"),
        (orjson.dumps({"model": MODEL}), "missing_required_parameter", "messages"),
        (orjson.dumps({"model": MODEL, "messages": "hi"}), "invalid_type", "messages"),
        (orjson.dumps({"model": MODEL, "messages": ["hi"]}), "invalid_type", "messages[0]"),
        (orjson.dumps({"model": MODEL, "messages": [{"content": "x"}]}), "invalid_type", "messages[0].role"),
        (orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}), "invalid_type", "messages[0].content"),
        (b"[" * 200_000, "json_too_deep", None),
        (b'{"a":' * 5000, "json_too_deep", None),
    ],
)
def test_bad_chat_bodies_are_400(proxy, body: bytes, code: str, param: str | None) -> None:
    resp = httpx.post(proxy.url + CHAT, content=body, headers={"content-type": "application/json"})
    error = assert_envelope(resp, 400, code, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": {"x": 1}}, "prompt"),
        ("/v1/embeddings", {"model": MODEL}, "input"),
        ("/v1/embeddings", {"model": MODEL, "input": 3}, "input"),
    ],
)
def test_bad_completion_and_embedding_bodies(proxy, path: str, body: dict, param: str) -> None:
    assert_envelope(httpx.post(proxy.url + path, json=body), 400, param=param)


def test_unknown_model_is_404_model_not_found(proxy) -> None:
    resp = httpx.post(proxy.url + CHAT, json={**GOOD, "model": "gpt-17"})
    error = assert_envelope(resp, 404, "model_not_found", "model")
    assert "gpt-17" in error["message"]


def test_unknown_path_and_wrong_method(proxy) -> None:
    assert_envelope(httpx.post(proxy.url + "/v1/nothing", json=GOOD), 404, "unknown_url")
    resp = httpx.get(proxy.url + CHAT)
    assert_envelope(resp, 405, "method_not_allowed")
    assert resp.headers["allow"] == "POST"


def test_body_over_limit_is_413_before_reading_it(servers: Servers) -> None:
    """A huge Content-Length is refused at once: the client never has to send the body."""
    proxy = servers.proxy_for(servers.sim(), server={"max_body_bytes": 1024})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 67108864\r\n\r\n{\"model\":"
        )
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413")
    assert b'"code":"request_too_large"' in answer


def test_chunked_body_over_limit_is_413(servers: Servers) -> None:
    proxy = servers.proxy_for(servers.sim(), server={"max_body_bytes": 1024})

    def chunks():
        for _ in range(100):
            yield b" " * 512

    resp = httpx.post(proxy.url + CHAT, content=chunks())
    assert_envelope(resp, 413, "request_too_large")
    ok = httpx.post(proxy.url + CHAT, json=GOOD)
    assert ok.status_code == 200


def test_no_healthy_backend_is_503_with_retry_after(servers: Servers) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    proxy = servers.proxy({"backends": [{"name": "gone", "url": f"http://127.0.0.1:{port}", "models": [MODEL]}]})
    resp = httpx.post(proxy.url + CHAT, json=GOOD)
    assert_envelope(resp, 503, "no_healthy_backend")
    assert resp.headers["retry-after"] == "1"
    assert resp.headers["retry-after-ms"] == "1000"
    assert httpx.get(proxy.url + "/ready").status_code == 503
    assert httpx.get(proxy.url + "/health").status_code == 200


def test_upstream_vllm_errors_are_normalised(servers: Servers) -> None:
    """A replica that lost an adapter answers vLLM's 404 (integer code, NotFoundError); clients
    get OpenAI's envelope with string type and code."""
    sim = servers.sim()
    proxy = servers.proxy({
        "backends": [{"name": "gpu-0", "url": sim.url, "models": [MODEL], "adapters": ["ghost"]}],
        "deployments": [{"name": "ghost", "model": MODEL, "adapter": "ghost"}],
    })
    resp = httpx.post(proxy.url + CHAT, json={**GOOD, "model": "ghost"})
    error = assert_envelope(resp, 404, "model_not_found", "model")
    assert error["type"] == "invalid_request_error"
    assert "ghost" in error["message"]


def test_client_errors_never_reach_a_replica(fleet) -> None:
    proxy, sims = fleet
    for body in (b"[]", b"{}", b'{"model": 1}'):
        httpx.post(proxy.url + CHAT, content=body)
    assert all(sum(sim_of(s).stats()["requests"].values()) == 0 for s in sims)
