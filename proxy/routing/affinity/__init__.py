"""`prefix_affinity`: send a request where its prefix is cached, without overloading anyone.

The unit of placement is the tenant: the **pin key** (the leading system part of the prompt).

1. A continuation (the longest known prefix match reaches past the pin part) goes back to the
   replica that computed its earlier turns, unless that replica is clearly over the bound or is
   no longer in its tenant's set (the tenant moved, or this conversation spilled): then it goes
   where the tenant's prompt now lives. Keeping a moved tenant's conversations where they were
   kept its prompt in two caches for as long as they lasted (seconds to minutes for a light
   tenant), crowding both; recomputing a conversation's own turns once is cheaper.
2. Every tenant has a small ordered **replica set** (its home first). A new conversation goes
   to the member under the bound with the least recent traffic, so a hot tenant's traffic is
   shared by replicas that all hold its prompt instead of spilling to arbitrary ones.
3. The set **grows** (by the replica with the least load and the fewest tenants) as soon as the
   tenant's own traffic needs it (the lower confidence bound of its share, over the window or
   over its last quarter, x N >= grow_fill x set size) and the fleet is past warm-up
   (`grow_min_requests`), also when every member is over the bound;
   with Redis the growth is a compare-and-set on the shared table, so proxies growing one tenant
   at once agree. A smaller tenant instead stays up to the looser (continuation) bound, else
   spills that one request and brings the packing repair forward (step 5 re-homes it); before
   warm-up only a real queue makes it spill. When the tenant cools (its traffic would fit in one
   replica less, `cool_down_requests` after the set last grew or lost a member; a member the
   packing repair replaced restarts nothing) the members it no longer needs are dropped at once.
   A set whose members all run at or over the mean also grows by a replica outside it that took
   under 3/4 of the mean of late, if the tenant's traffic can make up the difference: a replica
   holding only light tenants is capped by nobody and filled by nothing else (placement.py `_light`).
4. A tenant never seen is **placed** on the replica with the least recent traffic and cache
   pressure (active tenants placed there), ties broken by rendezvous hashing, among the replicas
   where the balance guard would not cap its first request (a population that just changed meets a
   guard window full of the last one's traffic: placed onto a capped replica, its first requests
   computed the prompt on a second one). With Redis the placement is
   written with set-if-absent (the first proxy wins, the others adopt its choice) into a hash
   every proxy mirrors, so all proxies agree on every tenant's set. The table does not correct a
   placement by its counts (skipping a first choice other proxies had filled meanwhile moved a
   tenant whose first request had already computed its prompt where this proxy placed it: the
   prompt was cached twice and that conversation stranded; with three proxies that cost 1-1.5 %
   of prefix hits in every phase with new tenants). Proxies placing at once decide on the same
   counts, so each counts its own placements of the last 50 ms for the others' of the same moment
   too (`TenantTable.herd`); what they still stack on one replica is the balance guard's and the
   packing repair's to even out. A new tenant's first requests at several proxies at once do not
   race: each waits for the shared table's answer to its proxy's placement (one Redis round
   trip, at most `placement_hold_s`) and goes where the first writer placed it (arrivals.py).
   When Redis is down, known
   tenants keep their mirrored sets and unknown ones fall back to rendezvous order (stateless
   agreement); without Redis at all, this process's table is the authority.
5. Placement is online bin packing with two limits, traffic (the bound) and cache room (the
   tenants' system prompts each replica's cache must hold, sized from `vllm:cache_config_info`),
   and warm-up placements are blind to popularity. So every `rebalance_every_requests` a **packing
   repair** (proxy/routing/packing.py, run in the background: repair.py) makes up to two changes, each a move
   of a single-replica tenant, a swap of two, or (while some replica runs slower) one member of a
   multi-replica set replaced in place (alone or in a swap), that spread the prompts evenly over
   the caches without pushing traffic past (1 + eps/2) x mean. With the balance guard, it weighs
   a tenant that arrived within a few hundred requests by its part of the guard's window, not by
   its rate since it appeared (repair.py `shares`). With Redis one proxy at a time plans (a lease it
   renews), so a single estimate of the tenants' shares decides, and it writes by
   compare-and-set on the shared table.

The bound (consistent hashing with bounded loads, Mirrokni et al. 2017) applies to a
**smoothed** load: the exponentially decayed count of requests routed to each replica summed over
all proxies via the shared load view. A replica is eligible when
smoothed + 1 <= (1 + eps) x mean + load_slack x sqrt(mean), so noise in the instantaneous in-flight
counts does not make tenants spill; in-flight counts only act as a guard against a real queue
(more than ceil((1 + eps) x mean) + queue_slack in flight).

**The policy's time is requests, not seconds.** Its clock advances by one per request routed over
all proxies (each proxy advances it by the number of proxies it estimates from the shared load
view), and every memory is counted on it: the smoothed load (`load_window_requests`), the
tenants' shares (`window_requests`), warm-up, growth and cool-down, the packing repair's period and its hold on
recently moved tenants. So the same request sequence behaves the same at 0.1x or 10x the rate,
and a benchmark's compressed minutes agree with production's hours. Wall time is used only to
age what other proxies published (at the observed request rate) and for Redis TTLs.

**Forgetting.** A tenant with no request for 6 of its mean gaps between requests (at most
`forget_requests`) is idle: it no longer counts in the tenants per replica that placement, the
cache-room limit and the packing repair look at (its prompt is on its way out of the LRU caches),
and when it returns it is placed anew by current load and room unless one of its replicas still
has both. A tenant's share is estimated over the requests since it appeared, so a new tenant's
share is right after a few dozen requests, not after a window's worth. When most of the last
requests come from tenants that arrived within a few hundred requests, far more than usual, the
population changed: the balance guard's window keeps only the new tenants' decisions (balance.py
`restart`), so the last population's traffic neither caps nor frees a replica for the new one,
and the recent loads that place newcomers start anew (load.py `restart`).

**Fleet changes.** A replica that leaves takes its index entries with it and its tenants are
re-homed (compare-and-set with Redis) on their next request, dropping it from their sets, so it
gets nothing back when it returns. A replica that joins (or returns) counts as carrying the mean
load and tenants at first, falling linearly to its own over load_window_requests, so the others do not all look
over the bound at once (which made every tenant spill onto the cold cache); placement and the
packing repair (brought forward by the change) fill it.

**Slower replicas.** While some replica decodes markedly slower (proxy/routing/speed.py) it
takes its share by speed in the bound, the balance guard and the packing repair, and as a cold
prompt costs it k times the prefill, the TTFT tail of such a fleet is made of cold prompts there.
So a tenant placed anew goes to a faster replica while one fits (its first request computes its
prompt wherever it goes); a tenant whose prompt the slower replica evicted (its index entries are
sized like its scraped cache) moves to a faster one at that miss; and the packing repair gives the
slower replica fewer prompts than its cache keeps, so it fills its share with hotter tenants,
whose prompts stay cached.

Modules, one job each: `store` (the tenant table's storage: local, or the Redis mirror of
proxy/shared.py), `table` (the table and what is remembered per tenant), `counts` (decayed counts
on the request clock), `load` (the request clock and the per-replica load estimate), `tenants`
(each tenant's share and idleness), `ranking` (where a new tenant goes), `arrivals` (a new tenant's
first request waits for its placement's answer), `placement` (the
decision for one request), `repair` (the packing repair, in the background) and `policy` (the
`PrefixAffinity` object that wires them). The prefix keys are proxy/prefix.py, the prefix index
proxy/routing/index.py, the packing planner proxy/routing/packing.py.
"""
from proxy.routing.affinity.counts import DecayedCounts
from proxy.routing.affinity.policy import PrefixAffinity
from proxy.routing.affinity.ranking import rendezvous_order, rendezvous_weight

__all__ = ["DecayedCounts", "PrefixAffinity", "rendezvous_order", "rendezvous_weight"]
