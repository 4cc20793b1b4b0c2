"""The small endpoints (model listing, liveness, readiness, metrics) as Starlette endpoints, and the
one exception handler that answers every error of the routed endpoints with an OpenAI envelope
(404 and 405 with `Allow` included). proxy/app.py declares the routes."""
from __future__ import annotations

import time
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.asgi import Headers
from proxy.errors import ProxyError, model_not_found
from proxy.routing.catalog import Route
from proxy.runtime import Runtime

_CREATED = int(time.time())
RUNTIME = "vllm_proxy.runtime"  # scope key: the Runtime the request started on (proxy/app.py)


class Raw(Response):
    """A complete body with exactly these headers (content-type, content-length, extra): the same
    bytes proxy/asgi.py's send_bytes writes, without Starlette's header assembly."""

    def __init__(self, status: int, body: bytes, content_type: bytes = b"application/json", headers: Headers = ()) -> None:
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *headers]


def json(status: int, data: Any) -> Raw:
    return Raw(status, orjson.dumps(data))


def error(err: ProxyError, headers: Headers = ()) -> Raw:
    return Raw(err.status, err.body(), headers=[*err.headers, *headers])


def runtime(request: Request) -> Runtime:
    return request.scope[RUNTIME]


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


def _visible(request: Request, route: Route | None) -> bool:
    client = request.scope.get("vllm_proxy.client")
    return route is not None and (client is None or client.may_use(route.name))


async def list_models(request: Request) -> Response:
    cards = [model_card(r) for r in runtime(request).catalog.values() if _visible(request, r)]
    return json(200, {"object": "list", "data": cards})


async def get_model(request: Request) -> Response:
    """`/v1/models/{id}` (ids may contain slashes, e.g. meta-llama/Llama-3.1-8B-Instruct)."""
    model_id = request.path_params["model_id"]
    if not model_id:
        raise HTTPException(404)
    route = runtime(request).catalog.get(model_id)
    if not _visible(request, route):
        raise model_not_found(model_id)
    return json(200, model_card(route))


async def health(request: Request) -> Response:
    return json(200, {"status": "ok"})


async def ready(request: Request) -> Response:
    """200 while some replica is healthy; 503 once SIGTERM started the drain (load balancers stop
    sending while in-flight requests finish, proxy/drain.py)."""
    rt = runtime(request)
    healthy = [b.name for b in rt.backends if b.healthy]
    ok = bool(healthy) and not rt.draining
    return json(200 if ok else 503, {"ready": ok, "draining": rt.draining, "healthy_backends": healthy})


async def metrics(request: Request) -> Response:
    return Raw(200, runtime(request).metrics.exposition(), CONTENT_TYPE_LATEST.encode())


async def on_error(request: Request, exc: Exception) -> Response:
    """Every error of a routed endpoint as an OpenAI envelope."""
    if isinstance(exc, ProxyError):
        return error(exc)
    scope = request.scope
    if isinstance(exc, HTTPException) and exc.status_code == 404:
        return error(ProxyError(404, f"Invalid URL ({scope['method']} {scope['path']})", code="unknown_url"))
    if isinstance(exc, HTTPException) and exc.status_code == 405:
        allow = ", ".join(sorted((exc.headers or {}).get("Allow", "").split(", ")))  # Starlette's order is a set's
        err = ProxyError(405, f"Method {scope['method']} is not allowed for {scope['path']}.", code="method_not_allowed")
        return error(err, [(b"allow", allow.encode())])
    if isinstance(exc, HTTPException):
        return error(ProxyError(exc.status_code, str(exc.detail)))
    return error(ProxyError(500, "Internal proxy error.", code="internal_error", type="server_error"))
