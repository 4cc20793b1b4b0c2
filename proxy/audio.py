"""`/v1/audio/transcriptions` and `/v1/audio/translations`: multipart uploads routed by their
`model` form field, plain or streamed (`stream=true`), on the chat path (proxy/inference.py).

The upload is read under `server.max_body_bytes`: a declared Content-Length above it is refused
with 413 before a byte of the body is read, and an undeclared (chunked) one as soon as it passes
the limit. Within the limit it is buffered, because the `model` field that decides the replica
may come after the file. Renaming a deployment to its upstream model rewrites only that field.
"""
from __future__ import annotations

from proxy import inference
from proxy.asgi import Receive, Scope, Send, header
from proxy.errors import bad_request
from proxy.spec import Spec
from proxy.multipart import Field, MultipartError, fields
from proxy.parse import ParsedRequest, require_model
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.runtime import Runtime

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
_FIELD_LIMIT = 4096  # bytes of a plain form field the proxy reads (model, stream)


class Upload(Spec):
    """One upload (an instance per request: it keeps the body's content type and model field)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.content_type = b""
        self.model_field: Field | None = None

    def parse(self, scope: Scope, body: bytes) -> ParsedRequest:
        self.content_type = header(scope, b"content-type") or b""
        try:
            form = fields(body, self.content_type, once=("model", "stream"))
        except MultipartError as exc:
            raise bad_request(f"{exc}", code="invalid_multipart") from None

        def text(name: str) -> str | None:
            f = form.get(name)
            if f is None:
                return None
            if f.end - f.start > _FIELD_LIMIT:
                raise bad_request(f"Form field `{name}` is too long.", param=name, code="invalid_value")
            return body[f.start:f.end].decode("utf-8", "replace")

        model = require_model(text("model"))
        self.model_field = form["model"]
        upload = form.get("file")
        if upload is None or upload.end <= upload.start:
            raise bad_request("Missing required parameter: `file` (the audio upload).", param="file",
                              code="missing_required_parameter")
        stream = (text("stream") or "false").strip().lower()
        if stream not in ("true", "false"):
            raise bad_request("`stream` must be true or false.", param="stream", code="invalid_type")
        return ParsedRequest(self.endpoint, {}, model, stream == "true")

    def rewrite(self, parsed: ParsedRequest, body: bytes, route: Route) -> bytes:
        f = self.model_field
        return body[:f.start] + route.upstream_id.encode() + body[f.end:]

    def head(self, backend: Backend, endpoint: str) -> bytes | None:
        return backend.head_prefix("POST", endpoint, self.content_type)


def handler(endpoint: str):
    async def handle(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
        await inference.handle(rt, scope, receive, send, endpoint, Upload(endpoint))

    return handle
