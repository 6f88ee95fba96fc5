"""Trace replay: every cache and prefetch policy on any routing trace, in milliseconds.

>>> res = workbench.replay_trace("runs/demo.zarr", eviction="lfu", cache_slots=32)   # doctest: +SKIP
>>> res.metrics()["hit_rate"], res.metrics()["share_of_belady"]                # doctest: +SKIP

Knob names and validation are those of :class:`workbench.Knobs` (``cache_slots``,
``pinned_layers``, ``eviction``, ``prefetch``, ``prefetch_lead``, ``prefetch_budget``,
``hotness_*``, ``profile``, ``target_model``, ``hybrid``, and the policies' own knobs); ``scope``
and ``engine`` are replay's own. Replay runs the simulation core (:mod:`workbench.sim`) that the
live runtime runs, over the trace instead of a model; the numba kernel is its fast path.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from workbench.policies.eviction import CEILING
from workbench.replay.engine import SCOPES, ReplayResult
from workbench.replay.engine import replay as _replay
from workbench.replay.flat import flat_hits
from workbench.sim.dispatch import DISPATCH, ROUTER_CHOICE


#: knob groups whose every knob a replay reads (the rest change what the model computes)
REPLAY_GROUPS = ("cache", "prefetch", "cost", "ep")


def replay_knob_names() -> set[str]:
    """Knobs a trace replay reads: the cache, prefetch and cost-model groups, every knob a
    registered eviction or prefetch policy declares (e.g. the predictor's ``window`` and
    ``decay`` for ``vismmoe``), and ``active_evict`` (False to replay a store recorded with
    it). The others — generation, execution, token compression, ActiveEvict's own knobs,
    dynamic top-k — change what the model computes, which a recorded trace cannot."""
    from workbench.knobs import Knobs
    from workbench.policies.eviction import EVICTION
    from workbench.policies.prefetch import PREFETCH

    k = Knobs()
    names = {n for g in REPLAY_GROUPS for n in k.group(g).knob_names()} | {"active_evict"}
    for reg in (EVICTION, PREFETCH):
        for policy in reg.available():
            accepted = reg.params(policy)
            if accepted is not None:
                names |= set(accepted) & set(k.names())
    return names


def as_trace(source: Any, **options: Any):
    """A :class:`~workbench.traces.trace.Trace` from a Trace, a run Dataset or a path."""
    import xarray as xr

    from workbench.traces import Trace, from_store, load_trace

    if isinstance(source, Trace):
        return source
    if isinstance(source, xr.Dataset):
        return from_store(source)
    return load_trace(Path(source), **options)


def replay_trace(source: Any, knobs: Any = None, *, scope: str = "global", engine: str = "auto",
           belady: bool = True, **knob_values: Any) -> ReplayResult:
    """Replay ``source`` (Trace, run Dataset or path) under ``knobs`` (a :class:`Knobs`, the
    stored run's knobs when ``source`` is a store and none are given, else defaults) changed by
    ``knob_values``. With ``belady=True`` the Belady ceiling is added to the metrics
    (``belady_hit_rate``, ``share_of_belady``).

    **The ceiling** (one definition, used by the CLI, ``ds.moe.io_metrics`` and the dashboard's
    replay curves): the same replay with ``eviction=belady``, every other setting unchanged,
    prefetch included. It is the best eviction for the run's own configuration, so the share
    compares eviction policies alike; a prefetcher's gain shows in both numerator and ceiling.
    (A demand-only Belady bound would be beaten by any good prefetcher, giving shares above 1.)
    With prefetch, Belady's optimality proof does not strictly hold, so a share can exceed 1
    by a hair in corner cases: it is a reference, not a theorem."""
    from workbench.knobs import Knobs

    trace = as_trace(source).compact_experts()
    if knobs is None:
        knobs = Knobs.from_attrs(trace.attrs) if trace.attrs.get("source") == "store" else Knobs()
    if knob_values:
        knobs = knobs.copy(**knob_values)
    dispatched = None
    knobs, recorded = _recorded_dispatch(trace, knobs)
    if DISPATCH.get(knobs.dispatch).changes_routing:  # capacity-aware: replay what it leaves
        from workbench.sim.dispatch import dispatch_trace
        from workbench.knobs import ModelShape

        knobs.check(ModelShape.of(trace), live=False)
        policy = DISPATCH.get(knobs.dispatch).for_knobs(knobs.group("ep"), knobs.seed)
        _check_scope_has_steps(trace, policy)
        classes_from = None
        # the calibrated expert classes (dynamic capacity; replay takes no rerouting)
        if policy.calibration_needed():
            if knobs.macs_calibration:
                from workbench.macs.calibration import load

                policy.classes = load(knobs.macs_calibration, trace.num_layers,
                                      trace.num_experts).classes
                classes_from = f"calibration {knobs.macs_calibration}"
            else:
                classes_from = "this trace (in-sample)"
        trace, dispatched = dispatch_trace(trace, policy)
    res = _replay(trace, knobs, scope=scope, engine=engine)
    if dispatched is not None:
        from workbench.telemetry.events import MODALITIES

        res.extra["dispatch"] = {"policy": knobs.dispatch,
                                 "capacity_factor": knobs.capacity_factor,
                                 "capacity_scope": knobs.capacity_scope,
                                 **dispatched.result(MODALITIES),
                                 **({"classes": classes_from} if classes_from else {})}
    elif recorded is not None:
        res.extra["dispatch"] = recorded
    if belady:
        if knobs.eviction == CEILING:
            bound = res
        else:
            bound = _replay(trace, knobs, scope=scope, hits_only=True, eviction=CEILING)
        res.extra["belady_hit_rate"] = bound.hit_rate
        res.extra["share_of_belady"] = (res.hit_rate / bound.hit_rate
                                        if bound.hit_rate > 0 else None)  # NaN > 0 is False
    if knobs.ep_ranks > 1:  # expert-parallel load (workbench.replay.ep): the same trace
        from workbench.replay.ep import ep_replay
        from workbench.replay.engine import cost_of
        from workbench.sim.costs import Prices

        cost, prof = cost_of(trace, knobs.profile, knobs.target_model, None)
        res.extra["ep"] = ep_replay(trace, knobs, Prices(prof, cost))
    return res


def _check_scope_has_steps(trace, policy) -> None:
    """A capacity-aware dispatch whose ``capacity_scope`` leaves it no step of ``trace`` would
    replay the router's routing and report 0 drops as if capacity had been applied: refused.
    That is ``prefill`` on a trace without a prefill step, e.g. one without recorded phases
    (an .npy without ``--prefill-tokens``, JSON lines by ``token_idx``, a ``Trace`` built
    without ``phase``), which reads as all decode."""
    import numpy as np

    from workbench.errors import KnobError
    from workbench.sim.dispatch import PREFILL

    phase = np.asarray(trace.phase)
    if trace.num_steps and not any(policy.acts_on(p) for p in np.unique(phase)):
        raise KnobError(
            f"capacity_scope={policy.capacity_scope!r} dispatches prefill steps (phase "
            f"{PREFILL}) only, and this trace has none (a trace without recorded phases reads "
            f"as all decode): dispatch={policy.name!r} would change nothing; replay with "
            f"capacity_scope=all, or give the trace its prefill (an .npy: --prefill-tokens N)")


_DISPATCH_KNOBS = ("dispatch", "capacity_factor", "capacity_scope", "min_capacity", "macs_delta",
                   "macs_rho", "macs_eta", "macs_semantic_load", "macs_dynamic_capacity",
                   "macs_reroute", "macs_selection", "macs_calibration")


def _recorded_dispatch_knobs(attrs) -> Mapping[str, Any] | None:
    """The recorded :data:`_DISPATCH_KNOBS` of a store's ``attrs`` (None: unreadable knobs; the
    replay's own checks say so). Every point of a replay study reads the same attrs, and
    building the knobs cost more than the replay itself: the answer is kept per distinct
    ``knob.*`` text (bounded)."""
    items = tuple(sorted((k, v) for k, v in attrs.items()
                         if isinstance(k, str) and k.startswith("knob.")))
    try:
        hash(items)
    except TypeError:  # a knob written as a JSON list or object, not text: not kept
        return _read_dispatch_knobs(attrs)
    return _dispatch_knobs_of(items)


def _read_dispatch_knobs(attrs) -> Mapping[str, Any] | None:
    from workbench.knobs import Knobs

    try:
        rec = Knobs.from_attrs(attrs)
    except Exception:  # unreadable knobs: the replay's own checks say so
        return None
    return MappingProxyType({n: getattr(rec, n) for n in _DISPATCH_KNOBS})


@functools.lru_cache(maxsize=64)
def _dispatch_knobs_of(items: tuple) -> Mapping[str, Any] | None:
    return _read_dispatch_knobs(dict(items))


def _show(value: Any) -> str:
    """A knob's value as ``--set`` spells it, cut short."""
    text = "none" if value is None else str(value).lower() if isinstance(value, bool) \
        else f"{value:g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _recorded_dispatch(trace, knobs):
    """A run store recorded with a dispatch holds its routing *after* it (-1 = dropped):
    replaying it with that dispatch again would apply the capacity twice (a token that lost
    every slot no longer counts, so it shrinks and drops more). Replayed with the recorded
    dispatch settings, the routing is used as it is (``dispatch`` becomes ``topk``); another
    dispatch on such a store is refused, since the routing it would need was not recorded.
    Returns ``(knobs to replay with, the replay's "dispatch" section or None)``."""
    from workbench.errors import KnobError

    if trace.attrs.get("source") != "store":
        return knobs, None
    rec = _recorded_dispatch_knobs(trace.attrs)
    if rec is None or not DISPATCH.get(rec["dispatch"]).changes_routing:
        return knobs, None
    same = all(rec[n] == getattr(knobs, n) for n in _DISPATCH_KNOBS)
    if not same and DISPATCH.get(knobs.dispatch).changes_routing:
        # name what differs: a changed capacity_scope alone read as "another dispatch"
        # beside the same dispatch and γ0
        changed = ", ".join(f"{n}={_show(getattr(knobs, n))} (recorded {_show(rec[n])})"
                            for n in _DISPATCH_KNOBS if rec[n] != getattr(knobs, n))
        raise KnobError(
            f"this run was recorded with dispatch={rec['dispatch']} (capacity_factor "
            f"{rec['capacity_factor']:g}, capacity_scope {rec['capacity_scope']}): its stored "
            f"routing is what that dispatch left, so it cannot be replayed with {changed}; "
            f"replay it with dispatch=topk (the routing as recorded), or record a run with "
            f"dispatch=topk and replay that")
    return knobs.copy(dispatch=ROUTER_CHOICE), {
        "policy": rec["dispatch"], "capacity_factor": rec["capacity_factor"], "recorded": True,
        "note": "applied live when the run was recorded: the stored routing is what it left "
                "(-1 = dropped), replayed as it is"}


__all__ = ["replay_trace", "as_trace", "ReplayResult", "flat_hits", "SCOPES"]
