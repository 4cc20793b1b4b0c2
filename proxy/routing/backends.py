"""Live state of each vLLM replica: health, what it serves, and the proxy's in-flight count."""
from __future__ import annotations

from hashlib import blake2b

from proxy.config import BackendConfig
from proxy.parse import ENDPOINTS


class Backend:
    __slots__ = ("name", "salt", "url", "config", "healthy", "in_flight", "models", "adapters", "failures", "urls", "headers")

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.salt = int.from_bytes(blake2b(config.name.encode(), digest_size=8).digest(), "little")
        self.url = config.url
        self.config = config
        self.healthy = False
        self.in_flight = 0
        self.failures = 0
        # model ids it serves, and adapter id -> base model id
        self.models: frozenset[str] = frozenset(config.models or ())
        self.adapters: dict[str, str | None] = {a: None for a in config.adapters or ()}
        self.urls = {endpoint: config.url + endpoint for endpoint in ENDPOINTS}
        self.headers = {"Content-Type": "application/json"}
        if config.api_key:
            self.headers["Authorization"] = f"Bearer {config.api_key}"

    def serves(self, model: str, adapter: str | None) -> bool:
        if adapter is None:
            return model in self.models
        return adapter in self.adapters and self.adapters[adapter] in (None, model)

    def base_model(self) -> str | None:
        """The single base model a plain vLLM replica serves (adapters hang off it)."""
        return next(iter(sorted(self.models)), None)

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, healthy={self.healthy}, in_flight={self.in_flight})"
