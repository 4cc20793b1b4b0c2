"""The scheduler: runs a routing profile for one request and returns a **lease** on the replica.

The lease counts the request in flight on its replica (and on its LoRA adapter) from the moment
of the pick, in the same event-loop step as the last check that the replica may take it, so no
eviction, drain or admission check can slip in between; `with lease:` releases it (and wakes a
request waiting for a slot). Retries take a new lease.

Per request: filters (a filter that `waits` empties the set only while every replica is at its
limit: then the request waits in the admission queue and the filters run again); the hooks'
`before_pick` (LoRA: only the replicas holding the adapter, loading it on demand); the policy's
pick (scorers and picker, or a single proposing plugin such as prefix_affinity); the hooks'
`after_pick` (a replica that can no longer take it is dropped and the pick runs again).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Final, Sequence

from proxy.errors import ProxyError
from proxy.routing.backends import Backend
from proxy.routing.catalog import Route
from proxy.routing.clock import SYSTEM, Clock

if TYPE_CHECKING:
    from proxy.admission import Admission
    from proxy.parse import ParsedRequest
    from proxy.routing.profiles import Profile

_REPICKS: Final = 4  # picks an after_pick hook may refuse before the request gets a 503


class Lease:
    """One request's claim on one replica; also the request's context while it is scheduled."""

    __slots__ = ("scheduler", "route", "request", "trusted_only", "tried", "backend", "reason", "status", "held")

    def __init__(self, scheduler: "Scheduler", route: Route, request: "ParsedRequest | None",
                 trusted_only: bool = False, tried: Sequence[Backend] | None = None) -> None:
        self.scheduler = scheduler
        self.route = route
        self.request = request
        self.trusted_only = trusted_only
        self.tried = tried
        self.held = False  # counted in flight on `backend` (until released; `backend` stays for the log)
        self.status: str | None = None  # the response status (set by the data path), for after_response hooks
        # backend, reason: set when picked

    def acquire(self, backend: Backend, reason: str) -> None:
        self.backend = backend
        self.reason = reason
        self.held = True
        backend.in_flight += 1
        adapter = self.route.adapter
        if adapter is not None:
            counts = backend.adapter_in_flight
            counts[adapter] = counts.get(adapter, 0) + 1
            backend.adapter_used[adapter] = self.scheduler.clock.monotonic()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        """Release: out of the in-flight (and adapter) counts, hooks told, a waiting request woken."""
        if not self.held:
            return
        self.held = False
        backend = self.backend
        backend.in_flight -= 1
        scheduler = self.scheduler
        adapter = self.route.adapter
        if adapter is not None:
            counts = backend.adapter_in_flight
            counts[adapter] = counts.get(adapter, 1) - 1
            backend.adapter_used[adapter] = scheduler.clock.monotonic()
            for hook in scheduler.done_adapter:
                hook.after_response(self)
        else:
            for hook in scheduler.done_all:
                hook.after_response(self)
        scheduler.admission.released()

    def __repr__(self) -> str:
        return f"Lease({self.route.name!r}, {getattr(self.backend, 'name', None)!r}, {getattr(self, 'reason', '')!r})"


def no_backend(route: Route) -> ProxyError:
    return ProxyError(
        503, f"No healthy replica can serve `{route.name}` right now; retry shortly.",
        code="no_healthy_backend", type="service_unavailable",
        headers=[(b"retry-after", b"1"), (b"retry-after-ms", b"1000")],
    )


class Scheduler:
    """A profile bound to one Runtime's services (admission queue, clock). `policy` is the pick
    step (the tracing wrapper may stand in for it)."""

    def __init__(self, profile: "Profile", admission: "Admission", clock: Clock = SYSTEM) -> None:
        self.profile = profile
        self.policy = profile.policy
        self.admission = admission
        self.clock = clock
        self.filters = tuple(profile.filters)
        self._usual = tuple(f for f in self.filters if f.only_when is None)  # when neither trusted_only nor tried
        hooks = profile.hooks
        self._before_all = tuple(h for h in hooks if not h.adapter_only and _overrides(h, "before_pick"))
        self._before_adapter = tuple(h for h in hooks if _overrides(h, "before_pick"))
        self._after_all = tuple(h for h in hooks if not h.adapter_only and _overrides(h, "after_pick"))
        self._after_adapter = tuple(h for h in hooks if _overrides(h, "after_pick"))
        self.done_all = tuple(h for h in hooks if not h.adapter_only and _overrides(h, "after_response"))
        self.done_adapter = tuple(h for h in hooks if _overrides(h, "after_response"))
        self._plain = not self._before_all and not self._after_all  # no hook before or after a plain pick
        # the policy's synchronous pick whose bookkeeping waits for `settle` (prefix_affinity's),
        # looked up on its class: a wrapper (tracing) has none and is awaited as usual
        self._now_of: object = None
        self._pick_now: Callable[..., tuple[Backend | None, str]] | None = None
        # that policy's `settle`: the bookkeeping `schedule_now` left, which the data path runs once
        # the request is on its way to the replica (None: nothing is ever left)
        self.settle: Callable[[], None] | None = None

    async def schedule(self, route: Route, request: "ParsedRequest", trusted_only: bool = False,
                       tried: Sequence[Backend] | None = None) -> Lease:
        """A lease on the replica for this request, counted in flight; or the 503/429 why none."""
        lease = Lease(self, route, request, trusted_only, tried)
        filters = self.filters if trusted_only or tried else self._usual
        while (candidates := self._candidates(route, lease, filters)) is None:
            await self.admission.wait()
        if route.adapter is None and self._plain:
            if not candidates:
                raise no_backend(route)
            backend, reason = await self.policy.pick(candidates, request, route)
            lease.acquire(backend, reason)  # (no await between the pick and the count)
            return lease
        before, after = (self._before_adapter, self._after_adapter) if route.adapter else (self._before_all, self._after_all)
        for _ in range(_REPICKS):
            for hook in before:
                candidates = await hook.before_pick(candidates, lease)
            if not candidates:
                raise no_backend(route)
            backend, reason = await self.policy.pick(candidates, request, route)
            # from here to the count below: no await (the lease's promise)
            for hook in after:
                if not hook.after_pick(backend, lease):
                    break
            else:
                lease.acquire(backend, reason)
                return lease
            candidates = [b for b in candidates if b is not backend]
        raise ProxyError(
            503, f"The replicas of `{route.name}` keep changing under the scheduler; retry shortly.",
            code="no_healthy_backend", type="service_unavailable",
            headers=[(b"retry-after", b"1"), (b"retry-after-ms", b"1000")],
        )

    def _candidates(self, route: Route, lease: Lease, filters: Sequence) -> Sequence[Backend] | None:
        """The replicas the filters leave; None when a filter that `waits` emptied the set (every
        replica at its limit: the request waits for a slot)."""
        candidates: Sequence[Backend] = route.backends
        for f in filters:
            kept = f.apply(candidates, lease)
            if not kept and candidates and f.waits:
                return None
            candidates = kept
        return candidates

    def schedule_now(self, route: Route, request: "ParsedRequest") -> Lease | None:
        """The lease `schedule` would give, when getting it waits for nothing: no LoRA adapter or
        hook, a replica free, a pick that awaits nothing (every built-in one). None: nothing was
        counted; `schedule` (in a task) decides instead (proxy/fastpath.py)."""
        if route.adapter is not None or not self._plain:
            return None
        lease = Lease(self, route, request)
        candidates = self._candidates(route, lease, self._usual)
        if not candidates:
            return None
        policy = self.policy
        if policy is not self._now_of:
            self._now_of = policy
            self._pick_now = getattr(policy, "pick_now", None) if hasattr(type(policy), "pick_now") else None
            self.settle = getattr(policy, "settle", None) if self._pick_now is not None else None
        pick_now = self._pick_now
        if pick_now is not None:
            backend, reason = pick_now(candidates, request, route)
            if backend is None:  # the pick waits for something (it counted nothing): `schedule` awaits it
                return None
        else:
            pick = policy.pick(candidates, request, route)
            try:
                pick.send(None)
            except StopIteration as done:
                backend, reason = done.value
            else:  # (a plugin's pick that awaits: abandoned before it counted anything, as a cancelled one)
                pick.close()
                return None
        lease.acquire(backend, reason)
        return lease

    def lease(self, route: Route, backend: Backend, reason: str, request: "ParsedRequest | None" = None) -> Lease:
        """A lease on a replica chosen outside the profile (a Responses API continuation must go
        to the replica holding its conversation)."""
        lease = Lease(self, route, request)
        lease.acquire(backend, reason)
        return lease


def _overrides(hook: object, method: str) -> bool:
    from proxy.routing.plugins import Hook

    return getattr(type(hook), method) is not getattr(Hook, method)
