"""Fault injection, set at run time through POST /sim/faults, to test how the proxy copes.

Faults are real time (not scaled by time_scale): a hung or slow replica must look hung or slow
even when the simulated model runs at infinite speed.

`hold` is the tests' gate: while set, every inference request the engine schedules (or, with
`hold_only`, every one for the listed model ids / adapter names) stays in the running batch before
its prefill; it goes on when `hold` is lifted or its model leaves `hold_only`. A state that would
otherwise last a few milliseconds of wall time (a request in prefill, an adapter occupying the
batch, a queue behind it) lasts exactly as long as the test needs, on a loaded machine too.
`steps` paces decoding the same way: at 0, requests wait before their next decoding step until a
test grants more, so each step reaches the proxy on its own however busy the machine is.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import MISSING, dataclass, field, fields

from proxy.sim.errors import bad_request


@dataclass
class Faults:
    hang: bool = False  # accept requests (also /health, /metrics) and never answer while set; streams stall
    error_rate: float = 0.0  # share of inference requests answered with error_status
    error_status: int = 500
    slow_ms: float = 0.0  # extra delay before the first byte of inference responses
    fail_lora_loads: bool = False
    hold: bool = False  # scheduled inference requests wait before their prefill while set
    hold_only: list = field(default_factory=list)  # model ids / adapter names `hold` applies to (empty: all)
    steps: int = -1  # decoding steps still allowed (any request; -1: unlimited)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    poison: str = ""  # a request whose body contains this text is never answered (the replica stays healthy)
    long_prefill: str = ""  # a request whose body contains this text waits long_prefill_ms before its first token
    long_prefill_ms: float = 0.0
    _released: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _random: random.Random = field(default_factory=lambda: random.Random(0), repr=False)

    def update(self, changes: object) -> None:
        """Apply `changes` (a JSON object of fault fields) atomically, or raise a 400."""
        if not isinstance(changes, dict):
            raise bad_request("Faults must be a JSON object.")
        current = self.as_dict()
        for key, value in changes.items():
            if key not in current:
                raise bad_request(f"Unknown fault '{key}'; known: {', '.join(current)}.", param=key)
            kind = type(current[key])
            if kind is list:
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise bad_request(f"Bad value for fault '{key}': {value!r} (a list of names).", param=key)
            elif kind is str:
                if not isinstance(value, str):
                    raise bad_request(f"Bad value for fault '{key}': {value!r}.", param=key)
            elif not isinstance(value, (bool, int, float)) or (kind is bool) != isinstance(value, bool):
                raise bad_request(f"Bad value for fault '{key}': {value!r}.", param=key)
            current[key] = kind(value)
        if not (0.0 <= current["error_rate"] <= 1.0) or not (400 <= current["error_status"] <= 599) \
                or current["slow_ms"] < 0 or current["steps"] < -1 or current["long_prefill_ms"] < 0:
            raise bad_request("error_rate must be in [0, 1], error_status in 400..599, slow_ms and "
                              "long_prefill_ms >= 0, steps >= -1.")
        for key, value in current.items():
            setattr(self, key, value)
        if self.hang:
            self._released.clear()
        else:
            self._released.set()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # held requests look again

    def reset(self) -> None:
        self.update({f.name: f.default_factory() if f.default is MISSING else f.default
                     for f in fields(self) if not f.name.startswith("_")})

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    async def take_step(self) -> None:
        """Use up one of `steps`, first waiting while none are left (until granted, or aborted)."""
        while self.steps == 0:
            await self._changed.wait()
        if self.steps > 0:
            self.steps -= 1

    async def wait_unhung(self) -> None:
        """Block while `hang` is set (forever, unless the client goes away or the fault is lifted)."""
        if self.hang:
            await self._released.wait()

    def holds(self, name: str) -> bool:
        """Whether a request for model id / adapter `name` must wait at the gate now."""
        return self.hold and (not self.hold_only or name in self.hold_only)

    async def wait_unheld(self, name: str) -> None:
        """Block while the gate holds `name` (until released, or the request is aborted)."""
        while self.holds(name):
            await self._changed.wait()

    async def before_first_token(self, body: bytes) -> None:
        """The per-request faults: a poison request waits forever (until its client leaves), a
        marked one waits its long prefill."""
        if self.poison and self.poison.encode() in body:
            await asyncio.Event().wait()
        if self.long_prefill and self.long_prefill.encode() in body and self.long_prefill_ms:
            await asyncio.sleep(self.long_prefill_ms / 1000)

    def should_fail(self) -> bool:
        return self.error_rate > 0 and self._random.random() < self.error_rate
