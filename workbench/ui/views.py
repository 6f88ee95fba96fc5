"""Views: small classes that turn a :class:`~workbench.ui.datastore.DataStore` into Panel panes.

Each plot view watches only the DataStore parameters its figure depends on (``watches``) and
redraws by calling the pure figure builders of :mod:`workbench.viz` (via the
``*_figure`` functions here, which add the dashboard's filters, the A/B baseline overlay and a
placeholder when there is nothing to show). A filter change therefore redraws the views that use
it, from the in-memory dataset, without re-running the model.

Every figure carries ``layout.meta = {"view": <name>}`` so a browser test can find it, and a
``uirevision`` per run so zoom survives the redraws of a live run. Time axes say which clock
they show (*measured* = wall time here; *modeled* = the hardware profile's timeline).
"""

from __future__ import annotations

import html
import logging
import textwrap
from pathlib import Path
from typing import Any, Callable

import numpy as np
import panel as pn
import plotly.graph_objects as go
import xarray as xr

from workbench.errors import WorkbenchError
from workbench.compression.policies import COMPRESSION
from workbench.policies.prefetch import PREFETCH
from workbench.policies.registry import declared_params
from workbench.sim.dispatch import DISPATCH
from workbench.sim.ep import imbalance
from workbench.sim.placement import EP_PLACEMENT
from workbench.sim.realb import balances
from workbench.telemetry.metadata import RunMetadata
from workbench.ui.datastore import (MAX_PROMPT_CHARS, DataStore, ab_context, ab_deltas, selected_steps,
                                    share_difference)
from workbench.ui import warm
from workbench.ui.replay import CEILING, METRICS, ReplayStudy, advance, curves_figure
from workbench.viz.ep import ep_load_figure
from workbench.viz.heatmap import expert_heatmap, hit_rate_figure, latency_figure, timeline_figure
from workbench.viz.predictor import hot_recall_figure
from workbench.viz.tokens import run_images, token_overlay_figure

__all__ = ["TickQueue", "PlotView", "HeatmapView", "DiffHeatmapView", "HitRateView", "LatencyView",
           "TimelineView", "DeltasView", "ReplayView", "TokenOverlayView", "HotRecallView",
           "heatmap_figure", "diff_heatmap_figure", "hit_rate_view_figure", "latency_view_figure",
           "timeline_view_figure", "token_overlay_view_figure", "hot_recall_view_figure",
           "replay_view_figure", "replay_table_html", "placeholder_figure", "deltas_html",
           "answer_view", "progress_view"]

log = logging.getLogger(__name__)

#: steps drawn by the timeline at most (the last ones of the selection): a Gantt chart of a
#: long run is unreadable and slow
TIMELINE_MAX_STEPS = 64
BASELINE_COLOR = "#9A9A9A"
_FONT = {"family": "Inter, Segoe UI, Helvetica, Arial, sans-serif", "size": 12}


#: characters a line of a plot title holds (plotly never wraps a title: a longer line is cut
#: off at the figure's edge). 64 fit the narrowest view (half the main column, ≈ 400 px at a
#: 1280 px window, 14 px text); the views that span the main column hold more.
TITLE_CHARS = 64
WIDE_TITLE_CHARS = 130
#: height of a title line, px
TITLE_LINE_PX = 18
WIDE_VIEWS = frozenset({"ep", "ep_timeline", "realb", "replay", "scheduler", "subexperts"})
#: where a long title line breaks, best first (between the parts of a title, never inside one
#: while a part fits a line): the separator, and how much of it stays on the line
_TITLE_BREAKS = ((" · ", 2), (" — ", 2), ("; ", 1), (": ", 1), (", ", 1), (" (", 0), (" ", 0))


def wrap_title(text: str, width: int = TITLE_CHARS) -> str:
    """``text`` with ``<br>`` where a line would pass ``width`` characters: lines already broken
    (``<br>``) stay so, a line that is one ``<sub>…</sub>`` is wrapped inside the tag (at 1.4 ×
    ``width``: smaller type), and a break goes at the first of :data:`_TITLE_BREAKS` that
    makes the line fit (a line with no break point is left long). Only breaks are added: read
    with each added ``<br>`` as a space, the text is ``text`` (tests find words in titles)."""
    out = []
    for line in str(text).split("<br>"):
        tag = line.startswith("<sub>") and line.endswith("</sub>") and line.count("<") == 2
        inner = line[5:-6] if tag else line
        parts = _wrap_line(inner, int(width * 1.4) if tag else width)
        out.extend(f"<sub>{p}</sub>" for p in parts) if tag else out.extend(parts)
    return "<br>".join(out)


def _wrap_line(line: str, width: int) -> list[str]:
    lines = []
    while len(line) > width:
        for sep, keep in _TITLE_BREAKS:
            at = line.rfind(sep, 1, width)
            if at > 0:
                cut = at + keep
                lines.append(line[:cut].rstrip())
                line = line[cut:].lstrip()
                break
        else:
            break
    return [*lines, line]


def finish_figure(fig: go.Figure, view: str, revision: Any = None) -> go.Figure:
    """The dashboard's look of a view's figure: its ``meta.view`` (tests and notebooks find a
    view by it), its title wrapped to the view's width (:func:`wrap_title`) with a top margin
    that holds its lines (a title never covers the plot or its axis titles), and a
    horizontal legend under the plot at the figure's bottom edge, below the x-axis title
    (plotly makes the bottom margin room for it): a legend placed in plot fractions covered the
    axis title whenever it grew (a pinned baseline's entries)."""
    title = wrap_title(fig.layout.title.text or "",
                       WIDE_TITLE_CHARS if view in WIDE_VIEWS else TITLE_CHARS)
    # the top margin holds the title's lines (plotly's own title.automargin measures the title
    # in the document, outside Panel's shadow roots, and throws)
    top = 60 + TITLE_LINE_PX * title.count("<br>")
    fig.update_layout(meta={"view": view}, uirevision=str(revision), template="plotly_white",
                      font=_FONT, margin={"l": 60, "r": 30, "t": top, "b": 50},
                      title={"x": 0.01, "xanchor": "left", "font": {"size": 14},
                             **({"text": title} if title else {})})
    legend = fig.layout.legend
    if legend.orientation == "h" and legend.y is not None and legend.y < 0.5:
        fig.update_layout(legend={"yref": "container", "y": 0, "yanchor": "bottom"})
    return fig


#: placeholder figures already built, as dicts: (view, title, message) → figure dict
_PLACEHOLDERS: dict[tuple[str, str, str], dict] = {}


def _arrays(value: Any) -> Any:
    """``value`` (a figure's ``to_dict()``) with plotly's typed-array specs (``{"dtype",
    "bdata"[, "shape"]}``, how plotly ≥ 6 writes numpy arrays) decoded back into numpy arrays."""
    if isinstance(value, dict):
        if "bdata" in value and "dtype" in value and set(value) <= {"bdata", "dtype", "shape"}:
            import base64

            a = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
            shape = value.get("shape")
            if isinstance(shape, str):
                shape = [int(x) for x in shape.split(",")]
            return a.reshape(shape).copy() if shape else a.copy()
        return {k: _arrays(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_arrays(v) for v in value]
    return value


def figure_from_dict(d: dict) -> go.Figure:
    """A new figure from a figure's ``to_dict()``, its arrays numpy arrays again (one
    validation: ≈ 5-20× cheaper than building a figure call by call)."""
    return go.Figure(_arrays(d))


def placeholder_figure(view: str, title: str, message: str) -> go.Figure:
    """An empty figure with ``message`` in the middle (no run yet, empty selection, …).

    A new figure each call (a pane may hold it), rebuilt from the dict of the first one built
    for the same arguments: one validation instead of five (≈ 5× cheaper, and views show
    placeholders at every run's start)."""
    key = (view, title, message)
    done = _PLACEHOLDERS.get(key)
    if done is not None:
        return figure_from_dict(done)
    fig = _placeholder(view, title, message)
    if len(_PLACEHOLDERS) > 256:
        _PLACEHOLDERS.clear()
    _PLACEHOLDERS[key] = fig.to_dict()
    return fig


def _placeholder(view: str, title: str, message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=wrap_title(message, WIDE_TITLE_CHARS if view in WIDE_VIEWS
                                       else TITLE_CHARS), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 13, "color": "#666"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(title=title)
    return finish_figure(fig, view, "empty")


def _steps_arg(steps: np.ndarray) -> Any:
    """Step numbers as the accessor's ``steps``: an inclusive slice when contiguous."""
    s = [int(x) for x in steps]
    if s and s == list(range(s[0], s[-1] + 1)):
        return slice(s[0], s[-1])
    return s


def _describe(step_range: tuple[int, int] | None, phase: str) -> str:
    parts = []
    if step_range is not None:
        parts.append(f"steps {step_range[0]}–{step_range[1]}")
    if phase not in (None, "all"):
        parts.append(f"{phase} only")
    return (" · " + ", ".join(parts)) if parts else ""


# -- figures (pure: datasets and filter values in, a figure out) --------------------------------
def heatmap_figure(ds: xr.Dataset | None, modality: str = "all",
                   step_range: tuple[int, int] | None = None, phase: str = "all",
                   revision: Any = None) -> go.Figure:
    """Layer × expert share of routed tokens (``ds.moe.heatmap``) under the filters."""
    title = "expert routing heatmap"
    if ds is None:
        return placeholder_figure("heatmap", title, "no run yet — press Run or open a run")
    steps = selected_steps(ds, step_range, phase)
    if len(steps) == 0:
        return placeholder_figure("heatmap", title, "no steps in the selection")
    fig = ds.moe.heatmap(modality=modality, steps=_steps_arg(steps))
    what = "all tokens" if modality in (None, "all") else f"{modality} tokens"
    fig.update_layout(title=f"routed-token share per expert — {what}"
                            f"{_describe(step_range, phase)}")
    if np.isnan(np.asarray(fig.data[0].z, float)).all():  # every layer empty
        fig.add_annotation(text=f"no {what} in the selection", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper", font={"size": 13, "color": "#666"})
    return finish_figure(fig, "heatmap", revision)


def diff_heatmap_figure(ds: xr.Dataset | None, baseline: xr.Dataset | None,
                        modality: str = "all", step_range: tuple[int, int] | None = None,
                        phase: str = "all", revision: Any = None) -> go.Figure:
    """Current − baseline routed-token shares per (layer, expert), diverging colours at 0."""
    title = "heatmap difference vs baseline"
    if ds is None or baseline is None:
        return placeholder_figure("heatmap_diff", title, "pin a baseline to compare runs")
    try:
        d = share_difference(ds, baseline, modality, step_range, phase)
    except WorkbenchError as e:
        return placeholder_figure("heatmap_diff", title, str(e))
    what = "all tokens" if modality in (None, "all") else f"{modality} tokens"
    fig = expert_heatmap(d, f"Δ routed-token share (current − baseline) — {what}"
                            f"{_describe(step_range, phase)}")
    lim = float(np.nanmax(np.abs(d.values))) if d.size else 0.0
    fig.update_traces(colorscale="RdBu_r", zmid=0, zmin=-max(lim, 0.01), zmax=max(lim, 0.01))
    if lim == 0:
        fig.add_annotation(text="same routing in both runs (Δ = 0 everywhere)",
                           showarrow=False, x=0.5, y=1.02, xref="paper", yref="paper",
                           yanchor="bottom", font={"size": 12, "color": "#666"})
    return finish_figure(fig, "heatmap_diff", revision)


def hit_rate_view_figure(ds: xr.Dataset | None, baseline: xr.Dataset | None = None,
                         step_range: tuple[int, int] | None = None, phase: str = "all",
                         revision: Any = None) -> go.Figure:
    """Cache hit rate per layer and per step (``hit_rate_figure``) of the selected steps, with
    the baseline's (same filters) in grey when one is pinned."""
    title = "expert-cache hit rate"
    if ds is None:
        return placeholder_figure("hit_rate", title, "no run yet")
    steps = selected_steps(ds, step_range, phase)
    if len(steps) == 0:
        return placeholder_figure("hit_rate", title, "no steps in the selection")
    sub = ds.sel(step=steps)
    fig = hit_rate_figure(sub)
    fig.data[0].name, fig.data[1].name = "current, per layer", "current, per step"
    if baseline is not None:
        bsteps = selected_steps(baseline, step_range, phase)
        if len(bsteps):
            b = baseline.sel(step=bsteps)
            bl, bs = b.moe.hit_rate(by="layer"), b.moe.hit_rate(by="step")
            fig.add_trace(go.Bar(x=bl["layer"].values, y=bl.values, name="baseline, per layer",
                                 marker_color=BASELINE_COLOR,
                                 hovertemplate="baseline layer %{x}: %{y:.1%}<extra></extra>"),
                          row=1, col=1)
            fig.add_trace(go.Scatter(x=bs["step"].values, y=bs.values, mode="lines+markers",
                                     name="baseline, per step",
                                     line={"color": BASELINE_COLOR, "dash": "dash"},
                                     hovertemplate="baseline step %{x}: %{y:.1%}"
                                                   "<extra></extra>"), row=1, col=2)
            hr = b.moe.hit_rate()
            fig.update_layout(showlegend=True, barmode="group",
                              legend={"orientation": "h", "y": -0.25},
                              title=f"{fig.layout.title.text} · baseline "
                                    f"{'n/a' if np.isnan(hr) else f'{hr:.1%}'}")
    fig.update_layout(title=f"{fig.layout.title.text}{_describe(step_range, phase)}")
    return finish_figure(fig, "hit_rate", revision)


def latency_view_figure(ds: xr.Dataset | None, baseline: xr.Dataset | None = None,
                        step_range: tuple[int, int] | None = None, phase: str = "all",
                        revision: Any = None) -> go.Figure:
    """Per-step latency, measured (left axis) and modeled (right axis), of the selected steps;
    the baseline's in grey when pinned."""
    title = "per-step latency: measured vs modeled"
    if ds is None:
        return placeholder_figure("latency", title, "no run yet")
    steps = selected_steps(ds, step_range, phase)
    if len(steps) == 0:
        return placeholder_figure("latency", title, "no steps in the selection")
    fig = latency_figure(ds.sel(step=steps))
    if baseline is not None:
        bsteps = selected_steps(baseline, step_range, phase)
        b = baseline.sel(step=bsteps)
        for var, label, secondary, dash in (("latency_measured_s", "measured", False, "solid"),
                                            ("latency_modeled_s", "modeled", True, "dot")):
            fig.add_trace(go.Scatter(
                x=b["step"].values, y=np.asarray(b[var].values) * 1e3, mode="lines",
                name=f"baseline, {label} (ms)", line={"dash": dash, "color": BASELINE_COLOR},
                hovertemplate=f"baseline step %{{x}}: %{{y:.3f}} ms {label}<extra></extra>"),
                secondary_y=secondary)
    fig.update_layout(title=f"{title}{_describe(step_range, phase)}",
                      legend={"orientation": "h", "y": -0.25})
    return finish_figure(fig, "latency", revision)


def timeline_view_figure(ds: xr.Dataset | None, clock: str = "modeled",
                         step_range: tuple[int, int] | None = None, phase: str = "all",
                         revision: Any = None) -> go.Figure:
    """Gantt chart of the compute / transfer / stall lanes on one clock (``timeline_figure``),
    for at most the last :data:`TIMELINE_MAX_STEPS` steps of the selection."""
    title = f"timeline, {clock} clock"  # lanes compute / transfer / stall on the y axis
    if ds is None:
        return placeholder_figure("timeline", title, "no run yet")
    steps = selected_steps(ds, step_range, phase)
    if len(steps) == 0:
        return placeholder_figure("timeline", title, "no steps in the selection")
    note = ""
    if len(steps) > TIMELINE_MAX_STEPS:
        steps = steps[-TIMELINE_MAX_STEPS:]
        note = f" (last {TIMELINE_MAX_STEPS} steps of the selection)"
    arg = _steps_arg(steps)
    fig = timeline_figure(ds, clock=clock, steps=arg)
    shown = f"steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    stall = "stall_measured_s" if clock == "measured" else "stall_modeled_s"
    total = float(np.asarray(ds[stall].sel(step=steps).values).sum()) * 1e3
    fig.update_layout(title=f"{title} · {shown}{note} · stall {total:.3f} ms ({clock})",
                      legend={"orientation": "h", "y": -0.3})
    return finish_figure(fig, "timeline", revision)


TOKENS_TITLE = "kept vs pruned visual tokens"


def token_overlay_view_figure(ds: xr.Dataset | None, revision: Any = None) -> go.Figure:
    """The shown run's image with each merged visual token's cell kept (outlined) or pruned
    (hatched) by token compression (``ds.moe.visual_tokens`` + :func:`token_overlay_figure`);
    a placeholder saying why not for a run without compression or without an image."""
    if ds is None:
        return placeholder_figure("tokens", TOKENS_TITLE, "no run yet")
    try:
        k = RunMetadata.from_attrs(ds.attrs, strict=False).knobs
    except WorkbenchError as e:  # a tampered or foreign store: say so, draw nothing
        return placeholder_figure("tokens", TOKENS_TITLE, f"this run's knobs cannot be read: "
                                                          f"{html.escape(str(e))[:200]}")
    if not COMPRESSION.get(k.compression).prunes:
        return placeholder_figure(
            "tokens", TOKENS_TITLE, "this run has no token compression (compression = none):"
                                    "<br>every visual token reaches every layer. Choose a "
                                    "compression policy<br>in the VisMMOE card and run again.")
    try:
        tokens = ds.moe.visual_tokens()
        n, kept = int(tokens.sizes["visual_token"]), int(tokens["kept"].sum())
        reads = declared_params(COMPRESSION.get(k.compression)) or ()  # λ: where it is used
        how = f"{k.compression}, β = {k.beta:g}" + (f", λ = {k.lam:g}" if "lam" in reads else "")
        fig = token_overlay_figure(
            tokens, run_images(ds.attrs),
            title=f"visual tokens past the pinned prefix: {kept} of {n} kept · {how}")
    except WorkbenchError as e:  # no image, a store without the image layout, …
        return placeholder_figure("tokens", TOKENS_TITLE,
                                  "<br>".join(textwrap.wrap(html.escape(str(e)), 70)))
    return finish_figure(fig, "tokens", revision)


#: k of the dashboard's Hot Recall view (the paper reports 10, 20, 30; at most the run's B)
HOT_RECALL_K = 10
RECALL_TITLE = "Hot Recall per layer"


def hot_recall_view_figure(ds: xr.Dataset | None, step_range: tuple[int, int] | None = None,
                           phase: str = "all", k: int = HOT_RECALL_K,
                           revision: Any = None) -> go.Figure:
    """Hot Recall@k of the run's lookahead predictor per MoE layer with the random baseline and
    the oracle (``ds.moe.hot_recall``) over the selected steps; a placeholder for a run recorded
    without the predictor. ``k`` is capped at the run's recorded top-B."""
    if ds is None:
        return placeholder_figure("hot_recall", RECALL_TITLE, "no run yet")
    ids = ds.get("predicted_ids")
    if ids is None or not bool((np.asarray(ids.values) >= 0).any()):
        return placeholder_figure(
            "hot_recall", RECALL_TITLE, "this run recorded no lookahead predictions "
                                        "(predictor = none):<br>run with predictor = vismmoe "
                                        "(or prefetch = vismmoe) to see Hot Recall")
    steps = selected_steps(ds, step_range, phase)
    if len(steps) == 0:
        return placeholder_figure("hot_recall", RECALL_TITLE, "no steps in the selection")
    k = min(int(k), int(ids.sizes["pred_order"]))
    sel = [int(s) for s in steps]
    recall, rnd, orc = (ds.moe.hot_recall(k, steps=sel, baseline=b)
                        for b in (None, "random", "oracle"))
    fig = hot_recall_figure(recall, rnd, orc, title=(
        f"Hot Recall@{k} per layer (layers l+1 … l+{recall.attrs['window']})"
        f"{_describe(step_range, phase)}"))
    return finish_figure(fig, "hot_recall", revision)


EP_TITLE = "expert parallel: load per rank"
#: the Expert parallel card's EPLB schedule knobs (they apply with placement = eplb)
EPLB_KNOBS = ("eplb_window", "eplb_interval", "num_redundant_experts")
EP_ONE_RANK = ("ep_ranks = 1: no expert parallelism.<br>Set ep_ranks in the Expert parallel "
               "card to spread this run's experts over ranks (virtual: nothing reruns)")


def ep_view_figure(ds: xr.Dataset | None, ranks: int, placement: str,
                   step_range: tuple[int, int] | None = None, phase: str = "all",
                   revision: Any = None, baseline: xr.Dataset | None = None,
                   baseline_name: str = "baseline", eplb: dict | None = None) -> go.Figure:
    """The shown run's routing over ``ranks`` virtual EP ranks under ``placement`` (the
    Expert parallel card's knobs: changing them redraws, nothing reruns): load per rank by
    modality and imbalance per layer × step over the selected steps (``ds.moe.ep_load``, from
    the stored ``routed_tokens``: drawn while the run is written too). ``baseline``: the pinned
    A/B run, its per-rank load over its own steps of the same phase (diamonds). ``eplb``:
    EPLB's schedule knobs (``placement`` = eplb: the card's window, interval, replicas)."""
    eplb = eplb or {}
    steps, empty = _ep_steps("ep", EP_TITLE, ds, ranks, step_range, phase)
    if empty is not None:
        return empty
    sel = {"step": [int(x) for x in steps]}
    routed = ds["routed_tokens"].sel(sel).sum(("step", "layer", "expert"))
    present = [str(m) for m, n in zip(routed["modality"].values, routed.values) if n > 0]
    # one load per modality present; their sum is the whole load (no second pass over it)
    if len(present) > 1:
        by_mod = {m: ds.moe.ep_load(ranks, placement, m, **eplb).sel(sel) for m in present}
    else:
        by_mod = {(present or ["text"])[0]: ds.moe.ep_load(ranks, placement, **eplb).sel(sel)}
    load = sum(by_mod.values())
    groups = max(int((load.sum("rank") > 0).sum()), 1)
    per_rank = {m: v.sum(("step", "layer")).values / groups for m, v in by_mod.items()}
    drops = ""
    if "dispatch_dropped" in ds and int(ds["dispatch_dropped"].sel(sel).sum()):
        gone = ds.moe.ep_dropped(ranks, placement, **eplb).sel(sel).sum(("step", "layer")).values
        per_rank["dropped"] = gone / groups
        kept = float(load.sum())
        drops = f", {gone.sum() / (kept + gone.sum()):.0%} of assignments dropped by dispatch"
    if "dispatch_rerouted" in ds and int(ds["dispatch_rerouted"].sel(sel).sum()):
        moved = ds.moe.ep_rerouted(ranks, placement, **eplb).sel(sel).sum(
            ("step", "layer")).values
        per_rank["rerouted"] = moved / groups
        drops += f", {moved.sum() / max(float(load.sum()), 1.0):.0%} rerouted"
    ib = imbalance(load.values)
    mean_ib = float(np.nanmean(ib)) if np.isfinite(ib).any() else float("nan")
    base, vs = None, ""
    if baseline is not None:
        b_steps = selected_steps(baseline, None, phase)
        if len(b_steps):
            b_sel = {"step": [int(x) for x in b_steps]}
            b_load = baseline.moe.ep_load(ranks, placement, **eplb).sel(b_sel)
            b_groups = max(int((b_load.sum("rank") > 0).sum()), 1)
            base = (f"baseline: {baseline_name}", b_load.sum(("step", "layer")).values / b_groups)
            b_ib = imbalance(b_load.values)
            if np.isfinite(b_ib).any():
                vs = f" (baseline {float(np.nanmean(b_ib)):.2f})"
    if EP_PLACEMENT.get(placement).dynamic:  # EPLB: its replicas and what rebalances moved
        reb = ds.moe.ep_times(ranks, placement, **eplb)["rebalance_s"].sel(sel)
        k = ds.moe._ep_knobs(ranks, placement, **eplb)
        drops += (f"; EPLB ({k.num_redundant_experts} replicas a layer, every "
                  f"{k.eplb_interval} steps): {int((reb > 0).sum())} rebalances, "
                  f"{float(reb.sum()) * 1e3:.1f} ms of weights moved (modeled)")
    fig = ep_load_figure(per_rank, ib, np.asarray(steps), (
        f"EP over {ranks} ranks ({placement}): imbalance {mean_ib:.2f}{vs} (max/mean, mean "
        f"over layer steps){drops}{_describe(step_range, phase)}"), base,
        _rank_capacity(ds, ranks, steps), _rank_precision(ds, ranks, placement, steps))
    return finish_figure(fig, "ep", revision)


def _rank_precision(ds: xr.Dataset, ranks: int, placement: str, steps: np.ndarray
                    ) -> tuple[str, np.ndarray] | None:
    """``(low precision, share of the selected layer calls each rank ran in it)`` when the
    run's live ReaLB decided over exactly these ranks and placement (its decisions are per
    rank of the run: another rank count or placement has none); else None."""
    if "realb_low" not in ds or int(ds.sizes.get("ep_rank", 0)) != ranks:
        return None
    from workbench.telemetry.metadata import RunMetadata

    try:
        k = RunMetadata.from_attrs(ds.attrs, strict=False).knobs
    except Exception:  # unreadable knobs: no marks
        return None
    if k is None or not balances(k.balance) or k.placement != placement \
            or int(k.ep_ranks) != ranks:
        return None
    sel = {"step": [int(x) for x in steps]}
    decided = ~np.isnan(ds["realb_m"].sel(sel).values[..., 0])  # [step, layer] layer calls
    if not decided.any():
        return None
    low = ds["realb_low"].sel(sel).values[decided]  # [calls, rank]
    return str(k.low_precision), low.mean(0)


REPLAY_TITLE = "replay: hit rate vs cache size"


def replay_view_figure(st: ReplayStudy, revision: Any = None) -> go.Figure:
    """Hit-rate curves of a :class:`~workbench.ui.replay.ReplayStudy` (Belady dashed: the
    ceiling; a star: the run as recorded; a dotted line: the table's cache size)."""
    cfg = st.settings
    pf = cfg.get("prefetch", "none")
    how = [f"{cfg.get('scope', 'global')} cache", "no prefetch" if not PREFETCH.get(pf).fetches else
           f"prefetch {pf} (lead {cfg.get('prefetch_lead', 1)})"]
    if cfg.get("target_model") not in (None, "none"):
        how.append(f"priced as {cfg['target_model']}")
    if cfg.get("knobs", {}).get("hybrid"):
        how.append("hybrid")
    fig = curves_figure(st.curves, f"{REPLAY_TITLE} · whole run · {', '.join(how)}", st.own)
    fig.add_vline(x=st.at_slots, line={"color": "#9ca3af", "dash": "dot", "width": 1},
                  annotation_text=f"table: {st.at_slots} slots", annotation_position="top left",
                  annotation_font={"size": 11, "color": "#6b7280"})
    return finish_figure(fig, "replay", revision)


def replay_table_html(st: ReplayStudy | None, message: str = "") -> str:
    """The replay metrics at the table's cache size, one row per policy (modeled figures say
    so), or ``message`` when there is no study."""
    if st is None:
        return f"<p class='wb-muted'>{html.escape(message)}</p>" if message else ""
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label, _ in METRICS)
    rows = []
    for _, r in st.table.iterrows():
        name = f"{r['eviction']} (ceiling)" if r["eviction"] == CEILING else r["eviction"]
        cells = "".join(f"<td>{_fmt(float(r.get(key, np.nan)), units)}</td>"
                        for key, _, units in METRICS)
        rows.append(f"<tr><td>{html.escape(str(name))}</td>{cells}</tr>")
    note = (f"<div class='wb-muted wb-ab-names'>at <b>{st.at_slots}</b> cache slots · useful "
            f"sizes {st.bounds[0]}–{st.bounds[1]} · replay took {st.elapsed_s * 1e3:.0f} ms "
            f"(measured) · I/O figures are <i>modeled</i> on the run's hardware profile"
            f"</div>")
    return (f"{note}<div class='wb-fit-box'><table class='wb-ab wb-fit wb-replay-table'><thead>"
            f"<tr><th>policy</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            f"</div>{_replay_ep_html(st.ep)}")


def _replay_ep_html(ep: Any) -> str:
    """The replayed trace's EP load (the Expert parallel card's ranks), one line; '' for
    ep_ranks = 1."""
    if ep is None:
        return ""
    if isinstance(ep, str):
        return f"<div class='wb-muted wb-replay-ep'>EP load: {html.escape(ep)}</div>"
    t = ep.get("moe_layer_s_modeled")
    clock = f" · MoE layers {t * 1e3:.2f} ms (<i>modeled</i>)" if t else ""
    return (f"<div class='wb-muted wb-replay-ep'>EP load of the replayed routing over "
            f"<b>{ep['ranks']}</b> ranks ({html.escape(str(ep['placement']))}): imbalance "
            f"<b>{ep['imbalance']:.2f}</b> (max/mean) · balancedness {ep['balancedness']:.2f} "
            f"· max rank load {ep['max_rank_load']}{clock}</div>")


# -- views ---------------------------------------------------------------------------------------
#: what a view says while the kernels it runs are compiled (:mod:`workbench.ui.warm`)
WARMING = ("preparing the compiled kernels (once after an install, in the background; the "
           "page stays usable) …")
#: how often such a view looks whether they are ready, s
WARM_RECHECK_S = 0.5


class TickQueue:
    """The redraws of one served session, one per event-loop tick, at most half the loop's time.

    A run's new steps change ``dataset`` several times a second and every plot redraws; done in
    one callback, the redraws held the event loop for a second or more, and a click (Stop)
    waited behind them (11-18 tokens late, ``benchmarks/bench_stop.py``). Here each redraw is
    its own callback, and a view asked again before its turn redraws once, with the newest state
    (the queue coalesces).

    Under load that was not enough (issue 37): a redraw took longer than the poll period, every
    poll brought new steps, the loop was busy redrawing ~98 % of the time (py-spy) and Stop
    reached the server 6–29 s after the click. So redraws leave the loop idle as long as they
    kept it busy: the next redraw waits :data:`REST` × the last one's duration, and after a
    burst :meth:`ready` is False for as long as the burst took — the poll reads the store's new
    steps only when ready (:meth:`DataStore.poll`), so under load frames are dropped (the
    newest state wins) instead of queueing, and clicks are read in the idle time.

    The rests are for a stream of new data only (``rest_while``: the app's says whether the
    shown run is being written): a filter's or a knob's redraws are finite, and resting between
    them only made the user wait (the step-range filter's hit rate waited behind the heatmap and
    its rest). ``urgent`` redraws (the first screen's views) go before the others queued (the
    views below it), so a filter or a new run's first plot never waits behind those.

    The page's own messages go before redraws (issue 37: a value typed as a run ended was said
    1.7-4.6 s later, and Run was heard 2.2 s after the click). Tornado reads a websocket
    message a frame at a time, several event-loop steps each, and a redraw queued for the next
    tick ran before every step: a typed value waited behind one redraw (0.1-0.4 s) per step of
    the relayout chatter (dozens of frames) that the end of a run's redraws make the page send.
    So a redraw that is not urgent (the views below the first screen, the replay's slices)
    first asks :meth:`page_waiting` — bytes from the page not read yet, or a message of it
    waiting for the document — and if so gives the loop its next step (a next-tick callback
    that only asks again: the websocket advances a step each time, and the process keeps its
    CPU) until the page is read, at most :data:`PAGE_MAX_WAIT_S` per redraw (a page that keeps
    talking still sees its plots change). A redraw that re-queues itself while it runs (a
    replay slice) is scheduled once, when it ends. Urgent redraws (what a click or a new run
    waits for) do not wait. Two earlier versions measured slower filters under ``--load 2``
    (1.5-4×, ``benchmarks/bench_dashboard.py``): one slept 10 ms between redraws and 3 ms at
    each look at the page (why sleeping cost that much on a busy machine was not traced), the
    other made every redraw wait for the page's relayout chatter."""

    #: idle time after a redraw, in units of the redraw's own duration
    REST = 1.0
    #: no redraw waits longer than this for the page, s
    PAGE_MAX_WAIT_S = 0.5

    def __init__(self, doc: Any) -> None:
        self.doc = doc
        self.pending: dict[int, Callable[[], None]] = {}  # insertion order = redraw order
        self.urgent: set[int] = set()  # keys of pending redraws that go first
        #: whether redraws rest now (None: always; the app: while the shown run streams)
        self.rest_while: Callable[[], bool] | None = None
        self.scheduled = False
        self.burst_s = 0.0  # seconds of redraws since the queue was last empty
        self.rest_until = 0.0  # time.monotonic() before which the session should not redraw
        self._waiting_since: float | None = None  # the next redraw waits for the page since
        self._running = False  # a redraw of this queue is running now

    def page_waiting(self) -> bool:
        """Whether the page has sent what the server has not handled yet: bytes in a
        connection's websocket stream or socket, or a message waiting for the document lock
        (which the redraw about to run would hold). Reads Bokeh's and Tornado's internals
        (``ServerSession._lock``, ``_subscribed_connections``, the handler's IOStream), so any
        surprise there answers False: the queue then runs its redraws one per tick, as
        outside a server."""
        import select

        try:
            session = self.doc.session_context._session
            waiters = getattr(getattr(session._lock, "_block", None), "_waiters", None)
            if waiters:
                return True
            for conn in list(session._subscribed_connections):
                stream = conn._socket.ws_connection.stream
                if stream._read_buffer_size:
                    return True
                sock = stream.socket
                if sock is not None and select.select([sock], [], [], 0)[0]:
                    return True
        except Exception:
            return False
        return False

    @classmethod
    def of_session(cls) -> "TickQueue | None":
        """The queue of the session being built or served; None outside a server (a notebook,
        a test): views then redraw at once."""
        doc = pn.state.curdoc
        if doc is None or getattr(doc, "session_context", None) is None:
            return None
        queue = getattr(doc, "_wb_ticks", None)
        if queue is None:
            queue = doc._wb_ticks = cls(doc)
        return queue

    def ready(self) -> bool:
        """Nothing queued and the rest after the last burst of redraws is over: new data may
        be read (and redrawn) now."""
        import time

        return not self.pending and time.monotonic() >= self.rest_until

    def _resting(self) -> bool:
        try:
            return self.rest_while is None or bool(self.rest_while())
        except Exception:  # a predicate that fails: rest, as before there was one
            return True

    def add(self, key: int, fn: Callable[[], None], urgent: bool = False) -> None:
        self.pending[key] = fn
        if urgent:
            self.urgent.add(key)
        if not self.scheduled and not self._running:  # running: its end schedules the next
            self.scheduled = True
            self.doc.add_next_tick_callback(self._one)

    def warming(self, key: int, fn: Callable[[], None]) -> bool:
        """Whether the kernels' warm-up child (:mod:`workbench.ui.warm`) still runs; if so,
        ``fn`` is queued under ``key`` again in :data:`WARM_RECHECK_S` (a view that would
        compile on the loop draws a placeholder meanwhile)."""
        if warm.ready():
            return False
        self.doc.add_timeout_callback(lambda: self.add(key, fn), int(WARM_RECHECK_S * 1e3))
        return True

    def _one(self) -> None:
        import time

        self.scheduled = False
        if not self.pending:
            return
        now = time.monotonic()
        key = next((k for k in self.pending if k in self.urgent), next(iter(self.pending)))
        # the page first: its message is read while this waits (an urgent redraw, a first
        # screen's view that a click or a run waits for, does not wait for the page's chatter)
        if key not in self.urgent and self.page_waiting():
            if self._waiting_since is None:
                self._waiting_since = now
            if now - self._waiting_since < self.PAGE_MAX_WAIT_S:
                self.scheduled = True
                self.doc.add_next_tick_callback(self._one)  # the loop's next step: no sleep
                return
        self._waiting_since = None
        self.urgent.discard(key)
        fn = self.pending.pop(key)
        t0 = time.monotonic()
        self._running = True
        try:
            fn()
        finally:
            self._running = False
            took = time.monotonic() - t0
            self.burst_s += took
            rest = self._resting()
            if self.pending:
                if not self.scheduled:
                    self.scheduled = True
                    if rest:
                        self.doc.add_timeout_callback(self._one,
                                                      max(1, int(took * self.REST * 1e3)))
                    else:  # the next tick, which first lets the page's messages be read
                        self.doc.add_next_tick_callback(self._one)
            else:
                self.rest_until = time.monotonic() + self.burst_s * self.REST if rest else 0.0
                self.burst_s = 0.0


#: figures of finished runs shared by sessions (``PlotView._safe_figure``): key → figure dict
_FIGURES: dict[tuple, dict] = {}

#: what a view below the first screen says while this session's run streams (``PlotView.live``)
WAITING_FOR_END = ("drawn when the run ends: the four plots above follow it live (under load "
                   "every view redrawn at each commit kept the page from answering)")


class PlotView:
    """A plotly pane redrawn from the DataStore when one of ``watches`` changes (served: on
    the session's :class:`TickQueue`, one view per tick).

    ``live`` False (the views below the first screen): while a run of this session streams
    (:attr:`DataStore.streaming`) the view does not follow its commits; it says so once
    (:data:`WAITING_FOR_END`) and draws the run when its last steps are read. Changes of
    anything but the run (filters, knobs) still redraw it at once. Served, such a view starts
    as a placeholder (``first_pending``) and the app draws it once the page has rendered: a new
    page's first screen does not wait for the views below it."""

    view = "plot"
    watches: tuple[str, ...] = ()
    #: follows every commit of a streaming run (the first screen's views); False: waits for
    #: its end
    live = True
    #: events that only bring a streaming run's next commit
    _RUN_EVENTS = frozenset({"dataset", "running"})

    def __init__(self, store: DataStore, height: int = 380) -> None:
        self.store = store
        self.redraws = 0
        self._waiting = False  # the WAITING_FOR_END placeholder is shown
        self._ticks = TickQueue.of_session()
        #: not drawn yet: the app queues the first redraw once the page has rendered
        self.first_pending = not self.live and self._ticks is not None
        first = placeholder_figure(self.view, self.view, "drawing …") if self.first_pending \
            else self._safe_figure()
        self.pane = pn.pane.Plotly(first, height=height,
                                   sizing_mode="stretch_width",
                                   config={"displaylogo": False, "responsive": True})
        store.param.watch(self._changed, list(self.watches))

    def _changed(self, *events: Any) -> None:
        fn = self.redraw
        if not self.live and getattr(self.store, "streaming", False) and events \
                and all(getattr(e, "name", None) in self._RUN_EVENTS for e in events):
            if self._waiting:
                return  # said already: the run is drawn when it ends
            fn = self._draw_waiting
        if self._ticks is None:
            fn()
        else:
            self._ticks.add(id(self), fn, urgent=self.live)

    def _draw_waiting(self) -> None:
        self._waiting = True
        self.pane.object = placeholder_figure(self.view, self.view, WAITING_FOR_END)

    def figure(self) -> go.Figure:
        raise NotImplementedError

    #: store parameters the figure depends on besides the dataset; a view that names them
    #: (and depends on nothing else) shares its figures of a finished run between sessions
    memo_params: tuple[str, ...] | None = None

    def _memo_key(self) -> tuple | None:
        """The key of this view's figure in :data:`_FIGURES`: the view, the shown store's
        identity (path, committed lengths and status, its ``zarr.json``'s mtime, size and
        inode) and :attr:`memo_params`; None when it is not shared (a run still written, a
        baseline pinned, a view without ``memo_params``)."""
        s = self.store
        if self.memo_params is None or s.dataset is None or s.baseline is not None \
                or s.live or getattr(s, "_sig", None) is None:
            return None
        return (type(self).__name__, str(s._path), s._sig, s._meta, str(s.run_name),
                *(repr(getattr(s, n)) for n in self.memo_params))

    def _safe_figure(self) -> go.Figure:
        """The figure, or a placeholder saying why not (a view never breaks the page). The
        first screen's figures of a finished run are built once per process (:data:`_FIGURES`):
        every new page showed the newest run and built the same four figures again (0.1-0.5 s
        each under load)."""
        key = self._memo_key()
        if key is not None and key in _FIGURES:
            return figure_from_dict(_FIGURES[key])
        fig = self._figure_or_why()
        if key is not None:
            if len(_FIGURES) > 64:
                _FIGURES.clear()
            _FIGURES[key] = fig.to_dict()
        return fig

    def _figure_or_why(self) -> go.Figure:
        try:
            return self.figure()
        except WorkbenchError as e:
            return placeholder_figure(self.view, self.view, str(e))
        except Exception as e:  # an unexpected store: say so, keep the other views going
            log.exception("view %s could not be drawn", self.view)
            return placeholder_figure(self.view, self.view,
                                      f"could not draw: {type(e).__name__}: {e}")

    def redraw(self, *events: Any) -> None:
        self._show(self._safe_figure())

    def _show(self, fig: go.Figure) -> None:
        self._waiting = self.first_pending = False
        self.pane.object = fig
        self.redraws += 1

    def _revision(self) -> str:
        return str(self.store.run_name)

    def __panel__(self) -> pn.pane.Plotly:
        return self.pane


class HeatmapView(PlotView):
    view = "heatmap"
    watches = ("dataset", "modality", "step_range", "phase")
    memo_params = ("modality", "step_range", "phase")

    def figure(self) -> go.Figure:
        s = self.store
        return heatmap_figure(s.dataset, s.modality, s.step_range, s.phase, self._revision())


class DiffHeatmapView(PlotView):
    view = "heatmap_diff"
    live = False
    watches = ("dataset", "baseline", "modality", "step_range", "phase")

    def figure(self) -> go.Figure:
        s = self.store
        return diff_heatmap_figure(s.dataset, s.baseline, s.modality, s.step_range, s.phase,
                                   self._revision())


class HitRateView(PlotView):
    view = "hit_rate"
    watches = ("dataset", "baseline", "step_range", "phase")
    memo_params = ("step_range", "phase")

    def figure(self) -> go.Figure:
        s = self.store
        return hit_rate_view_figure(s.dataset, s.baseline, s.step_range, s.phase,
                                    self._revision())


class LatencyView(PlotView):
    view = "latency"
    watches = ("dataset", "baseline", "step_range", "phase")
    memo_params = ("step_range", "phase")

    def figure(self) -> go.Figure:
        s = self.store
        return latency_view_figure(s.dataset, s.baseline, s.step_range, s.phase,
                                   self._revision())


class TimelineView(PlotView):
    view = "timeline"
    watches = ("dataset", "clock", "step_range", "phase")
    memo_params = ("clock", "step_range", "phase")

    def figure(self) -> go.Figure:
        s = self.store
        return timeline_view_figure(s.dataset, s.clock, s.step_range, s.phase,
                                    self._revision())


class TokenOverlayView(PlotView):
    """Kept vs pruned visual tokens over the shown run's image (token compression)."""

    view = "tokens"
    live = False
    watches = ("dataset",)

    def figure(self) -> go.Figure:
        return token_overlay_view_figure(self.store.dataset, self._revision())


class HotRecallView(PlotView):
    """Hot Recall per layer of the shown run's lookahead predictor, with the random baseline."""

    view = "hot_recall"
    live = False
    watches = ("dataset", "step_range", "phase")

    def figure(self) -> go.Figure:
        s = self.store
        return hot_recall_view_figure(s.dataset, s.step_range, s.phase,
                                      revision=self._revision())


class EPView(PlotView):
    """The shown run's expert-parallel load under the Expert parallel card's ``ep_ranks`` and
    ``placement`` (virtual ranks: redrawn from the recorded routing when they change, and at
    every commit of a run being written)."""

    view = "ep"
    live = False
    watches = ("dataset", "baseline", "step_range", "phase")

    def __init__(self, store: DataStore, height: int = 380) -> None:
        super().__init__(store, height)
        store.knobs.group("ep").param.watch(self._changed, ["ep_ranks", "placement",
                                                            *EPLB_KNOBS])

    def _eplb(self) -> dict:
        """The card's EPLB schedule knobs when its placement is eplb (else none apply)."""
        ep = self.store.knobs.group("ep")
        return {n: getattr(ep, n) for n in EPLB_KNOBS} \
            if EP_PLACEMENT.get(ep.placement).dynamic else {}

    def _key(self) -> str:
        ep = self.store.knobs.group("ep")
        return f"{self._revision()}-{ep.ep_ranks}-{ep.placement}-{sorted(self._eplb().items())}"

    def figure(self) -> go.Figure:
        s = self.store
        ep = s.knobs.group("ep")
        return ep_view_figure(s.dataset, int(ep.ep_ranks), ep.placement, s.step_range,
                              s.phase, self._key(), s.baseline, s.baseline_name or "baseline",
                              self._eplb())


def _rank_capacity(ds: xr.Dataset, ranks: int, steps: np.ndarray) -> tuple[str, float] | None:
    """A rank's capacity under the run's recorded dispatch, mean per (step, layer) group of
    ``steps``: its experts' (base) capacities C = max(min_capacity, ⌈γ0·T·k/E⌉), T the step's
    tokens; None for top-k (no capacity)."""
    from workbench.telemetry.metadata import RunMetadata

    try:
        k = RunMetadata.from_attrs(ds.attrs, strict=False).knobs
    except Exception:  # unreadable knobs: no line
        return None
    if k is None or not DISPATCH.get(k.dispatch).changes_routing:
        return None
    from workbench.sim.dispatch import CapacityDrop

    E = int(ds.sizes["expert"])
    top_k = int(ds.attrs.get("top_k", 1) or 1)
    tokens = ds["step_tokens"].sel(step=[int(x) for x in steps]).values
    cap = CapacityDrop(k.capacity_factor, k.min_capacity).capacity(tokens, top_k, E)
    label = "capacity per rank" + k.group("ep").selected("dispatch").capacity_note
    return label, float(np.mean(cap)) * E / ranks


EP_TIMELINE_TITLE = "expert parallel: the modeled EP clock of one step"


def _ep_steps(view: str, title: str, ds: xr.Dataset | None, ranks: int,
              step_range: tuple[int, int] | None, phase: str):
    """``(selected steps, None)``, or ``(None, placeholder)`` saying why an EP view has
    nothing to draw (no run, one rank, no step in the filters' selection)."""
    if ds is None:
        return None, placeholder_figure(view, title, "no run yet")
    if ranks <= 1:
        return None, placeholder_figure(view, title, EP_ONE_RANK)
    steps = selected_steps(ds, step_range, phase)
    if len(steps) == 0:
        return None, placeholder_figure(view, title, "no steps in the selection")
    return steps, None


def ep_timeline_view_figure(ds: xr.Dataset | None, ranks: int, placement: str,
                            step_range: tuple[int, int] | None = None, phase: str = "all",
                            revision: Any = None, eplb: dict | None = None) -> go.Figure:
    """The modeled EP clock (``ds.moe.ep_times``) of the first selected step — the prefill
    unless the filters say otherwise; with EPLB the first selected step that rebalances — as
    lanes: (EPLB's rebalance), dispatch (ReaLB's conversion beside it), each rank's experts,
    combine, per MoE layer (MACS Fig. 3). Follows the Expert parallel card's ranks, placement
    and EPLB knobs (``eplb``)."""
    steps, empty = _ep_steps("ep_timeline", EP_TIMELINE_TITLE, ds, ranks, step_range, phase)
    if empty is not None:
        return empty
    times = ds.moe.ep_times(ranks, placement, **(eplb or {}))
    step = int(steps[0])
    moving = [int(x) for x in steps if float(times["rebalance_s"].sel(step=int(x))) > 0]
    if moving:  # EPLB: show a step that pays for a rebalance
        step = moving[0]
    t = times.sel(step=step)
    routed = t["load"].sum("rank").values > 0
    if not routed.any():
        return placeholder_figure("ep_timeline", EP_TIMELINE_TITLE,
                                  f"step {step} routed no token")
    total = float(t["moe_layer_s"].sum()) * 1e3
    balanced = float((t["dispatch_s"] * 2 + t["compute_s"].mean("rank")).sum()) * 1e3
    from workbench.viz.ep import ep_timeline_figure

    reb = float(t["rebalance_s"]) if "rebalance_s" in t else 0.0
    sw = t["switch_s"].values[routed] if "switch_s" in t else None
    fig = ep_timeline_figure(
        t["dispatch_s"].values[routed], t["compute_s"].values[routed],
        t["combine_s"].values[routed], t["layer"].values[routed],
        f"modeled EP clock of step {step} over {ranks} ranks ({placement}, "
        f"{t.attrs['interconnect']}): {total:.2f} ms of MoE layers, {balanced:.2f} ms if every "
        f"rank were at the mean" + (f", + {reb * 1e3:.2f} ms EPLB rebalance" if reb else "")
        + " (modeled)", rebalance_s=reb, switch_s=sw)
    return finish_figure(fig, "ep_timeline", revision)


class EPTimelineView(EPView):
    """The modeled EP clock of one step of the shown run (:func:`ep_timeline_view_figure`),
    redrawn when the Expert parallel card's ranks or placement, the filters or the run
    change (as :class:`EPView`)."""

    view = "ep_timeline"
    watches = ("dataset", "step_range", "phase")

    def figure(self) -> go.Figure:
        s = self.store
        ep = s.knobs.group("ep")
        return ep_timeline_view_figure(s.dataset, int(ep.ep_ranks), ep.placement,
                                       s.step_range, s.phase, self._key(), self._eplb())


REALB_TITLE = "ReaLB: M_d per rank over the steps"


def realb_view_figure(ds: xr.Dataset | None, ranks: int, placement: str, balance: str,
                      revision: Any = None) -> go.Figure:
    """ReaLB's AIMD state of the shown run (seed 004 Fig. 9, ``ds.moe.plot_realb``): as its
    live controller recorded it; a run without one, under the Expert parallel card's
    ``balance`` (≠ none), ranks and placement: the controller over its recorded routing
    (*modeled*, nothing reruns)."""
    if ds is None:
        return placeholder_figure("realb", REALB_TITLE, "no run yet")
    recorded = "realb_m" in ds and not bool(np.isnan(ds["realb_m"].values).all())
    if not recorded:
        if not balances(balance):
            return placeholder_figure(
                "realb", REALB_TITLE, "the shown run had no ReaLB controller.<br>Set balance "
                "in the Expert parallel card to see it over this run's routing (modeled)")
        if ranks <= 1:
            return placeholder_figure("realb", REALB_TITLE, EP_ONE_RANK)
        fig = ds.moe.plot_realb(mode=balance, ranks=ranks, placement=placement)
    else:
        fig = ds.moe.plot_realb()
    return finish_figure(fig, "realb", revision)


class ReaLBView(EPView):
    """ReaLB's M_d trajectory of the shown run (:func:`realb_view_figure`), redrawn when the
    run, or the Expert parallel card's ranks, placement or balance change."""

    view = "realb"
    watches = ("dataset",)

    def __init__(self, store: DataStore, height: int = 340) -> None:
        super().__init__(store, height)
        store.knobs.group("ep").param.watch(self._changed, ["balance"])

    def figure(self) -> go.Figure:
        s = self.store
        ep = s.knobs.group("ep")
        return realb_view_figure(s.dataset, int(ep.ep_ranks), ep.placement, ep.balance,
                                 f"{self._revision()}-{ep.ep_ranks}-{ep.placement}-"
                                 f"{ep.balance}")


class ReplayView(PlotView):
    """What-if replay of the shown run (``DataStore.replay_study``): hit rate vs cache size of
    the chosen eviction policies, Belady as the ceiling, and a metrics table (``table``).
    Watches the shown run, the ``replay_*`` settings and the replay knobs (``replay_revision``)
    only; replays, never re-runs. A finished run's routing and the replays made on it are
    shared by the sessions that show it (``DataStore.replay_trace``): a new page replays
    nothing again. It replays on the event loop: in a worker thread (tried, issue 37) the
    replay, holding the GIL, slowed every callback of the page while it ran."""

    view = "replay"
    live = False
    watches = ("dataset", "running", "replay_evictions", "replay_scope", "replay_slots",
               "replay_at", "replay_revision")

    #: seconds of replays per event-loop tick when served: a run's study (9 policies × 13
    #: sizes) held the loop 2-11 s in one callback (py-spy), and a value typed right after a
    #: run ended waited behind it (``bench_dashboard.py``'s refused value)
    SLICE_S = 0.15

    def __init__(self, store: DataStore, height: int = 420, defer: bool = False) -> None:
        """``defer``: start with a placeholder and replay on the first :meth:`redraw` (the app
        calls it once the page has rendered: the first replay imports torch and the compiled
        replay kernel)."""
        self.study: ReplayStudy | None = None
        self.message = ""
        self._deferred = defer
        self._steps = None  # the study in progress (a generator), advanced one slice a tick
        self._more = False  # served: the study stopped at its slice's deadline; go on next tick
        self._said_at = 0.0  # time.monotonic() of the last progress message shown
        self.table = pn.pane.HTML("", sizing_mode="stretch_width")
        super().__init__(store, height)
        self.table.object = replay_table_html(self.study, self.message)
        self._deferred = False
        if self._more:  # served and drawn at once: the rest of the study on the next ticks
            self._ticks.add(id(self), self._slice)

    def figure(self) -> go.Figure:
        self.study, self.message = None, ""
        if self._deferred and self.store.dataset is not None:
            return placeholder_figure(self.view, REPLAY_TITLE, "replaying …")
        if self.store.dataset is None:
            self.message = "no run yet — press Run or open a run to replay it"
            return placeholder_figure(self.view, REPLAY_TITLE, self.message)
        if self.store.running:  # replaying every live update would hold the event loop
            self.message = "the run is in flight: it is replayed when it ends"
            return placeholder_figure(self.view, REPLAY_TITLE, self.message)
        if self._ticks is not None and self._ticks.warming(id(self), self.redraw):
            self.message = WARMING  # a compile would hold the loop
            return placeholder_figure(self.view, REPLAY_TITLE, self.message)
        try:
            if self._steps is None:
                self._steps = self.store.replay_study_steps()
            got = advance(self._steps, self._deadline())
            if not isinstance(got, ReplayStudy):  # a slice's end: the next tick goes on
                self._more = True
                self.message = f"replaying … {got[0]} of {got[1]} points"
                return placeholder_figure(self.view, REPLAY_TITLE, self.message)
            self._steps, self.study = None, got
            return replay_view_figure(self.study, self._revision())
        except Exception as e:  # e.g. a prefetch policy this run cannot serve, a bad store
            self._steps = None
            if not isinstance(e, WorkbenchError):
                log.exception("replay of %s failed", self.store.run_name)
            self.study = None
            self.message = str(e) if isinstance(e, WorkbenchError) else \
                f"could not replay: {type(e).__name__}: {str(e)[:200]}"
            return placeholder_figure(self.view, REPLAY_TITLE,
                                      "<br>".join(textwrap.wrap(html.escape(self.message), 90)))

    def _deadline(self) -> float | None:
        """The end of this slice of replays: served only (a notebook replays at once)."""
        import time

        return None if self._ticks is None else time.monotonic() + self.SLICE_S

    def redraw(self, *events: Any) -> None:
        self._steps = None  # a change: a new study (the memo keeps the replays already made)
        self._slice()

    #: seconds between two progress messages of a sliced study: each new figure costs the
    #: browser a plotly render, and under load the page's own input waits behind renders
    PROGRESS_EVERY_S = 2.0

    def _slice(self) -> None:
        import time

        going_on, self._more = self._steps is not None, False
        fig = self._safe_figure()
        if self._more:
            self._ticks.add(id(self), self._slice)  # a change meanwhile replaces it (same key)
            if going_on and time.monotonic() < self._said_at + self.PROGRESS_EVERY_S:
                return  # said recently: the page is left alone
            self._said_at = time.monotonic()
        self._show(fig)
        self.table.object = replay_table_html(self.study, self.message)


#: +1: higher is better, -1: lower is better, 0: neutral (colours the A/B deltas)
_BETTER = {"hit_rate": 1, "hits": 1, "misses": -1, "loads": -1, "evictions": -1, "host_runs": 0,
           "latency_measured_s": -1, "latency_modeled_s": -1, "stall_measured_s": -1,
           "stall_modeled_s": -1, "transfer_bytes_measured": -1, "transfer_bytes_modeled": -1,
           "steps": 0}


def _fmt(value: float, units: str, signed: bool = False) -> str:
    if not np.isfinite(value):
        return "n/a"
    sign = "+" if signed and value > 0 else ""
    if units == "fraction":
        return f"{sign}{value * 100:.1f} pp" if signed else f"{value:.1%}"
    if units == "s":
        return f"{sign}{value * 1e3:,.2f} ms"
    if units == "bytes":
        return f"{sign}{value / 1e6:,.2f} MB"
    return f"{sign}{value:,.0f}"


def deltas_html(rows: list[dict[str, Any]], current: str | None, baseline: str | None,
                context: dict[str, Any] | None = None) -> str:
    """The A/B table as HTML (deltas green when better, red when worse), under what it compares:
    the knobs that differ and, in red, why the runs may not be comparable (``ab_context``)."""
    if not rows:
        return ("<p class='wb-muted'>Pin a run as baseline (left, <b>Runs</b>), then run or "
                "open another: its hit rate, loads, latency and routing are compared here.</p>")
    def short(name: str | None) -> str:
        return (name or "").removesuffix(".zarr")

    context = context or {"differing": [], "warnings": []}
    diff = ", ".join(f"{html.escape(str(k))} {html.escape(_short_value(b))} → {html.escape(_short_value(c))}"
                     for k, c, b in context["differing"]) or "none (a repeat: the deltas are noise)"
    notes = (f"<div class='wb-muted wb-ab-diff' data-testid='ab-differs'>knobs that differ (baseline → "
             f"current): {diff}</div>"
             + "".join(f"<div class='wb-bad wb-ab-warn' data-testid='ab-warning'>⚠ {html.escape(w)}</div>"
                       for w in context["warnings"]))
    head = (f"<div class='wb-muted wb-ab-names'>current: <b>{short(current)}</b> · baseline: "
            f"<b>{short(baseline)}</b></div>{notes}<table class='wb-ab'><thead><tr><th>whole run</th>"
            f"<th>current</th><th>baseline</th><th>Δ</th><th>Δ %</th></tr></thead><tbody>")
    body = []
    for r in rows:
        good = _BETTER.get(r["metric"], 0) * np.sign(r["delta"]) if np.isfinite(r["delta"]) \
            else 0
        if r.get("noise"):
            good = 0  # within what a repeat changes: neither better nor worse
        cls = "wb-good" if good > 0 else "wb-bad" if good < 0 else ""
        rel = "n/a" if not np.isfinite(r["relative"]) else f"{r['relative']:+.1%}"
        label, cur, base = r["label"], _fmt(r["current"], r["units"]), _fmt(r["baseline"], r["units"])
        if "current_spread" in r:
            label += " (median of repeats)"
            cur, base = (_spread_cell(r[k], r["units"]) for k in ("current_spread", "baseline_spread"))
            if r["noise"]:
                few = min(r["current_spread"]["n"], r["baseline_spread"]["n"]) < 2
                rel += (" <span class='wb-muted' data-testid='ab-noise'>(one run: noise unknown, "
                        "run it again)</span>" if few else
                        " <span class='wb-muted' data-testid='ab-noise'>(within the spread of "
                        "repeats)</span>")
        body.append(f"<tr><td>{label}</td><td>{cur}</td><td>{base}</td>"
                    f"<td class='{cls}'>{_fmt(r['delta'], r['units'], signed=True)}</td>"
                    f"<td class='{cls}'>{rel}</td></tr>")
    return head + "".join(body) + "</tbody></table>"


def _spread_cell(sp: dict[str, Any], units: str) -> str:
    """A measured metric over repeats: the median, and the range when there are several."""
    if sp["n"] < 2:
        return f"{_fmt(sp['median'], units)} <span class='wb-muted'>(n=1)</span>"
    return (f"{_fmt(sp['median'], units)} <span class='wb-muted'>({_fmt(sp['min'], units)}–"
            f"{_fmt(sp['max'], units)}, n={sp['n']})</span>")


class DeltasView:
    """A/B table of the shown run vs the pinned baseline (whole runs, ``ab_deltas``)."""

    watches = ("dataset", "baseline")

    def __init__(self, store: DataStore) -> None:
        self.store = store
        self.rows: list[dict[str, Any]] = []
        self.pane = pn.pane.HTML(self._html(), sizing_mode="stretch_width")
        ticks = TickQueue.of_session()
        store.param.watch(self.redraw if ticks is None else
                          (lambda *e: ticks.add(id(self), self.redraw)), list(self.watches))

    def _html(self) -> str:
        s = self.store
        try:
            both = s.dataset is not None and s.baseline is not None
            reps = {"current": s.repeats(s.dataset, s.run_name),
                    "baseline": s.repeats(s.baseline, s.baseline_name)} if both else None
            self.rows = ab_deltas(s.dataset, s.baseline, reps) if both else []
            return deltas_html(self.rows, s.run_name, s.baseline_name,
                               ab_context(s.dataset, s.baseline) if both else None)
        except Exception as e:  # a run whose numbers cannot be computed: say so
            log.exception("A/B table of %s vs %s", s.run_name, s.baseline_name)
            self.rows = []
            return (f"<p class='wb-muted'>the runs cannot be compared: "
                    f"{html.escape(type(e).__name__)}: {html.escape(str(e)[:200])}</p>")

    def redraw(self, *events: Any) -> None:
        self.pane.object = self._html()

    def __panel__(self) -> pn.pane.HTML:
        return self.pane


def answer_view(store: DataStore) -> pn.viewable.Viewable:
    """The prompt and the answer as it streams; for a demo request, its expected answer beside
    it once the run is done (marked right or wrong: exact match, as the model card counts).

    The parts read from the run's attributes (thumbnail, batch answers) are computed once per
    shown dataset and baseline: the answer changes at every token, and parsing the attributes
    each time held the event loop (py-spy, issue 37)."""
    memo: dict[str, Any] = {"thumb": (None, ""), "rows": (None, "")}

    def thumb_of(ds: xr.Dataset | None) -> str:
        if memo["thumb"][0] is not ds:
            memo["thumb"] = (ds, _thumbnail(ds))
        return memo["thumb"][1]

    def rows_of(ds: xr.Dataset | None) -> str:
        key = (ds, store.baseline, store.baseline_name)
        old = memo["rows"][0]
        if old is None or any(a is not b for a, b in zip(old, key)):
            memo["rows"] = (key, _batch_table(DataStore.batch_answers(ds),
                                              DataStore.batch_answers(store.baseline),
                                              store.baseline_name))
        return memo["rows"][1]

    def render(answer: str, running: bool, run_name: str | None, ds: xr.Dataset | None,
               expected: str, baseline: xr.Dataset | None = None) -> str:
        text = answer.strip() or ("…" if running else "—")
        esc = html.escape(text)
        prompt = ds.attrs.get("prompt", "") if ds is not None else ""
        prompt = prompt if isinstance(prompt, str) else ""
        # the expected answer belongs to the demo request in the inputs: shown only beside a
        # finished answer to that same prompt
        check = ""
        if expected and not running and answer.strip() and prompt == store.prompt:
            ok = answer.strip() == expected.strip()
            check = (f"<div class='wb-expected' data-testid='expected' data-match='{str(ok).lower()}'>"
                     f"expected: {html.escape(expected)} {'✓' if ok else '✗'}</div>")
        if len(prompt) > MAX_PROMPT_CHARS:  # a store may hold any prompt
            prompt = prompt[:MAX_PROMPT_CHARS] + " …"
        prompt = html.escape(prompt)
        thumb = thumb_of(ds)
        rows = "" if running else rows_of(ds)
        return (f"<div class='wb-answer'>{thumb}<div class='wb-muted'>{prompt}</div>"
                f"<div class='wb-answer-text' data-testid='answer'>{esc}</div>{check}{rows}</div>")

    return pn.pane.HTML(pn.bind(render, store.param.answer, store.param.running,
                                store.param.run_name, store.param.dataset, store.param.expected,
                                store.param.baseline),
                        sizing_mode="stretch_width")


def _batch_table(rows: list[dict[str, Any]], base: list[dict[str, Any]],
                 base_name: str | None) -> str:
    """Every answer of a batch run (issue 37 §5): request, answer, expected answer where known
    (✓/✗, exact match), and — with a baseline pinned whose batch had the same prompts — the
    answers that differ from the baseline's, marked with the baseline's answer."""
    from workbench.runtime.result import answer_matches

    if not rows:
        return ""
    same = len(base) == len(rows) and all(a["prompt"] == b["prompt"] for a, b in zip(rows, base))
    known = [r for r in rows if r.get("expected") is not None]
    right = sum(answer_matches(r) for r in known)
    differ = sum(a["text"].strip() != b["text"].strip() for a, b in zip(rows, base)) if same else 0
    head = [f"{len(rows)} requests"]
    if known:
        head.append(f"{right} of {len(known)} as expected")
    if same:
        head.append(f"{differ} differ from the baseline {html.escape(str(base_name or ''))}")
    out = [f"<details class='wb-batch' data-testid='batch' {'open' if len(rows) <= 8 else ''}>"
           f"<summary>batch: {' · '.join(head)}</summary><div class='wb-batch-rows'>"
           f"<table class='wb-ab wb-batch-table'><tr><th>#</th><th>request</th><th>answer</th>"
           f"<th>expected</th>{'<th>baseline</th>' if same else ''}</tr>"]
    for i, r in enumerate(rows):
        prompt = r["prompt"] if len(r["prompt"]) <= 60 else r["prompt"][:60] + " …"
        if r.get("images"):
            prompt += " 🖼"
        exp = ""
        if r.get("expected") is not None:
            ok = answer_matches(r)
            exp = (f"<td class='{'wb-good' if ok else 'wb-bad'}' data-match='{str(ok).lower()}'>"
                   f"{html.escape(str(r['expected'])[:80])} {'✓' if ok else '✗'}</td>")
        else:
            exp = "<td class='wb-muted'>—</td>"
        cell = ""
        if same:
            b = base[i]["text"]
            moved = b.strip() != r["text"].strip()
            cell = (f"<td class='wb-bad' data-differs='true'>≠ {html.escape(b[:80])}</td>"
                    if moved else "<td class='wb-muted' data-differs='false'>same</td>")
        out.append(f"<tr><td>{i}</td><td>{html.escape(prompt)}</td>"
                   f"<td>{html.escape(r['text'][:120])}</td>{exp}{cell}</tr>")
    out.append("</table></div></details>")
    return "".join(out)


def _progress_values(store: DataStore) -> tuple[int, int]:
    """(value, max) of the progress bar: max ≥ 1, 0 ≤ value ≤ max."""
    m = max(1, int(store.progress_max or 1))
    return max(0, min(int(store.progress or 0), m)), m


def progress_view(store: DataStore) -> pn.viewable.Viewable:
    """Progress bar (tokens generated / max_new_tokens) and the status line.

    The bar's ``value`` and ``max`` move together in one watcher (max first): bound one by one
    to the store, a new run with more steps than the previous run's maximum set the value
    before the maximum and Panel refused it (``Progress.value must be at most …``)."""
    value, m = _progress_values(store)
    bar = pn.indicators.Progress(value=value, max=m, bar_color="primary",
                                 sizing_mode="stretch_width", height=18,
                                 margin=(8, 10, 0, 10))

    def sync(*events: Any) -> None:
        v, mx = _progress_values(store)
        if bar.value is not None and bar.value > mx:
            bar.value = v  # shrinking: the value first, then the bound
        bar.max = mx
        bar.value = v

    store.param.watch(sync, ["progress", "progress_max"])
    bar._wb_sync = sync  # tests
    line = pn.pane.HTML(pn.bind(lambda s: f"<span class='wb-status'>{html.escape(s)}</span>",
                                store.param.status),
                        sizing_mode="stretch_width", margin=(0, 10))
    return pn.Column(bar, line, sizing_mode="stretch_width")


VIEW_CLASSES: tuple[Callable[[DataStore], PlotView], ...] = (
    HeatmapView, HitRateView, LatencyView, TimelineView, DiffHeatmapView, TokenOverlayView,
    HotRecallView)


def _short_value(v: Any) -> str:
    """A knob value in a table cell: at most 40 characters."""
    text = "unset" if v is None else str(v)
    return text if len(text) <= 40 else text[:39] + "…"


class CompareView:
    """Several runs of the workspace at once (:func:`workbench.compare_runs`): pick runs in
    ``choice``; ``table`` shows one column per run (rows: the knobs that differ, then the
    headline numbers) and ``pane`` their hit rates per step overlaid. The run menu follows the
    workspace (re-listed when a run ends or another is shown)."""

    def __init__(self, store: DataStore) -> None:
        self.store = store
        from workbench.ui.widgets import names

        self.choice = pn.widgets.MultiChoice(**names(pn.widgets.MultiChoice, "runs to compare"), options=[],
                                             sizing_mode="stretch_width", css_classes=["wb-compare-runs"])
        self.table = pn.pane.HTML("<p class='wb-muted'>Pick two or more runs to compare them.</p>",
                                  sizing_mode="stretch_width")
        self.pane = pn.pane.Plotly(go.Figure(), height=320, sizing_mode="stretch_width", visible=False)
        self.choice.param.watch(self.redraw, "value")
        # the store's list of runs (re-listed every refresh_s and when a run's store is
        # written, which may come after ``running`` turned False: the end is shown first)
        store.param.watch(self.refresh, ["run_name", "running", "runs"])
        self.refresh()

    def refresh(self, *events: Any) -> None:
        names = [r.name for r in self.store.runs if r.readable and r.status != "running"]
        if names != list(self.choice.options):
            self.choice.options = names
        kept = [v for v in self.choice.value if v in names]
        if kept != list(self.choice.value):
            self.choice.value = kept

    def redraw(self, *events: Any) -> None:
        from workbench.analysis.compare import compare_runs

        picked = list(self.choice.value)
        if len(picked) < 2:
            self.table.object = "<p class='wb-muted'>Pick two or more runs to compare them.</p>"
            self.pane.visible = False
            return
        try:
            table, fig = compare_runs([self.store.workspace_path / n for n in picked])
        except Exception as e:  # a run that cannot be read: say so, keep the page
            log.warning("compare %s: %s", picked, e)
            self.table.object = (f"<p class='wb-bad'>the runs cannot be compared: "
                                 f"{html.escape(type(e).__name__)}: {html.escape(str(e)[:200])}</p>")
            self.pane.visible = False
            return
        # a run a column (a row per knob and number): the runs are few, the columns were many
        # (the table ran past its card)
        self.table.object = ("<div class='wb-fit-box'>" + table.T.to_html(
            classes="wb-ab wb-fit wb-compare-table", float_format=lambda x: f"{x:.4g}",
            border=0, escape=True) + "</div>")
        self.pane.object = fig
        self.pane.visible = True


_THUMBS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> <img> tag; small, bounded


def _thumbnail(ds: xr.Dataset | None, side: int = 72) -> str:
    """An ``<img>`` of the first image the shown run used (a 72 px PNG inlined), or ``""`` when
    it has none or the file is gone, unreadable or not an image the runtime would open (checked
    from its header first: a store's attrs may name any path)."""
    import base64
    import io

    from workbench.telemetry.metadata import RunMetadata

    if ds is None:
        return ""
    try:
        images = RunMetadata.from_attrs(ds.attrs, strict=False).images
        if not images:
            return ""
        path = Path(images[0])
        st = path.stat()
        key = (str(path), st.st_size, int(st.st_mtime))
        if key not in _THUMBS:
            from PIL import Image

            from workbench.models.inputs import probe_image

            probe_image(path)  # header, size and format checks before anything is decoded
            with Image.open(path) as im:
                im = im.convert("RGB")
                im.thumbnail((side, side))
                buf = io.BytesIO()
                im.save(buf, format="PNG")
            if len(_THUMBS) > 64:
                _THUMBS.clear()
            _THUMBS[key] = (f"<img class='wb-answer-image' data-testid='answer-image' alt='input image' "
                            f"src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}' "
                            f"style='float:right;max-height:{side}px;margin-left:8px'>")
        return _THUMBS[key]
    except Exception:  # a missing or odd file: no thumbnail, never a broken card
        return ""
