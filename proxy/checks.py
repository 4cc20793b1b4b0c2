"""Cross-reference checks of a valid policy, beyond its schema: what `vllm-proxy check` reports.

The schema (proxy/config.py) validates each key on its own; these look at how keys refer to each
other and to the environment the proxy will run in, without touching the network:

errors (exit 2 from `check`): a deployment naming a model no backend serves, or an adapter no
backend holds and none can load, when the backends pin what they serve; an adapter's `parent` that
is not a base deployment of its model; `auth.keys[].deployments`
naming an unknown deployment; a `key_env` that is unset or empty; a `key_file` that cannot be read.

warnings: what only the running fleet can tell (backends that discover their models, Redis),
and settings that silently do nothing (an unset `admin_key_env`, adapters no deployment uses).

`startup_problems` is the subset that stops a proxy from starting at all (an unreadable key
file): `serve` and a reload refuse it with the same key-path message.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from proxy.auth import stored_digest
from proxy.config import ConfigError, ProxyConfig


@dataclass
class Findings:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def startup_problems(config: ProxyConfig, source: str) -> None:
    """Raise ConfigError (key paths) for what would make the proxy fail to start."""
    problems = []
    for i, entry in enumerate(config.auth.keys):
        if entry.key_file is not None:
            try:
                stored_digest(entry, i)
            except ConfigError as exc:
                problems += exc.problems
    problems += _unreadable_upstream_keys(config)
    problems += _tracing_missing(config)
    if problems:
        raise ConfigError(source, problems)


def _key_sources(config: ProxyConfig) -> list[tuple[str, object]]:
    """Every backends entry and discovery source's settings, with its key path."""
    return [*((f"backends[{i}]", b) for i, b in enumerate(config.backends)),
            *((f"backends_from[{i}].backend", s.backend) for i, s in enumerate(config.backends_from or ()))]


def _tracing_missing(config: ProxyConfig) -> list[str]:
    """Tracing is on but proxy/tracing.py's imports would fail (a plain install lacks the extra)."""
    if not config.tracing.enabled:
        return []
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return ["tracing.enabled: needs the OpenTelemetry packages: pip install 'vllm-proxy[tracing]'"]
    return []


def _unreadable_upstream_keys(config: ProxyConfig) -> list[str]:
    """`api_key_file`s that Backend() could not read (at startup and on every reload)."""
    problems = []
    for path, settings in _key_sources(config):
        if settings.api_key_file is not None:
            try:
                settings.upstream_key()
            except (OSError, UnicodeDecodeError) as exc:
                problems.append(f"{path}.api_key_file: cannot read {settings.api_key_file!r}: "
                                f"{getattr(exc, 'strerror', None) or exc}")
    return problems


def cross_check(config: ProxyConfig) -> Findings:
    found = Findings()
    _served(config, found)
    _keys(config, found)
    found.errors += _tracing_missing(config)
    return found


def _replicas(config: ProxyConfig) -> list:
    """Settings of every replica the policy can reach: the static list, plus one entry per discovery
    source (a Kubernetes source's pod labels may override what it serves: not known here)."""
    found = [s.backend if s.dns else s.backend.model_copy(update={"models": None, "adapters": None})
             for s in config.backends_from or ()]
    return [*config.backends, *found]


def _served(config: ProxyConfig, found: Findings) -> None:
    backends = _replicas(config)
    pinned_models = all(b.models is not None for b in backends)
    if config.deployments is None:
        if not pinned_models:
            found.warnings.append("deployments: not set, so the served models come from the running backends "
                                  "(not checked here)")
        return
    used_adapters = {d.adapter for d in config.deployments if d.adapter}
    bases = {d.name: d.model for d in config.deployments if d.adapter is None}
    unchecked = []
    for i, d in enumerate(config.deployments):
        if d.parent is not None and (d.adapter is None or bases.get(d.parent) != d.model):
            found.errors.append(f"deployments[{i}].parent: must name a deployment without an adapter serving "
                                f"{d.model!r}, for an adapter deployment" + ("" if d.adapter else " (this has none)"))
        serving = [b for b in backends if b.models is None or d.model in b.models]
        if not serving:
            served = sorted({m for b in backends for m in b.models or ()})
            found.errors.append(f"deployments[{i}].model: no backend serves {d.model!r} "
                                f"(backends[].models list: {', '.join(map(repr, served))})")
            continue
        if any(b.models is None for b in serving):
            unchecked.append(d.name)
        if d.adapter is None or d.adapter_path is not None:
            continue  # a base model, or an adapter the proxy loads on demand
        if all(b.adapters is not None for b in serving):
            if not any(d.adapter in b.adapters for b in serving):  # type: ignore[operator]
                held = sorted({a for b in serving for a in b.adapters or ()})
                found.errors.append(
                    f"deployments[{i}].adapter: no backend serving {d.model!r} holds {d.adapter!r} "
                    f"(they list: {', '.join(map(repr, held)) or 'none'}) and no adapter_path is given to load it"
                )
        elif d.name not in unchecked:
            unchecked.append(d.name)
    if unchecked:
        found.warnings.append(f"deployments: {', '.join(unchecked)}: not checked against the backends (those "
                              "without `models`/`adapters` report what they serve at runtime)")
    for i, b in enumerate(backends):
        for j, adapter in enumerate(b.adapters or ()):
            if adapter not in used_adapters:
                found.warnings.append(f"backends[{i}].adapters[{j}]: no deployment uses {adapter!r}")


def _known_names(config: ProxyConfig) -> set[str] | None:
    """Every name a client may send, or None when only the running fleet knows them."""
    if config.deployments is not None:
        return {d.name for d in config.deployments}
    backends = _replicas(config)
    if all(b.models is not None and b.adapters is not None for b in backends):
        return {n for b in backends for n in (*(b.models or ()), *(b.adapters or ()))}
    return None


def _keys(config: ProxyConfig, found: Findings) -> None:
    known = _known_names(config)
    for i, entry in enumerate(config.auth.keys):
        if entry.key_env is not None and not os.environ.get(entry.key_env, "").strip():
            found.errors.append(f"auth.keys[{i}].key_env: environment variable {entry.key_env} is not set "
                                f"(or empty), so key {entry.name!r} would match nothing")
        if entry.key_file is not None:
            try:
                stored_digest(entry, i)
            except ConfigError as exc:
                found.errors += exc.problems
        for j, name in enumerate(entry.deployments or ()):
            if known is not None and name not in known:
                found.errors.append(f"auth.keys[{i}].deployments[{j}]: no deployment is named {name!r} "
                                    f"(known: {', '.join(map(repr, sorted(known))) or 'none'})")
        if entry.deployments is not None and known is None:
            found.warnings.append(f"auth.keys[{i}].deployments: model ids are discovered from the backends; "
                                  "not checked here")
    for path, settings in _key_sources(config):
        if settings.api_key_env is not None and not os.environ.get(settings.api_key_env, "").strip():
            found.errors.append(f"{path}.api_key_env: environment variable {settings.api_key_env} is not set "
                                "(or empty), so requests would reach the replica without its --api-key")
    found.errors += _unreadable_upstream_keys(config)
    admin = config.auth.admin_key_env
    if admin is not None and not os.environ.get(admin, ""):
        found.warnings.append(f"auth.admin_key_env: environment variable {admin} is not set: "
                              "POST /admin/reload stays disabled")
    if config.redis is not None:
        found.warnings.append(f"redis.url: {config.redis.url} is not contacted by check")
