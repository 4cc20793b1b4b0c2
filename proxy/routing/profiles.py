"""Routing profiles: a YAML composition of registered plugins, built into the objects a
Scheduler runs. The built-in policies are profiles too, with the defaults they always had:

    round_robin      standard filters, picker round_robin
    least_loaded     standard filters, scorer least_loaded, picker max_score (ties rotate)
    prefix_affinity  standard filters, scorer prefix_affinity (alone: its choice is final)

(standard filters: available, trusted_multimodal, untried, free_slot; every profile has the
`lora` hook unless it lists its own hooks.) A profile of your own, e.g. llm-d's weighting:

    routing:
      policy: cache_and_queue
      profiles:
        cache_and_queue:
          scorers: [{type: prefix_affinity, weight: 3}, {type: queue_depth, weight: 2}, {type: kv_cache, weight: 2}]
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

from proxy.config import PickerSpec, ProfileConfig, RoutingConfig, ScorerSpec
from proxy.parse import ParsedRequest
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.plugins import Env, Filter, Hook, Picker, Plugin, Scorer, lookup


def builtin(name: str) -> ProfileConfig:
    if name == "round_robin":
        return ProfileConfig(picker=PickerSpec(type="round_robin"))
    if name == "least_loaded":
        return ProfileConfig(scorers=[ScorerSpec(type="least_loaded")],
                             picker=PickerSpec(type="max_score", params={"reason": "least-loaded"}))
    if name == "prefix_affinity":
        return ProfileConfig(scorers=[ScorerSpec(type="prefix_affinity")])
    raise KeyError(name)


def make(kind: str, spec, routing: RoutingConfig, env: Env) -> Plugin:
    cls = lookup(kind, spec.type)
    params = spec.params
    if cls.section is not None:  # defaults from routing.<section>, e.g. routing.prefix_affinity
        params = getattr(routing, cls.section).model_dump() | params
    return cls(cls.Params.model_validate(params), env)


class Scored:
    """The pick step of a profile with scorers: the weighted sum of their opinions, a proposing
    scorer's choice counting its weight for the replica it names; the picker decides."""

    def __init__(self, name: str, scorers: list[tuple[Scorer, float]], picker: Picker) -> None:
        self.name = name
        self.picker = picker
        self.proposer = next((s for s, _ in scorers if s.proposes), None)
        self.proposal_weight = next((w for s, w in scorers if s.proposes), 0.0)
        self.scorers = [(s, w) for s, w in scorers if not s.proposes and w > 0]
        if self.proposer is not None and hasattr(self.proposer.policy, "load"):
            self.load = self.proposer.policy.load  # in flight over all proxies (the LoRA manager's load)
        if self.proposer is not None and hasattr(self.proposer.policy, "serve"):
            self.serve = self.proposer.policy.serve  # its background work (the Runtime runs it)
        lone = self.scorers[0][0] if len(self.scorers) == 1 and self.proposer is None else None
        if lone is not None and lone.order is not None and hasattr(picker, "pick_lowest"):
            self.pick = partial(picker.pick_lowest, lone.order)  # type: ignore[method-assign]

    async def pick(self, candidates: Sequence[Backend], request: ParsedRequest, route: Route) -> tuple[Backend, str]:
        proposed = None
        totals = [0.0] * len(candidates)
        if self.proposer is not None:
            proposed, why = await self.proposer.propose(candidates, request, route)
            totals[candidates.index(proposed)] += self.proposal_weight
        for scorer, weight in self.scorers:
            scorer.add(candidates, totals, weight, request)
        chosen = candidates[self.picker.choose(candidates, totals)]
        return chosen, why if chosen is proposed else self.picker.reason


class Unscored:
    """The pick step of a profile without scorers: the picker alone (round robin)."""

    def __init__(self, name: str, picker: Picker) -> None:
        self.name = name
        self.picker = picker
        self.pick = picker.pick


class Profile:
    """The built plugins of one profile. `policy` is its pick step (`name`, `async pick`): a lone
    proposing scorer (prefix_affinity) is its own pick step, so that profile costs nothing extra."""

    def __init__(self, name: str, config: ProfileConfig, routing: RoutingConfig, env: Env) -> None:
        self.name = name
        self.config = config
        self.env = env
        self.filters: list[Filter] = [make("filter", f, routing, env) for f in config.filters]  # type: ignore[misc]
        self.hooks: list[Hook] = [make("hook", h, routing, env) for h in config.hooks]  # type: ignore[misc]
        scorers = [(make("scorer", s, routing, env), s.weight) for s in config.scorers]
        picker: Picker = make("picker", config.picker, routing, env)  # type: ignore[assignment]
        self.plugins: list[Plugin] = [*self.filters, *(s for s, _ in scorers), picker, *self.hooks]
        lone = scorers[0][0] if len(scorers) == 1 else None
        if lone is not None and lone.proposes and config.picker.type == "max_score":
            self.policy = lone.policy  # type: ignore[attr-defined]
        elif scorers:
            self.policy = Scored(name, scorers, picker)  # type: ignore[arg-type]
        else:
            self.policy = Unscored(name, picker)


def build(routing: RoutingConfig, env: Env) -> Profile:
    """The profile `routing.policy` names."""
    name = routing.policy
    config = routing.profiles.get(name) or builtin(name)
    return Profile(name, config, routing, env)
