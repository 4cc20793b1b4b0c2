"""The routing framework's parts and the registry that names them (llm-d's scheduling framework,
in small): a request's candidates go through **filters** (who may serve it), **scorers** (each a
weighted opinion in [0, 1] per replica) and a **picker** (one replica from the scores), with
**hooks** before the pick, after it, and after the response. A profile (proxy/routing/profiles.py)
composes registered plugins by name from YAML; the scheduler (proxy/routing/scheduler.py) runs it.

A new plugin is one small class here or beside it, decorated with `@register`, with a pydantic
`Params` model if it takes parameters (validated at config load, listed in the config reference).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

from pydantic import BaseModel, ConfigDict

from proxy.routing.backends import Backend
from proxy.routing.clock import SYSTEM, Clock

if TYPE_CHECKING:
    from proxy.parse import ParsedRequest
    from proxy.routing.catalog import Route
    from proxy.routing.scheduler import Lease


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Env:
    """What plugins may use besides the request: the clock, the shared (Redis) state, the LoRA
    manager. One per profile; a reload that keeps the profile re-points it at the new services."""

    __slots__ = ("clock", "shared", "lora", "routing")

    def __init__(self, routing: Any, clock: Clock = SYSTEM, shared: Any = None, lora: Any = None) -> None:
        self.routing = routing  # the RoutingConfig the profile was built from
        self.clock = clock
        self.shared = shared
        self.lora = lora


class Plugin:
    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams
    section: ClassVar[str | None] = None  # a `routing.<section>` whose values are the params' defaults

    def __init__(self, params: BaseModel, env: Env) -> None:
        self.params = params
        self.env = env


class Filter(Plugin):
    """Keeps the replicas that may serve the request. Returns `candidates` itself when it removes
    nothing (no copy per request)."""

    kind = "filter"
    waits: ClassVar[bool] = False  # emptying a non-empty set means "wait for a slot", not "none can"
    # a filter that removes nothing unless this lease attribute is set (trusted_only, tried) is
    # skipped when it is not: most requests then run only the filters that always apply
    only_when: ClassVar[str | None] = None

    def apply(self, candidates: Sequence[Backend], lease: "Lease") -> Sequence[Backend]:
        raise NotImplementedError


class Scorer(Plugin):
    """A weighted opinion of each candidate in [0, 1] (1 = best). `score` sees one replica;
    a scorer that needs the whole set (to normalise) overrides `add`."""

    kind = "scorer"
    proposes: ClassVar[bool] = False  # a proposer names one replica (async `propose`) instead
    # optional: a key giving the same order as the score (lower = better), so a profile with this
    # scorer alone picks without summing (least_loaded: the in-flight count)
    order: ClassVar[Callable[[Backend], float] | None] = None

    def score(self, backend: Backend, request: "ParsedRequest") -> float:
        raise NotImplementedError

    def add(self, candidates: Sequence[Backend], totals: list[float], weight: float, request: "ParsedRequest") -> None:
        score = self.score
        for i, backend in enumerate(candidates):
            totals[i] += weight * score(backend, request)


class Picker(Plugin):
    """Chooses one candidate from the summed scores (`totals` is None for a profile without scorers)."""

    kind = "picker"

    reason = ""

    def choose(self, candidates: Sequence[Backend], totals: list[float] | None) -> int:
        raise NotImplementedError

    async def pick(self, candidates: Sequence[Backend], request: "ParsedRequest", route: "Route") -> tuple[Backend, str]:
        """The pick step of a profile without scorers: this picker alone."""
        return candidates[self.choose(candidates, None)], self.reason


class Hook(Plugin):
    """Runs around the pick. `adapter_only`: only for requests to a LoRA adapter's deployment."""

    kind = "hook"
    adapter_only: ClassVar[bool] = False

    async def before_pick(self, candidates: Sequence[Backend], lease: "Lease") -> Sequence[Backend]:
        return candidates

    def after_pick(self, backend: Backend, lease: "Lease") -> bool:
        """False: `backend` cannot take the request after all (pick again without it)."""
        return True

    def after_response(self, lease: "Lease") -> None:
        pass


REGISTRY: dict[tuple[str, str], type[Plugin]] = {}
KINDS = ("filter", "scorer", "picker", "hook")


def register(cls: type[Plugin]) -> type[Plugin]:
    REGISTRY[(cls.kind, cls.name)] = cls
    return cls


def lookup(kind: str, name: str) -> type[Plugin]:
    """The registered plugin, or a ValueError naming the choices."""
    import proxy.routing.builtin  # noqa: F401 (registers the built-in plugins)

    found = REGISTRY.get((kind, name))
    if found is None:
        names = ", ".join(sorted(n for k, n in REGISTRY if k == kind))
        raise ValueError(f"unknown {kind} {name!r}; registered: {names}")
    return found
