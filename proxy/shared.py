"""State shared by every proxy process through Redis: tenant placements, the prefix entries that
continuations need, and the load view — with **no Redis round trip on the request path**.

Each proxy keeps a local mirror and the request path only reads it (`longest`, `pins`) or
changes it (`place`, `grow`, `set_pin`, `remember`), synchronously. Behind it:

- a **flusher** sends the changes in one atomic script per batch (`_FLUSH`): index entries,
  unconditional placement writes, set-if-absent placements of new tenants (first writer wins)
  and compare-and-set growths, and the prompts its coalescing leaders are computing. Placement
  changes and those wake it at once; index entries ride along or go every
  `busy_sync_interval_s`. The script appends everything it changed to one Redis stream;
- a **reader** follows that stream (XREAD BLOCK on a connection of its own) and applies the
  other proxies' entries: a tenant another proxy placed first is adopted as soon as its entry
  arrives (milliseconds), and a proxy that lost a placement race adopts the winner from its own
  script's answer. A stream rather than pub/sub: the log is ordered with the table writes (one
  script does both), a proxy that joins reads the recent past (conversations started before
  it), and a short disconnect resumes from its cursor instead of losing messages; measured
  (`python -m loadtest.shared_delivery`), a change reaches a follower in ~0.3 ms against ~0.2 ms
  for pub/sub, both far below the flush interval;
- a **sync** loop publishes this proxy's per-replica in-flight counts, smoothed routed counts
  and busiest tenants (with its routed counts over the last quarter load window) a few times a
  second, and reads everyone else's.

Both go at `busy_sync_interval_s` while requests are routed and another proxy shares the state.
A proxy that has seen no other for `_ALONE_AFTER_S` (none of their load entries, balance
windows or stream entries) goes at `_ALONE_ROUNDS` times that (at most `sync_interval_s`):
nobody reads its view, and the rounds cost a single proxy at c=32 ~5 % of its throughput
(`python -m loadtest.overhead`, docs/BENCHMARKS.md). A proxy that joins is seen at its first
sync (it publishes its load at once) and, alone until it sees the others, reads them at its
first sync too.

On (re)connect a proxy writes back the placements Redis lacks (a Redis restarted empty gets
the fleet's table back), then reads the whole table once and follows the stream from before
that read. Slow or absent Redis therefore never delays a request: routing goes on from the
mirror (new tenants fall back to rendezvous order while Redis is down), the outage is logged
once and shown in `vllm_proxy_redis_up`, and the proxy reconnects by itself.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import math
import os
import time
from collections import OrderedDict
from typing import Callable, Sequence

import orjson
import redis.asyncio as redis

from proxy.routing.index import longest_match
from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.shared")

LOAD_KEY = "vp:load"
TENANTS_KEY = "vp:tenants"  # field: proxy id -> its busiest tenants' decayed request counts (JSON)
# the others' tenant counts (`SharedState.other_tenants`): tenant -> decayed requests, all requests,
# tenant -> (all requests of the proxies that count it, their requests since it appeared there)
Others = tuple[dict[int, float], float, dict[int, tuple[float, float]]]
_TENANTS_EVERY_S = 1.0  # how often a proxy publishes them...
# ... or after this many requests routed here, whichever comes first: a new population's tenants
# reach the others' packing repair within as many requests at any rate (at 10x a benchmark's
# rate, 1 s was most of a phase)
_TENANTS_EVERY_REQUESTS = 32
_TENANTS_MIN_S = 0.25  # but not more often than this (the payload is up to _TENANTS_TOP tenants)
_TENANTS_TOP = 2048  # tenants per proxy published (the planner moves the ones that carry traffic)
HOT_KEY = "vp:hot"  # field: proxy id -> its busy tenants' decayed requests on both of their windows (JSON)
# (the tenants' growth and shrinking rest on their shares: from a third of the requests with three
# proxies, a tenant turning hot grew later and spilled meanwhile; published each busy sync)
# the others' busy tenants, as one proxy published them: its age (s), and per tenant its decayed
# requests on the tenants' long and short windows and all requests there since it appeared
HotTenants = tuple[float, list[tuple[int, float, float, float, float]]]
GUARD_KEY = "vp:guard"  # field: proxy id|route -> its balance window: replicas, decisions, counts (JSON)
# a window published longer ago than one load window (`rate_tau`: load_window_requests at the
# measured rate, so the same number of requests at any rate), or this, is not counted: that
# proxy went idle or away
_GUARD_FRESH_S = 1.0
# the other proxies' balance windows of one (route, replicas), summed: decisions in their windows,
# replica -> its count there, and for the stretch bound the decisions and replica -> picks they
# made since this proxy first saw them (only ever growing while the same proxies stay)
RemoteWindow = tuple[int, dict[str, int], int, dict[str, int]]
# this proxy's window of one route as it publishes it: replicas sorted, decisions in the window,
# their counts, recent overflows (pin, replica, wall time), and decisions and picks since it began
LocalWindow = tuple[tuple[str, ...], int, list[int], list[tuple[int, str, float]], int, list[int]]
PINS_KEY = "vp:pins"  # field: pin key (hex) -> "replica,replica,...|unix time of the last write"
LOG_KEY = "vp:log"  # stream of changes: p = proxy id, i = index entries, t = placements changed, r = recent counts
_LOG_MAXLEN = 10000  # entries kept (at most one per proxy and flush, up to 50 a second): the recent past, bounded
_WARM_PER_ENTRY = 256  # "being computed" items applied per stream entry (a hostile entry stalls nothing)
_READ_COUNT = 500  # stream entries per read
_OPS_BATCH = 500  # placement operations per script call
_MIRROR_BLOCKS = 262144  # prefix entries mirrored (an LRU): enough for every replica's cache
_EXPIRE_EVERY_S = 10.0  # how often expired placements are dropped
_ALONE_AFTER_S = 2.0  # no other proxy seen for this long: this one is alone...
_ALONE_ROUNDS = 5.0  # ... and syncs and flushes this many busy intervals apart

# One batch of changes, atomically, then one stream entry naming what changed. ARGV: proxy id,
# stamp, stream max length, index entries (JSON or ''), prompts being computed (JSON or '',
# proxy/routing/affinity/coalesce.py), the sender's recent routed counts and its balance windows
# (JSON or '': they ride an entry written for the others), then operations (op, pin, argument
# count, arguments...):
#   S value          set (grow, shrink, re-home, refresh): last writer wins
#   N value          set if absent (republishing a mirror to a Redis that restarted empty)
#   G old value      compare-and-set of the members (proxies growing one tenant agree on one set)
#   P r n            place a new tenant on the caller's choice unless another proxy placed it
#                    first (then the caller adopts that). Not corrected by the table's counts:
#                    the caller's request already went to its choice, and moving the tenant
#                    elsewhere copied its prompt to a second cache and stranded the
#                    conversations it started there (the balance guard and the packing repair
#                    even out what proxies placing at once put on one replica).
# Returns {last stream id, pin, value in force, '1' if this call wrote it else '', ...} for the P
# and G operations.
_FLUSH = """
local changed, n, out = {}, 0, {}
local i = 8
while i <= #ARGV do
  local op, pin, argc = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local a = i + 3
  local cur = redis.call('hget', KEYS[1], pin)
  local value = cur
  if op == 'S' then
    value = ARGV[a]
  elseif op == 'N' then
    if not cur then value = ARGV[a] end
  elseif op == 'G' then
    local members = cur and string.match(cur, '^(.*)|[^|]*$') or cur
    if members == ARGV[a] or not cur then value = ARGV[a + 1] end
  elseif op == 'P' and not cur then
    value = ARGV[a] .. '|' .. ARGV[2]
  end
  if value and value ~= cur then
    redis.call('hset', KEYS[1], pin, value)
    changed[pin] = value
    n = n + 1
  end
  if op == 'P' or op == 'G' then
    out[#out + 1] = pin
    out[#out + 1] = value or ''
    out[#out + 1] = (value and value ~= cur) and '1' or ''
  end
  i = a + argc
end
local id
if n > 0 or ARGV[4] ~= '' or ARGV[5] ~= '' then
  id = redis.call('xadd', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'p', ARGV[1], 'i', ARGV[4],
                  't', n > 0 and cjson.encode(changed) or '', 'w', ARGV[5], 'r', ARGV[6], 'g', ARGV[7])
else
  local last = redis.call('xrevrange', KEYS[2], '+', '-', 'COUNT', 1)
  id = last[1] and last[1][1] or '0-0'
end
table.insert(out, 1, id)
return out
"""

# take a lease when free, or renew it when the caller holds it
_LEASE = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1 end
return 0
"""


def _window_entry(window: LocalWindow, now: float) -> dict:
    """A balance window as the others read it (the load sync's hash, the change stream's `g`)."""
    names, filled, counts, overflow, decided, picks = window
    return {"at": now, "names": names, "filled": filled, "counts": counts,
            "overflow": [(f"{pin:016x}", name, at) for pin, name, at in overflow],
            "decided": decided, "picks": picks}


def parse_pin(value: str) -> tuple[tuple[str, ...], float]:
    members, _, stamp = value.rpartition("|")
    try:
        at = float(stamp)
    except ValueError:
        members, at = value, 0.0
    return tuple(m for m in members.split(",") if m), at


def format_pin(members: Sequence[str], at: float) -> str:
    return f"{','.join(members)}|{at:.0f}"


def stream_id(value: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a comparable pair."""
    ms, _, seq = value.partition("-")
    return int(ms), int(seq or 0)


class SharedState:
    def __init__(
        self,
        url: str,
        *,
        ttl_s: float = 600.0,
        timeout_s: float = 0.05,
        sync_interval_s: float = 0.1,
        busy_sync_interval_s: float = 0.02,
        local_load: Callable[[], dict[str, int]],
        on_status: Callable[[bool], None] = lambda up: None,
        max_connections: int = 16,
        mirror_blocks: int = _MIRROR_BLOCKS,
    ) -> None:
        # Nothing here runs on the request path, so background calls get a timeout that a slow
        # Redis (or network) does not trip; `timeout_s` scales it for configurations that set it.
        self.io_timeout = max(timeout_s * 20, 1.0)
        self.max_connections = max(4, max_connections)
        quiet = {"decode_responses": True, "health_check_interval": 0}
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=self.max_connections, timeout=self.io_timeout, socket_timeout=self.io_timeout,
            socket_connect_timeout=self.io_timeout, **quiet,
        )
        self.client = redis.Redis(connection_pool=pool, retry=None)
        # the flusher and the stream reader each keep a connection of their own, always open: a
        # placement never waits for a pooled connection (or a new one) behind the load sync
        self._flush_client = redis.Redis.from_url(
            url, socket_timeout=self.io_timeout, socket_connect_timeout=self.io_timeout, retry=None,
            single_connection_client=True, **quiet,
        )
        self._read_block_ms = 1000
        self._reader_client = redis.Redis.from_url(  # XREAD BLOCK holds its connection
            url, socket_timeout=self.io_timeout + self._read_block_ms / 1000, socket_connect_timeout=self.io_timeout,
            retry=None, single_connection_client=True, **quiet,
        )
        self.ttl = int(ttl_s)
        self.timeout = timeout_s
        self.sync_interval = sync_interval_s
        # while requests are routed the load view and prefix entries go out this often: the other
        # proxies' view lags by what this proxy routes in that time, so the busier, the shorter
        self.busy_interval = min(busy_sync_interval_s, sync_interval_s)
        self.busy = False  # a request was routed since the last load sync (the policy sets it)
        self.alone_interval = min(self.busy_interval * _ALONE_ROUNDS, sync_interval_s)  # (busy_interval <= it)
        self.peers_at = -math.inf  # monotonic time another proxy's entry was last read (`alone`)
        self.local_load = local_load
        self.on_status = on_status
        self.proxy_id = f"{os.uname().nodename}:{os.getpid()}:{id(self):x}"
        self.up = False
        self._said_down = False
        # the packing repair's reads, kept a while (it asks every rebalance_every_requests: at 20k
        # requests a second, 70 times a second, two round trips each cost 4-6 % of the throughput):
        # lease name -> (monotonic time the answer stands until, held); (until, the others' tenants)
        self._leases: dict[str, tuple[float, bool]] = {}
        self._tenants_read: tuple[float, Others] | None = None
        self.remote_load: dict[str, int] = {}
        # smoothed routed counts of the other proxies, decayed to `remote_rate_at` (unix time)
        self.remote_rate: dict[str, float] = {}
        self.remote_rate_at = 0.0
        self.rate_tau = 30.0
        self.local_rates: Callable[[float], dict[str, float]] | None = None  # set by the policy
        # the others' routed counts over a quarter load window (where their traffic goes now), summed
        # and decayed to `remote_recent_at` (unix time); each proxy's as last heard, on the change
        # stream or with its busy tenants (`_hot`): proxy -> (its time, counts); this proxy's (set by
        # the policy)
        self.remote_recent: dict[str, float] = {}
        self.remote_recent_at = 0.0
        self._recents: dict[str, tuple[float, dict[str, float]]] = {}
        self._recents_heard = False  # a stream entry brought some since they were last summed
        self.local_recent: Callable[[], dict[str, float]] | None = None
        # (tenant -> decayed requests routed here, all requests, tenant -> those of all since it
        # appeared here) at a time, or None; set by the policy (`TenantStats.requests`)
        self.local_tenants: Callable[[float], tuple[dict[int, float], float, dict[int, float]] | None] | None = None
        self._tenants_at = 0.0
        self.routed = 0  # requests routed here (the policy counts them), for the tenants' cadence
        self._tenants_routed = 0
        # the balance guard's windows (route -> `LocalWindow`), set by the policy; the others',
        # summed per (route, replicas) (`RemoteWindow`)
        self.local_guard: Callable[[], dict[str, LocalWindow]] | None = None
        # the same for the change stream: windows that decided since the last entry (`flush`)
        self.stream_guard: Callable[[], dict[str, LocalWindow]] | None = None
        # (route, replicas, [(pin, replica, wall)]): the other proxies' recent overflows
        self.adopt_overflows: Callable[[str, tuple[str, ...], list[tuple[int, str, float]]], None] | None = None
        self.remote_guard: dict[tuple[str, tuple[str, ...]], RemoteWindow] = {}
        # this proxy's busy tenants (as in `HotTenants`), and where the others' go at each read
        # (every `HotTenants` fresh; [] once Redis is down); set by the policy
        self.local_hot: Callable[[], list[tuple[int, float, float, float, float]]] | None = None
        self.on_hot: Callable[[list[HotTenants]], None] | None = None
        self._guard_fields: set[str] = set()
        # the others' windows as last read: field -> (its raw value, parsed); one that did not
        # change (no decision there since) is not parsed again
        self._guard_read: dict[str, tuple[str, tuple]] = {}
        # the stretch bound's view of the others: per field, its totals as last read; per (route,
        # replicas), the decisions and picks they made since first seen, summed (they only grow)
        self._guard_totals: dict[str, tuple[int, list[int]]] = {}
        self._guard_accrued: dict[tuple[str, tuple[str, ...]], tuple[int, dict[str, int]]] = {}
        # the others' windows as the last load sync read them (field -> raw value), and as the
        # change stream brought them since: field -> (stamp, raw value); the newer of the two counts
        self._guard_table: dict[str, str] = {}
        self._guard_heard: dict[str, tuple[float, str]] = {}
        self._guard_new = False
        # mirror of the placement table: pin -> (members, stamp); `pins_changed` bumps on bulk changes
        self.pins: dict[int, tuple[tuple[str, ...], float]] = {}
        self.pins_changed = 0
        # mirror of the prefix index (block hash -> replica that last computed it, any proxy)
        self.owner: OrderedDict[int, str] = OrderedDict()
        self.mirror_blocks = mirror_blocks
        self.mirrored = False  # the mirror has been filled from Redis at least once
        self._ops: dict[int, tuple[str, ...]] = {}  # pin -> placement operation not sent yet
        self._pending: dict[int, str] = {}  # index entries not sent yet
        self._warm: list[tuple[str, str, bool, float]] = []  # prompts being computed here, not sent yet
        # (pin, replica, computing, seconds since): another proxy's leader began or ended; pin None:
        # nothing more will be heard of them (Redis went away), every one ended (set by the policy)
        self.on_warming: Callable[[int | None, str, bool, float], None] | None = None
        self.warm_ttl = 2.0  # an older "being computed" entry is ignored (the leaders' wait bound)
        self._wake = asyncio.Event()
        self._cursor = "0-0"  # last stream entry applied
        self._cursor_key = (0, 0)
        self._last_sent = (0, 0)  # id of the stream's last entry when this proxy's last flush ran
        self._reading = asyncio.Event()  # set while the cursor is valid (after a resync)
        self.adopted = 0  # placements changed by another proxy's entry or a lost race
        # tenants placed here whose requests wait for the shared table's answer (a future of the
        # members in force: proxy/routing/affinity/arrivals.py)
        self.claims: dict[int, asyncio.Future] = {}
        # answers that another proxy placed the tenant first, held until the reader reaches them:
        # (stream id of the answer, pin, (members in force, False))
        self._answered: list[tuple[tuple[int, int], int, tuple[tuple[str, ...], bool]]] = []
        self._tasks = Supervisor("shared")  # a child of the Runtime's, from start()
        # the loops also end on this flag: on Python < 3.12 wait_for can swallow a cancellation
        self._closing = False

    # -- request path: the mirror only, never a network call ------------------------------------
    def longest(self, chain: Sequence[int]) -> tuple[int, str | None] | None:
        """Longest prefix match known fleet-wide, or None before the mirror was first filled
        (then the caller's local index decides)."""
        if not self.mirrored:
            return None
        return longest_match(self.owner, chain)

    def place(self, pin: int, replica: str) -> tuple[str, ...] | None:
        """Place a new tenant on `replica` at once; the shared table reconciles in the background
        (the first proxy to place it wins; see _FLUSH). None while Redis is down (then the caller
        uses rendezvous order, which every proxy agrees on without talking)."""
        if not self.up:
            return None
        members = (replica,)
        self.pins[pin] = (members, time.time())
        self._queue(pin, ("P", replica))
        return members

    def claim(self, pin: int) -> asyncio.Future | None:
        """The placement of `pin` queued here, as the shared table will answer it: a future of
        (the members in force, whether this proxy's placement made them), or None if Redis could
        not say. None when no placement of `pin` is queued."""
        future = self.claims.get(pin)
        if future is None:
            op = self._ops.get(pin)
            if op is None or op[0] != "P":
                return None
            future = self.claims[pin] = asyncio.get_running_loop().create_future()
        return future

    def _unclaim(self) -> None:
        """No answer will come: whoever waits for one goes now."""
        self._release_answered(all_=True)
        claims, self.claims = self.claims, {}
        for future in claims.values():
            if not future.done():
                future.set_result(None)

    def alone(self) -> bool:
        """No other proxy's entry seen of late (in the load table or the change stream)."""
        return time.monotonic() - self.peers_at > _ALONE_AFTER_S

    def grow(self, pin: int, old: Sequence[str], members: Sequence[str]) -> tuple[str, ...] | None:
        """Change a tenant's set from `old` to `members` at once; in the background a
        compare-and-set on the shared table, so when another proxy changed it first, both adopt
        its set. None while Redis is down."""
        if not self.up:
            return None
        now = time.time()
        self.pins[pin] = (tuple(members), now)
        self._queue(pin, ("G", ",".join(old), format_pin(members, now)))
        return tuple(members)

    def set_pin(self, pin: int, members: Sequence[str]) -> None:
        """Change a tenant's replica set (shrink, re-home, refresh): local now, Redis on flush."""
        now = time.time()
        self.pins[pin] = (tuple(members), now)
        if self.up:
            self._queue(pin, ("S", format_pin(members, now)))

    def remember(self, hashes: Sequence[int], backend: str) -> None:
        """Record prefix entries in the mirror now; the flusher sends them with its next batch."""
        owner = self.owner
        up = self.up
        for h in hashes:
            owner[h] = backend
            owner.move_to_end(h)
            if up:
                self._pending[h] = backend
        while len(owner) > self.mirror_blocks:
            owner.popitem(last=False)

    def warming(self, pin: int, replica: str, computing: bool) -> None:
        """A leader of this proxy began (or ended) computing a tenant's prompt on `replica`: the
        other proxies' followers wait for it too. Sent at once."""
        if self.up:
            self._warm.append((f"{pin:016x}", replica, computing, time.time()))
            self._wake.set()

    def _queue(self, pin: int, op: tuple[str, ...]) -> None:
        self._ops[pin] = op
        self._wake.set()

    def interval(self) -> float:
        """The busy period of the sync and the flusher: longer while no other proxy is seen."""
        return self.alone_interval if self.alone() else self.busy_interval

    # -- background calls (never on the request path) -------------------------------------------
    async def lease(self, name: str, seconds: float) -> bool:
        """True while this proxy holds `name`: taken when free, renewed for `seconds` by its
        holder; False for the others or when Redis cannot answer now."""
        if not self.up:
            return False
        asked = time.monotonic()
        known = self._leases.get(name)
        if known is not None and asked < known[0]:
            return known[1]
        try:
            held = await asyncio.wait_for(
                self.client.eval(_LEASE, 1, f"vp:lease:{name}", self.proxy_id, max(int(seconds * 1000), 1)),
                self.io_timeout) == 1
        except Exception as exc:
            self._down(exc)
            return False
        # the answer stands for half the lease: its holder renews it well before it lapses, and the
        # others ask again at most half a lease after a holder that stopped would have lost it
        self._leases[name] = (asked + seconds / 2, held)
        return held

    async def other_tenants(self) -> Others | None:
        """The other proxies' published tenant counts (decayed to now), their total, and per
        tenant (the total of the proxies that count it, their requests since it appeared there):
        with N proxies each sees 1/N of every tenant's requests, too few to tell a light tenant's
        share from zero. One read, for the packing repair, kept for half the shortest publication
        period; None when Redis cannot answer now."""
        asked = time.monotonic()
        kept = self._tenants_read
        if kept is not None and asked < kept[0]:
            return kept[1]
        try:
            table = await asyncio.wait_for(self.client.hgetall(TENANTS_KEY), self.io_timeout)
        except Exception:
            return None
        now = time.time()
        rates: dict[int, float] = {}
        listed: dict[int, tuple[float, float]] = {}
        total = 0.0
        stale = []
        for proxy, value in table.items():
            if proxy == self.proxy_id:
                continue
            try:
                payload = orjson.loads(value)
                age = max(now - float(payload["at"]), 0.0)
                if age > 5 * _TENANTS_EVERY_S + 5 * self.sync_interval:  # that proxy is gone
                    stale.append(proxy)
                    continue
                decay = math.exp(-age / self.rate_tau)
                whole = float(payload["total"]) * decay
                since = payload.get("since") or {}
                total += whole
                for pin, rate in payload["rates"].items():
                    key = int(pin, 16)
                    rates[key] = rates.get(key, 0.0) + float(rate) * decay
                    part = float(since[pin]) * decay if pin in since else whole
                    seen = listed.get(key)
                    listed[key] = (whole, part) if seen is None else (seen[0] + whole, seen[1] + part)
            except (ValueError, KeyError, TypeError, AttributeError):
                stale.append(proxy)
        if stale:
            self._tasks.spawn(self._drop(stale, TENANTS_KEY), "drop stale tenant counts")
        others = (rates, total, listed)
        self._tenants_read = (asked + _TENANTS_MIN_S / 2, others)
        return others

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, tasks: Supervisor | None = None) -> None:
        if tasks is not None:
            self._tasks = tasks.child("shared")
        spawn = self._tasks.spawn
        spawn(self._run(), "Redis sync")
        spawn(self._flusher(), "Redis flush")
        spawn(self._reader(), "Redis stream reader")

    def move_to(self, tasks: Supervisor, local_load: Callable[[], dict[str, int]]) -> None:
        """A reload that keeps this state: its loops go on, now under the next config's tasks and
        publishing the next config's replicas."""
        self._tasks.move_to(tasks)
        self.local_load = local_load

    async def stop(self) -> None:
        self._closing = True
        self._wake.set()
        await self._tasks.stop()
        try:  # last writes and our entries out of the load view, side by side and bounded
            last = [self.client.hdel(LOAD_KEY, *[f"{self.proxy_id}|{b}" for b in self.local_load()] or ["-"]),
                    self.client.hdel(TENANTS_KEY, self.proxy_id), self.client.hdel(HOT_KEY, self.proxy_id)]
            if self._guard_fields:
                last.append(self.client.hdel(GUARD_KEY, *self._guard_fields))
            if self.up and (self._ops or self._pending or self._warm):
                last.append(self.flush())
            await asyncio.wait_for(asyncio.gather(*last, return_exceptions=True), self.io_timeout)
        except Exception:
            pass
        finally:  # also when the shutdown is cancelled: no socket left for the garbage collector
            self.up = False  # (what is queued from now on has no flusher to send it)
            await self.close()

    async def close(self) -> None:
        """Close every connection (stop does; so do tests that never started the loops)."""
        self._unclaim()
        for client in (self.client, self._flush_client, self._reader_client):
            try:
                await client.aclose()
            except Exception:
                pass

    async def _run(self) -> None:
        """Connect (and reconnect): republish and resync; then the load view every interval."""
        expire_at = 0.0
        while not self._closing:
            try:
                if not self.up:
                    await self._join()
                await self._sync()
                if time.monotonic() >= expire_at:
                    expire_at = time.monotonic() + _EXPIRE_EVERY_S
                    await self._expire()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._down(exc)
                # drop every socket: after a Redis restart each stale one would fail once more
                for client in (self.client, self._flush_client):
                    try:
                        await client.connection_pool.disconnect()
                    except Exception:
                        pass
            if not self.up:
                await asyncio.sleep(1.0)
                continue
            # the next round: after the busy interval once a request is routed, else the sync interval
            quiet_until = time.monotonic() + self.sync_interval
            await asyncio.sleep(self.interval())
            while not self.busy and time.monotonic() < quiet_until and not self._closing:
                await asyncio.sleep(self.busy_interval)

    async def _join(self) -> None:
        """Before (re)joining: note the stream's end, write our mirrored placements where the
        shared table has none (a Redis that restarted empty gets the fleet's table back instead
        of every proxy re-placing every tenant from scratch: cold caches), read the table, and
        follow the stream from the noted end (so nothing written meanwhile is missed). The first
        join reads the stream's retained past instead: the index entries of recent conversations."""
        # open the flusher's and the reader's connections now (over a slow link a new connection
        # costs round trips of its own), the first two commands side by side
        await asyncio.wait_for(asyncio.gather(self._flush_client.ping(), self._reader_client.ping()), self.io_timeout)
        last = await asyncio.wait_for(self.client.xrevrange(LOG_KEY, count=1), self.io_timeout)
        cursor = last[0][0] if last and self.mirrored else "0-0"
        await self._republish()
        table = await asyncio.wait_for(self.client.hgetall(PINS_KEY), self.io_timeout)
        self._mirror(table, time.time())
        self._set_cursor(cursor)
        self.mirrored = True
        self.up, self._said_down = True, False
        self._reading.set()
        self._wake.set()
        log.info("redis reachable: sharing placements, the prefix index and the load view")
        self.on_status(True)

    async def _republish(self) -> None:
        """Set-if-absent of every mirrored placement, in batches. Best effort: existing entries win."""
        items = [(pin, ("N", format_pin(members, at))) for pin, (members, at) in self.pins.items()]
        try:
            for start in range(0, len(items), _OPS_BATCH):
                await self._send(items[start:start + _OPS_BATCH], "")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("republishing %d placements to redis stopped early: %s", len(items), _describe(exc))

    async def _flusher(self) -> None:
        """Send queued changes: placement operations at once, index entries every busy interval."""
        while not self._closing:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval())
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if not self.up or self._closing:
                continue
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._down(exc)

    async def flush(self) -> None:
        """Send everything queued now (the flusher does this; tests call it to settle)."""
        ops, self._ops = self._ops, {}
        pending, self._pending = self._pending, {}
        warm, self._warm = self._warm, []
        index = ""
        if pending:
            by_backend: dict[str, list[int]] = {}
            for h, backend in pending.items():
                by_backend.setdefault(backend, []).append(h)
            index = orjson.dumps(by_backend).decode()
        warming = orjson.dumps(warm).decode() if warm else ""
        items = list(ops.items())
        recent = guard = ""
        if items or index or warming:
            now = time.time()
            if self.local_recent is not None:
                recent = orjson.dumps((round(now, 3), {b: round(v, 2) for b, v in self.local_recent().items()
                                                       if b is not None})).decode()
            if self.stream_guard is not None:
                windows = self.stream_guard()
                if windows:
                    guard = orjson.dumps({route: _window_entry(window, now)
                                          for route, window in windows.items()}).decode()
        for start in range(0, max(len(items), 1), _OPS_BATCH):
            batch = items[start:start + _OPS_BATCH]
            if batch or index or warming:
                await self._send(batch, index, warming, recent, guard)
            index = warming = recent = guard = ""

    async def _send(self, ops: list[tuple[int, tuple[str, ...]]], index: str, warming: str = "",
                    recent: str = "", guard: str = "") -> None:
        """One batch as one stream entry (with the sender's recent routed counts and balance
        windows when given: the others' placement and guard see where this proxy's traffic goes
        within a stream read, not a load sync)."""
        args: list[str] = [self.proxy_id, f"{time.time():.0f}", str(_LOG_MAXLEN), index, warming, recent, guard]
        for pin, (op, *rest) in ops:
            args += [op, f"{pin:016x}", str(len(rest)), *rest]
        answer = await asyncio.wait_for(self._flush_client.eval(_FLUSH, 2, PINS_KEY, LOG_KEY, *args), self.io_timeout)
        sent = stream_id(answer[0])
        self._last_sent = max(self._last_sent, sent)
        if self.claims:
            self._answer(ops, answer, sent)
        # the reader applies everything up to its cursor in order; apply what is newer here, at
        # once (a lost placement race is corrected within one round trip)
        if sent > self._cursor_key:
            for k in range(1, len(answer) - 2, 3):
                self._adopt(int(answer[k], 16), answer[k + 1])

    def _answer(self, ops: list[tuple[int, tuple[str, ...]]], answer: list, sent: tuple[int, int]) -> None:
        """Answer the claimed tenants among `ops` (members in force, whether this proxy's placement
        made them): at once where it did; where another proxy's had, once the reader has applied the
        stream up to `sent` (the winner's entry, with its "being computed", is before it: the request
        then follows the winner's leader instead of computing the prompt beside it, on another
        replica or on the same one). A claimed tenant whose placement a later write replaced before
        it went out is answered None."""
        claims = self.claims
        answered = {int(answer[k], 16): (answer[k + 1], answer[k + 2] == "1") for k in range(1, len(answer) - 2, 3)}
        for pin, _ in ops:
            future = claims.get(pin)
            if future is None:
                continue
            value, wrote = answered.get(pin, ("", False))
            result = (parse_pin(value)[0], wrote) if value else None
            if result is None or wrote or sent <= self._cursor_key:
                del claims[pin]
                if not future.done():
                    future.set_result(result)
            else:  # (still claimed: the tenant's next requests here wait for the same answer)
                self._answered.append((sent, pin, result))

    def _release_answered(self, all_: bool = False) -> None:
        """Answers held for the reader (`_answer`) whose entry it has applied (all: every one)."""
        keep = []
        for sent, pin, result in self._answered:
            if all_ or sent <= self._cursor_key:
                future = self.claims.pop(pin, None)
                if future is not None and not future.done():
                    future.set_result(result)
            else:
                keep.append((sent, pin, result))
        self._answered = keep

    async def _reader(self) -> None:
        """Follow the change stream: the other proxies' index entries and every placement change."""
        while not self._closing:
            await self._reading.wait()
            try:
                found = await self._reader_client.xread({LOG_KEY: self._cursor}, count=_READ_COUNT,
                                                        block=self._read_block_ms)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._down(exc)
                try:
                    await self._reader_client.connection_pool.disconnect()
                except Exception:
                    pass
                continue
            self._follow(found)

    async def catch_up(self) -> None:
        """Apply what the stream holds past the cursor now, without waiting (the reader does this;
        the offline benchmarks, which run no reader, call it at the points they choose)."""
        while True:
            found = await self.client.xread({LOG_KEY: self._cursor}, count=_READ_COUNT)
            self._follow(found)
            if not found or len(found[0][1]) < _READ_COUNT:
                return

    def _follow(self, found: list | None) -> None:
        """Apply an XREAD answer in order, moving the cursor past each entry."""
        for _, entries in found or ():
            for entry_id, fields in entries:
                if fields.get("p") != self.proxy_id:
                    self.peers_at = time.monotonic()
                self._apply(fields)
                self._set_cursor(entry_id)
        if self._recents_heard:  # (summed once a read, not once an entry)
            self._recents_heard = False
            self._sum_recents(time.time())
        if self._guard_new:  # (the same)
            self._guard_new = False
            self.remote_guard = self._other_windows(self._guard_table, time.time())
        if self._answered:
            self._release_answered()

    def _apply(self, fields: dict[str, str]) -> None:
        """One stream entry: index entries of another proxy, and placements now in force."""
        try:
            if fields.get("i"):
                # this proxy's own entries too: every mirror applies writes in the stream's order,
                # so two proxies writing one block agree on the last writer (except over a write
                # still queued here, which comes later)
                owner, pending = self.owner, self._pending
                for backend, hashes in orjson.loads(fields["i"]).items():
                    for h in hashes:
                        if h not in pending:
                            owner[h] = backend
                            owner.move_to_end(h)
                while len(owner) > self.mirror_blocks:
                    owner.popitem(last=False)
            if fields.get("t"):
                for pin, value in orjson.loads(fields["t"]).items():
                    self._adopt(int(pin, 16), value)
            if fields.get("r") and fields.get("p") != self.proxy_id:
                at, counts = orjson.loads(fields["r"])
                self._heard_recent(fields["p"], float(at), counts)
                self._recents_heard = True
            if fields.get("g") and fields.get("p") != self.proxy_id:
                self._heard_guard(fields["p"], fields["g"])
            if fields.get("w") and fields.get("p") != self.proxy_id and self.on_warming is not None:
                now = time.time()
                for pin, replica, computing, at in orjson.loads(fields["w"])[:_WARM_PER_ENTRY]:
                    age = now - at
                    # (not the stream's retained past, nor a clock far ahead of ours)
                    if isinstance(replica, str) and -self.warm_ttl <= age <= self.warm_ttl:
                        self.on_warming(int(pin, 16), replica, bool(computing), age if age > 0.0 else 0.0)
        except (ValueError, TypeError, AttributeError) as exc:
            log.debug("ignoring a malformed change entry: %s", exc)

    def _adopt(self, pin: int, value: str) -> None:
        """A placement in force in the shared table, unless this proxy has a newer write queued."""
        op = self._ops.get(pin)
        if op is not None and op[0] == "S":
            return
        if not value:
            return
        parsed = parse_pin(value)
        if time.time() - parsed[1] > self.ttl:  # an old entry of the stream's retained past
            return
        mine = self.pins.get(pin)
        if mine is None or mine[0] != parsed[0]:
            if mine is not None:
                self.adopted += 1
            self.pins_changed += 1
        self.pins[pin] = parsed

    def has_read(self, other: "SharedState") -> bool:
        """Whether this mirror has applied everything `other` has sent so far (tests settle on it)."""
        return not other._pending and other._last_sent > (0, 0) and self._cursor_key >= other._last_sent

    def _set_cursor(self, entry_id: str) -> None:
        self._cursor, self._cursor_key = entry_id, stream_id(entry_id)

    async def _sync(self) -> None:
        """Publish our load (and tenant counts, and while routing the balance windows), read
        everyone else's."""
        busy, self.busy = self.busy, False
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        rates = self.local_rates(now) if self.local_rates is not None else {}
        mine = {f"{self.proxy_id}|{b}": f"{n}|{now:.3f}|{rates.get(b, 0.0):.2f}" for b, n in self.local_load().items()}
        if mine:
            pipe.hset(LOAD_KEY, mapping=mine)
        since = now - self._tenants_at
        if self.local_tenants is not None and (since >= _TENANTS_EVERY_S or since >= _TENANTS_MIN_S and
                                               self.routed - self._tenants_routed >= _TENANTS_EVERY_REQUESTS):
            self._tenants_at, self._tenants_routed = now, self.routed
            counts = self.local_tenants(now)
            if counts is not None:
                top = heapq.nlargest(_TENANTS_TOP, counts[0].items(), key=lambda kv: kv[1])
                payload = {"at": now, "total": counts[1], "rates": {f"{p:016x}": round(r, 3) for p, r in top}}
                since = counts[2]
                if since:  # (requests since the tenant appeared here, where fewer than all)
                    payload["since"] = {f"{p:016x}": round(since[p], 3) for p, _ in top if p in since}
                pipe.hset(TENANTS_KEY, self.proxy_id, orjson.dumps(payload))
        if self.local_guard is not None and busy:
            windows = {f"{self.proxy_id}|{route}": orjson.dumps(_window_entry(window, now))
                       for route, window in self.local_guard().items()}
            if windows:
                pipe.hset(GUARD_KEY, mapping=windows)
                self._guard_fields.update(windows)
        if self.local_hot is not None and busy:
            recent = self.local_recent() if self.local_recent is not None else {}
            pipe.hset(HOT_KEY, self.proxy_id, orjson.dumps({"at": now, "hot": [
                (f"{pin:016x}", *(round(x, 3) for x in counts)) for pin, *counts in self.local_hot()],
                "recent": {b: round(v, 2) for b, v in recent.items() if b is not None}}))
        if self.local_guard is not None:
            pipe.hgetall(GUARD_KEY)
        if self.local_hot is not None:
            pipe.hgetall(HOT_KEY)
        pipe.hgetall(LOAD_KEY)
        results = await asyncio.wait_for(pipe.execute(), self.io_timeout)
        self.remote_load, self.remote_rate = self._others(results[-1], time.time())
        self.remote_rate_at = now
        if self.local_hot is not None and self.on_hot is not None:
            self.on_hot(self._hot(results[-2], time.time()))
        if self.local_guard is not None:
            self._guard_table = results[-3 if self.local_hot is not None else -2]
            self.remote_guard = self._other_windows(self._guard_table, time.time())

    def _hot(self, table: dict[str, str], now: float) -> list[HotTenants]:
        """The other proxies' fresh busy tenants (`HotTenants`); a proxy idle for long is left out
        (its entry, once older still, dropped). On the way, their recent routed counts per replica
        (`remote_recent`, published beside them: a proxy of an older release publishes none)."""
        out: list[HotTenants] = []
        stale = []
        fresh = max(_GUARD_FRESH_S, self.rate_tau)
        for proxy, value in table.items():
            if proxy == self.proxy_id:
                continue
            try:
                entry = orjson.loads(value)
                age = now - float(entry["at"])
                hot = [(int(pin, 16), float(r), float(f), float(long), float(short))
                       for pin, r, f, long, short in entry["hot"]]
            except (ValueError, KeyError, TypeError, AttributeError, orjson.JSONDecodeError):  # not ours: dropped
                stale.append(proxy)
                continue
            if age > 2 * fresh + 5.0 or age < -fresh:  # (gone, or a stamp from the future)
                stale.append(proxy)
            elif age <= fresh:
                out.append((max(age, 0.0), hot))
                recent = entry.get("recent")
                if isinstance(recent, dict):
                    self._heard_recent(proxy, float(entry["at"]), recent)
        for proxy in stale:
            self._recents.pop(proxy, None)
        self._sum_recents(now)
        if stale:
            self._tasks.spawn(self._drop(stale, HOT_KEY), "drop stale busy tenants")
        return out

    def _heard_recent(self, proxy: str, at: float, counts: dict) -> None:
        """Another proxy's recent routed counts per replica as of `at` (its clock), unless newer
        ones were heard (the same stamp: these came later, as the stream orders them)."""
        heard = self._recents.get(proxy)
        if heard is None or heard[0] <= at:
            self._recents[proxy] = (at, {name: float(count) for name, count in counts.items()
                                         if isinstance(count, (int, float))})

    def _sum_recents(self, now: float) -> None:
        """`remote_recent`: the others' recent counts as last heard, each aged to `now` at the
        observed rate (a quarter load window); one not heard from within the freshness bound left out."""
        fresh = max(_GUARD_FRESH_S, self.rate_tau)
        total: dict[str, float] = {}
        for proxy, (at, counts) in list(self._recents.items()):
            age = now - at
            if age > fresh or age < -fresh:
                del self._recents[proxy]
                continue
            decay = math.exp(-4.0 * max(age, 0.0) / self.rate_tau)
            for name, count in counts.items():
                total[name] = total.get(name, 0.0) + count * decay
        self.remote_recent, self.remote_recent_at = total, now

    def _heard_guard(self, proxy: str, payload: str) -> None:
        """Another proxy's balance windows from a stream entry (`flush`), kept where newer than
        what was heard before; summed in at the end of the stream read (`_follow`)."""
        try:
            windows = [(route, float(entry["at"]), entry) for route, entry in orjson.loads(payload).items()]
        except (ValueError, KeyError, TypeError, AttributeError):  # (not ours: ignored)
            return
        for route, at, entry in windows:
            field = f"{proxy}|{route}"
            known = self._guard_heard.get(field)
            if known is None or at > known[0]:
                self._guard_heard[field] = (at, orjson.dumps(entry).decode())
                self._guard_new = True

    def _newest_windows(self, table: dict[str, str]) -> dict[str, str]:
        """The load sync's `table` of the others' windows with what the stream brought since,
        where that is newer (a heard entry the table caught up with is dropped)."""
        heard = self._guard_heard
        if not heard:
            return table
        merged = dict(table)
        for field, (at, value) in list(heard.items()):
            current = table.get(field)
            if current is not None:
                known = self._guard_read.get(field)
                try:
                    stamp = known[1][0] if known is not None and known[0] == current else float(orjson.loads(current)["at"])
                except (ValueError, KeyError, TypeError, orjson.JSONDecodeError):
                    stamp = -math.inf
                if stamp >= at:
                    del heard[field]
                    continue
            merged[field] = value
        return merged

    def _other_windows(self, table: dict[str, str], now: float) -> dict[tuple[str, tuple[str, ...]], RemoteWindow]:
        """The other proxies' fresh balance windows, summed per (route, replicas) (`RemoteWindow`):
        a proxy that sees another fleet (a change not yet seen by all) or went idle is left out.
        Each window as the load sync read it, or as a stream entry brought it since (`_heard_guard`)."""
        table = self._newest_windows(table)
        out: dict[tuple[str, tuple[str, ...]], RemoteWindow] = {}
        stale = []
        fresh = max(_GUARD_FRESH_S, self.rate_tau)
        read, self._guard_read = self._guard_read, {}
        totals, self._guard_totals = self._guard_totals, {}
        accrued, self._guard_accrued = self._guard_accrued, {}
        for field, value in table.items():
            proxy, _, route = field.partition("|")
            if proxy == self.proxy_id:
                continue
            known = read.get(field)
            if known is None or known[0] != value:
                try:
                    entry = orjson.loads(value)
                    names = tuple(str(name) for name in entry["names"])
                    counts = [int(n) for n in entry["counts"]]
                    # (a proxy of an older release publishes no totals: it adds nothing to the stretch walks)
                    picks = [int(n) for n in entry["picks"]] if "picks" in entry else None
                    if len(counts) != len(names) or picks is not None and len(picks) != len(names):
                        raise ValueError(field)
                    parsed = (float(entry["at"]), names, int(entry["filled"]), counts,
                              [(int(pin, 16), str(name), float(at)) for pin, name, at in entry.get("overflow", ())],
                              int(entry.get("decided", 0)), picks)
                except (ValueError, KeyError, TypeError, AttributeError, orjson.JSONDecodeError):  # not ours: dropped
                    stale.append(field)
                    continue
            else:
                parsed = known[1]
            at, names, filled, counts, overflow, decided, picks = parsed
            age = now - at
            if age > 2 * fresh + 5.0 or age < -fresh:  # (gone, or a stamp from the future)
                stale.append(field)
                continue
            self._guard_read[field] = (value, parsed)
            if age <= fresh:
                self.peers_at = time.monotonic()
                key = (route, names)
                total, by = out.get(key, (0, {}))[:2]
                for name, n in zip(names, counts):
                    by[name] = by.get(name, 0) + n
                # what this proxy decided since the last sync; a proxy seen for the first time, or
                # whose totals fell (it began a new window), is a starting point, not decisions
                made, picked = self._guard_accrued.get(key) or accrued.get(key) or (0, {})
                before = totals.get(field)
                if picks is not None:
                    self._guard_totals[field] = (decided, picks)
                    if (before is not None and decided >= before[0]
                            and all(n >= m for n, m in zip(picks, before[1]))):
                        made += decided - before[0]
                        picked = dict(picked)
                        for name, n, m in zip(names, picks, before[1]):
                            picked[name] = picked.get(name, 0) + n - m
                self._guard_accrued[key] = (made, picked)
                out[key] = (total + filled, by, made, picked)
                if overflow and self.adopt_overflows is not None:
                    self.adopt_overflows(route, names, overflow)
        if stale:
            # (out of the sync's table too: each stream read sums it again, and would drop them again)
            for field in stale:
                self._guard_heard.pop(field, None)
                self._guard_table.pop(field, None)
            self._tasks.spawn(self._drop(stale, GUARD_KEY), "drop stale balance windows")
        return out

    async def _expire(self) -> None:
        """Drop placements nobody refreshed for the TTL (every proxy agrees on the stamps), here
        and in the shared table."""
        now = time.time()
        expired = [pin for pin, (_, at) in self.pins.items() if now - at > self.ttl]
        for pin in expired:
            del self.pins[pin]
        if expired:
            self.pins_changed += 1
            await self._drop([f"{pin:016x}" for pin in expired], PINS_KEY)

    def _mirror(self, table: dict[str, str], now: float) -> None:
        pins: dict[int, tuple[tuple[str, ...], float]] = {}
        expired = []
        for field, value in table.items():
            try:
                pin = int(field, 16)
            except ValueError:
                expired.append(field)
                continue
            members, at = parse_pin(value)
            if not members or now - at > self.ttl:
                expired.append(field)
            else:
                pins[pin] = (members, at)
        for pin, op in self._ops.items():  # changed while we were reading
            if op[0] == "S" and pin in self.pins:
                pins[pin] = self.pins[pin]
        self.pins.clear()
        self.pins.update(pins)
        self.pins_changed += 1
        if expired:
            self._tasks.spawn(self._drop(expired, PINS_KEY), "drop expired pins")

    def _others(self, table: dict[str, str], now: float) -> tuple[dict[str, int], dict[str, float]]:
        totals: dict[str, int] = {}
        rates: dict[str, float] = {}
        stale = []
        tau = self.rate_tau
        for field, value in table.items():
            proxy, _, backend = field.rpartition("|")
            count, _, rest = value.partition("|")
            stamp, _, rate = rest.partition("|")
            try:
                age = now - float(stamp)
                n = int(count)
                r = float(rate) if rate else 0.0
            except ValueError:
                stale.append(field)
                continue
            if age > 5.0:
                stale.append(field)
            elif proxy != self.proxy_id and age <= max(1.0, 10 * self.sync_interval):
                self.peers_at = time.monotonic()
                totals[backend] = totals.get(backend, 0) + n
                rates[backend] = rates.get(backend, 0.0) + r * math.exp(-max(age, 0.0) / tau)
        if stale:
            self._tasks.spawn(self._drop(stale), "drop stale load entries")
        return totals, rates

    async def _drop(self, fields: list[str], key: str = LOAD_KEY) -> None:
        try:
            await asyncio.wait_for(self.client.hdel(key, *fields), self.io_timeout)
        except Exception:
            pass

    def _down(self, exc: BaseException) -> None:
        if self.up or not self._said_down:
            self._said_down = True
            log.warning("redis unreachable (%s): routing on local state until it returns", _describe(exc))
            self.up = False
            self._reading.clear()
            self._leases = {}
            self._tenants_read = None
            self.remote_load = {}
            self.remote_rate = {}
            self.remote_recent = {}
            self._recents = {}
            self.remote_guard = {}
            self._guard_table, self._guard_heard = {}, {}
            self._pending = {}
            self._ops = {}
            self._unclaim()
            self._warm = []
            if self.on_warming is not None:  # the others' releases will not arrive: nobody waits for them
                self.on_warming(None, "", False, 0.0)
            if self.on_hot is not None:  # the others' counts stop here: each proxy counts its own again
                self.on_hot([])
            self.on_status(False)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
