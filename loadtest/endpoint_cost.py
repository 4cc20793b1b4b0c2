"""CPU per request of the small endpoints inside the app (no server, no socket): the ASGI app is
called directly, so only the routing and the endpoint itself are measured. Only `proxy.*` is
imported, so the same file measures another tree (run it with that tree's interpreter):

    python -m loadtest.endpoint_cost
    cd /work/main && .venv/bin/python /path/to/loadtest/endpoint_cost.py
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

PATHS = [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/v1/models/m"), ("GET", "/ready"),
         ("GET", "/nothing"), ("GET", "/v1/chat/completions")]


async def run(n: int, rounds: int) -> dict[str, float]:
    from proxy.app import ProxyApp
    from proxy.config import parse_config

    app = ProxyApp(parse_config({"backends": [{"name": f"gpu-{i}", "url": f"http://127.0.0.1:{9000 + i}",
                                               "models": ["m"]} for i in range(4)]}))
    sent = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    def scope(method: str, path: str) -> dict:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                "headers": [(b"host", b"x")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8080),
                "scheme": "http", "state": {}}

    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for method, path in PATHS:  # interleaved: each path sees the same machine load
            for _ in range(n // 10):  # warm
                await app(scope(method, path), receive, send)
            sent.clear()
            t0 = time.process_time()
            for _ in range(n):
                await app(scope(method, path), receive, send)
            out.setdefault(f"{method} {path}", []).append((time.process_time() - t0) / n * 1e6)
            assert sent and sent[0]["type"] == "http.response.start"
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=5000, help="calls per path per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import proxy

    result = asyncio.run(run(args.n, args.rounds))
    print(f"tree: {os.path.dirname(os.path.dirname(proxy.__file__))}: CPU µs per call (median of {args.rounds} rounds)")
    for key, us in result.items():
        print(f"  {key:28s} {us:7.1f}")


if __name__ == "__main__":
    main()
