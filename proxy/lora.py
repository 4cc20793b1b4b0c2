"""LoRA adapter management: route adapter requests only to replicas that hold the adapter, load
adapters on demand, evict the least recently used idle one, replicate hot adapters.

- Routing (the `lora` hook, proxy/routing/lora_hook.py): an adapter request's candidates are the
  healthy replicas whose adapter set (from discovery, or from this manager's own loads/unloads)
  holds the adapter; the routing profile picks among them, and the pick is re-checked against the
  adapter set in the same event-loop step in which the scheduler's lease counts the request in
  flight, so an eviction can never slip between.
- On demand: a deployment with `adapter_path` that no healthy replica holds is loaded with
  `POST /v1/load_lora_adapter` on the best replica (fewest adapters in use, then no eviction
  needed, then least load), once however many requests wait for it (single flight).
- `lora.max_adapters_per_replica`: before loading beyond it, the least recently used adapter of
  that replica with no request in flight (and that the proxy can load again) is taken out of
  routing and unloaded. Adapters with requests in flight are never unloaded.
- Failures: 503 naming the adapter, the replica and the cause; that (replica, adapter) pair is
  not tried again until an exponential backoff has passed.
- Replication: when every replica of an adapter is at the load bound (the prefix-affinity bound
  ceil((1 + eps) x fleet mean), and at least `replicate_min_in_flight`), load it on one more
  replica (up to `max_replicas`); when it has been cool for `cool_down_s`, drain one replica
  (out of routing first, unload once its in-flight requests ended). `min_replicas` are kept
  loaded by the background task, which also heals replicas restarted without their adapters.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter as Tally
from typing import Callable, Sequence

import httpx
import orjson

from proxy.config import ProxyConfig
from proxy.control import read_capped
from proxy.errors import ProxyError
from proxy.routing.affinity import rendezvous_weight
from proxy.routing.backends import Backend, rendezvous_salt
from proxy.routing.catalog import Route
from proxy.routing.clock import SYSTEM, Clock
from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.lora")


class ManagedAdapter:
    """An adapter the proxy may load (a deployment gave its `adapter_path`)."""

    __slots__ = ("name", "model", "path", "min_replicas", "max_replicas", "key", "placing", "growing", "cool_since")

    def __init__(self, name: str, model: str, path: str, min_replicas: int, max_replicas: int | None) -> None:
        self.name = name
        self.model = model
        self.path = path
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.key = rendezvous_salt(name)
        self.placing: asyncio.Task | None = None  # the single-flight first load
        self.growing: asyncio.Task | None = None  # a replication / min_replicas load
        self.cool_since: float | None = None


def _unavailable(message: str, code: str, retry_after: float = 1.0) -> ProxyError:
    seconds = max(1, math.ceil(retry_after))
    return ProxyError(
        503, message, code=code, type="service_unavailable",
        headers=[(b"retry-after", str(seconds).encode()), (b"retry-after-ms", str(int(seconds * 1000)).encode())],
    )


def _cause(status: int, body: bytes) -> str:
    """vLLM's error message from a failed admin call, else the raw text."""
    try:
        data = orjson.loads(body)
        inner = data.get("error", data) if isinstance(data, dict) else None
        message = inner.get("message") if isinstance(inner, dict) else inner
        if isinstance(message, str) and message:
            return message
    except orjson.JSONDecodeError:
        pass
    text = body[:300].decode("utf-8", "replace").strip()
    return text or f"HTTP {status}"


class LoraManager:
    def __init__(
        self,
        config: ProxyConfig,
        backends: list[Backend],
        session: Callable[[], httpx.AsyncClient],
        rebuild: Callable[[], None],
        ops=None,
        load: Callable[[Backend], int] | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.cfg = config.lora
        self.clock = clock
        self.epsilon = config.routing.prefix_affinity.epsilon
        self.backends = backends
        self._session = session
        self._rebuild = rebuild
        self._load_of = load or (lambda b: b.in_flight)
        self.managed: dict[str, ManagedAdapter] = {}
        for d in config.deployments or ():
            if d.adapter is not None and d.adapter_path is not None and d.adapter not in self.managed:
                self.managed[d.adapter] = ManagedAdapter(d.adapter, d.model, d.adapter_path, d.min_replicas, d.max_replicas)
        self._busy: set[tuple[str, str]] = set()  # (backend, adapter) with a load/unload/drain under way
        self._pending: Tally[str] = Tally()  # loads under way per backend (count toward the limit)
        self._backoff: dict[tuple[str, str], tuple[float, int, str]] = {}  # -> (until, failures, cause)
        self._freed = asyncio.Event()
        self._waiters = 0
        self._tasks = Supervisor("lora")  # a child of the Runtime's, from start()
        self.ops = ops  # the vllm_proxy_lora_operations counter (proxy/metrics.py), if any

    # --- hot path (the `lora` hook of the routing pipeline, proxy/routing/lora_hook.py) ----------

    async def holders(self, route: Route, candidates: Sequence[Backend]) -> Sequence[Backend]:
        """The candidates holding `route.adapter`; none: the replica it was just loaded on."""
        adapter = route.adapter
        have = [b for b in candidates if adapter in b.adapters]
        state = self.managed.get(adapter)
        if not have:
            if state is None:
                raise _unavailable(
                    f"No healthy replica has LoRA adapter `{adapter}` (model `{route.name}`) loaded; retry shortly.",
                    "no_healthy_backend",
                )
            return [await self._ensure(state)]
        if state is not None and self.cfg.replicate and state.growing is None:
            self._check_hot(state, have)
        return have

    @staticmethod
    def still_holds(backend: Backend, adapter: str) -> bool:
        """Checked after the pick, in the event-loop step that counts the request in flight, so an
        eviction can never slip between."""
        return adapter in backend.adapters and backend.healthy

    def released(self, backend: Backend, adapter: str) -> None:
        """A request for `adapter` on `backend` ended (the lease counted it down)."""
        if backend.adapter_in_flight.get(adapter, 0) <= 0 and self._waiters:
            self._freed.set()

    # --- placement ---------------------------------------------------------------------------

    def replicas(self, name: str) -> list[Backend]:
        return [b for b in self.backends if b.healthy and name in b.adapters]

    async def _ensure(self, state: ManagedAdapter) -> Backend:
        """A healthy replica holding `state`'s adapter, loading it once for all waiting requests."""
        task = state.placing
        if task is None or task.done():
            task = state.placing = self._spawn(self._place(state))
        # a client going away must not abort the load the others wait for
        return await asyncio.shield(task)

    async def _place(self, state: ManagedAdapter) -> Backend:
        deadline = self.clock.monotonic() + self.cfg.load_timeout_s
        while True:
            for b in self.backends:  # loaded meanwhile (discovery, replication, another route)
                if b.healthy and state.name in b.adapters and state.model in b.models:
                    return b
            target, victim, why = self._target(state)
            if target is not None:
                await self._load(target, state, victim, "on_demand", deadline)
                return target
            remaining = deadline - self.clock.monotonic()
            if why != "full" or remaining <= 0:
                raise self._cannot_place(state, why)
            await self._wait_freed(min(remaining, 0.25))

    def _cannot_place(self, state: ManagedAdapter, why: str) -> ProxyError:
        if why == "backoff":
            now = self.clock.monotonic()
            mine = [(v, k[0]) for k, v in self._backoff.items() if k[1] == state.name and v[0] > now]
            (until, _, cause), backend = min(mine)
            return _unavailable(
                f"LoRA adapter `{state.name}` cannot be loaded right now: the last attempt on replica {backend} "
                f"failed ({cause}); retrying after a backoff.", "adapter_load_failed", until - now,
            )
        if why == "full":
            return _unavailable(
                f"No replica has room for LoRA adapter `{state.name}`: each holds "
                f"max_adapters_per_replica={self.cfg.max_adapters_per_replica} adapters with requests in flight.",
                "adapter_capacity",
            )
        return _unavailable(
            f"No healthy replica serves `{state.model}`, the base model of LoRA adapter `{state.name}`; retry shortly.",
            "no_healthy_backend",
        )

    def _target(self, state: ManagedAdapter, redundant_only: bool = False) -> tuple[Backend | None, str | None, str]:
        """The best replica to load `state` on, the adapter to evict there first, or why none."""
        now = self.clock.monotonic()
        limit = self.cfg.max_adapters_per_replica
        best = best_key = victim_of_best = None
        why = "none"
        for b in self.backends:
            if not b.healthy or state.model not in b.models or state.name in b.adapters or (b.name, state.name) in self._busy:
                continue
            backoff = self._backoff.get((b.name, state.name))
            if backoff is not None and backoff[0] > now:
                why = "backoff" if why == "none" else why
                continue
            victim = None
            if limit is not None and len(b.adapters) + self._pending[b.name] >= limit:
                victim = self._victim(b, redundant_only)
                if victim is None:
                    why = "full"
                    continue
            in_use = sum(1 for n in b.adapter_in_flight.values() if n > 0)
            key = (in_use, victim is not None, self._load_of(b), len(b.adapters), -rendezvous_weight(state.key, b.salt))
            if best_key is None or key < best_key:
                best, best_key, victim_of_best = b, key, victim
        return best, victim_of_best, why

    def _victim(self, b: Backend, redundant_only: bool = False) -> str | None:
        """The adapter of `b` to unload for room: nothing in flight, reloadable by the proxy, not
        below its min_replicas; a copy some other replica also holds first, then least recently used."""
        found = None
        best = (True, math.inf)
        for name in b.adapters:
            state = self.managed.get(name)
            if state is None or b.adapter_in_flight.get(name, 0) > 0 or (b.name, name) in self._busy:
                continue
            copies = len(self.replicas(name))
            if copies <= state.min_replicas or (redundant_only and copies <= 1):
                continue
            key = (copies <= 1, b.adapter_used.get(name, 0.0))
            if key < best:
                found, best = name, key
        return found

    async def _load(
        self, b: Backend, state: ManagedAdapter, victim: str | None, reason: str, deadline: float | None = None
    ) -> None:
        key = (b.name, state.name)
        self._busy.add(key)
        self._pending[b.name] += 1
        b.adapter_ops += 1
        try:
            if victim is not None:
                await self._unload(b, victim, "evict")
            timeout = self.cfg.load_timeout_s if deadline is None else max(deadline - self.clock.monotonic(), 0.1)
            status, body = await self._post(b, "/v1/load_lora_adapter", {"lora_name": state.name, "lora_path": state.path}, timeout)
            cause = _cause(status, body) if status else body.decode()
            if status != 200 and not (status == 400 and "already" in cause):
                self._count(state.name, b, "load", reason, "error")
                _, failures, _ = self._backoff.get(key, (0.0, 0, ""))
                pause = min(self.cfg.backoff_s * 2 ** failures, self.cfg.backoff_max_s)
                self._backoff[key] = (self.clock.monotonic() + pause, failures + 1, cause)
                log.warning("loading LoRA adapter %s on %s failed: %s (backoff %.1fs)", state.name, b.name, cause, pause)
                raise _unavailable(
                    f"Could not load LoRA adapter `{state.name}` on replica {b.name}: {cause}", "adapter_load_failed"
                )
            self._backoff.pop(key, None)
            self._count(state.name, b, "load", reason, "ok")
            log.info("loaded LoRA adapter %s on %s (%s)", state.name, b.name, reason)
            b.adapter_used[state.name] = self.clock.monotonic()
            b.adapters = {**b.adapters, state.name: state.model}
            self._rebuild()
        finally:
            self._busy.discard(key)
            self._pending[b.name] -= 1
            b.adapter_ops -= 1
            b.adapter_epoch += 1

    def _claim(self, b: Backend, name: str) -> None:
        """Take `name` on `b` out of routing now (same event-loop step as the decision to unload)."""
        self._busy.add((b.name, name))
        b.adapter_ops += 1
        self._forget(b, name)

    async def _unload(self, b: Backend, name: str, reason: str, claimed: bool = False) -> None:
        """Unload once no request is in flight for it (eviction only ever picks idle adapters)."""
        key = (b.name, name)
        if not claimed:
            self._claim(b, name)
        try:
            while b.adapter_in_flight.get(name, 0) > 0:  # drains only; eviction picks idle adapters
                await self._wait_freed(0.25)
            status, body = await self._post(b, "/v1/unload_lora_adapter", {"lora_name": name}, self.cfg.load_timeout_s)
            ok = status in (200, 404)
            self._count(name, b, "unload", reason, "ok" if ok else "error")
            if ok:
                log.info("unloaded LoRA adapter %s from %s (%s)", name, b.name, reason)
            else:
                log.warning("unloading LoRA adapter %s from %s failed: %s", name, b.name, _cause(status, body))
        finally:
            self._busy.discard(key)
            b.adapter_ops -= 1
            b.adapter_epoch += 1

    def _forget(self, b: Backend, name: str) -> None:
        if name in b.adapters:
            b.adapters = {k: v for k, v in b.adapters.items() if k != name}
            self._rebuild()

    async def _post(self, b: Backend, path: str, payload: dict, timeout: float) -> tuple[int, bytes]:
        async def exchange() -> tuple[int, bytes]:
            async with self._session().stream("POST", b.url + path, content=orjson.dumps(payload), headers=b.headers,
                                              timeout=timeout) as resp:
                return resp.status_code, await read_capped(resp)

        try:
            return await asyncio.wait_for(exchange(), timeout)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            return 0, f"timed out after {timeout:.1f}s".encode()
        except (httpx.HTTPError, ValueError) as exc:
            return 0, (str(exc) or type(exc).__name__).encode()

    async def _wait_freed(self, timeout: float) -> None:
        self._waiters += 1
        try:
            await asyncio.wait_for(self._freed.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters -= 1
            if not self._waiters:
                self._freed.clear()

    # --- replication -------------------------------------------------------------------------

    def _bound(self, model: str) -> int:
        fleet = [b for b in self.backends if b.healthy and model in b.models]
        if not fleet:
            return self.cfg.replicate_min_in_flight
        total = sum(self._load_of(b) for b in fleet)
        cap = math.ceil((1.0 + self.epsilon) * (total + 1) / len(fleet))
        return max(cap, self.cfg.replicate_min_in_flight)

    def _check_hot(self, state: ManagedAdapter, have: list[Backend]) -> None:
        """Every replica of the adapter is at the bound: spread it to one more (background)."""
        limit = state.max_replicas or len(self.backends)
        if len(have) >= limit:
            return
        bound = self._bound(state.model)
        for b in have:
            if self._load_of(b) + 1 <= bound:
                return
        state.cool_since = None
        state.growing = self._spawn(self._grow(state, "replicate"))

    async def _grow(self, state: ManagedAdapter, reason: str) -> None:
        try:
            # spreading one adapter never takes the only copy of another
            target, victim, _ = self._target(state, redundant_only=reason == "replicate")
            if target is not None:
                await self._load(target, state, victim, reason)
        except ProxyError:
            pass  # logged and backed off in _load
        finally:
            state.growing = None

    def _rebalance(self) -> None:
        now = self.clock.monotonic()
        for state in self.managed.values():
            reps = self.replicas(state.name)
            if len(reps) < state.min_replicas and state.growing is None:
                state.growing = self._spawn(self._grow(state, "min_replicas"))
                continue
            keep = max(state.min_replicas, 1)
            if not self.cfg.replicate or len(reps) <= keep:
                state.cool_since = None
                continue
            total = sum(b.adapter_in_flight.get(state.name, 0) for b in reps)
            if total > (len(reps) - 1) * self.cfg.replicate_min_in_flight // 2:
                state.cool_since = None
            elif state.cool_since is None:
                state.cool_since = now
            elif now - state.cool_since >= self.cfg.cool_down_s:
                state.cool_since = now
                drop = min(
                    (b for b in reps if (b.name, state.name) not in self._busy),
                    key=lambda b: (b.adapter_in_flight.get(state.name, 0), b.adapter_used.get(state.name, 0.0)),
                    default=None,
                )
                if drop is not None:
                    self._claim(drop, state.name)  # out of routing now, unloaded once drained
                    self._spawn(self._unload(drop, state.name, "shrink", claimed=True))

    # --- lifecycle ---------------------------------------------------------------------------

    def _spawn(self, coro) -> asyncio.Task:
        """A load, unload or drain; a ProxyError is its outcome (logged and backed off in _load)."""
        return self._tasks.spawn(coro, "LoRA adapter operation", expected=(ProxyError,))

    def _count(self, adapter: str, b: Backend, op: str, reason: str, outcome: str) -> None:
        if self.ops is not None:
            self.ops.labels(adapter, b.name, op, reason, outcome).inc()

    def start(self, tasks: Supervisor) -> None:
        self._tasks = tasks.child("lora")
        if self.managed:
            self._tasks.spawn(self._run(), "LoRA rebalance")

    async def _run(self) -> None:
        while True:
            try:
                self._rebalance()
            except Exception:  # never let the loop die
                log.exception("LoRA rebalance failed")
            await asyncio.sleep(self.cfg.rebalance_interval_s)

    def snapshot(self) -> dict:
        """Where each adapter is and how busy (for tests, debugging)."""
        return {
            b.name: {a: b.adapter_in_flight.get(a, 0) for a in b.adapters} for b in self.backends
        }
