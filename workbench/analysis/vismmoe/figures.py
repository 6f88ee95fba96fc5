"""Plotly figures of the study results (pure: results in, Figure out): routing heatmaps
(:func:`heatmaps_figure`), per-layer routing statistics (:func:`per_layer_figure`), the ablation
ladder beside the paper (:func:`ladder_figure`) and latency vs the pinned prefix
(:func:`sweep_figure`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import xarray as xr

from workbench.analysis.vismmoe.routing import chance_jaccard


def heatmaps_figure(ds: xr.Dataset, groups: Sequence[str] | None = None):
    """Seed Fig. 1 in kind: layer × expert share of each layer's routed tokens, one panel per
    group of :func:`characterise_pruning` (summed over its requests)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    groups = list(groups) if groups is not None else [str(g) for g in ds["group"].values]
    c = ds["counts"].sel(group=groups).astype(float)
    share = c / c.sum("expert").where(c.sum("expert") > 0)
    fig = make_subplots(rows=1, cols=len(groups), subplot_titles=groups, shared_yaxes=True,
                        horizontal_spacing=0.03)
    zmax = float(share.max())
    for i, g in enumerate(groups, start=1):
        fig.add_trace(go.Heatmap(z=share.sel(group=g).values, x=ds["expert"].values,
                                 y=ds["layer"].values, coloraxis="coloraxis",
                                 hovertemplate="layer %{y} · expert %{x}<br>%{z:.1%}"
                                               "<extra></extra>"), row=1, col=i)
        fig.update_xaxes(title_text="expert", row=1, col=i)
    fig.update_yaxes(title_text="MoE layer", autorange="reversed", row=1, col=1)
    fig.update_layout(coloraxis={"colorscale": "Viridis", "cmin": 0, "cmax": zmax,
                                 "colorbar": {"title": {"text": "share of layer"}}},
                      title=f"routed-token share per expert, prefill, {ds.sizes['request']} "
                            f"requests (measured; pinned prefix: layers 0–"
                            f"{int(ds.attrs['pinned_layers']) - 1})", height=380)
    return fig


def per_layer_figure(ds: xr.Dataset, var: str = "concentration"):
    """One line per group over MoE layers of ``var`` (mean over requests) of
    :func:`characterise_pruning`; the pinned prefix shaded."""
    import plotly.graph_objects as go

    m = ds[var].mean("request", skipna=True)
    fig = go.Figure([go.Scatter(x=ds["layer"].values, y=m.sel(group=g).values,
                                mode="lines+markers", name=str(g)) for g in ds["group"].values])
    p = int(ds.attrs["pinned_layers"])
    if p:
        fig.add_vrect(x0=-0.5, x1=p - 0.5, fillcolor="#9ca3af", opacity=0.2, line_width=0,
                      annotation_text="pinned prefix (uncompressed)")
    if var == "similarity_next":
        fig.add_hline(y=chance_jaccard(ds.attrs["top_k"], ds.attrs["num_experts"]),
                      line_dash="dot", annotation_text="unrelated routing")
    titles = {"concentration": f"top-{ds.attrs['top_k']} concentration",
              "inactive": "inactive experts", "entropy": "entropy (bits)",
              "similarity_next": "Jaccard similarity with layer l+1"}
    fig.update_layout(title=f"{titles.get(var, var)} per layer (measured, prefill)",
                      xaxis_title="MoE layer", yaxis_title=titles.get(var, var),
                      legend={"orientation": "h", "y": -0.25})
    return fig


def ladder_figure(table: pd.DataFrame):
    """Seed Table 4 in kind: modeled latency per stage as a share of base, beside the paper's."""
    import plotly.graph_objects as go

    fig = go.Figure([
        go.Bar(x=list(table.index), y=table["norm. (modeled)"], name="embedded model, modeled "
               "(Qwen3-VL-30B experts on A100-40GB)", text=[f"{v:.0%}" for v in
                                                          table["norm. (modeled)"]]),
        go.Bar(x=list(table.index), y=table["paper norm."], name="paper (Table 4, HF backend)",
               text=[f"{v:.0%}" if np.isfinite(v) else "" for v in table["paper norm."]])])
    fig.update_layout(barmode="group", yaxis_tickformat=".0%", yaxis_title="latency / base",
                      title="ablation ladder: latency relative to base",
                      legend={"orientation": "h", "y": -0.2})
    return fig


def sweep_figure(sweep: pd.DataFrame):
    """Seed Fig. 12 in kind: modeled latency vs pinned_layers, one line per expert budget."""
    import plotly.graph_objects as go

    v = sweep[sweep["valid"]]
    fig = go.Figure()
    for b, d in v.groupby("budget_slots"):
        d = d.sort_values("pinned_layers")
        fig.add_trace(go.Scatter(x=d["pinned_layers"], y=d["latency_modeled_ms"],
                                 mode="lines+markers", name=f"{b} expert slots",
                                 customdata=d["cache_slots"],
                                 hovertemplate="pinned %{x} · cache %{customdata} slots<br>"
                                               "%{y:.1f} ms modeled<extra></extra>"))
    fig.update_layout(title="latency vs pinned prefix at a fixed expert budget (modeled)",
                      xaxis_title="pinned_layers (cache = budget − 32 × pinned)",
                      yaxis_title="ms per request, modeled (A100-40GB)", xaxis_dtick=1)
    return fig
