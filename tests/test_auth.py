"""Client API keys (hashed, env, file; per-key deployments) and upstream keys (vLLM --api-key)."""
from __future__ import annotations

import hashlib

import httpx
import openai
import pytest

from tests.conftest import MODEL, Servers

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def secured(servers: Servers, tmp_path, monkeypatch):
    monkeypatch.setenv("TEAM_B_KEY", "key-b")
    (tmp_path / "key-c").write_text("key-c\n")
    sim = servers.sim(api_key="upstream-secret")
    proxy = servers.proxy({
        "backends": [{"name": "gpu-0", "url": sim.url, "api_key": "upstream-secret", "models": [MODEL]}],
        "deployments": [{"name": "llama", "model": MODEL}, {"name": "llama-2", "model": MODEL}],
        "auth": {
            "keys": [
                {"name": "team-a", "sha256": hashlib.sha256(b"key-a").hexdigest()},
                {"name": "team-b", "key_env": "TEAM_B_KEY", "deployments": ["llama-2"]},
                {"name": "team-c", "key_file": str(tmp_path / "key-c")},
            ],
            "protect_metrics": True,
        },
    })
    return proxy


def client(proxy, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)


def test_keys_from_digest_env_and_file(secured) -> None:
    for key in ("key-a", "key-c"):
        assert client(secured, key).chat.completions.create(model="llama", messages=MESSAGES, max_tokens=1).choices
    assert client(secured, "key-b").chat.completions.create(model="llama-2", messages=MESSAGES, max_tokens=1).choices


def test_missing_or_wrong_key_is_401(secured) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(secured, "nope").chat.completions.create(model="llama", messages=MESSAGES)
    assert info.value.code == "invalid_api_key"
    resp = httpx.post(secured.url + "/v1/chat/completions", json={"model": "llama", "messages": MESSAGES})
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "invalid_request_error"
    assert resp.headers["x-should-retry"] == "false"
    assert httpx.get(secured.url + "/v1/models").status_code == 401


def test_per_key_deployments(secured) -> None:
    b = client(secured, "key-b")
    assert [m.id for m in b.models.list()] == ["llama-2"]
    with pytest.raises(openai.NotFoundError):
        b.chat.completions.create(model="llama", messages=MESSAGES)
    assert {m.id for m in client(secured, "key-a").models.list()} == {"llama", "llama-2"}


def test_open_and_protected_operational_endpoints(secured) -> None:
    assert httpx.get(secured.url + "/health").status_code == 200
    assert httpx.get(secured.url + "/ready").status_code == 200
    assert httpx.get(secured.url + "/metrics").status_code == 401
    ok = httpx.get(secured.url + "/metrics", headers={"authorization": "Bearer key-a"})
    assert ok.status_code == 200 and "key-a" not in ok.text


def test_bad_key_config_names_the_key_path(tmp_path) -> None:
    from proxy.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as info:
        parse_config({"backends": [{"name": "a", "url": "http://x:1"}],
                      "auth": {"keys": [{"name": "k", "sha256": "abc"}, {"name": "j"}]}})
    text = "\n".join(info.value.problems)
    assert "auth.keys[0].sha256:" in text and "auth.keys[1]: give exactly one of" in text
