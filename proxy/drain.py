"""Graceful shutdown that load balancers can see.

uvicorn's own shutdown closes the listening socket at once, so during the drain `/ready` refuses
connections instead of answering 503, and at the deadline it cancels what still runs: streams are
cut without an error event (curl exit 18). `DrainingServer` keeps listening for the whole drain:
`/ready` answers 503, every response closes its connection, in-flight requests (and any that
still arrive) are served. It ends once nothing is in flight or at the deadline
(`server.drain_timeout_s`); then streams still open end with an SSE error event, requests not
answered yet get 503 `proxy_shutting_down` (proxy/forward.py, proxy/server.py), and it exits.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import sys

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from proxy.cycle import cancel
from proxy.server import refuse_unsupported

log = logging.getLogger("vllm_proxy")

_POLL_S = 0.1
_CUT_GRACE_S = 5.0  # after the deadline: time for cut requests to send their error events


class DrainingServer(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            refuse_unsupported(self.config)
        except ValueError as exc:
            log.error("%s", exc)
            sys.exit(STARTUP_FAILURE)
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.server_state
        state.draining = True  # type: ignore[attr-defined]  # ProxyProtocol: responses close connections
        runtime = _runtime_of(self.config.loaded_app)
        if runtime is not None:
            runtime.draining = True  # /ready answers 503
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_graceful_shutdown
        log.info("draining: %d request(s) in flight, deadline in %g s",
                 len(state.tasks), self.config.timeout_graceful_shutdown)
        for connection in list(state.connections):
            start_pending = getattr(connection, "start_pending", None)
            if start_pending is not None:
                start_pending()  # (a request whose body is still arriving: waited for too)
            connection.shutdown()  # idle keep-alive connections close now, busy ones after their response
        while state.tasks and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(state.connections):
            connection.shutdown()
        tasks = list(state.tasks)
        if tasks:
            log.warning("drain deadline passed: ending %d request(s) still in flight", len(tasks))
            for task in tasks:  # (a request served in callbacks, proxy/fastpath.py, answers at once)
                cancel(task, "drain deadline passed")
            futures = [task for task in tasks if isinstance(task, asyncio.Future)]
            if futures:
                await asyncio.wait(futures, timeout=_CUT_GRACE_S)
        for connection in list(state.connections):
            connection.shutdown()
        if not self.force_exit:
            await self.lifespan.shutdown()


def _runtime_of(app: object):
    """The proxy's live Runtime behind uvicorn's wrappers, if the app is the proxy."""
    for _ in range(8):
        runtime = getattr(app, "runtime", None)
        if runtime is not None:
            return runtime
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None
