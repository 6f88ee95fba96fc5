"""Figures of the lookahead predictor (issue 5): Hot Recall per MoE layer.

Pure: the DataArrays of :meth:`ds.moe.hot_recall
<workbench.analysis.accessor.MoEAccessor.hot_recall>` in, a plotly ``go.Figure`` out.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import xarray as xr

__all__ = ["hot_recall_figure", "PREDICTOR_COLOR", "RANDOM_COLOR"]

PREDICTOR_COLOR = "#2563eb"
RANDOM_COLOR = "#9ca3af"


def hot_recall_figure(recall: xr.DataArray, random: xr.DataArray,
                      oracle: xr.DataArray | None = None, title: str | None = None) -> go.Figure:
    """Grouped bars per MoE layer: the predictor's Hot Recall@k and the random baseline (both
    fractions, y in [0, 1]), with the oracle (best any k experts can do) as markers. Pinned
    layers (coordinate ``pinned``) are marked on the x axis; layers without a sample (NaN, e.g.
    the last one) have no bar. Trace names start with ``predictor``, ``random`` and ``oracle``."""
    layer = np.asarray(recall["layer"].values)
    pinned = (np.asarray(recall["pinned"].values, bool) if "pinned" in recall.coords
              else np.zeros(layer.shape, bool))
    labels = [f"{l}{' (pinned)' if p else ''}" for l, p in zip(layer, pinned)]
    k, w = recall.attrs.get("k"), recall.attrs.get("window")
    fig = go.Figure()
    samples = (np.asarray(recall["samples"].values) if "samples" in recall.coords
               else np.zeros(layer.shape, int))
    fig.add_trace(go.Bar(x=labels, y=recall.values, name=f"predictor top-{k}",
                         marker_color=PREDICTOR_COLOR, customdata=samples,
                         hovertemplate="layer %{x}: %{y:.1%} (mean of %{customdata} steps)"
                                       "<extra>predictor</extra>"))
    fig.add_trace(go.Bar(x=labels, y=random.values, name=f"random {k}",
                         marker_color=RANDOM_COLOR,
                         hovertemplate="layer %{x}: %{y:.1%}<extra>random</extra>"))
    if oracle is not None:
        fig.add_trace(go.Scatter(x=labels, y=oracle.values, name="oracle (best k)",
                                 mode="markers", marker={"symbol": "line-ew-open", "size": 22,
                                                         "color": "#111827",
                                                         "line": {"width": 2}},
                                 hovertemplate="layer %{x}: %{y:.1%}<extra>oracle</extra>"))
    fig.update_layout(
        title=title or f"Hot Recall@{k} per layer (experts of layers l+1 … l+{w})",
        barmode="group", yaxis={"title": "Hot Recall", "tickformat": ".0%", "range": [0, 1.05]},
        xaxis={"title": "MoE layer l (predictor at l)"},
        legend={"orientation": "h", "y": -0.25})
    return fig
