"""MoE-Prism figures (plotly): the operating-point curve and the QoS scheduler's serving figures.
Pure: numbers in → Figure out (the dashboard's views and notebooks add titles and context)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

#: the curves of an operating-points file, in drawing order: label, colour, dash
CURVES = {
    "prism": ("MoE-Prism: k_active of N sub-experts", "#4C78A8", "solid"),
    "top_k": ("original: top-k′ (whole experts dropped)", "#F58518", "solid"),
    "prism_random": ("MoE-Prism, random partition (control)", "#9A9A9A", "dot"),
}
#: one colour per scheduler policy (registered later: plotly's next colours)
POLICY_COLOURS = {"prism": "#4C78A8", "fifo": "#F58518", "fullbatch": "#54A24B"}
_MORE = ("#B279A2", "#E45756", "#72B7B2", "#9D755D")


def operating_points_figure(curves: Mapping[str, Sequence[Mapping[str, float]]],
                            mark: tuple[float, float, str] | None = None,
                            run_share: tuple[float, str] | None = None,
                            title: str = "operating points") -> go.Figure:
    """Accuracy vs the share of the routed experts' compute, one line per curve of ``curves``
    (``{curve: [{k, compute_share, accuracy, se}]}``, keys of :data:`CURVES`; error bars ±2 SE,
    each point labelled by its k); ``mark`` ``(share, accuracy, label)``: a star (the next
    run's k_active); ``run_share`` ``(share, label)``: a dotted vertical line (the compute the
    shown run did)."""
    fig = go.Figure()
    for key, (label, colour, dash) in CURVES.items():
        pts = curves.get(key) or []
        if not pts:
            continue
        x = [p["compute_share"] for p in pts]
        y = [p["accuracy"] for p in pts]
        k = "k′" if key == "top_k" else "k"
        fig.add_trace(go.Scatter(
            x=x, y=y, name=label, mode="lines+markers+text",
            text=[f"{k}={p['k']}" for p in pts],
            textposition="top left" if key == "prism" else "bottom right",
            textfont={"size": 10, "color": colour},
            line={"color": colour, "dash": dash}, marker={"size": 8},
            error_y={"type": "data", "array": [2 * p["se"] for p in pts], "thickness": 1,
                     "width": 3},
            hovertemplate=f"{label}<br>%{{text}}: %{{y:.1%}} of answers at %{{x:.0%}} of the "
                          f"expert compute<extra></extra>"))
    if mark is not None:
        share, acc, label = mark
        fig.add_trace(go.Scatter(x=[share], y=[acc], name=label, mode="markers",
                                 marker={"symbol": "star", "size": 18, "color": "#C0392B",
                                         "line": {"color": "white", "width": 1}},
                                 hovertemplate=f"{label}<extra></extra>"))
    if run_share is not None:
        share, label = run_share
        fig.add_vline(x=share, line={"color": "#6b7280", "dash": "dot", "width": 1.5},
                      annotation_text=label, annotation_position="bottom left",
                      annotation_font={"size": 11, "color": "#374151"})
    fig.update_xaxes(title_text="share of the routed experts' compute", tickformat=".0%",
                     range=[0, 1.08], dtick=0.25)
    # short: a longer title outgrew the plot's height and ran into the title's subtitle
    fig.update_yaxes(title_text="answers right", tickformat=".0%")
    fig.update_layout(title=title, legend={"orientation": "h", "y": -0.25})
    return fig


def policy_colour(policy: str, order: Sequence[str] = ()) -> str:
    """The colour of ``policy`` in every scheduler figure."""
    if policy in POLICY_COLOURS:
        return POLICY_COLOURS[policy]
    i = list(order).index(policy) if policy in order else 0
    return _MORE[i % len(_MORE)]


#: the latency panels of :func:`scheduler_figure`: key, title
LATENCIES = (("ttft_s", "time to first token"), ("tpot_s", "time per output token"),
             ("e2e_s", "end-to-end latency"))


def scheduler_figure(rates: Sequence[float], sweep: Mapping[str, Mapping[str, Sequence[float]]],
                     quantiles: Mapping[str, Mapping[str, np.ndarray]], rate: float,
                     slo: Mapping[str, float | None], title: str) -> go.Figure:
    """Top left: throughput (solid) and goodput (dashed) of each policy vs the arrival rate
    (``sweep[policy]["throughput_rps" | "goodput_rps"]`` over ``rates``), the chosen ``rate``
    dotted. The other panels: at ``rate``, the distribution (ECDF from ``quantiles[policy][key]``,
    the 0 … 100th percentiles) of each latency of :data:`LATENCIES` per policy, on a log axis,
    with its limit from ``slo`` (None: none) dashed in red."""
    fig = make_subplots(rows=2, cols=2, horizontal_spacing=0.09, vertical_spacing=0.2,
                        subplot_titles=("throughput and goodput vs arrival rate",
                                        *[f"{t} at {rate:.3g} req/s" for _, t in LATENCIES]))
    order = list(sweep)
    for p in order:
        c = policy_colour(p, order)
        for key, dash, what in (("throughput_rps", "solid", "throughput"),
                                ("goodput_rps", "dash", "goodput")):
            fig.add_trace(go.Scatter(
                x=list(rates), y=list(sweep[p][key]), mode="lines+markers",
                name=f"{p} {what}", legendgroup=p, line={"color": c, "dash": dash},
                marker={"size": 5},
                hovertemplate=f"{p}: %{{y:.3g}} req/s {what} at %{{x:.3g}} req/s offered"
                              f"<extra></extra>"), row=1, col=1)
    fig.add_vline(x=rate, line={"color": "#6b7280", "dash": "dot", "width": 1.5}, row=1, col=1)
    fig.update_xaxes(title_text="arrival rate (req/s)", row=1, col=1)
    fig.update_yaxes(title_text="req/s", row=1, col=1)
    share = np.linspace(0, 1, 101)
    for (key, what), (row, col) in zip(LATENCIES, ((1, 2), (2, 1), (2, 2))):
        for p in order:
            q = np.asarray(quantiles[p][key], float)
            if not np.isfinite(q).any():
                continue
            fig.add_trace(go.Scatter(
                x=q, y=share[:len(q)], mode="lines", name=f"{p} {what}", legendgroup=p,
                showlegend=False, line={"color": policy_colour(p, order), "shape": "hv"},
                hovertemplate=f"{p}: %{{y:.0%}} of requests within %{{x:.3g}} s"
                              f"<extra></extra>"), row=row, col=col)
        limit = slo.get(key)
        if limit is not None:  # a trace, not add_vline: annotations on log axes take log10(x)
            fig.add_trace(go.Scatter(
                x=[limit, limit], y=[0, 1.02], mode="lines+text", text=["", f"SLO {limit:.3g} s"],
                textposition="bottom left", textfont={"size": 10, "color": "#C0392B"},
                line={"color": "#C0392B", "dash": "dash", "width": 1}, showlegend=False,
                name=f"{what} limit",
                hovertemplate=f"SLO: {what} ≤ {limit:.3g} s<extra></extra>"),
                row=row, col=col)
        fig.update_xaxes(title_text="seconds (log)", type="log", row=row, col=col)
        fig.update_yaxes(title_text="share of requests", tickformat=".0%", range=[0, 1.02],
                         row=row, col=col)
    fig.update_layout(title=title, legend={"orientation": "h", "y": -0.18})
    return fig


__all__ = ["operating_points_figure", "scheduler_figure", "policy_colour", "CURVES",
           "LATENCIES", "POLICY_COLOURS"]
