"""The example policies in policies/: each passes `check` and serves every deployment it declares
when run against a simulated fleet shaped like it (URLs, Redis and secrets swapped for the test's)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import yaml

from proxy.checks import cross_check
from proxy.config import load_config, parse_config
from tests.conftest import Servers

ROOT = Path(__file__).resolve().parent.parent
POLICIES = sorted((ROOT / "policies").glob("*.yaml"))
IMAGE = {"type": "image_url", "image_url": {"url": "https://images.example.com/cat.png"}}


def test_the_examples_are_there() -> None:
    names = {p.stem for p in POLICIES}
    assert {"demo", "single-model", "multi-lora", "multimodal-fleet", "multi-proxy-redis"} <= names
    for path in POLICIES:
        assert sum(line.lstrip().startswith("#") for line in path.read_text().splitlines()) >= 3, path  # commented


def _localise(data: dict, servers: Servers, tmp_path: Path, monkeypatch, redis_url: str | None) -> dict:
    """The policy with each backend replaced by a simulated replica serving what it declares."""
    base = next((d["model"] for d in data.get("deployments") or [] if not d.get("adapter")), None)
    pinned = {a for b in data["backends"] for a in b.get("adapters") or []}
    # adapters neither pinned nor loadable on demand: started on the second replica, as the demo does
    preloaded = [d["adapter"] for d in data.get("deployments") or []
                 if d.get("adapter") and not d.get("adapter_path") and d["adapter"] not in pinned]
    for i, backend in enumerate(data["backends"]):
        model = (backend.get("models") or [base])[0]
        adapters = (backend.get("adapters") or []) + (preloaded if i == 1 else [])
        sim = servers.sim(model=model, lora_modules={a: f"/adapters/{a}" for a in adapters},
                          trust_request_mm_kwargs=backend.get("trust_request_mm_kwargs", False), max_loras=4)
        backend["url"] = sim.url
    if "redis" in data:
        data["redis"]["url"] = redis_url
    for key in (data.get("auth") or {}).get("keys", []):
        if "key_env" in key:
            monkeypatch.setenv(key["key_env"], f"key-of-{key['name']}")
        if "key_file" in key:
            key["key_file"] = str(tmp_path / key["name"])
            Path(key["key_file"]).write_text(f"key-of-{key['name']}\n")
        if "sha256" in key:
            key["sha256"] = hashlib.sha256(f"key-of-{key['name']}".encode()).hexdigest()
    if (data.get("auth") or {}).get("admin_key_env"):
        monkeypatch.setenv(data["auth"]["admin_key_env"], "admin")
    return data


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.stem)
def test_example_policy_checks_and_serves(path: Path, servers: Servers, tmp_path: Path, monkeypatch,
                                          request: pytest.FixtureRequest) -> None:
    load_config(path)  # the file as shipped is valid
    data = yaml.safe_load(path.read_text())
    redis_url = request.getfixturevalue("redis_url") if "redis" in data else None
    data = _localise(data, servers, tmp_path, monkeypatch, redis_url)
    assert cross_check(parse_config(data)).errors == []
    proxy = servers.proxy(data)
    keys = {k["name"]: k for k in (data.get("auth") or {}).get("keys", [])}
    for deployment in data["deployments"]:
        name = deployment["name"]
        allowed = [k for k, spec in keys.items() if spec.get("deployments") is None or name in spec["deployments"]]
        headers = {"authorization": f"Bearer key-of-{allowed[0]}"} if keys else {}
        content = [{"type": "text", "text": "what is this?"}, IMAGE] if "vl" in name else "hello"
        resp = httpx.post(proxy.url + "/v1/chat/completions", headers=headers, timeout=30,
                          json={"model": name, "messages": [{"role": "user", "content": content}], "max_tokens": 4})
        assert resp.status_code == 200, (name, resp.text)
        assert resp.json()["model"] == name
        if "vl" in name:
            assert resp.headers["x-vllm-proxy-backend"].startswith("vision-")
    if keys:  # a key limited to some deployments does not see the others
        limited = next(k for k, spec in keys.items() if spec.get("deployments"))
        listed = httpx.get(proxy.url + "/v1/models", headers={"authorization": f"Bearer key-of-{limited}"}).json()
        assert {m["id"] for m in listed["data"]} == set(keys[limited]["deployments"])
