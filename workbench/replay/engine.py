"""Trace replay: how a cache + prefetch configuration would have done on a routing trace.

``replay(trace, knobs)`` serves the trace's access groups (see :mod:`workbench.traces.trace`)
through an expert cache of ``cache_slots`` slots, the first ``pinned_layers`` layers resident,
prefetching ``prefetch_lead`` layers ahead, and prices it on the modeled timeline of
``profile``/``target_model`` exactly as the live runtime's modeled clock does. Two engines:

- ``fast`` (numba, :mod:`workbench.replay.kernel`) for the built-in eviction policies;
- ``python``: the real :class:`ExpertCache`, :class:`LayerFill` and policy objects, for any
  registered policy (tests hold both equal, and equal to the live run they replay).

``hybrid=True`` (GPU–CPU hybrid mode) runs every miss that
:func:`~workbench.runtime.clocks.runs_on_host` picks on the modeled host lane instead of loading
it, as the live runtime does (python engine only).

``scope="per-layer"`` gives every offloaded layer its own ``cache_slots // offloaded layers`` slots
instead of one shared pool. All times are *modeled* seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workbench.errors import InputError, KnobError
from workbench.policies.eviction import EVICTION
from workbench.policies.prefetch import PREFETCH, plan_prefetch
from workbench.replay import kernel as K
from workbench.runtime.clocks import CostSpec, host_expert_time, runs_on_host
from workbench.runtime.expert_cache import ExpertCache
from workbench.runtime.profiles import get_profile, get_target_model
from workbench.traces.trace import Groups, Trace

SCOPES = ("global", "per-layer")


@dataclass
class ReplayResult:
    """Outcome of one replay. Per-(step, layer) arrays are ``int64 [steps, layers]``; pinned
    layers count every access as a hit (as the live runtime does) but are left out of
    ``hit_rate`` and the other cache metrics."""

    config: dict[str, Any]
    hits: np.ndarray
    misses: np.ndarray
    prefetch_loads: np.ndarray
    prefetch_hits: np.ndarray
    evictions: np.ndarray
    redundant: np.ndarray
    host_runs: np.ndarray  # misses run on the host (hybrid mode), not loaded
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
        """Transfers: demand loads (one per miss not run on the host) plus prefetches."""
        return (self._off(self.misses) - int(self.host_runs.sum())
                + int(self.prefetch_loads.sum()))

    def metrics(self) -> dict[str, Any]:
        """Every figure of SPEC §2 and the bounds, as plain numbers (times modeled)."""
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
            "transfers": loads, "evictions": int(self.evictions.sum()),
            "transfer_bytes": int(loads * self.expert_bytes),
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

    def to_dataset(self):
        """The result as an xarray Dataset (dims step, layer; attrs = config + metrics)."""
        import xarray as xr

        data = {n: (("step", "layer"), getattr(self, n)) for n in (
            "hits", "misses", "prefetch_loads", "prefetch_hits", "evictions", "redundant",
            "host_runs", "stall_s")}
        data["step_latency_s"] = (("step",), self.step_latency_s)
        data["pinned"] = (("layer",), self.pinned)
        attrs = {f"config.{k}": str(v) for k, v in self.config.items()}
        attrs.update({k: v for k, v in self.metrics().items() if v is not None})
        return xr.Dataset(data, attrs=attrs)


def _cost(trace: Trace, profile: str, target_model: str, expert_bytes: float | None):
    """(CostSpec, HardwareProfile). Imported traces know no model sizes: they need a target
    model (or explicit expert bytes) to be priced; stores carry their run's cost spec."""
    prof = get_profile(profile)
    if target_model != "none":
        return CostSpec.from_target(get_target_model(target_model)), prof
    spec = trace.attrs.get("cost_spec")
    if spec is not None:
        return _recorded_cost(trace, spec), prof
    if expert_bytes is None:
        raise KnobError(
            f"target_model must name a real model to price this trace "
            f"({trace.attrs.get('source', 'imported')}): it carries no model sizes; one of "
            f"{', '.join(_targets())}, not 'none'")
    return CostSpec("given", float(expert_bytes), 0.0, 0.0, 0.0), prof


def _recorded_cost(trace: Trace, spec) -> CostSpec:
    """The cost spec a store (or a ``.wbtrace`` ``@attr``) recorded, checked: its fields are
    the :class:`CostSpec` fields, sizes and times finite and ≥ 0."""
    import dataclasses
    import json
    import math

    where = f"{trace.attrs.get('source', 'trace')} {trace.attrs.get('path', '')!s}".strip()
    fields = {f.name: f for f in dataclasses.fields(CostSpec)}
    required = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
    try:
        if isinstance(spec, str):
            spec = json.loads(spec)
        if not isinstance(spec, dict) or not required <= set(spec) <= set(fields):
            raise ValueError(f"expected an object with {', '.join(fields)}")
        if not isinstance(spec["source"], str):
            raise ValueError("source must be text")
        for k, v in spec.items():
            if k != "source" and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v < 0):
                raise ValueError(f"{k} is {v!r}, expected a finite number ≥ 0")
        return CostSpec(**spec)
    except (ValueError, TypeError, RecursionError) as e:
        raise InputError(f"{where}: attribute 'cost_spec' is unusable ({str(e)[:160]}); "
                         f"replay with --set target_model=NAME to price it instead") from None


def _targets() -> list[str]:
    from workbench.runtime.profiles import available_target_models

    return available_target_models()


def replay(trace: Trace, *, eviction: str = "lru", cache_slots: int = 64,
           pinned_layers: int = 0, scope: str = "global", prefetch: str = "none",
           prefetch_lead: int = 1, prefetch_budget: int | None = None,
           profile: str = "a100-40gb", target_model: str = "none",
           expert_bytes: float | None = None, engine: str = "auto", hybrid: bool = False,
           **policy_knobs: Any) -> ReplayResult:
    """Replay ``trace``; see the module docstring. ``policy_knobs`` reach the policy classes
    (e.g. ``hotness_decay``). Raises :class:`KnobError` for bad settings."""
    L, E = trace.num_layers, trace.num_experts
    if scope not in SCOPES:
        raise KnobError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    if not 0 <= pinned_layers <= L:
        raise KnobError(f"pinned_layers must be between 0 and {L} (the trace's layers), "
                        f"not {pinned_layers}")
    if prefetch_lead < 1:
        raise KnobError(f"prefetch_lead must be at least 1 layer, not {prefetch_lead}")
    pinned = np.arange(L) < pinned_layers
    n_off = int((~pinned).sum())
    if n_off and cache_slots < trace.top_k:
        raise KnobError(f"cache_slots must be at least {trace.top_k} (top-k), not {cache_slots}")
    pol_cls = EVICTION.get(eviction)
    try:
        pol_cls(**policy_knobs)  # the policy checks its own knobs (e.g. hotness γ and T)
    except ValueError as e:
        raise KnobError(str(e)) from None
    if eviction == "hotness" and int(policy_knobs.get("hotness_window", 16)) > K.RING:
        raise KnobError(f"hotness_window must be at most {K.RING} steps, not "
                        f"{policy_knobs['hotness_window']}")
    if prefetch_budget is not None and prefetch_budget < 1:
        raise KnobError(f"prefetch_budget must be at least 1 or None, not {prefetch_budget}")
    pf_policy = PREFETCH.create(prefetch, **policy_knobs)
    cost, prof = _cost(trace, profile, target_model, expert_bytes)
    groups = trace.groups()
    if scope == "global":
        pool_of_layer = np.zeros(L, np.int64)
        pool_cap = np.array([min(cache_slots, max(n_off * E, 1))], np.int64)
    else:
        share = cache_slots // max(n_off, 1)
        if n_off and share < trace.top_k:
            raise KnobError(
                f"cache_slots must give every offloaded layer at least top-k = {trace.top_k} "
                f"slots with scope=per-layer ({n_off} layers → ≥ {n_off * trace.top_k}), "
                f"not {cache_slots}")
        pool_of_layer = np.arange(L, dtype=np.int64)
        pool_cap = np.full(L, min(share, E), np.int64)
    # modeled prices, exactly as ModeledClock computes them (one call per distinct size)
    def priced(counts: np.ndarray, flops: float, nbytes: float) -> np.ndarray:
        vals, inv = np.unique(counts, return_inverse=True)
        return np.array([prof.compute_time(int(v) * flops, nbytes) for v in vals],
                        np.float64)[inv.reshape(-1)]

    # dense work over the tokens that reach each group's layer (pruned tokens skip the layers
    # behind the pinned prefix), as ModeledClock prices it
    layer_tokens = (groups.layer_tokens if groups.layer_tokens is not None
                    else groups.step_tokens[groups.step])
    dense = priced(layer_tokens, cost.dense_flops_per_token_per_layer,
                   cost.dense_bytes_per_layer)
    comp = priced(groups.expert_tokens, cost.expert_flops_per_token, cost.expert_bytes)
    xfer = prof.transfer_time(cost.expert_bytes)
    pf_ptr, pf_key = plan_prefetch(pf_policy, trace, groups, pinned, prefetch_lead,
                                   prefetch_budget)
    kernel_code = K.POLICY_CODES.get(eviction)
    if engine == "auto":
        engine = "fast" if eviction in K.POLICY_CODES and not hybrid else "python"
    if engine not in ("fast", "python"):
        raise KnobError(f"engine must be one of auto, fast, python, not {engine!r}")
    if engine == "fast" and kernel_code is None:
        raise KnobError(f"eviction {eviction!r} has no compiled replay; use engine='python'")
    if engine == "fast" and hybrid:
        raise KnobError("hybrid=True has no compiled replay; use engine='python' (or 'auto')")
    host = None
    if hybrid:  # per access: (runs on the host?, modeled host seconds), as the live rule decides
        vals, inv = np.unique(groups.expert_tokens, return_inverse=True)
        on = np.array([runs_on_host(prof, cost, int(v)) for v in vals], bool)
        dur = np.array([host_expert_time(prof, cost, int(v)) for v in vals], np.float64)
        host = (on[inv.reshape(-1)], dur[inv.reshape(-1)])
    config = dict(eviction=eviction, cache_slots=cache_slots, pinned_layers=pinned_layers,
                  scope=scope, prefetch=prefetch, prefetch_lead=prefetch_lead,
                  prefetch_budget=prefetch_budget, profile=prof.name, cost_source=cost.source,
                  engine=engine, hybrid=bool(hybrid), **policy_knobs)
    policy_stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    if engine == "fast":
        out = _run_fast(groups, dense, comp, pinned, pool_of_layer, pool_cap, kernel_code,
                        policy_knobs, pf_ptr, pf_key, xfer, trace.num_steps)
    else:
        out = _run_python(groups, dense, comp, pinned, pool_of_layer, pool_cap,
                          pol_cls, policy_knobs, pf_ptr, pf_key, xfer, trace.num_steps,
                          trace=trace, stats=policy_stats, host=host)
    elapsed = time.perf_counter() - t0
    hits, misses, pf_loads, pf_hits, stall, g_end, ev_sl, red_sl, unused = out[:9]
    host_runs = out[9] if len(out) > 9 else np.zeros_like(hits)
    S = trace.num_steps

    flat_sl = groups.step.astype(np.int64) * L + groups.layer  # (step, layer) of each group

    def per_sl(v: np.ndarray) -> np.ndarray:
        # each (step, layer) has at most one group: a scatter, no accumulation needed
        m = np.zeros(S * L, v.dtype)
        m[flat_sl] = v
        return m.reshape(S, L)

    # step latency: end of the step's last group minus the end of the previous step
    step_end = np.zeros(S)
    if groups.num_groups:
        last = np.r_[np.flatnonzero(np.diff(groups.step)), groups.num_groups - 1]
        step_end[groups.step[last]] = g_end[last]
        step_end = np.maximum.accumulate(step_end)
    latency = np.diff(np.r_[0.0, step_end])
    return ReplayResult(
        config=config, hits=per_sl(hits), misses=per_sl(misses),
        prefetch_loads=per_sl(pf_loads), prefetch_hits=per_sl(pf_hits),
        evictions=ev_sl.reshape(S, L), redundant=red_sl.reshape(S, L),
        host_runs=per_sl(host_runs), stall_s=per_sl(stall),
        step_latency_s=latency, pinned=pinned, unused_at_end=int(unused),
        num_tokens=trace.num_tokens, expert_bytes=cost.expert_bytes, transfer_time_s=xfer,
        elapsed_s=elapsed, extra=policy_stats)


def _occurrences(groups: Groups, num_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of the groups each key occurs in, ascending (Belady's future)."""
    keys = groups.keys()
    g_of = np.repeat(np.arange(groups.num_groups, dtype=np.int64), np.diff(groups.ptr))
    order = np.argsort(keys, kind="stable")
    ptr = np.zeros(num_keys + 1, np.int64)
    np.add.at(ptr, keys + 1, 1)
    return np.cumsum(ptr), g_of[order]


def _run_fast(groups, dense, comp, pinned, pool_of_layer, pool_cap, code, knobs, pf_ptr, pf_key,
              xfer, S):
    L, E = groups.num_layers, groups.num_experts
    nk = L * E
    if code == K.BELADY:
        occ_ptr, occ_grp = _occurrences(groups, nk)
    else:
        occ_ptr, occ_grp = np.zeros(nk + 1, np.int64), np.zeros(1, np.int64)
    window = min(int(knobs.get("hotness_window", 16)), K.RING)  # checked in replay()
    return K.simulate(groups.layer.astype(np.int64), groups.step.astype(np.int64),
                      groups.ptr.astype(np.int64), groups.keys(), dense, comp, pinned,
                      pool_of_layer, pool_cap, code, float(knobs.get("hotness_decay", 0.8)),
                      window, occ_ptr, occ_grp, pf_ptr, pf_key, float(xfer), nk, E, S, L)


def _run_python(groups, dense, comp, pinned, pool_of_layer, pool_cap, pol_cls, knobs, pf_ptr,
                pf_key, xfer, S, trace=None, stats=None, host=None):
    """The same sequence of calls as the live offloader, on the real cache and policy objects
    (one cache per pool). A policy with ``attach_trace`` gets ``trace`` (e.g. the slab policy
    reads its recorded predictor outputs); ``stats``, when a dict, receives the summed
    ``policy.stats()`` of the pools. ``host`` (hybrid mode): per access, (runs on the host if
    missed, modeled host seconds)."""
    L, E = groups.num_layers, groups.num_experts
    G = groups.num_groups
    pools = [ExpertCache(int(c), pol_cls(**knobs), L, E) for c in pool_cap]
    for c in pools:
        if hasattr(c.policy, "prepare"):
            c.policy.prepare(groups)
        if trace is not None and hasattr(c.policy, "attach_trace"):
            c.policy.attach_trace(trace)
    out_h, out_m, out_pl, out_ph, out_host = (np.zeros(G, np.int64) for _ in range(5))
    stall, g_end = np.zeros(G), np.zeros(G)
    ev_sl, red_sl = np.zeros(S * L, np.int64), np.zeros(S * L, np.int64)
    used: dict[tuple[int, int], bool] = {}
    pref: set[tuple[int, int]] = set()
    ready: dict[tuple[int, int], float] = {}
    now = xfer_free = host_free = 0.0
    clock = 0  # the pools share one access clock, like the kernel

    def evicted(key, step: int) -> None:
        ev_sl[step * L + key[0]] += 1
        if not used.get(key, True):
            red_sl[step * L + key[0]] += 1
        pref.discard(key)

    def prefetch(g: int, step: int, now: float, protected=frozenset()) -> None:
        nonlocal clock, xfer_free
        for k in pf_key[pf_ptr[g]:pf_ptr[g + 1]].tolist():
            key = (k // E, k % E)
            c = pools[int(pool_of_layer[key[0]])]
            if key in c:
                continue
            c.t = clock
            got = c.admit(key, protected)
            clock = c.t
            if got is None:
                continue
            if got[1] is not None:
                evicted(got[1], step)
            used[key] = False
            pref.add(key)
            xfer_free = max(xfer_free, now) + xfer
            ready[key] = xfer_free
            out_pl[g] += 1

    for g in range(G):
        layer, step = int(groups.layer[g]), int(groups.step[g])
        a, b = int(groups.ptr[g]), int(groups.ptr[g + 1])
        experts = groups.expert[a:b].tolist()
        now += dense[g]
        for c in pools:
            c.policy.begin_group(g, step)
        if pinned[layer]:
            out_h[g] = len(experts)
            prefetch(g, step, now)
            now += float(comp[a:b].sum())
            g_end[g] = now
            continue
        cache = pools[int(pool_of_layer[layer])]
        cache.t = clock
        hits, misses = cache.lookup(layer, experts)
        out_h[g], out_m[g] = len(hits), len(misses)
        host_done = now
        on_host: set[int] = set()
        if host is not None:  # hybrid: these misses run on the host lane, nothing is loaded
            pos = {e: a + i for i, e in enumerate(experts)}
            for e in misses:
                if host[0][pos[e]]:
                    on_host.add(e)
                    host_free = host_done = max(host_free, now) + host[1][pos[e]]
            out_host[g] = len(on_host)
            misses = [e for e in misses if e not in on_host]
        for e in hits:
            key = (layer, e)
            if key in pref:
                out_ph[g] += 1
                pref.discard(key)
            used[key] = True
        for e in misses:
            xfer_free = max(xfer_free, now) + xfer
            ready[(layer, e)] = xfer_free

        fill = cache.fill(layer, experts, misses)
        admitted = []
        pf_done = False

        def issue() -> None:
            nonlocal pf_done, clock
            for e, _slot, victim in fill.issue():
                if victim is not None:
                    evicted(victim, step)
                used[(layer, e)] = True
                pref.discard((layer, e))
                admitted.append(e)
            if not pf_done and not fill.pending:  # as the live offloader does
                pf_done = True
                clock = cache.t
                prefetch(g, step, now, fill.protected)
                cache.t = clock

        issue()
        fill.done(hits)
        issue()
        i = 0
        while i < len(admitted):
            fill.done((admitted[i],))
            i += 1
            issue()
        clock = cache.t
        miss_set = set(misses)
        for e, cost in zip(experts, comp[a:b]):
            if e not in miss_set and e not in on_host:
                r = ready.get((layer, e), 0.0)
                if r > now:
                    stall[g] += r - now
                    now = r
                now += cost
        for e, cost in zip(experts, comp[a:b]):
            if e in miss_set:
                r = ready[(layer, e)]
                if r > now:
                    stall[g] += r - now
                    now = r
                now += cost
        if host_done > now:  # the layer waits for the host's outputs
            stall[g] += host_done - now
            now = host_done
        g_end[g] = now
    unused = sum(1 for c in pools for key in c.slot_of if not used.get(key, True))
    if stats is not None:
        for c in pools:
            for k, v in (c.policy.stats() if hasattr(c.policy, "stats") else {}).items():
                stats[k] = stats.get(k, 0) + v
    return out_h, out_m, out_pl, out_ph, stall, g_end, ev_sl, red_sl, unused, out_host


def flat_hits(keys: np.ndarray, cache_slots: int, eviction: str = "lru",
              engine: str = "fast") -> int:
    """Hits of a classic one-key-at-a-time cache over ``keys`` (any ints) — the flattened
    trace libCacheSim and textbooks use. Each access is its own group; nothing is pinned."""
    keys = np.asarray(keys, np.int64)
    uniq, dense_keys = np.unique(keys, return_inverse=True)
    n = len(keys)
    if cache_slots < 1:
        raise KnobError(f"cache_slots must be at least 1, not {cache_slots}")
    cache_slots = min(cache_slots, max(len(uniq), 1))  # more slots than keys change nothing
    pol_cls = EVICTION.get(eviction)
    groups = Groups(step=np.arange(n, dtype=np.int32), layer=np.zeros(n, np.int32),
                    ptr=np.arange(n + 1, dtype=np.int64), expert=dense_keys.astype(np.int32),
                    expert_tokens=np.ones(n, np.int32), step_tokens=np.ones(n, np.int64),
                    num_layers=1, num_experts=max(len(uniq), 1))
    z = np.zeros(n)
    pinned = np.zeros(1, bool)
    cap = np.array([cache_slots], np.int64)
    pools = np.zeros(1, np.int64)
    empty = (np.zeros(n + 1, np.int64), np.zeros(0, np.int64))
    if engine == "fast":
        if eviction not in K.POLICY_CODES:
            raise KnobError(f"eviction {eviction!r} has no compiled replay; use engine='python'")
        out = _run_fast(groups, z, z, pinned, pools, cap, K.POLICY_CODES[eviction], {}, *empty,
                        0.0, n)
    else:
        out = _run_python(groups, z, z, pinned, pools, cap, pol_cls, {}, *empty, 0.0, n)
    return int(out[0].sum())
