"""What an operator sees: refused requests (401, 429) in the metrics and the access log with the
key's name, per-key counters, logs of `serve --workers 2` (every request once with its worker,
INFO lines once and timestamped), and reload reports (restart-required keys, a deleted file, the
last-reload gauges)."""
from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from tests.conftest import MODEL, Servers, eventually, sim_of
from tests.test_metrics import access_lines, families, value  # noqa: F401 - access_lines is a fixture
from tests.test_operations import ProxyProcess, free_port, write

CHAT = "/v1/chat/completions"
BODY = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                         r"\[(main|supervisor|worker-\d+)\] [\w.]+: ")


def _keyed_proxy(servers: Servers, **server: object):
    sim = servers.sim(time_scale=1.0, itl_ms=50.0, prefill_ms_per_token=0.0)
    proxy = servers.proxy({
        "backends": [{"name": "gpu-0", "url": sim.url, "models": [MODEL], "max_in_flight": 1}],
        "deployments": [{"name": "llama", "model": MODEL}],
        "server": {"max_queue": 0, **server},
        "auth": {"keys": [{"name": "team-a", "sha256": hashlib.sha256(b"key-a").hexdigest()},
                          {"name": "team-b", "sha256": hashlib.sha256(b"key-b").hexdigest()}]},
    })
    return sim, proxy


def test_401_and_429_are_counted_and_logged_with_the_key_name(servers: Servers, access_lines: list[str]) -> None:
    sim, proxy = _keyed_proxy(servers)
    a = {"authorization": "Bearer key-a"}
    assert httpx.post(proxy.url + CHAT, json=BODY, headers={"authorization": "Bearer wrong",
                                                            "x-request-id": "r-401"}).status_code == 401
    assert httpx.get(proxy.url + "/v1/models/x", headers={"x-request-id": "r-401b"}).status_code == 401
    # team-b holds the only slot; team-a's request finds no slot and no queue: 429
    holder = threading.Thread(target=lambda: httpx.post(proxy.url + CHAT, json={**BODY, "max_tokens": 40},
                                                        headers={"authorization": "Bearer key-b"}, timeout=30))
    holder.start()
    assert eventually(lambda: sim_of(sim).stats()["running"] == 1, timeout=10)
    busy = httpx.post(proxy.url + CHAT, json=BODY, headers={**a, "x-request-id": "r-429"})
    holder.join()
    assert busy.status_code == 429
    assert httpx.post(proxy.url + CHAT, json=BODY, headers={**a, "x-request-id": "r-200"}).status_code == 200

    assert eventually(lambda: len(access_lines) == 5)
    lines = {r["request_id"]: r for r in map(orjson.loads, access_lines)}
    assert lines["r-401"]["status"] == 401 and lines["r-401"]["key"] is None
    assert lines["r-401"]["endpoint"] == CHAT and lines["r-401"]["deployment"] == "unknown"
    assert lines["r-401b"]["status"] == 401 and lines["r-401b"]["endpoint"] == "other"  # no label per path
    assert lines["r-429"]["status"] == 429 and lines["r-429"]["key"] == "team-a"
    assert lines["r-200"]["key"] == "team-a" and lines["r-200"]["worker"] == 0
    assert all("key-a" not in line and "wrong" not in line for line in access_lines)

    fams = families(proxy)
    assert value(fams, "vllm_proxy_requests", "vllm_proxy_requests_total", status_code="401", endpoint=CHAT) == 1
    assert value(fams, "vllm_proxy_requests", "vllm_proxy_requests_total", status_code="429", deployment="llama") == 1
    assert value(fams, "vllm_proxy_key_requests", "vllm_proxy_key_requests_total", key="none", status_code="401") == 2
    assert value(fams, "vllm_proxy_key_requests", "vllm_proxy_key_requests_total", key="team-a", status_code="429") == 1
    assert value(fams, "vllm_proxy_key_requests", "vllm_proxy_key_requests_total", key="team-a", status_code="200") == 1
    assert value(fams, "vllm_proxy_key_requests", "vllm_proxy_key_requests_total", key="team-b", status_code="200") == 1


def test_token_counters_per_deployment_and_key(servers: Servers) -> None:
    sim, proxy = _keyed_proxy(servers)
    usage = httpx.post(proxy.url + CHAT, json=BODY, headers={"authorization": "Bearer key-a"}).json()["usage"]
    with httpx.stream("POST", proxy.url + CHAT, headers={"authorization": "Bearer key-b"},
                      json={**BODY, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200 and "data: [DONE]" in list(resp.iter_lines())
    fams = families(proxy)
    tokens = "vllm_proxy_tokens_total"
    assert value(fams, "vllm_proxy_tokens", tokens, deployment="llama", key="team-a", kind="prompt") == usage["prompt_tokens"]
    assert value(fams, "vllm_proxy_tokens", tokens, key="team-a", kind="completion") == usage["completion_tokens"] == 4
    assert value(fams, "vllm_proxy_tokens", tokens, key="team-b", kind="completion") == 4
    assert value(fams, "vllm_proxy_build_info") == 1


def _config(sim_url: str, port: int, **extra: object) -> dict:
    return {"server": {"port": port}, "backends": [{"name": "gpu-0", "url": sim_url}],
            "discovery": {"interval_s": 0.2, "timeout_s": 1.0}, **extra}


def _log_lines(proxy: ProxyProcess) -> list[str]:
    return proxy.log.read_text(errors="replace").splitlines()


def _access(proxy: ProxyProcess) -> list[dict]:
    return [orjson.loads(line) for line in _log_lines(proxy) if line.startswith("{")]


def test_workers_log_every_request_once_with_its_worker(servers: Servers, tmp_path: Path) -> None:
    sim = servers.sim()
    path = tmp_path / "policy.yaml"
    config = _config(sim.url, free_port(), deployments=[{"name": "llama", "model": MODEL}])
    write(path, config)
    proxy = ProxyProcess(path, args=("--workers", "2"))
    try:
        ids = [f"req-{i}" for i in range(40)]
        for rid in ids:  # a new connection each: the kernel spreads them over both workers
            assert httpx.post(proxy.url + CHAT, json=BODY, headers={"x-request-id": rid}).status_code == 200
        assert eventually(lambda: {r["request_id"] for r in _access(proxy)} >= set(ids), timeout=10)
        records = [r for r in _access(proxy) if r["request_id"].startswith("req-")]
        assert sorted(r["request_id"] for r in records) == sorted(ids)  # each exactly once
        assert {r["worker"] for r in records} == {0, 1}

        # a reload: every worker applies it (each serves the new name), the log says so once
        write(path, {**config, "deployments": [{"name": "llama", "model": MODEL}, {"name": "llama-2", "model": MODEL}]})

        def both_reloaded() -> bool:
            httpx.post(proxy.url + CHAT, json={**BODY, "model": "llama-2"}, headers={"x-request-id": "after"})
            return {r["worker"] for r in _access(proxy) if r["request_id"] == "after" and r["status"] == 200} == {0, 1}

        assert eventually(both_reloaded, timeout=20, interval=0.05)
        lines = _log_lines(proxy)
        operator = [line for line in lines if not line.startswith("{") and not line.startswith("vllm-proxy serving")]
        assert operator and all(TIMESTAMPED.match(line) for line in operator), operator
        assert sum("config reloaded" in line for line in lines) == 1, operator
        assert sum("serving 1 deployments" in line for line in lines) == 1, operator  # at startup, by worker-0
        assert sum("serving 2 deployments" in line for line in lines) == 1, operator  # after the reload
        assert proxy.metric('vllm_proxy_config_reloads_total{result="success"}') == 1
    finally:
        proxy.stop()


def test_reload_reports_restart_keys_missing_file_and_gauges(servers: Servers, tmp_path: Path) -> None:
    sim = servers.sim()
    path = tmp_path / "policy.yaml"
    port = free_port()
    config = _config(sim.url, port)
    write(path, config)
    proxy = ProxyProcess(path)
    try:
        write(path, {**config, "server": {"port": free_port(), "keep_alive_s": 30}})
        assert eventually(lambda: "take effect only after a restart" in proxy.log.read_text(), timeout=10)
        text = proxy.log.read_text()
        assert f"server.port: {port} -> " in text and "server.keep_alive_s: 75.0 -> 30" in text
        assert proxy.metric("vllm_proxy_config_last_reload_success") == 1
        stamp = proxy.metric("vllm_proxy_config_last_reload_timestamp_seconds")
        assert stamp > 1.7e9
        assert httpx.get(proxy.url + "/ready").status_code == 200  # still on the old port

        path.write_text("backends: [")  # a bad edit
        assert eventually(lambda: proxy.metric("vllm_proxy_config_last_reload_success") == 0 and
                          proxy.metric("vllm_proxy_config_last_reload_timestamp_seconds") > stamp, timeout=10)
        assert proxy.metric('vllm_proxy_config_reloads_total{result="error"}') == 1

        path.unlink()
        assert eventually(lambda: "is missing or unreadable" in proxy.log.read_text(), timeout=10)
        assert httpx.get(proxy.url + "/ready").status_code == 200
        assert "Traceback" not in proxy.log.read_text()
    finally:
        proxy.stop()


def test_reload_with_a_missing_key_file_names_the_key_path(servers: Servers, tmp_path: Path) -> None:
    sim = servers.sim()
    path = tmp_path / "policy.yaml"
    config = _config(sim.url, free_port())
    write(path, config)
    proxy = ProxyProcess(path)
    try:
        write(path, {**config, "auth": {"keys": [{"name": "k", "key_file": str(tmp_path / "absent")}]}})
        assert eventually(lambda: proxy.metric('vllm_proxy_config_reloads_total{result="error"}') == 1, timeout=10)
        text = proxy.log.read_text()
        assert "auth.keys[0].key_file: cannot read" in text and "Traceback" not in text
        assert httpx.post(proxy.url + CHAT, json={**BODY, "model": MODEL}).status_code == 200  # old config, no auth
    finally:
        proxy.stop()


@pytest.mark.parametrize("fmt", ["json"])
def test_json_log_format(servers: Servers, tmp_path: Path, fmt: str) -> None:
    sim = servers.sim()
    path = tmp_path / "policy.yaml"
    write(path, _config(sim.url, free_port()))
    import subprocess
    import sys

    out = tmp_path / "out.log"
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "--log-format", fmt, "serve", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=open(out, "wb"))
    try:
        assert eventually(lambda: "serving 1 deployments" in out.read_text(), timeout=15)
        record = next(orjson.loads(line) for line in out.read_text().splitlines() if "serving 1" in line)
        assert record["level"] == "INFO" and record["worker"] == "main" and record["logger"] == "vllm_proxy.runtime"
        # the discovery poll behind "serving" is not logged at info (httpx logs each request there)
        assert not [line for line in out.read_text().splitlines() if orjson.loads(line)["logger"].startswith("httpx")]
        assert yaml.safe_load(path.read_text())  # the policy is untouched
    finally:
        proc.kill()
        proc.wait()


def test_adapter_parent_is_the_marked_base_else_the_first_alias(servers: Servers) -> None:
    sim = servers.sim(lora_modules={"sql-lora": "/adapters/sql"})
    deployments = [{"name": "llama-a", "model": MODEL}, {"name": "llama-b", "model": MODEL},
                   {"name": "sql", "model": MODEL, "adapter": "sql-lora"},
                   {"name": "sql-b", "model": MODEL, "adapter": "sql-lora", "parent": "llama-b"},
                   {"name": "orphan", "model": "other/model", "adapter": "x-lora"}]
    for order in (deployments, [deployments[1], deployments[0], *deployments[2:]]):
        proxy = servers.proxy({"backends": [{"name": "gpu-0", "url": sim.url}], "deployments": order})
        parents = {m["id"]: m["parent"] for m in httpx.get(proxy.url + "/v1/models").json()["data"]}
        assert parents["sql"] == order[0]["name"]  # no mark: the first alias in the file, every time
        assert parents["sql-b"] == "llama-b"  # marked
        assert parents["orphan"] == "other/model"  # no base deployment: the upstream id
        assert parents["llama-a"] is None


def test_dashboard_covers_the_operator_families() -> None:
    from proxy.metrics import Metrics

    dashboard = orjson.loads((Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "components" / "monitoring" / "vllm-proxy.json").read_bytes())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    names = {m for e in exprs for m in re.findall(r"vllm_proxy_[a-z_]+", e)}
    families = list(Metrics().registry.collect())
    exposed = {f.name + suffix for f in families for suffix in ("", "_total", "_bucket", "_sum", "_count")}
    assert names <= exposed, names - exposed
    for family in ("redis_up", "retries_total", "lora_operations_total", "multimodal_requests_total",
                   "key_requests_total", "tokens_total", "config_last_reload_success", "build_info"):
        assert any(f"vllm_proxy_{family}" in e for e in exprs), family
    assert any('status_code="429"' in e for e in exprs) and any("401|403" in e for e in exprs)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
