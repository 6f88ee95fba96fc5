"""Trace replay: every cache and prefetch policy on any routing trace, in milliseconds.

>>> res = workbench.replay_trace("runs/demo.zarr", eviction="lfu", cache_slots=32)   # doctest: +SKIP
>>> res.metrics()["hit_rate"], res.metrics()["share_of_belady"]                # doctest: +SKIP

Knob names and validation are those of :class:`workbench.Knobs` (``cache_slots``,
``pinned_layers``, ``eviction``, ``prefetch``, ``prefetch_lead``, ``prefetch_budget``,
``hotness_*``, ``profile``, ``target_model``, ``hybrid``); ``scope`` and ``engine`` are replay's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.replay.engine import SCOPES, ReplayResult, flat_hits
from workbench.replay.engine import replay as _replay

_REPLAY_KNOBS = ("cache_slots", "pinned_layers", "eviction", "hotness_decay", "hotness_window",
                 "prefetch", "prefetch_lead", "prefetch_budget", "profile", "target_model",
                 "hybrid")


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
    ``knob_values``. With ``belady=True`` the Belady bound of the same settings is added to the
    metrics (``belady_hit_rate``, ``share_of_belady``)."""
    from workbench.knobs import Knobs

    trace = as_trace(source)
    if knobs is None:
        knobs = Knobs.from_attrs(trace.attrs) if trace.attrs.get("source") == "store" else Knobs()
    knobs = knobs.copy(**knob_values)
    if getattr(knobs, "active_evict", False):
        from workbench.errors import KnobError

        raise KnobError("active_evict runs live only (it acts on the router lookahead's "
                        "probabilities, which traces do not keep): pass active_evict=False to "
                        "replay this trace under the other policies")
    kw = {n: getattr(knobs, n) for n in _REPLAY_KNOBS}
    if kw["prefetch"] == "vismmoe" or kw["eviction"] == "slab":
        # the predictor policies' own knobs (W, γ), as live
        kw.update(window=knobs.window, decay=knobs.decay)
    if knobs.cache_bytes is not None:
        from workbench.replay.engine import _cost

        cost, _ = _cost(trace, knobs.profile, knobs.target_model, None)
        kw["cache_slots"] = knobs.effective_slots(int(cost.expert_bytes))
    res = _replay(trace, scope=scope, engine=engine, **kw)
    if belady:
        if kw["eviction"] == "belady" and kw["prefetch"] == "none":
            bound = res
        else:
            bound = _replay(trace, scope=scope, **{**kw, "eviction": "belady",
                                                         "prefetch": "none"})
        res.extra["belady_hit_rate"] = bound.hit_rate
        res.extra["share_of_belady"] = (res.hit_rate / bound.hit_rate
                                        if bound.hit_rate > 0 else None)  # NaN > 0 is False
    return res


__all__ = ["replay_trace", "as_trace", "ReplayResult", "flat_hits", "SCOPES"]
