"""What-if replay of a routing trace: policy × cache-size curves, for the dashboard and notebooks.

Pure computation and figures (no Panel): :func:`replay_curves` replays a
:class:`~workbench.traces.Trace` for every eviction policy asked for, at every cache size, and
returns one row per (policy, size) with the replay's metrics; :func:`curves_figure` draws hit
rate against cache size with Belady (the offline optimum: it evicts the expert needed furthest
in the future) as the ceiling line; :func:`prefetch_comparison` compares the prefetch policies at
one cache size; :func:`study` bundles curves and a metrics table at one size for the dashboard's
replay view.

**One replay entry point**: every replay here is :func:`workbench.replay.replay_trace`, the one
the CLI (``workbench replay``), ``ds.moe.replay()`` and the notebooks use. Its knobs come from
``knobs`` (a :class:`~workbench.knobs.Knobs`; default: the recorded run's own,
``Knobs.from_attrs`` of a store's trace, else the defaults), changed by the explicit arguments;
along a curve only ``eviction`` and ``cache_slots`` change (``cache_bytes`` is cleared so that
the slot count holds, ``active_evict`` is off: it acts on live router probabilities no trace
keeps), and the pinned prefix is the recorded run's. So the curves' point at the run's own
policy and size is exactly ``replay_trace(store)``.

Policy names always come from the registries (``EVICTION.available()``,
``PREFETCH.available()``), so a policy registered later appears here with no change. A policy
the trace cannot serve (``speculative``/``apex`` without recorded router lookahead) raises
:class:`~workbench.errors.KnobError` from :func:`replay_curves`; :func:`prefetch_comparison`
keeps its message in the ``error`` column instead.

Units: ``cache_slots`` in experts (one routed expert per slot); hit rates and shares are
fractions of the offloaded layers' accesses; every time and byte count is *modeled* (the
hardware profile's timeline), never measured.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Generator, Iterable, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from workbench.errors import InputError, KnobError, WorkbenchError
from workbench.policies.eviction import EVICTION
from workbench.policies.prefetch import PREFETCH
from workbench.replay import SCOPES, replay_trace
from workbench.sim.unit import slots_needed

__all__ = ["CEILING", "AS_RECORDED", "SCOPES", "METRICS", "REPLAY_GROUPS", "CURVE_KNOBS",
           "replay_knob_names", "pinned_prefix", "slot_bounds", "cache_sizes", "recorded_knobs",
           "replay_curves", "belady_share", "curves_figure", "prefetch_comparison",
           "ReplayStudy", "study", "study_steps", "curves_steps", "advance", "Progress"]

#: the eviction policy drawn as the ceiling (Belady's offline optimum)
CEILING = "belady"
#: ``target_model`` argument meaning "as the knobs say" (for a store: priced as its run was),
#: the same as None
AS_RECORDED = "as recorded"
#: knob groups (``Knobs.groups`` keys) whose knobs change what a trace replay does: the cache
#: and its policies' knobs, prefetch, and the modeled clock's pricing
REPLAY_GROUPS = ("cache", "prefetch", "cost")
#: knobs of those groups a study sets itself: the two axes of the curves, and the pinned prefix
#: (the recorded run's: the useful cache sizes depend on it); and the memory-plan knobs, which
#: only size a live cache (a study sizes it in slots)
CURVE_KNOBS = ("cache_slots", "eviction", "pinned_layers", "cache_bytes", "semantic_layers",
               "cache_reserve_slots")
#: (metric key, label, units) of the replay metrics table, in display order; ``belady_share``
#: is the policy's hit rate over Belady's at the same size
METRICS: tuple[tuple[str, str, str], ...] = (
    ("hit_rate", "hit rate", "fraction"),
    ("belady_share", "share of Belady", "fraction"),
    ("blocking_io_s", "blocking I/O, modeled", "s"),
    ("total_io_s", "total I/O, modeled", "s"),
    ("transfer_bytes_per_token", "moved per token, modeled", "bytes"),
    ("redundant_share", "redundant transfers", "fraction"),
    ("fetch_precision", "fetch precision", "fraction"),
    ("prefetch_recall", "prefetch recall", "fraction"),
)
_KEEP = ("hit_rate", "hits", "misses", "accesses", "transfers", "prefetch_loads",
         "prefetch_hits", "evictions", "blocking_io_s", "total_io_s", "latency_s",
         "transfer_bytes", "transfer_bytes_per_token", "redundant_share", "fetch_precision",
         "prefetch_recall")
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
            "#bcbd22", "#7f7f7f")
#: most replays a memo keeps (each a small dict of numbers) before it starts over
MEMO_MAX = 20_000
#: marker symbols per policy, so that policies with equal hit rates stay visible
_SYMBOLS = ("circle", "square-open", "diamond-open", "triangle-up-open", "x-thin-open",
            "star-open", "hexagon-open", "cross-open", "circle-open")
CEILING_COLOR = "#111827"


#: what a study's steps yield: (points made, points in all)
Progress = tuple[int, int]


def advance(steps: Generator[Progress, None, Any], deadline: float | None = None) -> Any:
    """Run ``steps`` (:func:`curves_steps`, :func:`study_steps`) to its end and return its
    value; with ``deadline`` (``time.monotonic()``) stop at the first step that ends after it
    (at least one step is made) and return that step's :data:`Progress` instead — the same
    generator, advanced again, goes on. The dashboard replays a run in such slices, one per
    event-loop tick, so that clicks are read between them."""
    while True:
        try:
            got = next(steps)
        except StopIteration as end:
            return end.value
        if deadline is not None and time.monotonic() > deadline:
            return got


def replay_knob_names() -> list[str]:
    """The knobs a user sets for a replay (the dashboard's replay widgets), in their groups'
    order: those of :data:`REPLAY_GROUPS` that are not :data:`CURVE_KNOBS` (a group registered
    later under one of these keys brings its knobs along)."""
    from workbench.knobs import Knobs

    groups = Knobs().groups
    return [n for key in REPLAY_GROUPS if key in groups
            for n in groups[key].knob_names() if n not in CURVE_KNOBS]


def recorded_knobs(trace):
    """The knobs ``replay_trace`` replays ``trace`` with when given none: a store's own
    (``Knobs.from_attrs`` via :class:`~workbench.telemetry.metadata.RunMetadata`; a malformed
    ``knob.*`` attribute raises :class:`~workbench.errors.StoreError` naming it), else the
    defaults."""
    from workbench.knobs import Knobs
    from workbench.telemetry.metadata import RunMetadata

    if trace.attrs.get("source") != "store":
        return Knobs()
    return RunMetadata.from_attrs(trace.attrs, strict=False).knobs


def pinned_prefix(trace) -> int:
    """Number of leading layers the recording run kept resident (replay pins a prefix)."""
    pinned = np.asarray(trace.pinned, bool)
    return int(np.argmin(pinned)) if not pinned.all() else len(pinned)


def slot_bounds(trace, scope: str = "global", pinned_layers: int | None = None
                ) -> tuple[int, int]:
    """Smallest and largest useful ``cache_slots`` for ``trace``: at least top-k (``global``)
    or top-k per offloaded layer (``per-layer``); at most every offloaded expert (beyond it
    nothing is ever evicted). :class:`InputError` if every layer is pinned."""
    if scope not in SCOPES:
        raise KnobError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    pin = pinned_prefix(trace) if pinned_layers is None else int(pinned_layers)
    n_off = trace.num_layers - pin
    if n_off <= 0:
        raise InputError("every layer of this run is pinned (resident): there is no expert "
                         "cache to replay")
    lo = trace.top_k if scope == "global" else n_off * trace.top_k
    return lo, max(lo, n_off * trace.num_experts)


def cache_sizes(lo: int, hi: int, n: int = 12, spacing: str = "linear") -> list[int]:
    """At most ``n`` distinct integer sizes over ``[lo, hi]``, both included, spread evenly
    (``spacing="linear"``) or by a constant factor (``"log"``: denser at small caches, where
    the curves bend)."""
    lo, hi = int(lo), int(hi)
    if hi < lo:
        lo, hi = hi, lo
    if spacing not in ("linear", "log"):
        raise KnobError(f"spacing must be 'linear' or 'log', not {spacing!r}")
    xs = np.geomspace(max(lo, 1), hi, max(2, n)) if spacing == "log" and hi > 0 else \
        np.linspace(lo, hi, max(2, n))
    return sorted({lo, hi} | {int(round(x)) for x in xs})


def _effective(trace, knobs, prefetch, prefetch_lead, target_model, profile):
    """The knobs of a study: ``knobs`` (default :func:`recorded_knobs`) changed by the explicit
    arguments that are not None."""
    base = recorded_knobs(trace) if knobs is None else knobs
    target_model = None if target_model == AS_RECORDED else target_model
    changes = {k: v for k, v in (("prefetch", prefetch), ("prefetch_lead", prefetch_lead),
                                 ("target_model", target_model), ("profile", profile))
               if v is not None}
    return base.copy(**changes) if changes else base.copy()


def _knobs_key(knobs) -> str:
    """The part of a memo key that the knobs make (computed once per curve set: a point
    read from the memo must cost next to nothing, a sliced study walks them again)."""
    return json.dumps(knobs.to_dict(), sort_keys=True, default=str)


def _replay_one(trace, eviction: str, slots: int, *, knobs, scope: str, pinned_layers: int,
                memo: dict | None, knobs_key: str | None = None) -> dict[str, Any]:
    """Metrics of ``replay_trace`` at one point of a curve (memoised in ``memo``; ``knobs_key``:
    :func:`_knobs_key` of ``knobs`` when the caller has it)."""
    key = (eviction, int(slots), scope, int(pinned_layers),
           _knobs_key(knobs) if knobs_key is None else knobs_key)
    if memo is not None:
        if memo.get("trace") is not trace or len(memo) > MEMO_MAX:  # one trace, bounded
            memo.clear()
            memo["trace"] = trace
        if key in memo:
            return memo[key]
    m = replay_trace(trace, knobs, scope=scope, belady=False, eviction=eviction,
                     cache_slots=int(slots), cache_bytes=None, pinned_layers=int(pinned_layers),
                     active_evict=False, ep_ranks=1).metrics()  # (the curves need no EP load)
    row = {k: m[k] for k in _KEEP if k in m}
    if memo is not None:
        memo[key] = row
    return row


def _settings(knobs, scope: str, pin: int) -> dict[str, Any]:
    return dict(prefetch=knobs.prefetch, prefetch_lead=knobs.prefetch_lead, scope=scope,
                pinned_layers=pin, target_model=knobs.target_model, profile=knobs.profile,
                knobs={n: getattr(knobs, n) for n in replay_knob_names()})


def replay_curves(trace, evictions: Iterable[str] | None = None,
                  sizes: Sequence[int] | None = None, **kw: Any) -> pd.DataFrame:
    """:func:`curves_steps` run to its end (the arguments and the result are its)."""
    return advance(curves_steps(trace, evictions, sizes, **kw))


def curves_steps(trace, evictions: Iterable[str] | None = None,
                 sizes: Sequence[int] | None = None, *, knobs=None,
                 prefetch: str | None = None, prefetch_lead: int | None = None,
                 scope: str = "global", pinned_layers: int | None = None,
                 target_model: str | None = None, profile: str | None = None,
                 memo: dict | None = None) -> Generator[Progress, None, pd.DataFrame]:
    """Hit rate (and the other replay metrics) of each eviction policy at each cache size.

    ``evictions``: registered names (default: every one); :data:`CEILING` is always added.
    ``sizes``: cache slots (default: :func:`cache_sizes` over :func:`slot_bounds`); sizes
    below the scope's minimum are left out. ``knobs``: the other knobs of every replay
    (default :func:`recorded_knobs`: a store's own); ``prefetch``, ``prefetch_lead``,
    ``target_model`` (a registered target model to price the trace as; ``"none"``: the run's
    own cost spec, which imported traces lack; None or :data:`AS_RECORDED`: the knobs') and
    ``profile`` change them when given.
    ``pinned_layers``: default the run's pinned prefix. ``memo``: a dict reused across calls
    to skip replays already made (it serves one trace: given another, it is cleared).
    A generator: it yields :data:`Progress` after each point and returns the curves
    (:func:`advance` runs it, in slices if asked; :func:`replay_curves` at once).

    Returns a long DataFrame: ``eviction``, ``cache_slots``, the metrics of
    :meth:`ReplayResult.metrics` (times *modeled*) and ``belady_share`` = hit rate / Belady's
    hit rate at the same size (NaN where Belady's is 0); its ``attrs`` say which settings
    were replayed. Raises :class:`KnobError` when the trace cannot serve the prefetch policy
    or a setting is out of range.
    """
    avail = EVICTION.available()
    names = list(avail if evictions is None else evictions)
    for n in names:
        EVICTION.get(n)  # unknown names list the available ones
    k = _effective(trace, knobs, prefetch, prefetch_lead, target_model, profile)
    if CEILING in avail and CEILING not in names:
        names.append(CEILING)
    pin = pinned_prefix(trace) if pinned_layers is None else int(pinned_layers)
    lo, hi = slot_bounds(trace, scope, pin)
    sizes = cache_sizes(lo, hi) if sizes is None else sorted({int(s) for s in sizes if s >= lo})
    # a layer-wise offload unit holds whole layers: smaller caches are refused, not drawn
    unit_lo = slots_needed(k.offload_unit, trace.num_experts, trace.num_layers - pin)
    sizes = [s for s in sizes if s >= unit_lo]
    if not sizes:
        why = (f"offload_unit={k.offload_unit} holds whole layers: at least {unit_lo} slots"
               if unit_lo > lo else
               f"at least {lo} slots with scope={scope} "
               f"(top-k {'per offloaded layer' if scope != 'global' else ''})")
        raise KnobError(f"cache sizes must reach {why}; allowed: {max(lo, unit_lo)} … {hi}")
    rows, total, kk = [], len(names) * len(sizes), _knobs_key(k)
    for ev in names:
        for s in sizes:
            row = _replay_one(trace, ev, s, knobs=k, scope=scope, pinned_layers=pin, memo=memo,
                              knobs_key=kk)
            rows.append({"eviction": ev, "cache_slots": int(s), **row})
            yield len(rows), total
    df = pd.DataFrame(rows)
    if CEILING in names:
        ceil = df[df.eviction == CEILING].set_index("cache_slots")["hit_rate"]
        c = df["cache_slots"].map(ceil).to_numpy(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            df["belady_share"] = np.where(c > 0, df["hit_rate"].to_numpy(float) / c, np.nan)
    else:
        df["belady_share"] = np.nan
    df.attrs.update(**_settings(k, scope, pin), slot_bounds=(lo, hi))
    return df


def belady_share(df: pd.DataFrame) -> pd.DataFrame:
    """``cache_slots`` × policy table of each policy's hit rate as a share of Belady's."""
    return df.pivot(index="cache_slots", columns="eviction", values="belady_share")


def curves_figure(df: pd.DataFrame, title: str = "hit rate vs cache size",
                  own: tuple[int, float, str] | None = None, log_x: bool = False) -> go.Figure:
    """Hit rate against cache slots, one line per policy of ``df`` (from
    :func:`replay_curves`), Belady as a thick dashed ceiling line on top. ``own`` =
    ``(slots, hit_rate, label)`` marks what the recorded run itself got; ``log_x`` draws the
    cache size on a log axis (for sizes from ``cache_sizes(..., spacing="log")``)."""
    fig = go.Figure()
    names = list(dict.fromkeys(df["eviction"]))
    others = [n for n in names if n != CEILING]
    for i, ev in enumerate(others):
        d = df[df.eviction == ev]
        fig.add_trace(go.Scatter(
            x=d["cache_slots"], y=d["hit_rate"], mode="lines+markers", name=ev,
            line={"color": _PALETTE[i % len(_PALETTE)], "width": 2},
            marker={"symbol": _SYMBOLS[i % len(_SYMBOLS)], "size": 8 if i else 7},
            customdata=np.c_[d["belady_share"], d["blocking_io_s"] * 1e3],
            hovertemplate=f"{ev} · %{{x}} slots: %{{y:.1%}} hit rate<br>%{{customdata[0]:.0%}} "
                          f"of Belady · blocking I/O %{{customdata[1]:.2f}} ms (modeled)"
                          f"<extra></extra>"))
    if CEILING in names:
        d = df[df.eviction == CEILING]
        fig.add_trace(go.Scatter(
            x=d["cache_slots"], y=d["hit_rate"], mode="lines", name=f"{CEILING} (ceiling)",
            line={"color": CEILING_COLOR, "width": 3, "dash": "dash"},
            customdata=d["blocking_io_s"] * 1e3,
            hovertemplate=f"{CEILING} (offline optimum) · %{{x}} slots: %{{y:.1%}}<br>blocking "
                          f"I/O %{{customdata:.2f}} ms (modeled)<extra></extra>"))
    if own is not None and own[0] is not None and np.isfinite(own[1]):
        fig.add_trace(go.Scatter(
            x=[own[0]], y=[own[1]], mode="markers", name=own[2],
            marker={"symbol": "star", "size": 14, "color": "#dc2626"},
            hovertemplate=f"{own[2]}: %{{x}} slots, %{{y:.1%}} hit rate<extra></extra>"))
    fig.update_layout(title=title, legend={"orientation": "h", "y": -0.22},
                      hovermode="closest")
    fig.update_xaxes(title="cache slots (experts resident on the device)"
                     + (", log scale" if log_x else ""), type="log" if log_x else "linear")
    fig.update_yaxes(title="hit rate (offloaded layers)", tickformat=".0%",
                     range=[-0.02, 1.02])
    return fig


def prefetch_comparison(trace, cache_slots: int, *, eviction: str = "lru",
                        prefetches: Iterable[str] | None = None, knobs=None,
                        prefetch_lead: int | None = None, scope: str = "global",
                        pinned_layers: int | None = None, target_model: str | None = None,
                        profile: str | None = None, memo: dict | None = None) -> pd.DataFrame:
    """Every prefetch policy (default: all registered) at one cache size and eviction policy;
    the other knobs as :func:`replay_curves` takes them.

    One row per policy: ``prefetch``, the replay metrics (times *modeled*) and ``error``: ''
    or, for a policy this trace cannot serve, the :class:`KnobError` message (its metrics NaN).
    """
    pin = pinned_prefix(trace) if pinned_layers is None else int(pinned_layers)
    k = _effective(trace, knobs, None, prefetch_lead, target_model, profile)
    rows = []
    for pf in (PREFETCH.available() if prefetches is None else prefetches):
        try:
            row = _replay_one(trace, eviction, cache_slots, knobs=k.copy(prefetch=pf),
                              scope=scope, pinned_layers=pin, memo=memo)
            rows.append({"prefetch": pf, **row, "error": ""})
        except KnobError as e:
            rows.append({"prefetch": pf, "error": str(e)})
    df = pd.DataFrame(rows)
    df.attrs.update(**{**_settings(k, scope, pin), "prefetch": None},
                    cache_slots=int(cache_slots), eviction=eviction)
    return df


@dataclass
class ReplayStudy:
    """What the dashboard's replay view shows for one run and one set of replay settings.

    ``curves``: :func:`replay_curves` over ``sizes``; ``table``: one row per policy (Belady
    included) at ``at_slots``; ``bounds``: useful cache sizes of the trace and scope;
    ``own``: ``(slots, hit_rate, label)`` of the recorded run itself, or None (unknown, or
    outside the range drawn); ``elapsed_s``:
    measured wall time of the replays (cached ones cost nothing)."""

    curves: pd.DataFrame
    table: pd.DataFrame
    sizes: list[int]
    at_slots: int
    bounds: tuple[int, int]
    own: tuple[int, float, str] | None
    settings: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    #: the trace's expert-parallel load under the replay's knobs (``workbench replay --set
    #: ep_ranks=R``'s ``ep`` figures), or a message why not; None: ``ep_ranks`` = 1
    ep: dict[str, Any] | str | None = None


def study(trace, evictions: Iterable[str] | None = None, **kw: Any) -> ReplayStudy:
    """:func:`study_steps` run to its end (the arguments and the result are its)."""
    return advance(study_steps(trace, evictions, **kw))


def study_steps(trace, evictions: Iterable[str] | None = None, *,
                slot_range: tuple[int, int] | None = None, at_slots: int | None = None,
                points: int = 12, own: tuple[int, float, str] | None = None, knobs=None,
                scope: str = "global", memo: dict | None = None,
                ep: tuple[int, str] | None = None,
                **changes: Any) -> Generator[Progress, None, ReplayStudy]:
    """:class:`ReplayStudy` of ``trace``: curves over ``points`` sizes of ``slot_range``
    (clipped to :func:`slot_bounds`; None = all of it) plus ``own[0]`` and ``at_slots`` when
    inside it, and the metrics table at ``at_slots`` (default ``own[0]``, else the middle of
    the range; clipped to the range). ``knobs`` and ``changes`` (``prefetch``,
    ``prefetch_lead``, ``target_model``, ``profile``) as :func:`replay_curves` takes them.
    ``ep`` ``(ranks, placement)``: also the trace's EP load over that many virtual ranks
    (after the replay knobs' dispatch, priced by their target model), when ranks > 1.
    A generator as :func:`curves_steps` is (:func:`study` runs it at once); the study's
    ``elapsed_s`` counts its own steps' time only, not the pauses between slices."""
    t = time.perf_counter()
    busy = 0.0
    pin = pinned_prefix(trace)
    lo, hi = slot_bounds(trace, scope, pin)
    a, b = (lo, hi) if slot_range is None else (int(min(slot_range)), int(max(slot_range)))
    a, b = min(max(a, lo), hi), min(max(b, lo), hi)
    sizes = cache_sizes(a, b, points)
    if at_slots is None:
        at_slots = own[0] if own is not None and own[0] is not None else (a + b) // 2
    at_slots = min(max(int(at_slots), a), b)
    if own is not None and (own[0] is None or not a <= own[0] <= b):
        own = None  # outside the range drawn
    sizes = sorted(set(sizes) | {at_slots} | ({own[0]} if own is not None else set()))
    steps = curves_steps(trace, evictions, sizes, knobs=knobs, scope=scope, pinned_layers=pin,
                         memo=memo, **changes)
    while True:
        try:
            got = next(steps)
        except StopIteration as end:
            curves = end.value
            break
        busy += time.perf_counter() - t
        yield got
        t = time.perf_counter()
    table = curves[curves.cache_slots == at_slots]
    table = pd.concat([table[table.eviction != CEILING], table[table.eviction == CEILING]],
                      ignore_index=True)  # the ceiling last
    ep_figures = None
    if ep is not None and int(ep[0]) > 1:
        k = _effective(trace, knobs, changes.get("prefetch"), changes.get("prefetch_lead"),
                       changes.get("target_model"), changes.get("profile"))
        try:
            ep_figures = replay_trace(trace, k, scope=scope, belady=False,
                                      cache_slots=at_slots, cache_bytes=None,
                                      ep_ranks=int(ep[0]), placement=ep[1]).extra.get("ep")
        except WorkbenchError as e:  # e.g. more ranks than the trace has experts
            ep_figures = str(e)
    return ReplayStudy(curves=curves, table=table, sizes=sizes, at_slots=at_slots,
                       bounds=(lo, hi), own=own, settings=dict(curves.attrs),
                       elapsed_s=busy + time.perf_counter() - t, ep=ep_figures)
