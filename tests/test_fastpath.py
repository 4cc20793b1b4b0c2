"""Plain requests served in protocol callbacks (proxy/fastpath.py): the same answers, failures,
retries, disconnects and shutdowns as the task path. Each test first makes one request per
replica so that a pooled connection is idle: only then is a request served in callbacks, and
each test checks that it was (an `_Exchange` among the server's tasks while it is in flight)."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import threading
from pathlib import Path

import httpx

from proxy.fastpath import _Exchange
from proxy.prefix import prefix_key
from tests.conftest import MODEL, Servers, eventually, sim_of
from tests.support import held, sim_faults

CHAT = "/v1/chat/completions"


def body(content: str = "hello", max_tokens: int = 4) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def in_callbacks(proxy) -> list[_Exchange]:
    return [t for t in list(proxy.server.server_state.tasks) if isinstance(t, _Exchange)]


def warm(proxy, sims) -> None:
    """One request per replica: each then has an idle pooled connection."""
    for _ in range(2 * len(sims)):
        assert httpx.post(proxy.url + CHAT, json=body(), timeout=30).status_code == 200
    pool = proxy.server.config.app.runtime.upstream.pool
    assert eventually(lambda: sum(len(c) for c in pool._idle.values()) >= len(sims))


def metrics(proxy) -> str:
    return httpx.get(proxy.url + "/metrics").text


def test_a_plain_request_is_answered_from_callbacks(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, routing={"policy": "prefix_affinity"})
    warm(proxy, [sim])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with held(sim.url):
            pending = pool.submit(httpx.post, proxy.url + CHAT, json=body("callbacks"), timeout=30)
            assert eventually(lambda: len(in_callbacks(proxy)) == 1)
        resp = pending.result()
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
    assert resp.headers["x-request-id"] and float(resp.headers["x-vllm-proxy-overhead-ms"]) >= 0
    assert not in_callbacks(proxy)
    app = proxy.server.config.app
    assert all(b.in_flight == 0 for b in app.runtime.backends)
    text = metrics(proxy)
    assert f'vllm_proxy_requests_total{{backend="gpu-0",deployment="{MODEL}",endpoint="/v1/chat/completions",status_code="200"}} 3.0' in text
    assert 'vllm_proxy_in_flight_requests{backend="gpu-0"} 0.0' in text


def test_a_client_leaving_aborts_the_request_on_the_replica(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim)
    warm(proxy, [sim])
    payload = httpx.Request("POST", proxy.url + CHAT, json=body("leaving")).read()
    with held(sim.url):
        sock = socket.create_connection(("127.0.0.1", proxy.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        assert eventually(lambda: len(in_callbacks(proxy)) == 1 and sim_of(sim).stats()["running"] == 1)
        sock.close()
        assert eventually(lambda: sim_of(sim).stats()["aborted"] == 1)
    assert eventually(lambda: not in_callbacks(proxy))
    app = proxy.server.config.app
    assert all(b.in_flight == 0 for b in app.runtime.backends)
    text = metrics(proxy)
    assert f'vllm_proxy_client_disconnects_total{{deployment="{MODEL}",phase="before_first_byte"}} 1.0' in text
    assert 'status_code="499"} 1.0' in text
    assert httpx.post(proxy.url + CHAT, json=body(), timeout=30).status_code == 200


def test_a_503_from_the_replica_is_retried_on_another(servers: Servers) -> None:
    sims = [servers.sim(), servers.sim()]
    proxy = servers.proxy_for(*sims, routing={"policy": "round_robin"})
    warm(proxy, sims)
    sim_faults(sims[0].url, error_rate=1.0, error_status=503)
    for i in range(4):
        resp = httpx.post(proxy.url + CHAT, json=body(f"retried {i}"), timeout=30)
        assert resp.status_code == 200 and resp.headers["x-vllm-proxy-backend"] == "gpu-1"
    assert 'vllm_proxy_retries_total{' in metrics(proxy)


def test_a_hung_replica_is_cut_and_the_request_fails_over(servers: Servers) -> None:
    sims = [servers.sim(), servers.sim()]
    proxy = servers.proxy_for(*sims, routing={"policy": "round_robin"})
    warm(proxy, sims)
    with held(sims[0].url), held(sims[1].url), concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(httpx.post, proxy.url + CHAT, json=body(f"q{i}"), timeout=120) for i in range(2)]
        assert eventually(lambda: len(in_callbacks(proxy)) == 2
                          and all(sim_of(s).stats()["running"] == 1 for s in sims), timeout=30)
        sim_faults(sims[0].url, hang=True)
        sim_faults(sims[1].url, hold=False, hold_only=[])
        answers = [f.result() for f in pending]
    assert [a.status_code for a in answers] == [200, 200]
    assert {a.headers["x-vllm-proxy-backend"] for a in answers} == {"gpu-1"}
    sim_faults(sims[0].url, hang=False)


def test_first_byte_timeout_is_a_504(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, server={"timeouts": {"first_byte": 0.3}})
    warm(proxy, [sim])
    sim_faults(sim.url, poison="never answered")  # that request hangs; the replica stays healthy
    resp = httpx.post(proxy.url + CHAT, json=body("never answered"), timeout=30)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"
    assert all(b.in_flight == 0 for b in proxy.server.config.app.runtime.backends)


def test_an_answer_over_the_response_limit_is_a_502(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, server={"max_response_bytes": 1000})
    warm(proxy, [sim])
    resp = httpx.post(proxy.url + CHAT, json={**body("long", max_tokens=400), "ignore_eos": True}, timeout=30)
    assert resp.status_code == 502 and "exceeds 1000 bytes" in resp.json()["error"]["message"]
    assert httpx.post(proxy.url + CHAT, json=body(), timeout=30).status_code == 200


def test_shutdown_deadline_answers_503(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim)
    warm(proxy, [sim])
    with held(sim.url), concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, proxy.url + CHAT, json=body("at shutdown"), timeout=60)
        assert eventually(lambda: len(in_callbacks(proxy)) == 1)
        proxy.server.should_exit = True  # uvicorn's shutdown cancels what is left at its deadline
        resp = pending.result()
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "proxy_shutting_down"
    assert resp.headers["connection"] == "close"


def raw_request(payload: bytes, chunked: bool = False) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)


def test_a_reset_and_a_disconnect_in_one_turn_release_everything(servers: Servers) -> None:
    """The replica's connection resets and the client leaves in the same loop turn: the task that
    takes the failure over is cancelled before its first step, which must not skip its cleanup."""
    sim = servers.sim()
    proxy = servers.proxy_for(sim)
    warm(proxy, [sim])
    app = proxy.server.config.app
    with held(sim.url):
        sock = socket.create_connection(("127.0.0.1", proxy.port))
        sock.sendall(raw_request(json.dumps(body("both")).encode()))
        assert eventually(lambda: len(in_callbacks(proxy)) == 1 and sim_of(sim).stats()["running"] == 1)
        [exchange] = in_callbacks(proxy)
        done = threading.Event()

        def both() -> None:
            exchange.response._conn.transport.abort()
            exchange.cycle.protocol.transport.abort()
            done.set()

        exchange.cycle.protocol.loop.call_soon_threadsafe(both)
        assert done.wait(30)
        assert eventually(lambda: not proxy.server.server_state.tasks)
        assert eventually(lambda: all(b.in_flight == 0 for b in app.runtime.backends))
    assert 'vllm_proxy_in_flight_requests{backend="gpu-0"} 0.0' in metrics(proxy)


def test_a_large_chunked_body_still_sees_the_client_leave(servers: Servers) -> None:
    """Over 64 KiB of body pauses reading the client; served in callbacks, reading must resume,
    or a client that leaves goes unnoticed while the replica computes for nobody."""
    sim = servers.sim()
    proxy = servers.proxy_for(sim)
    warm(proxy, [sim])
    payload = json.dumps(body("padded")).encode() + b" " * 70_000  # (JSON whitespace: a short prompt)
    with held(sim.url):
        sock = socket.create_connection(("127.0.0.1", proxy.port))
        sock.sendall(raw_request(payload, chunked=True))
        assert eventually(lambda: len(in_callbacks(proxy)) == 1 and sim_of(sim).stats()["running"] == 1)
        sock.close()
        assert eventually(lambda: sim_of(sim).stats()["aborted"] == 1)


def test_infinite_timeouts(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim, server={"timeouts": {"first_byte": float("inf"), "total": float("inf")}})
    warm(proxy, [sim])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with held(sim.url):
            pending = pool.submit(httpx.post, proxy.url + CHAT, json=body("no deadline"), timeout=30)
            assert eventually(lambda: len(in_callbacks(proxy)) == 1)
        assert pending.result().status_code == 200


def test_drain_waits_for_a_body_still_arriving(servers: Servers, tmp_path: Path) -> None:
    """A request whose body is still arriving when SIGTERM comes is waited for and answered (a 503
    at the deadline here), whether its head was read before the drain began or after."""
    from tests.test_drain import serve

    proc, url = serve(tmp_path, [servers.sim()], drain_timeout_s=1)
    try:
        request = raw_request(json.dumps(body("late body")).encode())
        sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        sock.sendall(request[:-10])  # the head and most of the body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        sock.settimeout(30)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"proxy_shutting_down" in answer
    finally:
        proc.kill()
        proc.wait()


def test_the_pick_is_counted_once_the_request_is_sent(servers: Servers) -> None:
    """prefix_affinity's bookkeeping (load and tenant counts, the index entry) waits until the
    request is written to the replica, then runs in the same callback: while the replica holds
    the request, the policy already knows where its prefix is."""
    sim = servers.sim()
    proxy = servers.proxy_for(sim, routing={"policy": "prefix_affinity"})
    warm(proxy, [sim])
    policy = proxy.server.config.app.runtime.profile.policy
    system = "You are the settling assistant. " * 40
    chat = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    pin, chain, _ = prefix_key(True, chat, MODEL, policy._block_chars, policy._max_blocks)
    assert chain and policy.index.longest(chain) == (0, None) and pin not in policy.tenants.rate.scaled
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with held(sim.url):
            pending = pool.submit(httpx.post, proxy.url + CHAT, json=chat, timeout=30)
            assert eventually(lambda: len(in_callbacks(proxy)) == 1)
            # settled in the write pass that follows (the loop's next callback), while the
            # replica holds the request: its answer cannot be what settles it
            assert eventually(lambda: policy._due is None and policy.index.longest(chain) == (len(chain), "gpu-0"))
            assert pin in policy.tenants.rate.scaled
        assert pending.result().status_code == 200
