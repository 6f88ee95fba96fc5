"""Answer accuracy under visual-token compression: :func:`normalise_answer` (the exact-match
rule), :func:`accuracy_vs_beta` (greedy answers of the embedded model per compression policy ×
keep ratio β, and without compression) and :func:`accuracy_table`. Everything here is measured."""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np
import pandas as pd
import xarray as xr

from workbench.analysis.vismmoe.config import base_knobs


def normalise_answer(text: str) -> str:
    """Lower case, punctuation removed, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w\s]", " ", str(text).lower()).split())


def accuracy_vs_beta(rt, examples: Sequence[tuple[Any, str, str]], *,
                     policies: Sequence[str] = ("random", "saliency", "affinity"),
                     betas: Sequence[float] = (1.0, 0.7, 0.5), pinned_layers: int = 1,
                     max_new_tokens: int = 32) -> xr.Dataset:
    """Greedy answers of the embedded model (stopping at end of sequence, at most
    ``max_new_tokens``) under each compression policy × β, and without compression; correct =
    exact match with the generated ground truth after :func:`normalise_answer`. Compression
    acts behind ``pinned_layers``; every expert of the offloaded layers fits in the cache
    (answers never depend on the cache). Dataset: ``answer``/``correct`` over (policy, beta,
    question), ``answer_none``/``correct_none`` over question, ``same_as_none`` over (policy,
    beta). Measured."""
    lay = rt.lm.layout
    knobs = {**base_knobs(max_new_tokens), "pinned_layers": int(pinned_layers),
             "cache_slots": max(lay.top_k, (lay.num_layers - pinned_layers) * lay.num_experts)}
    from workbench.models.embedded.v2.tasks import question_kind

    P, B, Q = len(policies), len(betas), len(examples)
    ans = np.empty((P, B, Q), object)
    ans_none = np.empty(Q, object)
    for i, (img, q, _a) in enumerate(examples):
        ans_none[i] = normalise_answer(rt.run(q, images=[img], record=False, **knobs).text)
        for p, pol in enumerate(policies):
            for b, beta in enumerate(betas):
                res = rt.run(q, images=[img], record=False,
                             **{**knobs, "compression": pol, "beta": float(beta)})
                ans[p, b, i] = normalise_answer(res.text)
    truth = np.array([normalise_answer(a) for _, _, a in examples], object)
    ds = xr.Dataset(
        {"answer": (("policy", "beta", "question"), ans.astype(str)),
         "correct": (("policy", "beta", "question"), ans == truth[None, None]),
         "answer_none": ("question", ans_none.astype(str)),
         "correct_none": ("question", ans_none == truth)},
        coords={"policy": list(policies), "beta": [float(b) for b in betas],
                "question": np.arange(Q), "truth": ("question", truth.astype(str)),
                "kind": ("question", [question_kind(q) for _, q, _ in examples])})
    ds["same_as_none"] = (ds["answer"] == ds["answer_none"]).all("question")
    ds.attrs = {"study": "answer accuracy vs keep ratio β per compression policy (seed "
                         "VisMMOE Table 3 in kind)",
                "measured": "everything (greedy answers of the real model)", "modeled": "nothing",
                "pinned_layers": int(pinned_layers), "questions": Q,
                "max_new_tokens": int(max_new_tokens),
                "match": "exact match after normalise_answer (lower case, no punctuation)"}
    return ds


def accuracy_table(ds: xr.Dataset) -> pd.DataFrame:
    """Accuracy per policy (rows, with *none* first) and β (columns), plus the per-kind
    accuracy without compression in ``attrs['per_kind_none']``."""
    acc = ds["correct"].mean("question").to_pandas()
    acc.columns = [f"β = {b:g}" for b in acc.columns]
    none = float(ds["correct_none"].mean())
    t = pd.concat([pd.DataFrame({c: [none] for c in acc.columns}, index=["none"]), acc])
    t.index.name = "policy"
    t.attrs = {"questions": ds.sizes["question"], "measured": ds.attrs["measured"],
               "same_as_none_at_beta_1": {str(p): bool(ds["same_as_none"].sel(
                   policy=p, beta=1.0)) for p in ds["policy"].values}
               if 1.0 in ds["beta"].values else {},
               "per_kind_none": ds["correct_none"].groupby("kind").mean().to_pandas().to_dict()}
    return t
