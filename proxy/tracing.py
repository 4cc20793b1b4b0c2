"""Optional OpenTelemetry traces (OTLP over HTTP): a server span per request, a child span for
the routing decision and one for the upstream exchange, whose W3C `traceparent` is sent to the
replica (vLLM started with `--otlp-traces-endpoint` joins the trace).

Off by default, and then free: nothing here is imported, `Runtime.tracing` is None, and the
request path pays one attribute test. On, the policy and the upstream client are wrapped (their
other attributes pass through), so the hot path itself carries no tracing code. Spans go out in
batches from the SDK's own thread. Needs the `tracing` extra (pip install 'vllm-proxy[tracing]').
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from proxy.asgi import Receive, Scope, Send
from proxy.config import TracingConfig

UNTRACED = frozenset(("/health", "/ready", "/metrics"))


class Tracing:
    def __init__(self, config: TracingConfig) -> None:
        try:
            from opentelemetry import context, trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise RuntimeError(
                f"tracing.enabled needs the OpenTelemetry packages (pip install 'vllm-proxy[tracing]'): {exc}"
            ) from None
        self._context = context
        self._trace = trace
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint, headers=dict(config.headers)))
        )
        self.tracer = self.provider.get_tracer("vllm-proxy")
        self.propagator = TraceContextTextMapPropagator()
        self._server = trace.SpanKind.SERVER
        self._client = trace.SpanKind.CLIENT

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter thread."""
        self.provider.shutdown()

    async def serve(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], scope: Scope, receive: Receive,
                    send: Send) -> None:
        """Run one HTTP request under a server span (continuing the client's trace, if it sent one)."""
        if scope["path"] in UNTRACED:
            return await app(scope, receive, send)
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in (b"traceparent", b"tracestate")}
        parent = self.propagator.extract(carrier) if carrier else None
        name = f"{scope['method']} {scope['path']}"
        with self.tracer.start_as_current_span(name, context=parent, kind=self._server) as span:
            span.set_attribute("http.request.method", scope["method"])
            span.set_attribute("url.path", scope["path"])

            async def observed(message: dict) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
                    for key, value in message.get("headers", ()):
                        if key == b"x-request-id":
                            span.set_attribute("vllm_proxy.request_id", value.decode("latin-1"))
                await send(message)

            await app(scope, receive, observed)

    def policy(self, inner: Any) -> "TracedPolicy":
        return TracedPolicy(inner, self)

    def upstream(self, inner: Any) -> "TracedUpstream":
        return TracedUpstream(inner, self)


class TracedPolicy:
    """The routing policy with a `route` span around each decision."""

    def __init__(self, inner: Any, tracing: Tracing) -> None:
        self.inner = inner
        self._tracing = tracing

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def pick(self, candidates, request, route):
        with self._tracing.tracer.start_as_current_span("route") as span:
            backend, reason = await self.inner.pick(candidates, request, route)
            span.set_attribute("vllm_proxy.deployment", route.name)
            span.set_attribute("vllm_proxy.policy", self.inner.name)
            span.set_attribute("vllm_proxy.candidates", len(candidates))
            span.set_attribute("vllm_proxy.backend", backend.name)
            span.set_attribute("vllm_proxy.route_reason", reason)
            return backend, reason


class TracedUpstream:
    """The upstream client with a client span around each exchange; its context goes upstream
    as `traceparent` (and `tracestate`) headers."""

    def __init__(self, inner: Any, tracing: Tracing) -> None:
        self.inner = inner
        self._tracing = tracing

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def exchange(self, backend, endpoint, body, request_id, send, response_headers, progress, rename=None,
                       retryable=False, timeouts=None, head=None):
        tracing = self._tracing
        with tracing.tracer.start_as_current_span(f"upstream {endpoint}", kind=tracing._client) as span:
            span.set_attribute("vllm_proxy.backend", backend.name)
            span.set_attribute("server.address", backend.url)
            carrier: dict[str, str] = {}
            tracing.propagator.inject(carrier)
            extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in carrier.items())
            prefix = (head or backend.heads[endpoint]) + extra
            try:
                status = await self.inner.exchange(backend, endpoint, body, request_id, send, response_headers,
                                                   progress, rename, retryable, timeouts, head=prefix)
            except Exception as exc:
                span.record_exception(exc)
                span.set_status(tracing._trace.Status(tracing._trace.StatusCode.ERROR, str(exc)))
                raise
            span.set_attribute("http.response.status_code", status)
            return status
