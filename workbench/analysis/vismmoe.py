"""VisMMOE reproduced in kind (issue 5 §4): the studies behind
``notebooks/02_visual_expert_affinity.ipynb`` and ``benchmarks/bench_vismmoe.py``.

Every study runs the real embedded Qwen3-VL-MoE (8 MoE layers × 32 experts, top-4) through
:class:`workbench.Runtime` and returns an xarray Dataset or a pandas DataFrame whose ``attrs``
say which numbers are **modeled** (the discrete-event clock: the run's routing priced as
Qwen3-VL-30B-A3B experts, 17.3 MB each, on the A100-40GB profile — an 8-layer slice of that
model, not the 48-layer model) and which are **measured** (counted on the real model here, or
wall time on this machine's CPU). Each is parameterised by the number of scenes, so the
notebook runs small and the benchmark big.

- :func:`ablation_ladder` — base → +compression → +prediction & prefetch → full (seed
  Table 4).
  The stages are :data:`LADDER`, cumulative: adding a stage is one :class:`Stage` line.
- :func:`pinned_sweep` — latency vs ``pinned_layers`` under a fixed expert budget (seed Fig. 12).
- :func:`characterise_pruning` — text / raw visual / pruned visual routing statistics and
  heatmaps from run stores (seed Figs. 1, 3, 4).
- :func:`accuracy_vs_beta` — greedy answers vs the generated ground truth, per policy × β.
- :func:`hot_recall_summary` — held-out Hot Recall of the calibrated predictor vs random, at the
  paper's k and at k scaled to 32 experts (seed §4.3.2).

Scaling the paper's setting to 8 × 32 experts (decisions, also in ``docs/vismmoe.md``):

- **Expert budget**: Qwen3-VL-30B on A100-40GB gives anchors 21.6 GB + cache 14.3 GB = 35.9 GB
  to routed experts, 33.8 % of its 48 × 128 × 17.3 MB; the same share of 256 experts is
  :func:`expert_budget_slots` = 86 slots. Every configuration spends exactly that:
  ``cache_slots = 86 − 32 · pinned_layers`` (deeper anchoring costs cache, as in the paper).
- **Prefetch budget B and Hot Recall k** scale with the experts per layer: B = 20 · 32/128 = 5,
  k = 10/20/30 → 3/5/8 (the random baseline k/E then matches the paper's 7.8–23.4 %).
- **Pinned prefix**: base, +compression and +prediction keep L_semantic = 1 layer (affinity
  compression reads the prefix routing); *full* picks, inside the valid interval of seed eq. 10
  on the scaled budget (:func:`scaled_plan`), the depth with the lowest modeled latency on
  separate profiling scenes (the paper's "offline profiling").
- **Scenes**: evaluation on the embedded model's held-out split (``make_split(HELDOUT_SEED, n)``,
  never trained on); predictor calibration on ``CALIB_SEED`` scenes and pinned-prefix profiling
  on ``PROFILE_SEED`` scenes (neither the training stream, the held-out split nor the demo
  scenes).
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import xarray as xr

import workbench.analysis.accessor  # noqa: F401  (registers ds.moe)
from workbench.errors import InputError
from workbench.runtime.plan import MemoryPlan
from workbench.runtime.profiles import get_target_model

__all__ = [
    "Stage", "LADDER", "RULE", "PAPER", "TARGET", "PROFILE", "CALIB_SEED", "PROFILE_SEED",
    "eval_seed",
    "scenes", "expert_budget_slots", "scaled_prefetch_budget", "scaled_ks", "scaled_plan",
    "base_knobs", "ladder_configs", "stage_knobs", "ablation_ladder", "ladder_table", "pinned_sweep",
    "choose_pinned", "token_subset", "characterise_pruning", "pruning_table",
    "accuracy_vs_beta", "accuracy_table", "normalise_answer", "hot_recall_summary",
    "hot_recall_table", "findings", "findings_markdown", "chance_jaccard",
    "prefill_io_table", "heatmaps_figure", "per_layer_figure", "ladder_figure", "sweep_figure",
    "timed", "modeled_costs",
]

TARGET = "qwen3-vl-30b-a3b"
PROFILE = "a100-40gb"
CALIB_SEED = 1
"""Scenes for predictor calibration: not the model's training stream (seed 0), not its
held-out split, not the demo scenes (``training_log.json`` ``seeds``)."""
PROFILE_SEED = 2
"""Scenes on which *full* profiles its pinned prefix (seen neither by the model nor by the
predictor)."""

#: What the paper reports (seed 000, VisMMOE; SPEC §1), for side-by-side tables.
PAPER: dict[str, Any] = {
    "anchor_bytes": 21.6e9, "cache_bytes": 14.3e9, "backbone_bytes": 4.1e9,
    "prefetch_budget": 20, "num_experts": 128, "hot_recall_ks": (10, 20, 30),
    "hot_recall": {10: 0.641, 20: 0.819, 30: 0.898},
    "hot_recall_random": {10: 0.078, 20: 0.156, 30: 0.234},
    "hot_recall_x_random": (3.8, 8.2),
    "ladder_s": {"base": 13.17, "+compression": 11.55, "+prediction & prefetch": 7.72,
                 "full": 4.91},
    "pinned_optimum": (8, 12),
}

RULE = "valid-interval"
"""Stage value of ``pinned_layers`` meaning: the depth chosen in the valid interval
(:func:`choose_pinned`), resolved when the ladder runs."""


@dataclass(frozen=True)
class Stage:
    """One rung of the ablation ladder: ``knobs`` are set on top of every earlier stage's."""

    name: str
    adds: str
    knobs: Mapping[str, Any] = field(default_factory=dict)


#: The ablation ladder (seed Table 4), cumulative; a new rung is one line. The paper's table
#: ends at "full"; "full + hybrid" adds the GPU–CPU hybrid mode it describes as an option.
LADDER: tuple[Stage, ...] = (
    Stage("base", "experts offloaded and loaded on demand, LRU eviction, no compression, "
                  "1 pinned layer"),
    Stage("+compression", "affinity-aware visual-token compression, β = 0.5, λ = 2, α = 0.1",
          {"compression": "affinity", "beta": 0.5, "lam": 2.0, "alpha": 0.1}),
    Stage("+prediction & prefetch", "calibrated lookahead predictor, prefetch = vismmoe "
                                    "(W = 5, γ = 0.8, B scaled to 32 experts)",
          {"predictor": "vismmoe", "prefetch": "vismmoe"}),
    Stage("full", "slab eviction (Required / Speculative / Expired) and the pinned prefix "
                  "chosen in the valid interval", {"eviction": "slab", "pinned_layers": RULE}),
    Stage("full + hybrid", "GPU–CPU hybrid mode: a miss runs on the host copy when that ends "
                           "sooner (modeled)", {"hybrid": True}),
)


# -- scaling ---------------------------------------------------------------------------------
def eval_seed() -> int:
    """The embedded model's held-out split seed (``HELDOUT_SEED``): never used for training."""
    from workbench.models.embedded.train import HELDOUT_SEED

    return int(HELDOUT_SEED)


def scenes(seed: int, n: int) -> list[tuple[Any, str, str]]:
    """``n`` generated (image, question, answer) triples of ``seed``
    (:func:`workbench.models.embedded.scenes.make_split`)."""
    from workbench.models.embedded.scenes import make_split

    if n < 1:
        raise InputError(f"n must be at least 1 scene, not {n}")
    return make_split(int(seed), int(n))


def expert_budget_slots(num_layers: int, num_experts: int) -> int:
    """Routed-expert slots of a model with ``num_layers × num_experts`` experts that hold the
    same share of its experts as the paper's A100-40GB setting gives Qwen3-VL-30B-A3B (anchors
    + cache = 35.9 GB of 48 × 128 × 17.3 MB = 33.8 %), rounded down: 86 for 8 × 32."""
    t = get_target_model(TARGET)
    share = (PAPER["anchor_bytes"] + PAPER["cache_bytes"]) / (
        t.num_layers * t.num_experts * t.expert_bytes)
    return int(math.floor(share * num_layers * num_experts))


def scaled_prefetch_budget(num_experts: int) -> int:
    """The paper's B = 20 of 128 experts, as the same share of ``num_experts`` (≥ 1): 5 of 32."""
    return max(1, int(round(PAPER["prefetch_budget"] * num_experts / PAPER["num_experts"])))


def scaled_ks(num_experts: int) -> tuple[int, ...]:
    """The paper's Hot Recall k = 10/20/30 of 128 experts as the same share of
    ``num_experts``, rounded up: 3/5/8 of 32."""
    return tuple(max(1, math.ceil(k * num_experts / PAPER["num_experts"]))
                 for k in PAPER["hot_recall_ks"])


def scaled_plan(layout, budget_slots: int, pinned_layers: int, *, semantic_layers: int = 1,
                reserve_slots: int | None = None) -> MemoryPlan:
    """The memory plan of the embedded model under an expert budget of ``budget_slots``
    experts (device budget = backbone + budget), so that :attr:`MemoryPlan.valid_interval`
    applies seed eq. 10 on the scaled budget: ``L_semantic ≤ L ≤ ⌊(M_avail − C_safe) /
    S_layer⌋`` with C_safe = ``reserve_slots`` (default: top-k) experts."""
    eb = float(layout.expert_bytes)
    pinned = int(pinned_layers)
    return MemoryPlan(
        label=f"scaled plan ({budget_slots} expert slots)", num_layers=layout.num_layers,
        num_experts=layout.num_experts, pinned_layers=pinned,
        slots=max(0, budget_slots - pinned * layout.num_experts), expert_bytes=eb,
        backbone_bytes=float(layout.backbone_bytes),
        budget_bytes=float(layout.backbone_bytes) + budget_slots * eb,
        semantic_layers=semantic_layers,
        reserve_slots=layout.top_k if reserve_slots is None else int(reserve_slots))


def _cache_slots(layout, budget_slots: int, pinned: int) -> int:
    return int(budget_slots - pinned * layout.num_experts)


# -- ladder ----------------------------------------------------------------------------------
def base_knobs(max_new_tokens: int = 16) -> dict[str, Any]:
    """Knobs every study starts from: the modeled clock prices Qwen3-VL-30B-A3B experts on the
    A100-40GB profile; greedy decoding of exactly ``max_new_tokens`` (``ignore_eos``: every
    configuration decodes the same number of steps); router-lookahead recording off (no stage
    uses it, so the measured clock does not pay for it)."""
    return dict(target_model=TARGET, profile=PROFILE, max_new_tokens=int(max_new_tokens),
                ignore_eos=True, lookahead_depth=0, eviction="lru", prefetch="none",
                compression="none", predictor="none", pinned_layers=1)


def ladder_configs(layout, *, stages: Sequence[Stage] = LADDER, budget_slots: int,
                   pinned_full: int, predictor_path: str | Path | None = None,
                   max_new_tokens: int = 16) -> list[tuple[Stage, dict[str, Any]]]:
    """Each stage with its complete knobs (cumulative). ``pinned_layers`` = :data:`RULE`
    becomes ``pinned_full``; ``cache_slots`` is always the rest of the expert budget
    (``budget_slots − E · pinned_layers``); the predictor stages get ``predictor_path`` and the
    scaled prefetch budget B."""
    knobs = base_knobs(max_new_tokens)
    out = []
    for st in stages:
        knobs = {**knobs, **st.knobs}
        k = dict(knobs)
        if k.get("pinned_layers") == RULE:
            k["pinned_layers"] = int(pinned_full)
        k["cache_slots"] = _cache_slots(layout, budget_slots, k["pinned_layers"])
        if k["cache_slots"] < layout.top_k:
            raise InputError(f"stage {st.name!r}: pinned_layers={k['pinned_layers']} leaves "
                             f"{k['cache_slots']} of the {budget_slots} expert slots for the "
                             f"cache, fewer than top-k ({layout.top_k})")
        if k.get("predictor") == "vismmoe" or k.get("prefetch") == "vismmoe":
            if predictor_path is None:
                raise InputError(f"stage {st.name!r} uses the lookahead predictor: pass "
                                 f"predictor_path (a workbench calibrate --out directory)")
            k["predictor_path"] = str(predictor_path)
            k.setdefault("prefetch_budget", scaled_prefetch_budget(layout.num_experts))
        out.append((st, k))
    return out


def stage_knobs(layout, name: str, **kw: Any) -> dict[str, Any]:
    """The complete knobs of the :data:`LADDER` stage called ``name`` (``kw`` as for
    :func:`ladder_configs`)."""
    for st, k in ladder_configs(layout, **kw):
        if st.name == name:
            return k
    raise InputError(f"stage must be one of {', '.join(st.name for st in LADDER)}, "
                     f"not {name!r}")


def _first_word(text: str) -> str:
    w = normalise_answer(text).split()
    return w[0] if w else ""


def ablation_ladder(rt, requests: Sequence[tuple[Any, str, str]], *,
                    stages: Sequence[Stage] = LADDER, budget_slots: int | None = None,
                    pinned_full: int = 1, predictor_path: str | Path | None = None,
                    max_new_tokens: int = 16) -> xr.Dataset:
    """Run every stage on every request (interleaved: per request, each stage in turn, so
    drift of this machine hits all stages alike). Dataset over (stage, request):

    - modeled (Qwen3-VL-30B-A3B experts on A100-40GB): ``latency_modeled_s``,
      ``prefill_modeled_s``, ``decode_modeled_s`` (per decode token), ``stall_modeled_s``,
      ``transfer_bytes_modeled``;
    - measured here: ``latency_measured_s``, ``prefill_measured_s`` (CPU wall time),
      ``hits``, ``misses``, ``loads`` (offloaded layers), ``kept_visual``, ``visual``,
      ``correct`` (the first generated word equals the ground-truth answer).
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
            correct[s, r] = _first_word(res.text) == normalise_answer(a)
    ds = xr.Dataset({v: (("stage", "request"), x) for v, x in f.items()},
                    coords={"stage": names, "request": np.arange(R),
                            "adds": ("stage", [st.adds for st, _ in cfgs]),
                            "pinned_layers": ("stage", [k["pinned_layers"] for _, k in cfgs]),
                            "cache_slots": ("stage", [k["cache_slots"] for _, k in cfgs]),
                            "question": ("request", [q for _, q, _ in requests])})
    ds["correct"] = (("stage", "request"), correct)
    ds.attrs = {
        "study": "ablation ladder (seed VisMMOE Table 4)",
        "modeled": "latency_modeled_s, prefill_modeled_s, decode_modeled_s, stall_modeled_s, "
                   "transfer_bytes_modeled: the embedded model's routing (8 MoE layers) priced "
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


# -- pinned prefix ---------------------------------------------------------------------------
def pinned_sweep(rt, requests: Sequence[tuple[Any, str, str]], *,
                 knobs: Mapping[str, Any] | None = None,
                 budgets: Iterable[int] | None = None, pinned: Iterable[int] | None = None,
                 semantic_layers: int = 1, predictor_path: str | Path | None = None,
                 max_new_tokens: int = 16) -> pd.DataFrame:
    """Latency vs ``pinned_layers`` at fixed expert budgets (seed Fig. 12). For each budget
    (default: :func:`expert_budget_slots`) every depth in ``pinned`` (default: its valid
    interval, :func:`scaled_plan`) runs with ``cache_slots = budget − E · depth`` and
    ``knobs`` (default: the *full* stage of :data:`LADDER`). Depths outside the interval are
    listed with ``valid=False`` and not run. One row per (budget, depth): means over the
    requests (modeled latency parts, hit rate, loads) and the median measured latency."""
    lay = rt.lm.layout
    budgets = [expert_budget_slots(lay.num_layers, lay.num_experts)] if budgets is None \
        else [int(b) for b in budgets]
    if knobs is None:
        knobs = stage_knobs(lay, "full", budget_slots=budgets[0], pinned_full=semantic_layers,
                            predictor_path=predictor_path, max_new_tokens=max_new_tokens)
    rows = []
    for b in budgets:
        lo, hi = scaled_plan(lay, b, 0, semantic_layers=semantic_layers).valid_interval
        depths = range(lo, hi + 1) if pinned is None else pinned
        for p in depths:
            p = int(p)
            row = {"budget_slots": b, "pinned_layers": p,
                   "cache_slots": _cache_slots(lay, b, p), "valid": lo <= p <= hi}
            if row["valid"]:
                lat, pre, dec, meas, hits, misses, loads = [], [], [], [], 0, 0, []
                for img, q, _a in requests:
                    res = rt.run(q, images=[img], record=False,
                                 **{**knobs, "pinned_layers": p,
                                    "cache_slots": row["cache_slots"]})
                    lat.append(res.latency_modeled_s)
                    pre.append(res.prefill_modeled_s)
                    dec.append((res.latency_modeled_s - res.prefill_modeled_s)
                               / max(res.steps - 1, 1))
                    meas.append(res.latency_measured_s)
                    hits, misses = hits + res.hits, misses + res.misses
                    loads.append(res.loads)
                row.update(latency_modeled_ms=np.mean(lat) * 1e3,
                           prefill_modeled_ms=np.mean(pre) * 1e3,
                           decode_modeled_ms_per_token=np.mean(dec) * 1e3,
                           hit_rate=hits / max(hits + misses, 1), loads=np.mean(loads),
                           latency_measured_ms_median=np.median(meas) * 1e3)
            rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs = {"study": "latency vs pinned_layers (seed VisMMOE Fig. 12)",
                "modeled": f"latency_modeled_ms, prefill_modeled_ms, "
                           f"decode_modeled_ms_per_token ({TARGET} experts on {PROFILE})",
                "measured": "latency_measured_ms_median (CPU wall time here), hit_rate, loads",
                "requests": len(requests), "knobs": repr(dict(knobs)),
                "semantic_layers": semantic_layers}
    return df


def choose_pinned(sweep: pd.DataFrame, budget_slots: int | None = None) -> int:
    """The valid depth with the lowest mean modeled latency (ties: the shallower one, which
    leaves more cache) — the paper's offline profiling inside the valid interval."""
    d = sweep[sweep["valid"]]
    if budget_slots is not None:
        d = d[d["budget_slots"] == budget_slots]
    if d.empty:
        raise InputError("the sweep has no valid pinned depth to choose from")
    d = d.sort_values(["latency_modeled_ms", "pinned_layers"], kind="stable")
    return int(d["pinned_layers"].iloc[0])


# -- pruning characterisation ----------------------------------------------------------------
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
    """
    lay = rt.lm.layout
    budget = expert_budget_slots(lay.num_layers, lay.num_experts) if budget_slots is None \
        else int(budget_slots)
    wd = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="vismmoe-"))
    wd.mkdir(parents=True, exist_ok=True)
    knobs = {**base_knobs(1), "max_new_tokens": 1, "pinned_layers": int(pinned_layers),
             "cache_slots": _cache_slots(lay, budget, pinned_layers)}
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
        "study": "routing of text, raw visual and pruned visual tokens (seed VisMMOE Figs. 1, "
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
    (0.075 for top-4 of 32)."""
    k, E = int(k), int(num_experts)
    return float(sum(math.comb(k, i) * math.comb(E - k, k - i) / math.comb(E, k) * i / (2 * k - i)
                     for i in range(1, k + 1)))


def _layer_range(ds: xr.Dataset, layers: str) -> slice:
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
    sel = ds.isel(layer=_layer_range(ds, layers))
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
    expert loads and hits of the prefill on the offloaded layers (seed Fig. 3b). Every request
    starts with an empty cache here, so prefill hits stay 0 without prefetch."""
    t = pd.DataFrame({"prefill loads": ds["prefill_loads"].mean("request").values,
                      "prefill hits": ds["prefill_hits"].mean("request").values},
                     index=pd.Index(ds["run"].values, name="compression"))
    t.attrs = {"measured": "loads and hits counted by the live runtime",
               "cache_slots": ds.attrs["cache_slots"], "requests": ds.sizes["request"]}
    return t


# -- accuracy --------------------------------------------------------------------------------
def normalise_answer(text: str) -> str:
    """Lower case, punctuation removed, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w\s]", " ", str(text).lower()).split())


def accuracy_vs_beta(rt, examples: Sequence[tuple[Any, str, str]], *,
                     policies: Sequence[str] = ("random", "saliency", "affinity"),
                     betas: Sequence[float] = (1.0, 0.7, 0.5), pinned_layers: int = 1,
                     max_new_tokens: int = 4) -> xr.Dataset:
    """Greedy answers of the embedded model (stopping at end of sequence, at most
    ``max_new_tokens``) under each compression policy × β, and without compression; correct =
    exact match with the generated ground truth after :func:`normalise_answer`. Compression
    acts behind ``pinned_layers``; every expert of the offloaded layers fits in the cache
    (answers never depend on the cache). Dataset: ``answer``/``correct`` over (policy, beta,
    question), ``answer_none``/``correct_none`` over question, ``same_as_none`` over (policy,
    beta). Measured."""
    lay = rt.lm.layout
    knobs = {**base_knobs(max_new_tokens), "ignore_eos": False,
             "pinned_layers": int(pinned_layers),
             "cache_slots": max(lay.top_k, (lay.num_layers - pinned_layers) * lay.num_experts)}
    from workbench.models.embedded.scenes import question_kind

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


# -- Hot Recall ------------------------------------------------------------------------------
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
    ds.attrs = {"study": "held-out Hot Recall of the lookahead predictor (seed VisMMOE §4.3.2)",
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


# -- the modeled clock's proportions ------------------------------------------------------------
def modeled_costs(top_k: int, prompt_tokens: int, prefill_experts_per_layer: float
                  ) -> pd.DataFrame:
    """What the modeled clock charges per MoE layer (:data:`TARGET` on :data:`PROFILE`): the
    compute of a decode step (1 token, ``top_k`` experts) and of a prefill (``prompt_tokens``
    spread over ``prefill_experts_per_layer`` experts), against copying one expert and against
    copying all of them (the layer's demand on a cold cache). Modeled."""
    from workbench.runtime.clocks import CostSpec
    from workbench.runtime.profiles import get_profile

    p = get_profile(PROFILE)
    c = CostSpec.from_target(get_target_model(TARGET))
    one = p.transfer_time(c.expert_bytes)
    rows = {}
    for name, T, n in (("decode step", 1, top_k),
                       ("prefill", int(prompt_tokens), float(prefill_experts_per_layer))):
        dense = p.compute_time(T * c.dense_flops_per_token_per_layer, c.dense_bytes_per_layer)
        per = T * top_k / max(n, 1e-9)
        experts = n * p.compute_time(per * c.expert_flops_per_token, c.expert_bytes)
        rows[name] = {"tokens": T, "experts / layer": n,
                      "compute ms / layer": (dense + experts) * 1e3,
                      "one expert copy ms": one * 1e3,
                      "copying the layer's experts ms": n * one * 1e3,
                      "copies / compute": n * one / (dense + experts)}
    t = pd.DataFrame(rows).T
    t.index.name = "per MoE layer"
    t.attrs = {"modeled": f"{TARGET} costs on the {PROFILE} profile"}
    return t


# -- what appears ----------------------------------------------------------------------------
def _paired(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean of ``y − x`` over paired samples and its standard error."""
    d = np.asarray(y, float) - np.asarray(x, float)
    d = d[np.isfinite(d)]
    if len(d) < 2:
        return (float(d.mean()) if len(d) else float("nan")), float("nan")
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


def _clear(diff: float, se: float, direction: int) -> bool:
    """``diff`` lies in ``direction`` (−1: down, +1: up) by more than two standard errors."""
    if not np.isfinite(diff):
        return False
    return direction * diff > 0 and (not np.isfinite(se) or abs(diff) > 2 * se)


def findings(ladder: xr.Dataset | None = None, sweep: pd.DataFrame | None = None,
             pruning: xr.Dataset | None = None, accuracy: xr.Dataset | None = None,
             recall: xr.Dataset | None = None) -> list[tuple[str, bool, str]]:
    """``(effect, appears, sentence with the numbers)`` for each effect of the paper that the
    given study results speak to. An effect *appears* when it has the paper's sign and is
    larger than two standard errors of the paired difference over requests (questions for
    accuracy); the sentences quote the numbers, so text built from them is never stale."""
    out: list[tuple[str, bool, str]] = []
    if ladder is not None:
        lat = ladder["latency_modeled_s"]
        base = float(lat.isel(stage=0).mean())
        names = [str(s) for s in ladder["stage"].values]
        paper = PAPER["ladder_s"]
        for prev, cur in zip(names, names[1:]):
            d, se = _paired(lat.sel(stage=prev).values, lat.sel(stage=cur).values)
            ref = (f"; paper {paper[prev] / paper['base']:.1%} → {paper[cur] / paper['base']:.1%}"
                   if prev in paper and cur in paper else "")
            out.append((f"{cur} lowers the modeled latency", _clear(d, se, -1),
                        f"{prev} → {cur}: {float(lat.sel(stage=prev).mean()) / base:.1%} → "
                        f"{float(lat.sel(stage=cur).mean()) / base:.1%} of base, "
                        f"{d * 1e3:+.1f} ± {se * 1e3:.1f} ms per request (modeled){ref}"))
        if "+compression" in names:
            m = ladder["latency_measured_s"]
            d, se = _paired(m.sel(stage=names[0]).values, m.sel(stage="+compression").values)
            out.append(("compression lowers the measured latency here", _clear(d, se, -1),
                        f"{names[0]} → +compression: {d * 1e3:+.1f} ± {se * 1e3:.1f} ms per "
                        f"request (measured, CPU wall time)"))
    if sweep is not None:
        v = sweep[sweep["valid"]]
        for b, d in v.groupby("budget_slots"):
            d = d.sort_values("pinned_layers")
            y = d["latency_modeled_ms"].to_numpy()
            x = d["pinned_layers"].to_numpy()
            i = int(np.argmin(y))
            u = len(y) >= 3 and 0 < i < len(y) - 1
            shape = ("U-shaped" if u else "decreasing" if np.all(np.diff(y) <= 0)
                     else "increasing" if np.all(np.diff(y) >= 0) else "irregular")
            pts = ", ".join(f"{p} → {t:.1f}" for p, t in zip(x, y))
            out.append((f"U-shaped latency vs pinned_layers at {b} expert slots", u,
                        f"valid depths {x.min()}–{x.max()} (cache {d['cache_slots'].max()}–"
                        f"{d['cache_slots'].min()} slots), modeled ms {pts}: {shape}, lowest "
                        f"at {x[i]} ({len(y)} valid point{'s' if len(y) != 1 else ''})"))
    if pruning is not None:
        after = pruning.isel(layer=_layer_range(pruning, "after-prefix"))
        conc = after["concentration"].mean("layer")
        inact = after["inactive"].mean("layer")
        sim = after["similarity_next"].mean("layer", skipna=True)
        g = [str(x) for x in pruning["group"].values]
        ct, cr = conc.sel(group="text").values, conc.sel(group="visual (raw)").values
        d, se = _paired(cr, ct)
        out.append(("text tokens route more concentrated than raw visual tokens",
                    _clear(d, se, +1),
                    f"top-{pruning.attrs['top_k']} concentration text {np.nanmean(ct):.3f} vs "
                    f"raw visual {np.nanmean(cr):.3f} ({d:+.3f} ± {se:.3f}), on "
                    f"{float(pruning['tokens'].sel(group='text').mean()):.0f} text vs "
                    f"{float(pruning['tokens'].sel(group='visual (raw)').isel(layer=0).mean()):.0f}"
                    f" visual tokens per request"))
        chance = chance_jaccard(pruning.attrs["top_k"], pruning.attrs["num_experts"])
        for name in (x for x in g if x.startswith("visual (kept")):
            dc, sc = _paired(cr, conc.sel(group=name).values)
            di, si = _paired(inact.sel(group="visual (raw)").values,
                             inact.sel(group=name).values)
            ds_, ss = _paired(sim.sel(group="visual (raw)").values, sim.sel(group=name).values)
            rel = dc / np.nanmean(cr)
            out.append((f"{name} routes more concentrated than raw visual", _clear(dc, sc, +1),
                        f"concentration {np.nanmean(cr):.3f} → "
                        f"{float(conc.sel(group=name).mean()):.3f} ({rel:+.1%}; paper Fig. 1: "
                        f"+32 %)"))
            i0 = float(inact.sel(group="visual (raw)").mean())
            out.append((f"{name} leaves more experts inactive", _clear(di, si, +1),
                        f"inactive experts per layer {i0:.1f} → "
                        f"{float(inact.sel(group=name).mean()):.1f} ({di:+.2f} ± {si:.2f}, "
                        f"{di / i0:+.1%}; paper Fig. 3b: nearly doubles)"))
            out.append((f"{name} raises inter-layer routing similarity", _clear(ds_, ss, +1),
                        f"Jaccard l→l+1 {float(sim.sel(group='visual (raw)').mean()):.3f} → "
                        f"{float(sim.sel(group=name).mean()):.3f} ({ds_:+.3f} ± {ss:.3f}); "
                        f"unrelated routing would give {chance:.3f}"))
        if {"visual (kept: affinity)", "visual (kept: random)"} <= set(g):
            for what, arr, sign in (("concentration", conc, +1), ("inactive experts", inact, +1)):
                d, se = _paired(arr.sel(group="visual (kept: random)").values,
                                arr.sel(group="visual (kept: affinity)").values)
                va = float(arr.sel(group="visual (kept: affinity)").mean())
                vr = float(arr.sel(group="visual (kept: random)").mean())
                out.append((f"affinity keeps a set with higher {what} than random at equal β",
                            _clear(d, se, sign),
                            f"{what}: affinity {va:.3f} vs random {vr:.3f} ({d:+.3f} ± "
                            f"{se:.3f}, layers behind the prefix)"))
    if accuracy is not None:
        none = accuracy["correct_none"].values.astype(float)
        betas = [float(b) for b in accuracy["beta"].values if float(b) != 1.0]
        nq = accuracy.sizes["question"]
        for pol in accuracy["policy"].values:
            parts, loss = [], False
            for b in betas:
                c = accuracy["correct"].sel(policy=pol, beta=b).values.astype(float)
                d, se = _paired(none, c)
                parts.append(f"β {b:g}: {c.mean():.1%} ({d * 100:+.1f} ± {se * 100:.1f} "
                             f"points)")
                loss = loss or _clear(d, se, -1)
            out.append((f"{pol} compression costs no measurable accuracy", not loss,
                        f"no compression {none.mean():.1%}; " + "; ".join(parts)
                        + f" ({nq} questions)"))
        pols = [str(p) for p in accuracy["policy"].values]
        if {"affinity", "random"} <= set(pols):
            for b in betas:
                ca = accuracy["correct"].sel(policy="affinity", beta=b).values.astype(float)
                cr = accuracy["correct"].sel(policy="random", beta=b).values.astype(float)
                d, se = _paired(cr, ca)
                out.append((f"affinity is more accurate than random at β = {b:g}",
                            _clear(d, se, +1),
                            f"affinity {ca.mean():.1%} vs random {cr.mean():.1%} "
                            f"({d * 100:+.1f} ± {se * 100:.1f} points, {nq} questions)"))
    if recall is not None:
        lo, hi = PAPER["hot_recall_x_random"]
        p = recall.sel(variant="predictor")
        a = recall.sel(variant="without h^(v)")
        for k in recall["k"].values[recall["scaled"].values]:
            k = int(k)
            x, xm = float(p["x_random"].sel(k=k)), float(p["x_random_max"].sel(k=k))
            out.append((f"Hot Recall@{k} is {lo}–{hi}× random", lo <= x <= hi,
                        f"@{k} ({k / recall.attrs['num_experts']:.1%} of the experts): "
                        f"{float(p['hot_recall'].sel(k=k)):.1%} vs random "
                        f"{float(p['random'].sel(k=k)):.1%} = {x:.2f}× (a perfect predictor: "
                        f"{xm:.2f}×)"))
            hv, nv = float(p["hot_recall"].sel(k=k)), float(a["hot_recall"].sel(k=k))
            out.append((f"the visual summary h^(v) raises Hot Recall@{k}", hv > nv + 0.005,
                        f"@{k}: {hv:.1%} with h^(v), {nv:.1%} without"))
    return out


def findings_markdown(items: Sequence[tuple[str, bool, str]]) -> str:
    """A markdown list: ✓ appears / ✗ does not appear, with the sentence."""
    return "\n".join(f"- {'✓ appears' if ok else '✗ does not appear'} — **{eff}**: {txt}"
                      for eff, ok, txt in items)


# -- figures (plotly; pure: results in, Figure out) -------------------------------------------
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


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``(fn(*args, **kwargs), seconds)``."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
