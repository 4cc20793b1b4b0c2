"""`prefix_affinity` as a plugin: a proposing scorer around PrefixAffinity (proxy/routing/affinity/),
which names the replica holding the request's prefix (its tenant's replica set, under the load
bound) and records the decision itself. Its weight is what that proposal counts for against the
other scorers; alone in a profile its choice is final and nothing else runs."""
from __future__ import annotations

from typing import Sequence

from proxy.config import AffinityConfig
from proxy.parse import ParsedRequest
from proxy.routing.affinity import PrefixAffinity
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.plugins import Env, Scorer, register


@register
class PrefixAffinityScorer(Scorer):
    """Proposes the replica holding the request's prefix, within the load bound (and records it)."""

    name = "prefix_affinity"
    proposes = True
    Params = AffinityConfig
    section = "prefix_affinity"  # params given in a profile override routing.prefix_affinity

    def __init__(self, params: AffinityConfig, env: Env) -> None:
        super().__init__(params, env)
        self.policy = PrefixAffinity(params, env.shared, timer=env.clock)

    async def propose(self, candidates: Sequence[Backend], request: ParsedRequest, route: Route) -> tuple[Backend, str]:
        return await self.policy.pick(candidates, request, route)
