"""The multi-tenant chat workload of the routing-quality benchmark, fixed before any request is sent.

Tenants have long, distinct system prompts (seeded random words, distinct from the first
token) and Zipf-distributed popularity. A share of requests continues an earlier, still open
conversation of the tenant: the full earlier messages, the previous assistant reply and a new
user turn. The reply is the text the simulated replica deterministically answers for that
prompt (computed with the sim's own code), so the continuation is what a real client would send
and the whole sequence is replayable. Everything derives from `seed`.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from proxy.sim import protocol
from proxy.sim.config import SimConfig
from proxy.sim.models import Models
from proxy.sim.tokenizer import render_chat

# name -> (tenants, skew, fleet cache factor): few hot tenants vs a long, flat tail. The factor is
# the fleet's prefix cache over all tenants' system prompts: each replica holds 2.0/4 = half of the
# prompts (strong) or 1.2/4 = 30 % (weak). "tight" is the strong shape in the weak shape's caches:
# there its top tenant (39 % of traffic) must sit on two replicas whose caches hold ~3.6 prompts
# each, and no fixed layout gets above ~0.92 of the pooled bound (loadtest.affinity_layouts).
SHAPES = {"strong": (12, 1.2, 2.0), "weak": (80, 0.6, 1.2), "tight": (12, 1.2, 1.2)}


@dataclass
class WorkloadSpec:
    tenants: int = 12
    skew: float = 1.2
    system_chars: int = 4000
    user_chars: int = 400
    multi_turn: float = 0.5
    max_turns: int = 6
    open_per_tenant: int = 8  # older open conversations are abandoned
    requests: int = 2000
    max_tokens: int = 8
    model: str = "bench-model"
    seed: int = 0
    # the drift benchmark (loadtest.affinity_drift): prompts drawn from their own seed, so one
    # population can be replayed with other requests; tenant i gets the popularity of rank
    # (i + rotate) mod tenants (a popularity swap inside one population)
    prompt_seed: int | None = None
    rotate: int = 0


@dataclass
class Turn:
    """One request. `after` is the index of the previous turn of the same conversation: the client
    sends this one only once that one has completed, as a user waits for the answer."""

    index: int
    tenant: int
    conversation: int
    turn: int
    after: int | None
    messages: list[dict]
    reply: str = ""

    def body(self, spec: WorkloadSpec) -> dict:
        return {"model": spec.model, "messages": self.messages, "max_tokens": spec.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Workload:
    spec: WorkloadSpec
    system_prompts: list[str]
    turns: list[Turn]
    per_tenant: list[int] = field(default_factory=list)

    @property
    def continuation_share(self) -> float:
        return sum(t.after is not None for t in self.turns) / max(len(self.turns), 1)


def _words(rng: random.Random, chars: int) -> str:
    """Random lowercase words (2-9 letters) with some punctuation, about `chars` long."""
    out, size = [], 0
    while size < chars:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        if rng.random() < 0.08:
            word += rng.choice(".,;:?")
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def sim_reply(spec: WorkloadSpec, body: dict, models: Models) -> str:
    """The assistant text a sim replica (default seed) streams back for `body`."""
    req = protocol.parse_chat(body, models)
    return "".join(req.outputs[0])


def generate(spec: WorkloadSpec) -> Workload:
    rng = random.Random(spec.seed if spec.prompt_seed is None else spec.prompt_seed)
    prompts = [f"Tenant {i}: " + _words(rng, spec.system_chars) for i in range(spec.tenants)]
    if spec.prompt_seed is not None:
        rng = random.Random(spec.seed)
    weights = [1.0 / ((i + spec.rotate) % spec.tenants + 1) ** spec.skew for i in range(spec.tenants)]
    models = Models(SimConfig(model=spec.model))
    open_convs: list[list[Turn]] = [[] for _ in range(spec.tenants)]  # last turn of each open conversation
    turns: list[Turn] = []
    per_tenant = [0] * spec.tenants
    conversations = 0
    for index in range(spec.requests):
        tenant = rng.choices(range(spec.tenants), weights)[0]
        per_tenant[tenant] += 1
        user = {"role": "user", "content": _words(rng, spec.user_chars)}
        candidates = open_convs[tenant]
        if candidates and rng.random() < spec.multi_turn:
            prev = candidates.pop(rng.randrange(len(candidates)))
            messages = prev.messages + [{"role": "assistant", "content": prev.reply}, user]
            turn = Turn(index, tenant, prev.conversation, prev.turn + 1, prev.index, messages)
        else:
            messages = [{"role": "system", "content": prompts[tenant]}, user]
            turn = Turn(index, tenant, conversations, 1, None, messages)
            conversations += 1
        turn.reply = sim_reply(spec, turn.body(spec), models)
        turns.append(turn)
        if turn.turn < spec.max_turns:
            candidates.append(turn)
            if len(candidates) > spec.open_per_tenant:
                candidates.pop(0)
    return Workload(spec, prompts, turns, per_tenant)


def system_blocks(workload: Workload, block_size: int) -> list[int]:
    """Full cache blocks of each tenant's rendered system message (the part every request repeats)."""
    return [len(render_chat([{"role": "system", "content": p}], None)) // block_size
            for p in workload.system_prompts]


def prompt_tokens(workload: Workload) -> list[int]:
    return [len(render_chat(t.messages, None)) for t in workload.turns]
