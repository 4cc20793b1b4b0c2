"""Build the discovery source a `backends_from` entry describes."""
from __future__ import annotations

from proxy.config import BackendSource
from proxy.discovery.fleet import Fleet


def make_source(source: BackendSource, fleet: Fleet):
    """A source with `async start(tasks)` (first sync, then its background loop on the Runtime's
    supervisor) and `async stop()`."""
    if source.dns is not None:
        from proxy.discovery.dns import DnsDiscovery

        return DnsDiscovery(source, fleet)
    from proxy.discovery.kubernetes import KubernetesDiscovery

    return KubernetesDiscovery(source, fleet)
