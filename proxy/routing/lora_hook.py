"""`lora`: requests for a LoRA adapter's deployment go only to replicas holding the adapter; one
that no healthy replica holds is loaded on demand (proxy/lora.py: placement, eviction,
replication). The lease counts the request on its adapter, so eviction skips adapters in use."""
from __future__ import annotations

from typing import Sequence

from proxy.routing.backends import Backend
from proxy.routing.plugins import Hook, register
from proxy.routing.scheduler import Lease


@register
class LoraHook(Hook):
    """Adapter requests: only replicas holding the adapter, loading it on demand (proxy/lora.py)."""

    name = "lora"
    adapter_only = True

    async def before_pick(self, candidates: Sequence[Backend], lease: Lease) -> Sequence[Backend]:
        return await self.env.lora.holders(lease.route, candidates)

    def after_pick(self, backend: Backend, lease: Lease) -> bool:
        return self.env.lora.still_holds(backend, lease.route.adapter)

    def after_response(self, lease: Lease) -> None:
        self.env.lora.released(lease.backend, lease.route.adapter)
