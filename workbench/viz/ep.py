"""Expert-parallel load figures (plotly): Dataset-derived arrays in → Figure out."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

#: bar colours per modality (text, image, video), as the heatmap's modality filter names them
MODALITY_COLOURS = {"text": "#4C78A8", "image": "#F58518", "video": "#54A24B",
                    "dropped": "#BBBBBB", "rerouted": "#9D755D"}


def ep_load_figure(per_rank: Mapping[str, np.ndarray], imbalance: np.ndarray,
                   steps: np.ndarray, title: str,
                   baseline: tuple[str, np.ndarray] | None = None,
                   capacity: tuple[str, float] | None = None,
                   precision: tuple[str, np.ndarray] | None = None) -> go.Figure:
    """Left: each rank's mean load per (step, layer) group, stacked by modality, with the
    balanced level (every rank at the mean) dashed; a ``"dropped"`` entry (assignments a
    capacity-aware dispatch took away) is drawn hatched on top and left out of the level, a
    ``"rerouted"`` entry (assignments MACS moved away from the rank's experts, to a
    same-rank expert: they are in the load too) cross-hatched;
    ``baseline`` ``(label, per-rank load)``: another run's (the pinned A/B baseline), as
    diamonds over the bars; ``capacity`` ``(label, assignments)``: a rank's capacity under the
    run's dispatch (its experts' capacities, mean per layer step), dotted; ``precision``
    ``(low precision, share per rank)``: the share of its layer calls each rank ran in that
    precision (ReaLB), written over its bar. Right: imbalance max/mean per layer ×
    step (``imbalance`` [step, layer], NaN where nothing was routed)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.38, 0.62], horizontal_spacing=0.1,
                        subplot_titles=("load per rank (mean per layer step)",
                                        "imbalance max/mean per layer step"))
    ranks = None
    total = None
    for name, v in per_rank.items():
        v = np.asarray(v, float)
        ranks = np.arange(len(v))
        if name in ("dropped", "rerouted"):
            label = ("dropped by dispatch" if name == "dropped"
                     else "rerouted (overflow moved on the rank)")
            fig.add_trace(go.Bar(x=[f"rank {r}" for r in ranks], y=v, name=label,
                                 marker={"color": MODALITY_COLOURS[name],
                                         "pattern": {"shape": "/" if name == "dropped"
                                                     else "x"}}), row=1, col=1)
            continue
        total = v if total is None else total + v
        fig.add_trace(go.Bar(x=[f"rank {r}" for r in ranks], y=v, name=f"{name} tokens",
                             marker_color=MODALITY_COLOURS.get(name)), row=1, col=1)
    if total is not None and len(total):
        mean = float(total.mean())
        fig.add_trace(go.Scatter(x=[f"rank {r}" for r in ranks], y=[mean] * len(total),
                                 mode="lines", name="balanced (mean)",
                                 line={"dash": "dash", "color": "#333"}), row=1, col=1)
    if capacity is not None and ranks is not None:
        label, c = capacity
        fig.add_trace(go.Scatter(x=[f"rank {r}" for r in ranks], y=[float(c)] * len(ranks),
                                 mode="lines", name=label,
                                 line={"dash": "dot", "color": "#C0392B"}), row=1, col=1)
    if baseline is not None and ranks is not None:
        label, b = baseline
        fig.add_trace(go.Scatter(x=[f"rank {r}" for r in ranks], y=np.asarray(b, float),
                                 mode="markers", name=label,
                                 marker={"symbol": "diamond", "size": 10, "color": "#111"}),
                      row=1, col=1)
    if precision is not None and ranks is not None and total is not None:
        name, share = precision
        share = np.asarray(share, float)
        fig.add_trace(go.Scatter(
            x=[f"rank {r}" for r in ranks], y=total, mode="markers+text",
            text=[f"{p:.0%} {name}" for p in share], textposition="top center",
            name=f"share of layer calls in {name} (ReaLB)",
            marker={"symbol": "triangle-down", "size": 9,
                    "color": ["#C0392B" if p > 0 else "#999" for p in share]}),
            row=1, col=1)
    fig.add_trace(go.Heatmap(z=np.asarray(imbalance, float).T, x=np.asarray(steps),
                             colorscale="Reds", zmin=1.0, name="imbalance",
                             colorbar={"title": "max/mean", "x": 1.02},
                             hovertemplate="step %{x}, layer %{y}: %{z:.2f}<extra></extra>"),
                  row=1, col=2)
    fig.update_layout(barmode="stack", title=title, legend={"orientation": "h", "y": -0.2})
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_yaxes(title_text="assignments", row=1, col=1)
    fig.update_yaxes(title_text="layer", row=1, col=2)
    return fig


def ep_timeline_figure(dispatch_s: np.ndarray, compute_s: np.ndarray, combine_s: np.ndarray,
                       layers: np.ndarray, title: str, rebalance_s: float = 0.0,
                       switch_s: np.ndarray | None = None) -> go.Figure:
    """The modeled EP clock of one step as lanes (MACS Fig. 3): per MoE layer in order, the
    dispatch all-to-all, then every rank's expert compute side by side (the slowest sets the
    layer; the others wait, drawn light), then the combine. ``dispatch_s`` / ``combine_s``
    [layers], ``compute_s`` [layers, ranks], seconds (drawn in ms). ``rebalance_s``: EPLB's
    weight movement before the step (its own lane, first: the step waits for it);
    ``switch_s`` [layers]: ReaLB's online precision conversion, drawn beside the dispatch it
    overlaps (the layer's front is the longer of the two)."""
    comp = np.asarray(compute_s, float)
    L, R = comp.shape if comp.ndim == 2 else (0, 0)
    sw = np.zeros(L) if switch_s is None else np.asarray(switch_s, float)
    lanes = (["rebalance"] if rebalance_s > 0 else []) + ["dispatch"] + (
        ["conversion"] if sw.any() else []) + [f"rank {r}" for r in range(R)] + ["combine"]
    fig = go.Figure()
    t = 0.0
    parts: dict[str, list] = {"rebalance": [], "dispatch": [], "conversion": [],
                              "compute": [], "wait": [], "combine": []}
    if rebalance_s > 0:
        parts["rebalance"].append(("rebalance", t, rebalance_s * 1e3, -1))
        t += rebalance_s * 1e3
    for i in range(L):
        d, c = float(dispatch_s[i]) * 1e3, comp[i] * 1e3
        parts["dispatch"].append(("dispatch", t, d, int(layers[i])))
        if sw[i] > 0:
            parts["conversion"].append(("conversion", t, sw[i] * 1e3, int(layers[i])))
            d = max(d, sw[i] * 1e3)
        t += d
        slow = float(c.max()) if R else 0.0
        for r in range(R):
            parts["compute"].append((f"rank {r}", t, float(c[r]), int(layers[i])))
            if slow - c[r] > 0:
                parts["wait"].append((f"rank {r}", t + float(c[r]), slow - float(c[r]),
                                      int(layers[i])))
        t += slow
        m = float(combine_s[i]) * 1e3
        parts["combine"].append(("combine", t, m, int(layers[i])))
        t += m
    style = {"rebalance": ("#E45756", "EPLB rebalance (expert weights moved)"),
             "conversion": ("#72B7B2", "ReaLB precision conversion (overlaps the dispatch)"),
             "dispatch": ("#9D755D", "dispatch (all-to-all)"),
             "compute": ("#4C78A8", "expert compute"),
             "wait": ("#DDE6F0", "waiting for the slowest rank"),
             "combine": ("#B279A2", "combine (all-to-all)")}
    for name, rows in parts.items():
        if not rows:
            continue
        colour, label = style[name]
        fig.add_trace(go.Bar(
            y=[r[0] for r in rows], base=[r[1] for r in rows], x=[r[2] for r in rows],
            orientation="h", name=label, marker_color=colour,
            customdata=[r[3] for r in rows],
            hovertemplate="layer %{customdata}: %{x:.3f} ms<extra>" + label + "</extra>"))
    fig.update_layout(barmode="overlay", title=title, legend={"orientation": "h", "y": -0.25})
    fig.update_yaxes(categoryorder="array", categoryarray=lanes[::-1])
    fig.update_xaxes(title_text="modeled time in the step (ms)")
    return fig


def realb_m_figure(m: np.ndarray, ib_global: np.ndarray, low: np.ndarray, tau: float,
                   title: str) -> go.Figure:
    """ReaLB's AIMD state over iterations (seed 004 Fig. 9): M_d of every rank (``m``
    [step, rank]) as lines, the steps where IB_global > τ (``ib_global`` [step]: the
    multiplicative decrease) shaded, and the (step, rank) cells that ran in low precision
    (``low`` [step, rank]) as markers on their rank's line."""
    m = np.asarray(m, float)
    S, R = m.shape if m.ndim == 2 else (0, 0)
    steps = np.arange(S)
    fig = go.Figure()
    for s in np.nonzero(np.asarray(ib_global, float) > tau)[0]:
        fig.add_vrect(x0=s - 0.5, x1=s + 0.5, fillcolor="#F58518", opacity=0.15,
                      line_width=0, layer="below")
    for r in range(R):
        fig.add_trace(go.Scatter(x=steps, y=m[:, r], mode="lines", name=f"rank {r}",
                                 line={"shape": "hv"}))
    rows, cols = np.nonzero(np.asarray(low, bool)) if S else ((), ())
    if len(rows):
        fig.add_trace(go.Scatter(x=rows, y=m[rows, cols], mode="markers",
                                 name="rank ran in low precision",
                                 marker={"symbol": "x", "color": "#C0392B", "size": 8},
                                 customdata=cols,
                                 hovertemplate="step %{x}, rank %{customdata}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"IB_global > τ = {tau:g}",
                             marker={"symbol": "square", "color": "#F58518", "opacity": 0.3,
                                     "size": 12}))
    fig.update_layout(title=title, legend={"orientation": "h", "y": -0.25})
    fig.update_xaxes(title_text="step (iteration)")
    fig.update_yaxes(title_text="M_d (vision-ratio threshold)", range=[-0.05, 1.05])
    return fig
