"""Hung replicas, long prefills and poison requests, default detection settings (proxy/watchdog.py).

A hung replica (the simulator's `hang` fault: connections accepted, nothing answered, running
streams stall, as under SIGSTOP) must cost clients nothing but time: new requests are failed
over, its live streams end with an SSE error event, and it is back once it answers again. A
replica that is merely slow to start (a long prefill) is never marked down, and a request that
hangs on a healthy replica fails alone instead of hanging a second replica too.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import MODEL, Servers, eventually, sim_of

CHAT = "/v1/chat/completions"
LONG = 120.0  # seconds: a client timeout far beyond anything the proxy should take


def fault(sim, **changes) -> None:
    assert httpx.post(sim.url + "/sim/faults", json=changes).status_code == 200


def body(content: str, stream: bool, max_tokens: int = 4) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}


class Stream(threading.Thread):
    """One streaming request read in the background: which replica served it, what arrived."""

    def __init__(self, url: str, content: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.payload = url, {**body(content, True, max_tokens), "ignore_eos": True}  # runs max_tokens
        self.backend: str | None = None
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + CHAT, json=self.payload, timeout=LONG) as resp:
                self.backend = resp.headers.get("x-vllm-proxy-backend")
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            self.error = exc
        finally:
            self.first.set()

    @property
    def completed(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def ended_with_error(self) -> bool:
        return bool(self.events) and self.events[-1].startswith('{"error"')


def ask(url: str, i: int) -> tuple[int, bool, float]:
    """One new request (every other one streaming): (status, complete, seconds)."""
    stream = i % 2 == 0
    started = time.monotonic()
    resp = httpx.post(url + CHAT, json=body(f"question {i}", stream), timeout=LONG)
    complete = "[DONE]" in resp.text if stream else resp.status_code == 200
    return resp.status_code, complete, time.monotonic() - started


def up(proxy, name: str) -> bool:
    return name in httpx.get(proxy.url + "/ready").json()["healthy_backends"]


def test_hung_replica_under_streaming_and_plain_load(servers: Servers) -> None:
    """Default settings (600 s first-byte timeout): 0 failed new requests, the hung replica's
    streams end with an error event, and it is back in rotation once it answers again."""
    sims = [servers.sim(time_scale=1.0, itl_ms=20.0, prefill_ms_per_token=0.0) for _ in range(4)]
    proxy = servers.proxy_for(*sims, routing={"policy": "round_robin"})
    streams = [Stream(proxy.url, f"long story {i}", max_tokens=5000) for i in range(8)]  # ~100 s each
    for s in streams:
        assert s.first.wait(30) and s.error is None
    hung = [s for s in streams if s.backend == "gpu-1"]
    assert hung, "round robin put no stream on gpu-1"
    fault(sims[1], hang=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: ask(proxy.url, i), range(80)))
    assert [r for r in results if r[:2] != (200, True)] == []
    assert max(t for *_, t in results) < 60  # rescued, not waiting out a timeout (measured: loadtest/faults.py)
    for s in hung:
        s.join(30)
        assert not s.is_alive() and s.ended_with_error, s.events[-2:]
        assert "gpu-1" in s.events[-1] and "stopped answering" in s.events[-1]
    assert not up(proxy, "gpu-1")
    assert all(s.is_alive() for s in streams if s not in hung)  # healthy streams go on
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'vllm_proxy_upstream_errors_total{backend="gpu-1",kind="down"}' in metrics

    fault(sims[1], hang=False)
    assert eventually(lambda: up(proxy, "gpu-1"), timeout=30)
    before = sim_of(sims[1]).stats()["completed"]
    assert all(ask(proxy.url, i)[:2] == (200, True) for i in range(8))
    assert sim_of(sims[1]).stats()["completed"] > before


def test_long_prefill_is_not_a_hang(servers: Servers, caplog: pytest.LogCaptureFixture) -> None:
    """A request whose first token takes far longer than the watchdog's suspicion threshold (the
    replica is silent meanwhile, but answers its probes) succeeds, and the replica stays up."""
    sims = [servers.sim() for _ in range(2)]
    proxy = servers.proxy_for(*sims, routing={"policy": "round_robin"})
    prefill_s = 6.0  # six times the default suspicion threshold: several probes answered
    for sim in sims:
        fault(sim, long_prefill="a very long document", long_prefill_ms=prefill_s * 1000)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=LONG)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(client.chat.completions.create, model=MODEL, max_tokens=3, stream=stream,
                            messages=[{"role": "user", "content": "a very long document"}]) for stream in (False, True)]
        others = list(pool.map(lambda i: ask(proxy.url, i), range(40)))
        plain, streamed = slow[0].result(), list(slow[1].result())
    assert plain.choices[0].message.content
    assert streamed and streamed[-1].choices[0].finish_reason is not None
    assert [r for r in others if r[:2] != (200, True)] == []
    assert up(proxy, "gpu-0") and up(proxy, "gpu-1")
    assert "stopped answering" not in caplog.text
    assert "retries_total{" not in httpx.get(proxy.url + "/metrics").text


def test_poison_request_fails_alone(servers: Servers) -> None:
    """A request that hangs on a healthy replica times out there and is not retried elsewhere
    (it would hang that replica too): the error says so; the fleet and other clients are unharmed."""
    sims = [servers.sim() for _ in range(4)]
    proxy = servers.proxy_for(*sims, server={"timeouts": {"first_byte": 2.0}})
    for sim in sims:
        fault(sim, poison="n=100000")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        poison = pool.submit(httpx.post, proxy.url + CHAT, json=body("please n=100000", False), timeout=LONG)
        others = list(pool.map(lambda i: ask(proxy.url, i), range(40)))
        resp = poison.result()
    assert resp.status_code == 504
    error = resp.json()["error"]
    assert error["code"] == "upstream_timeout" and "not retried" in error["message"]
    assert [r for r in others if r[:2] != (200, True)] == []
    metrics = httpx.get(proxy.url + "/metrics").text
    assert "vllm_proxy_retries_total{" not in metrics
    assert sum(line.startswith("vllm_proxy_upstream_errors_total{") and line.endswith(" 1.0")
               for line in metrics.splitlines()) == 1  # one replica saw it, once
    assert all(up(proxy, f"gpu-{i}") for i in range(4))


def test_request_on_a_replica_that_hangs_before_answering_is_retried(servers: Servers) -> None:
    """The replica hangs while the request waits for its first byte (non-streaming, default
    timeouts): the request is cut from it and answered by another replica."""
    sims = [servers.sim(time_scale=1.0, itl_ms=50.0, prefill_ms_per_token=0.0) for _ in range(2)]
    proxy = servers.proxy_for(*sims, routing={"policy": "round_robin"})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(httpx.post, proxy.url + CHAT, json=body(f"q{i}", False, max_tokens=100), timeout=LONG)
                   for i in range(2)]
        assert eventually(lambda: all(sim_of(s).stats()["running"] == 1 for s in sims), timeout=30)
        fault(sims[0], hang=True)
        answers = [f.result() for f in pending]
    assert [a.status_code for a in answers] == [200, 200]
    assert {a.headers["x-vllm-proxy-backend"] for a in answers} == {"gpu-1"}
    fault(sims[0], hang=False)


def test_sim_fault_fields_are_validated(servers: Servers) -> None:
    sim = servers.sim()
    assert httpx.post(sim.url + "/sim/faults", json={"poison": 5}).status_code == 400
    assert httpx.post(sim.url + "/sim/faults", json={"long_prefill_ms": -1}).status_code == 400
    assert httpx.post(sim.url + "/sim/faults", json={"hang": "yes"}).status_code == 400
    assert httpx.post(sim.url + "/sim/faults", json={"poison": "x", "long_prefill_ms": 5}).json()["poison"] == "x"
