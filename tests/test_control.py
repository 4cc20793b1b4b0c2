"""The control-plane client (proxy/control.py): a pool per replica, idle ones closed."""
from __future__ import annotations

from proxy import control
from proxy.config import BackendConfig
from proxy.routing.backends import Backend


async def test_one_pool_per_replica_and_idle_pools_close(module_servers, monkeypatch) -> None:
    sims = [module_servers.sim() for _ in range(3)]
    backends = [Backend(BackendConfig(name=f"gpu-{i}", url=s.url)) for i, s in enumerate(sims)]
    client = control.client(keep_alive_s=4.0, connect_s=1.0, read_s=5.0)
    transport = client._transport
    try:
        for b in backends[:2]:
            assert b"data" in await control.fetch(b, client, "/v1/models", 5.0)
            await control.fetch(b, client, "/v1/models", 5.0)
        assert len(transport._pools) == 2
        monkeypatch.setattr(control, "IDLE_CLOSE_S", 0.0)  # every pool used before now counts as idle
        await control.fetch(backends[2], client, "/v1/models", 5.0)  # a new replica: the idle ones close
        assert [origin[2] for origin in transport._pools] == [sims[2].port]
    finally:
        await client.aclose()
    assert transport._pools == {}
