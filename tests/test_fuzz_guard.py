"""Property tests of the request parser and the media guard, without servers (so thousands of cases).

The guard is checked against an independent model of what vLLM's chat parser fetches
(vllm/entrypoints/chat_utils.py: MM_PARSER_MAP and `_parse_chat_message_content_mm_part`): for
any request the proxy lets through, every URL vLLM would read must be one of the safe ones.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.config import parse_config
from proxy.errors import ProxyError
from proxy.multimodal import MultimodalGate
from proxy.parse import CHAT, COMPLETIONS, EMBEDDINGS, parse_request
from proxy.urlguard import Forbidden, check_url

SAFE = ["https://example.com/a.png", "https://8.8.8.8/x.jpg", "data:image/png;base64,iVBORw0KGgo=",
        "DATA:image/png;base64,AAAA", "https://EXAMPLE.org./b.png"]
BAD = ["http://169.254.169.254/latest/meta-data/", "https://169.254.169.254/", "https://127.1/", "https://0x7f.0.0.1/",
       "https://[::ffff:127.0.0.1]/", "https://kubernetes.default.svc/", "https://metadata/", "https://db.internal/",
       "file:///etc/passwd", "HTTPS://10.0.0.1/", "https://redis.ns.svc.cluster.local/", "https://localhost./",
       "https://１２７.０.０.１/", "gopher://example.com/", " https://127.0.0.1/"]
URL = st.sampled_from(SAFE + BAD)
URL_KEYS = ["image_url", "audio_url", "video_url"]
TYPES = ["text", "input_text", "image_url", "input_image", "audio_url", "video_url", "input_audio", "image_embeds",
         "audio_embeds", "video_embeds", "prompt_embeds", "tool_reference", "thinking", "refusal", "file",
         "Image_URL", "image", "input_file", "x"]

url_value = st.one_of(URL, st.fixed_dictionaries({"url": URL}), st.fixed_dictionaries({"url": URL, "detail": st.just("auto")}),
                      st.none(), st.integers(-5, 5), st.lists(URL, max_size=2))
part = st.builds(
    lambda t, uuid, extra, text: {**({"type": t} if t is not None else {}), **({"uuid": uuid} if uuid is not None else {}),
                                  "text": text, **extra},
    st.one_of(st.sampled_from(TYPES), st.none()),
    st.one_of(st.none(), st.just("u-1"), st.integers(-5, 5)),
    st.dictionaries(st.sampled_from(URL_KEYS + ["input_audio", "image_embeds", "tool_reference", "data"]), url_value, max_size=3),
    st.text(max_size=5),
)
content = st.one_of(st.text(max_size=5), st.lists(st.one_of(part, st.text(max_size=3)), min_size=1, max_size=4))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                           "content": content}), min_size=1, max_size=3)

VLLM_TYPES = {"text", "thinking", "input_text", "output_text", "input_image", "image_url", "image_embeds",
              "audio_embeds", "prompt_embeds", "image_pil", "audio_url", "input_audio", "refusal", "video_url",
              "tool_reference", "video_embeds"}


def _url_of(value) -> object:
    return value.get("url") if isinstance(value, dict) else value


def vllm_fetches(p) -> list:
    """The URLs vLLM's chat parser would hand to its media connector for one content part (a
    superset: shapes its pydantic validation would refuse count as fetched too)."""
    if not isinstance(p, dict):
        return []
    kind, uuid = p.get("type"), p.get("uuid")
    if isinstance(kind, str) and kind in VLLM_TYPES and uuid is None:
        if kind == "input_image":
            return [_url_of(p.get("image_url"))]
        if kind in URL_KEYS:
            return [_url_of(p.get(kind))]
        return []
    if kind is None or uuid is not None:
        for key in ("image_url", "image_pil", "image_embeds", "audio_embeds", "prompt_embeds", "audio_url",
                    "input_audio", "video_url", "tool_reference"):
            if key in p and (key != "input_audio" or p[key] is not None):
                return [_url_of(p[key])] if key in URL_KEYS else []
    return []


CONFIG = parse_config({"backends": [{"name": "t", "url": "http://127.0.0.1:1", "trust_request_mm_kwargs": True}],
                       "multimodal": {"urls": {"schemes": ["https", "data"]}}})
ROUTE = SimpleNamespace(name="d", backends=(SimpleNamespace(config=SimpleNamespace(trust_request_mm_kwargs=True)),))


def admitted(body: dict) -> bool:
    """Whether the proxy forwards `body` (parse + multimodal gate); any other outcome is a 4xx."""
    try:
        parsed = parse_request(CHAT, orjson.dumps(body))
        if parsed.multimodal:
            asyncio.run(MultimodalGate(CONFIG).check(parsed, ROUTE))  # type: ignore[arg-type]
    except ProxyError as err:
        assert 400 <= err.status < 500, err
        return False
    return True


@settings(max_examples=1500, deadline=None)
@given(messages=messages)
def test_nothing_vllm_would_fetch_from_an_admitted_request_is_unsafe(messages) -> None:
    if not admitted({"model": "m", "messages": messages}):
        return
    for message in messages:
        parts = message["content"] if isinstance(message["content"], list) else []
        for p in parts:
            for url in vllm_fetches(p):
                assert url is None or url in SAFE, (p, url)


@settings(max_examples=1500, deadline=None)
@given(body=st.one_of(st.binary(max_size=200), st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(
        st.sampled_from(["model", "messages", "prompt", "input", "stream", "stream_options", "role", "content",
                         "type", "text", "image_url", "uuid", "mm_processor_kwargs"]), inner, max_size=5)),
    max_leaves=20).map(orjson.dumps)), endpoint=st.sampled_from([CHAT, COMPLETIONS, EMBEDDINGS]))
def test_the_request_parser_answers_anything_with_a_result_or_a_4xx(body: bytes, endpoint: str) -> None:
    try:
        parsed = parse_request(endpoint, body)
    except ProxyError as err:
        assert 400 <= err.status < 500
        assert orjson.loads(err.body())["error"]["message"]
    else:
        assert isinstance(parsed.model, str) and parsed.model


@settings(max_examples=3000, deadline=None)
@given(url=st.one_of(st.text(max_size=40), st.builds(lambda s, h: s + h, st.sampled_from(["https://", "http://", "HTTPS://", "data:"]),
                                                     st.text(max_size=30))))
@example(url="HTTPS://-1")  # found by this test: int() read "-1" as a loose IPv4 number
@example(url="https://1_0")
def test_the_url_guard_never_crashes(url: str) -> None:
    try:
        check_url(url, frozenset(("https", "data")))
    except Forbidden:
        pass


@settings(max_examples=1000, deadline=None)
@given(a=st.integers(0, 255), b=st.integers(0, 255), spelling=st.sampled_from(["dotted", "int", "hex", "octal", "mapped"]),
       private=st.sampled_from([10, 127, 169, 172, 192, 100, 0]))
def test_private_addresses_are_refused_in_every_spelling(a: int, b: int, spelling: str, private: int) -> None:
    second = {169: 254, 172: 16, 192: 168, 100: 64}.get(private, a)
    octets = [private, second, a, b]
    number = int.from_bytes(bytes(octets), "big")
    host = {"dotted": ".".join(map(str, octets)), "int": str(number), "hex": hex(number),
            "octal": ".".join("0%o" % o for o in octets), "mapped": "[::ffff:%s]" % ".".join(map(str, octets))}[spelling]
    try:
        check_url(f"https://{host}/x", frozenset(("https",)))
    except Forbidden:
        return
    raise AssertionError(f"{host} passed")
