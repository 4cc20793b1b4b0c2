"""The YAML policy schema: typed, strict (unknown keys are errors), with key-path error messages."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(Strict):
    """Upstream timeouts in seconds. First byte is generous: a long prefill is normal."""

    connect: float = Field(5.0, gt=0)
    first_byte: float = Field(600.0, gt=0)
    idle: float = Field(300.0, gt=0, description="longest silence between two chunks of a stream")


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    workers: int = Field(1, ge=1)
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    keep_alive_s: float = Field(75.0, gt=0, description="client keep-alive; outlasts common client pools")
    upstream_keep_alive_s: float = Field(4.0, gt=0, description="shorter than vLLM's own 5 s keep-alive")
    timeouts: Timeouts = Timeouts()
    explain_headers: bool = Field(True, description="x-vllm-proxy-backend / -route response headers")


class BackendConfig(Strict):
    """One vLLM replica. `models`/`adapters` pin what it serves; unset, they are discovered."""

    name: str = Field(min_length=1)
    url: str
    models: list[str] | None = None
    adapters: list[str] | None = None
    trust_request_mm_kwargs: bool = False
    api_key: str | None = Field(None, description="sent upstream as Authorization: Bearer (vLLM --api-key)")

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")) or len(value.split("://", 1)[1]) == 0:
            raise ValueError("must be an http:// or https:// base URL, e.g. http://127.0.0.1:8000")
        value = value.rstrip("/")
        if value.endswith("/v1"):
            raise ValueError("give the base URL without /v1")
        return value


class MediaUrlPolicy(Strict):
    schemes: list[Literal["https", "http", "data"]] = ["https", "data"]
    allowed_domains: list[str] = Field([], description="if set, media hosts must be one of these or below them")
    block_internal: bool = Field(True, description="refuse loopback/private/link-local/metadata/reserved targets")
    resolve_dns: bool = Field(False, description="also refuse names that resolve to non-public addresses")
    dns_timeout_s: float = Field(0.5, gt=0)


class MultimodalPolicy(Strict):
    """What to do with images/audio/video and request-level multimodal kwargs."""

    mode: Literal["route_to_trusted", "reject", "allow"] = "route_to_trusted"
    allowed_kwargs: list[str] | None = Field(
        None, description="mm_processor_kwargs keys that may pass; unset = any key"
    )
    on_disallowed_kwarg: Literal["reject", "strip"] = "reject"
    max_items: dict[Literal["image", "audio", "video", "file", "other"], int] = Field(
        {"image": 16, "audio": 4, "video": 2, "file": 4, "other": 16}, description="per modality per request"
    )
    max_data_url_bytes: int = Field(10 * 1024 * 1024, gt=0)
    max_total_data_bytes: int = Field(20 * 1024 * 1024, gt=0)
    urls: MediaUrlPolicy = MediaUrlPolicy()


class DeploymentConfig(Strict):
    """A public model name clients send, mapped to an upstream model and optional LoRA adapter."""

    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    adapter: str | None = None
    multimodal: dict | None = Field(None, description="overrides of the global multimodal policy, key by key")


class AffinityConfig(Strict):
    """Knobs of `prefix_affinity` (see proxy/routing/affinity.py)."""

    block_chars: int = Field(256, ge=16, description="prefix block size in bytes of rendered prompt (~64 tokens)")
    max_blocks: int = Field(64, ge=1, description="blocks hashed per request; longer prompts share keys beyond it")
    epsilon: float = Field(0.1, gt=0, le=10, description="load bound: no replica above ceil((1+eps) x mean)")
    index_blocks_per_backend: int = Field(
        50_000, ge=1, description="local index entries per replica (about its prefix-cache size in blocks)"
    )
    shared_ttl_s: float = Field(600.0, gt=0, description="lifetime of a prefix entry in Redis")


class RoutingConfig(Strict):
    policy: Literal["prefix_affinity", "least_loaded", "round_robin"] = "prefix_affinity"
    prefix_affinity: AffinityConfig = AffinityConfig()


class DiscoveryConfig(Strict):
    """Polling of each backend's /v1/models: health, served models and adapters."""

    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    failures_to_down: int = Field(2, ge=1)


class RedisConfig(Strict):
    """Shared routing state for several proxy processes; optional."""

    url: str = "redis://127.0.0.1:6379/0"
    timeout_s: float = Field(0.05, gt=0, description="per request-path call; slower means local mode")
    sync_interval_s: float = Field(0.1, gt=0, description="load view publish/read period")

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value


class ProxyConfig(Strict):
    server: ServerConfig = ServerConfig()
    backends: list[BackendConfig] = Field(min_length=1)
    deployments: list[DeploymentConfig] | None = None
    routing: RoutingConfig = RoutingConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    redis: RedisConfig | None = None
    multimodal: MultimodalPolicy = MultimodalPolicy()

    @model_validator(mode="after")
    def _consistent(self) -> "ProxyConfig":
        _unique("backends", [b.name for b in self.backends])
        _unique("backends", [b.url for b in self.backends], what="url")
        if self.deployments:
            _unique("deployments", [d.name for d in self.deployments])
            for i, d in enumerate(self.deployments):
                if d.multimodal is not None:
                    try:
                        self.multimodal_for(d.name)
                    except ValidationError as exc:
                        first = exc.errors()[0]
                        where = ".".join(str(p) for p in first["loc"])
                        raise ValueError(f"deployments[{i}].multimodal.{where}: {first['msg']}") from None
        return self

    def multimodal_for(self, deployment: str) -> MultimodalPolicy:
        """The global multimodal policy with the deployment's overrides applied."""
        for d in self.deployments or ():
            if d.name == deployment and d.multimodal:
                merged = self.multimodal.model_dump() | d.multimodal
                return MultimodalPolicy.model_validate(merged)
        return self.multimodal


def _unique(section: str, values: list[str], what: str = "name") -> None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{section}: duplicate {what} {value!r}")
        seen.add(value)


class ConfigError(Exception):
    """A config that cannot be used; `problems` holds one 'key.path: reason' line each."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid config\n" + "\n".join(f"  {p}" for p in problems))


def _key_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(top level)"


def parse_config(data: object, source: str = "<config>") -> ProxyConfig:
    try:
        return ProxyConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            # model-level checks name their own key path in the message
            problems.append(f"{_key_path(err['loc'])}: {msg}" if err["loc"] else msg)
        raise ConfigError(source, problems) from None


def load_config(path: str | Path) -> ProxyConfig:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, [f"cannot read file: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, ["(top level): must be a mapping with at least `backends`"])
    return parse_config(data, source)
