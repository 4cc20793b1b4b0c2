"""Live state of each vLLM replica: health, what it serves, and the proxy's in-flight count.
Compiled with the routing decision (proxy/native.py), which reads it on every request; its
control-plane calls are in proxy/control.py."""
from __future__ import annotations

from hashlib import blake2b
from typing import ClassVar
from urllib.parse import urlsplit

from proxy.config import BackendConfig
from proxy.parse import ENDPOINTS


def rendezvous_salt(name: str) -> int:
    """A stable 64-bit salt of a name (a replica's, an adapter's, a proxy's) for rendezvous
    hashing: every process computes the same one."""
    return int.from_bytes(blake2b(name.encode(), digest_size=8).digest(), "little")


class Backend:
    __slots__ = (
        "name", "salt", "url", "config", "healthy", "in_flight", "models", "adapters", "failures", "headers", "api_key",
        "adapter_in_flight", "adapter_used", "adapter_epoch", "adapter_ops",
        "origin", "heads", "errors_in_row", "ejections", "ejected_until", "limit", "cache_tokens",
        "waiting", "kv_usage", "itl_s", "load_factor",
    )
    speed_version: ClassVar[int] = 0  # moves on whenever some backend's load_factor changes (proxy/routing/speed.py)

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.salt = rendezvous_salt(config.name)
        self.url = config.url
        self.config = config
        self.healthy = False
        self.in_flight = 0
        self.failures = 0
        # model ids it serves, and adapter id -> base model id
        self.models: frozenset[str] = frozenset(config.models or ())
        self.adapters: dict[str, str | None] = {a: None for a in config.adapters or ()}
        # LoRA bookkeeping (proxy/lora.py): in-flight requests and last use per adapter; the
        # epoch/ops pair lets discovery drop a /v1/models answer that raced a load or unload
        self.adapter_in_flight: dict[str, int] = {}
        self.adapter_used: dict[str, float] = {}
        self.adapter_epoch = 0
        self.adapter_ops = 0
        self.headers = {"Content-Type": "application/json"}
        self.api_key = api_key = config.upstream_key()  # plaintext, or read from the env var / file it names
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        # the data path's pre-formatted request heads (proxy/http1.py), one per endpoint
        parts = urlsplit(config.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self.origin = (parts.scheme, parts.hostname, port)
        self.heads = {e: self.head_prefix("POST", e) for e in ENDPOINTS}
        # passive outlier detection (proxy/outlier.py) and admission (max in-flight)
        self.errors_in_row = 0
        self.ejections = 0
        self.ejected_until = 0.0
        self.limit = config.max_in_flight or 1 << 30
        # prefix-cache size (num_gpu_blocks x block_size) from its /metrics; None until scraped
        self.cache_tokens: int | None = None
        # its scheduler's queue and KV-cache usage (0..1) from its /metrics (proxy/scrape.py), for the
        # queue_depth and kv_cache scorers; None until scraped, and again when it cannot be
        self.waiting: float | None = None
        self.kv_usage: float | None = None
        # its decode time per token between the last scrapes, and what one request to it counts as
        # in prefix_affinity's balance against the fastest replica's (proxy/routing/speed.py)
        self.itl_s: float | None = None
        self.load_factor = 1.0

    def head_prefix(self, method: str, target: str, content_type: bytes = b"application/json") -> bytes:
        """The request line and fixed headers for any other endpoint (`target`: path and query)."""
        parts = urlsplit(self.url)
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        line = f"{method} {parts.path.rstrip('/')}{target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        return line.encode("latin-1") + b"Content-Type: " + content_type + b"\r\n" + auth.encode("latin-1")

    def request_head(self, endpoint: str, length: int, request_id: bytes, prefix: bytes | None = None) -> bytes:
        return (prefix or self.heads[endpoint]) + b"Content-Length: %d\r\nX-Request-Id: %s\r\n\r\n" % (length, request_id)

    def serves(self, model: str, adapter: str | None) -> bool:
        if adapter is None:
            return model in self.models
        return adapter in self.adapters and self.adapters[adapter] in (None, model)

    def base_model(self) -> str | None:
        """The single base model a plain vLLM replica serves (adapters hang off it)."""
        return next(iter(sorted(self.models)), None)

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, healthy={self.healthy}, in_flight={self.in_flight})"
