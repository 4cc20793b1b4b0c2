"""Scorers: each rates every candidate in [0, 1] (1 = best); a profile sums them with weights.

A new scorer is one small class here (a `score` of one replica, or an `add` that sees the whole
set to normalise) plus one line in a profile: `- {type: <name>, weight: 2}`. A scorer whose
opinion is the same for every candidate adds nothing (the picker compares sums)."""
from __future__ import annotations

from operator import attrgetter
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

from proxy.parse import ParsedRequest
from proxy.routing.backends import Backend
from proxy.routing.plugins import Scorer, register


def _relative(values: list[float], totals: list[float], weight: float, full: float = 0.0) -> None:
    """Add weight x (max - v) / max(max - min, full): the least loaded scores 1, the most 0
    (llm-d's normalisation); equal values add nothing. With `full`, a spread smaller than that
    counts in proportion (one request more waiting is not the whole weight)."""
    hi = max(values)
    span = hi - min(values)
    if span > 0:
        scale = weight / max(span, full)
        for i, v in enumerate(values):
            totals[i] += (hi - v) * scale


@register
class LeastLoaded(Scorer):
    """Fewer requests in flight from this proxy (exact and immediate, unlike scraped metrics)."""

    name = "least_loaded"
    order = attrgetter("in_flight")

    def score(self, backend: Backend, request: ParsedRequest) -> float:
        return 1.0 / (1 + backend.in_flight)

    def add(self, candidates: Sequence[Backend], totals: list[float], weight: float, request: ParsedRequest) -> None:
        _relative([b.in_flight for b in candidates], totals, weight)


class QueueParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    unknown: float = Field(0.0, ge=0, description="requests assumed waiting on a replica not (yet) scraped")
    full_spread: float = Field(
        4.0, ge=0, description="a difference in waiting requests that counts the whole weight; smaller ones count "
        "in proportion (0: any difference does, as llm-d's normalisation)")


@register
class QueueDepth(Scorer):
    """Fewer requests waiting in the replica's own queue (vllm:num_requests_waiting, scraped with
    its /metrics on the discovery interval): sees other proxies' traffic and slow replicas."""

    name = "queue_depth"
    Params = QueueParams

    def add(self, candidates: Sequence[Backend], totals: list[float], weight: float, request: ParsedRequest) -> None:
        unknown = self.params.unknown
        _relative([unknown if b.waiting is None else b.waiting for b in candidates], totals, weight,
                  self.params.full_spread)


class KvParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    unknown: float = Field(0.5, ge=0, le=1, description="KV-cache usage assumed for a replica not (yet) scraped")


@register
class KvCache(Scorer):
    """More free KV cache (1 - vllm:kv_cache_usage_perc, scraped): room to run the request now."""

    name = "kv_cache"
    Params = KvParams

    def score(self, backend: Backend, request: ParsedRequest) -> float:
        usage = backend.kv_usage
        return 1.0 - (self.params.unknown if usage is None else usage)
