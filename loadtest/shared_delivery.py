"""How fast does a change reach another proxy: Redis pub/sub vs a stream followed with XREAD BLOCK?
(proxy/shared.py follows a stream: ordered with the table writes, replayable after a short
disconnect, and a joining proxy reads the recent past; this measures what that costs.)

    python -m loadtest.shared_delivery [--messages 500]

Writer and follower are two connections to a private redis-server; each message is ~200 bytes
(a flush's change entry is about that size or larger). Prints p50 / p99 from the writer's call
to the follower holding the message.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis.asyncio as redis

from loadtest.private_redis import PrivateRedis


def summary(name: str, seconds: list[float]) -> str:
    ordered = sorted(seconds)
    return (f"{name:8} p50 {statistics.median(ordered) * 1e6:6.0f} µs   "
            f"p99 {ordered[int(len(ordered) * 0.99)] * 1e6:6.0f} µs")


async def pubsub(writer: redis.Redis, follower: redis.Redis, n: int) -> list[float]:
    sub = follower.pubsub()
    await sub.subscribe("vp:bench")
    await sub.get_message(timeout=1)  # the subscription's confirmation
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await writer.publish("vp:bench", b"x" * 200)
        while True:
            message = await sub.get_message(timeout=1)
            if message and message["type"] == "message":
                break
        out.append(time.perf_counter() - t)
    await sub.aclose()
    return out


async def stream(writer: redis.Redis, follower: redis.Redis, n: int) -> list[float]:
    cursor = await writer.xadd("vp:bench-log", {"x": "0"})
    out = []
    for _ in range(n):
        reading = asyncio.get_running_loop().create_task(follower.xread({"vp:bench-log": cursor}, block=1000))
        await asyncio.sleep(0.0005)  # the follower's XREAD reaches the server and blocks there
        t = time.perf_counter()
        await writer.xadd("vp:bench-log", {"x": "y" * 200}, maxlen=1000, approximate=True)
        found = await reading
        cursor = found[0][1][-1][0]
        out.append(time.perf_counter() - t)
    return out


async def measure(url: str, n: int) -> None:
    writer, follower = redis.Redis.from_url(url), redis.Redis.from_url(url)
    try:
        print(summary("pub/sub", await pubsub(writer, follower, n)))
        print(summary("stream", await stream(writer, follower, n)))
    finally:
        await writer.aclose()
        await follower.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=500)
    args = ap.parse_args()
    with PrivateRedis() as server:
        asyncio.run(measure(server.url, args.messages))


if __name__ == "__main__":
    main()
