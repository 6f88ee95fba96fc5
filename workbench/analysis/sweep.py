"""Knob sweeps on Dask distributed: every point of a grid × inputs, each its own run store.

Layout of a sweep folder ``OUT``::

    OUT/points/<id>.zarr    the run store of one point (written by the worker that ran it)
    OUT/points/<id>.json    the point's outcome: knobs, input, status, result or error
                            (written last, atomically: its presence with status "complete"
                            is what marks a point finished)
    OUT/summary.zarr        the summary Dataset, dims = the grid's knobs + input

Workers only ever write their own point's files, and only the client writes the summary, so no
two processes touch the same zarr metadata. Re-running the same sweep skips finished points; a
failed point is recorded with its error and the sweep goes on; Ctrl-C cancels what is in flight
and leaves every finished point intact.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import xarray as xr

from workbench.errors import InputError, KnobError
from workbench.knobs import Knobs

#: result fields gathered into the summary (all from :class:`RunResult`)
SUMMARY_FIELDS = ("hit_rate", "hits", "misses", "loads", "evictions", "host_runs", "steps",
                  "latency_measured_s", "latency_modeled_s", "stall_measured_s",
                  "stall_modeled_s", "transfer_bytes", "transfer_bytes_modeled")


@dataclass(frozen=True)
class SweepInput:
    """One input of a sweep: a name (summary coordinate), a prompt and image paths."""

    name: str
    prompt: str
    images: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "SweepInput":
        """``"PROMPT"`` or ``"IMAGE[,IMAGE…]|PROMPT"`` (the CLI's ``--input``)."""
        if "|" in text:
            imgs, prompt = text.split("|", 1)
            images = tuple(i.strip() for i in imgs.split(",") if i.strip())
        else:
            images, prompt = (), text
        if not prompt.strip():
            raise InputError(f"--input {text!r} has an empty prompt; use 'IMAGE|PROMPT' or 'PROMPT'")
        name = (Path(images[0]).stem + ": " if images else "") + prompt.strip()
        return cls(name=name, prompt=prompt.strip(), images=images)


def demo_inputs(n: int = 2) -> list[SweepInput]:
    """The first ``n`` bundled demo scenes with their prompts."""
    demo = Path(__file__).resolve().parents[2] / "data" / "demo"
    items = json.loads((demo / "prompts.json").read_text())[:n]
    return [SweepInput(name=f"{Path(i['image']).stem}: {i['prompt']}", prompt=i["prompt"],
                       images=(str(demo / i["image"]),)) for i in items]


def parse_grid(assignments: Iterable[str]) -> dict[str, list[Any]]:
    """``["cache_slots=8,16", "eviction=lru,lfu"]`` → typed, validated value lists."""
    from workbench.knobs import _parse

    grid: dict[str, list[Any]] = {}
    probe = Knobs()
    for a in assignments:
        if "=" not in a:
            raise KnobError(f"--grid expects NAME=V1,V2,…, not {a!r}")
        name, values = a.split("=", 1)
        name = name.strip()
        owner = probe._owner(name)
        if name in grid:
            raise KnobError(f"--grid names {name!r} twice")
        vals = [_parse(owner.param[name], name, v) for v in values.split(",") if v.strip()]
        if not vals:
            raise KnobError(f"--grid {name} has no values")
        for v in vals:
            probe.set(**{name: v})  # validates each value against the knob's bounds
        grid[name] = vals
    if not grid:
        raise KnobError("a sweep needs at least one --grid NAME=V1,V2,…")
    return grid


def point_id(knobs: dict[str, Any], inp: SweepInput) -> str:
    key = json.dumps({"knobs": knobs, "input": [inp.prompt, list(inp.images)]}, sort_keys=True)
    return "p-" + hashlib.sha256(key.encode()).hexdigest()[:12]


# -- the work of one point (runs in a Dask worker process) --------------------------------------
_MODELS: dict[tuple[str, str, str], Any] = {}


def run_point(model_dir: str | None, knobs: dict[str, Any], prompt: str, images: Sequence[str],
              store: str, meta: str, point: dict[str, Any]) -> dict[str, Any]:
    """Run one point and write its outcome file; never raises for a point's own failure."""
    import torch

    from workbench.models.loading import load
    from workbench.runtime.runtime import Runtime

    torch.set_num_threads(1)  # one worker = one core; the cluster provides the parallelism
    outcome = dict(point)
    try:
        key = (model_dir or "", knobs["dtype"], knobs["device"])
        if key not in _MODELS:
            _MODELS[key] = load(model_dir, dtype=knobs["dtype"], device=knobs["device"])
        rt = Runtime(_MODELS[key], knobs=Knobs(**knobs))
        res = rt.run(prompt, images=list(images), store=store, overwrite=True)
        outcome.update(status="complete", result=res.to_json())
    except Exception as e:  # a failed point is data, not a crash of the sweep
        outcome.update(status="failed", error=f"{type(e).__name__}: {e}")
    tmp = Path(meta).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(outcome))
    os.replace(tmp, meta)  # atomic: a point is finished exactly when this file says so
    return outcome


# -- the client side ---------------------------------------------------------------------------
def sweep(grid: dict[str, Sequence[Any]], inputs: Sequence[SweepInput] | None = None, *,
          out: str | Path, model: str | Path | None = None, knobs: Knobs | None = None,
          scheduler: str | None = None, workers: int | None = None,
          progress: bool = True) -> xr.Dataset:
    """Run every point of ``grid`` × ``inputs`` on Dask; returns the summary Dataset.

    ``scheduler`` is the address of an existing Dask scheduler; without it a LocalCluster of
    ``workers`` processes (default 2) on 127.0.0.1 is started and stopped.
    """
    from dask.distributed import Client, LocalCluster, as_completed

    base = (knobs.copy() if knobs is not None else Knobs())
    inputs = list(inputs) if inputs else demo_inputs()
    names = list(grid)
    out = Path(out)
    (out / "points").mkdir(parents=True, exist_ok=True)
    todo, done = [], {}
    for values in itertools.product(*(grid[n] for n in names)):
        k = base.copy(**dict(zip(names, values))).to_dict()
        for inp in inputs:
            pid = point_id(k, inp)
            point = {"id": pid, "grid": dict(zip(names, values)), "knobs": k,
                     "input": inp.name, "prompt": inp.prompt, "images": list(inp.images)}
            meta = out / "points" / f"{pid}.json"
            prev = json.loads(meta.read_text()) if meta.exists() else None
            if prev and prev.get("status") == "complete":
                done[pid] = prev
            else:
                todo.append((pid, point))
    model_dir = str(Path(model).resolve()) if model is not None else None
    if todo:
        cluster = None
        if scheduler is None:
            cluster = LocalCluster(n_workers=workers or 2, threads_per_worker=1, processes=True,
                                   host="127.0.0.1", dashboard_address=None)
        client = Client(scheduler or cluster)
        try:
            futures = [client.submit(
                run_point, model_dir, point["knobs"], point["prompt"], point["images"],
                str(out / "points" / f"{pid}.zarr"), str(out / "points" / f"{pid}.json"),
                point, key=f"workbench-{pid}", pure=False) for pid, point in todo]
            bar = _progress(len(futures), len(done), progress)
            try:
                for fut in as_completed(futures):
                    res = fut.result()
                    done[res["id"]] = res
                    bar.update(1)
                    bar.set_postfix_str(f"failed {sum(d['status'] != 'complete' for d in done.values())}")
            except KeyboardInterrupt:
                client.cancel(futures)
                raise
            finally:
                bar.close()
        finally:
            client.close()
            if cluster is not None:
                cluster.close()
    summary = summarize(out, grid, inputs, base)
    return summary


def _progress(total: int, already: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"sweep ({already} already done)", unit="point",
                disable=not enabled, file=sys.stderr)


def summarize(out: str | Path, grid: dict[str, Sequence[Any]], inputs: Sequence[SweepInput],
              base: Knobs | None = None) -> xr.Dataset:
    """Gather every point's outcome into ``OUT/summary.zarr`` (regenerated on each call)."""
    out = Path(out)
    base = base or Knobs()
    names = list(grid)
    shape = [len(grid[n]) for n in names] + [len(inputs)]
    dims = names + ["input"]
    data = {f: np.full(shape, np.nan) for f in SUMMARY_FIELDS}
    status = np.full(shape, "missing", dtype=object)
    error = np.full(shape, "", dtype=object)
    store = np.full(shape, "", dtype=object)
    for idx in itertools.product(*(range(n) for n in shape)):
        values = {n: grid[n][i] for n, i in zip(names, idx[:-1])}
        inp = inputs[idx[-1]]
        pid = point_id(base.copy(**values).to_dict(), inp)
        meta = out / "points" / f"{pid}.json"
        if not meta.exists():
            continue
        o = json.loads(meta.read_text())
        status[idx] = o["status"]
        error[idx] = o.get("error", "")
        if o["status"] == "complete":
            store[idx] = str(Path("points") / f"{pid}.zarr")
            for f in SUMMARY_FIELDS:
                v = o["result"].get(f)
                data[f][idx] = np.nan if v is None else v
    coords = {n: _coord(grid[n]) for n in names}
    coords["input"] = _vstr(np.array([i.name for i in inputs], dtype=object))
    ds = xr.Dataset({f: (dims, v) for f, v in data.items()}, coords=coords)
    ds["status"] = (dims, _vstr(status))
    ds["error"] = (dims, _vstr(error))
    ds["store"] = (dims, _vstr(store))
    ds.attrs.update({"grid": json.dumps({n: list(map(_jsonable, grid[n])) for n in names}),
                     "base_knobs": json.dumps(base.to_dict()),
                     "description": "one value per grid point × input; 'store' is relative to "
                                    "the sweep folder"})
    target = out / "summary.zarr"
    tmp = out / "summary.zarr.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    ds.to_zarr(tmp, mode="w-", zarr_format=3, consolidated=False)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return ds


def open_summary(out: str | Path) -> xr.Dataset:
    p = Path(out) / "summary.zarr"
    if not p.exists():
        raise InputError(f"sweep folder {str(out)!r} has no summary.zarr")
    return xr.open_zarr(p, consolidated=False, zarr_format=3).load()


def _vstr(a: np.ndarray) -> np.ndarray:
    """Variable-length strings: zarr v3's specified "string" type (fixed-width unicode is not)."""
    return a.astype(str).astype(np.dtypes.StringDType())


def _coord(values: Sequence[Any]) -> Any:
    if any(v is None for v in values) or all(isinstance(v, str) for v in values):
        return _vstr(np.array([str(v) for v in values], dtype=object))
    return list(values)


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
