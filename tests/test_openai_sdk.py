"""The official openai SDK against the proxy: sync and async, streaming and not, tools, errors."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import MODEL, Servers, sim_of

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


@pytest.fixture
def fleet(shared_fleet):
    """These tests only read answers: one fleet for all of them (a local override of conftest's)."""
    return shared_fleet


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0)


def test_models_list_and_retrieve(fleet) -> None:
    client = client_for(fleet[0].url)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_sync_non_streaming(fleet) -> None:
    client = client_for(fleet[0].url)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.usage.completion_tokens == 5
    assert resp.choices[0].finish_reason == "length"


def test_chat_sync_streaming_with_usage(fleet) -> None:
    client = client_for(fleet[0].url)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


async def test_chat_async_streaming_and_not(fleet) -> None:
    client = openai.AsyncOpenAI(base_url=fleet[0].url + "/v1", api_key="test", max_retries=0)
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert resp.usage.completion_tokens == 3
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True)
    pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) == 4
    await client.close()


def test_tool_calls_pass_through(fleet) -> None:
    client = client_for(fleet[0].url)
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=True)
    names = [tc.function.name for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or []) if tc.function and tc.function.name]
    assert names == ["get_weather"]


def test_completions_and_embeddings(fleet) -> None:
    client = client_for(fleet[0].url)
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert comp.object == "text_completion" and comp.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True) if c.choices)
    assert streamed
    emb = client.embeddings.create(model=MODEL, input=["a", "b"])  # the SDK asks for base64
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    floats = client.embeddings.create(model=MODEL, input="a", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(emb.data[0].embedding, rel=1e-6)  # base64 is float32


def test_sdk_exceptions(fleet) -> None:
    client = client_for(fleet[0].url)
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="missing", messages=MESSAGES)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model=MODEL, messages="not a list")  # type: ignore[arg-type]
    assert br.value.param == "messages"


def test_deployment_names_map_to_upstream_model_and_adapter(servers: Servers) -> None:
    base, lora = servers.sim(), servers.sim(lora_modules={"sql-lora": "/adapters/sql"})
    proxy = servers.proxy_for(base, lora, deployments=[
        {"name": "llama-8b", "model": MODEL},
        {"name": "sql", "model": MODEL, "adapter": "sql-lora"},
    ])
    client = client_for(proxy.url)
    cards = {m.id: m for m in client.models.list()}
    assert set(cards) == {"llama-8b", "sql"}
    assert cards["sql"].model_extra["parent"] == "llama-8b"
    for _ in range(4):
        assert client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=2).model == "sql"
        chunks = client.chat.completions.create(model="llama-8b", messages=MESSAGES, max_tokens=2, stream=True)
        assert {c.model for c in chunks} == {"llama-8b"}
    assert sim_of(base).stats()["requests"].get("sql-lora", 0) == 0
    assert sim_of(lora).stats()["requests"]["sql-lora"] == 4
    assert sim_of(base).stats()["requests"].get(MODEL, 0) + sim_of(lora).stats()["requests"].get(MODEL, 0) == 4


def test_discovery_serves_every_model_and_adapter(servers: Servers) -> None:
    proxy = servers.proxy_for(servers.sim(), servers.sim(lora_modules={"sql-lora": "/adapters/sql"}))
    data = httpx.get(proxy.url + "/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {MODEL, "sql-lora"}
    assert by_id["sql-lora"]["parent"] == MODEL
    # Tokios-style base URL without /v1 works too
    assert httpx.get(proxy.url + "/models").json()["data"] == data
