"""The simulated vLLM replica, served for real and driven with the official openai SDK and httpx."""
from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import socket
import struct
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.sim import SimApp, SimConfig, create_app
from proxy.sim.cli import add_arguments, config_from_args
from proxy.sim.faults import Faults
from tests.support import ServerThread, held, sim_faults

BASE = "meta-llama/Llama-3.1-8B-Instruct"
USER = [{"role": "user", "content": "Say something."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@contextlib.contextmanager
def serve(**config) -> Iterator[tuple[str, SimApp]]:
    config.setdefault("time_scale", 0)
    app = create_app(SimConfig(**config))
    with ServerThread(app) as server:
        yield server.url, app


@pytest.fixture(scope="module")
def fast() -> Iterator[tuple[str, SimApp]]:
    with serve(lora_modules={"sql": "/loras/sql"}) as served:
        yield served


@pytest.fixture
def client(fast) -> openai.OpenAI:
    return openai.OpenAI(base_url=fast[0] + "/v1", api_key="unused", max_retries=0)


def metrics(url: str) -> dict[str, float]:
    """Samples as {'name{label=value,...}': value}, plus bare names for unlabelled lookups."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def raw_request(url: str, path: str, body: dict) -> socket.socket:
    """Send a request on a raw socket (so the test can hang up at any moment)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = orjson.dumps(body)
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


# --- OpenAI surface ---------------------------------------------------------------------------

def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=BASE, messages=USER, max_tokens=5, n=2)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == BASE
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.message.content for c in r.choices)
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens <= 10
    assert u.prompt_tokens_details.cached_tokens >= 0
    again = client.chat.completions.create(model=BASE, messages=USER, max_tokens=5, n=2)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # deterministic


def test_finish_reasons(client):
    r = client.chat.completions.create(model=BASE, messages=USER, max_tokens=40)
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=BASE, messages=USER, max_completion_tokens=4000)  # runs into "EOS"
    assert 64 <= r.usage.completion_tokens < 4000 and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=BASE, messages=USER, max_tokens=600, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 600 and r.choices[0].finish_reason == "length"


def test_chat_streaming_wire_format(fast):
    url, _ = fast
    body = {"model": BASE, "messages": USER, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
            "extra_vllm_field": 1, "top_k": 5, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 4 and all(c["object"] == "chat.completion.chunk" for c in tokens)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert len({c["id"] for c in chunks}) == 1


def test_chat_streaming_sdk_matches_non_streaming(client):
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="sql", messages=USER, max_tokens=7, stream=True) if c.choices)
    assert text == client.chat.completions.create(model="sql", messages=USER, max_tokens=7).choices[0].message.content


async def test_completions_async(fast):
    client = openai.AsyncOpenAI(base_url=fast[0] + "/v1", api_key="x", max_retries=0)
    r = await client.completions.create(model=BASE, prompt=["one two", "three"], max_tokens=3, n=2)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and len(r.choices) == 4
    assert r.usage.completion_tokens == sum(len(c.text.split()) for c in r.choices)
    r = await client.completions.create(model=BASE, prompt=[1, 2, 3, 4], max_tokens=2)
    assert r.usage.prompt_tokens == 4
    chunks = [c async for c in await client.completions.create(model=BASE, prompt="hi", max_tokens=3, stream=True)]
    assert "".join(c.choices[0].text for c in chunks) and chunks[-1].choices[0].finish_reason
    await client.close()


def test_embeddings_base64_default_and_float(fast, client):
    r = client.embeddings.create(model=BASE, input=["hello", "world"])  # the SDK asks for base64
    assert len(r.data) == 2 and len(r.data[0].embedding) == 32
    assert abs(sum(v * v for v in r.data[0].embedding) - 1) < 1e-4 and r.usage.prompt_tokens > 0
    raw = httpx.post(fast[0] + "/v1/embeddings", json={"model": BASE, "input": "hello"}).json()
    assert raw["data"][0]["embedding"] == pytest.approx(r.data[0].embedding, abs=1e-6)
    b64 = httpx.post(fast[0] + "/v1/embeddings",
                     json={"model": BASE, "input": "hello", "encoding_format": "base64"}).json()["data"][0]
    assert struct.unpack("<32f", base64.b64decode(b64["embedding"])) == pytest.approx(raw["data"][0]["embedding"])
    assert len(client.embeddings.create(model=BASE, input=[[1, 2, 3], [4, 5]]).data) == 2


def test_tool_calls(client):
    r = client.chat.completions.create(model=BASE, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=64)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(orjson.loads(call.function.arguments)) == {"city", "days"}
    chunks = list(client.chat.completions.create(
        model=BASE, messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True, max_tokens=64))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert orjson.loads("".join(d.function.arguments for d in deltas)) == orjson.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=BASE, messages=USER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_models_and_lora_admin(fast, client):
    url, app = fast
    assert {m.id: m.parent for m in client.models.list()} == {BASE: None, "sql": BASE}
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "fr", "lora_path": "/loras/fr"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fr' added successfully."
    card = next(m for m in client.models.list().data if m.id == "fr")
    assert card.root == "/loras/fr" and card.parent == BASE and card.owned_by == "vllm"
    assert client.chat.completions.create(model="fr", messages=USER).model == "fr"
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "fr", "lora_path": "/loras/fr"})
    assert again.status_code == 400 and again.json()["error"]["type"] == "BadRequestError"
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/loras/invalid"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "fr"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fr' removed successfully."
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "fr"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="fr", messages=USER)
    stats = httpx.get(url + "/sim/stats").json()
    assert stats["lora_loads"] >= 1 and stats["lora_unloads"] >= 1 and stats["requests"]["fr"] == 1


def test_errors_have_vllm_shape(fast, client):
    url, _ = fast
    r = httpx.post(url + "/v1/chat/completions", json={"model": "gpt-x", "messages": USER})
    assert r.status_code == 404 and r.json() == {"error": {
        "message": "The model `gpt-x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-x", messages=USER)
    for body in (b"{not json", b"[1]", b'{"model": "%s"}' % BASE.encode(),
                 b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
                 b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}'):
        r = httpx.post(url + "/v1/chat/completions", content=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", body
    assert httpx.post(url + "/v1/chat/completions", json={"messages": USER}).json()["model"] == BASE  # vLLM default
    assert httpx.get(url + "/v1/chat/completions").status_code == 405
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/health").content == b""
    assert httpx.get(url + "/version").json() == {"version": "0.31.0-sim"}


def test_cli_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args([
        "--served-model-name", "llama", "--lora-modules", "a=/a", "b=/b", "--max-loras", "2", "--time-scale", "0",
        "--trust-request-mm-kwargs", "--num-gpu-blocks", "64", "--api-key", "k"]))
    assert config.model_id == "llama" and config.lora_modules == {"a": "/a", "b": "/b"} and config.max_loras == 2
    assert config.time_scale == 0 and config.trust_request_mm_kwargs and config.num_gpu_blocks == 64
    assert config.api_key == "k" and config.block_size == SimConfig().block_size


def test_api_key():
    with serve(api_key="s3cret") as (url, _):
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model=BASE, messages=USER).choices


def test_multimodal_gate():
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}]
    with serve() as (url, app):
        r = httpx.post(url + "/v1/chat/completions", json={"model": BASE, "messages": image})
        assert r.status_code == 400 and "--trust-request-mm-kwargs" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions",
                       json={"model": BASE, "messages": USER, "mm_processor_kwargs": {"num_crops": 4}})
        assert r.status_code == 400
        assert app.engine.stats.multimodal == 0
    with serve(trust_request_mm_kwargs=True) as (url, app):
        r = httpx.post(url + "/v1/chat/completions", json={"model": BASE, "messages": image})
        assert r.status_code == 200 and app.engine.stats.multimodal == 1


# --- prefix cache -----------------------------------------------------------------------------

def test_prefix_cache_hits_and_eviction():
    system = {"role": "system", "content": "Tenant A: you are a meticulous assistant. " * 20}
    with serve(num_gpu_blocks=40) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        first = client.chat.completions.create(model=BASE, messages=[system, *USER])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = client.chat.completions.create(model=BASE, messages=[system, {"role": "user", "content": "Other."}])
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached > 0 and cached % 16 == 0 and cached >= first.usage.prompt_tokens - 32
        m = metrics(url)
        assert m["vllm:prefix_cache_hits_total"] == cached
        assert m["vllm:prefix_cache_queries_total"] == first.usage.prompt_tokens + second.usage.prompt_tokens
        # other tenants fill the 40-block budget and push tenant A out (LRU)
        for tenant in "BCD":
            client.chat.completions.create(model=BASE, messages=[
                {"role": "system", "content": f"Tenant {tenant}: you are a meticulous assistant. " * 20}, *USER])
        third = client.chat.completions.create(model=BASE, messages=[system, *USER])
        assert third.usage.prompt_tokens_details.cached_tokens == 0
        assert app.engine.cache.evictions > 0 and len(app.engine.cache) <= 40


def test_prefix_cache_is_per_adapter_and_covers_multi_turn():
    with serve(lora_modules={"a": "/a"}) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        turn1 = [{"role": "user", "content": "Tell me about the sea and the ships upon it. " * 4}]
        r1 = client.chat.completions.create(model=BASE, messages=turn1, max_tokens=40, extra_body={"ignore_eos": True})
        turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "More."}]
        r2 = client.chat.completions.create(model=BASE, messages=turn2)
        # the previous answer was cached too, so more than the first prompt hits
        assert r2.usage.prompt_tokens_details.cached_tokens > r1.usage.prompt_tokens
        r3 = client.chat.completions.create(model="a", messages=turn2)
        assert r3.usage.prompt_tokens_details.cached_tokens == 0


# --- scheduling and latency -------------------------------------------------------------------

async def test_max_loras_makes_other_adapters_wait():
    with serve(lora_modules={"a": "/a", "b": "/b"}, max_loras=1, max_cpu_loras=2, time_scale=1, itl_ms=30,
               prefill_ms_per_token=0) as (url, app):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        kwargs = {"messages": USER, "max_tokens": 10, "extra_body": {"ignore_eos": True}}
        engine = app.engine
        with held(url):  # scheduled requests stay in the batch until released
            first = asyncio.create_task(client.chat.completions.create(model="a", **kwargs))
            await until(lambda: engine.held == 1)
            base = asyncio.create_task(client.chat.completions.create(model=BASE, **kwargs))
            await until(lambda: engine.held == 2)  # (sent together, "b" could arrive first: base would queue behind it)
            second = asyncio.create_task(client.chat.completions.create(model="b", **kwargs))
            # "a" and the base request scheduled, "b" waits for the one LoRA slot
            await until(lambda: engine.held == 2 and len(engine.waiting) == 1)
            assert {r.adapter for r in engine.running} == {"a", None} and [r.adapter for r in engine.waiting] == ["b"]
            info = next(k for k in metrics(url) if k.startswith("vllm:lora_requests_info"))
            assert "running_lora_adapters=a," in info and "waiting_lora_adapters=b" in info and "max_lora=1" in info
            t0 = time.monotonic()
        r_b = await second
        assert time.monotonic() - t0 > 0.15  # released, "b" still waited for "a" to finish its ~0.3 s
        assert (await first).model == "a" and r_b.model == "b" and (await base).model == BASE
        await client.close()


def test_latency_model():
    with serve(time_scale=1, prefill_ms_per_token=3, itl_ms=10) as (url, _):
        body = {"model": BASE, "prompt": [7] * 200, "max_tokens": 5, "ignore_eos": True}
        t0 = time.monotonic()
        assert httpx.post(url + "/v1/completions", json=body).status_code == 200
        cold = time.monotonic() - t0  # 600 ms prefill + 4 x 10 ms
        warm = []
        for _ in range(3):
            t0 = time.monotonic()
            httpx.post(url + "/v1/completions", json=body)
            warm.append(time.monotonic() - t0)  # 8 uncached tokens: 24 ms + 4 x 10 ms
        # a lower bound holds on any machine; a busy one adds to the warm requests' time, but
        # hardly a quarter of a second to the quickest of three
        assert cold > 0.64 and min(warm) < cold / 2
        m = metrics(url)
        assert m["vllm:time_to_first_token_seconds_count"] == 4 and m["vllm:inter_token_latency_seconds_count"] == 16


def test_max_num_seqs_queue_and_kv_usage():
    with serve(max_num_seqs=2, num_gpu_blocks=100) as (url, app), held(url):  # they stay until they leave
        socks = [raw_request(url, "/v1/completions", {"prompt": [1] * 64, "max_tokens": 20, "ignore_eos": True})
                 for _ in range(3)]
        wait_for(lambda: len(app.engine.running) == 2 and len(app.engine.waiting) == 1)
        m = metrics(url)
        assert m["vllm:num_requests_running"] == 2 and m["vllm:num_requests_waiting"] == 1
        assert 0.08 <= m["vllm:kv_cache_usage_perc"] <= 0.2
        socks[2].close()  # the queued one leaves: gone from the queue
        wait_for(lambda: not app.engine.waiting)
        assert len(app.engine.running) == 2
        for s in socks[:2]:
            s.close()
        wait_for(lambda: not app.engine.running)  # held: only an abort ends them
        assert app.engine.stats.aborted == 3 and metrics(url)["vllm:request_success_total{finished_reason=abort}"] == 3


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_prefill_aborts(stream):
    with serve() as (url, app), held(url):  # a prefill that never ends unless the client leaves
        sock = raw_request(url, "/v1/completions", {"model": BASE, "prompt": [3] * 500, "stream": stream})
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # vLLM sends stream headers before scheduling
        wait_for(lambda: app.engine.held == 1)
        sock.close()
        wait_for(lambda: metrics(url)["vllm:num_requests_running"] == 0)
        assert app.engine.stats.aborted == 1 and app.engine.stats.completed == 0


def test_disconnect_mid_stream_aborts():
    with serve(time_scale=1, itl_ms=200) as (url, app):  # 40 s of tokens unless the client leaves
        body = {"model": BASE, "messages": USER, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client() as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        wait_for(lambda: not app.engine.running)
        assert app.engine.stats.aborted == 1
        assert 0 < metrics(url)["vllm:generation_tokens_total"] < 20


# --- metrics and faults -----------------------------------------------------------------------

def test_metric_names(fast, client):
    client.chat.completions.create(model=BASE, messages=USER)
    names = set(metrics(fast[0]))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert name in names, name
    assert any(n.startswith("vllm:request_success_total{finished_reason=") for n in names)
    assert "vllm:cache_config_info{block_size=16,cache_dtype=auto,enable_prefix_caching=True," \
           "gpu_memory_utilization=0.9,num_gpu_blocks=2048}" in names
    assert any(n.startswith("vllm:lora_requests_info{max_lora=1,") for n in names)


def test_independent_registries(fast):
    with serve() as (url, _):
        httpx.post(url + "/v1/completions", json={"prompt": "x"})
        assert metrics(url)["vllm:request_success_total{finished_reason=length}"] + \
            metrics(url)["vllm:request_success_total{finished_reason=stop}"] == 1


def test_faults():
    with serve(lora_modules={"a": "/a"}) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert httpx.post(url + "/sim/faults", json={"nope": 1}).status_code == 400
        httpx.post(url + "/sim/faults", json={"error_rate": 1.0, "error_status": 503})
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=BASE, messages=USER)
        assert err.value.status_code == 503
        httpx.post(url + "/sim/faults", json={"error_rate": 0.0, "slow_ms": 150})
        t0 = time.monotonic()
        client.chat.completions.create(model=BASE, messages=USER)
        assert time.monotonic() - t0 >= 0.15
        httpx.post(url + "/sim/faults", json={"slow_ms": 0, "fail_lora_loads": True})
        assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "/z"}).status_code == 400
        httpx.post(url + "/sim/faults", json={"hang": True})
        for path in ("/health", "/v1/models"):
            with pytest.raises(httpx.ReadTimeout):
                httpx.get(url + path, timeout=0.2)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=0.2)
        wait_for(lambda: not app.engine.running and not app.engine.waiting, 1.0)
        stats = httpx.get(url + "/sim/stats").json()
        assert stats["faults"]["hang"] is True and stats["running"] == 0
        assert httpx.post(url + "/sim/reset").json()["faults"]["hang"] is False
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_hold_gate():
    """The tests' gate: scheduled requests wait before prefill until released, per model if asked."""
    with serve(lora_modules={"a": "/a"}) as (url, app), concurrent.futures.ThreadPoolExecutor(4) as pool:
        engine = app.engine
        assert httpx.post(url + "/sim/faults", json={"hold_only": "a"}).status_code == 400  # a list of names
        sim_faults(url, hold=True, hold_only=["a"])
        held_a = pool.submit(httpx.post, url + "/v1/completions", json={"model": "a", "prompt": "x"}, timeout=30)
        wait_for(lambda: engine.held == 1)
        assert httpx.post(url + "/v1/completions", json={"model": BASE, "prompt": "x"}).status_code == 200  # not held
        assert not held_a.done() and httpx.get(url + "/sim/stats").json()["held"] == 1
        sim_faults(url, hold_only=[BASE])  # "a" leaves the held set: it goes on, hold stays on
        assert held_a.result().status_code == 200
        held_base = pool.submit(httpx.post, url + "/v1/completions", json={"model": BASE, "prompt": "x"}, timeout=30)
        wait_for(lambda: engine.held == 1)
        assert httpx.post(url + "/sim/reset").json()["faults"] == {**Faults().as_dict()}  # reset releases too
        assert held_base.result().status_code == 200 and engine.held == 0


def test_step_pacing():
    """`steps` lets a test pace decoding: at 0 a request waits before its next step."""
    with serve() as (url, app):
        assert httpx.post(url + "/sim/faults", json={"steps": -2}).status_code == 400
        sim_faults(url, steps=0)
        body = {"model": BASE, "prompt": "x", "max_tokens": 3, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            wait_for(lambda: len(app.engine.running) == 1)
            assert next(iter(app.engine.running)).steps_done == 0  # waits before its first step
            sim_faults(url, steps=1)
            assert orjson.loads(next(lines)[6:])["choices"][0]["text"]  # one step
            wait_for(lambda: app.faults.steps == 0)
            assert next(iter(app.engine.running)).steps_done == 1
            sim_faults(url, steps=-1)  # unlimited again: the rest at once
            rest = list(lines)
        assert len(rest) == 3 and rest[-1] == "data: [DONE]" and app.engine.stats.completed == 1
