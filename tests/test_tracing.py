"""OpenTelemetry tracing: spans reach a local OTLP/HTTP receiver, and the upstream request carries
the trace (W3C traceparent) to the replica."""
from __future__ import annotations

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from proxy.forward import Upstream
from proxy.sim.app import read_body
from tests.conftest import MODEL, Servers, eventually
from tests.support import ServerThread


class OtlpReceiver:
    """Accepts OTLP/HTTP protobuf exports and keeps every span."""

    def __init__(self) -> None:
        self.spans: list = []

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scoped in resource.scope_spans:
                self.spans.extend(scoped.spans)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-protobuf")]})
        await send({"type": "http.response.body", "body": b""})


class HeaderBackend:
    """An OpenAI-shaped upstream that records the headers of every POST."""

    def __init__(self) -> None:
        self.headers: list[dict[bytes, bytes]] = []

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] == "GET":
            payload = b'{"object":"list","data":[{"id":"%s","object":"model","parent":null}]}' % MODEL.encode()
        else:
            self.headers.append(dict(scope["headers"]))
            payload = (b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"%s","choices":[{"index":0,'
                       b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}' % MODEL.encode())
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


def start(servers: Servers, app) -> ServerThread:
    server = ServerThread(app).start()
    servers.running.append(server)
    return server


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def test_spans_reach_the_receiver_and_the_trace_goes_upstream(servers: Servers) -> None:
    receiver, backend = OtlpReceiver(), HeaderBackend()
    receiver_url = start(servers, receiver).url
    upstream = start(servers, backend)
    proxy = servers.proxy({"backends": [{"name": "gpu-0", "url": upstream.url}],
                           "tracing": {"enabled": True, "endpoint": receiver_url + "/v1/traces"}})
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT,
                   headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert r.status_code == 200
    assert httpx.post(proxy.url + "/v1/chat/completions", json=CHAT).status_code == 200  # a trace of its own
    assert proxy.server.config.app.runtime.tracing.provider.force_flush(10_000)
    assert eventually(lambda: len(receiver.spans) >= 6, timeout=10)

    ours = [s for s in receiver.spans if s.trace_id.hex() == trace_id]
    by_name = {s.name: s for s in ours}
    assert set(by_name) == {"POST /v1/chat/completions", "route", "upstream /v1/chat/completions"}
    server = by_name["POST /v1/chat/completions"]
    assert server.parent_span_id.hex() == "00f067aa0ba902b7"  # continues the client's trace
    assert by_name["route"].parent_span_id == server.span_id
    upstream_span = by_name["upstream /v1/chat/completions"]
    assert upstream_span.parent_span_id == server.span_id
    attributes = {a.key: a.value for a in upstream_span.attributes}
    assert attributes["vllm_proxy.backend"].string_value == "gpu-0"
    assert attributes["http.response.status_code"].int_value == 200

    sent = backend.headers[0][b"traceparent"].decode()
    assert sent == f"00-{trace_id}-{upstream_span.span_id.hex()}-01"  # the replica joins under the upstream span
    other = backend.headers[1][b"traceparent"].decode()
    assert other.split("-")[1] != trace_id
    assert {s.trace_id.hex() for s in receiver.spans} == {trace_id, other.split("-")[1]}


def test_health_and_metrics_are_not_traced(servers: Servers) -> None:
    receiver = OtlpReceiver()
    receiver_url = start(servers, receiver).url
    proxy = servers.proxy_for(servers.sim(), tracing={"enabled": True, "endpoint": receiver_url + "/v1/traces"})
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(proxy.url + path).status_code == 200
    assert httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200
    assert proxy.server.config.app.runtime.tracing.provider.force_flush(10_000)
    assert eventually(lambda: len(receiver.spans) >= 3, timeout=10)
    assert all(s.name not in ("GET /health", "GET /ready", "GET /metrics") for s in receiver.spans)


def test_off_by_default_nothing_wrapped(servers: Servers) -> None:
    proxy = servers.proxy_for(servers.sim())
    rt = proxy.server.config.app.runtime
    assert rt.tracing is None
    assert type(rt.upstream) is Upstream and not hasattr(rt.policy, "inner")
    assert httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200


async def test_reload_turns_tracing_on_and_off_around_the_same_client() -> None:
    from proxy.app import ProxyApp
    from proxy.config import parse_config
    from proxy.tracing import TracedUpstream

    base = {"backends": [{"name": "gpu-0", "url": "http://127.0.0.1:9", "models": [MODEL]}],
            "discovery": {"interval_s": 60, "timeout_s": 0.2}}
    app = ProxyApp(parse_config(base))
    await app.runtime.start()
    client = app.runtime.upstream
    try:
        await app.apply(parse_config({**base, "tracing": {"enabled": True, "endpoint": "http://127.0.0.1:9/v1/traces"}}))
        traced = app.runtime.upstream
        assert isinstance(traced, TracedUpstream) and traced.inner is client and traced.session is client.session
        assert app.runtime.policy.inner.name == "prefix_affinity"
        await app.apply(parse_config(base))
        assert app.runtime.upstream is client and app.runtime.tracing is None
    finally:
        await app.runtime.stop()
        await client.close()  # after a reload the current Runtime does not own the process-wide client
