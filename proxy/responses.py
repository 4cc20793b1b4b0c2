"""The Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`.

vLLM keeps each response (and the conversation behind it) in the memory of the replica that
created it, so a follow-up naming `previous_response_id`, a retrieval or a cancel must reach
that replica: the proxy records response id -> replica when the replica names a new response
(proxy/response_owners.py: local, shared through Redis in the background) and sends every later
request about it there, never elsewhere (no retry on another replica: it would not know the
conversation). An owner that is down gives 410 `response_owner_unavailable`; an id no proxy or
replica knows gives 404. New conversations take the normal routing, prefix affinity keyed on
`instructions` and `input` as a chat would be, and their media parts pass the multimodal policy.

Streams (named SSE events) are relayed byte for byte; TTFT and ITL are timed on
`response.output_text.delta` events.
"""
from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Sequence

from proxy import inference
from proxy.asgi import DISCONNECT, Receive, Scope, Send, send_error
from proxy.control import fetch
from proxy.errors import ProxyError, bad_request
from proxy.forward import Progress, StreamBroken
from proxy.spec import Spec
from proxy.parse import CHAT, MEDIA_PARTS, MediaPart, ParsedRequest, _json_type, decode, media_part, require_model
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.scheduler import Lease
from proxy.runtime import Runtime

CREATE = "/v1/responses"
BY_ID = "/v1/responses/{id}"  # the metrics' endpoint label of retrievals and cancels
_ID = re.compile(r"[A-Za-z0-9_.\-]{1,256}\Z")
_QUERY = re.compile(rb"[A-Za-z0-9_.\-=&%+]{0,512}\Z")
_ID_IN_BODY = re.compile(rb'"id":\s*"(resp[A-Za-z0-9_.\-]{0,252})"')
_SCAN_LIMIT = 1 << 16  # bytes of a created response searched for its id
_PROBE_TIMEOUT_S = 2.0


def _check_id(value: object, param: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise bad_request(f"`{param}` must be a response id (letters, digits, `_`, `-`, `.`).", param=param,
                          code="invalid_type" if not isinstance(value, str) else "invalid_value")
    return value


def _conversation(data: dict[str, Any]) -> tuple[list[dict], list[MediaPart] | None]:
    """Chat messages standing for the request (for prefix affinity) and its media parts."""
    messages: list[dict] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("`instructions` must be a string.", param="instructions", code="invalid_type")
        messages.append({"role": "system", "content": instructions})
    value = data.get("input")
    if value is None:
        raise bad_request("Missing required parameter: `input`.", param="input", code="missing_required_parameter")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages, None
    if not isinstance(value, list) or not value:
        raise bad_request("`input` must be a string or a non-empty array of input items.", param="input",
                          code="invalid_type")
    media: list[MediaPart] | None = None
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad_request(f"`input[{i}]` must be an object.", param=f"input[{i}]", code="invalid_type")
        content = item.get("content")
        role = item.get("role") if isinstance(item.get("role"), str) else item.get("type", "item")
        output = item.get("output")
        if isinstance(output, list):  # function_call_output: vLLM makes it a tool message's content parts
            for j, part in enumerate(output):
                found = media_part(f"input[{i}].output[{j}]", part, RESPONSE_MEDIA)
                if found is not None:
                    media = media or []
                    media.append(found)
        if isinstance(content, str) or content is None:
            messages.append({"role": role, "content": content or ""})
            continue
        if not isinstance(content, list):
            param = f"input[{i}].content"
            raise bad_request(f"`{param}` must be a string or an array of content parts.", param=param,
                              code="invalid_type")
        text = []
        for j, part in enumerate(content):
            found = media_part(f"input[{i}].content[{j}]", part, RESPONSE_MEDIA)
            if found is None:
                text.append({"type": "text", "text": part.get("text") if isinstance(part.get("text"), str) else ""})
                continue
            if media is None:
                media = []
            media.append(found)
            text.append(part)
        messages.append({"role": role, "content": text})
    return messages, media


# Responses API media parts: the chat ones plus `input_file` (`file_url`/`file_data`, both guarded)
RESPONSE_MEDIA = MEDIA_PARTS | {"input_file"}


class Create(Spec):
    """One `POST /v1/responses` (an instance per request: it remembers where the request went)."""

    marker = b"event: response.output_text.delta"

    def __init__(self) -> None:
        self.view: ParsedRequest | None = None
        self.previous: str | None = None
        self.backend: Backend | None = None
        self.deployment = ""
        self.client = None  # the API key's holder (proxy/auth.py), if keys are configured
        self.usage_chunk: bytes | None = None  # a stream's last chunk naming `usage` (response.completed)

    def parse(self, scope: Scope, body: bytes) -> ParsedRequest:
        self.client = scope.get("vllm_proxy.client")
        data = decode(body)
        model = require_model(data.get("model"))
        stream = data.get("stream") or False
        if not isinstance(stream, bool):
            raise bad_request(f"`stream` must be a boolean, not {_json_type(stream)}.", param="stream",
                              code="invalid_type")
        if data.get("previous_response_id") is not None:
            self.previous = _check_id(data["previous_response_id"], "previous_response_id")
        messages, media = _conversation(data)
        self.view = ParsedRequest(CHAT, {"messages": messages}, model, stream)
        return ParsedRequest(CREATE, data, model, stream, media)

    async def choose(self, rt: Runtime, route: Route, parsed: ParsedRequest, trusted_only: bool = False,
                     exclude: list[Backend] | None = None) -> Lease:
        self.deployment = route.name
        if self.previous is None:
            lease = await rt.scheduler.schedule(route, self.view, trusted_only, exclude)
        else:
            if exclude:
                raise ProxyError(502, "The replica holding the conversation failed.", code="upstream_failed")
            backend, _ = await owner_of(rt, self.previous, "previous_response_id", self.client)
            lease = rt.scheduler.lease(route, backend, "owner")
        self.backend = lease.backend
        return lease

    def watch(self, rt: Runtime, send: Send) -> Send:
        """`send`, recording the id of the response the replica creates as the first bytes pass."""
        state = {"ok": False, "seen": 0, "tail": b""}

        async def recording(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["ok"] = message["status"] == 200
            else:
                body = message.get("body", b"")
                if b'"usage"' in body:  # response.completed comes after the last token delta (the relay's tail)
                    self.usage_chunk = body
                if state["ok"]:
                    found = _ID_IN_BODY.search(state["tail"] + body)  # the id may straddle two chunks
                    if found is not None:
                        rt.response_owners.remember(found.group(1).decode(), self.backend.name, self.deployment)
                        state["ok"] = False
                    else:
                        state["tail"] = body[-300:]
                        state["seen"] += len(body)
                        state["ok"] = state["seen"] < _SCAN_LIMIT
            await send(message)

        return recording

    def usage(self, progress: Progress, stream: bool) -> bytes | None:
        return self.usage_chunk if stream else progress.body


async def create(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    spec = Create()
    await inference.handle(rt, scope, receive, spec.watch(rt, send), CREATE, spec)


async def owner_of(rt: Runtime, response_id: str, param: str, client: Any = None) -> tuple[Backend, str]:
    """The healthy replica holding `response_id` and the deployment it was created for (if known),
    or the 404/410 that says why there is none. A key that may not use that deployment gets 404."""
    not_found = ProxyError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")
    found = await rt.response_owners.lookup(response_id)
    name = found[0] if found is not None else await _probe(rt, response_id)
    if name is None:
        raise not_found
    deployment = found[1] if found is not None else ""
    if client is not None and deployment and not client.may_use(deployment):
        raise not_found
    for backend in rt.backends:
        if backend.name == name and backend.healthy:
            return backend, deployment
    raise ProxyError(
        410, f"Response '{response_id}' is held by replica `{name}`, which is unavailable: vLLM keeps a response "
        "only in the memory of the replica that created it. Start a new response with the full input instead.",
        param=param, code="response_owner_unavailable",
    )


async def _probe(rt: Runtime, response_id: str) -> str | None:
    """Ask every healthy replica for a response no record names (created through a proxy without
    shared records, or its record still on its way); the one that has it becomes its owner."""
    session = rt.upstream.session
    candidates: Sequence[Backend] = [b for b in rt.backends if b.healthy]
    if session is None or not candidates:
        return None

    async def ask(backend: Backend) -> Backend:
        await fetch(backend, session, f"/v1/responses/{response_id}", _PROBE_TIMEOUT_S)
        return backend

    async with rt.response_owners.probe_slots:
        return await _first_holder(rt, response_id, [asyncio.ensure_future(ask(b)) for b in candidates])


async def _first_holder(rt: Runtime, response_id: str, tasks: list[asyncio.Future]) -> str | None:
    try:
        for next_done in asyncio.as_completed(tasks):
            try:
                backend = await next_done
            except Exception:  # noqa: BLE001 (a 404 or no answer: not this one)
                continue
            rt.response_owners.remember(response_id, backend.name, "")
            return backend.name
    finally:
        for task in tasks:
            task.cancel()
    return None


def by_id_route(path: str) -> tuple[str, str] | None:
    """(response id, method) for `/v1/responses/{id}` (GET) and `/v1/responses/{id}/cancel` (POST)."""
    for prefix in ("/v1/responses/", "/responses/"):
        if path.startswith(prefix):
            rest = path[len(prefix):]
            if rest.endswith("/cancel"):
                rest, method = rest[:-len("/cancel")], "POST"
            else:
                method = "GET"
            return (rest, method) if rest and "/" not in rest else None  # e.g. /input_items: not served
    return None


async def by_id(rt: Runtime, scope: Scope, receive: Receive, send: Send, response_id: str, method: str) -> None:
    """Retrieve (`?stream=true&starting_after=N` passed on) or cancel a response, at its owner."""
    started = time.perf_counter()
    metrics = rt.metrics
    request_id = inference._request_id(scope)
    id_header = [(b"x-request-id", request_id.encode("ascii"))]
    deployment, backend_name, status = "unknown", "none", "502"
    watch = None
    try:
        if scope["method"] != method:
            raise ProxyError(405, f"Method {scope['method']} is not allowed for {scope['path']}.",
                             code="method_not_allowed", headers=[(b"allow", method.encode())])
        _check_id(response_id, "response_id")
        query = scope.get("query_string", b"")
        if not _QUERY.match(query):
            raise bad_request("Unsupported query string.", code="invalid_value")
        backend, known = await owner_of(rt, response_id, "response_id", scope.get("vllm_proxy.client"))
        deployment, backend_name = known or deployment, backend.name
        lean = scope.get(DISCONNECT)
        watch = lean.arm() if lean is not None else inference.DisconnectWatch(receive)
        target = f"/v1/responses/{response_id}" + ("/cancel" if method == "POST" else "")
        if query:
            target += "?" + query.decode("ascii")
        route = rt.catalog.get(deployment)
        headers = inference.response_headers(rt, id_header, backend, "owner")
        code = await rt.upstream.exchange(
            backend, BY_ID, b"", id_header[0][1], send, headers, Progress(started),
            route.rename if route is not None else None, head=backend.head_prefix(method, target),
        )
        status = str(code)
    except ProxyError as err:  # UpstreamFailure included: nothing reached the client yet
        status = str(err.status)
        await send_error(send, err, id_header)
    except StreamBroken:
        pass
    except asyncio.CancelledError:
        if watch is None or not watch.gone:
            raise
        status = inference.CLIENT_CLOSED
    finally:
        if watch is not None:
            watch.stop()
    elapsed = time.perf_counter() - started
    metrics.child(metrics.requests, deployment, backend_name, BY_ID, status).inc()
    metrics.child(metrics.duration, deployment, backend_name, BY_ID).observe(elapsed)
    if rt.access is not None and rt.access.wanted():
        rt.access.write(request_id, BY_ID, deployment, backend_name, "owner", status, False, elapsed)
