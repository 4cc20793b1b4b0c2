"""The YAML policy schema: typed, strict (unknown keys are errors), with key-path error messages."""
from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Plain:
    """A plain-object copy of a config's fields, for code that reads them on every request: a
    pydantic model's `__getattr__` hook defeats the interpreter's attribute caches (a field read
    costs 2-3x a plain object's)."""

    def __init__(self, config: BaseModel) -> None:
        self.__dict__.update(config.__dict__)


_Config = TypeVar("_Config", bound=BaseModel)


def plain(config: _Config) -> _Config:
    """A `Plain` copy of `config`, typed as the config it copies (it has the same fields), so the
    code reading it is type-checked (and compiled: proxy/native.py) against the real schema."""
    return Plain(config)  # type: ignore[return-value]


class Timeouts(Strict):
    """Upstream timeouts in seconds. First byte is generous: a long prefill is normal."""

    connect: float = Field(5.0, gt=0)
    first_byte: float = Field(600.0, gt=0)
    idle: float = Field(300.0, gt=0, description="longest silence between two chunks of a stream")
    total: float = Field(3600.0, gt=0, description="longest whole upstream exchange, streams included")


class RetryConfig(Strict):
    """Retries happen only before any byte reached the client, only for connect errors, first-byte
    timeouts and 502/503/504 from a replica, always on another replica, within a budget."""

    max_attempts: int = Field(2, ge=1, le=5, description="attempts per request, the first included")
    budget_ratio: float = Field(0.2, ge=0, le=1, description="retries allowed per request of recent traffic")
    budget_min_per_s: float = Field(5.0, ge=0, description="retries always allowed per second")


class OutlierConfig(Strict):
    """Passive outlier detection: consecutive failures eject a replica for a growing backoff;
    after it, one request probes (half-open). Never ejects a deployment's last healthy replica."""

    consecutive_failures: int = Field(3, ge=1)
    base_ejection_s: float = Field(5.0, gt=0)
    max_ejection_s: float = Field(120.0, gt=0)


class HungReplicaConfig(Strict):
    """Hung-replica detection (proxy/watchdog.py): a replica with requests in flight that sends no
    byte for `suspect_after_s` is probed; no answer within `probe_timeout_s` marks it down, its
    requests that sent nothing to the client are retried elsewhere and its streams end with an
    SSE error event. A replica that is merely busy (a long prefill) answers the probe."""

    enabled: bool = True
    suspect_after_s: float = Field(1.0, gt=0, description="silence, with requests in flight, that triggers a probe")
    probe_timeout_s: float = Field(2.0, gt=0, description="a probe unanswered this long marks the replica down")
    probe_path: str = Field("/health", pattern=r"^/", description="vLLM's liveness endpoint")


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    workers: int = Field(
        1, ge=1, description="processes, each with its own SO_REUSEPORT socket; share routing state via `redis`"
    )
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    header_timeout_s: float = Field(30.0, gt=0, description="a request head must arrive within this; an idle new connection is closed then")
    body_timeout_s: float = Field(30.0, gt=0, description="longest stall while reading a request body")
    send_timeout_s: float = Field(60.0, gt=0, description="longest a client may leave the answer unread before the connection is dropped")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="request line and headers beyond this: 431")
    max_headers: int = Field(100, ge=1, description="more request header fields than this: 431")
    max_response_bytes: int = Field(64 * 1024 * 1024, gt=0, description="largest non-streaming upstream body buffered; beyond: 502")
    keep_alive_s: float = Field(75.0, gt=0, description="client keep-alive; outlasts common client pools")
    upstream_keep_alive_s: float = Field(4.0, gt=0, description="shorter than vLLM's own 5 s keep-alive")
    timeouts: Timeouts = Timeouts()
    explain_headers: bool = Field(True, description="x-vllm-proxy-backend / -route response headers")
    retries: RetryConfig = RetryConfig()
    outlier: OutlierConfig = OutlierConfig()
    max_queue: int = Field(256, ge=0, description="requests waiting for a replica slot before 429s")
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait for a replica slot before 429")
    sse_keepalive_s: float | None = Field(None, gt=0, description="`: ping` comments in silent streams; off if unset")
    drain_timeout_s: float = Field(
        120.0, gt=0, description="on SIGTERM: /ready answers 503 and in-flight requests may finish this long; "
        "streams still open then end with an SSE error event (deploy kits' grace periods assume 120 s)"
    )
    hung_replicas: HungReplicaConfig = HungReplicaConfig()


class BackendSettings(Strict):
    """What a replica serves and how to reach it; `models`/`adapters` pin it, unset they are discovered."""

    models: list[str] | None = None
    adapters: list[str] | None = None
    trust_request_mm_kwargs: bool = False
    api_key: str | None = Field(None, description="sent upstream as Authorization: Bearer (vLLM --api-key)")
    api_key_env: str | None = Field(None, description="env var holding that key (e.g. from a Kubernetes Secret)")
    api_key_file: str | None = Field(None, description="file holding that key (e.g. a mounted Secret)")
    max_in_flight: int | None = Field(None, ge=1, description="admission limit; further requests queue")

    @model_validator(mode="after")
    def _one_key_source(self) -> "BackendSettings":
        if sum(x is not None for x in (self.api_key, self.api_key_env, self.api_key_file)) > 1:
            raise ValueError("give at most one of api_key, api_key_env, api_key_file")
        return self

    def upstream_key(self) -> str | None:
        """The key to send upstream, read from the env var or file when named (at Backend build)."""
        if self.api_key_env is not None:
            return os.environ.get(self.api_key_env, "").strip() or None
        if self.api_key_file is not None:
            return Path(self.api_key_file).read_text(encoding="utf-8").strip() or None
        return self.api_key


class BackendConfig(BackendSettings):
    """One vLLM replica. `models`/`adapters` pin what it serves; unset, they are discovered."""

    name: str = Field(min_length=1)
    url: str

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")) or len(value.split("://", 1)[1]) == 0:
            raise ValueError("must be an http:// or https:// base URL, e.g. http://127.0.0.1:8000")
        value = value.rstrip("/")
        try:  # what the data path needs to open a connection (routing/backends.py)
            parts = urlsplit(value)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"not a valid URL: {exc}") from None
        if not parts.hostname or port == 0:
            raise ValueError("needs a host and a port in 1-65535, e.g. http://127.0.0.1:8000")
        if value.endswith("/v1"):
            raise ValueError("give the base URL without /v1")
        return value


class DnsSource(Strict):
    """Replicas from DNS: a headless Service's A/AAAA records (with `port`) or its SRV records,
    re-resolved every `interval_s`."""

    host: str = Field(min_length=1, description="name to resolve, e.g. vllm.vllm.svc.cluster.local")
    record: Literal["A", "AAAA", "SRV"] = Field("A", description="SRV gives ports too; A/AAAA need `port`")
    port: int | None = Field(None, ge=1, le=65535)
    interval_s: float = Field(5.0, gt=0, description="re-resolution period")
    timeout_s: float = Field(2.0, gt=0)
    nameservers: list[str] | None = Field(None, description="ip or ip:port; unset = the system resolver's")

    @model_validator(mode="after")
    def _port(self) -> "DnsSource":
        if self.record != "SRV" and self.port is None:
            raise ValueError(f"record {self.record} needs `port`")
        return self


class KubernetesSource(Strict):
    """Replicas from the Kubernetes API: the EndpointSlices of a Service, or pods by label selector,
    kept by list + watch. Needs get/list/watch on endpointslices (or pods) in `namespace`."""

    namespace: str | None = Field(None, description="unset = the proxy's own (service-account) namespace")
    service: str | None = Field(None, description="watch this Service's EndpointSlices")
    selector: str | None = Field(None, description="or watch pods with this label selector, e.g. app=vllm")
    port: int | str | None = Field(None, description="port number or name; unset = the first port")
    api_server: str | None = Field(None, description="unset = in-cluster (service-account token and CA)")
    watch_timeout_s: int = Field(300, ge=1, description="server-side lifetime of one watch request")
    annotation_prefix: str = Field(
        "vllm-proxy.io/", description="labels/annotations <prefix>models, <prefix>adapters (comma lists), "
        "<prefix>trust-request-mm-kwargs (true) on the pod (selector) or Service (service) override `backend`"
    )

    @model_validator(mode="after")
    def _one_kind(self) -> "KubernetesSource":
        if (self.service is None) == (self.selector is None):
            raise ValueError("give exactly one of service, selector")
        return self


class BackendSource(Strict):
    """A set of replicas that changes at runtime (proxy/discovery/). Names are `<name>/<pod or address>`.
    A replica enters after its first successful health check; one that turns not ready, terminating
    or disappears gets no new requests, and its requests in flight finish."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    scheme: Literal["http", "https"] = "http"
    dns: DnsSource | None = None
    kubernetes: KubernetesSource | None = None
    backend: BackendSettings = Field(BackendSettings(), description="settings of every replica found")

    @model_validator(mode="after")
    def _one_source(self) -> "BackendSource":
        if (self.dns is None) == (self.kubernetes is None):
            raise ValueError("give exactly one of dns, kubernetes")
        return self


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
    timeouts: dict | None = Field(None, description="overrides of server.timeouts for this deployment, key by key")
    adapter_path: str | None = Field(
        None, min_length=1, description="LoRA adapter: load it on demand from this path (vLLM `lora_path`)"
    )
    min_replicas: int = Field(0, ge=0, description="LoRA adapter: replicas it stays loaded on even when idle")
    max_replicas: int | None = Field(None, ge=1, description="LoRA adapter: most replicas a hot adapter spreads to")
    parent: str | None = Field(
        None, min_length=1, description="LoRA adapter: the deployment /v1/models names as its `parent` (default: "
        "the first deployment of its base model, else the model id)"
    )

    @model_validator(mode="after")
    def _adapter_fields(self) -> "DeploymentConfig":
        if self.adapter is None and (self.adapter_path or self.min_replicas or self.max_replicas is not None):
            raise ValueError("adapter_path, min_replicas and max_replicas need `adapter`")
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class AffinityConfig(Strict):
    """Knobs of `prefix_affinity` (see proxy/routing/affinity.py)."""

    block_chars: int = Field(256, ge=16, description="prefix block size in bytes of rendered prompt (~64 tokens)")
    max_blocks: int = Field(64, ge=1, description="blocks hashed per request; longer prompts share keys beyond it")
    epsilon: float = Field(0.1, gt=0, le=10, description="load bound: no replica above ceil((1+eps) x mean)")
    index_blocks_per_backend: int = Field(
        4096, ge=1,
        description="local index entries per replica: its prefix-cache size in blocks (4096 x 256 chars is about "
        "260 k tokens, a large vLLM KV cache); a bigger index only remembers what the replica evicted",
    )
    shared_ttl_s: float = Field(600.0, gt=0, description="lifetime of a prefix entry / tenant placement in Redis")
    coalesce_wait_s: float = Field(
        2.0, ge=0, description="a request for a system prompt that a streamed request is computing on the same replica "
        "right now (at this proxy, or at another one sharing Redis) waits for that one's first token (until this long "
        "after that one began) rather than compute the prompt again beside it (vLLM caches a prompt's blocks once "
        "computed); 0 turns this off"
    )
    placement_hold_s: float = Field(
        0.1, ge=0, description="with Redis and other proxies sharing it: a new tenant's first request at this proxy waits "
        "for the shared table's answer to its placement (one round trip; the first proxy to place it wins) and goes "
        "where the tenant was placed, at most this long; 0 never waits"
    )
    join_share: float = Field(
        0.5, ge=0, le=1, description="a replica that joins while the others hold more tenants' prompts than their caches "
        "keep takes at once the tenants under this part of a replica's share of the traffic whose rendezvous choice "
        "among the new fleet it is (every proxy picks the same); the heavier ones the packing repair moves by load; "
        "0 turns this off"
    )
    window_requests: float = Field(
        3000.0, gt=0, description="the policy's memory, in requests over all proxies (not seconds, so the same "
        "request sequence behaves the same at any rate): time constant of the tenants' traffic shares (a thirtieth of it "
        "for the short estimate that shows a tenant turning hot or cold)"
    )
    load_window_requests: float = Field(
        1000.0, gt=0, description="time constant, in requests over all proxies, of the smoothed per-replica load "
        "that the bound applies to"
    )
    load_slack: float = Field(
        1.0, ge=0, description="standard deviations of a replica's smoothed count (sqrt of the mean) it may exceed "
        "the (1+eps) x mean bound by: the count's own noise is no reason to spill"
    )
    balance_window_requests: float = Field(
        200.0, ge=0, description="balance guard (proxy/routing/affinity/balance.py): over the last this many requests "
        "per replica (over all proxies), no replica takes more than (1 + balance_epsilon) x mean + 10 of them, whatever "
        "the cache says; 0 turns the guard off (more prefix hits at a fresh start, ~1.2-1.7x the mean load on one "
        "replica for a while after the workload changes)"
    )
    balance_epsilon: float = Field(0.03, ge=0, le=10, description="headroom of the balance guard over the mean")
    balance_burst: float = Field(
        20.0, ge=0, description="balance guard, over any stretch of consecutive requests however short or long: no "
        "replica takes more than 1.1 x its share of the stretch + this many of them (a replica "
        "that ran light cannot take back what it did not take: with phases of half the window, one took 1.5x the "
        "mean); 0 turns this bound off"
    )
    speed_balance: float = Field(
        0.35, ge=0, le=1, description="a replica that decodes k times slower than the fastest (its scraped inter-token "
        "latency, each reading over 2 s or more; 1.5x or more on two readings in a row, else replicas count alike) counts 1 + speed_balance x (k - 1) per request in the load "
        "bound, the balance guard and the packing repair (proxy/routing/speed.py): 1 gives it 1/k of a share, 0 "
        "turns this off. Needs the replicas' /metrics (metrics.scrape_backends)"
    )
    speed_balance_epsilon: float = Field(
        0.1, ge=0, le=10, description="headroom of the balance guard over each replica's share by speed while some "
        "replica decodes markedly slower (speed_balance): that share is an estimate, and the mean's tight headroom "
        "(balance_epsilon) then overflowed 3-4x as many requests to replicas without their prompt"
    )
    continuation_slack: float = Field(
        0.1, ge=0, description="extra relative headroom a conversation's continuation gets on the replica holding it"
    )
    queue_slack: int = Field(
        8, ge=0, description="in-flight guard: skip a replica with more than ceil((1+eps) x mean) + this in flight"
    )
    grow_fill: float = Field(
        0.9, gt=0, description="a tenant's replica set grows only when its own traffic exceeds this fraction of what "
        "its replicas take at the mean (smaller tenants stay put and spill single requests instead)"
    )
    grow_min_requests: float = Field(
        32.0, ge=0, description="no replica set grows, and no tenant spills short of a real queue, before this "
        "proxy has routed this many (decayed) requests"
    )
    move_after_requests: float = Field(
        300.0, ge=0, description="a tenant whose set changed (placed, moved, grown) is not moved by the packing repair "
        "for this many requests"
    )
    cool_down_requests: float = Field(
        1000.0, gt=0, description="a tenant's replica set shrinks only this many requests after it last changed (a "
        "member the packing repair replaced does not count); for as long, the packing repair does not move a tenant "
        "back where it came from"
    )
    forget_requests: float = Field(
        2000.0, gt=0, description="a tenant with no request for this many requests (sooner for a busy one: 6 of its "
        "mean gaps between requests) stops counting in placement, cache room and the packing repair; when it comes "
        "back it is placed anew unless its replica still has room"
    )
    cache_fill: float = Field(
        0.65, gt=0, le=1, description="share of a replica's prefix cache (vllm:cache_config_info) that tenants' "
        "system prompts (sized at 4 characters a token) may fill before their spread over the caches fully "
        "matters to the packing repair; the rest holds conversations"
    )
    max_tenants: int = Field(
        100_000, ge=16, description="tenants (distinct system prompts) this proxy keeps placements and rates for: "
        "beyond it the least recently used are forgotten (clients must not grow its memory without bound)"
    )
    rebalance_every_requests: float = Field(
        300.0, gt=0, description="period, in requests, of the packing repair (proxy/routing/packing.py): one proxy "
        "makes at most two changes (a move or a swap each) per period (sooner after a spill or a fleet change), "
        "evening out the system prompts per cache within the traffic target (1+eps/2) x mean"
    )

    @field_validator("balance_burst")
    @classmethod
    def _burst_whole(cls, value: float) -> float:
        if 0 < value < 1:
            raise ValueError("must be 0 (off) or at least 1: under one request every decision would be capped")
        return value


class PluginSpec(Strict):
    """One plugin of a routing profile: its registered name and parameters (a bare name is fine)."""

    kind: ClassVar[str] = ""
    type: str = Field(min_length=1, description="the registered plugin name (see the routing plugins table)")
    params: dict = Field({}, description="the plugin's parameters (see the routing plugins table)")

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, value: object) -> object:
        return {"type": value} if isinstance(value, str) else value

    @field_validator("type")
    @classmethod
    def _registered(cls, value: str) -> str:
        from proxy.routing.plugins import lookup  # (the plugins import this module)

        lookup(cls.kind, value)
        return value

    @model_validator(mode="after")
    def _params(self) -> "PluginSpec":
        from proxy.routing.plugins import lookup

        plugin = lookup(self.kind, self.type)
        try:
            plugin.Params.model_validate(self.params)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
            raise ValueError(f"params.{where}: {msg}") from None
        return self


class FilterSpec(PluginSpec):
    """A filter: keeps the replicas that may serve the request."""

    kind: ClassVar[str] = "filter"


class ScorerSpec(PluginSpec):
    """A scorer: rates each replica in [0, 1]; the picker compares the weighted sums."""

    kind: ClassVar[str] = "scorer"
    weight: float = Field(1.0, ge=0, description="what this scorer's [0, 1] opinion counts for in the sum")


class PickerSpec(PluginSpec):
    """The picker: one replica from the weighted sums."""

    kind: ClassVar[str] = "picker"


class HookSpec(PluginSpec):
    """A hook around the pick (before it, after it, after the response)."""

    kind: ClassVar[str] = "hook"


STANDARD_FILTERS = ("available", "trusted_multimodal", "untried", "free_slot")


class ProfileConfig(Strict):
    """A routing profile (proxy/routing/): filters in order, weighted scorers, a picker, hooks."""

    filters: list[FilterSpec] = Field(
        default_factory=lambda: [FilterSpec(type=n) for n in STANDARD_FILTERS],
        description="in order; leaving one out turns that check off",
    )
    scorers: list[ScorerSpec] = Field([], description="summed with their weights; none: the picker alone decides")
    picker: PickerSpec = Field(default_factory=lambda: PickerSpec(type="max_score"))
    hooks: list[HookSpec] = Field(
        default_factory=lambda: [HookSpec(type="lora")], description="`lora`: adapter routing and on-demand loads"
    )


BUILTIN_POLICIES = ("prefix_affinity", "least_loaded", "round_robin")


class RoutingConfig(Strict):
    profiles: dict[str, ProfileConfig] = Field(
        {}, description="routing profiles by name, made of registered plugins; `policy` may name one"
    )
    policy: str = Field(
        "prefix_affinity", description=f"the routing profile: a built-in one ({', '.join(BUILTIN_POLICIES)}) or "
        "a name under `profiles`",
    )
    prefix_affinity: AffinityConfig = AffinityConfig()

    @field_validator("profiles")
    @classmethod
    def _not_builtin(cls, value: dict) -> dict:
        for name in value:
            if name in BUILTIN_POLICIES:
                raise ValueError(f"{name!r} is a built-in profile's name; give yours another")
        return value

    @field_validator("policy")
    @classmethod
    def _known(cls, value: str, info: ValidationInfo) -> str:
        profiles = info.data.get("profiles")
        if profiles is not None and value not in BUILTIN_POLICIES and value not in profiles:
            raise ValueError(f"unknown policy {value!r}: give one of {', '.join(BUILTIN_POLICIES)} or a name "
                             f"under routing.profiles ({', '.join(profiles) or 'none given'})")
        return value


class LoraConfig(Strict):
    """LoRA adapter management (proxy/lora.py): on-demand loads, eviction, replication of hot adapters."""

    max_adapters_per_replica: int | None = Field(
        None, ge=1, description="before loading beyond it, unload the least recently used idle adapter; unset = no limit"
    )
    load_timeout_s: float = Field(60.0, gt=0, description="longest a request waits for an on-demand load")
    backoff_s: float = Field(5.0, gt=0, description="first pause before a failed replica is retried for an adapter")
    backoff_max_s: float = Field(300.0, gt=0, description="the pause doubles per failure up to this")
    replicate: bool = Field(True, description="load hot adapters on more replicas, unload the extra ones when cool")
    replicate_min_in_flight: int = Field(
        4, ge=1, description="a hot adapter spreads only when each of its replicas carries at least this many requests"
    )
    cool_down_s: float = Field(30.0, gt=0, description="an adapter this long under its bound loses a replica")
    rebalance_interval_s: float = Field(1.0, gt=0, description="period of the min_replicas / shrink check")


class DiscoveryConfig(Strict):
    """Polling of each backend's /v1/models: health, served models and adapters."""

    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    failures_to_down: int = Field(2, ge=1)


class ApiKey(Strict):
    """One client key: give its SHA-256 hex digest, or name an env var or file holding the key."""

    name: str = Field(min_length=1, description="who holds the key (logged instead of the key)")
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    key_env: str | None = None
    key_file: str | None = None
    deployments: list[str] | None = Field(None, description="deployments this key may use; unset = all")

    @model_validator(mode="after")
    def _one_source(self) -> "ApiKey":
        if sum(x is not None for x in (self.sha256, self.key_env, self.key_file)) != 1:
            raise ValueError("give exactly one of sha256, key_env, key_file")
        return self


class AuthConfig(Strict):
    keys: list[ApiKey] = []
    protect_metrics: bool | None = Field(
        None, description="require a key for /metrics; unset: required when a key is limited to some deployments "
        "(metric labels would name what that key hides); only keys for every deployment may read it"
    )
    admin_key_env: str | None = Field(
        None, description="env var holding the key for POST /admin/reload; unset disables the endpoint"
    )


class RedisConfig(Strict):
    """Shared routing state for several proxy processes; optional."""

    url: str = "redis://127.0.0.1:6379/0"
    timeout_s: float = Field(
        0.05, gt=0, description="scales the background calls' timeout (20x, at least 1 s); no request waits on Redis"
    )
    sync_interval_s: float = Field(0.1, gt=0, description="load view publish/read period while no request is routed")
    busy_sync_interval_s: float = Field(
        0.02, gt=0, description="the same (and the prefix entries' send period) while requests are routed: what the "
        "other proxies see is this much old, so at a higher request rate it lags by fewer requests. A proxy that sees "
        "no other for 2 s uses 5x this (at most sync_interval_s): nobody reads its view"
    )
    max_connections: int = Field(
        16, ge=2, description="Redis connections per proxy process for the background sync (plus one following the "
        "change stream)"
    )

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value


class MetricsConfig(Strict):
    """Prometheus metrics at /metrics (see proxy/metrics.py)."""

    enabled: bool = Field(True, description="per-request metrics; off: /metrics shows only backend state")
    scrape_backends: bool = Field(
        True, description="read each backend's /metrics on the discovery interval (queue, KV cache, hit ratio)"
    )


class LoggingConfig(Strict):
    """The structured access log: one JSON line per request on logger `vllm_proxy.access`."""

    access_log: bool = True
    level: Literal["debug", "info", "warning"] = Field("info", description="level of the access-log records")
    sample: float = Field(1.0, ge=0, le=1, description="fraction of requests logged")
    file: str | None = Field(None, description="append the lines to this file instead of stdout")


class ResponsesConfig(Strict):
    """The Responses API's response id -> replica records (proxy/responses.py)."""

    owner_ttl_s: float = Field(86400.0, gt=0, description="how long a response id is remembered in Redis")
    max_local_records: int = Field(100_000, ge=1, description="response ids kept in this proxy's memory (LRU)")


class TracingConfig(Strict):
    """OpenTelemetry traces over OTLP/HTTP (proxy/tracing.py); needs the `tracing` extra."""

    enabled: bool = Field(False, description="off: no span is made and nothing is imported")
    endpoint: str = Field("http://127.0.0.1:4318/v1/traces", description="OTLP/HTTP traces endpoint")
    service_name: str = "vllm-proxy"
    sample_ratio: float = Field(1.0, ge=0, le=1, description="share of new traces recorded (parent-based)")
    headers: dict[str, str] = Field({}, description="sent with every export (e.g. an auth token)")


class ProxyConfig(Strict):
    server: ServerConfig = ServerConfig()
    backends: list[BackendConfig] = Field([], description="static replicas; may be left out when `backends_from` is set")
    backends_from: list[BackendSource] = []
    deployments: list[DeploymentConfig] | None = None
    routing: RoutingConfig = RoutingConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    redis: RedisConfig | None = None
    multimodal: MultimodalPolicy = MultimodalPolicy()
    auth: AuthConfig = AuthConfig()
    lora: LoraConfig = LoraConfig()
    metrics: MetricsConfig = MetricsConfig()
    logging: LoggingConfig = LoggingConfig()
    responses: ResponsesConfig = ResponsesConfig()
    tracing: TracingConfig = TracingConfig()

    @model_validator(mode="after")
    def _consistent(self) -> "ProxyConfig":
        if not self.backends and not self.backends_from:
            raise ValueError("backends: give at least one backend, or set backends_from")
        _unique("backends", [b.name for b in self.backends])
        _unique("backends_from", [s.name for s in self.backends_from])
        _unique("backends", [b.url for b in self.backends], what="url")
        if self.deployments:
            _unique("deployments", [d.name for d in self.deployments])
            for i, d in enumerate(self.deployments):
                for key, check in (("multimodal", self.multimodal_for), ("timeouts", self.timeouts_for)):
                    try:
                        check(d.name)
                    except ValidationError as exc:
                        first = exc.errors()[0]
                        where = ".".join(str(p) for p in first["loc"])
                        raise ValueError(f"deployments[{i}].{key}.{where}: {first['msg']}") from None
        return self

    def _override(self, deployment: str, key: str, base: BaseModel) -> BaseModel:
        for d in self.deployments or ():
            if d.name == deployment and getattr(d, key):
                return type(base).model_validate(base.model_dump() | getattr(d, key))
        return base

    def timeouts_for(self, deployment: str) -> Timeouts:
        """server.timeouts with the deployment's overrides applied."""
        return self._override(deployment, "timeouts", self.server.timeouts)  # type: ignore[return-value]

    def multimodal_for(self, deployment: str) -> MultimodalPolicy:
        """The global multimodal policy with the deployment's overrides applied."""
        return self._override(deployment, "multimodal", self.multimodal)  # type: ignore[return-value]


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


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error: YAML forbids it, and PyYAML's
    silent "last one wins" would drop e.g. a whole first `backends:` list."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` may be overridden by the keys beside it
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: SafeConstructor reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep)


def load_config(path: str | Path) -> ProxyConfig:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, [f"cannot read file: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [f"not UTF-8 text: {exc.reason} at byte {exc.start}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: e.g. a date like 2020-13-01
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, ["(top level): must be a mapping with at least `backends`"])
    return parse_config(data, source)
