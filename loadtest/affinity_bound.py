"""The pooled bound: the hit rate one LRU prefix cache of the whole fleet's size would reach.

Replays the exact request sequence, in the order the requests were sent, through one simulated
engine (the sim's own parser, tokenizer, chat template, prefix cache and output caching, with
delays off), so the number is measured the same way as the replicas' own counters.
"""
from __future__ import annotations

import asyncio

from proxy.sim import protocol
from proxy.sim.app import SimApp
from proxy.sim.config import SimConfig


def token_hit_rate(pairs) -> float:
    """Token-weighted hit rate of (hit tokens, queried tokens) pairs, as vLLM's counters define it."""
    pairs = list(pairs)
    return sum(h for h, _ in pairs) / max(sum(q for _, q in pairs), 1)


def pooled_hit_rate(bodies: list[dict], *, model: str, block_size: int, num_blocks: int) -> dict:
    """Replay `bodies` one after another; token-weighted hit rate as vLLM's counters define it."""
    app = SimApp(SimConfig(model=model, block_size=block_size, num_gpu_blocks=num_blocks, time_scale=0,
                           max_num_seqs=1))
    engine = app.engine

    per_request: list[tuple[int, int]] = []  # (hit tokens, queried tokens) of each body

    async def replay() -> None:
        stats = engine.stats
        for body in bodies:
            hits, queries = stats.prefix_hits, stats.prefix_queries
            await engine.execute(protocol.parse_chat(body, app.models))
            per_request.append((stats.prefix_hits - hits, stats.prefix_queries - queries))

    asyncio.run(replay())
    stats = engine.stats
    return {"hits": stats.prefix_hits, "queries": stats.prefix_queries,
            "hit_rate": stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0,
            "evictions": engine.cache.evictions, "per_request": per_request}
