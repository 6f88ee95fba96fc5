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
                   baseline: tuple[str, np.ndarray] | None = None) -> go.Figure:
    """Left: each rank's mean load per (step, layer) group, stacked by modality, with the
    balanced level (every rank at the mean) dashed; a ``"dropped"`` entry (assignments a
    capacity-aware dispatch took away) is drawn hatched on top and left out of the level, a
    ``"rerouted"`` entry (assignments MACS moved away from the rank's experts, to a
    same-rank expert: they are in the load too) cross-hatched;
    ``baseline`` ``(label, per-rank load)``: another run's (the pinned A/B baseline), as
    diamonds over the bars. Right: imbalance max/mean per layer ×
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
    if baseline is not None and ranks is not None:
        label, b = baseline
        fig.add_trace(go.Scatter(x=[f"rank {r}" for r in ranks], y=np.asarray(b, float),
                                 mode="markers", name=label,
                                 marker={"symbol": "diamond", "size": 10, "color": "#111"}),
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
