"""The Responses API through the proxy: stateful follow-ups reach the replica that holds the
conversation, across proxies sharing Redis; streaming named events; retrieve; cancel; owner down."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.conftest import MODEL, Servers, eventually, sim_of


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0)


def three_proxies(servers: Servers, redis_url: str):
    sims = [servers.sim() for _ in range(3)]
    backends = [{"name": f"gpu-{i}", "url": s.url} for i, s in enumerate(sims)]
    proxies = [servers.proxy({"backends": backends, "redis": {"url": redis_url}}) for _ in range(3)]
    for proxy in proxies:  # every proxy's subscriber listens before the test starts
        owners = proxy.server.config.app.runtime.response_owners
        assert eventually(lambda: owners.subscribed is not None and owners.subscribed.is_set(), timeout=10)
    return sims, proxies


def owner_of(sims, response_id: str) -> int:
    holders = [i for i, s in enumerate(sims) if response_id in sim_of(s).responses.store]
    assert len(holders) == 1
    return holders[0]


def test_chain_of_eight_across_three_proxies_and_retrieve_everywhere(servers: Servers, redis_url: str) -> None:
    sims, proxies = three_proxies(servers, redis_url)
    clients = [client_for(p.url) for p in proxies]
    previous = None
    ids = []
    for turn in range(8):
        client = clients[turn % 3]
        resp = client.responses.create(model=MODEL, input=f"Turn {turn}: go on.", instructions="Be terse.",
                                       previous_response_id=previous, max_output_tokens=4)
        assert resp.status in ("completed", "incomplete")
        assert resp.output_text
        assert resp.previous_response_id == previous
        ids.append(resp.id)
        previous = resp.id
    owners = {owner_of(sims, i) for i in ids}
    assert len(owners) == 1  # the whole conversation stayed on the replica that holds it
    # the last response's usage counts every earlier turn: the owner had the whole conversation
    last = clients[0].responses.retrieve(ids[-1])
    first = clients[0].responses.retrieve(ids[0])
    assert last.usage.input_tokens > first.usage.input_tokens + 7 * 4
    for client in clients:
        for response_id in (ids[0], ids[-1]):
            got = client.responses.retrieve(response_id)
            assert got.id == response_id and got.output_text


def test_streaming_yields_every_event_and_follow_up_streams(servers: Servers, redis_url: str) -> None:
    sims, proxies = three_proxies(servers, redis_url)
    first = client_for(proxies[0].url).responses.create(model=MODEL, input="Hello", max_output_tokens=5)
    stream = client_for(proxies[1].url).responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=5, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds.count("response.output_text.delta") == 5
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.previous_response_id == first.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.output_text == text
    assert owner_of(sims, done.id) == owner_of(sims, first.id)
    # the streamed response is retrievable through another proxy
    assert client_for(proxies[2].url).responses.retrieve(done.id).output_text == text


def test_ttft_is_timed_on_text_deltas(servers: Servers) -> None:
    """The first token is the first `response.output_text.delta`, not `response.created` (which vLLM
    sends before prefill): with a slow prefill the time to first token includes it."""
    sim = servers.sim(time_scale=1.0, itl_ms=5.0, prefill_ms_per_token=20.0)
    proxy = servers.proxy_for(sim)
    stream = client_for(proxy.url).responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True)
    assert sum(e.type == "response.output_text.delta" for e in stream) == 4
    prompt_tokens = sim_of(sim).engine.stats.prefix_queries or 5
    metrics = {line.split("{")[0]: float(line.split()[-1]) for line in httpx.get(proxy.url + "/metrics").text.splitlines()
               if line.startswith(("vllm_proxy_time_to_first_token_seconds_", "vllm_proxy_inter_token_latency_seconds_count"))}
    assert metrics["vllm_proxy_time_to_first_token_seconds_count"] == 1.0
    assert metrics["vllm_proxy_time_to_first_token_seconds_sum"] >= 0.02 * 5  # at least 5 prompt tokens' prefill
    assert metrics["vllm_proxy_inter_token_latency_seconds_count"] >= 1.0
    assert prompt_tokens


def test_owner_down_is_a_clear_410(servers: Servers, redis_url: str) -> None:
    sims, proxies = three_proxies(servers, redis_url)
    resp = client_for(proxies[0].url).responses.create(model=MODEL, input="Remember me", max_output_tokens=3)
    owner = owner_of(sims, resp.id)
    sims[owner].stop()
    for proxy in proxies:
        rt = proxy.server.config.app.runtime
        assert eventually(lambda: not rt.backends[owner].healthy, timeout=10)
    for proxy in proxies[1:]:
        client = client_for(proxy.url)
        with pytest.raises(openai.APIStatusError) as info:
            client.responses.create(model=MODEL, input="Still there?", previous_response_id=resp.id)
        assert info.value.status_code == 410
        assert info.value.body["code"] == "response_owner_unavailable"
        assert f"gpu-{owner}" in info.value.body["message"]
        with pytest.raises(openai.APIStatusError) as info:
            client.responses.retrieve(resp.id)
        assert info.value.status_code == 410
    # a new conversation still works on the replicas that are up
    assert client_for(proxies[1].url).responses.create(model=MODEL, input="Fresh start", max_output_tokens=2).id


def test_unknown_response_is_404_without_redis(servers: Servers) -> None:
    sims = [servers.sim(), servers.sim()]
    proxy = servers.proxy_for(*sims)
    client = client_for(proxy.url)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_doesnotexist")
    assert info.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_doesnotexist")
    assert sum(sim_of(s).stats()["requests"][MODEL] for s in sims) == 0


def test_a_proxy_without_records_finds_the_owner_by_asking(servers: Servers) -> None:
    """No Redis: a follow-up through a second proxy still reaches the owner (probed once, then known)."""
    sims = [servers.sim() for _ in range(3)]
    backends = [{"name": f"gpu-{i}", "url": s.url} for i, s in enumerate(sims)]
    a, b = (servers.proxy({"backends": backends}) for _ in range(2))
    first = client_for(a.url).responses.create(model=MODEL, input="Hello there", max_output_tokens=3)
    second = client_for(b.url).responses.create(model=MODEL, input="More", previous_response_id=first.id,
                                                max_output_tokens=3)
    assert owner_of(sims, second.id) == owner_of(sims, first.id)
    assert b.server.config.app.runtime.response_owners.known(second.id)[0] == f"gpu-{owner_of(sims, first.id)}"


def test_background_response_and_cancel(servers: Servers) -> None:
    sim = servers.sim(time_scale=1.0, itl_ms=50.0)
    proxy = servers.proxy_for(sim)
    client = client_for(proxy.url)
    resp = client.responses.create(model=MODEL, input="Long story", background=True, max_output_tokens=200)
    assert resp.status in ("queued", "in_progress")
    cancelled = client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(resp.id).status == "cancelled"
    sync = client.responses.create(model=MODEL, input="Short", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):  # vLLM: "Cannot cancel a synchronous response."
        client.responses.cancel(sync.id)


def test_new_conversations_use_prefix_affinity(servers: Servers) -> None:
    sims = [servers.sim() for _ in range(3)]
    proxy = servers.proxy_for(*sims)
    client = client_for(proxy.url)
    instructions = "You are the support agent of ACME. " * 40
    ids = [client.responses.create(model=MODEL, instructions=instructions, input=f"Question {i}",
                                   max_output_tokens=2).id for i in range(6)]
    assert len({owner_of(sims, i) for i in ids}) == 1


def test_multimodal_parts_pass_the_policy_and_url_guard(servers: Servers) -> None:
    plain, trusted = servers.sim(), servers.sim(trust_request_mm_kwargs=True)
    proxy = servers.proxy({"backends": [{"name": "plain", "url": plain.url},
                                        {"name": "trusted", "url": trusted.url, "trust_request_mm_kwargs": True}]})
    client = client_for(proxy.url)

    def ask(url: str):
        return client.responses.create(model=MODEL, max_output_tokens=2, input=[{
            "role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                        {"type": "input_image", "image_url": url}]}])

    for _ in range(3):
        assert ask("https://example.com/cat.png").id
    assert sim_of(trusted).stats()["multimodal_requests"] == 3 and sim_of(plain).stats()["multimodal_requests"] == 0
    for url in ("http://169.254.169.254/latest/meta-data", "https://127.0.0.1/x.png", "file:///etc/passwd"):
        with pytest.raises(openai.BadRequestError) as info:
            ask(url)
        assert info.value.body["code"] == "media_url_forbidden"
        assert info.value.body["param"].startswith("input[0].content[1]")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_file", "file_url": "http://10.0.0.1/secret.pdf"}]}])
    assert info.value.body["code"] == "media_url_forbidden"
    # a tool's output: vLLM makes `output` a tool message's content, and fetches its media too
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=[
            {"role": "user", "content": "hi"},
            {"type": "function_call_output", "call_id": "c1",
             "output": [{"type": "input_image", "image_url": "https://169.254.169.254/latest/meta-data"}]}])
    assert (info.value.body["code"], info.value.body["param"]) == ("media_url_forbidden", "input[1].output[0].image_url")


@pytest.mark.parametrize("body, status, code, param", [
    (b"{not json", 400, "invalid_json", None),
    (b"[]", 400, "invalid_type", None),
    (b'{"input": "hi"}', 400, "missing_required_parameter", "model"),
    (b'{"model": "nope", "input": "hi"}', 404, "model_not_found", "model"),
    (b'{"model": "%s"}' % MODEL.encode(), 400, "missing_required_parameter", "input"),
    (b'{"model": "%s", "input": 5}' % MODEL.encode(), 400, "invalid_type", "input"),
    (b'{"model": "%s", "input": [7]}' % MODEL.encode(), 400, "invalid_type", "input[0]"),
    (b'{"model": "%s", "input": "x", "stream": "yes"}' % MODEL.encode(), 400, "invalid_type", "stream"),
    (b'{"model": "%s", "input": "x", "instructions": 3}' % MODEL.encode(), 400, "invalid_type", "instructions"),
    (b'{"model": "%s", "input": "x", "previous_response_id": "a b\\r\\n"}' % MODEL.encode(), 400, "invalid_value",
     "previous_response_id"),
])
def test_bad_create_bodies(fleet, body: bytes, status: int, code: str, param: str | None) -> None:
    proxy, sims = fleet
    r = httpx.post(proxy.url + "/v1/responses", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == param
    assert sum(sim_of(s).stats()["requests"][MODEL] for s in sims) == 0


def test_bad_retrieve_requests(fleet) -> None:
    proxy, _ = fleet
    r = httpx.get(proxy.url + "/v1/responses/bad%20id")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    r = httpx.post(proxy.url + "/v1/responses/resp_x")
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    r = httpx.get(proxy.url + "/v1/responses/resp_x/cancel")
    assert r.status_code == 405


def test_concurrent_chains_keep_their_owners(servers: Servers, redis_url: str) -> None:
    sims, proxies = three_proxies(servers, redis_url)
    errors: list[BaseException] = []

    def chain(k: int) -> None:
        try:
            previous = None
            for turn in range(4):
                client = client_for(proxies[(k + turn) % 3].url)
                previous = client.responses.create(model=MODEL, input=f"chain {k} turn {turn}",
                                                   previous_response_id=previous, max_output_tokens=2).id
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=chain, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors


def test_keys_limited_to_a_deployment_cannot_reach_other_deployments_responses(servers: Servers, monkeypatch) -> None:
    """Also with upstream keys: retrievals and follow-ups carry the replica's --api-key."""
    monkeypatch.setenv("KEY_A", "key-a")
    monkeypatch.setenv("KEY_B", "key-b")
    sim = servers.sim(api_key="upstream-secret")
    proxy = servers.proxy({
        "backends": [{"name": "gpu-0", "url": sim.url, "api_key": "upstream-secret", "models": [MODEL]}],
        "deployments": [{"name": "private", "model": MODEL}, {"name": "public", "model": MODEL}],
        "auth": {"keys": [{"name": "a", "key_env": "KEY_A"},
                          {"name": "b", "key_env": "KEY_B", "deployments": ["public"]}]},
    })
    a = openai.OpenAI(base_url=proxy.url + "/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=proxy.url + "/v1", api_key="key-b", max_retries=0)
    secret = a.responses.create(model="private", input="a secret", max_output_tokens=2)
    assert secret.model == "private"
    assert a.responses.retrieve(secret.id).model == "private"  # the upstream id is renamed on the way back
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(secret.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(model="public", input="tell me", previous_response_id=secret.id)
    mine = b.responses.create(model="public", input="hello", max_output_tokens=2)
    assert b.responses.create(model="public", input="more", previous_response_id=mine.id, max_output_tokens=2).id


async def test_the_id_is_found_across_a_chunk_boundary_and_not_in_other_fields() -> None:
    from types import SimpleNamespace

    from proxy.responses import Create

    recorded = []
    rt = SimpleNamespace(response_owners=SimpleNamespace(remember=lambda *a: recorded.append(a)))
    spec = Create()
    spec.backend, spec.deployment = SimpleNamespace(name="gpu-1"), "llama"
    sent = []

    async def send(message: dict) -> None:
        sent.append(message)

    watched = spec.watch(rt, send)
    body = (b'event: response.created\ndata: {"response":{"previous_response_id":"resp_old","id":"resp_abc123",'
            b'"object":"response"},"type":"response.created"}\n\n')
    cut = body.index(b"resp_abc") + 6
    await watched({"type": "http.response.start", "status": 200, "headers": []})
    await watched({"type": "http.response.body", "body": body[:cut], "more_body": True})
    assert recorded == []
    await watched({"type": "http.response.body", "body": body[cut:], "more_body": True})
    assert recorded == [("resp_abc123", "gpu-1", "llama")]
    assert b"".join(m.get("body", b"") for m in sent) == body  # relayed untouched


def test_paths_vllm_does_not_serve_are_404(fleet) -> None:
    proxy, _ = fleet
    for path in ("/v1/responses/resp_x/input_items", "/v1/responses/", "/v1/responses//cancel"):
        r = httpx.get(proxy.url + path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url", path


def test_redis_unreachable_conversations_still_reach_their_owner(servers: Servers) -> None:
    """Records cannot be shared: each proxy keeps its own, and finds the others' by asking the replicas."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    sims = [servers.sim() for _ in range(3)]
    backends = [{"name": f"gpu-{i}", "url": s.url} for i, s in enumerate(sims)]
    proxies = [servers.proxy({"backends": backends, "redis": {"url": dead}}) for _ in range(2)]
    previous = None
    ids = []
    for turn in range(4):
        client = client_for(proxies[turn % 2].url)
        previous = client.responses.create(model=MODEL, input=f"turn {turn}", previous_response_id=previous,
                                           max_output_tokens=2).id
        ids.append(previous)
    assert len({owner_of(sims, i) for i in ids}) == 1
    assert client_for(proxies[1].url).responses.retrieve(ids[0]).id == ids[0]


async def test_async_sdk_streams_a_follow_up(fleet) -> None:
    proxy, sims = fleet
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="test", max_retries=0)
    first = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    stream = await client.responses.create(model=MODEL, input="Go on", previous_response_id=first.id,
                                           max_output_tokens=3, stream=True)
    kinds = [event.type async for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 3
    await client.close()


def test_client_leaving_mid_stream_aborts_the_replica_request(servers: Servers) -> None:
    sim = servers.sim(time_scale=1.0, itl_ms=50.0)
    proxy = servers.proxy_for(sim)
    body = {"model": MODEL, "input": "Tell me everything", "max_output_tokens": 200, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/responses", json=body, timeout=30) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 2:
                break
    assert eventually(lambda: sim_of(sim).stats()["aborted"] == 1, timeout=10)
    assert sim_of(sim).stats()["completed"] == 0
