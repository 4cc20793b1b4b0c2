"""State shared by every proxy process through Redis: the prefix index and the load view.

The request path makes at most one Redis round trip (an MGET of the prompt's block hashes),
bounded by a short timeout; only the first request of a never-seen tenant makes one more (an
atomic set-if-absent of its placement), and so does a request that grows a tenant's replica set
(an atomic compare-and-set, so proxies growing one tenant at once agree on the new member). Writes are batched by a background flusher, and each
proxy publishes its per-replica in-flight counts and smoothed routed counts a few times a
second. Tenant placements (pin key -> ordered replica set) live in one hash that every proxy
mirrors locally, re-read only when its version counter moves. When Redis is unreachable the
proxy routes on local state (rendezvous hashing keeps replicas in agreement), logs once, shows
it in `vllm_proxy_redis_up`, and reconnects by itself.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import math
import os
import time
from typing import Callable, Sequence

import orjson
import redis.asyncio as redis

from proxy.tasks import Background

log = logging.getLogger("vllm_proxy.shared")

INDEX_PREFIX = "vp:px:"
LOAD_KEY = "vp:load"
TENANTS_KEY = "vp:tenants"  # field: proxy id -> its busiest tenants' decayed request counts (JSON)
_TENANTS_EVERY_S = 1.0  # how often a proxy publishes them
_TENANTS_TOP = 2048  # tenants per proxy published (the planner moves the ones that carry traffic)
PINS_KEY = "vp:pins"  # field: pin key (hex) -> "replica,replica,...|unix time of the last write"
PINS_VERSION = "vp:pins:v"
_REPUBLISH_BATCH = 500

# place a tenant unless another proxy already did; bump the version so mirrors re-read. ARGV[3..]
# are the caller's choices, best first, each with the tenants it believed that replica holds:
# while the table is small (ARGV[2] entries at most; a cold start, when proxies place tenants
# at once from mirrors that do not show each other's placements yet) the script takes the first
# choice whose count did not grow behind the caller's back, else the one that grew least
_PLACE = """
local cur = redis.call('hget', KEYS[1], ARGV[1])
if cur then return cur end
local choice = ARGV[4]
if #ARGV > 5 and redis.call('hlen', KEYS[1]) <= tonumber(ARGV[2]) then
  local counts = {}
  for _, v in ipairs(redis.call('hvals', KEYS[1])) do
    for m in string.gmatch(string.match(v, '^(.*)|[^|]*$') or v, '[^,]+') do counts[m] = (counts[m] or 0) + 1 end
  end
  local least
  for i = 4, #ARGV, 2 do
    local grown = (counts[ARGV[i]] or 0) - tonumber(ARGV[i + 1])
    if least == nil or grown < least then least, choice = grown, ARGV[i] end
    if grown <= 0 then break end
  end
end
local value = choice .. '|' .. ARGV[3]
redis.call('hset', KEYS[1], ARGV[1], value)
redis.call('incr', KEYS[2])
return value
"""
_PLACE_COUNTED = 256  # table size up to which a placement looks at every replica's tenant count

# change a tenant's set only if it still is what the caller saw (compare-and-set), so proxies
# growing the same tenant at the same time agree on one new member; returns the current value
_GROW = """
local cur = redis.call('hget', KEYS[1], ARGV[1])
local members = cur and string.match(cur, '^(.*)|[^|]*$') or cur
if members == ARGV[2] or not cur then
  redis.call('hset', KEYS[1], ARGV[1], ARGV[3])
  redis.call('incr', KEYS[2])
  return ARGV[3]
end
return cur
"""

# take a lease when free, or renew it when the caller holds it
_LEASE = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1 end
return 0
"""


def parse_pin(value: str) -> tuple[tuple[str, ...], float]:
    members, _, stamp = value.rpartition("|")
    try:
        at = float(stamp)
    except ValueError:
        members, at = value, 0.0
    return tuple(m for m in members.split(",") if m), at


def format_pin(members: Sequence[str], at: float) -> str:
    return f"{','.join(members)}|{at:.0f}"


class SharedState:
    def __init__(
        self,
        url: str,
        *,
        ttl_s: float = 600.0,
        timeout_s: float = 0.05,
        sync_interval_s: float = 0.1,
        local_load: Callable[[], dict[str, int]],
        on_status: Callable[[bool], None] = lambda up: None,
        max_connections: int = 16,
    ) -> None:
        # A bounded pool: a burst of requests never opens more than `max_connections` sockets.
        # The request path uses at most max_connections - 1 of them (one stays for the sync);
        # a request finding them all busy routes on local state, without marking Redis down.
        self.max_connections = max(2, max_connections)
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=self.max_connections, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=max(timeout_s, 0.2), decode_responses=True, health_check_interval=0,
        )
        self.client = redis.Redis(connection_pool=pool, retry=None)
        self._busy = 0  # request-path calls in progress
        self.pool_full = 0  # request-path calls skipped because every connection was busy
        self.ttl = int(ttl_s)
        self.timeout = timeout_s
        self.sync_interval = sync_interval_s
        self.local_load = local_load
        self.on_status = on_status
        self.proxy_id = f"{os.uname().nodename}:{os.getpid()}:{id(self):x}"
        self.up = False
        self._said_down = False
        self.remote_load: dict[str, int] = {}
        # smoothed routed counts of the other proxies, decayed to `remote_rate_at` (unix time)
        self.remote_rate: dict[str, float] = {}
        self.remote_rate_at = 0.0
        self.rate_tau = 30.0
        self.local_rates: Callable[[float], dict[str, float]] | None = None  # set by the policy
        # (tenant -> decayed requests routed here, all requests) at a time; set by the policy
        self.local_tenants: Callable[[float], tuple[dict[int, float], float] | None] | None = None
        self._tenants_at = 0.0
        # mirror of the placement hash: pin -> (members, stamp); `pins_changed` is bumped on re-read
        self.pins: dict[int, tuple[tuple[str, ...], float]] = {}
        self.pins_changed = 0
        self._pins_version: str | None = None
        self._pending_pins: dict[int, str] = {}
        self._pending: dict[int, str] = {}
        self._loop = Background()

    # -- request path -------------------------------------------------------------------------
    async def longest(self, chain: Sequence[int]) -> tuple[int, str | None] | None:
        """Longest shared prefix match, or None when Redis cannot answer now (use local state)."""
        if not self.up or not chain:
            return (0, None) if self.up else None
        if self._busy >= self.max_connections - 1:
            self.pool_full += 1
            return None
        self._busy += 1
        try:
            owners = await asyncio.wait_for(
                self.client.mget([f"{INDEX_PREFIX}{h:016x}" for h in chain]), self.timeout
            )
        except Exception as exc:  # timeouts, resets, refused: all mean "local mode for now"
            self._down(exc)
            return None
        finally:
            self._busy -= 1
        for i in range(len(owners) - 1, -1, -1):
            if owners[i]:
                return i + 1, owners[i]
        return 0, None

    async def place(self, pin: int, choices: Sequence[tuple[str, int]]) -> tuple[str, ...] | None:
        """Record a new tenant's placement unless another proxy did first: the first of `choices`
        (replica, tenants the caller believes it holds), best first, that no other proxy filled
        meanwhile (see _PLACE). Returns the placement in force, or None when Redis cannot answer now."""
        if not self.up:
            return None
        if self._busy >= self.max_connections - 1:
            self.pool_full += 1
            return None
        flat = [str(x) for choice in choices for x in choice]
        return await self._pin_script(_PLACE, pin, str(_PLACE_COUNTED), f"{time.time():.0f}", *flat)

    async def grow(self, pin: int, old: Sequence[str], members: Sequence[str]) -> tuple[str, ...] | None:
        """Change a tenant's set from `old` to `members` unless another proxy changed it first;
        returns the set now in force, or None when Redis cannot answer now."""
        if not self.up or self._busy >= self.max_connections - 1:
            return None
        found = await self._pin_script(_GROW, pin, ",".join(old), format_pin(members, time.time()))
        if found is not None:
            self._pending_pins.pop(pin, None)
        return found

    async def lease(self, name: str, seconds: float) -> bool:
        """True while this proxy holds `name`: taken when free, renewed for `seconds` by its
        holder; False for the others or when Redis cannot answer now."""
        if not self.up or self._busy >= self.max_connections - 1:
            return False
        self._busy += 1
        try:
            held = await asyncio.wait_for(
                self.client.eval(_LEASE, 1, f"vp:lease:{name}", self.proxy_id, max(int(seconds * 1000), 1)),
                self.timeout)
        except Exception as exc:
            self._down(exc)
            return False
        finally:
            self._busy -= 1
        return held == 1

    async def _pin_script(self, script: str, pin: int, *args: str) -> tuple[str, ...] | None:
        """Run a compare-and-set script on the tenant table; the stored entry wins."""
        self._busy += 1
        try:
            stored = await asyncio.wait_for(
                self.client.eval(script, 2, PINS_KEY, PINS_VERSION, f"{pin:016x}", *args), self.timeout
            )
        except Exception as exc:
            self._down(exc)
            return None
        finally:
            self._busy -= 1
        if not stored:  # both scripts always return the entry in force
            return None
        parsed = parse_pin(stored)
        self.pins[pin] = parsed
        return parsed[0]

    def set_pin(self, pin: int, members: Sequence[str]) -> None:
        """Change a tenant's replica set (grow, shrink, re-home, refresh): local now, Redis on flush."""
        now = time.time()
        self.pins[pin] = (tuple(members), now)
        if self.up:
            self._pending_pins[pin] = format_pin(members, now)

    def remember(self, hashes: Sequence[int], backend: str) -> None:
        """Queue index writes; the flusher sends them in one pipeline."""
        if self.up:
            for h in hashes:
                self._pending[h] = backend

    # -- background ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop.start(self._run())

    async def stop(self) -> None:
        await self._loop.stop()
        try:
            await self.client.hdel(LOAD_KEY, *[f"{self.proxy_id}|{b}" for b in self.local_load()])
            await self.client.hdel(TENANTS_KEY, self.proxy_id)
        except Exception:
            pass
        await self.client.aclose()

    async def _run(self) -> None:
        while True:
            try:
                if not self.up:
                    await self._republish()
                await self._sync()
                if not self.up:
                    self.up, self._said_down = True, False
                    log.info("redis reachable: sharing the prefix index and load view")
                    self.on_status(True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._down(exc)
                try:  # drop every pooled socket: after a Redis restart each stale one would fail once more
                    await self.client.connection_pool.disconnect()
                except Exception:
                    pass
            await asyncio.sleep(self.sync_interval if self.up else 1.0)

    async def _republish(self) -> None:
        """Before (re)joining: write our mirrored placements where the shared table has none
        (HSETNX), so a Redis that restarted empty gets the fleet's table back instead of every
        proxy re-placing every tenant from scratch (cold caches); existing entries win.
        Best effort, in batches that yield to the request path; a failure is not an outage."""
        items = list(self.pins.items())
        if not items:
            return
        try:
            for start in range(0, len(items), _REPUBLISH_BATCH):
                pipe = self.client.pipeline(transaction=False)
                for pin, (members, at) in items[start:start + _REPUBLISH_BATCH]:
                    pipe.hsetnx(PINS_KEY, f"{pin:016x}", format_pin(members, at))
                await asyncio.wait_for(pipe.execute(), max(self.timeout * 4, 0.5))
            await asyncio.wait_for(self.client.incr(PINS_VERSION), max(self.timeout * 4, 0.5))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("republishing %d placements to redis stopped early: %s", len(items), _describe(exc))

    async def _sync(self) -> None:
        """Flush index and placement writes, publish our load, read everyone else's."""
        now = time.time()
        pending, self._pending = self._pending, {}
        pending_pins, self._pending_pins = self._pending_pins, {}
        pipe = self.client.pipeline(transaction=False)
        for h, backend in pending.items():
            pipe.set(f"{INDEX_PREFIX}{h:016x}", backend, ex=self.ttl)
        if pending_pins:
            pipe.hset(PINS_KEY, mapping={f"{p:016x}": v for p, v in pending_pins.items()})
            pipe.incr(PINS_VERSION)
        rates = self.local_rates(now) if self.local_rates is not None else {}
        mine = {f"{self.proxy_id}|{b}": f"{n}|{now:.3f}|{rates.get(b, 0.0):.2f}" for b, n in self.local_load().items()}
        if mine:
            pipe.hset(LOAD_KEY, mapping=mine)
        if self.local_tenants is not None and now - self._tenants_at >= _TENANTS_EVERY_S:
            self._tenants_at = now
            counts = self.local_tenants(now)
            if counts is not None:
                top = heapq.nlargest(_TENANTS_TOP, counts[0].items(), key=lambda kv: kv[1])
                payload = {"at": now, "total": counts[1], "rates": {f"{p:016x}": round(r, 3) for p, r in top}}
                pipe.hset(TENANTS_KEY, self.proxy_id, orjson.dumps(payload))
        pipe.hgetall(LOAD_KEY)
        pipe.get(PINS_VERSION)
        results = await asyncio.wait_for(pipe.execute(), max(self.timeout * 4, 0.5))
        self.remote_load, self.remote_rate = self._others(results[-2], now)
        self.remote_rate_at = now
        version = results[-1]
        if version != self._pins_version:
            table = await asyncio.wait_for(self.client.hgetall(PINS_KEY), max(self.timeout * 4, 0.5))
            self._pins_version = version
            self._mirror(table, now)

    async def other_tenants(self) -> tuple[dict[int, float], float] | None:
        """The other proxies' published tenant counts (decayed to now) and their total: with N
        proxies each sees 1/N of every tenant's requests, too few to tell a light tenant's share
        from zero. One read, for the packing repair (never on the request path); None when
        Redis cannot answer now."""
        try:
            table = await asyncio.wait_for(self.client.hgetall(TENANTS_KEY), max(self.timeout * 4, 0.5))
        except Exception:
            return None
        now = time.time()
        rates: dict[int, float] = {}
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
                total += float(payload["total"]) * decay
                for pin, rate in payload["rates"].items():
                    key = int(pin, 16)
                    rates[key] = rates.get(key, 0.0) + float(rate) * decay
            except (ValueError, KeyError, TypeError, AttributeError):
                stale.append(proxy)
        if stale:
            asyncio.get_running_loop().create_task(self._drop(stale, TENANTS_KEY))
        return rates, total

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
        for pin, value in self._pending_pins.items():  # changed while we were reading
            pins[pin] = parse_pin(value)
        self.pins.clear()
        self.pins.update(pins)
        self.pins_changed += 1
        if expired:
            asyncio.get_running_loop().create_task(self._drop(expired, PINS_KEY))

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
                totals[backend] = totals.get(backend, 0) + n
                rates[backend] = rates.get(backend, 0.0) + r * math.exp(-max(age, 0.0) / tau)
        if stale:
            asyncio.get_running_loop().create_task(self._drop(stale))
        return totals, rates

    async def _drop(self, fields: list[str], key: str = LOAD_KEY) -> None:
        try:
            await self.client.hdel(key, *fields)
        except Exception:
            pass

    def _down(self, exc: BaseException) -> None:
        if self.up or not self._said_down:
            self._said_down = True
            log.warning("redis unreachable (%s): routing on local state until it returns", _describe(exc))
            self.up = False
            self.remote_load = {}
            self.remote_rate = {}
            self._pending = {}
            self._pending_pins = {}
            self._pins_version = None  # re-read the placements when Redis returns
            self.on_status(False)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
