"""vLLM's tokenizer and pooling endpoints through the proxy: routed by `model`, relayed, with the
proxy's error envelopes, limits and metrics."""
from __future__ import annotations

import httpx
import pytest

from proxy.passthrough import REQUIRED
from tests.conftest import MODEL, Servers, sim_of

GOOD = {
    "/tokenize": {"prompt": "Hello there, world"},
    "/detokenize": {"tokens": []},
    "/v1/rerank": {"query": "cats", "documents": ["dogs", "cats are nice"]},
    "/rerank": {"query": "cats", "documents": ["dogs", "cats are nice"]},
    "/v2/rerank": {"query": "cats", "documents": ["dogs", "cats are nice"]},
    "/v1/score": {"text_1": "cats", "text_2": ["cats are nice", "dogs"]},
    "/score": {"queries": "cats", "documents": ["cats", "dogs"]},
    "/classify": {"input": ["good", "bad"]},
    "/pooling": {"input": "pool me"},
}


def test_tokenize_detokenize_round_trip(fleet) -> None:
    proxy, _ = fleet
    text = "The proxy relays tokens, 42 of them!"
    tokens = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    back = httpx.post(proxy.url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == text
    chat = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 1


def test_rerank_on_every_path(fleet) -> None:
    proxy, sims = fleet
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(proxy.url + path, json={"model": MODEL, "query": "red fox", "top_n": 2,
                                               "documents": ["a blue whale", "the red fox jumps", "red wine"]})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 2 and results[0]["document"]["text"] == "the red fox jumps"
        assert results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert r.headers["x-vllm-proxy-backend"] in ("gpu-0", "gpu-1")


@pytest.mark.parametrize("path", sorted(GOOD))
def test_every_endpoint_answers_and_is_counted(fleet, path: str) -> None:
    proxy, _ = fleet
    r = httpx.post(proxy.url + path, json={"model": MODEL, **GOOD[path]})
    assert r.status_code == 200, r.text
    metrics = httpx.get(proxy.url + "/metrics").text
    assert f'endpoint="{path}",status_code="200"' in metrics


def test_deployment_names_are_rewritten_both_ways(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, deployments=[{"name": "llama", "model": MODEL}])
    r = httpx.post(proxy.url + "/v1/score", json={"model": "llama", "text_1": "a", "text_2": "a b"})
    assert r.status_code == 200 and r.json()["model"] == "llama"
    assert sim_of(sim).engine.stats.not_found == {}


def test_body_limit_applies(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, server={"max_body_bytes": 1024})
    r = httpx.post(proxy.url + "/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["x" * 2000]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_replica_errors_are_normalised(fleet) -> None:
    proxy, _ = fleet
    r = httpx.post(proxy.url + "/detokenize", json={"model": MODEL, "tokens": [999_999_999]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "vocabulary" in error["message"]


@pytest.mark.parametrize("path", sorted(REQUIRED))
def test_bad_inputs_are_4xx_envelopes(fleet, path: str) -> None:
    proxy, sims = fleet
    cases = [
        (b"{oops", 400, "invalid_json", None),
        (b'"a string"', 400, "invalid_type", None),
        (b'{"prompt": "x"}', 400, "missing_required_parameter", "model"),
        (b'{"model": 7}', 400, "invalid_type", "model"),
        (b'{"model": "%s"}' % MODEL.encode(), 400, "missing_required_parameter", REQUIRED[path][0][0]),
    ]
    for body, status, code, param in cases:
        r = httpx.post(proxy.url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(proxy.url + path, json={"model": "nope", **GOOD[path]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(proxy.url + path)
    assert r.status_code == 405
    assert sum(sim_of(s).engine.stats.not_found.total() for s in sims) == 0


def test_wrong_types(fleet) -> None:
    proxy, _ = fleet
    r = httpx.post(proxy.url + "/detokenize", json={"model": MODEL, "tokens": "1 2 3"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(proxy.url + "/v1/rerank", json={"model": MODEL, "query": "q", "documents": "one"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_media_in_rerank_and_score_inputs_pass_the_url_guard(fleet) -> None:
    proxy, sims = fleet
    bad = {"content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}]}
    for path, body in (("/v1/rerank", {"query": "q", "documents": ["fine", bad]}),
                       ("/score", {"text_1": bad, "text_2": "x"})):
        r = httpx.post(proxy.url + path, json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "media_url_forbidden"
    assert sum(sim_of(s).engine.stats.requests.total() for s in sims) == 0
