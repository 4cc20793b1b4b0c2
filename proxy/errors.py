"""OpenAI error envelopes: the proxy's own errors and upstream (vLLM-shaped) errors, normalised."""
from __future__ import annotations

import orjson

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ProxyError(Exception):
    """A failure answered with an OpenAI error envelope and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers or []

    def body(self) -> bytes:
        return envelope(self.message, self.type, self.param, self.code)

    def sse_event(self) -> bytes:
        """The error as a final SSE event (mid-stream failures: no [DONE] follows)."""
        return b"data: " + self.body() + b"\n\n"


def envelope(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)


_ECHO_LIMIT = 256  # characters of a client's model name repeated back (a 1 MB name is not echoed whole)


def model_not_found(model: str) -> ProxyError:
    shown = model if len(model) <= _ECHO_LIMIT else model[:_ECHO_LIMIT] + "…"
    return ProxyError(404, f"The model `{shown}` does not exist.", param="model", code="model_not_found")


def normalise_upstream_error(status: int, body: bytes) -> bytes:
    """vLLM answers `{"error": {..., "type": "BadRequestError", "code": 400}}` (or, older, the same
    fields at top level). Clients expect OpenAI's string `type`/`code`; keep vLLM's message."""
    message = None
    param = None
    code = None
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict):
            message = inner.get("message")
            param = inner.get("param") if isinstance(inner.get("param"), str) else None
            code = inner.get("code") if isinstance(inner.get("code"), str) else None
        elif isinstance(inner, str):
            message = inner
        if message is None and isinstance(data.get("detail"), (str, list)):
            message = str(data["detail"])
    if not isinstance(message, str) or not message:
        text = body[:500].decode("utf-8", "replace").strip()
        message = text or f"upstream returned HTTP {status}"
    if code is None and status == 404 and (param == "model" or "model" in message.lower()):
        code = "model_not_found"
    return envelope(message, error_type(status), param, code)
