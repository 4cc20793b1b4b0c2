"""The filters every built-in profile runs, in this order: available (healthy, not ejected),
trusted_multimodal, untried (on a retry), free_slot."""
from __future__ import annotations

from typing import ClassVar, Sequence

from proxy.routing.backends import Backend
from proxy.routing.plugins import Filter, register
from proxy.routing.scheduler import Lease

@register
class Available(Filter):
    """Healthy (discovery, hung-replica watchdog) and not ejected by passive outlier detection."""

    name = "available"

    def __init__(self, params, env) -> None:
        super().__init__(params, env)
        self._monotonic = env.clock.monotonic

    def apply(self, candidates: Sequence[Backend], lease: Lease | None = None) -> Sequence[Backend]:
        now = self._monotonic()
        for b in candidates:  # usually all are: then no new list
            if not b.healthy or b.ejected_until > now:
                return [b for b in candidates if b.healthy and b.ejected_until <= now]
        return candidates


@register
class TrustedMultimodal(Filter):
    """Requests with request-level multimodal kwargs go only to replicas trusting them
    (`trust_request_mm_kwargs`; proxy/multimodal.py decides which requests)."""

    name = "trusted_multimodal"
    only_when = "trusted_only"

    def apply(self, candidates: Sequence[Backend], lease: Lease) -> Sequence[Backend]:
        if not lease.trusted_only:
            return candidates
        return [b for b in candidates if b.config.trust_request_mm_kwargs]


@register
class Untried(Filter):
    """A retry never goes back to a replica this request already failed on."""

    name = "untried"
    only_when = "tried"

    def apply(self, candidates: Sequence[Backend], lease: Lease) -> Sequence[Backend]:
        tried = lease.tried
        if not tried:
            return candidates
        return [b for b in candidates if b not in tried]


@register
class FreeSlot(Filter):
    """Under its `max_in_flight`; when every candidate is at its limit the request waits in the
    admission queue (proxy/admission.py) and the filters run again."""

    name = "free_slot"
    waits: ClassVar[bool] = True

    def apply(self, candidates: Sequence[Backend], lease: Lease) -> Sequence[Backend]:
        for b in candidates:  # usually all have room: then no new list
            if b.in_flight >= b.limit:
                return [b for b in candidates if b.in_flight < b.limit]
        return candidates
