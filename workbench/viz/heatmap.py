"""Figure builders: a run Dataset (or a DataArray from ``ds.moe``) in, a plotly Figure out.

Pure functions: no I/O, no model, no global state. Arrays go to plotly as whole numpy arrays
(one trace per series, never one per cell or per span) so a 48-layer × 128-expert heatmap or a
timeline of tens of thousands of spans builds in milliseconds. Every time axis and trace name
says whether it shows the *measured* clock (wall time here) or the *modeled* one (the hardware
profile's timeline).

The Datasets come from :func:`workbench.open_run` (``workbench.analysis``), which registers
``ds.moe``; viz never imports analysis (the accessor imports viz to build its figures).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
import xarray as xr
from plotly.subplots import make_subplots

from workbench.errors import InputError
from workbench.telemetry.events import CLOCKS, LANES

__all__ = ["expert_heatmap", "hit_rate_figure", "latency_figure", "subexpert_heatmap",
           "timeline_figure"]

#: one colour per timeline lane (compute, transfer, stall, host = hybrid mode's host runs)
LANE_COLORS = {"compute": "#4C78A8", "transfer": "#F58518", "stall": "#E45756",
               "host": "#54A24B"}


def expert_heatmap(counts: xr.DataArray, title: str = "routed tokens per expert") -> go.Figure:
    """Layer × expert heatmap of a [layer, expert] DataArray (``ds.moe.expert_counts``).

    ``z`` is ``[layer, expert]`` (layer 0 on top); the colour bar is titled with
    ``counts.attrs["units"]``.
    """
    if set(counts.dims) != {"layer", "expert"}:
        raise InputError(f"counts must have dims ('layer', 'expert'), not {counts.dims!r}")
    c = counts.transpose("layer", "expert")
    units = c.attrs.get("units", "")
    fig = go.Figure(go.Heatmap(
        z=np.asarray(c.values, float), x=c["expert"].values, y=c["layer"].values,
        colorscale="Viridis", colorbar={"title": {"text": units}},
        hovertemplate="layer %{y} · expert %{x}<br>%{z}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="expert", yaxis_title="MoE layer",
                      yaxis_autorange="reversed", margin={"t": 60})
    return fig


def subexpert_heatmap(counts: xr.DataArray, title: str = "tokens per sub-expert") -> go.Figure:
    """Expert × sub-expert heatmap of one layer's [expert, subexpert] DataArray
    (``ds.moe.subexpert_counts().sel(layer=l)``): which parts of each expert the tokens ran."""
    if set(counts.dims) != {"expert", "subexpert"}:
        raise InputError(f"counts must have dims ('expert', 'subexpert'), not {counts.dims!r}")
    c = counts.transpose("subexpert", "expert")
    fig = go.Figure(go.Heatmap(
        z=np.asarray(c.values, float), x=c["expert"].values, y=c["subexpert"].values,
        colorscale="Viridis", colorbar={"title": {"text": c.attrs.get("units", "")}},
        hovertemplate="expert %{x} · sub-expert %{y}<br>%{z}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="expert", yaxis_title="sub-expert",
                      yaxis_autorange="reversed", margin={"t": 60})
    return fig


def hit_rate_figure(ds: xr.Dataset) -> go.Figure:
    """Expert-cache hit rate (offloaded layers): bars per layer, and a line over steps."""
    by_layer = ds.moe.hit_rate(by="layer")
    by_step = ds.moe.hit_rate(by="step")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5],
                        subplot_titles=("per layer (pinned layers blank)", "per step"))
    fig.add_trace(go.Bar(x=by_layer["layer"].values, y=by_layer.values,
                         name="hit rate per layer",
                         hovertemplate="layer %{x}: %{y:.1%}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=by_step["step"].values, y=by_step.values, mode="lines+markers",
                             name="hit rate per step",
                             hovertemplate="step %{x}: %{y:.1%}<extra></extra>"), row=1, col=2)
    fig.update_xaxes(title_text="MoE layer", row=1, col=1, **integer_ticks(by_layer["layer"].values))
    fig.update_xaxes(title_text="step", row=1, col=2, **integer_ticks(by_step["step"].values))
    fig.update_yaxes(title_text="hit rate", tickformat=".0%", range=[0, 1.02])
    overall = ds.moe.hit_rate()
    fig.update_layout(title=f"expert-cache hit rate (offloaded layers): "
                            f"{'n/a' if np.isnan(overall) else f'{overall:.1%}'} overall"
                            f"{_over_fetch(ds)}",
                      showlegend=False)
    return fig


def _over_fetch(ds: xr.Dataset) -> str:
    """What the hit rate cost in transfers: loads per access and, for a prefetching run, the
    share of the loads prefetched and evicted unused (from a complete run's summary)."""
    from workbench.telemetry.metadata import RunMetadata

    acc = float(ds["hits"].sum() + ds["misses"].sum()) if "hits" in ds and "misses" in ds else 0
    if not acc or "loads" not in ds:
        return ""
    text = f" · {float(ds['loads'].sum()) / acc:.2f} loads per access"
    summary = RunMetadata.from_attrs(ds.attrs, strict=False).summary or {}
    red, loads = summary.get("redundant_prefetches"), summary.get("loads")
    if isinstance(red, int) and isinstance(loads, int) and loads > 0 and \
            summary.get("prefetches"):
        text += f", {red / loads:.0%} prefetched and evicted unused"
    return text


def latency_figure(ds: xr.Dataset) -> go.Figure:
    """Per-step latency in ms: measured (left axis) and modeled (right axis) traces.

    The two clocks differ by orders of magnitude when the model runs on a CPU but is priced on
    a GPU profile, so each gets its own y axis, and each axis says which clock it shows.
    """
    step = ds["step"].values
    phase_names = list(ds.attrs.get("phase_names", ("prefill", "decode")))
    phase = [phase_names[int(p)] for p in np.asarray(ds["phase"].values)]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for var, label, secondary, dash in (("latency_measured_s", "measured", False, "solid"),
                                        ("latency_modeled_s", "modeled", True, "dot")):
        fig.add_trace(go.Scatter(
            x=step, y=np.asarray(ds[var].values) * 1e3, customdata=phase, mode="lines+markers",
            name=f"step latency, {label} (ms)", line={"dash": dash},
            hovertemplate=f"step %{{x}} (%{{customdata}}): %{{y:.3f}} ms {label}<extra></extra>"),
            secondary_y=secondary)
    fig.update_xaxes(title_text="step (0 = prefill)", **integer_ticks(step))
    # axis titles short enough for the plot's height: a longer one ran past the plot into the
    # top margin, under the plot's toolbar (the profile is the legend's, once)
    fig.update_yaxes(title_text="measured (ms)", secondary_y=False, rangemode="tozero")
    prof = ds.attrs.get("hardware_profile")
    fig.update_yaxes(title_text="modeled (ms)", secondary_y=True, rangemode="tozero")
    if prof:
        fig.data[1].name = f"step latency, modeled on {prof} (ms)"
    fig.update_layout(title="per-step latency: measured vs modeled",
                      legend={"orientation": "h", "y": -0.2})
    return fig


def timeline_figure(ds: xr.Dataset, clock: str = "modeled", steps: Any = None) -> go.Figure:
    """Gantt chart of the ``span_*`` intervals of one clock: lanes compute / transfer / stall
    (/ host, when hybrid mode ran experts on the host) on the y axis, one colour per lane, time in ms on the x axis.

    ``steps`` (an int, a list of ints or an inclusive ``slice``) keeps the spans of those steps.
    """
    if clock not in CLOCKS:
        raise InputError(f"clock must be one of {', '.join(map(repr, CLOCKS))}, not {clock!r}")
    code = CLOCKS.index(clock)
    sc = np.asarray(ds["span_clock"].values)
    st = np.asarray(ds["span_step"].values)
    keep = sc == code
    if steps is not None:
        if isinstance(steps, slice):
            lo = -np.inf if steps.start is None else steps.start
            hi = np.inf if steps.stop is None else steps.stop
            keep &= (st >= lo) & (st <= hi)
        elif isinstance(steps, (int, np.integer)) and not isinstance(steps, bool):
            keep &= st == steps
        elif isinstance(steps, (list, tuple, np.ndarray)):
            keep &= np.isin(st, np.asarray(steps))
        else:
            raise InputError(f"steps must be None, an int, a list of ints or a slice of steps, "
                             f"not {steps!r}")
    lane = np.asarray(ds["span_lane"].values)[keep]
    start = np.asarray(ds["span_start_s"].values)[keep] * 1e3
    dur = np.asarray(ds["span_end_s"].values)[keep] * 1e3 - start
    info = np.stack([st[keep], np.asarray(ds["span_layer"].values)[keep],
                     np.asarray(ds["span_expert"].values)[keep]], axis=-1)
    # the host lane only where hybrid mode used it
    lane_names = [n for i, n in enumerate(ds.attrs.get("lane_names", LANES))
                  if n != "host" or (lane == i).any()]
    all_names = list(ds.attrs.get("lane_names", LANES))
    fig = go.Figure()
    for name in lane_names:
        m = lane == all_names.index(name)
        fig.add_trace(go.Bar(
            orientation="h", base=start[m], x=dur[m], y=np.full(int(m.sum()), name),
            customdata=info[m], name=f"{name} ({clock})",
            marker={"color": LANE_COLORS.get(name), "line": {"width": 0}},
            hovertemplate=(f"{name}, {clock}<br>step %{{customdata[0]}} · layer "
                           "%{customdata[1]} · expert %{customdata[2]}<br>"
                           "start %{base:.4f} ms · %{x:.4f} ms<extra></extra>")))
    fig.update_layout(
        title=f"timeline, {clock} clock" + (f" ({_steps_label(steps)})" if steps is not None else ""),
        barmode="overlay", bargap=0.3,
        xaxis_title=f"time since run start, {clock} (ms)", yaxis_title="lane",
        yaxis={"categoryorder": "array", "categoryarray": lane_names, "autorange": "reversed"})
    return fig


def _steps_label(steps: Any) -> str:
    """``steps`` as a reader says it: "step 3", "steps 0-1", "steps from 4", "steps 1, 5"."""
    if isinstance(steps, slice):
        lo, hi = steps.start, steps.stop
        if lo is None and hi is None:
            return "every step"
        if hi is None:
            return f"steps from {lo}"
        return f"steps {0 if lo is None else lo}-{hi}"
    if isinstance(steps, (list, tuple, np.ndarray)):
        return "steps " + ", ".join(str(int(s)) for s in steps)
    return f"step {int(steps)}"


def integer_ticks(values: Any, most: int = 12) -> dict[str, Any]:
    """Plotly axis settings that put ticks on whole numbers only (steps and layers are counts:
    a two-step run must not read 0, 0.5, 1), at most about ``most`` of them."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {}
    lo, hi = float(v.min()), float(v.max())
    return {"tickmode": "linear", "tick0": int(np.floor(lo)),
            "dtick": max(1, int(np.ceil((hi - lo) / most)))}
