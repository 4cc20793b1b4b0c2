"""Public model names (deployments) -> upstream model/adapter and the replicas able to serve them."""
from __future__ import annotations

from dataclasses import dataclass, field

from proxy.config import DeploymentConfig, ProxyConfig, Timeouts
from proxy.routing.backends import Backend


@dataclass(frozen=True, slots=True)
class Route:
    name: str  # what clients send as `model`
    model: str  # upstream base model id
    adapter: str | None  # upstream LoRA adapter id, if any
    backends: tuple[Backend, ...]  # replicas that have model (and adapter)
    parent: str | None = None  # for adapters: the public name of their base (for /v1/models)
    timeouts: Timeouts = Timeouts()  # upstream timeouts for this deployment

    # Derived once here (fields, not properties: the request path reads them on every request).
    # What vLLM expects in `model`: the adapter name selects the adapter
    upstream_id: str = field(init=False, default="", compare=False, repr=False)
    rewrite: bool = field(init=False, default=False, compare=False, repr=False)  # the name differs from it
    # response bytes to swap so clients see the name they asked for in `model`
    rename: tuple[bytes, bytes] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "upstream_id", self.adapter or self.model)
        object.__setattr__(self, "rewrite", self.name != self.upstream_id)
        if self.rewrite:
            swap = (b'"model":"%s"' % self.upstream_id.encode(), b'"model":"%s"' % self.name.encode())
            object.__setattr__(self, "rename", swap)


def build_catalog(config: ProxyConfig, backends: list[Backend]) -> dict[str, Route]:
    """Declared deployments, or else every model and adapter the backends report under its own id."""
    deployments = config.deployments
    if deployments is None:
        deployments = _discovered_deployments(backends)
    public_base: dict[str, str] = {}
    for d in deployments:
        if d.adapter is None:
            public_base.setdefault(d.model, d.name)  # the first alias, in file order: deterministic
    bases = {d.name for d in deployments if d.adapter is None}
    return {
        d.name: Route(
            name=d.name,
            model=d.model,
            adapter=d.adapter,
            backends=tuple(b for b in backends if b.serves(d.model, d.adapter)),
            parent=_parent(d, public_base, bases),
            timeouts=config.timeouts_for(d.name),
        )
        for d in deployments
    }


def _parent(d: DeploymentConfig, public_base: dict[str, str], bases: set[str]) -> str | None:
    """An adapter's `parent` in /v1/models: the base deployment the operator named, else the first
    deployment of its base model, else the upstream model id."""
    if d.adapter is None:
        return None
    if d.parent in bases:
        return d.parent
    return public_base.get(d.model, d.model)


def _discovered_deployments(backends: list[Backend]) -> list[DeploymentConfig]:
    found: dict[str, DeploymentConfig] = {}
    for backend in backends:
        for model in sorted(backend.models):
            found.setdefault(model, DeploymentConfig(name=model, model=model))
        for adapter, parent in sorted(backend.adapters.items()):
            base = parent or backend.base_model()
            if base is not None:
                found.setdefault(adapter, DeploymentConfig(name=adapter, model=base, adapter=adapter))
    return list(found.values())
