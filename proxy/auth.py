"""Client API keys: `Authorization: Bearer <key>`, stored as SHA-256 digests, compared in
constant time, each key limited to the deployments it names. Keys are never logged."""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from proxy.asgi import Scope, bearer
from proxy.config import AuthConfig
from proxy.errors import ProxyError


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
        for entry in config.keys:
            if entry.sha256:
                stored = bytes.fromhex(entry.sha256)
            elif entry.key_env:
                stored = digest(os.environ.get(entry.key_env, "").strip())
            else:
                stored = digest(Path(entry.key_file).read_text().strip())  # type: ignore[arg-type]
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


def unauthorized(message: str) -> ProxyError:
    return ProxyError(
        401, message, code="invalid_api_key", type="invalid_request_error",
        headers=[(b"www-authenticate", b"Bearer"), (b"x-should-retry", b"false")],
    )
