"""Multimodal policy and media-URL guard: trusted routing, modes, kwargs, limits, forbidden URLs."""
from __future__ import annotations

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.parse import MM_KWARGS, TEXT_PARTS
from tests.conftest import MODEL, Servers, sim_of
from tests.support import CaptureBackend, ServerThread

CHAT = "/v1/chat/completions"


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def mm_body(*parts: dict, **extra) -> dict:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def text_body(i: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 2}


def mixed_fleet(servers: Servers):
    """gpu-0 untrusted, gpu-1 trusted, round robin so text traffic visibly uses both."""
    untrusted, trusted = servers.sim(), servers.sim(trust_request_mm_kwargs=True)
    proxy = servers.proxy({
        "backends": [{"name": "gpu-0", "url": untrusted.url},
                     {"name": "gpu-1", "url": trusted.url, "trust_request_mm_kwargs": True}],
        "routing": {"policy": "round_robin"},
    })
    return proxy, untrusted, trusted


@pytest.fixture
def mixed(servers: Servers):
    return mixed_fleet(servers)


@pytest.fixture(scope="module")
def shared_mixed(module_servers: Servers):
    """`mixed`, shared by the URL checks (they look at answers only, never at replica counters)."""
    return mixed_fleet(module_servers)


def post(proxy: ServerThread, body: dict) -> httpx.Response:
    return httpx.post(proxy.url + CHAT, json=body)


def error_of(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_multimodal_goes_only_to_trusted_and_text_uses_both(mixed) -> None:
    proxy, untrusted, trusted = mixed
    for i in range(10):
        assert post(proxy, mm_body(image(f"https://example.com/{i}.png"))).status_code == 200
        assert post(proxy, mm_body(mm_processor_kwargs={"num_crops": 4})).status_code == 200
    for i in range(10):
        assert post(proxy, text_body(i)).status_code == 200
    assert sim_of(untrusted).stats()["multimodal_requests"] == 0
    assert sim_of(trusted).stats()["multimodal_requests"] == 20
    assert sim_of(untrusted).stats()["requests"][MODEL] >= 3  # text requests still use both
    metrics = httpx.get(proxy.url + "/metrics").text
    assert f'vllm_proxy_multimodal_requests_total{{decision="trusted",deployment="{MODEL}"}} 20.0' in metrics


def test_no_trusted_replica_is_a_clear_400(servers: Servers) -> None:
    proxy = servers.proxy_for(servers.sim())
    error = error_of(post(proxy, mm_body(image("https://example.com/a.png"))))
    assert error["code"] == "multimodal_not_supported"
    assert error["param"] == "messages[0].content[1]"
    assert "--trust-request-mm-kwargs" in error["message"]


def test_reject_mode_and_per_deployment_override(servers: Servers) -> None:
    trusted = servers.sim(trust_request_mm_kwargs=True)
    proxy = servers.proxy({
        "backends": [{"name": "gpu-0", "url": trusted.url, "trust_request_mm_kwargs": True}],
        "deployments": [{"name": "vision", "model": MODEL},
                        {"name": "text-only", "model": MODEL, "multimodal": {"mode": "reject"}}],
    })
    assert post(proxy, {**mm_body(image("https://example.com/a.png")), "model": "vision"}).status_code == 200
    error = error_of(post(proxy, {**mm_body(image("https://example.com/a.png")), "model": "text-only"}))
    assert error["code"] == "multimodal_not_supported"
    assert post(proxy, {**text_body(1), "model": "text-only"}).status_code == 200


def test_allow_mode_forwards_anywhere(servers: Servers) -> None:
    capture = CaptureBackend(MODEL)
    upstream = ServerThread(capture).start()
    servers.running.append(upstream)
    proxy = servers.proxy({"backends": [{"name": "plain", "url": upstream.url}], "multimodal": {"mode": "allow"}})
    assert post(proxy, mm_body(image("https://example.com/a.png"))).status_code == 200
    assert len(capture.bodies) == 1


def test_disallowed_kwargs_rejected_or_stripped(servers: Servers) -> None:
    capture = CaptureBackend(MODEL)
    upstream = ServerThread(capture).start()
    servers.running.append(upstream)
    backends = [{"name": "t", "url": upstream.url, "trust_request_mm_kwargs": True}]
    strict = servers.proxy({"backends": backends, "multimodal": {"allowed_kwargs": ["num_crops"]}})
    error = error_of(post(strict, mm_body(mm_processor_kwargs={"num_crops": 2, "evil": 1})))
    assert (error["code"], error["param"]) == ("mm_kwarg_not_allowed", "mm_processor_kwargs.evil")
    assert post(strict, mm_body(mm_processor_kwargs={"num_crops": 2})).status_code == 200
    stripping = servers.proxy({"backends": backends,
                               "multimodal": {"allowed_kwargs": ["num_crops"], "on_disallowed_kwarg": "strip"}})
    assert post(stripping, mm_body(mm_processor_kwargs={"num_crops": 2, "evil": 1})).status_code == 200
    assert orjson.loads(capture.bodies[-1])["mm_processor_kwargs"] == {"num_crops": 2}
    assert post(stripping, mm_body(mm_processor_kwargs={"evil": 1})).status_code == 200
    assert "mm_processor_kwargs" not in orjson.loads(capture.bodies[-1])


def test_media_limits(servers: Servers) -> None:
    trusted = servers.sim(trust_request_mm_kwargs=True)
    proxy = servers.proxy({
        "backends": [{"name": "t", "url": trusted.url, "trust_request_mm_kwargs": True}],
        "multimodal": {"max_items": {"image": 2}, "max_data_url_bytes": 1000, "max_total_data_bytes": 1500},
    })
    three = [image(f"https://example.com/{i}.png") for i in range(3)]
    error = error_of(post(proxy, mm_body(*three)))
    assert (error["code"], error["param"]) == ("too_many_media_items", "messages[0].content[3]")
    big = "data:image/png;base64," + "A" * 2000
    error = error_of(post(proxy, mm_body(image(big))))
    assert (error["code"], error["param"]) == ("media_too_large", "messages[0].content[1].image_url.url")
    medium = "data:image/png;base64," + "A" * 800
    error = error_of(post(proxy, mm_body(image(medium), image(medium))))
    assert error["code"] == "media_too_large"
    audio = {"type": "input_audio", "input_audio": {"data": "B" * 2000, "format": "wav"}}
    assert error_of(post(proxy, mm_body(audio)))["param"] == "messages[0].content[1].input_audio.data"
    assert post(proxy, mm_body(image(medium))).status_code == 200


FORBIDDEN = [
    "http://169.254.169.254/latest/meta-data/",  # http not allowed by default, and metadata
    "https://169.254.169.254/latest/meta-data/",
    "https://[fd00:ec2::254]/latest/meta-data/",
    "https://metadata.google.internal/computeMetadata/v1/",
    "https://127.0.0.1/a.png", "https://127.1/a.png", "https://127.0.1/a.png", "https://2130706433/a.png",
    "https://0177.0.0.1/a.png", "https://0x7f.0.0.1/a.png", "https://0x7f000001/a.png", "https://017700000001/a.png",
    "https://0/a.png", "https://0.0.0.0/a.png", "https://[::]/a.png", "https://[::1]/a.png",
    "https://[::ffff:127.0.0.1]/a.png", "https://[::ffff:7f00:1]/a.png", "https://[0:0:0:0:0:ffff:a9fe:a9fe]/a.png",
    "https://[::127.0.0.1]/a.png", "https://[64:ff9b::a9fe:a9fe]/a.png", "https://[2002:a9fe:a9fe::]/a.png",
    "https://[fe80::1]/a.png", "https://[fc00::1]/a.png", "https://[ff02::1]/a.png",
    "https://10.0.0.1/a.png", "https://10.1/a.png", "https://172.16.0.1/a.png", "https://192.168.0.1/a.png",
    "https://100.64.0.1/a.png", "https://198.18.0.1/a.png", "https://224.0.0.1/a.png", "https://240.0.0.1/a.png",
    "https://255.255.255.255/a.png", "https://192.0.2.1/a.png",
    "https://localhost/a.png", "https://LOCALHOST./a.png", "https://api.localhost/a.png", "https://db.internal/a.png",
    "https://printer.local/a.png", "https://intranet/a.png", "https://１２７.０.０.１/a.png", "https://127.0.0.1./a.png",
    "https://127.0.0.%31/a.png", "https://user:pass@example.com/a.png", "https://example.com@127.0.0.1/a.png",
    "https://example.com\\@127.0.0.1/a.png", "https://exa mple.com/a.png",
    "file:///etc/passwd", "ftp://example.com/a.png", "gopher://example.com/", "javascript:alert(1)",
    "//example.com/a.png", "example.com/a.png", "https:///a.png", "https://[::1/a.png",
    # an ideographic or half-width full stop is a dot to IDNA (UTS 46): a trailing one too
    "https://localhost\u3002/a.png", "https://metadata.google.internal\uff61/v1/", "https://127.0.0.1\u3002/a.png",
    "https://[64:ff9b:1::a9fe:a9fe]/a.png", "https://[::ffff:0:127.0.0.1]/a.png",  # local NAT64, SIIT-translated
    "https://[v1.x]/a.png",  # IPvFuture: brackets hold an IPv6 address or nothing we fetch
]


@pytest.mark.parametrize("url", FORBIDDEN)
def test_forbidden_media_urls_are_refused(shared_mixed, url: str) -> None:
    proxy, untrusted, trusted = shared_mixed
    error = error_of(post(proxy, mm_body(image(url))))
    assert error["code"] == "media_url_forbidden", error
    assert error["param"] == "messages[0].content[1].image_url.url"


@pytest.mark.parametrize("url", [
    "https://upload.wikimedia.org/wikipedia/commons/a/a9/Example.jpg",
    "https://example.com/a%20b.png?size=large#x",
    "https://8.8.8.8/a.png", "https://[2606:4700:4700::1111]/a.png", "https://EXAMPLE.com./a.png",
    "data:image/png;base64,iVBORw0KGgo=",
])
def test_public_and_data_urls_pass(shared_mixed, url: str) -> None:
    proxy, untrusted, trusted = shared_mixed
    assert post(proxy, mm_body(image(url))).status_code == 200


def test_other_media_part_types_are_guarded(shared_mixed) -> None:
    proxy, *_ = shared_mixed
    for part in (
        {"type": "video_url", "video_url": {"url": "https://10.0.0.1/v.mp4"}},
        {"type": "audio_url", "audio_url": {"url": "https://localhost/a.wav"}},
        {"type": "image_url", "image_url": "https://127.0.0.1/simple-form.png"},
        {"type": "file", "file": {"file_data": "data:application/pdf;base64," + "A" * 30_000_000}},
    ):
        resp = post(proxy, mm_body(part))
        assert resp.status_code in (400, 413)


def test_domain_allowlist_and_dns_check(servers: Servers) -> None:
    trusted = servers.sim(trust_request_mm_kwargs=True)
    proxy = servers.proxy({
        "backends": [{"name": "t", "url": trusted.url, "trust_request_mm_kwargs": True}],
        "multimodal": {"urls": {"allowed_domains": ["example.com"], "resolve_dns": True, "dns_timeout_s": 0.2}},
    })
    assert error_of(post(proxy, mm_body(image("https://example.org/a.png"))))["code"] == "media_url_forbidden"
    # cdn.example.com cannot be resolved here (no network): refused rather than let through
    error = error_of(post(proxy, mm_body(image("https://cdn.example.com/a.png"))))
    assert error["code"] == "media_url_forbidden"


MEDIA_TYPES = ["image_url", "audio_url", "video_url", "input_audio", "file", "image_embeds", "Image_URL", "x"]
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20),
                      st.sampled_from(["https://127.0.0.1/x", "https://example.com/x.png", "data:,x", "file:///x"]))
part_value = st.one_of(json_leaf, st.dictionaries(st.sampled_from(["url", "data", "file_data", "detail"]), json_leaf, max_size=3))
content_part = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", *MEDIA_TYPES]), "text": json_leaf}),
    st.sampled_from(MEDIA_TYPES).flatmap(lambda t: st.fixed_dictionaries({"type": st.just(t), t: part_value})),
    json_leaf,
    st.dictionaries(st.text(max_size=5), json_leaf, max_size=3),
)
message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": st.one_of(st.text(max_size=10), st.lists(content_part, max_size=4), json_leaf),
})
request_extra = st.dictionaries(st.sampled_from(list(MM_KWARGS)), st.one_of(json_leaf, st.dictionaries(st.text(max_size=4), json_leaf, max_size=2)), max_size=2)


@pytest.fixture(scope="module")
def fuzz_target():
    from tests.conftest import Servers as S
    servers = S()
    capture = CaptureBackend(MODEL)
    untrusted = ServerThread(capture).start()
    servers.running.append(untrusted)
    trusted = servers.sim(trust_request_mm_kwargs=True)
    proxy = servers.proxy({
        "backends": [{"name": "plain", "url": untrusted.url},
                     {"name": "trusted", "url": trusted.url, "trust_request_mm_kwargs": True}],
        "routing": {"policy": "round_robin"},
    })
    with httpx.Client(base_url=proxy.url) as client:  # one client: not one (and one SSL context) per example
        yield proxy, capture, client
    servers.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=3), extra=request_extra)
def test_fuzzed_content_never_500_and_never_bypasses(fuzz_target, messages, extra) -> None:
    proxy, capture, client = fuzz_target
    resp = client.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 1, **extra})
    assert resp.status_code < 500, resp.text
    assert set(resp.json()) & {"error", "choices"}
    for body in capture.bodies:  # the untrusted replica only ever saw text-only requests
        data = orjson.loads(body)
        assert not any(data.get(k) is not None for k in MM_KWARGS)
        for m in data["messages"]:
            if isinstance(m.get("content"), list):
                assert all(isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in m["content"])


@pytest.mark.parametrize("extra", [{"input": "x"}, {}])
def test_chat_style_embeddings_are_guarded(shared_mixed, extra: dict) -> None:
    """vLLM's /v1/embeddings also takes `messages` (EmbeddingChatRequest) and fetches their media.
    Before: only `input` was looked at, so `messages` beside it went to vLLM unchecked (and chat
    style embeddings without `input` were refused as incomplete)."""
    proxy, untrusted, trusted = shared_mixed
    body = {"model": MODEL, **extra, "messages": [{"role": "user", "content": [image("https://169.254.169.254/x")]}]}
    error = error_of(httpx.post(proxy.url + "/v1/embeddings", json=body))
    assert (error["code"], error["param"]) == ("media_url_forbidden", "messages[0].content[0].image_url.url")
    body["messages"][0]["content"] = [image("https://example.com/a.png")]
    resp = httpx.post(proxy.url + "/v1/embeddings", json=body)
    if extra:
        assert resp.status_code == 200, resp.text
    else:  # forwarded: the simulator has no chat-style embeddings, its own 400 names `input`, not the proxy's
        assert "x-vllm-proxy-backend" in resp.headers, resp.text
