"""Trace replay: how a cache + prefetch configuration would have done on a routing trace.

``replay(trace, knobs)`` serves the trace's access groups (see :mod:`workbench.traces.trace`)
through an expert cache of ``cache_slots`` slots, the first ``pinned_layers`` layers resident,
prefetching ``prefetch_lead`` layers ahead, and prices it on the modeled timeline of
``profile``/``target_model`` exactly as the live runtime's modeled clock does. Two engines:

- ``fast`` (numba, :mod:`workbench.replay.kernel`) for the built-in eviction policies;
- ``python``: the real :class:`ExpertCache`, :class:`LayerFill` and policy objects, for any
  registered policy (tests hold both equal, and equal to the live run they replay).

``hybrid=True`` (GPU–CPU hybrid mode) runs every miss that
:func:`~workbench.sim.costs.runs_on_host` picks on the modeled host lane instead of loading
it, as the live runtime does (python engine only).

``transfer_order`` (``fifo`` or ``demand-first``, :mod:`workbench.sim.lane`) is modeled by both
engines, cancelled prefetches included; without prefetch both orders are the same lane.

``offload_unit`` (``expert``, ``layerwise``, ``layerwise-prefetch``: :mod:`workbench.sim.unit`)
is modeled by the python engine only (the numba kernel is the per-expert cache): ``auto``
chooses it for a layer-wise unit and ``fast`` is refused with one line.

``scope="per-layer"`` gives every offloaded layer its own ``cache_slots // offloaded layers`` slots
instead of one shared pool. All times are *modeled* seconds.

Memory: the fast engine streams the trace in chunks of steps (:data:`CHUNK_ACCESSES` accesses
each) through one kernel state, so a replay holds the per-(step, layer) outputs, Belady's
future (4 bytes an access) and one chunk — not the trace's access groups (a 200 MB ``.npy``:
6.4 GB before, 0.9 GB, ``benchmarks/bench_trace_memory.py --replay``). :func:`replay_bytes` is
checked against the trace memory budget before anything is allocated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workbench.errors import InputError, KnobError, StoreError
from workbench.policies.eviction import EVICTION
from workbench.policies.prefetch import PREFETCH, plan_prefetch
from workbench.replay import kernel as K
from workbench.sim.costs import CostSpec, Prices
from workbench.sim.lane import CANCELLING_ORDERS
from workbench.sim.placement import SCOPES, Placement  # noqa: F401 (re-exported)
from workbench.sim.profiles import get_profile, get_target_model
from workbench.sim.step import Access, Simulator
from workbench.traces.trace import COMPACT_KEYS, Groups, Trace


@dataclass
class ReplayResult:
    """Outcome of one replay. Per-(step, layer) arrays are ``[steps, layers]`` counts: int64,
    or on a trace of more than :data:`NARROW_CELLS` (step, layer) cells the narrowest unsigned
    type that holds them (sum them; do not add two elementwise). ``hits``
    and ``misses`` count expert-cache lookups (offloaded layers); the pinned prefix's accesses
    are in ``pinned_accesses`` — the same split as a run store and the run summary. Times are
    modeled; NaN (``metrics()``: None) when the trace carries no model sizes to price them."""

    config: dict[str, Any]
    hits: np.ndarray
    misses: np.ndarray
    pinned_accesses: np.ndarray
    prefetch_loads: np.ndarray
    prefetch_hits: np.ndarray
    evictions: np.ndarray
    redundant: np.ndarray
    host_runs: np.ndarray  # misses run on the host (hybrid mode), not loaded
    cancelled: np.ndarray  # demand-first: prefetches cancelled before their copy started
    stall_s: np.ndarray  # float [steps, layers], modeled
    step_latency_s: np.ndarray  # float [steps], modeled
    pinned: np.ndarray
    unused_at_end: int
    num_tokens: int
    expert_bytes: float
    transfer_time_s: float
    elapsed_s: float  # measured wall time of the replay itself
    extra: dict[str, Any] = field(default_factory=dict)

    # -- totals ------------------------------------------------------------------------------
    def _off(self, a: np.ndarray) -> int:
        return int(a[:, ~self.pinned].sum())

    @property
    def accesses(self) -> int:
        return self._off(self.hits) + self._off(self.misses)

    @property
    def hit_rate(self) -> float:
        n = self.accesses
        return self._off(self.hits) / n if n else float("nan")

    @property
    def loads(self) -> int:
        """Transfers: demand loads (one per miss not run on the host) plus prefetches, less
        the prefetches cancelled before their copy started (demand-first)."""
        return (self._off(self.misses) - int(self.host_runs.sum())
                + int(self.prefetch_loads.sum()) - int(self.cancelled.sum()))

    @property
    def priced(self) -> bool:
        """Whether the replay had model sizes to price times and bytes with."""
        return self.expert_bytes == self.expert_bytes  # NaN: no cost model

    def metrics(self) -> dict[str, Any]:
        """Every I/O figure (ActiveEvict's metrics) and the bounds, as plain numbers (times modeled; None when
        the trace carries no model sizes)."""
        loads = self.loads
        misses = self._off(self.misses)
        pf = int(self.prefetch_loads.sum())
        pf_hits = int(self.prefetch_hits.sum())
        redundant = int(self.redundant.sum())
        out = {
            "accesses": self.accesses, "hits": self._off(self.hits), "misses": misses,
            "hit_rate": self.hit_rate,
            "demand_loads": misses - int(self.host_runs.sum()), "prefetch_loads": pf,
            "prefetch_hits": pf_hits, "host_runs": int(self.host_runs.sum()),
            "cancelled_prefetches": int(self.cancelled.sum()),
            "transfers": loads, "evictions": int(self.evictions.sum()),
            "transfer_bytes": int(loads * self.expert_bytes) if self.priced else None,
            "transfer_bytes_per_token": loads * self.expert_bytes / max(self.num_tokens, 1),
            "blocking_io_s": float(self.stall_s.sum()),
            "total_io_s": loads * self.transfer_time_s,
            "latency_s": float(self.step_latency_s.sum()),
            "redundant_transfers": redundant,
            "redundant_share": redundant / loads if loads else 0.0,
            "unused_at_end": self.unused_at_end,
            "fetch_precision": (loads - redundant - self.unused_at_end) / loads if loads else 1.0,
            "prefetch_recall": pf_hits / (pf_hits + misses) if pf_hits + misses else 0.0,
            "replay_s_measured": self.elapsed_s,
            "accesses_per_s_measured": self.accesses / self.elapsed_s if self.elapsed_s else None,
        }
        out.update(self.extra)
        # no offloaded access (empty trace, everything pinned): no rate, rather than NaN
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in out.items()}

    def per_layer(self) -> dict[str, np.ndarray]:
        """Per-layer totals (pinned layers included, flagged in ``pinned``)."""
        h, m = self.hits.sum(0), self.misses.sum(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = h / (h + m)
        return {"hits": h, "misses": m, "hit_rate": rate, "stall_s": self.stall_s.sum(0),
                "host_runs": self.host_runs.sum(0),
                "evictions": self.evictions.sum(0), "redundant": self.redundant.sum(0),
                "pinned": self.pinned}


def _where(trace: Trace) -> str:
    """The trace as an error message names it: its format and path."""
    return f"{trace.attrs.get('source', 'trace')} {trace.attrs.get('path', '')!s}".strip()


#: replay memory per (layer, expert) key, bytes: the kernel's per-key state (8 int64 + 8 uint8
#: + ready, and the transfer lane's pending list: 2 int64 links + an issue time), the hotness
#: policy's ring of recent uses (512) and Belady's per-key offsets (8): 624 at most
REPLAY_BYTES_PER_KEY = 640
#: the python engine's memory per (step, layer), bytes (measured 213 before streaming: its
#: per-group outputs and per-(step, layer) results; ``bench_trace_memory.py --replay``)
PYTHON_BYTES_PER_STEP_LAYER = 216


def replay_bytes(trace: Trace, engine: str = "fast", eviction: str = "lru",
                 hits_only: bool = False, prefetch_lead: int = 0) -> int:
    """Bytes a replay of ``trace`` allocates besides the trace (an upper estimate; the python
    engine's access groups are checked by :meth:`Trace.groups` itself). The fast engine
    streams: per (step, layer) its counts and stall (:class:`_Outputs`: 15 bytes when narrow,
    64 when not), per step 32, per access 4 for Belady's future, per key
    :data:`REPLAY_BYTES_PER_KEY`, and one chunk's working set (≈ 150 bytes per access of
    :data:`CHUNK_ACCESSES` or of the trace if it has fewer, and a prefetch plan of
    ``prefetch_lead`` layers ahead ≈ 48 bytes per access and layer of lead, a lead reaching at
    most the step's last layer: 0 = no prefetch). Keys are those in use
    (:meth:`Trace.compact_experts` first)."""
    S, L, E = trace.num_steps, trace.num_layers, trace.num_experts
    keys = L * E * REPLAY_BYTES_PER_KEY
    if engine != "fast":
        return S * L * PYTHON_BYTES_PER_STEP_LAYER + keys
    narrow = S * L > NARROW_CELLS
    cell = (7 if narrow else 56) + (0 if hits_only else 8)
    slots = trace.num_tokens * L * trace.top_k  # every routed (token, layer) slot
    future = 4 * slots if K.POLICY_CODES.get(eviction) == K.BELADY else 0  # its future list
    # what is allocated, not the knobs' reach: a chunk holds no more accesses than the trace,
    # and a plan looks ahead only to the step's last layer (depths l + d < L)
    lead = min(prefetch_lead, max(L - 1, 0))
    chunk = (150 + 48 * lead) * min(CHUNK_ACCESSES, slots)
    return S * L * cell + 32 * S + future + keys + chunk


def _check_replay_memory(trace: Trace, engine: str, hits_only: bool,
                         eviction: str = "lru", prefetch_lead: int = 0) -> None:
    """Refuse, before allocating, a replay whose state exceeds the trace memory budget (the
    one loading and :meth:`Trace.groups` use)."""
    from workbench.traces import limits

    limits.check(replay_bytes(trace, engine, eviction, hits_only, prefetch_lead),
                 limits.budget(None),
                 f"{_where(trace)}: replay",
                 f"its state ({trace.num_steps:,} steps × {trace.num_layers:,} layers, "
                 f"{trace.num_layers:,} × {trace.num_experts:,} (layer, expert) keys) would")


def cost_of(trace: Trace, profile: str, target_model: str, expert_bytes: float | None):
    """(CostSpec or None, HardwareProfile). Imported traces know no model sizes: they are
    priced only with a target model (or explicit expert bytes), else their times are
    unavailable (None); stores carry their run's cost spec."""
    prof = get_profile(profile)
    if target_model != "none":
        return CostSpec.from_target(get_target_model(target_model)), prof
    spec = trace.attrs.get("cost_spec")
    if spec is not None:
        return _recorded_cost(trace, spec), prof
    if expert_bytes is None:
        return None, prof  # hit counts only: nothing to price the times with
    return CostSpec("given", float(expert_bytes), 0.0, 0.0, 0.0), prof


def _recorded_cost(trace: Trace, spec) -> CostSpec:
    """The cost spec a store (or a ``.wbtrace`` ``@attr``) recorded, read by the typed run
    metadata reader (its fields are the :class:`CostSpec` fields, sizes finite and ≥ 0)."""
    from workbench.telemetry.metadata import RunMetadata

    try:
        cost, problem = RunMetadata.field({"cost_spec": spec}, "cost_spec"), None
    except StoreError as e:
        cost, problem = None, e
    if cost is None:
        raise InputError(f"{_where(trace)}: attribute 'cost_spec' is unusable "
                         f"({str(problem)[:160]}); "
                         f"replay with --set target_model=NAME to price it instead")
    return cost


def replay(trace: Trace, knobs: Any = None, *, scope: str = "global", engine: str = "auto",
           expert_bytes: float | None = None, groups: Groups | None = None,
           hits_only: bool = False, **knob_values: Any) -> ReplayResult:
    """Replay ``trace`` under ``knobs`` (a :class:`~workbench.knobs.Knobs`; None: every knob's
    default) changed by ``knob_values`` (``cache_slots=32``, ``eviction="lfu"``, …); see the
    module docstring. The knobs are checked as a trace replay (:meth:`Knobs.check` with
    ``live=False``): a bad setting raises :class:`KnobError`. ``expert_bytes`` prices a trace
    that carries no model sizes when no ``target_model`` is set; with neither, the hit counts
    are exact and the times unavailable (:attr:`ReplayResult.priced` False). ``groups``:
    ``trace.groups()`` when the caller already has them (replaying one trace twice).
    ``hits_only``: skip the modeled clock (a bound needs only its hit rate); the counts are
    those of a priced replay, the times unavailable."""
    if groups is None:  # (a caller with groups built them from a compacted trace)
        trace = trace.compact_experts()
    st = _settings(trace, knobs, knob_values, scope, engine, expert_bytes)
    if getattr(st.knobs, "prism_offload", False):  # the cache holds sub-experts
        trace, groups = _subexpert_keys(trace, st, scope), None
    elif trace.subexperts > 1:  # MoE-Prism's global K may leave routed experts idle
        ran = trace.ran_experts()
        if ran is not trace:
            trace, groups = ran, None
    _check_replay_memory(trace, st.engine, hits_only, st.knobs.eviction,
                         st.knobs.prefetch_lead if PREFETCH.get(st.knobs.prefetch).fetches else 0)
    if hits_only and not st.knobs.hybrid:  # hybrid decides misses by price: keep them
        st.prices = Prices(st.prices.profile, None)
    if st.engine == "fast":  # builds its own groups, chunk by chunk (``groups`` unused)
        return _replay_fast(trace.compact_experts(), st, hits_only)
    if groups is None:
        groups = trace.groups()
    prices = st.prices
    dense, comp = _work(prices, groups, trace)
    k = st.knobs
    pf_ptr, pf_key = plan_prefetch(PREFETCH.create(k.prefetch, **st.values), trace, groups,
                                   st.placement.pinned, k.prefetch_lead, k.prefetch_budget)
    host = None
    if k.hybrid:  # per access: (runs on the host if missed?, modeled host seconds) of its
        hp = prices.part(st.part)  # key: an expert, or a sub-expert (1/N of the work)
        host = (Prices.many(hp.on_host, groups.expert_tokens, bool),
                Prices.many(hp.host, groups.expert_tokens))
    policy_stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    policy_knobs = EVICTION.kwargs_for(k.eviction, st.values)
    out = run_python(groups, dense, comp, st.placement,
                      lambda: make_policy(k.eviction, policy_knobs, groups, trace),
                      pf_ptr, pf_key, st.transfer_s, trace.num_steps,
                      stats=policy_stats, host=host, transfer_order=k.transfer_order,
                      offload_unit=k.offload_unit)
    hits, misses, pf_loads, pf_hits, stall, g_end, ev_sl, red_sl, unused, host_runs, canc = out
    acc = _Outputs(trace.num_steps, trace.num_layers, keep_stall=st.prices.available)
    acc.add(groups.step, groups.layer, (hits, misses, pf_loads, pf_hits, host_runs), stall,
            g_end, (ev_sl, red_sl, canc), 0, trace.num_steps)
    return acc.result(trace, st, int(unused), time.perf_counter() - t0, policy_stats)


def _work(prices: Prices, groups: Groups, trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Modeled seconds of dense work per group (over the tokens that reach its layer: pruned
    tokens skip the layers behind the pinned prefix) and of expert work per access.

    MoE-Prism (a trace with sub-experts): each expert's op is :meth:`Prices.subexpert_op` of
    the sub-experts it ran, as the live clock prices it; on a trace whose keys are the
    sub-experts (:meth:`Trace.as_subexperts`) each sub-expert's access carries its share of
    its expert's op (by its runs), so both granularities price the same compute."""
    layer_tokens = (groups.layer_tokens if groups.layer_tokens is not None
                    else groups.step_tokens[groups.step])
    dense = Prices.many(prices.dense, layer_tokens)
    split = trace.attrs.get("subexpert_of")
    N = int(split) if split else trace.subexperts
    if N == 1:
        return dense, Prices.many(prices.expert, groups.expert_tokens)
    sub = groups if split else trace.as_subexperts().groups()
    # one op per (group, expert): its sub-experts' accesses are adjacent (ids e·N + s ascend)
    g = np.repeat(np.arange(sub.num_groups), np.diff(sub.ptr))
    e = sub.expert.astype(np.int64) // N
    start = np.ones(len(e), bool)
    start[1:] = (g[1:] != g[:-1]) | (e[1:] != e[:-1])
    op = np.cumsum(start) - 1
    runs = np.bincount(op, weights=sub.expert_tokens).astype(np.int64)
    parts = np.bincount(op).astype(np.int64)
    op_s = Prices.many(lambda code: prices.subexpert_op(code // (N + 1), code % (N + 1), N),
                       runs * (N + 1) + parts)
    if split:
        return dense, op_s[op] * sub.expert_tokens / runs[op]
    if len(op_s) != groups.num_accesses:  # a routed slot that ran no sub-expert
        raise InputError(f"{_where(trace)}: an expert access ran no sub-expert; replay it "
                         f"with prism_offload=True (only the sub-experts run are accessed)")
    return dense, op_s


#: accesses per chunk of a streamed (fast engine) replay: its working set is ≈ 150 bytes per
#: access of a chunk, whatever the trace's length
CHUNK_ACCESSES = 1 << 19


def _replay_fast(trace: Trace, st: "_Settings", hits_only: bool) -> ReplayResult:
    """The compiled replay, streamed over chunks of steps (:meth:`Trace.step_chunks`): each
    chunk's groups, prefetch plan and prices are built, run through one
    :class:`~workbench.replay.kernel.KernelState` carried from chunk to chunk, and dropped; only
    the per-(step, layer) outputs and Belady's future (4 bytes per access) span the trace. A
    chunk is planned with the step before it (``previous-step`` prefetch reads it), whose
    groups the previous chunk ran."""
    k, prices, placement = st.knobs, st.prices, st.placement
    L, E, S = trace.num_layers, trace.num_experts, trace.num_steps
    nk = L * E
    code = K.POLICY_CODES[k.eviction]
    policy = PREFETCH.create(k.prefetch, **st.values)
    chunks = trace.step_chunks(CHUNK_ACCESSES)
    t0 = time.perf_counter()
    occ_ptr, occ_grp = np.zeros(nk + 1, np.int64), K.no_future()
    G = A = 0
    if code == K.BELADY:
        occ_ptr, occ_grp, G, A = _belady_future(trace, chunks, nk)
    pf_bound = _candidates_per_group(policy, k, E, nk)
    window = st.values["hotness_window"]  # ≤ K.RING: the knob's bound
    state = K.KernelState(nk, placement.pool_slots, code, float(st.values["hotness_decay"]),
                          window, E, L, G, 2 * A + G * pf_bound + 1,
                          occ_ptr if code == K.BELADY else None, K.ORDER_CODES[k.transfer_order])
    # only demand-first with prefetch cancels: otherwise the count stays unwritten (zero pages)
    cancels = k.transfer_order in CANCELLING_ORDERS and PREFETCH.get(k.prefetch).fetches
    out = _Outputs(S, L, keep_stall=prices.available and not hits_only)
    g0 = 0
    for s0, s1 in chunks:
        lo = max(s0 - 1, 0)
        sub = trace.step_slice(lo, s1)
        groups = sub.groups()
        skip = int(np.searchsorted(groups.step, s0 - lo))  # the step before: run already
        pf_ptr, pf_key = plan_prefetch(policy, sub, groups, placement.pinned, k.prefetch_lead,
                                       k.prefetch_budget, step_offset=lo, first_group=skip)
        a0, p0 = int(groups.ptr[skip]), int(pf_ptr[skip])
        dense, comp = _work(prices, groups, sub)
        g_step = groups.step[skip:].astype(np.int64) + lo
        g_layer = groups.layer[skip:].astype(np.int64)
        go, gf, sl = state.run(
            g_layer, g_step, groups.ptr[skip:] - a0, groups.keys()[a0:], dense[skip:],
            comp[a0:], placement.pinned, placement.pool_of_layer, occ_ptr, occ_grp,
            pf_ptr[skip:] - p0, pf_key[p0:], float(st.transfer_s), g0, s0, s1 - s0)
        out.add(g_step, g_layer, (go[K.G_HITS], go[K.G_MISSES], go[K.G_PF_LOADS],
                                  go[K.G_PF_HITS], None), gf[0], gf[1],
                (sl[0], sl[1], sl[2] if cancels else None), s0, s1)
        g0 += len(g_layer)
    return out.result(trace, st, state.unused_at_end(), time.perf_counter() - t0, {})


def _candidates_per_group(policy, k, E: int, nk: int) -> int:
    """An upper bound of one group's prefetch candidates (for the access clock's bound that
    decides Belady's tree): the budget (or the policy's default budget), else a built-in's
    depths × experts, else every key."""
    if not policy.fetches:
        return 0
    budget = k.prefetch_budget if k.prefetch_budget is not None else getattr(
        policy, "default_budget", None)
    depths = getattr(type(policy), "depths", None)
    L = nk // max(E, 1)  # depths past the last layer name nothing
    bound = sum(d < L for d in depths(k.prefetch_lead)) * E if callable(depths) else nk
    return min(bound, int(budget) if budget is not None else bound, nk)


def _belady_future(trace: Trace, chunks, nk: int):
    """Belady's future over the whole trace, chunk by chunk: CSR ``(occ_ptr [keys + 1],
    occ_grp [accesses])`` of the (global) groups each key occurs in, ascending, int32 where the
    group count allows; and the trace's group and access counts. Each chunk's groups are built
    twice here (count, then fill) and once more by the replay: rebuilding is ≈ 7 ns an access,
    keeping them would cost the memory streaming saves."""
    counts = np.zeros(nk + 1, np.int64)
    sizes = []
    for s0, s1 in chunks:
        groups = trace.step_slice(s0, s1).groups()
        counts[1:] += np.bincount(groups.keys(), minlength=nk)
        sizes.append(groups.num_groups)
    occ_ptr = np.cumsum(counts)
    G, A = int(sum(sizes)), int(occ_ptr[-1])
    occ_grp = np.zeros(A, K.occ_dtype(G))
    fill = occ_ptr[:-1].copy()
    g0 = 0
    for (s0, s1), n in zip(chunks, sizes):
        groups = trace.step_slice(s0, s1).groups()
        K.fill_occurrences(groups.ptr, groups.keys(), g0, fill, occ_grp)
        g0 += n
    return occ_ptr, occ_grp, G, A


class _Outputs:
    """A replay's per-(step, layer) outputs, filled chunk by chunk (or at once).

    Counts are kept int64 while the trace is small; beyond :data:`NARROW_CELLS` (step, layer)
    cells they start as uint8 and widen only when a value needs it — a 200 MB trace has 25 M
    cells, 8 bytes each per count was most of its replay's memory (issue 26). Sum them (numpy
    sums small unsigned ints in 64 bits); do not add two such arrays elementwise."""

    COUNTS = ("hits", "misses", "prefetch_loads", "prefetch_hits", "host_runs", "evictions",
              "redundant", "cancelled")

    def __init__(self, S: int, L: int, keep_stall: bool):
        self.S, self.L = S, L
        dtype = np.uint8 if S * L > NARROW_CELLS else np.int64
        # np.zeros maps zero pages: a count never written (host runs of the fast engine,
        # prefetch of a replay without it) costs no memory
        self.counts = {n: np.zeros(S * L, dtype) for n in self.COUNTS}
        self.stall = np.zeros(S * L) if keep_stall else None
        self.step_end = np.zeros(S)

    def _put(self, name: str, idx, values: np.ndarray) -> None:
        arr = self.counts[name]
        top = int(values.max()) if values.size else 0
        if top > np.iinfo(arr.dtype).max:
            for dt in (np.uint16, np.uint32, np.int64):
                if top <= np.iinfo(dt).max:
                    break
            arr = self.counts[name] = arr.astype(dt)
        arr[idx] = values

    def add(self, g_step, g_layer, per_group, stall, g_end, per_sl, s0: int, s1: int) -> None:
        """One chunk: per-group ``(hits, misses, pf_loads, pf_hits, host_runs or None)``,
        stall and end times; ``per_sl`` (evictions, redundant, cancelled or None) over steps
        ``s0 .. s1-1`` (on the layer of the key)."""
        flat = g_step.astype(np.int64) * self.L + g_layer  # at most one group per cell
        for name, v in zip(self.COUNTS[:5], per_group):
            if v is not None:
                self._put(name, flat, v)
        for name, v in zip(self.COUNTS[5:], per_sl):
            if v is None:
                continue
            self._put(name, slice(s0 * self.L, s1 * self.L), v[:(s1 - s0) * self.L])
        if self.stall is not None:
            self.stall[flat] = stall
        if len(g_step):  # each step's end: its last group's end time
            last = np.r_[np.flatnonzero(np.diff(g_step)), len(g_step) - 1]
            self.step_end[g_step[last]] = g_end[last]

    def result(self, trace: Trace, st: "_Settings", unused: int, elapsed: float,
               policy_stats: dict) -> ReplayResult:
        S, L = self.S, self.L
        c = {n: a.reshape(S, L) for n, a in self.counts.items()}
        pinned = st.placement.pinned
        # both engines count a pinned layer's accesses as hits per group: split them off
        hits = c["hits"]
        pinned_acc = np.zeros_like(hits)
        pinned_acc[:, pinned] = hits[:, pinned]
        hits[:, pinned] = 0
        priced = st.prices.available
        step_end = np.maximum.accumulate(self.step_end) if S else self.step_end
        latency = np.diff(np.r_[0.0, step_end])
        if self.stall is None or not priced:
            stall = np.broadcast_to(np.float64(np.nan), (S, L))  # no memory
            latency[:] = np.nan
        else:
            stall = self.stall.reshape(S, L)
        return ReplayResult(
            config=st.config, hits=hits, misses=c["misses"], pinned_accesses=pinned_acc,
            prefetch_loads=c["prefetch_loads"], prefetch_hits=c["prefetch_hits"],
            evictions=c["evictions"], redundant=c["redundant"], host_runs=c["host_runs"],
            cancelled=c["cancelled"],
            stall_s=stall, step_latency_s=latency, pinned=pinned, unused_at_end=int(unused),
            num_tokens=trace.num_tokens,
            expert_bytes=st.prices.cost.expert_bytes / st.part if priced else float("nan"),
            transfer_time_s=st.transfer_s if priced else float("nan"),
            elapsed_s=elapsed, extra=policy_stats)


#: (step, layer) cells above which a replay keeps its counts in the narrowest dtype (4 Mi
#: cells: 7 int64 counts would be 224 MiB)
NARROW_CELLS = 1 << 22


@dataclass
class _Settings:
    knobs: Any
    values: dict[str, Any]  # knobs.to_dict()
    prices: Prices
    placement: Placement
    engine: str  # "fast" or "python"
    config: dict[str, Any]
    part: int = 1  # MoE-Prism sub-expert offloading: the cache's keys are 1/part of an expert

    @property
    def transfer_s(self) -> float:
        """Modeled seconds to copy one cache key (an expert, or a sub-expert)."""
        return float(self.prices.part(self.part).transfer)


def _settings(trace: Trace, knobs: Any, knob_values: dict, scope: str, engine: str,
              expert_bytes: float | None) -> _Settings:
    """The checked knobs of a replay and what follows from them (prices, placement, engine)."""
    from workbench.knobs import Knobs, ModelShape

    if knobs is None:
        knobs = Knobs(**knob_values)
    elif knob_values:  # never changes the caller's object
        knobs = knobs.copy(**knob_values)
    cost, prof = cost_of(trace, knobs.profile, knobs.target_model, expert_bytes)
    # the expert size the replay prices with: cache_bytes then obeys the rule cache_slots
    # does (at least top-k experts), as in a live run
    eb = int(cost.expert_bytes) if cost is not None and cost.expert_bytes >= 1 else None
    knobs.check(ModelShape.of(trace, expert_bytes=eb), live=False)
    eviction, hybrid = knobs.eviction, bool(knobs.hybrid)
    prices = Prices(prof, cost)
    if hybrid and not prices.available:
        raise KnobError("hybrid=True decides each miss by comparing modeled prices, and this "
                        "trace carries no model sizes: set target_model")
    cache_slots = knobs.cache_slots
    if knobs.cache_bytes is not None:
        if cost is None:
            raise KnobError("cache_bytes needs the size of an expert, and this trace carries "
                            "no model sizes: set target_model, or set cache_slots instead")
        cache_slots = knobs.effective_slots(int(cost.expert_bytes))
    placement = Placement.single_device(trace.num_layers, trace.num_experts, trace.top_k,
                                        knobs.pinned_layers, cache_slots, scope)
    values = knobs.to_dict()
    try:
        EVICTION.create(eviction, **values)  # the policy checks its own knobs
    except ValueError as e:
        raise KnobError(str(e)) from None
    has_kernel = eviction in K.POLICY_CODES
    unit = knobs.offload_unit
    if unit != "expert" and trace.attrs.get("experts_compacted"):
        raise KnobError(f"offload_unit={unit!r} copies every expert of a layer, and this trace's "
                        f"expert ids were renumbered to those it uses; replay it with "
                        f"offload_unit='expert'")
    if unit != "expert" and scope != "global":
        raise KnobError(f"offload_unit={unit!r} holds whole layers in one pool: scope must be "
                        f"'global', not {scope!r}")
    if engine == "auto":
        engine = "fast" if has_kernel and not hybrid and unit == "expert" else "python"
    if engine not in ("fast", "python"):
        raise KnobError(f"engine must be one of auto, fast, python, not {engine!r}")
    if engine == "fast" and not has_kernel:
        raise KnobError(f"eviction {eviction!r} has no compiled replay; use engine='python'")
    if engine == "fast" and unit != "expert":
        raise KnobError(f"offload_unit={unit!r} has no compiled replay; use engine='python' "
                        f"(or 'auto')")
    if engine == "fast" and hybrid:
        raise KnobError("hybrid=True has no compiled replay; use engine='python' (or 'auto')")
    config = dict(eviction=eviction, cache_slots=cache_slots, pinned_layers=knobs.pinned_layers,
                  scope=scope, prefetch=knobs.prefetch, prefetch_lead=knobs.prefetch_lead,
                  prefetch_budget=knobs.prefetch_budget, transfer_order=knobs.transfer_order,
                  offload_unit=unit,
                  profile=prof.name,
                  cost_source=cost.source if cost is not None else "none",
                  engine=engine, hybrid=hybrid, **EVICTION.kwargs_for(eviction, values))
    return _Settings(knobs, values, prices, placement, engine, config)


def _subexpert_keys(trace: Trace, st: _Settings, scope: str) -> Trace:
    """MoE-Prism sub-expert offloading (``prism_offload``): ``trace`` with the sub-experts its
    run ran as the cache's keys (:meth:`Trace.as_subexperts`), and ``st`` set for it (in
    place) — the same memory in slots of 1/N of an expert (``cache_slots`` · N of them), each
    copy 1/N of an expert's transfer."""
    N = trace.subexperts
    if N == 1:
        raise KnobError("prism_offload=True caches sub-experts, and this trace has none: "
                        "replay a run recorded with prism=True")
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    if L * E * N > COMPACT_KEYS:
        raise KnobError(f"prism_offload=True keys every sub-expert: {L} layers × {E} experts "
                        f"× {N} is over {COMPACT_KEYS}")
    sub = trace.as_subexperts()
    slots = int(st.config["cache_slots"])  # expert-sized
    st.placement = Placement.single_device(L, E * N, K * N, st.knobs.pinned_layers,
                                           slots * N, scope)
    st.part = N
    st.config.update(prism_offload=True, subexperts=N, subexpert_slots=slots * N)
    return sub


def make_policy(name: str, knobs: dict, groups: Groups, trace: Trace | None):
    """One eviction policy for one pool, given what it asks for (the trace's future for
    Belady, its recorded predictor outputs for slab)."""
    policy = EVICTION.create(name, **knobs)
    if hasattr(policy, "prepare"):
        policy.prepare(groups)
    if trace is not None and hasattr(policy, "attach_trace"):
        policy.attach_trace(trace)
    return policy


def run_fast(groups, dense, comp, placement: Placement, code, knobs, pf_ptr, pf_key, xfer, S):
    """Whole ``groups`` through the compiled loop in one chunk (:func:`flat_hits` builds its
    own groups; a trace replay streams through :func:`_replay_fast`)."""
    L, E = groups.num_layers, groups.num_experts
    nk = L * E
    keys = groups.keys()
    if code == K.BELADY:
        occ_ptr, occ_grp = K.occurrences(groups.ptr, keys, nk)
    else:
        occ_ptr, occ_grp = np.zeros(nk + 1, np.int64), K.no_future()
    out = K.simulate(groups.layer.astype(np.int64), groups.step.astype(np.int64),
                     groups.ptr.astype(np.int64), keys, dense, comp, placement.pinned,
                     placement.pool_of_layer, placement.pool_slots, code,
                     float(knobs["hotness_decay"]), knobs["hotness_window"], occ_ptr, occ_grp,
                     pf_ptr, pf_key, float(xfer), nk, E, S, L)
    return (*out, np.zeros_like(out[0]))


def run_python(groups, dense, comp, placement: Placement, policy_factory, pf_ptr, pf_key,
                xfer, S, stats=None, host=None, transfer_order: str = "fifo",
                offload_unit: str = "expert"):
    """Every group through :meth:`workbench.sim.step.Simulator.step` — the same function the
    live offloader calls. ``stats``, when a dict, receives the summed ``policy.stats()`` of the
    pools. ``host`` (hybrid mode): per access, (runs on the host if missed, modeled host
    seconds). Returns per-group arrays in the numba kernel's layout (pinned accesses counted
    as hits there, as the kernel does), then per (step, layer of the key) the cancelled
    prefetches (``transfer_order``: :mod:`workbench.sim.lane`; ``offload_unit``:
    :mod:`workbench.sim.unit`)."""
    L, E = groups.num_layers, groups.num_experts
    G = groups.num_groups
    sim = Simulator(placement, policy_factory, transfer_s=xfer, transfer_order=transfer_order,
                    offload_unit=offload_unit)
    out_h, out_m, out_pl, out_ph, out_host = (np.zeros(G, np.int64) for _ in range(5))
    stall, g_end = np.zeros(G), np.zeros(G)
    ev_sl, red_sl, canc_sl = (np.zeros(S * L, np.int64) for _ in range(3))
    expert_list = groups.expert.tolist()
    comp_list = comp.tolist()
    pf_list = pf_key.tolist()
    for g in range(G):
        layer, step = int(groups.layer[g]), int(groups.step[g])
        a, b = int(groups.ptr[g]), int(groups.ptr[g + 1])
        pa, pb = int(pf_ptr[g]), int(pf_ptr[g + 1])
        o = sim.step(Access(
            step=step, layer=layer, experts=expert_list[a:b], compute_s=comp_list[a:b],
            dense_s=float(dense[g]), prefetch=[divmod(k, E) for k in pf_list[pa:pb]],
            on_host=None if host is None else host[0][a:b],
            host_s=None if host is None else host[1][a:b], group=g))
        out_h[g] = (b - a) if o.pinned else len(o.hits)
        out_m[g], out_host[g] = len(o.misses), len(o.host)
        out_pl[g], out_ph[g] = len(o.prefetched), o.prefetch_hits
        stall[g], g_end[g] = o.stall_s, o.end_s
        for key in o.evicted:
            ev_sl[step * L + key[0]] += 1
        for key in o.redundant:
            red_sl[step * L + key[0]] += 1
        for key in o.cancelled:
            canc_sl[step * L + key[0]] += 1
    if stats is not None:
        for c in sim.pools:
            for k, v in (c.policy.stats() if hasattr(c.policy, "stats") else {}).items():
                stats[k] = stats.get(k, 0) + v
    return (out_h, out_m, out_pl, out_ph, stall, g_end, ev_sl, red_sl, sim.unused_resident(),
            out_host, canc_sl)
