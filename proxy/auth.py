"""Client API keys: `Authorization: Bearer <key>`, stored as SHA-256 digests, compared in
constant time, each key limited to the deployments it names. Keys are never logged; their
configured names are (access log `key`, `vllm_proxy_key_requests_total`)."""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from proxy.asgi import Scope, bearer
from proxy.config import ApiKey, AuthConfig, ConfigError
from proxy.errors import ProxyError

log = logging.getLogger("vllm_proxy.auth")
CLIENT: Final = "vllm_proxy.client"  # scope key: the authenticated Client


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class Client:
    name: str
    deployments: frozenset[str] | None  # None: every deployment

    def may_use(self, deployment: str) -> bool:
        return self.deployments is None or deployment in self.deployments


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        limited = any(entry.deployments is not None for entry in config.keys)
        self.protect_metrics = limited if config.protect_metrics is None else config.protect_metrics
        self._keys: list[tuple[bytes, Client]] = []
        for i, entry in enumerate(config.keys):
            stored = stored_digest(entry, i)
            if stored is None:
                log.warning("auth.keys[%d].key_env: $%s is not set; key %r matches nothing", i, entry.key_env, entry.name)
                continue
            deployments = frozenset(entry.deployments) if entry.deployments is not None else None
            self._keys.append((stored, Client(entry.name, deployments)))

    def client(self, scope: Scope, every_deployment: bool = False) -> Client:
        """The caller, or a 401: every stored digest is compared, so timing says nothing. With
        `every_deployment` (for /metrics, whose labels name every deployment), a key limited to
        some deployments is a 403."""
        token = bearer(scope)
        if token is None:
            raise unauthorized("You didn't provide an API key. Send `Authorization: Bearer <key>`.")
        presented = hashlib.sha256(token).digest()
        found = None
        for stored, client in self._keys:
            if hmac.compare_digest(stored, presented) and found is None:
                found = client
        if found is None:
            raise unauthorized("Incorrect API key provided.")
        if every_deployment and found.deployments is not None:
            raise ProxyError(403, "This API key may not read metrics of every deployment.", code="forbidden",
                             type="permission_error")
        return found


def stored_digest(entry: ApiKey, index: int) -> bytes | None:
    """The SHA-256 digest a presented key must match; None for an unset or empty `key_env`
    (nothing may match it: an empty key is no key). An unreadable `key_file` is a ConfigError
    naming its key path, so `serve`, `check` and a reload report it instead of a traceback."""
    if entry.sha256:
        return bytes.fromhex(entry.sha256)
    if entry.key_env:
        value = os.environ.get(entry.key_env, "").strip()
        return digest(value) if value else None
    where = f"auth.keys[{index}].key_file"
    try:
        value = Path(entry.key_file).read_text(encoding="utf-8").strip()  # type: ignore[arg-type]
    except (OSError, ValueError) as exc:
        raise ConfigError(where, [f"{where}: cannot read {entry.key_file!r}: {getattr(exc, 'strerror', None) or exc}"]) from None
    if not value:
        raise ConfigError(where, [f"{where}: {entry.key_file!r} is empty"])
    return digest(value)


def unauthorized(message: str) -> ProxyError:
    return ProxyError(
        401, message, code="invalid_api_key", type="invalid_request_error",
        headers=[(b"www-authenticate", b"Bearer"), (b"x-should-retry", b"false")],
    )
