"""The one step function: what the expert cache does for one (step, layer) group.

:meth:`Simulator.step` takes one :class:`Access` (the distinct experts a layer routed to in
one step, with their modeled prices and the feature inputs: prefetch candidates, the hybrid
rule's picks, a pre-eviction hook) and decides, in this order (VisMMOE §3.4: a miss blocks
only on that expert):

1. the layer's dense work runs on the compute lane (``dense_s``);
2. **pinned** layer: every expert is resident (a *pinned access*, not a cache hit); the
   pre-eviction hook and the prefetch candidates run at once; the experts compute;
3. **offloaded** layer: look up every routed expert (hits, misses); misses the hybrid rule
   picks run on the host lane and are not loaded; the other misses are queued on the transfer
   lane (:mod:`workbench.sim.lane`, in the order of ``transfer_order``) and admitted into slots in order (:class:`~workbench.sim.cache.LayerFill`:
   issue → hits computed → issue → per admitted miss: computed → issue); as soon as every
   miss has a slot, the pre-eviction hook (ActiveEvict) and then the prefetch candidates run,
   the prefetches queued on the transfer lane behind the misses; hits compute first (a
   prefetched expert still in flight stalls until it lands), then the misses in order, each
   when its transfer is done; the layer ends when the host lane has delivered too;
4. ``demand-first`` transfer order: at the layer's end, prefetches for this layer (or an
   earlier one) that have not started are cancelled (:class:`Cancelled`: the slot is freed,
   no copy is made; ``Outcome.cancelled``); so is a pending prefetch evicted before it
   started. Under ``fifo`` nothing is ever cancelled.

With a layer-wise ``offload_unit`` (:mod:`workbench.sim.unit`) an offloaded layer copies all
its experts and waits for every copy, then computes its routed experts; the unit leaves at the
layer's end (:meth:`Simulator._layerwise`).

It returns an :class:`Outcome`: the counts, the modeled times, and a **schedule** — the
ordered, typed actions the live runtime executes on real tensors (:mod:`workbench.sim.schedule`:
:class:`Load`, :class:`Prefetch`, :class:`PreEvicted`, :class:`Hits`, :class:`HostRun`,
:class:`Miss`, :class:`Cancelled`). Slots are those of the instant the action runs: later actions of the same step
may reuse them. The live offloader and the Python replay engine
both call this function; the numba kernel (:mod:`workbench.replay.kernel`) is the checked fast
path of the same semantics. A new mechanism (a rank, a precision, a sub-expert) extends this
module once.

Times are modeled seconds on the lanes of :class:`Lanes` (per rank when ranks come).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from workbench.policies.eviction import EvictionPolicy
from workbench.sim.cache import ExpertCache, Key
from workbench.sim.lane import TransferLane
from workbench.sim.placement import Placement
from workbench.sim.schedule import (Action, Cancelled, Freed, Hits, HostRun, LayerUnit, Load,
                                    Miss, PreEvicted, Prefetch)
from workbench.sim.unit import OFFLOAD_UNITS, slots_needed

# lanes of a modeled span (the same codes as workbench.telemetry.events.LANES)
COMPUTE, TRANSFER, STALL, HOST = 0, 1, 2, 3

PreEvict = Callable[[ExpertCache, set], list]


@dataclass
class Access:
    """One (step, layer) group. ``experts`` are the layer's distinct routed experts (in the
    order the cache looks them up); ``compute_s`` / ``tokens`` are aligned with them."""

    step: int
    layer: int
    experts: Sequence[int]
    compute_s: Sequence[float]  # modeled seconds of each expert on the device
    dense_s: float = 0.0  # modeled seconds of the layer's dense work
    prefetch: Sequence[Key] = ()  # candidates (layer, expert), in order, already selected
    on_host: Sequence[bool] | None = None  # hybrid: run this expert on the host if missed
    host_s: Sequence[float] | None = None  # hybrid: modeled host seconds of each expert
    pre_evict: PreEvict | None = None  # called once every miss has a slot (ActiveEvict)
    group: int = -1  # index handed to the policies' begin_group (replay: group; live: -1)


@dataclass
class Outcome:
    """What :meth:`Simulator.step` decided for one group (see the module docstring)."""

    pinned: bool
    hits: list[int] = field(default_factory=list)  # cache hits (offloaded layers only)
    misses: list[int] = field(default_factory=list)  # every miss, host runs included
    host: list[int] = field(default_factory=list)  # misses run on the host (hybrid)
    evicted: list[Key] = field(default_factory=list)  # by admissions and prefetches, in order
    redundant: list[Key] = field(default_factory=list)  # evicted, prefetched, never used
    prefetched: list[Key] = field(default_factory=list)
    #: demand-first: prefetches dropped before their copy started (issued by this group or
    #: an earlier one; their slot freed, not in ``evicted``)
    cancelled: list[Key] = field(default_factory=list)
    prefetch_hits: int = 0  # hits on experts a prefetch brought in
    pre_evicted: list[Key] = field(default_factory=list)
    schedule: list[Action] = field(default_factory=list)
    stall_s: float = 0.0  # modeled
    end_s: float = 0.0  # modeled: when the group's output is ready on the compute lane
    moved: int = 0  # copies started over the link in this group (loads + prefetches)
    spans: list[tuple] = field(default_factory=list)  # (lane, layer, expert, start, end)


@dataclass
class Lanes:
    """Modeled timeline of one device: when each lane is next free (seconds)."""

    compute: float = 0.0
    host: float = 0.0  # (the transfer lane is Simulator.lane, a TransferLane)


class Simulator:
    """The caching semantics of one run over a :class:`Placement`: one cache per pool, one
    access clock shared by the pools, the modeled lanes, and the prefetch bookkeeping that
    spans groups (which resident experts a prefetch brought in and whether they were used).

    ``policy_factory()`` makes one eviction policy per pool. ``record_spans`` keeps the modeled
    spans of each group in its :class:`Outcome` (a live run with a store writes them; replay
    and a run without a store do not need them: nothing else the core computes depends on
    it). ``transfer_order``: ``fifo`` or ``demand-first`` (:mod:`workbench.sim.lane`).
    ``offload_unit``: ``expert``, ``layerwise`` or ``layerwise-prefetch``
    (:mod:`workbench.sim.unit`; every pool must hold the unit's slots)."""

    def __init__(self, placement: Placement, policy_factory: Callable[[], EvictionPolicy], *,
                 transfer_s: float = 0.0, record_spans: bool = False,
                 transfer_order: str = "fifo", offload_unit: str = "expert") -> None:
        if offload_unit not in OFFLOAD_UNITS:
            raise ValueError(f"offload_unit must be one of {', '.join(OFFLOAD_UNITS)}, "
                             f"not {offload_unit!r}")
        self.placement = placement
        L, E = placement.num_layers, placement.num_experts
        self.pools = [ExpertCache(int(n), policy_factory(), L, E) for n in placement.pool_slots]
        self.transfer_s = float(transfer_s)
        self.record_spans = record_spans
        self.lanes = Lanes()
        self.lane = TransferLane(self.transfer_s, transfer_order)
        self.clock = 0  # the pools' shared logical access clock
        self.pinned_accesses = np.zeros(L, np.int64)
        self._used: dict[Key, bool] = {}  # resident key → used since it was loaded
        self._prefetched: set[Key] = set()  # resident by a prefetch, not yet hit
        self.unit = offload_unit
        if offload_unit != "expert":
            off = ~placement.pinned
            n_off = int(off.sum())
            for p in set(placement.pool_of_layer[off].tolist()):
                share = int((placement.pool_of_layer[off] == p).sum())
                need = slots_needed(offload_unit, E, min(n_off, share) if
                                    placement.num_pools == 1 else 1)
                if int(placement.pool_slots[p]) < need:
                    raise ValueError(f"offload_unit {offload_unit!r} needs {need} slots in "
                                     f"pool {p}, which has {int(placement.pool_slots[p])}")

    # -- queries ------------------------------------------------------------------------------
    def pool(self, layer: int) -> ExpertCache:
        return self.pools[int(self.placement.pool_of_layer[layer])]

    def is_resident(self, key: Key) -> bool:
        return bool(self.placement.pinned[key[0]]) or key in self.pool(key[0])

    def residency(self) -> np.ndarray:
        """``bool [L, E]``: resident experts (pinned layers entirely)."""
        r = np.zeros((self.placement.num_layers, self.placement.num_experts), bool)
        for c in self.pools:
            r |= c.residency()
        r[self.placement.pinned] = True
        return r

    def unused_resident(self) -> int:
        """Resident experts a prefetch brought in that no access has used."""
        return sum(1 for c in self.pools for key in c.slot_of if not self._used.get(key, True))

    def counters(self) -> dict[str, np.ndarray]:
        """Cumulative per-layer counters summed over the pools, plus ``pinned_accesses``;
        ``loads`` are the copies made: admissions less the ``cancelled`` prefetches."""
        out = {k: sum(c.counters()[k] for c in self.pools)
               for k in ("hits", "misses", "loads", "evictions", "cancelled")}
        out["loads"] = out["loads"] - out["cancelled"]  # copies made (admissions less cancelled)
        out["pinned_accesses"] = self.pinned_accesses.copy()
        return out

    # -- the step -------------------------------------------------------------------------------
    def step(self, acc: Access) -> Outcome:
        """Decide and price one group (see the module docstring)."""
        layer = int(acc.layer)
        pinned = bool(self.placement.pinned[layer])
        out = Outcome(pinned=pinned)
        self._out = out  # the group whose outcome the lane's copies are booked on
        for c in self.pools:
            c.policy.begin_group(acc.group, acc.step)
            c.policy.begin_layer(layer)
        now = self._dense(acc, out)
        experts = list(acc.experts)
        if self.unit != "expert":
            return self._layerwise(acc, out, now, pinned)
        if pinned:
            self.pinned_accesses[layer] += len(experts)
            out.hits = []
            self._after_fill(acc, out, now, set(), frozenset())
            out.schedule.append(Hits([]))
            now = self._compute_many(out, layer, zip(experts, acc.compute_s), now)
            return self._end(out, now, layer)
        cache = self.pool(layer)
        cache.t = self.clock
        hits, misses = cache.lookup(layer, experts)
        self.clock = cache.t
        out.hits, out.misses = hits, misses
        host_done = now
        on_host: set[int] = set()
        if acc.on_host is not None:
            pos = {e: i for i, e in enumerate(experts)}
            for e in misses:
                if acc.on_host[pos[e]]:
                    on_host.add(e)
                    start = max(self.lanes.host, now)
                    self.lanes.host = host_done = start + float(acc.host_s[pos[e]])
                    self._span(out, HOST, layer, e, start, host_done)
            out.host = [e for e in misses if e in on_host]
        device_misses = [e for e in misses if e not in on_host] if on_host else misses
        self._count_hits(out, layer, hits)
        demand, started = self.lane.demand, self._started
        for e in device_misses:
            demand((layer, e), now, started)
        self._fill(acc, out, cache, experts, hits, device_misses, now)
        # hits first (a prefetched one may still be in flight), then the misses in order
        miss_set = set(device_misses)
        pairs = list(zip(experts, acc.compute_s))
        now = self._compute_many(out, layer, [(e, d) for e, d in pairs
                                              if e not in miss_set and e not in on_host], now)
        now = self._compute_many(out, layer, [(e, d) for e, d in pairs if e in miss_set], now)
        if host_done > now:  # the layer's output needs the host's experts too
            self._span(out, STALL, layer, out.host[-1], now, host_done)
            out.stall_s += host_done - now
            now = host_done
        return self._end(out, now, layer)

    # -- the layer-wise unit (offload_unit ≠ expert, workbench.sim.unit) -----------------------
    def _layerwise(self, acc: Access, out: Outcome, now: float, pinned: bool) -> Outcome:
        """One group under a layer-wise unit: keys of other layers still resident leave (none
        in a well-formed run); ``layerwise-prefetch`` issues the next layer's copies now; an
        offloaded layer looks its routed experts up (hits only on a prefetched unit), copies
        its unit if nobody prefetched it, waits for every copy, computes, and lets the unit
        go."""
        layer, E = int(acc.layer), self.placement.num_experts
        experts = list(acc.experts)
        nxt = layer + 1
        ahead = (self.unit == "layerwise-prefetch" and nxt < self.placement.num_layers
                 and not self.placement.pinned[nxt])
        keep = {layer, nxt} if ahead else {layer}
        for c in self.pools:  # stale units (a layer with no group): let them go
            for key in [k for k in c.slot_of if k[0] not in keep]:
                self._free(out, key, now)
        if pinned:
            self.pinned_accesses[layer] += len(experts)
            if ahead:
                self._copy_unit(out, nxt, now)
            out.schedule.append(Hits([]))
            now = self._compute_many(out, layer, zip(experts, acc.compute_s), now)
            return self._end(out, now, layer)
        cache = self.pool(layer)
        staged = (layer, 0) in cache  # a unit is whole or absent
        cache.t = self.clock
        hits, misses = cache.lookup(layer, experts)
        self.clock = cache.t
        out.hits, out.misses = hits, misses
        self._count_hits(out, layer, hits)
        if not staged:  # copied now: the routed experts on demand, then the others
            self._copy_unit(out, layer, now, demand=misses)
        if ahead:  # the next layer's copies, behind this layer's on the lane
            self._copy_unit(out, nxt, now)
        ready = max((self.lane.land((layer, e), self._started) or 0.0) for e in range(E))
        if ready > now:  # the layer waits for its whole unit
            self._span(out, STALL, layer, experts[-1] if experts else -1, now, ready)
            out.stall_s += ready - now
            now = ready
        out.schedule.append(LayerUnit(experts, [cache.slot((layer, e)) for e in experts]))
        for e, d in zip(experts, acc.compute_s):
            self._span(out, COMPUTE, layer, e, now, now + float(d))
            now += float(d)
        for e in range(E):
            self._free(out, (layer, e), now)
        return self._end(out, now, layer)

    def _copy_unit(self, out: Outcome, layer: int, now: float, demand: Sequence[int] = ()
                   ) -> None:
        """Admit and queue all E experts of ``layer``: ``demand`` ones as demand loads (the
        routed misses), the others as prefetches (booked in ``out.prefetched``); every copy
        is a :class:`Prefetch` record for the executor (a :class:`LayerUnit` waits for
        them)."""
        c = self.pool(layer)
        E = self.placement.num_experts
        wanted = set(demand)
        order = [*demand, *(e for e in range(E) if e not in wanted)]
        protected = {(layer, e) for e in range(E)}
        for e in order:
            key = (layer, e)
            c.t = self.clock
            got = c.admit(key, protected)
            self.clock = c.t
            if got is None:  # cannot happen: the knob check gives every pool the unit's slots
                raise RuntimeError(f"layer {layer}: no slot for expert {e} of its unit")
            slot, victim = got
            if victim is not None:
                self._evicted(out, victim, now)
            if e in wanted:
                self._used[key] = True
                self.lane.demand(key, now, self._started)
            else:
                self._used[key] = False
                self._prefetched.add(key)
                self.lane.prefetch(key, now, layer, self._started)
                out.prefetched.append(key)
            out.schedule.append(Prefetch(key, slot, victim))

    def _free(self, out: Outcome, key: Key, now: float) -> None:
        """The unit lets ``key`` go (an eviction; redundant when it was never used)."""
        self.pool(key[0]).evict(key)
        self._evicted(out, key, now)
        self._used.pop(key, None)
        out.schedule.append(Freed(key))

    # -- pieces of the step ---------------------------------------------------------------------
    def _dense(self, acc: Access, out: Outcome) -> float:
        start = self.lanes.compute
        now = start + acc.dense_s
        self._span(out, COMPUTE, acc.layer, -1, start, now)
        return now

    def _count_hits(self, out, layer: int, hits) -> None:
        """Hits on a prefetched key count once as prefetch hits; every hit marks its key used."""
        for e in hits:
            key = (layer, e)
            if key in self._prefetched:
                out.prefetch_hits += 1
                self._prefetched.discard(key)
            self._used[key] = True

    def _fill(self, acc: Access, out: Outcome, cache: ExpertCache, experts: list[int],
              hits: list[int], misses: list[int], now: float) -> None:
        """Admit the layer's misses in the order the live offloader issues its copies, and
        write the schedule it executes."""
        layer = int(acc.layer)
        fill = cache.fill(layer, experts, misses)
        admitted: list[int] = []
        needed = {(layer, e) for e in experts}  # every routed expert stays until computed
        state = {"pre_done": False}

        def issue() -> None:
            cache.t = self.clock
            got = fill.issue()
            self.clock = cache.t
            for e, slot, victim in got:
                if victim is not None:
                    self._evicted(out, victim, now)
                key = (layer, e)
                self._used[key] = True
                self._prefetched.discard(key)
                admitted.append(e)
                out.schedule.append(Load(e, slot, victim))
            if not state["pre_done"] and not fill.pending:
                # all of this layer's misses have a slot: make room for the next layers
                # while this one still computes
                state["pre_done"] = True
                self._after_fill(acc, out, now, needed, fill.protected)

        issue()
        out.schedule.append(Hits([cache.slot((layer, e)) for e in hits]))
        fill.done(hits)
        issue()
        out.schedule.extend(HostRun(e) for e in out.host)
        i = 0
        while i < len(admitted):
            out.schedule.append(Miss(admitted[i]))
            # (with every miss admitted and the pre-fill hooks run, done and issue change
            # nothing: the common case, skipped — one key of each sub-expert run's copies)
            if fill.pending or not state["pre_done"]:
                fill.done((admitted[i],))
                i += 1
                issue()
            else:
                i += 1
        if fill.pending:  # cannot happen with ≥ 1 slot per pool: every miss frees one
            raise RuntimeError(f"layer {layer}: {len(fill.pending)} experts found no slot")

    def _after_fill(self, acc: Access, out: Outcome, now: float, needed: set,
                    protected: frozenset | set) -> None:
        """Pre-eviction (ActiveEvict), then the prefetch candidates, at the instant every miss
        of the layer has a slot."""
        if acc.pre_evict is not None:
            nxt = min(int(acc.layer) + 1, self.placement.num_layers - 1)
            gone = acc.pre_evict(self.pool(nxt), set(needed))
            for key in gone:
                self._prefetched.discard(key)
                out.pre_evicted.append(key)
                out.schedule.append(PreEvicted(key))
                self._unqueue(out, key, now)
        for key in acc.prefetch:
            key = (int(key[0]), int(key[1]))
            c = self.pool(key[0])
            if key in c:
                continue
            c.t = self.clock
            got = c.admit(key, protected)
            self.clock = c.t
            if got is None:
                continue
            slot, victim = got
            if victim is not None:
                self._evicted(out, victim, now)
            self._used[key] = False
            self._prefetched.add(key)
            self.lane.prefetch(key, now, key[0], self._started)
            out.prefetched.append(key)
            out.schedule.append(Prefetch(key, slot, victim))

    def _evicted(self, out: Outcome, key: Key, now: float) -> None:
        out.evicted.append(key)
        # (_unqueue finds nothing to cancel while no prefetch is pending: not called then)
        if (not (self.lane.pending and self._unqueue(out, key, now))
                and not self._used.get(key, True)):
            out.redundant.append(key)
        self._prefetched.discard(key)

    def _unqueue(self, out: Outcome, key: Key, now: float) -> bool:
        """Demand-first: ``key`` left the cache at ``now``; a prefetch of it that has not
        started is cancelled (no copy; counted in ``cancelled``, not redundant)."""
        if not self.lane.pending or not self.lane.cancel(now, None, key, self._started):
            return False
        self.pool(key[0]).cancelled[key[0]] += 1
        out.cancelled.append(key)
        return True

    def _started(self, key: Key, start: float, end: float) -> None:
        """A copy started on the transfer lane: booked on the group in progress."""
        out = self._out
        out.moved += 1
        if self.record_spans:
            out.spans.append((TRANSFER, int(key[0]), int(key[1]), start, end))

    def _compute_many(self, out: Outcome, layer: int, pairs, now: float) -> float:
        """Compute ``pairs`` ((expert, modeled seconds), in order) of ``layer`` from ``now``:
        each waits for its copy to land (a stall), then runs; returns when the last ends.
        (The per-key path of every computed key, in one loop, not a call per key: ≈ 10 % of
        the core's time caching sub-experts, bench_core_step; spans appended here, not by
        :meth:`_span`.)"""
        lane, started = self.lane, self._started
        ready = lane.ready
        spans = out.spans if self.record_spans else None
        L = int(layer)
        for e, d in pairs:
            key = (layer, e)
            # (no pending prefetch: landing is the ready time's pop, as TransferLane.land)
            r = lane.land(key, started) if lane.pending else ready.pop(key, None)
            if r is not None and r > now:
                if spans is not None:
                    spans.append((STALL, L, int(e), now, r))
                out.stall_s += r - now
                now = r
            end = now + float(d)
            if spans is not None:
                spans.append((COMPUTE, L, int(e), now, end))
            now = end
        return now

    def _end(self, out: Outcome, now: float, layer: int) -> Outcome:
        if self.lane.pending:  # demand-first: prefetches for a layer that has run
            for key in self.lane.cancel(now, layer, None, self._started):
                self.pool(key[0]).cancel(key)
                self._used.pop(key, None)
                self._prefetched.discard(key)
                out.cancelled.append(key)
                out.schedule.append(Cancelled(key))
        self.lanes.compute = out.end_s = now
        return out

    def _span(self, out: Outcome, lane: int, layer: int, expert: int, start: float,
              end: float) -> None:
        if self.record_spans:
            out.spans.append((lane, int(layer), int(expert), start, end))

