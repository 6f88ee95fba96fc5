"""The ablation ladder (VisMMOE Table 4 in kind): :func:`ablation_ladder` runs every stage of
:data:`~workbench.analysis.vismmoe.config.LADDER` on every request, interleaved, and
:func:`ladder_table` summarises it per stage beside the paper's normalised latencies."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import xarray as xr

from workbench.analysis.vismmoe.accuracy import normalise_answer
from workbench.analysis.vismmoe.config import (LADDER, PAPER, PROFILE, TARGET, Stage,
                                               expert_budget_slots, ladder_configs)
from workbench.errors import InputError


def ablation_ladder(rt, requests: Sequence[tuple[Any, str, str]], *,
                    stages: Sequence[Stage] = LADDER, budget_slots: int | None = None,
                    pinned_full: int = 1, predictor_path: str | Path | None = None,
                    max_new_tokens: int = 32) -> xr.Dataset:
    """Run every stage on every request (interleaved: per request, each stage in turn, so
    drift of this machine hits all stages alike). Dataset over (stage, request):

    - modeled (Qwen3-VL-30B-A3B experts on A100-40GB): ``latency_modeled_s``,
      ``prefill_modeled_s``, ``decode_modeled_s`` (per decode token), ``stall_modeled_s``,
      ``transfer_bytes_modeled``;
    - measured here: ``latency_measured_s``, ``prefill_measured_s`` (CPU wall time),
      ``hits``, ``misses``, ``loads`` (offloaded layers), ``kept_visual``, ``visual``,
      ``correct`` (the generated answer equals the ground truth after ``normalise_answer``).
    """
    lay = rt.lm.layout
    budget = expert_budget_slots(lay.num_layers, lay.num_experts) if budget_slots is None \
        else int(budget_slots)
    cfgs = ladder_configs(lay, stages=stages, budget_slots=budget, pinned_full=pinned_full,
                          predictor_path=predictor_path, max_new_tokens=max_new_tokens)
    names = [st.name for st, _ in cfgs]
    if len(set(names)) != len(names):
        raise InputError(f"stage names must be unique, not {names}")
    S, R = len(cfgs), len(requests)
    f = {v: np.zeros((S, R)) for v in (
        "latency_modeled_s", "prefill_modeled_s", "decode_modeled_s", "stall_modeled_s",
        "transfer_bytes_modeled", "latency_measured_s", "prefill_measured_s", "hits",
        "misses", "loads", "kept_visual", "visual", "steps")}
    correct = np.zeros((S, R), bool)
    for r, (img, q, a) in enumerate(requests):
        for s, (_st, k) in enumerate(cfgs):
            res = rt.run(q, images=[img], record=False, **k)
            dec = max(res.steps - 1, 1)
            vals = dict(latency_modeled_s=res.latency_modeled_s,
                        prefill_modeled_s=res.prefill_modeled_s,
                        decode_modeled_s=(res.latency_modeled_s - res.prefill_modeled_s) / dec,
                        stall_modeled_s=res.stall_modeled_s,
                        transfer_bytes_modeled=res.transfer_bytes_modeled,
                        latency_measured_s=res.latency_measured_s,
                        prefill_measured_s=res.prefill_measured_s, hits=res.hits,
                        misses=res.misses, loads=res.loads,
                        kept_visual=res.kept_visual_tokens if res.visual_tokens else np.nan,
                        visual=res.visual_tokens or np.nan, steps=res.steps)
            for v, x in vals.items():
                f[v][s, r] = x
            correct[s, r] = normalise_answer(res.text) == normalise_answer(a)
    ds = xr.Dataset({v: (("stage", "request"), x) for v, x in f.items()},
                    coords={"stage": names, "request": np.arange(R),
                            "adds": ("stage", [st.adds for st, _ in cfgs]),
                            "pinned_layers": ("stage", [k["pinned_layers"] for _, k in cfgs]),
                            "cache_slots": ("stage", [k["cache_slots"] for _, k in cfgs]),
                            "question": ("request", [q for _, q, _ in requests])})
    ds["correct"] = (("stage", "request"), correct)
    ds.attrs = {
        "study": "ablation ladder (VisMMOE Table 4)",
        "modeled": "latency_modeled_s, prefill_modeled_s, decode_modeled_s, stall_modeled_s, "
                   f"transfer_bytes_modeled: the embedded model's routing ({lay.num_layers} MoE layers) priced "
                   f"as {TARGET} experts on the {PROFILE} profile",
        "measured": "latency_measured_s, prefill_measured_s (CPU wall time here); hits, "
                    "misses, loads, kept_visual, correct (counted on the real model)",
        "budget_slots": budget, "pinned_full": int(pinned_full),
        "max_new_tokens": int(max_new_tokens), "requests": R,
        "knobs": repr([k for _, k in cfgs]),
    }
    return ds


def ladder_table(ds: xr.Dataset) -> pd.DataFrame:
    """Seed Table 4 in kind: per stage, mean modeled latency (ms) and its share of base, with
    prefill and per-decode-token parts, hit rate, loads, median measured latency, accuracy."""
    m = ds.mean("request")
    base = float(m["latency_modeled_s"].isel(stage=0))
    hits, misses = ds["hits"].sum("request"), ds["misses"].sum("request")
    t = pd.DataFrame({
        "pinned": ds["pinned_layers"].values, "slots": ds["cache_slots"].values,
        "modeled ms": m["latency_modeled_s"].values * 1e3,
        "norm. (modeled)": m["latency_modeled_s"].values / base,
        "prefill ms (modeled)": m["prefill_modeled_s"].values * 1e3,
        "ms / decode token (modeled)": m["decode_modeled_s"].values * 1e3,
        "stall ms (modeled)": m["stall_modeled_s"].values * 1e3,
        "hit rate": (hits / (hits + misses)).values,
        "loads / request": m["loads"].values,
        "measured ms (median)": ds["latency_measured_s"].median("request").values * 1e3,
        "accuracy": m["correct"].values,
    }, index=pd.Index(ds["stage"].values, name="stage"))
    paper = PAPER["ladder_s"]
    pbase = paper["base"]
    t["paper norm."] = [paper[s] / pbase if s in paper else np.nan for s in t.index]
    t.attrs = {"modeled": ds.attrs["modeled"], "measured": ds.attrs["measured"],
               "requests": ds.sizes["request"]}
    return t
