"""Model-routed passthrough for vLLM's other JSON endpoints: tokenizer (`/tokenize`,
`/detokenize`) and pooling models (rerank on three paths, score on two, classify, pooling).

They take the chat path (proxy/inference.py): bounded body, one parse, the deployment by
`model`, a replica by the routing policy, the answer relayed with the same error envelope and
metrics (the path is the `endpoint` label). Only the fields needed to refuse an obviously
incomplete request are checked here; the rest is vLLM's business.
"""
from __future__ import annotations

from proxy.asgi import Scope
from proxy.errors import bad_request
from proxy.spec import Spec
from proxy.parse import MediaPart, ParsedRequest, _check_messages, media_part, _json_type, decode, require_model

# path -> groups of fields, one group of which must be present in full
REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    "/tokenize": (("prompt",), ("messages",)),
    "/detokenize": (("tokens",),),
    "/v1/rerank": (("query", "documents"),),
    "/rerank": (("query", "documents"),),
    "/v2/rerank": (("query", "documents"),),
    "/v1/score": (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2")),
    "/score": (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2")),
    "/classify": (("input",), ("messages",)),
    "/pooling": (("input",), ("messages",)),
}
_LISTS = ("tokens", "documents", "items")
# rerank/score inputs: a string or {"content": [parts]} (vLLM's ScoreMultiModalParam), or a list of them
_SCORED = ("query", "documents", "text_1", "text_2", "queries", "items", "data_1", "data_2")


def _scored_media(data: dict) -> list[MediaPart] | None:
    """Media parts inside rerank/score inputs, for the multimodal policy and the URL guard."""
    media: list[MediaPart] | None = None
    for key in _SCORED:
        value = data.get(key)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            content = item.get("content") if isinstance(item, dict) else None
            if not isinstance(content, list):
                continue
            base = f"{key}[{i}]" if isinstance(value, list) else key
            for j, part in enumerate(content):
                found = media_part(f"{base}.content[{j}]", part)
                if found is not None:
                    media = media or []
                    media.append(found)
    return media


class Passthrough(Spec):
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.groups = REQUIRED[endpoint]

    def parse(self, scope: Scope, body: bytes) -> ParsedRequest:
        data = decode(body)
        model = require_model(data.get("model"))
        if not any(all(data.get(k) is not None for k in group) for group in self.groups):
            wanted = " or ".join(" and ".join(f"`{k}`" for k in group) for group in self.groups)
            missing = next(k for k in self.groups[0] if data.get(k) is None)
            raise bad_request(f"Missing required parameter: {wanted}.", param=missing, code="missing_required_parameter")
        for key in _LISTS:
            if key in data and not isinstance(data[key], list):
                raise bad_request(f"`{key}` must be an array, not {_json_type(data[key])}.", param=key, code="invalid_type")
        media = _check_messages(data["messages"]) if data.get("messages") is not None else _scored_media(data)
        return ParsedRequest(self.endpoint, data, model, False, media)


SPECS = {path: Passthrough(path) for path in REQUIRED}
