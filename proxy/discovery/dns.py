"""Replicas from DNS: A/AAAA records of a name (a headless Service) with a configured port, or SRV
records (ports included), re-resolved every `interval_s`. A name that no longer exists or has no
records empties the set; a resolver that fails or times out changes nothing (a DNS blip must not
drain the fleet)."""
from __future__ import annotations

import logging

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from proxy.config import BackendSource
from proxy.discovery.fleet import Fleet, Found
from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.discovery")


def _nameserver(text: str) -> dns.nameserver.Do53Nameserver:
    """`ip`, `ip:port`, `v6`, or `[v6]:port`."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return dns.nameserver.Do53Nameserver(host, int(rest[1:]) if rest.startswith(":") else 53)
    if text.count(":") == 1:
        host, port = text.split(":")
        return dns.nameserver.Do53Nameserver(host, int(port))
    return dns.nameserver.Do53Nameserver(text)


class DnsDiscovery:
    def __init__(self, source: BackendSource, fleet: Fleet) -> None:
        assert source.dns is not None
        self.source = source
        self.config = source.dns
        self.fleet = fleet
        self.resolver = dns.asyncresolver.Resolver(configure=self.config.nameservers is None)
        if self.config.nameservers is not None:
            self.resolver.nameservers = [_nameserver(n) for n in self.config.nameservers]
        self.resolver.lifetime = self.config.timeout_s

    async def _records(self, name: str, rdtype: str) -> list:
        try:
            return list(await self.resolver.resolve(name, rdtype, search=False))
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []

    async def resolve(self) -> list[Found]:
        cfg = self.config
        if cfg.record != "SRV":
            return [Found(f"{r.address}:{cfg.port}", r.address, cfg.port, True) for r in await self._records(cfg.host, cfg.record)]
        found = []
        for srv in await self._records(cfg.host, "SRV"):
            target = srv.target.to_text(omit_final_dot=True)
            for rdtype in ("A", "AAAA"):
                found += [Found(f"{r.address}:{srv.port}", r.address, srv.port, True) for r in await self._records(target, rdtype)]
        return found

    async def sync(self) -> None:
        try:
            found = await self.resolve()
        except dns.exception.DNSException as exc:  # timeout, SERVFAIL, no nameserver: keep the known set
            log.warning("source %s: DNS resolution failed, keeping %s: %s", self.source.name, self.config.host, exc)
            return
        self.fleet.update(self.source, found)

    async def start(self, tasks: Supervisor) -> None:
        await self.sync()
        tasks.every(self.config.interval_s, self.sync, f"source {self.source.name}: DNS resolution", log, wait_first=True)

    async def stop(self) -> None:
        pass  # its loop is the Runtime's task
