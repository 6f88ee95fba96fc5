"""Compare several runs at once: one table row per run and overlaid per-step curves.

>>> table, fig = workbench.compare_runs(["runs/a.zarr", "runs/b.zarr", "runs/c.zarr"])  # doctest: +SKIP

The table says what differs between the runs (the knobs whose values are not the same in all
of them, and the model / request when those differ) beside the headline numbers of
``ds.moe.summary()``; times are in seconds and say *measured* or *modeled* in their names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import xarray as xr

from workbench.errors import InputError

#: headline columns of the table, in order
COLUMNS = ("hit_rate", "hits", "misses", "loads", "evictions", "latency_measured_s", "latency_modeled_s",
           "stall_modeled_s", "steps")


#: what the table and the figure read from each run (``ds.moe.summary``, ``hit_rate``)
NEEDED_DIMS = ("step", "layer")
NEEDED_VARS = ("phase", "hits", "misses", "loads", "evictions", "latency_measured_s",
               "latency_modeled_s", "stall_measured_s", "stall_modeled_s", "transfer_bytes",
               "transfer_bytes_modeled")


def _as_dataset(run: Any, i: int) -> tuple[str, xr.Dataset]:
    """Entry ``i`` of ``runs`` as (name, Dataset); :class:`InputError` naming the entry when
    it is neither a store path nor a Dataset with what a run store holds (checked here, so that
    a bad entry is not a KeyError deep in the summary)."""
    if isinstance(run, xr.Dataset):
        missing = ([f"dimension {d!r}" for d in NEEDED_DIMS if d not in run.dims]
                   + [repr(v) for v in NEEDED_VARS if v not in run.variables])
        if missing:
            raise InputError(f"compare_runs: runs[{i}] is a Dataset that is not a run store's "
                             f"(it lacks {', '.join(missing[:4])}"
                             f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}); "
                             f"give a store path or workbench.open_run(path)")
        return str(run.attrs.get("run_name") or run.attrs.get("store") or "run"), run
    if not isinstance(run, (str, os.PathLike)):
        raise InputError(f"compare_runs: runs[{i}] is a {type(run).__name__} "
                         f"({str(run)[:60]!r}); give a store path or a Dataset of "
                         f"workbench.open_run")
    from workbench.telemetry.store import open_run

    path = Path(run)
    return path.name.removesuffix(".zarr"), open_run(path)


def compare_runs(runs: Sequence[Any]) -> tuple[Any, Any]:
    """``(table, figure)`` for ``runs`` (run store paths or opened Datasets, at least one):
    ``table`` a DataFrame indexed by run name, first the knobs that differ across the runs (and
    ``model`` / ``prompt`` when they differ), then :data:`COLUMNS`; ``figure`` the hit rate per
    step of every run overlaid (offloaded layers)."""
    import pandas as pd
    import plotly.graph_objects as go

    from workbench.telemetry.metadata import RunMetadata

    if isinstance(runs, (str, Path, xr.Dataset)) or not len(runs):
        raise InputError("compare_runs takes a list of one or more runs (store paths or Datasets)")
    named = [_as_dataset(r, i) for i, r in enumerate(runs)]
    names = [n for n, _ in named]
    if len(set(names)) != len(names):  # two stores of one name in different folders
        names = [f"{n} ({i})" for i, n in enumerate(names)]
    metas = [RunMetadata.from_attrs(ds.attrs, strict=False) for _, ds in named]
    knobs = [dict(m.knob_values or {}) for m in metas]
    keys = sorted(set().union(*knobs))
    differ = [k for k in keys if k not in ("store", "flush_every")
              and len({repr(kv.get(k)) for kv in knobs}) > 1]
    rows = []
    for name, (_, ds), meta, kv in zip(names, named, metas, knobs):
        s = ds.moe.summary()
        row: dict[str, Any] = {"run": name}
        if len({m.config_hash for m in metas}) > 1:
            row["model"] = meta.model_id
        if len({(m.prompt, m.images) for m in metas}) > 1:
            row["prompt"] = meta.prompt
        row.update({k: kv.get(k) for k in differ})
        row.update({c: s[c] for c in COLUMNS})
        rows.append(row)
    table = pd.DataFrame(rows).set_index("run")
    fig = go.Figure()
    for name, (_, ds) in zip(names, named):
        by_step = ds.moe.hit_rate(by="step")
        fig.add_trace(go.Scatter(x=by_step["step"].values, y=np.asarray(by_step.values, float),
                                 mode="lines+markers", name=name,
                                 hovertemplate=f"{name} · step %{{x}}: %{{y:.1%}}<extra></extra>"))
    fig.update_layout(title=f"hit rate per step, {len(named)} runs (offloaded layers)",
                      xaxis_title="step", yaxis={"title": "hit rate", "tickformat": ".0%",
                                                 "range": [0, 1.02]})
    fig.update_xaxes(dtick=1 if max((ds.sizes.get("step", 0) for _, ds in named), default=0) <= 12 else None)
    return table, fig


__all__ = ["compare_runs", "COLUMNS"]
