"""LoRA-aware routing (proxy/lora.py) against simulated replicas: static, discovered and on-demand
adapters; single-flight loads; LRU eviction that spares busy adapters; backoff; healing; replication.

Every test ends by checking the replicas' own counters: no request for an adapter ever reached a
replica that did not hold it (a simulated replica counts those 404s in /sim/stats `not_found`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time

import httpx
import pytest
from openai import OpenAI

from proxy.config import ConfigError, parse_config
from proxy.sim.app import create_app
from proxy.sim.config import SimConfig
from tests.conftest import MODEL, Servers, eventually, sim_of
from tests.support import ServerThread, held, sim_faults

INTERVAL = 0.2  # the test proxies' discovery interval (conftest)


def chat(proxy: ServerThread, model: str, content: str = "hi", **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)


async def chat_many(proxy: ServerThread, model: str, n: int, **extra) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=n)) as client:
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}
        return list(await asyncio.gather(*(
            client.post(proxy.url + "/v1/chat/completions", json={"model": model, **body,
                        "messages": [{"role": "user", "content": f"hello {i}"}]})
            for i in range(n)
        )))


def adapter_requests(sim: ServerThread, adapter: str) -> int:
    return sim_of(sim).stats()["requests"].get(adapter, 0)


def assert_no_misroute(*sims: ServerThread) -> None:
    for sim in sims:
        assert sim_of(sim).stats()["not_found"] == {}, sim.url


def loads(*sims: ServerThread) -> int:
    return sum(sim_of(s).stats()["lora_loads"] for s in sims)


def holds(sim: ServerThread, adapter: str) -> bool:
    return adapter in sim_of(sim).models.adapters


def proxy_sees(proxy: ServerThread, backend: str, adapter: str) -> bool:
    """Whether the proxy's current view has `adapter` on replica `backend` (a healthy one)."""
    return any(b.name == backend and b.healthy and adapter in b.adapters for b in proxy.server.config.app.runtime.backends)


def on_demand(*adapters: str, **extra) -> list[dict]:
    return [{"name": "llama", "model": MODEL}] + [
        {"name": a, "model": MODEL, "adapter": f"{a}-lora", "adapter_path": f"/adapters/{a}", **extra} for a in adapters
    ]


def restart(servers: Servers, old: ServerThread, **options) -> ServerThread:
    """Stop a simulated replica and start a fresh one (no runtime-loaded adapters) on the same port."""
    old.stop()
    options.setdefault("model", MODEL)
    options.setdefault("time_scale", 0.0)
    new = ServerThread(create_app(SimConfig(**options)))
    new.sock.close()
    new.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    new.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    new.sock.bind(("127.0.0.1", old.port))
    new.port, new.url = old.port, old.url
    new.thread = threading.Thread(target=new.server.run, kwargs={"sockets": [new.sock]}, daemon=True)
    servers.running.append(new.start())
    return new


# --- config ------------------------------------------------------------------------------------


def test_lora_config_keys_are_checked() -> None:
    base = {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    cfg = parse_config({**base, "lora": {"max_adapters_per_replica": 2, "backoff_s": 1},
                        "deployments": on_demand("sql", min_replicas=1, max_replicas=2)})
    assert cfg.lora.max_adapters_per_replica == 2 and cfg.deployments[1].adapter_path == "/adapters/sql"
    with pytest.raises(ConfigError) as err:
        parse_config({**base, "deployments": [{"name": "x", "model": MODEL, "adapter_path": "/p"}]})
    assert "deployments[0]: adapter_path, min_replicas and max_replicas need `adapter`" in err.value.problems
    with pytest.raises(ConfigError) as err:
        parse_config({**base, "deployments": on_demand("sql", min_replicas=3, max_replicas=2)})
    assert any(p.startswith("deployments[1]") and "min_replicas" in p for p in err.value.problems)
    with pytest.raises(ConfigError) as err:
        parse_config({**base, "lora": {"max_adapters_per_replica": 0, "bogus": 1}})
    assert {"lora.max_adapters_per_replica: Input should be greater than or equal to 1", "lora.bogus: unknown key"} \
        <= set(err.value.problems)


# --- routing of static and discovered adapters -------------------------------------------------


def test_static_adapter_goes_only_to_replicas_that_hold_it(servers: Servers) -> None:
    plain = servers.sim()
    lora = [servers.sim(lora_modules={"sql-lora": "/adapters/sql"}) for _ in range(2)]
    proxy = servers.proxy_for(plain, *lora, routing={"policy": "round_robin"}, deployments=[
        {"name": "llama", "model": MODEL}, {"name": "sql", "model": MODEL, "adapter": "sql-lora"},
    ])
    for i in range(20):
        r = chat(proxy, "sql", f"question {i}")
        assert r.status_code == 200 and r.json()["model"] == "sql"
        assert r.headers["x-vllm-proxy-backend"] in ("gpu-1", "gpu-2")
    assert adapter_requests(plain, "sql-lora") == 0
    assert adapter_requests(lora[0], "sql-lora") > 0 and adapter_requests(lora[1], "sql-lora") > 0
    assert_no_misroute(plain, *lora)


def test_discovered_adapter_follows_the_replicas_within_one_interval(servers: Servers) -> None:
    a, b = servers.sim(), servers.sim()
    proxy = servers.proxy_for(a, b)  # no deployments: every discovered model and adapter, by its id
    assert chat(proxy, "fr").status_code == 404
    httpx.post(b.url + "/v1/load_lora_adapter", json={"lora_name": "fr", "lora_path": "/adapters/fr"})
    assert eventually(lambda: chat(proxy, "fr").status_code == 200, timeout=10)
    models = {m["id"]: m for m in httpx.get(proxy.url + "/v1/models").json()["data"]}
    assert models["fr"]["parent"] == MODEL
    for _ in range(6):
        assert chat(proxy, "fr").headers["x-vllm-proxy-backend"] == "gpu-1"
    # moved behind the proxy's back: off b, onto a
    httpx.post(b.url + "/v1/unload_lora_adapter", json={"lora_name": "fr"})
    httpx.post(a.url + "/v1/load_lora_adapter", json={"lora_name": "fr", "lora_path": "/adapters/fr"})
    # within a discovery interval or so (generous: a busy machine polls late)
    assert eventually(lambda: proxy_sees(proxy, "gpu-0", "fr") and not proxy_sees(proxy, "gpu-1", "fr"), timeout=10)
    for _ in range(6):
        r = chat(proxy, "fr")
        assert r.status_code == 200 and r.headers["x-vllm-proxy-backend"] == "gpu-0"
    assert adapter_requests(a, "fr") == 6 and adapter_requests(b, "fr") == 7
    assert_no_misroute(a, b)


def test_declared_adapter_without_path_is_503_when_no_replica_holds_it(servers: Servers) -> None:
    sim = servers.sim(lora_modules={"sql-lora": "/adapters/sql"})
    proxy = servers.proxy_for(sim, deployments=[{"name": "sql", "model": MODEL, "adapter": "sql-lora"}])
    assert chat(proxy, "sql").status_code == 200
    httpx.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "sql-lora"})
    assert eventually(lambda: not proxy_sees(proxy, "gpu-0", "sql-lora"), timeout=10)  # the next poll shows it
    r = chat(proxy, "sql")
    assert r.status_code == 503 and "sql-lora" in r.json()["error"]["message"]
    assert_no_misroute(sim)


# --- on-demand loading ---------------------------------------------------------------------------


def test_on_demand_load_from_a_cold_fleet_through_the_openai_sdk(servers: Servers) -> None:
    sims = [servers.sim(), servers.sim()]
    proxy = servers.proxy_for(*sims, deployments=on_demand("sql"))
    client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    listed = {m.id: m for m in client.models.list().data}
    assert listed["sql"].parent == "llama" and listed["sql"].root == "sql-lora"  # listed before any load
    assert loads(*sims) == 0
    answer = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "SELECT?"}])
    assert answer.model == "sql" and answer.choices[0].message.content
    assert loads(*sims) == 1
    for _ in range(5):
        client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "again"}])
    holder = next(s for s in sims if holds(s, "sql-lora"))
    assert adapter_requests(holder, "sql-lora") == 6 and loads(*sims) == 1
    assert_no_misroute(*sims)


def test_concurrent_first_requests_cause_exactly_one_load(servers: Servers) -> None:
    sims = [servers.sim(time_scale=1.0, lora_load_ms=300, itl_ms=1) for _ in range(3)]
    proxy = servers.proxy_for(*sims, deployments=on_demand("sql"))
    started = time.monotonic()
    answers = asyncio.run(chat_many(proxy, "sql", 40))
    assert [r.status_code for r in answers] == [200] * 40
    assert time.monotonic() - started >= 0.3  # they all waited for the one load
    assert loads(*sims) == 1
    assert sum(adapter_requests(s, "sql-lora") for s in sims) == 40
    assert_no_misroute(*sims)


def test_load_goes_to_the_replica_with_fewest_adapters(servers: Servers) -> None:
    busy = servers.sim(lora_modules={"x": "/x", "y": "/y"})
    idle = servers.sim()
    proxy = servers.proxy_for(busy, idle, deployments=on_demand("sql"))
    assert chat(proxy, "sql").headers["x-vllm-proxy-backend"] == "gpu-1"
    assert holds(idle, "sql-lora") and not holds(busy, "sql-lora")


def test_load_failure_is_503_naming_adapter_and_cause_then_backoff(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, deployments=on_demand("sql"), lora={"backoff_s": 1.5})
    httpx.post(sim.url + "/sim/faults", json={"fail_lora_loads": True})
    r = chat(proxy, "sql")
    error = r.json()["error"]
    assert r.status_code == 503 and error["code"] == "adapter_load_failed" and "retry-after" in r.headers
    assert "`sql-lora`" in error["message"] and "gpu-0" in error["message"] and "simulated fault" in error["message"]
    httpx.post(sim.url + "/sim/faults", json={"fail_lora_loads": False})
    again = chat(proxy, "sql")  # inside the backoff: the replica is not tried
    assert again.status_code == 503 and "backoff" in again.json()["error"]["message"]
    assert "simulated fault" in again.json()["error"]["message"] and loads(sim) == 0
    time.sleep(int(again.headers["retry-after-ms"]) / 1000)  # as long as the proxy says the backoff lasts
    assert chat(proxy, "sql").status_code == 200 and loads(sim) == 1
    assert_no_misroute(sim)


def test_bad_adapter_path_is_reported(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, deployments=[
        {"name": "bad", "model": MODEL, "adapter": "bad-lora", "adapter_path": "/adapters/invalid"}])
    r = chat(proxy, "bad")
    assert r.status_code == 503 and "No adapter found for /adapters/invalid" in r.json()["error"]["message"]


# --- eviction ------------------------------------------------------------------------------------


def _stream_open(proxy: ServerThread, model: str) -> tuple[httpx.Client, httpx.Response]:
    """A streaming request kept in flight (the caller reads or closes it)."""
    client = httpx.Client(timeout=30)
    body = {"model": model, "messages": [{"role": "user", "content": "long"}], "max_tokens": 60, "stream": True}
    response = client.send(client.build_request("POST", proxy.url + "/v1/chat/completions", json=body), stream=True)
    assert response.status_code == 200
    return client, response


def test_eviction_unloads_the_lru_idle_adapter_never_a_busy_one(servers: Servers) -> None:
    sim = servers.sim(max_loras=4)
    proxy = servers.proxy_for(sim, deployments=on_demand("a", "b", "c", "d"),
                              lora={"max_adapters_per_replica": 2, "load_timeout_s": 0.5})
    with held(sim.url, "a-lora"):  # streams stay in flight (busy) until the gate lets them go
        client, stream = _stream_open(proxy, "a")  # `a` is loaded first (least recently used) and stays busy
        assert chat(proxy, "b").status_code == 200
        assert chat(proxy, "c").status_code == 200  # full: evicts `b` (idle), not `a` (in flight)
        assert holds(sim, "a-lora") and holds(sim, "c-lora") and not holds(sim, "b-lora")
        sim_faults(sim.url, hold_only=["a-lora", "c-lora"])
        client2, stream2 = _stream_open(proxy, "c")  # now both residents are busy
        r = chat(proxy, "d")
        assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_capacity"
        assert "`d-lora`" in r.json()["error"]["message"]
        sim_faults(sim.url, hold_only=["c-lora"])  # `a` finishes, `c` stays busy
        text = stream.read().decode()  # the busy adapter's stream was never disturbed
        assert text.rstrip().endswith("data: [DONE]") and holds(sim, "a-lora")
        stream.close(), client.close()
        # `a` is idle now (and least recently used): `d` takes its place while `c` still streams
        assert chat(proxy, "d").status_code == 200
        assert holds(sim, "c-lora") and holds(sim, "d-lora") and not holds(sim, "a-lora")
    assert stream2.read().decode().rstrip().endswith("data: [DONE]")
    stream2.close(), client2.close()
    stats = sim_of(sim).stats()
    assert stats["lora_loads"] == 4 and stats["lora_unloads"] == 2
    assert_no_misroute(sim)


def test_a_waiting_load_proceeds_when_an_adapter_frees_up(servers: Servers) -> None:
    sim = servers.sim(max_loras=4)
    proxy = servers.proxy_for(sim, deployments=on_demand("a", "b"), lora={"max_adapters_per_replica": 1})
    manager = proxy.server.config.app.runtime.lora
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with held(sim.url):
            client, stream = _stream_open(proxy, "a")  # in flight until released
            waiting = pool.submit(chat, proxy, "b")
            assert eventually(lambda: manager._waiters == 1, timeout=30)  # the load of `b` waits for a free slot
            assert not waiting.done() and holds(sim, "a-lora") and not holds(sim, "b-lora")
        assert waiting.result().status_code == 200  # `a` finished: `b` evicted it
    stream.read(), stream.close(), client.close()
    assert holds(sim, "b-lora") and not holds(sim, "a-lora")
    assert_no_misroute(sim)


# --- healing -------------------------------------------------------------------------------------


def test_replica_restarted_without_its_adapter_is_healed_by_reloading(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, deployments=on_demand("sql"))
    assert chat(proxy, "sql").status_code == 200 and holds(sim, "sql-lora")
    fresh = restart(servers, sim)
    # the proxy saw it come back without the adapter
    assert eventually(lambda: not proxy_sees(proxy, "gpu-0", "sql-lora")
                      and proxy.server.config.app.runtime.backends[0].healthy, timeout=10)
    assert not holds(fresh, "sql-lora")
    r = chat(proxy, "sql")
    assert r.status_code == 200 and holds(fresh, "sql-lora")
    assert sim_of(fresh).stats()["lora_loads"] == 1 and adapter_requests(fresh, "sql-lora") == 1
    assert_no_misroute(fresh)


def test_adapter_unloaded_behind_the_proxys_back_is_reloaded(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, deployments=on_demand("sql"))
    assert chat(proxy, "sql").status_code == 200
    httpx.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "sql-lora"})
    assert eventually(lambda: not proxy_sees(proxy, "gpu-0", "sql-lora"), timeout=10)
    assert chat(proxy, "sql").status_code == 200
    assert sim_of(sim).stats()["lora_loads"] == 2
    assert_no_misroute(sim)


def test_min_replicas_are_kept_loaded_without_traffic(servers: Servers) -> None:
    sims = [servers.sim(), servers.sim(), servers.sim()]
    proxy = servers.proxy_for(*sims, deployments=on_demand("sql", min_replicas=2),
                              lora={"rebalance_interval_s": 0.1})
    assert eventually(lambda: sum(holds(s, "sql-lora") for s in sims) == 2, timeout=10)
    holder = next(s for s in sims if holds(s, "sql-lora"))
    i = sims.index(holder)
    sims[i] = restart(servers, holder)
    assert eventually(lambda: sum(holds(s, "sql-lora") for s in sims) == 2, timeout=10)
    time.sleep(0.3)
    assert sum(holds(s, "sql-lora") for s in sims) == 2  # no overshoot
    assert chat(proxy, "sql").status_code == 200
    assert_no_misroute(*sims)


# --- replication ---------------------------------------------------------------------------------


def test_hot_adapter_spreads_up_to_max_replicas_and_shrinks_when_cool(servers: Servers) -> None:
    sims = [servers.sim(time_scale=1.0, itl_ms=25, max_loras=4) for _ in range(3)]
    proxy = servers.proxy_for(
        *sims, routing={"policy": "least_loaded"}, deployments=on_demand("sql", max_replicas=2),
        lora={"replicate_min_in_flight": 2, "cool_down_s": 0.5, "rebalance_interval_s": 0.1},
    )
    assert chat(proxy, "sql").status_code == 200 and loads(*sims) == 1

    async def waves() -> None:
        for _ in range(3):
            answers = await chat_many(proxy, "sql", 16, max_tokens=16)
            assert all(r.status_code == 200 for r in answers)

    asyncio.run(waves())
    assert loads(*sims) == 2  # spread to exactly one more replica (max_replicas=2)
    used = [s for s in sims if adapter_requests(s, "sql-lora") > 0]
    assert len(used) == 2 and all(holds(s, "sql-lora") for s in used)
    assert eventually(lambda: sum(holds(s, "sql-lora") for s in sims) == 1, timeout=10)  # cooled down
    assert sum(sim_of(s).stats()["lora_unloads"] for s in sims) == 1
    assert chat(proxy, "sql").status_code == 200
    assert_no_misroute(*sims)
