"""The small endpoints: model listing, liveness, readiness, metrics, and the 404/405 fallbacks."""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST

from proxy.asgi import Receive, Scope, Send, send_bytes, send_error, send_json
from proxy.errors import ProxyError, model_not_found
from proxy.routing.catalog import Route
from proxy.runtime import Runtime

_CREATED = int(time.time())


def model_card(route: Route) -> dict:
    """OpenAI's model object plus vLLM's `root`/`parent` (adapters name their base deployment)."""
    return {
        "id": route.name,
        "object": "model",
        "created": _CREATED,
        "owned_by": "vllm-proxy",
        "root": route.upstream_id,
        "parent": route.parent,
    }


def _visible(scope: Scope, route: Route | None) -> bool:
    client = scope.get("vllm_proxy.client")
    return route is not None and (client is None or client.may_use(route.name))


async def list_models(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    cards = [model_card(r) for r in rt.catalog.values() if _visible(scope, r)]
    await send_json(send, 200, {"object": "list", "data": cards})


async def get_model(rt: Runtime, scope: Scope, receive: Receive, send: Send, model_id: str) -> None:
    route = rt.catalog.get(model_id)
    if not _visible(scope, route):
        await send_error(send, model_not_found(model_id))
    else:
        await send_json(send, 200, model_card(route))


async def health(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    await send_json(send, 200, {"status": "ok"})


async def ready(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    """200 while some replica is healthy; 503 once SIGTERM started the drain (load balancers stop
    sending while in-flight requests finish, proxy/drain.py)."""
    healthy = [b.name for b in rt.backends if b.healthy]
    ok = bool(healthy) and not rt.draining
    await send_json(send, 200 if ok else 503, {"ready": ok, "draining": rt.draining, "healthy_backends": healthy})


async def metrics(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    await send_bytes(send, 200, rt.metrics.exposition(), CONTENT_TYPE_LATEST.encode())


async def not_found(scope: Scope, send: Send) -> None:
    await send_error(send, ProxyError(404, f"Invalid URL ({scope['method']} {scope['path']})", code="unknown_url"))


async def method_not_allowed(scope: Scope, send: Send, allowed: bytes) -> None:
    error = ProxyError(405, f"Method {scope['method']} is not allowed for {scope['path']}.", code="method_not_allowed")
    await send_error(send, error, [(b"allow", allowed)])
