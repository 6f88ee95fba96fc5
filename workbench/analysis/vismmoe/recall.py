"""Hot Recall of the lookahead predictor (VisMMOE §4.3.2 in kind): :func:`hot_recall_summary`
calibrates it as ``workbench calibrate`` does and reports held-out Hot Recall@k with and
without the visual summary h^(v), against random and oracle, and :func:`hot_recall_table` sets
it beside the paper's figures. Everything here is measured."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import xarray as xr

from workbench.analysis.vismmoe.config import PAPER, scaled_ks
from workbench.errors import InputError


def hot_recall_summary(lm, requests: Sequence[tuple[Any, str, str]], out: str | Path, *,
                       steps: int = 300, seed: int = 0, window: int = 5, decay: float = 0.8,
                       holdout: float = 0.25, max_new_tokens: int = 4,
                       ks: Sequence[int] | None = None) -> xr.Dataset:
    """Calibrate the lookahead predictor the way ``workbench calibrate`` does (same recording,
    split, training and seed: :mod:`workbench.predictor.calibrate`), save it to ``out`` (the
    ``predictor_path`` of the ladder), and report held-out Hot Recall@k of the full predictor
    and of the ablation without the visual summary h^(v), with random and oracle, at the
    paper's k and at k scaled to this model's experts (:func:`scaled_ks`). ``x_random`` is the
    ratio over random; ``x_random_max`` = oracle / random, the most any predictor can reach at
    that k. Measured (held-out requests of the real model)."""
    import torch

    from workbench.predictor.calibrate import (call_cost, dataset, evaluate, record, train)
    from workbench.predictor.model import (PredictorConfig, hot_recall, oracle_recall,
                                           random_recall, save)

    reqs = [(img, q) for img, q, *_ in requests]
    if len(reqs) < 2:
        raise InputError(f"calibration needs at least 2 requests, got {len(reqs)}")
    torch.manual_seed(seed)
    rec = record(lm, reqs, max_new_tokens)
    n = len(reqs)
    n_hold = max(1, int(round(holdout * n)))
    tr, te = list(range(n - n_hold)), list(range(n - n_hold, n))
    E = rec.num_experts
    ks = tuple(ks) if ks is not None else tuple(sorted({*PAPER["hot_recall_ks"],
                                                        *scaled_ks(E)}))
    variants = {"predictor": True, "without h^(v)": False}
    vals = {v: np.zeros((len(variants), len(ks))) for v in ("hot_recall", "random", "oracle")}
    saved = None
    report: dict[str, Any] = {}
    for vi, (name, vis) in enumerate(variants.items()):
        cfg = PredictorConfig(rec.num_layers, E, rec.hidden_size, use_visual=vis,
                              window=window, decay=decay, model_id=rec.model_id,
                              config_hash=rec.config_hash)
        Xtr, Gtr, _, _ = dataset(rec, tr, window, decay, vis)
        Xte, _, Ate, Lte = dataset(rec, te, window, decay, vis)
        pred, losses = train(cfg, Xtr, Gtr, steps, seed)
        s = pred.scores(Xte)
        for ki, k in enumerate(ks):
            vals["hot_recall"][vi, ki] = np.nanmean(hot_recall(s, Ate, k))
            vals["random"][vi, ki] = np.nanmean(random_recall(Ate, k))
            vals["oracle"][vi, ki] = np.nanmean(oracle_recall(Ate, k))
        if vis:
            saved = pred
            report = {"requests": n, "train_requests": len(tr), "heldout_requests": len(te),
                      "record_s": rec.seconds, "window": window, "decay": decay,
                      "steps": steps, "seed": seed, "train_samples": int(len(Xtr)),
                      "final_loss": losses[-1] if losses else None,
                      "heldout": evaluate(pred, Xte, Ate, Lte, rec.num_layers),
                      "cost": call_cost(pred, Xte)}
            samples = int(len(Xte))
            active = float(Ate.sum(1).mean()) if len(Ate) else 0.0
    save(saved, Path(out), report)
    ds = xr.Dataset({v: (("variant", "k"), x) for v, x in vals.items()},
                    coords={"variant": list(variants), "k": list(ks),
                            "k_share": ("k", [k / E for k in ks]),
                            "scaled": ("k", [k in scaled_ks(E) for k in ks])})
    ds["x_random"] = ds["hot_recall"] / ds["random"]
    ds["x_random_max"] = ds["oracle"] / ds["random"]
    ds.attrs = {"study": "held-out Hot Recall of the lookahead predictor (VisMMOE §4.3.2)",
                "measured": "everything (held-out requests of the real model)",
                "modeled": "nothing", "predictor_path": str(out), "requests": n,
                "heldout_requests": len(te), "heldout_samples": samples,
                "mean_active_next_layer": active, "num_experts": E,
                "definition": "share of the experts layer l+1 activates among the top-k of y_l",
                "cost_p50_s": report["cost"]["p50_s"], "cost_p99_s": report["cost"]["p99_s"]}
    return ds


def _paper_recall(k: int) -> str:
    hr, rr = PAPER["hot_recall"][k], PAPER["hot_recall_random"][k]
    return f"@{k}: {hr:.1%} vs random {rr:.1%} ({hr / rr:.1f}×)"


def hot_recall_table(ds: xr.Dataset) -> pd.DataFrame:
    """One row per k: predictor, random, × random, oracle, × random at most, without h^(v), and
    the paper's figures where the k share matches the paper's."""
    E = int(ds.attrs["num_experts"])
    p, a = ds.sel(variant="predictor"), ds.sel(variant="without h^(v)")
    paper_k = {math.ceil(k * E / PAPER["num_experts"]): k for k in PAPER["hot_recall_ks"]}
    rows = []
    for k in ds["k"].values:
        k = int(k)
        pk = paper_k.get(k) if bool(ds["scaled"].sel(k=k)) else None
        rows.append({"k": k, "share of experts": k / E,
                     "predictor": float(p["hot_recall"].sel(k=k)),
                     "random": float(p["random"].sel(k=k)),
                     "× random": float(p["x_random"].sel(k=k)),
                     "oracle": float(p["oracle"].sel(k=k)),
                     "× random at most": float(p["x_random_max"].sel(k=k)),
                     "without h^(v)": float(a["hot_recall"].sel(k=k)),
                     "paper (k of 128)": _paper_recall(pk) if pk else ""})
    t = pd.DataFrame(rows).set_index("k")
    t.attrs = {k: ds.attrs[k] for k in ("heldout_requests", "heldout_samples",
                                        "mean_active_next_layer", "measured")}
    return t
