"""How text, raw visual and pruned visual tokens route (VisMMOE Figs. 1, 3, 4 in kind):
:func:`token_subset` cuts a run store to some tokens, :func:`characterise_pruning` measures
concentration, entropy, inactive experts and inter-layer similarity per token group,
:func:`pruning_table` and :func:`prefill_io_table` summarise it, and :func:`chance_jaccard` is the
similarity of unrelated routing. Everything here is measured."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import xarray as xr

import workbench.analysis.accessor  # noqa: F401  (registers ds.moe)
from workbench.analysis.vismmoe.config import pinned_cache_slots, base_knobs, expert_budget_slots
from workbench.errors import InputError


def token_subset(ds: xr.Dataset, mask: np.ndarray) -> xr.Dataset:
    """``ds`` cut to the tokens where ``mask`` is True, with ``routed_tokens`` recounted from
    those tokens' ``topk_ids`` (ids −1, e.g. a pruned token behind the prefix, count nowhere),
    so every ``ds.moe`` routing metric (``expert_counts``, ``concentration``, ``entropy``,
    ``inactive_experts``, ``layer_similarity``, ``heatmap``) sees only those tokens."""
    mask = np.asarray(mask, bool)
    if mask.shape != (ds.sizes["token"],):
        raise InputError(f"mask must have one entry per token ({ds.sizes['token']}), not "
                         f"shape {mask.shape}")
    sub = ds.isel(token=np.flatnonzero(mask))
    ids = np.asarray(sub["topk_ids"].transpose("token", "layer", "k").values)
    step = np.asarray(sub["token_step"].values).astype(np.int64)
    mod = np.asarray(sub["token_modality"].values).astype(np.int64)
    counts = np.zeros((ds.sizes["step"], ds.sizes["layer"], ds.sizes["expert"],
                       ds.sizes["modality"]), np.int32)
    t, l, j = np.nonzero(ids >= 0)
    np.add.at(counts, (step[t], l, ids[t, l, j].astype(np.int64), mod[t]), 1)
    sub["routed_tokens"] = (("step", "layer", "expert", "modality"), counts)
    return sub


_RAW_GROUPS = ("text", "visual (raw)")


def _group_masks(ds: xr.Dataset, policy: str) -> dict[str, np.ndarray]:
    """Prefill tokens of each group in one run store: text and all visual tokens of the
    uncompressed run; kept visual tokens of a pruned run."""
    prefill = np.asarray(ds["token_step"].values) == 0
    mod = np.asarray(ds["token_modality"].values)
    image = list(ds["modality"].values).index("image")
    if policy == "none":
        return {"text": prefill & (mod == 0), "visual (raw)": prefill & (mod == image)}
    kept = np.asarray(ds["kept"].values, bool)
    return {f"visual (kept: {policy})": prefill & (mod == image) & kept}


def characterise_pruning(rt, requests: Sequence[tuple[Any, str, str]], *,
                         policies: Sequence[str] = ("affinity", "saliency", "random"),
                         beta: float = 0.5, pinned_layers: int = 1,
                         budget_slots: int | None = None, workdir: str | Path | None = None
                         ) -> xr.Dataset:
    """Seed Figs. 1, 3, 4 in kind, from run stores of the prefill of each request: the
    uncompressed run (groups *text* and *visual (raw)*) and one run per compression policy at
    keep ratio ``beta`` (group *visual (kept: policy)*: only the kept visual tokens — the
    pruned ones are excluded on every layer). Cache: the base stage (LRU, ``pinned_layers``,
    the rest of the expert budget). Dataset:

    - per (group, request, layer): ``concentration`` (routed-token share of the top-k busiest
      experts), ``entropy`` (bits), ``inactive`` (experts with no token), ``similarity_next``
      (mean Jaccard of a token's expert sets at layers l and l+1; NaN on the last layer),
      ``tokens``;
    - per (group, layer, expert): ``counts`` summed over requests (the heatmaps);
    - per (run, request): ``prefill_loads`` and ``prefill_hits`` on the offloaded layers.

    All of it is measured (counted on the real model's routing); nothing is modeled.
    ``workdir`` keeps the run stores there (attr ``workdir``); without it they go to a
    temporary directory removed before the call returns.
    """
    if workdir is None:
        # The result is loaded into memory: the run stores are scratch, removed on return
        # (a study never leaves bytes behind that the caller did not ask to keep).
        with tempfile.TemporaryDirectory(prefix="vismmoe-") as tmp:
            out = characterise_pruning(rt, requests, policies=policies, beta=beta,
                                       pinned_layers=pinned_layers, budget_slots=budget_slots,
                                       workdir=tmp)
        out.attrs.pop("workdir")
        return out
    lay = rt.lm.layout
    budget = expert_budget_slots(lay.num_layers, lay.num_experts) if budget_slots is None \
        else int(budget_slots)
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    knobs = {**base_knobs(1), "max_new_tokens": 1, "pinned_layers": int(pinned_layers),
             "cache_slots": pinned_cache_slots(lay, budget, pinned_layers)}
    runs = ["none", *policies]
    groups = [*_RAW_GROUPS, *(f"visual (kept: {p})" for p in policies)]
    L, E, R = lay.num_layers, lay.num_experts, len(requests)
    per = {v: np.full((len(groups), R, L), np.nan) for v in
           ("concentration", "entropy", "inactive", "similarity_next", "tokens")}
    counts = np.zeros((len(groups), L, E), np.int64)
    loads = np.zeros((len(runs), R))
    hits = np.zeros((len(runs), R))
    for r, (img, q, _a) in enumerate(requests):
        for ri, pol in enumerate(runs):
            extra = {} if pol == "none" else {"compression": pol, "beta": float(beta)}
            res = rt.run(q, images=[img], store=wd / f"{pol}-{r}.zarr", overwrite=True,
                         **{**knobs, **extra})
            loads[ri, r], hits[ri, r] = res.loads, res.hits
            from workbench.telemetry.store import open_run

            ds = open_run(res.store).load()
            for name, mask in _group_masks(ds, pol).items():
                g = groups.index(name)
                sub = token_subset(ds, mask)
                c = sub.moe.expert_counts()
                counts[g] += c.values
                per["concentration"][g, r] = sub.moe.concentration().values
                per["entropy"][g, r] = sub.moe.entropy().values
                per["inactive"][g, r] = sub.moe.inactive_experts().values
                sim = sub.moe.layer_similarity().values
                per["similarity_next"][g, r, :-1] = np.diagonal(sim, 1)
                per["tokens"][g, r] = c.values.sum(1) / max(rt.lm.layout.top_k, 1)
    out = xr.Dataset({v: (("group", "request", "layer"), x) for v, x in per.items()},
                     coords={"group": groups, "request": np.arange(R), "layer": np.arange(L),
                             "expert": np.arange(E), "run": runs})
    out["counts"] = (("group", "layer", "expert"), counts)
    out["prefill_loads"] = (("run", "request"), loads)
    out["prefill_hits"] = (("run", "request"), hits)
    out.attrs = {
        "study": "routing of text, raw visual and pruned visual tokens (VisMMOE Figs. 1, "
                 "3, 4)",
        "measured": "everything: routing counted on the real model's prefill",
        "modeled": "nothing",
        "beta": float(beta), "pinned_layers": int(pinned_layers), "top_k": lay.top_k,
        "num_experts": E, "cache_slots": knobs["cache_slots"], "requests": R,
        "similarity": "mean over tokens of the Jaccard overlap of the token's top-k expert "
                      "sets at layers l and l+1 (expert ids compared by index, "
                      "ds.moe.layer_similarity)",
        "workdir": str(wd),
    }
    return out


def chance_jaccard(k: int, num_experts: int) -> float:
    """Expected Jaccard overlap of two independent uniform ``k``-subsets of ``num_experts``
    (hypergeometric): the inter-layer similarity of routing with no relation between layers
    (0.075 for top-4 of 32, 0.037 for top-4 of 64)."""
    k, E = int(k), int(num_experts)
    return float(sum(math.comb(k, i) * math.comb(E - k, k - i) / math.comb(E, k) * i / (2 * k - i)
                     for i in range(1, k + 1)))


def layer_range(ds: xr.Dataset, layers: str) -> slice:
    p = int(ds.attrs["pinned_layers"])
    ranges = {"after-prefix": slice(p, None), "prefix": slice(0, p), "all": slice(None)}
    if layers not in ranges:
        raise InputError(f"layers must be one of {', '.join(map(repr, ranges))}, not {layers!r}")
    return ranges[layers]


def pruning_table(ds: xr.Dataset, layers: str = "after-prefix") -> pd.DataFrame:
    """Per group: tokens, concentration, entropy, inactive experts and consecutive-layer
    similarity, averaged over requests and over the layers behind the pinned prefix
    (``layers="after-prefix"``, where pruning acts), the prefix layers (``"prefix"``, whose
    routing affinity scores) or every layer (``"all"``). ``attrs['chance_similarity']``: the
    similarity of unrelated routing (:func:`chance_jaccard`)."""
    sel = ds.isel(layer=layer_range(ds, layers))
    sim = sel["similarity_next"]
    with np.errstate(invalid="ignore"):
        simv = (sim.mean(("request", "layer"), skipna=True).values
                if np.isfinite(sim.values).any() else np.full(ds.sizes["group"], np.nan))
    t = pd.DataFrame({
        "tokens / request": sel["tokens"].mean(("request", "layer")).values,
        f"top-{ds.attrs['top_k']} concentration": sel["concentration"].mean(
            ("request", "layer")).values,
        "entropy (bits)": sel["entropy"].mean(("request", "layer")).values,
        f"inactive experts / layer (of {ds.attrs['num_experts']})": sel["inactive"].mean(
            ("request", "layer")).values,
        "similarity l→l+1": simv,
    }, index=pd.Index(ds["group"].values, name="tokens"))
    lay = sel["layer"].values
    t.attrs = {"measured": ds.attrs["measured"],
               "layers": f"{lay.min()}–{lay.max()}" if len(lay) else "none",
               "requests": ds.sizes["request"],
               "chance_similarity": chance_jaccard(ds.attrs["top_k"], ds.attrs["num_experts"])}
    return t


def prefill_io_table(ds: xr.Dataset) -> pd.DataFrame:
    """Per run of :func:`characterise_pruning` (no compression, each policy): mean on-demand
    expert loads and hits of the prefill on the offloaded layers (VisMMOE Fig. 3b). Every request
    starts with an empty cache here, so prefill hits stay 0 without prefetch."""
    t = pd.DataFrame({"prefill loads": ds["prefill_loads"].mean("request").values,
                      "prefill hits": ds["prefill_hits"].mean("request").values},
                     index=pd.Index(ds["run"].values, name="compression"))
    t.attrs = {"measured": "loads and hits counted by the live runtime",
               "cache_slots": ds.attrs["cache_slots"], "requests": ds.sizes["request"]}
    return t
