"""Observability (issue 6): Prometheus families and their values, latency histograms against a
simulated replica with known TTFT and ITL, scraped backend state, request ids, the overhead
header, the JSON access log, and the multi-worker (multiprocess) exposition."""
from __future__ import annotations

import concurrent.futures
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean, median

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy import accesslog
from proxy.accesslog import LOGGER, usage_tokens
from proxy.scrape import Reading, _Previous, hit_ratio, parse_vllm_metrics
from proxy.sim.tokenizer import render_chat
from tests.conftest import MODEL, Servers, eventually, sim_of
from tests.support import ServerThread, held, sim_faults

ROOT = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"

FAMILIES = [  # the issue's list, as the parser names them (counters without _total)
    "vllm_proxy_requests", "vllm_proxy_request_duration_seconds", "vllm_proxy_time_to_first_token_seconds",
    "vllm_proxy_inter_token_latency_seconds", "vllm_proxy_overhead_seconds", "vllm_proxy_upstream_errors",
    "vllm_proxy_in_flight_requests", "vllm_proxy_backend_up", "vllm_proxy_routing_decisions",
    "vllm_proxy_client_disconnects", "vllm_proxy_config_reloads", "vllm_proxy_backend_prefix_cache_hit_ratio",
    "vllm_proxy_backend_requests_waiting", "vllm_proxy_backend_kv_cache_usage", "vllm_proxy_backend_load_factor",
    # operator families (issue 21)
    "vllm_proxy_key_requests", "vllm_proxy_tokens", "vllm_proxy_config_last_reload_success",
    "vllm_proxy_config_last_reload_timestamp_seconds", "vllm_proxy_build_info", "vllm_proxy_redis_up",
    "vllm_proxy_retries", "vllm_proxy_lora_operations", "vllm_proxy_multimodal_requests",
]


def chat(content: str = "hello", stream: bool = False, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, **extra}


def families(server: ServerThread) -> dict:
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    """Sum of the samples of `family` (named `sample`, default the family's own) matching `labels`."""
    name = sample or family
    return sum(s.value for s in fams[family].samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def quantile(fams: dict, family: str, q: float, **labels: str) -> float:
    """histogram_quantile() as Prometheus computes it: linear interpolation inside the bucket."""
    buckets: dict[float, float] = {}
    for s in fams[family].samples:
        if s.name == family + "_bucket" and all(s.labels.get(k) == v for k, v in labels.items()):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    assert total > 0
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / (buckets[le] - below)
        lower, below = le, buckets[le]
    raise AssertionError("unreachable")


def stream_events(url: str, body: dict, headers: dict | None = None) -> list[str]:
    with httpx.stream("POST", url + CHAT, json=body, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200
        return [line for line in resp.iter_lines() if line.startswith("data: ")]


# --- counters and families -------------------------------------------------------------------

def paced_sim(servers: Servers) -> ServerThread:
    """Tokens 3 ms apart, so each decoding step reaches the proxy as a chunk of its own."""
    return servers.sim(time_scale=1.0, itl_ms=3.0, prefill_ms_per_token=0.0)


def lock_step_events(url: str, sim: ServerThread, body: dict) -> list[str]:
    """The SSE data lines of streaming `body` through the proxy at `url`, with replica `sim` in lock
    step with the client: its next decoding step waits until the client has the last token, so every
    step reaches the proxy in a read of its own, however busy the machine."""
    sim_faults(sim.url, steps=1)
    events = []
    try:
        with httpx.stream("POST", url + CHAT, json=body, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    choices = orjson.loads(line[6:]).get("choices") if line != "data: [DONE]" else None
                    if choices and "role" not in choices[0]["delta"]:
                        sim_faults(sim.url, steps=1)  # a token arrived: the next step may go
    finally:
        sim_faults(sim.url, steps=-1)
    return events


def test_counters_say_n_and_every_family_is_present(servers: Servers) -> None:
    sim = paced_sim(servers)
    proxy = servers.proxy_for(sim)
    plain, streamed, unknown = 7, 5, 3
    with httpx.Client(base_url=proxy.url) as client:
        for i in range(plain):
            assert client.post(CHAT, json=chat(f"plain {i}")).status_code == 200
        for i in range(unknown):
            assert client.post(CHAT, json={**chat(), "model": f"no-such-model-{i}"}).status_code == 404
    for i in range(streamed):
        assert lock_step_events(proxy.url, sim, chat(f"stream {i}", stream=True))[-1] == "data: [DONE]"

    fams = families(proxy)
    for name in FAMILIES:
        assert name in fams, f"{name} missing from /metrics"
    ok = {"deployment": MODEL, "backend": "gpu-0", "endpoint": CHAT}
    assert value(fams, "vllm_proxy_requests", "vllm_proxy_requests_total", **ok, status_code="200") == plain + streamed
    # unknown models are counted under `unknown`, never under the name the client sent
    assert value(fams, "vllm_proxy_requests", "vllm_proxy_requests_total", deployment="unknown",
                 status_code="404") == unknown
    assert not any("no-such-model" in str(s.labels) for f in fams.values() for s in f.samples)
    duration = "vllm_proxy_request_duration_seconds"
    assert value(fams, duration, duration + "_count", **ok) == plain + streamed
    ttft = "vllm_proxy_time_to_first_token_seconds"
    assert value(fams, ttft, ttft + "_count", deployment=MODEL, backend="gpu-0") == streamed  # streaming only
    itl = "vllm_proxy_inter_token_latency_seconds"
    # 8 decoding steps (the first carries the role and first token): 7 gaps; [DONE] is no token.
    # One gap per upstream read; in lock step every step is a read of its own.
    assert value(fams, itl, itl + "_count", deployment=MODEL, backend="gpu-0") == streamed * 7
    overhead = "vllm_proxy_overhead_seconds"
    assert value(fams, overhead, overhead + "_count", endpoint=CHAT) == plain + streamed
    # seconds, and a part of each request's time (a fixed bound would break on a busy machine)
    assert 0 < value(fams, overhead, overhead + "_sum") < value(fams, duration, duration + "_sum", **ok)
    assert value(fams, "vllm_proxy_routing_decisions", "vllm_proxy_routing_decisions_total") == plain + streamed
    assert value(fams, "vllm_proxy_in_flight_requests", backend="gpu-0") == 0
    assert value(fams, "vllm_proxy_backend_up", backend="gpu-0") == 1


def test_upstream_errors_and_status_codes_are_counted(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim)
    httpx.post(sim.url + "/sim/faults", json={"error_rate": 1.0, "error_status": 500})
    for _ in range(3):
        assert httpx.post(proxy.url + CHAT, json=chat()).status_code == 500
    fams = families(proxy)
    assert value(fams, "vllm_proxy_requests", "vllm_proxy_requests_total", backend="gpu-0", status_code="500") == 3


def test_usage_only_chunk_and_include_usage(servers: Servers) -> None:
    """With include_usage the last event has `"choices":[]`: not a token, so not an ITL sample."""
    sim = servers.sim()
    proxy = servers.proxy_for(sim)
    events = lock_step_events(proxy.url, sim, chat(stream=True, max_tokens=5, stream_options={"include_usage": True}))
    assert '"usage"' in events[-2] and len(events) == 1 + 5 + 2  # role, tokens, usage, [DONE]
    fams = families(proxy)
    itl = "vllm_proxy_inter_token_latency_seconds"
    assert value(fams, itl, itl + "_count") == 4


def test_events_in_one_chunk_are_one_gap(servers: Servers) -> None:
    """A replica that flushes a whole stream at once (time_scale 0) shows a TTFT and no gaps:
    events that arrive together are not counted as zero-length gaps."""
    proxy = servers.proxy_for(servers.sim())
    stream_events(proxy.url, chat(stream=True, max_tokens=8))
    fams = families(proxy)
    assert value(fams, "vllm_proxy_time_to_first_token_seconds", "vllm_proxy_time_to_first_token_seconds_count") == 1
    itl = "vllm_proxy_inter_token_latency_seconds"
    assert value(fams, itl, itl + "_count") <= 1


# --- latency histograms against known sim latencies -------------------------------------------

def test_ttft_and_itl_medians_match_the_sim(servers: Servers) -> None:
    target_ttft, target_itl = 0.100, 0.030
    prompts = [f"request {i:03d} " + "word " * 300 for i in range(12)]
    tokens = len(render_chat([{"role": "user", "content": prompts[0]}], None))
    sim = servers.sim(time_scale=1.0, prefill_ms_per_token=target_ttft * 1000 / tokens, itl_ms=target_itl * 1000)
    proxy = servers.proxy_for(sim)

    def one(prompt: str) -> tuple[float, list[float]]:
        arrivals = []
        started = time.perf_counter()
        with httpx.stream("POST", proxy.url + CHAT, json=chat(prompt, stream=True, max_tokens=10), timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append(time.perf_counter())
        # the role event and the first token event come from the first step together
        return arrivals[0] - started, [b - a for a, b in zip(arrivals[1:], arrivals[2:])]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, prompts))
    assert sim_of(sim).stats()["prefix_cache"]["hits"] == 0  # every prefill was paid in full

    fams = families(proxy)
    labels = {"deployment": MODEL, "backend": "gpu-0"}
    ttft = quantile(fams, "vllm_proxy_time_to_first_token_seconds", 0.5, **labels)
    itl = quantile(fams, "vllm_proxy_inter_token_latency_seconds", 0.5, **labels)
    client_ttft = median(r[0] for r in results)
    client_itl = median(g for r in results for g in r[1])
    client_mean_itl = mean(g for r in results for g in r[1])
    print(f"TTFT median: histogram {ttft * 1000:.1f} ms, client {client_ttft * 1000:.1f} ms; "
          f"ITL median: histogram {itl * 1000:.1f} ms, client {client_itl * 1000:.1f} ms")
    # never below what the replica takes; above it only as far as the client saw too (on an idle
    # machine the client sees the targets; a busy one stretches every gap, for everybody)
    assert target_ttft * 0.8 <= ttft <= max(target_ttft, client_ttft) * 1.2
    assert target_itl * 0.8 <= itl <= max(target_itl, client_itl) * 1.2
    # the exact means (sum / count) agree too
    name = "vllm_proxy_inter_token_latency_seconds"
    mean_itl = value(fams, name, name + "_sum", **labels) / value(fams, name, name + "_count", **labels)
    assert target_itl * 0.9 <= mean_itl <= max(target_itl, client_mean_itl) * 1.2


# --- scraped backend state --------------------------------------------------------------------

def gauge(proxy: ServerThread, family: str, backend: str = "gpu-0") -> float | None:
    fams = families(proxy)
    found = [s.value for s in fams[family].samples if s.labels.get("backend") == backend]
    return found[0] if found else None


def test_waiting_and_kv_usage_follow_the_sim(servers: Servers) -> None:
    sim = servers.sim(max_num_seqs=1)
    proxy = servers.proxy_for(sim)
    assert eventually(lambda: gauge(proxy, "vllm_proxy_backend_requests_waiting") == 0, timeout=10)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        with held(sim.url):  # one runs (held), three queue behind it, for as long as the scrapes take
            futures = [pool.submit(httpx.post, proxy.url + CHAT, json=chat(f"q{i}", max_tokens=40), timeout=30)
                       for i in range(4)]
            assert eventually(lambda: sim_of(sim).stats()["waiting"] == 3, timeout=30)
            assert eventually(lambda: gauge(proxy, "vllm_proxy_backend_requests_waiting") == 3, timeout=30)
            kv = gauge(proxy, "vllm_proxy_backend_kv_cache_usage")
            assert kv is not None and 0 < kv <= 1
        assert all(f.result().status_code == 200 for f in futures)
    assert eventually(lambda: gauge(proxy, "vllm_proxy_backend_requests_waiting") == 0, timeout=10)
    assert eventually(lambda: gauge(proxy, "vllm_proxy_backend_kv_cache_usage") == 0, timeout=10)


def test_hit_ratio_follows_the_sim(servers: Servers) -> None:
    sim = servers.sim()
    proxy = servers.proxy_for(sim)
    prompt = "a long shared system prompt " * 40
    assert httpx.post(proxy.url + CHAT, json=chat(prompt, max_tokens=1)).status_code == 200  # all misses
    assert eventually(lambda: gauge(proxy, "vllm_proxy_backend_prefix_cache_hit_ratio") == 0.0, timeout=10)
    before = sim_of(sim).stats()["prefix_cache"]
    for _ in range(4):
        assert httpx.post(proxy.url + CHAT, json=chat(prompt, max_tokens=1)).status_code == 200
    after = sim_of(sim).stats()["prefix_cache"]
    expected = (after["hits"] - before["hits"]) / (after["queries"] - before["queries"])
    assert expected > 0.8
    # every repeat has the same ratio, so any scrape window over them shows `expected`
    assert eventually(
        lambda: abs((gauge(proxy, "vllm_proxy_backend_prefix_cache_hit_ratio") or 0) - expected) < 1e-9, timeout=10
    )


def test_scrape_parser_reads_current_and_legacy_names() -> None:
    current = b"""# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
vllm:lora_requests_info{max_lora="1",running_lora_adapters="a b",waiting_lora_adapters=""} 1.7e9
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="8192"} 1.0
"""
    r = parse_vllm_metrics(current)
    assert (r.waiting, r.kv_usage, r.queries, r.hits, r.cache_tokens) == (5.0, 0.5, 1000.0, 400.0, 16 * 8192)
    legacy = b"""vllm:num_requests_waiting{model_name="m"} 1.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 5.0
"""
    r = parse_vllm_metrics(legacy)
    assert (r.waiting, r.kv_usage, r.queries, r.hits) == (1.0, 0.5, 10.0, 5.0)
    assert parse_vllm_metrics(b'vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.3\n').hit_rate == 0.3
    # hit ratio: cumulative first, then per scrape window; a window without queries keeps the last
    prev = _Previous()
    assert hit_ratio(prev, Reading(queries=100, hits=50)) == 0.5
    assert hit_ratio(prev, Reading(queries=200, hits=140)) == 0.9
    assert hit_ratio(prev, Reading(queries=200, hits=140)) == 0.9
    assert hit_ratio(prev, Reading(queries=10, hits=1)) == 0.1  # the backend restarted


# --- request ids, overhead header ---------------------------------------------------------------

class HeaderCapture:
    """An upstream that records request headers and answers a fixed chat completion."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] == "GET":
            body = b'{"object":"list","data":[{"id":"%s","object":"model"}]}' % MODEL.encode()
        else:
            self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
            body = (b'{"id":"x","object":"chat.completion","model":"%s","choices":[{"index":0,"message":'
                    b'{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
                    b'"usage":{"prompt_tokens":11,"completion_tokens":2,"total_tokens":13}}' % MODEL.encode())
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def test_request_id_forwarded_and_returned_and_overhead_header(servers: Servers) -> None:
    upstream = HeaderCapture()
    backend = ServerThread(upstream).start()
    servers.running.append(backend)
    proxy = servers.proxy_for(backend)
    sent = time.perf_counter()
    resp = httpx.post(proxy.url + CHAT, json=chat(), headers={"x-request-id": "client-id-42"})
    elapsed_ms = (time.perf_counter() - sent) * 1000
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "client-id-42"
    assert upstream.headers[-1]["x-request-id"] == "client-id-42"
    overhead_ms = float(resp.headers["x-vllm-proxy-overhead-ms"])
    assert 0 < overhead_ms < elapsed_ms  # milliseconds, a part of what the client waited

    resp = httpx.post(proxy.url + CHAT, json=chat())
    generated = resp.headers["x-request-id"]
    assert len(generated) == 24 and int(generated, 16) >= 0
    assert upstream.headers[-1]["x-request-id"] == generated
    # streams carry the id too, but no overhead header (headers precede the relay)
    sim_proxy = servers.proxy_for(servers.sim())
    with httpx.stream("POST", sim_proxy.url + CHAT, json=chat(stream=True), headers={"x-request-id": "s-1"}) as r:
        assert r.headers["x-request-id"] == "s-1"
        assert "x-vllm-proxy-overhead-ms" not in r.headers


# --- access log ---------------------------------------------------------------------------------

class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access_lines():
    logger = logging.getLogger(LOGGER)
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_access_log_lines(servers: Servers, access_lines: list[str]) -> None:
    sim = servers.sim(api_key="sk-backend-secret")
    proxy = servers.proxy_for(backends=[{"name": "gpu-0", "url": sim.url, "api_key": "sk-backend-secret"}])
    secret_prompt = "my private prompt text"
    resp = httpx.post(proxy.url + CHAT, json=chat(secret_prompt), headers={"x-request-id": "log-1",
                                                                             "authorization": "Bearer sk-client"})
    assert resp.status_code == 200
    stream_events(proxy.url, chat(secret_prompt, stream=True, max_tokens=4, stream_options={"include_usage": True}),
                  headers={"x-request-id": "log-2"})
    stream_events(proxy.url, chat(secret_prompt, stream=True, max_tokens=4), headers={"x-request-id": "log-3"})
    httpx.post(proxy.url + CHAT, json={**chat(), "model": "nope"}, headers={"x-request-id": "log-4"})
    assert eventually(lambda: len(access_lines) == 4)
    records = {r["request_id"]: r for r in map(orjson.loads, access_lines)}
    usage = resp.json()["usage"]

    plain = records["log-1"]
    assert plain["deployment"] == MODEL and plain["backend"] == "gpu-0" and plain["route"]
    assert plain["status"] == 200 and plain["stream"] is False and plain["ttft_ms"] is None
    assert plain["prompt_tokens"] == usage["prompt_tokens"] and plain["completion_tokens"] == usage["completion_tokens"]
    assert 0 < plain["overhead_ms"] < plain["duration_ms"]
    streamed = records["log-2"]
    assert streamed["stream"] is True and 0 < streamed["ttft_ms"] <= streamed["duration_ms"]
    assert streamed["completion_tokens"] == 4 and streamed["prompt_tokens"] == usage["prompt_tokens"]
    assert records["log-3"]["prompt_tokens"] is None  # no usage event asked for: not parsed out of the stream
    assert records["log-4"]["status"] == 404 and records["log-4"]["deployment"] == "unknown"
    for line in access_lines:
        assert "private prompt" not in line and "sk-" not in line


def test_access_log_sampling_and_switch(servers: Servers, access_lines: list[str]) -> None:
    sim = servers.sim()
    off = servers.proxy_for(sim, logging={"access_log": False})
    none = servers.proxy_for(sim, logging={"sample": 0.0})
    debug = servers.proxy_for(sim, logging={"level": "debug"})  # below the logger's INFO
    for proxy in (off, none, debug):
        for _ in range(3):
            assert httpx.post(proxy.url + CHAT, json=chat()).status_code == 200
    assert access_lines == []
    half = servers.proxy_for(sim, logging={"sample": 0.5})
    for _ in range(200):
        httpx.post(half.url + CHAT, json=chat())
    assert 60 < len(access_lines) < 140


def test_line_writer_batches_whole_lines(tmp_path: Path) -> None:
    from proxy.accesslog import LineWriter

    path = tmp_path / "access.log"
    writer = LineWriter(str(path))
    lines = [orjson.dumps({"request_id": f"r{i}", "pad": "x" * (i % 300)}) + b"\n" for i in range(500)]
    for line in lines:
        writer.line(line)  # no event loop in this thread: written at once
    writer.flush()
    assert path.read_bytes() == b"".join(lines)
    os.close(writer.fd)


def test_a_line_writer_shared_by_two_event_loops_flushes_each_in_time(tmp_path: Path) -> None:
    """Two proxies (event loops in threads) share the access log's writer. The first loop ends
    with its flush timer pending: before, the second loop's lines then waited for a full batch
    (64 KiB to a file) or the process's exit, because a timer was "armed" on a dead loop."""
    import asyncio
    import threading

    from proxy.accesslog import LineWriter

    path = tmp_path / "access.log"
    writer = LineWriter(str(path))
    found: list[int] = []

    async def first() -> None:
        writer.line(b'{"proxy":"a"}\n')  # its loop ends right after: the timer never fires

    async def second() -> None:
        for i in range(100):
            writer.line(b'{"proxy":"b","i":%d}\n' % i)
        deadline = asyncio.get_running_loop().time() + 30  # (a bound: the flush delay is 0.1 s)
        while path.read_bytes().count(b"\n") < 101 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        found.append(path.read_bytes().count(b"\n"))

    for job in (first, second):
        thread = threading.Thread(target=asyncio.run, args=(job(),))
        thread.start()
        thread.join()
    assert found == [101]
    os.close(writer.fd)


def test_usage_tokens() -> None:
    assert usage_tokens(b'{"x":1,"usage": {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": 2}}') == (7, 2)
    assert usage_tokens(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\ndata: [DONE]') == (3, 1)
    assert usage_tokens(b'{"usage":null}') == (None, None)
    assert usage_tokens(b'{"content":"the \\"usage\\": {\\"prompt_tokens\\": 5}"}') == (None, None)
    assert usage_tokens(None) == (None, None)
    # vLLM's compact layout (one match) and the general search agree, up to the window's end
    vllm = b'{"usage":{"prompt_tokens":20,"total_tokens":36,"completion_tokens":16,"prompt_tokens_details":null}}'
    assert usage_tokens(vllm) == (20, 16)
    assert usage_tokens(b'{"usage":{"prompt_tokens":' + b"1" * 1030 + b',"completion_tokens":2}}') == (int(b"1" * 999), None)


def test_usage_tokens_reads_the_compact_layout_as_a_regular_expression_would() -> None:
    """The compact layout is read by hand (proxy/accesslog.py `_compact`): it agrees with the
    expression it replaced on that layout and its broken variants, up to the window's edge."""
    compact = re.compile(rb'"usage":\{"prompt_tokens":(\d+),(?:"total_tokens":\d+,)?"completion_tokens":(\d+)')

    def reference(buf: bytes) -> tuple[int | None, int | None]:  # (the code before the hand reader)
        at = buf.rfind(b'"usage"')
        found = compact.match(buf, at, at + accesslog._USAGE_WINDOW)
        if found is not None:
            return int(found.group(1)), int(found.group(2))
        if accesslog._USAGE.match(buf, at) is None:
            return None, None
        prompt = accesslog._PROMPT.search(buf, at, at + accesslog._USAGE_WINDOW)
        completion = accesslog._COMPLETION.search(buf, at, at + accesslog._USAGE_WINDOW)
        return (int(prompt.group(1)) if prompt else None), (int(completion.group(1)) if completion else None)

    rng = random.Random(7)
    pieces = [b"", b"7", b"120", b"1" * 900, b"x", b","]
    for _ in range(3000):
        prompt, total, completion = (rng.choice(pieces) for _ in range(3))
        body = b'{"usage":{"prompt_tokens":' + prompt + b"," + (
            b'"total_tokens":' + total + b"," if rng.random() < 0.5 else b"") + b'"completion_tokens":' + completion + b"}}"
        body = body[:rng.randrange(20, len(body) + 1)] if rng.random() < 0.2 else body
        assert usage_tokens(body) == reference(body), body[:80]


# --- metrics off --------------------------------------------------------------------------------

def test_metrics_disabled(servers: Servers, access_lines: list[str]) -> None:
    proxy = servers.proxy_for(servers.sim(), metrics={"enabled": False})
    resp = httpx.post(proxy.url + CHAT, json=chat())
    assert resp.status_code == 200 and "x-vllm-proxy-overhead-ms" in resp.headers
    assert stream_events(proxy.url, chat(stream=True), headers={"x-request-id": "off-1"})[-1] == "data: [DONE]"
    assert eventually(lambda: len(access_lines) == 2)
    assert orjson.loads(access_lines[1])["ttft_ms"] > 0  # the access log still times streams
    fams = families(proxy)
    assert not fams["vllm_proxy_requests"].samples
    assert not fams["vllm_proxy_time_to_first_token_seconds"].samples
    assert value(fams, "vllm_proxy_backend_up", backend="gpu-0") == 1


# --- several workers ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_workers_count_every_request(servers: Servers, tmp_path: Path) -> None:
    sim = servers.sim()
    port = free_port()
    config = tmp_path / "proxy.yaml"
    config.write_text(f"backends:\n  - {{name: gpu-0, url: \"{sim.url}\"}}\n"
                      "discovery: {interval_s: 0.2, timeout_s: 1.0}\nlogging: {access_log: false}\n")
    shared = tmp_path / "multiproc"  # an operator-set directory (else `serve` makes a temp one)
    shared.mkdir()
    (shared / "counter_999999.db").write_bytes(b"stale")  # a previous run's file is cleared
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--log-level", "warning", "serve", "--config", str(config),
         "--port", str(port), "--workers", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            try:
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert eventually(ready, timeout=40, interval=0.1), "proxy with 2 workers did not become ready"
        n = 40
        for i in range(n):  # a new connection each time, so both workers get requests
            with httpx.Client(base_url=url) as client:
                assert client.post(CHAT, json=chat(f"r{i}", stream=i % 2 == 0)).status_code == 200
        def scrape() -> dict:
            with httpx.Client(base_url=url) as client:  # a new connection: either worker may answer
                return {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}

        def complete() -> bool:  # workers publish their counts to the shared files every second
            return value(scrape(), "vllm_proxy_requests", "vllm_proxy_requests_total", status_code="200") == n

        assert eventually(complete, timeout=15, interval=0.2)
        for _ in range(6):  # whichever worker answers /metrics, it reports all of them
            fams = scrape()
            assert value(fams, "vllm_proxy_requests", "vllm_proxy_requests_total", status_code="200") == n
            ttft = "vllm_proxy_time_to_first_token_seconds"
            assert value(fams, ttft, ttft + "_count") == n // 2
            duration = "vllm_proxy_request_duration_seconds"
            assert value(fams, duration, duration + "_count") == n
            assert value(fams, "vllm_proxy_in_flight_requests", backend="gpu-0") == 0
            assert value(fams, "vllm_proxy_backend_up", backend="gpu-0") == 1
        # both workers served (each writes its own counter file), and the totals above merged them
        assert len(list(shared.glob("counter_*.db"))) == 2
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- dashboard ----------------------------------------------------------------------------------

def test_grafana_dashboard_uses_these_metrics() -> None:
    import re

    dashboard = orjson.loads((ROOT / "deploy" / "k8s" / "components" / "monitoring" / "vllm-proxy.json").read_bytes())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"vllm_proxy_[a-z_]+", e)}
    known = {f + suffix for f in FAMILIES for suffix in ("", "_total", "_bucket", "_sum", "_count")}
    assert used <= known, used - known
    for family in ("time_to_first_token_seconds", "inter_token_latency_seconds", "overhead_seconds",
                   "routing_decisions", "backend_prefix_cache_hit_ratio", "backend_requests_waiting"):
        assert any(family in e for e in exprs), family
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
