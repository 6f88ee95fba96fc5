"""Kept vs pruned visual tokens drawn over the run's image(s) (token compression, issue 5).

Pure figure builders: the Dataset of :meth:`ds.moe.visual_tokens
<workbench.analysis.accessor.MoEAccessor.visual_tokens>` (image, row, col, kept per merged visual
token) and the images in, a plotly ``go.Figure`` out. Each merged visual token covers one cell
of its image's ``rows × cols`` grid (the processor resizes the whole image onto the patch grid,
so cell (r, c) spans the fractions r/rows … (r+1)/rows of the height and c/cols … (c+1)/cols of
the width); a **kept** token's cell is outlined in green, a **pruned** one (dropped after the
pinned prefix) darkened and hatched. Coordinates are display pixels of the (down-scaled) image,
y pointing down.

Images come from the run's attrs ``images`` (paths; :func:`run_images`). An image that cannot
be opened — a run of an in-memory PIL image (recorded as ``"<PIL image>"``), a moved or deleted
file — is drawn as a grey canvas of the grid's shape with a note saying why: the cells, counts
and hover are the same, only the picture is missing.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import plotly.graph_objects as go
import xarray as xr
from plotly.subplots import make_subplots

from workbench.errors import InputError
from workbench.telemetry.metadata import attr_json

__all__ = ["token_overlay_figure", "run_images", "open_run_image", "DISPLAY_PX", "KEPT_COLOR",
           "PRUNED_COLOR"]

#: longest side of an image as drawn, in display pixels (larger images are down-scaled: the
#: figure is sent to the browser at every redraw)
DISPLAY_PX = 480
#: longest side of the grey canvas drawn when the image is unavailable, in display pixels
CANVAS_PX = 320
KEPT_COLOR = "#10b981"
PRUNED_COLOR = "rgba(17, 24, 39, 0.62)"
#: what the runtime records in attrs ``images`` for an in-memory PIL image
PIL_MARK = "<PIL image>"


def open_run_image(image: Any) -> tuple[Any, str]:
    """``(RGB PIL image, "")`` for a PIL image or a readable image file, else ``(None, why)``
    (never raises: a missing picture must not hide the overlay)."""
    from workbench.models.inputs import open_image

    if image is None or (isinstance(image, str) and image == PIL_MARK):
        return None, "the run's image was an in-memory PIL image; the store keeps no copy"
    try:
        return open_image(image if hasattr(image, "size") else Path(image)), ""
    except InputError as e:
        return None, str(e)


def run_images(attrs: dict[str, Any]) -> list[tuple[Any, str]]:
    """The run's input images from its attrs ``images`` (a JSON list of paths, read by
    :class:`~workbench.telemetry.metadata.RunMetadata`), each as :func:`open_run_image` gives
    it; none when the attribute is missing or malformed (the overlay draws canvases). Relative
    paths are taken from the working directory."""
    from workbench.telemetry.metadata import RunMetadata

    return [open_run_image(i) for i in RunMetadata.from_attrs(attrs, strict=False).images]


def _data_uri(img: Any, size: tuple[int, int]) -> str:
    buf = io.BytesIO()
    (img if img.size == size else img.resize(size)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _display_size(width: float, height: float, longest: int) -> tuple[int, int]:
    scale = min(1.0, longest / max(width, height)) if longest < max(width, height) else 1.0
    return max(1, round(width * scale)), max(1, round(height * scale))


def _polygons(x0: np.ndarray, y0: np.ndarray, x1: np.ndarray, y1: np.ndarray
              ) -> tuple[list[float | None], list[float | None]]:
    """Closed rectangles, one per cell, separated by None (one scatter trace draws them all)."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    for a, b, c, d in zip(x0, y0, x1, y1):
        xs += [a, c, c, a, a, None]
        ys += [b, b, d, d, b, None]
    return xs, ys


def token_overlay_figure(tokens: xr.Dataset, images: Sequence[tuple[Any, str]] = (),
                         title: str | None = None) -> go.Figure:
    """One panel per image: the image (or a grey canvas) with every merged visual token's cell
    outlined (kept) or darkened and hatched (pruned).

    ``tokens``: :meth:`ds.moe.visual_tokens` (its attrs ``grids``); ``images``: per image
    ``(PIL image or None, note)`` as :func:`run_images` gives them (missing entries draw a
    canvas). Traces: the image, then per panel an outline trace ``kept (n)`` and a filled trace
    ``pruned (n)``, and hover traces with ``meta = {"cells": "kept" | "pruned", "image": i}``
    whose points are the cell centres — one point per visual token, so
    ``len(trace.x)`` counts the kept / pruned tokens of that image.
    """
    grids = attr_json(tokens.attrs, "grids") or []
    n = len(grids)
    if n == 0:
        raise InputError("the run has no image, so there are no visual tokens to draw")
    image = np.asarray(tokens["image"].values)
    row, col = np.asarray(tokens["row"].values), np.asarray(tokens["col"].values)
    kept, tok = np.asarray(tokens["kept"].values, bool), np.asarray(tokens["token"].values)
    fig = make_subplots(rows=1, cols=n, horizontal_spacing=0.04,
                        subplot_titles=[f"image {i}" for i in range(n)] if n > 1 else None)
    for i, (rows, cols) in enumerate(grids):
        img, note = images[i] if i < len(images) else (None, "no image given")
        if img is not None:
            w, h = _display_size(*img.size, DISPLAY_PX)
            fig.add_trace(go.Image(source=_data_uri(img, (w, h)), x0=0.5, y0=0.5,
                                   hoverinfo="skip", name=f"image {i}"), row=1, col=i + 1)
        else:
            w, h = _display_size(cols, rows, CANVAS_PX)
            if max(w, h) < CANVAS_PX:  # a small grid: scale up to the canvas size
                w, h = _display_size(cols * CANVAS_PX, rows * CANVAS_PX, CANVAS_PX)
            fig.add_shape(type="rect", x0=0, y0=0, x1=w, y1=h, line={"width": 0},
                          fillcolor="#e5e7eb", layer="below", row=1, col=i + 1)
            fig.add_annotation(text=f"image not available: {note}", x=w / 2, y=h + 4,
                               yanchor="top", showarrow=False, font={"size": 11,
                                                                     "color": "#6b7280"},
                               row=1, col=i + 1)
        cw, ch = w / cols, h / rows
        sel = image == i
        for state, mask in (("kept", sel & kept), ("pruned", sel & ~kept)):
            r, c, t = row[mask], col[mask], tok[mask]
            inset = 0.8 if state == "kept" else 0.0
            xs, ys = _polygons(c * cw + inset, r * ch + inset, (c + 1) * cw - inset,
                               (r + 1) * ch - inset)
            style: dict[str, Any] = (
                {"mode": "lines", "line": {"color": KEPT_COLOR, "width": 1.4}}
                if state == "kept" else
                {"mode": "lines", "line": {"width": 0}, "fill": "toself",
                 "fillcolor": PRUNED_COLOR,
                 "fillpattern": {"shape": "/", "fgcolor": "rgba(255, 255, 255, 0.55)",
                                 "bgcolor": PRUNED_COLOR, "size": 7, "solidity": 0.2}})
            fig.add_trace(go.Scatter(x=xs, y=ys, name=f"{state} ({int(mask.sum())})",
                                     legendgroup=state, showlegend=i == 0, hoverinfo="skip",
                                     **style), row=1, col=i + 1)
            fig.add_trace(go.Scatter(
                x=(c + 0.5) * cw, y=(r + 0.5) * ch, mode="markers", name=state,
                legendgroup=state, showlegend=False, meta={"cells": state, "image": i},
                marker={"size": max(4.0, min(cw, ch) * 0.6), "opacity": 0},
                customdata=np.stack([t, r, c], axis=1),
                hovertemplate=f"image {i} · cell (row %{{customdata[1]}}, col "
                              f"%{{customdata[2]}}) · token %{{customdata[0]}} · "
                              f"<b>{state}</b><extra></extra>"), row=1, col=i + 1)
        xname = "x" if i == 0 else f"x{i + 1}"
        fig.update_xaxes(range=[0, w], visible=False, constrain="domain", row=1, col=i + 1)
        fig.update_yaxes(range=[h + (24 if img is None else 0), 0], visible=False,
                         scaleanchor=xname, constrain="domain", row=1, col=i + 1)
    total, k = int(kept.size), int(kept.sum())
    fig.update_layout(
        title=title or f"visual tokens: {k} of {total} kept ({k / max(total, 1):.0%}), "
                       f"{total - k} pruned",
        legend={"orientation": "h", "y": -0.02, "yanchor": "top"}, plot_bgcolor="white")
    return fig
