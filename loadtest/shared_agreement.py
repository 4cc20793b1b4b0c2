"""How fast do proxies agree on a new tenant's replica? (proxy/shared.py: placed locally at once,
reconciled in the background: the first writer wins, the others adopt.)

Several `prefix_affinity` policies, each with its own SharedState (as separate proxy processes
would have), share a private redis-server, optionally behind a relay adding a delay each way
(loadtest/delay_relay.py). Each proxy sees a different load picture, so each would place a new
tenant on a different replica. New tenants then arrive at a fixed request rate, requests spread
round-robin over the proxies; per tenant it counts the requests routed elsewhere than the
placement finally agreed on, and the time until every proxy's mirror holds that placement.

    python -m loadtest.shared_agreement [--proxies 3] [--tenants 50] [--rate 1000] [--delay-ms 0,100]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import orjson

from loadtest.delay_relay import DelayRelay
from loadtest.private_redis import PrivateRedis
from proxy.config import AffinityConfig, BackendConfig
from proxy.parse import CHAT, parse_request
from proxy.prefix import prefix_key
from proxy.routing.affinity import PrefixAffinity
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.shared import SharedState

MODEL = "bench-model"
REPLICAS = 4


def request(tenant: int, i: int):
    body = {"model": MODEL, "messages": [{"role": "system", "content": f"Tenant {tenant}. " + "Be brief. " * 60},
                                         {"role": "user", "content": f"question {i} " * 20}]}
    return parse_request(CHAT, orjson.dumps(body))


class Member:
    """One proxy: its shared state, policy and (private) view of the fleet's load."""

    def __init__(self, url: str, k: int) -> None:
        self.state = SharedState(url, local_load=dict)
        self.policy = PrefixAffinity(AffinityConfig(load_slack=1000), self.state)
        self.fleet = [Backend(BackendConfig(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", models=[MODEL]))
                      for i in range(REPLICAS)]
        for b in self.fleet:
            b.healthy = True
        now = self.policy.clock  # (the request clock: the routed counts decay per request)
        for i in range(REPLICAS):  # proxy k sees replica k % REPLICAS idle, the others busy
            self.policy.routed.add(f"r{i}", now, 0.0 if i == k % REPLICAS else 50 * self.policy.routed.factor(now))
        self.route = Route(name=MODEL, model=MODEL, adapter=None, backends=tuple(self.fleet))


async def measure(url: str, proxies: int, tenants: int, rate: float, per_tenant: int) -> dict:
    members = [Member(url, k) for k in range(proxies)]
    for m in members:
        m.state.start()
    deadline = time.monotonic() + 60
    while not all(m.state.up and m.state.mirrored for m in members):
        if time.monotonic() > deadline:
            raise RuntimeError("shared state did not connect")
        await asyncio.sleep(0.01)
    routed: dict[int, list[str]] = {}
    first_at: dict[int, float] = {}
    pins: dict[int, int] = {}
    agreed_at: dict[int, float] = {}

    async def watch() -> None:
        """Note when every mirror first holds one placement for each tenant (polled each ms)."""
        while True:
            for t, pin in list(pins.items()):
                if t not in agreed_at:
                    views = {m.state.pins.get(pin, ((None,),))[0] for m in members}
                    if len(views) == 1 and None not in next(iter(views)):
                        agreed_at[t] = time.monotonic()
            await asyncio.sleep(0.001)

    watcher = asyncio.get_running_loop().create_task(watch())
    gap = 1.0 / rate
    start = time.monotonic()
    n = 0
    decide = []
    for i in range(per_tenant):  # every tenant's i-th request, tenants interleaved
        for t in range(tenants):
            m = members[n % proxies]
            parsed = request(t, i)
            t0 = time.perf_counter()
            backend, _ = await m.policy.pick(m.fleet, parsed, m.route)
            decide.append(time.perf_counter() - t0)
            routed.setdefault(t, []).append(backend.name)
            if t not in first_at:
                first_at[t] = time.monotonic()
                pins[t] = prefix_key(True, parsed.data, MODEL, 256, 64).pin
            n += 1
            await asyncio.sleep(max(start + n * gap - time.monotonic(), 0))
    deadline = time.monotonic() + 30
    while len(agreed_at) < tenants and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    watcher.cancel()
    for m in members:
        await m.state.stop()
    final = {t: members[0].state.pins.get(pin, ((None,),))[0][0] for t, pin in pins.items()}
    wrong = [sum(1 for name in routed[t] if name != final[t]) for t in range(tenants)]
    times = [(agreed_at[t] - first_at[t]) * 1000 for t in agreed_at]
    return {"requests": n, "tenants": tenants, "agreed": len(agreed_at),
            "misrouted_mean": statistics.mean(wrong), "misrouted_max": max(wrong),
            "agree_ms_p50": statistics.median(times) if times else float("nan"),
            "agree_ms_max": max(times) if times else float("nan"),
            "decide_us_p50": statistics.median(decide) * 1e6, "decide_us_max": max(decide) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxies", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=50)
    ap.add_argument("--per-tenant", type=int, default=20, help="requests per tenant")
    ap.add_argument("--rate", type=float, default=1000.0, help="requests per second over all proxies")
    ap.add_argument("--delay-ms", default="0,100", help="comma list: delay added each way to Redis")
    args = ap.parse_args()
    print(f"{args.proxies} proxies, {args.tenants} new tenants x {args.per_tenant} requests at {args.rate:g} req/s "
          f"(a tenant's requests {args.tenants / args.rate * 1000:.0f} ms apart, spread over the proxies)")
    print(f"{'redis delay':>11} {'misrouted/tenant':>16} {'max':>4} {'agreed':>7} {'agree ms p50':>12} "
          f"{'max':>6} {'decide µs p50':>13} {'max':>7}")
    with PrivateRedis() as redis:
        for delay in (float(x) for x in args.delay_ms.split(",")):
            redis_client = __import__("redis").Redis(port=redis.port)
            redis_client.flushdb()
            redis_client.close()
            relay = DelayRelay("127.0.0.1", redis.port, delay / 1000).start() if delay else None
            try:
                url = relay.url if relay else redis.url
                r = asyncio.run(measure(url, args.proxies, args.tenants, args.rate, args.per_tenant))
            finally:
                if relay:
                    relay.stop()
            print(f"{delay:>9g}ms {r['misrouted_mean']:>16.2f} {r['misrouted_max']:>4} "
                  f"{r['agreed']:>3}/{r['tenants']:<3} {r['agree_ms_p50']:>12.1f} {r['agree_ms_max']:>6.1f} "
                  f"{r['decide_us_p50']:>13.1f} {r['decide_us_max']:>7.0f}")


if __name__ == "__main__":
    main()
