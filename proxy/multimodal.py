"""Multimodal policy: which replicas may take media and request-level mm kwargs, limits on media,
and the media-URL guard. Runs only for requests whose single parse found media or mm kwargs.

vLLM >= 0.31 rejects request-level multimodal input unless started with
--trust-request-mm-kwargs; backends marked `trust_request_mm_kwargs: true` are those replicas.
"""
from __future__ import annotations

from typing import Any

from proxy.config import MultimodalPolicy, ProxyConfig
from proxy.errors import bad_request
from proxy.parse import MediaPart, ParsedRequest
from proxy.routing.catalog import Route
from proxy.urlguard import Forbidden, Resolver, check_url

MODALITY = {
    "image_url": "image", "input_image": "image", "image_embeds": "image", "image_pil": "image",
    "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio",
    "video_url": "video", "video_embeds": "video", "file": "file",
}
# Every key vLLM fetches a URL from, whatever the part's type: a string, or an object's `url`
# (`file_url`: the Responses API's `input_file`).
URL_KEYS = ("image_url", "audio_url", "video_url", "file_url")
# Inline payloads (never fetched; size-limited): key, and the field inside an object value.
DATA_KEYS = (("image_embeds", None), ("audio_embeds", None), ("video_embeds", None), ("data", None),
             ("input_audio", "data"), ("file", "file_data"), ("file_data", None))


def is_data_url(value: str) -> bool:
    """URL schemes are case-insensitive: `DATA:` is a data URL to vLLM too."""
    return value[:5].lower() == "data:"


def _payloads(media: MediaPart) -> list[tuple[str, str, bool]]:
    """(param, value, is_url) for every URL and inline data string vLLM could read from the part."""
    part, base = media.part, media.param
    if media.kind == "image_pil":
        raise bad_request("`image_pil` parts cannot be sent over HTTP.", param=f"{base}.type", code="unsupported_content_part")
    found = []
    for key in URL_KEYS:
        value = part.get(key)
        param = f"{base}.{key}"
        if isinstance(value, dict):
            value, param = value.get("url"), f"{param}.url"
        if value is None:
            continue
        if not isinstance(value, str):
            raise bad_request(f"`{param}` must be a URL string.", param=param, code="invalid_type")
        found.append((param, value, True))
    for key, field in DATA_KEYS:
        value = part.get(key)
        param = f"{base}.{key}"
        if field is not None and isinstance(value, dict):
            value, param = value.get(field), f"{param}.{field}"
        values = value.items() if isinstance(value, dict) else ((None, value),)
        for name, item in values:
            if isinstance(item, str):
                found.append((param if name is None else f"{param}.{name}", item, is_data_url(item)))
    return found


class MultimodalGate:
    def __init__(self, config: ProxyConfig, count: Any = None) -> None:
        self.config = config
        self._policies: dict[str, MultimodalPolicy] = {}
        self._resolver: Resolver | None = None
        self._count = count  # callable(deployment, decision) for metrics

    def policy(self, deployment: str) -> MultimodalPolicy:
        found = self._policies.get(deployment)
        if found is None:
            found = self._policies[deployment] = self.config.multimodal_for(deployment)
        return found

    async def check(self, parsed: ParsedRequest, route: Route) -> tuple[bool, bool]:
        """Raises a 400 for a request the policy refuses. Returns (trusted replicas only, body
        changed) — the body changes only when disallowed kwargs are stripped."""
        policy = self.policy(route.name)
        try:
            if policy.mode == "reject":
                raise bad_request(
                    f"Deployment `{route.name}` does not accept multimodal input.",
                    param=parsed.media[0].param if parsed.media else parsed.mm_kwargs[0],
                    code="multimodal_not_supported",
                )
            changed = self._check_kwargs(parsed, policy)
            if parsed.media:
                await self._check_media(parsed.media, policy)
            trusted_only = policy.mode == "route_to_trusted"
            if trusted_only and not any(b.config.trust_request_mm_kwargs for b in route.backends):
                raise bad_request(
                    f"Deployment `{route.name}` has no replica that accepts multimodal input "
                    "(none runs with --trust-request-mm-kwargs).",
                    param=parsed.media[0].param if parsed.media else parsed.mm_kwargs[0],
                    code="multimodal_not_supported",
                )
        except Exception:
            self._counted(route.name, "rejected")
            raise
        self._counted(route.name, "stripped" if changed else ("trusted" if trusted_only else "allowed"))
        return trusted_only, changed

    def _counted(self, deployment: str, decision: str) -> None:
        if self._count is not None:
            self._count(deployment, decision)

    def _check_kwargs(self, parsed: ParsedRequest, policy: MultimodalPolicy) -> bool:
        kwargs = parsed.data.get("mm_processor_kwargs")
        if kwargs is None or policy.allowed_kwargs is None:
            return False
        if not isinstance(kwargs, dict):
            raise bad_request("`mm_processor_kwargs` must be an object.", param="mm_processor_kwargs", code="invalid_type")
        banned = [k for k in kwargs if k not in policy.allowed_kwargs]
        if not banned:
            return False
        if policy.on_disallowed_kwarg == "reject":
            raise bad_request(
                f"`mm_processor_kwargs.{banned[0]}` is not allowed here (allowed: {', '.join(policy.allowed_kwargs) or 'none'}).",
                param=f"mm_processor_kwargs.{banned[0]}",
                code="mm_kwarg_not_allowed",
            )
        for key in banned:
            del kwargs[key]
        if not kwargs:
            del parsed.data["mm_processor_kwargs"]
            parsed.mm_kwargs = tuple(k for k in parsed.mm_kwargs if k != "mm_processor_kwargs")
        return True

    async def _check_media(self, media: list[MediaPart], policy: MultimodalPolicy) -> None:
        counts: dict[str, int] = {}
        total = 0
        schemes = frozenset(policy.urls.schemes)
        domains = tuple(d.lower().rstrip(".") for d in policy.urls.allowed_domains)
        for part in media:
            modality = MODALITY.get(part.kind, "other")
            counts[modality] = counts.get(modality, 0) + 1
            limit = policy.max_items.get(modality)
            if limit is not None and counts[modality] > limit:
                raise bad_request(
                    f"Too many {modality} items: at most {limit} per request.", param=part.param, code="too_many_media_items"
                )
            for param, value, is_url in _payloads(part):
                if not is_url or is_data_url(value):
                    if len(value) > policy.max_data_url_bytes:
                        raise bad_request(
                            f"Inline media is larger than {policy.max_data_url_bytes} bytes.", param=param, code="media_too_large"
                        )
                    total += len(value)
                    if total > policy.max_total_data_bytes:
                        raise bad_request(
                            f"Inline media exceeds {policy.max_total_data_bytes} bytes in total.", param=param, code="media_too_large"
                        )
                    if not is_url:
                        continue
                await self._check_url(value, param, schemes, domains, policy)

    async def _check_url(self, url: str, param: str, schemes, domains, policy: MultimodalPolicy) -> None:
        try:
            _, host = check_url(url, schemes, domains, policy.urls.block_internal)
            if host is not None and policy.urls.resolve_dns and policy.urls.block_internal:
                if self._resolver is None:
                    self._resolver = Resolver(policy.urls.dns_timeout_s)
                await self._resolver.check(host)
        except Forbidden as exc:
            raise bad_request(f"Media URL refused: {exc}.", param=param, code="media_url_forbidden") from None
