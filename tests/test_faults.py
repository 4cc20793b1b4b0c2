"""Fault tests with real servers: a killed replica, one answering 5xx, a slow one, Redis dying
mid-run, and a storm of client disconnects. Clients must not notice. (Hung replicas, poison
requests and long prefills: tests/test_hung_replicas.py; drains: tests/test_drain.py.)"""
from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import httpx

from loadtest.private_redis import PrivateRedis
from proxy.sim.app import create_app
from proxy.sim.config import SimConfig
from tests.conftest import MODEL, Servers, eventually, sim_of
from tests.support import ServerThread, held

CHAT = "/v1/chat/completions"


def ask(url: str, i: int, stream: bool = False) -> tuple[int, float]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 2, "stream": stream}
    started = time.monotonic()
    try:
        resp = httpx.post(url + CHAT, json=body, timeout=30)
        ok = 599 if resp.status_code == 200 and stream and "[DONE]" not in resp.text else resp.status_code
    except httpx.HTTPError:
        ok = 0
    return ok, time.monotonic() - started


def run(url: str, n: int, workers: int = 8) -> list[tuple[int, float]]:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda i: ask(url, i, stream=i % 2 == 0), range(n)))


def fault(sim, **changes) -> None:
    assert httpx.post(sim.url + "/sim/faults", json=changes).status_code == 200


def fleet_of_four(servers: Servers, **proxy_config):
    sims = [servers.sim() for _ in range(4)]
    config = {"routing": {"policy": "least_loaded"}, **proxy_config}
    config.setdefault("server", {})
    config["server"] = {"timeouts": {"first_byte": 0.5}, **config["server"]}
    return servers.proxy_for(*sims, **config), sims


def test_one_killed_replica_of_four(servers: Servers) -> None:
    # discovery polls rarely here: retries and passive ejection must carry it alone
    proxy, sims = fleet_of_four(servers, discovery={"interval_s": 30, "timeout_s": 1, "failures_to_down": 1})
    sims[2].stop()
    results = run(proxy.url, 200)
    assert [r for r in results if r[0] != 200] == []


def test_replica_answering_503_is_retried_elsewhere(servers: Servers) -> None:
    proxy, sims = fleet_of_four(servers)
    fault(sims[0], error_rate=1.0, error_status=503)
    results = run(proxy.url, 100)
    assert [r for r in results if r[0] != 200] == []
    metrics = httpx.get(proxy.url + "/metrics").text
    assert "vllm_proxy_retries_total" in metrics


def test_replica_answering_500_is_ejected(servers: Servers) -> None:
    """500 is not retried (the request may have had effects), but the replica is ejected after a
    few consecutive failures, so only those few reach clients."""
    proxy, sims = fleet_of_four(servers, server={"outlier": {"consecutive_failures": 3, "base_ejection_s": 60}})
    fault(sims[3], error_rate=1.0, error_status=500)
    results = run(proxy.url, 100, workers=1)
    failures = [r for r in results if r[0] != 200]
    assert 1 <= len(failures) <= 3
    assert all(code == 500 for code, _ in failures)


def test_last_replica_is_never_ejected(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, server={"outlier": {"consecutive_failures": 1}})
    fault(sim, error_rate=1.0, error_status=500)
    for i in range(5):
        assert ask(proxy.url, i)[0] == 500  # the replica's own answer, not a 503 from an empty fleet
    fault(sim, error_rate=0.0)
    assert ask(proxy.url, 99)[0] == 200


def test_slow_replica(servers: Servers) -> None:
    proxy, sims = fleet_of_four(servers, server={"timeouts": {"first_byte": 5}})
    fault(sims[0], slow_ms=300)
    results = run(proxy.url, 80)
    assert [r for r in results if r[0] != 200] == []
    assert sim_of(sims[0]).stats()["completed"] < 40  # least-loaded steered around it


def test_redis_stopped_mid_run(servers: Servers) -> None:
    redis = PrivateRedis().start()
    try:
        sims = [servers.sim() for _ in range(3)]
        proxy = servers.proxy_for(*sims, redis={"url": redis.url})
        up = lambda: 'vllm_proxy_redis_up 1.0' in httpx.get(proxy.url + "/metrics").text  # noqa: E731
        assert eventually(up, timeout=30)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            first = pool.map(lambda i: ask(proxy.url, i), range(100))
            redis.kill()
            second = list(pool.map(lambda i: ask(proxy.url, i), range(100, 200)))
        assert [r for r in [*first, *second] if r[0] != 200] == []
        assert eventually(lambda: not up(), timeout=30)
        redis.start()
        assert eventually(up, timeout=30)  # reconnects by itself
        assert all(ask(proxy.url, i)[0] == 200 for i in range(20))
    finally:
        redis.stop()


def test_storm_of_client_disconnects(servers: Servers) -> None:
    sims = [servers.sim(time_scale=1.0, itl_ms=50.0, prefill_ms_per_token=0.5) for _ in range(2)]
    proxy = servers.proxy_for(*sims)
    body = b'{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":200,"stream":true}' % (
        MODEL.encode(), b"long prompt " * 200)
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    socks = []
    for i in range(100):
        sock = socket.create_connection(("127.0.0.1", proxy.port))
        sock.sendall(request)
        socks.append(sock)
        if i % 2:
            time.sleep(0.002)
    # all reached a replica (some in prefill, some mid-stream): 10 s each unless cut off
    assert eventually(lambda: sum(sim_of(s).stats()["running"] for s in sims) == 100, timeout=30)
    for sock in socks:
        sock.close()
    assert eventually(lambda: all(sim_of(s).stats()["running"] + sim_of(s).stats()["waiting"] == 0 for s in sims), timeout=30)
    assert sum(sim_of(s).stats()["aborted"] for s in sims) == 100  # cut off, none ran to its end
    app = proxy.server.config.app
    assert eventually(lambda: all(b.in_flight == 0 for b in app.runtime.backends), timeout=10)
    assert 'vllm_proxy_in_flight_requests{backend="gpu-0"} 0.0' in httpx.get(proxy.url + "/metrics").text
    idle = sum(len(v) for v in app.runtime.upstream.pool._idle.values())
    assert idle <= 10  # aborted exchanges dropped their connections instead of pooling them
    assert ask(proxy.url, 1)[0] == 200


def test_timeouts_per_deployment(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy({
        "backends": [{"name": "gpu-0", "url": sim.url, "models": [MODEL]}],
        "deployments": [{"name": "patient", "model": MODEL},
                        {"name": "hasty", "model": MODEL, "timeouts": {"first_byte": 0.3}}],
        "server": {"timeouts": {"first_byte": 2.0}},
    })
    fault(sim, poison="never answered")  # that request hangs; the replica stays healthy
    timings = {}
    for name in ("hasty", "patient"):
        started = time.monotonic()
        resp = httpx.post(proxy.url + CHAT, json={"model": name, "messages": [{"role": "user", "content": "never answered"}]},
                          timeout=10)
        timings[name] = time.monotonic() - started
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"
    assert 0.3 <= timings["hasty"] < 2.0 <= timings["patient"]


def test_admission_queue_429_and_clients_leaving_the_queue(servers: Servers) -> None:
    """One slot per replica: further requests wait in FIFO order, a full queue answers 429 with
    Retry-After, and a client that gives up while queued leaves the queue at once (it neither
    reaches the replica nor holds up the requests behind it)."""
    sim = servers.sim()
    proxy = servers.proxy({"backends": [{"name": "gpu-0", "url": sim.url, "max_in_flight": 1}],
                           "server": {"max_queue": 2, "queue_timeout_s": 30}})
    admission = proxy.server.config.app.runtime.admission
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}

    def post() -> httpx.Response:
        return httpx.post(proxy.url + CHAT, json=body, timeout=30)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        with held(sim.url):  # the one slot stays taken until released
            first = pool.submit(post)
            assert eventually(lambda: sim_of(sim).engine.held == 1, timeout=30)
            queued = [pool.submit(post) for _ in range(2)]
            assert eventually(lambda: admission.queued == 2, timeout=30)
            rejected = post()  # the queue (2) is full
            assert rejected.status_code == 429 and rejected.headers["retry-after"] == "1"
            assert rejected.json()["error"]["code"] == "server_saturated"
        assert [f.result().status_code for f in [first, *queued]] == [200, 200, 200]

    # a client leaves the queue: the one behind it is served right after the running request
    requests_before = sum(sim_of(sim).stats()["requests"].values())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with held(sim.url):
            running = pool.submit(post)
            assert eventually(lambda: sim_of(sim).engine.held == 1, timeout=30)
            raw = httpx.Request("POST", proxy.url + CHAT, json=body).read()
            leaver = socket.create_connection(("127.0.0.1", proxy.port))
            leaver.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                           % (CHAT.encode(), len(raw), raw))
            assert eventually(lambda: admission.queued == 1, timeout=30)
            leaver.close()  # gives up while queued
            assert eventually(lambda: admission.queued == 0, timeout=30)  # and leaves the queue at once
            behind = pool.submit(post)
            assert eventually(lambda: admission.queued == 1, timeout=30)
        assert running.result().status_code == 200 and behind.result().status_code == 200
    assert sum(sim_of(sim).stats()["requests"].values()) - requests_before == 2  # the leaver never ran


def test_rolling_restart_of_every_replica_under_load(servers: Servers) -> None:
    """Each replica in turn stops (finishing what it runs) and comes back on its port while
    clients keep sending: no request fails, and every restarted replica serves again."""
    sims = [servers.sim() for _ in range(4)]
    proxy = servers.proxy_for(*sims)
    stop = threading.Event()
    results: list[tuple[int, float]] = []

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            results.append(ask(proxy.url, i, stream=i % 2 == 0))
            i += 4

    def healthy() -> list[str]:
        return httpx.get(proxy.url + "/ready").json()["healthy_backends"]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        for i, old in enumerate(list(sims)):
            served = len(results)
            old.stop()
            assert eventually(lambda: f"gpu-{i}" not in healthy(), timeout=30)
            new = ServerThread(create_app(SimConfig(model=MODEL, time_scale=0.0)), port=old.port).start()
            servers.running.append(new)
            assert eventually(lambda: f"gpu-{i}" in healthy() and sim_of(new).stats()["completed"] > 0, timeout=30)
            assert len(results) > served  # load went on meanwhile
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(results) > 40 and [r for r in results if r[0] != 200] == []
