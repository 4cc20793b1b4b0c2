"""How an endpoint other than chat/completions/embeddings differs on the inference path
(proxy/inference.py): its parse, its choice of replica, its body rewrite, its request head.
Its own module, interpreted: proxy/passthrough.py, proxy/responses.py and proxy/audio.py
subclass it, and a class of a compiled module cannot be subclassed by interpreted code."""
from __future__ import annotations

import orjson

from proxy.asgi import Scope
from proxy.forward import Progress
from proxy.parse import ParsedRequest
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.scheduler import Lease
from proxy.runtime import Runtime


class Spec:
    """The default steps (chat/completions/embeddings); an endpoint overrides those it does differently."""

    marker = b"data:"  # what a streamed chunk carrying a token contains (for TTFT/ITL)

    def parse(self, scope: Scope, body: bytes) -> ParsedRequest:
        raise NotImplementedError

    async def choose(self, rt: Runtime, route: Route, parsed: ParsedRequest, trusted_only: bool = False,
                     exclude: list[Backend] | None = None) -> Lease:
        return await rt.scheduler.schedule(route, parsed, trusted_only, exclude)

    def rewrite(self, parsed: ParsedRequest, body: bytes, route: Route) -> bytes:
        parsed.data["model"] = route.upstream_id
        return orjson.dumps(parsed.data)

    def usage(self, progress: Progress, stream: bool) -> bytes | None:
        """Where the replica's `usage` object is (this spec's answers: as chat completions')."""
        return progress.usage(stream)

    def head(self, backend: Backend, endpoint: str) -> bytes | None:
        head = backend.heads.get(endpoint)
        if head is None:  # kept per endpoint path (a fixed, small set)
            head = backend.heads[endpoint] = backend.head_prefix("POST", endpoint)
        return head


JSON_BODY = Spec()  # the chat/completions/embeddings behaviour of the rarely taken steps
