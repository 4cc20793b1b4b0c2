"""Fixtures that start real servers: simulated vLLM replicas and the proxy, on loopback ports."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from proxy.app import ProxyApp
from proxy.config import parse_config
from proxy.server import ProxyProtocol
from proxy.sim.app import create_app
from proxy.sim.config import SimConfig
from loadtest.private_redis import PrivateRedis
from tests.support import ServerThread, reuse_default_ssl_context

reuse_default_ssl_context()

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# The files that take longest (10-30 s each, mostly waiting on real servers), started first: under
# `make test` (pytest-xdist, whole files per process, collection order) none is left running alone
# at the end while the other processes idle.
LONGEST_FIRST = ("test_packaging.py", "test_discovery.py", "test_hung_replicas.py", "test_hardening.py",
                 "test_faults.py", "test_fuzz_guard.py", "test_operator.py", "test_operations.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


class Servers:
    """Starts servers on demand and stops them all at teardown."""

    def __init__(self) -> None:
        self.running: list[ServerThread] = []

    def sim(self, **options: Any) -> ServerThread:
        options.setdefault("model", MODEL)
        options.setdefault("time_scale", 0.0)
        server = ServerThread(create_app(SimConfig(**options))).start()
        self.running.append(server)
        return server

    def proxy(self, config: dict[str, Any], http: Any = ProxyProtocol) -> ServerThread:
        """The proxy under uvicorn with our lean inference cycle (as `vllm-proxy serve` runs it);
        `http="httptools"` runs it as a plain ASGI app under stock uvicorn instead."""
        # a poll that times out marks the replica down: generous, since a busy machine (or a replica
        # busy parsing a 1 MB prompt) may take a second to answer; dead replicas refuse at once
        config.setdefault("discovery", {"interval_s": 0.2, "timeout_s": 5.0, "failures_to_down": 1})
        server = ServerThread(ProxyApp(parse_config(config)), loop="uvloop", http=http).start()
        self.running.append(server)
        return server

    def proxy_for(self, *sims: ServerThread, **config: Any) -> ServerThread:
        """A proxy in front of `sims` (named gpu-0, gpu-1, ...)."""
        backends = config.pop("backends", None) or [{"name": f"gpu-{i}", "url": s.url} for i, s in enumerate(sims)]
        return self.proxy({"backends": backends, **config})

    def stop(self) -> None:
        for server in reversed(self.running):  # all shut down at once: one teardown, not one per server
            if isinstance(server, ServerThread):  # (tests may add other things with a stop())
                server.server.should_exit = True
        for server in reversed(self.running):
            server.stop()


@pytest.fixture
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def private_redis() -> Iterator[PrivateRedis]:
    """A redis-server of the suite's own (free port, temporary dir); never one on 6379."""
    with PrivateRedis() as server:
        yield server


@pytest.fixture
def redis_url(private_redis: PrivateRedis) -> Iterator[str]:
    """Database 0 of the suite's own Redis, empty before and after the test."""
    import redis

    client = redis.Redis.from_url(private_redis.url)
    client.flushdb()
    yield private_redis.url
    client.flushdb()
    client.close()


@pytest.fixture
def fleet(servers: Servers) -> tuple[ServerThread, list[ServerThread]]:
    """Proxy in front of two fast simulated replicas serving MODEL with discovery."""
    sims = [servers.sim(), servers.sim()]
    return servers.proxy_for(*sims), sims


@pytest.fixture(scope="module")
def module_servers() -> Iterator[Servers]:
    """Like `servers`, but shared by the tests of one module and stopped after the last of them:
    for tests that cannot disturb each other (they only read answers, or only send requests that
    never reach a replica), so they need not each pay for starting and stopping a fleet."""
    s = Servers()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def shared_fleet(module_servers: Servers) -> tuple[ServerThread, list[ServerThread]]:
    """The `fleet` setup, shared by the tests of one module (see `module_servers`)."""
    sims = [module_servers.sim(), module_servers.sim()]
    return module_servers.proxy_for(*sims), sims


def sim_of(server: ServerThread) -> Any:
    return server.server.config.app


Predicate = Callable[[], bool]


def eventually(predicate: Predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Whether `predicate` holds within `timeout` (generous: it returns as soon as it holds, and a
    busy machine must not fail a test that waits on a condition)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def pytest_report_header(config: Any) -> str:
    """Whether the routing decision and request path run compiled (proxy/native.py) or from source, and why."""
    from proxy import native

    return f"vllm-proxy: routing decision and request path {native.describe()}"
