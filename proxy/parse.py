"""One pass over a request body: decode once (orjson), check the fields the proxy relies on.

Everything else in the body is the upstream's business and is forwarded byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Final

import orjson

from proxy.errors import bad_request

CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
EMBEDDINGS: Final = "/v1/embeddings"
# request path -> endpoint: the Tokios connector and other clients may use a base URL with or without /v1
INFERENCE: Final = {p: p for p in (CHAT, COMPLETIONS, EMBEDDINGS)} | {p[3:]: p for p in (CHAT, COMPLETIONS, EMBEDDINGS)}
ENDPOINTS: Final = (CHAT, COMPLETIONS, EMBEDDINGS)


# Content-part types as vLLM's chat parser knows them (vllm/entrypoints/chat_utils.py,
# MM_PARSER_MAP): these carry only text; the media types below are checked by the multimodal gate;
# any other type is refused (vLLM refuses it too, and an unknown type must never slip past).
TEXT_PARTS: Final = frozenset(("text", "input_text", "output_text", "refusal", "thinking", "tool_reference"))
MEDIA_PARTS: Final = frozenset((
    "image_url", "input_image", "image_embeds", "image_pil", "audio_url", "input_audio", "audio_embeds",
    "video_url", "video_embeds", "prompt_embeds", "file",
))
# With a `uuid` (or no `type`), vLLM ignores `type` and takes the first of these keys it finds.
KEYED_PARTS: Final = ("image_url", "image_pil", "image_embeds", "audio_embeds", "prompt_embeds", "audio_url",
                      "input_audio", "video_url", "video_embeds", "tool_reference")
# Request-level fields that vLLM >= 0.31 only accepts with --trust-request-mm-kwargs.
MM_KWARGS: Final = ("mm_processor_kwargs", "multi_modal_data", "media_io_kwargs")


@dataclass(frozen=True, slots=True)
class MediaPart:
    param: str  # e.g. messages[1].content[0]
    kind: str  # the part's type as vLLM reads it (see vllm_kind)
    part: dict  # the whole part: vLLM reads URLs from more keys than the one its type names


class ParsedRequest:
    """What the proxy read of one request body. A plain class, not a dataclass: compiled, its
    constructor runs natively (a dataclass keeps the generated, interpreted `__init__`)."""

    __slots__ = ("endpoint", "data", "model", "stream", "media", "mm_kwargs", "warmed", "wait_for")

    def __init__(self, endpoint: str, data: dict[str, Any], model: str, stream: bool,
                 media: list[MediaPart] | None = None, mm_kwargs: tuple[str, ...] = ()) -> None:
        self.endpoint = endpoint
        self.data = data
        self.model = model
        self.stream = stream
        self.media = media  # None for text-only requests (the common, free case)
        self.mm_kwargs = mm_kwargs
        # set by prefix_affinity when this request computes a prompt others wait for: called once its
        # first token is relayed, or its exchange ended (proxy/routing/affinity/coalesce.py)
        self.warmed: Callable[[], None] | None = None
        # set by prefix_affinity when another request computes this one's prompt on its replica: awaited
        # by the data path once the lease counts this request in flight, before it is sent
        self.wait_for: Callable[[], Awaitable[None]] | None = None

    @property
    def multimodal(self) -> bool:
        return self.media is not None or bool(self.mm_kwargs)


def decode(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        reason = str(exc)
        if "depth limit" in reason:
            raise bad_request("JSON nesting is too deep (limit 1024 levels).", code="json_too_deep") from None
        if "UTF-8" in reason or "surrogate" in reason:
            raise bad_request(f"Request body is not valid UTF-8 JSON: {reason}", code="invalid_encoding") from None
        if not body:
            raise bad_request("Request body is empty; expected a JSON object.", code="invalid_json") from None
        raise bad_request(f"Request body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(
            f"Request body must be a JSON object, not {_json_type(data)}.", code="invalid_type"
        )
    return data


def parse_request(endpoint: str, body: bytes) -> ParsedRequest:
    data = decode(body)
    model = require_model(data.get("model"))
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise bad_request(f"`stream` must be a boolean, not {_json_type(stream)}.", param="stream", code="invalid_type")
    media = None
    if endpoint == CHAT:
        media = _check_messages(data.get("messages"))
    elif endpoint == COMPLETIONS:
        _require(data, "prompt", (str, list))
    else:
        messages = data.get("messages")
        if messages is not None:  # vLLM's chat-style embeddings: media URLs it would fetch, guarded as chat's
            media = _check_messages(messages)
        if messages is None or "input" in data:
            _require(data, "input", (str, list))
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("`stream_options` must be an object.", param="stream_options", code="invalid_type")
    if "mm_processor_kwargs" in data or "multi_modal_data" in data or "media_io_kwargs" in data:
        return ParsedRequest(endpoint, data, model, stream, media, tuple(k for k in MM_KWARGS if data.get(k) is not None))
    return ParsedRequest(endpoint, data, model, stream, media)


def require_model(model: object) -> str:
    if model is None:
        raise bad_request("You must provide a model parameter.", param="model", code="missing_required_parameter")
    if model == "":
        raise bad_request("`model` must not be empty.", param="model", code="invalid_type")
    if not isinstance(model, str):
        raise bad_request(
            f"`model` must be a non-empty string, not {_json_type(model)}.", param="model", code="invalid_type"
        )
    return model


def _check_messages(messages: object) -> list[MediaPart] | None:
    """Checks the message list and collects its media parts in the same pass."""
    if messages is None:
        raise bad_request("Missing required parameter: `messages`.", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty array.", param="messages", code="invalid_type")
    media: list[MediaPart] | None = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"`messages[{i}]` must be an object.", param=f"messages[{i}]", code="invalid_type")
        if not isinstance(message.get("role"), str):
            raise bad_request(
                f"`messages[{i}].role` must be a string.", param=f"messages[{i}].role", code="invalid_type"
            )
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad_request(
                f"`messages[{i}].content` must be a string or an array of content parts.",
                param=f"messages[{i}].content",
                code="invalid_type",
            )
        for j, part in enumerate(content):
            found = media_part(f"messages[{i}].content[{j}]", part)
            if found is not None:
                if media is None:
                    media = []
                media.append(found)
    return media


def media_part(param: str, part: object, known: frozenset[str] = MEDIA_PARTS) -> MediaPart | None:
    """The content part at `param` as vLLM will read it: None for text, a MediaPart for media
    (`known` types), else a 400 — a type we do not know could carry a URL we do not check."""
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or not isinstance(part, dict):
        raise bad_request(f"`{param}` must be an object with a string `type`.", param=param, code="invalid_type")
    if kind in TEXT_PARTS and part.get("uuid") is None:
        return None
    kind = vllm_kind(part)
    if kind in TEXT_PARTS:
        return None
    if kind not in known:
        raise bad_request(
            f"`{param}` has an unsupported content part type {kind!r}.", param=f"{param}.type",
            code="unsupported_content_part",
        )
    return MediaPart(param, kind, part)


def vllm_kind(part: dict) -> str:
    """The part's type as vLLM's `_parse_chat_message_content_mm_part` decides it: `type`, unless
    the part has a `uuid`; then the first known key present (so `{"type": "text", "uuid": ..,
    "image_url": ..}` is an image to vLLM)."""
    if part.get("uuid") is None:
        return part["type"]
    for key in KEYED_PARTS:
        if key in part and (key != "input_audio" or part[key] is not None):
            return key
    return "(none)"


def _require(data: dict[str, Any], key: str, types: tuple[type, ...]) -> None:
    value = data.get(key)
    if value is None:
        raise bad_request(f"Missing required parameter: `{key}`.", param=key, code="missing_required_parameter")
    if not isinstance(value, types):
        raise bad_request(f"`{key}` has the wrong type ({_json_type(value)}).", param=key, code="invalid_type")


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
