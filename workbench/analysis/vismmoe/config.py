"""The fixed setting of the VisMMOE studies: the target model and hardware profile the modeled
clock prices, the seeds of the calibration and profiling scenes, what the paper reports
(:data:`PAPER`), the cumulative ablation ladder (:class:`Stage`, :data:`LADDER`, :data:`RULE`),
the scaling of the paper's budgets to 12 × 64 experts, and the complete knobs of each stage
(:func:`base_knobs`, :func:`ladder_configs`, :func:`stage_knobs`)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from workbench.errors import InputError
from workbench.knobs import Knobs
from workbench.predictor.knobs import PredictorKnobs
from workbench.sim.plan import MemoryPlan
from workbench.sim.profiles import get_target_model

TARGET = "qwen3-vl-30b-a3b"
PROFILE = "a100-40gb"
CALIB_SEED = 1
"""Scenes for predictor calibration: not the model's training stream (seed 0), not its
held-out split, not the demo scenes (``training_log.json`` ``seeds``)."""
PROFILE_SEED = 2
"""Scenes on which *full* profiles its pinned prefix (seen neither by the model nor by the
predictor)."""

#: What the paper reports (VisMMOE, docs/references.md), for side-by-side tables.
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


#: The ablation ladder (VisMMOE Table 4), cumulative; a new rung is one line. The paper's table
#: ends at "full"; "full + hybrid" adds the GPU–CPU hybrid mode it describes as an option.
LADDER: tuple[Stage, ...] = (
    Stage("base", "experts offloaded and loaded on demand, LRU eviction, no compression, "
                  "1 pinned layer"),
    Stage("+compression", "affinity-aware visual-token compression, β = 0.5, λ = 2, α = 0.1",
          {"compression": "affinity", "beta": 0.5, "lam": 2.0, "alpha": 0.1}),
    Stage("+prediction & prefetch", "calibrated lookahead predictor, prefetch = vismmoe "
                                    "(W = 5, γ = 0.8, B scaled to 64 experts)",
          {"predictor": "vismmoe", "prefetch": "vismmoe"}),
    Stage("full", "slab eviction (Required / Speculative / Expired) and the pinned prefix "
                  "chosen in the valid interval", {"eviction": "slab", "pinned_layers": RULE}),
    Stage("full + hybrid", "GPU–CPU hybrid mode: a miss runs on the host copy when that ends "
                           "sooner (modeled)", {"hybrid": True}),
)


# -- scaling ---------------------------------------------------------------------------------
def eval_seed() -> int:
    """The embedded model's held-out split seed (``HELDOUT_SEED``): never used for training."""
    from workbench.models.embedded.v2.train import HELDOUT_SEED

    return int(HELDOUT_SEED)


def scenes(seed: int, n: int, scale: int = 1) -> list[tuple[Any, str, str]]:
    """``n`` generated (image, question, answer) triples of ``seed``, every one with an image
    (:func:`workbench.models.embedded.v2.tasks.make_split` with ``image_only``: the studies are
    about visual tokens, so the text-only requests of the mixed split are left out). ``scale``
    draws the same scenes that many times larger (run them inside :func:`scene_scale`)."""
    from workbench.models.embedded.v2.tasks import make_split

    if n < 1:
        raise InputError(f"n must be at least 1 scene, not {n}")
    try:
        return make_split(int(seed), int(n), image_only=True, scale=scale)
    except ValueError as e:
        raise InputError(str(e)) from None


@contextmanager
def scene_scale(lm, scale: int = 1):
    """While inside, the embedded model ``lm``'s image processor keeps scenes drawn ``scale``
    times larger at their size (pixel budget ``(128·scale)²``: ``64·scale²`` visual tokens);
    the shipped budget comes back on exit. ``scale = 1`` changes nothing."""
    from workbench.models.embedded.v2.model import scale_image_processor

    ip = lm.image_processor if lm.image_processor is not None else lm.processor.image_processor
    old = ip.size
    try:
        scale_image_processor(ip, scale)
    except ValueError as e:
        raise InputError(str(e)) from None
    try:
        yield
    finally:
        ip.size = old


def expert_budget_slots(num_layers: int, num_experts: int) -> int:
    """Routed-expert slots of a model with ``num_layers × num_experts`` experts that hold the
    same share of its experts as the paper's A100-40GB setting gives Qwen3-VL-30B-A3B (anchors
    + cache = 35.9 GB of 48 × 128 × 17.3 MB = 33.8 %), rounded down: 259 for 12 × 64."""
    t = get_target_model(TARGET)
    share = (PAPER["anchor_bytes"] + PAPER["cache_bytes"]) / (
        t.num_layers * t.num_experts * t.expert_bytes)
    return int(math.floor(share * num_layers * num_experts))


def scaled_prefetch_budget(num_experts: int) -> int:
    """The paper's B = 20 of 128 experts, as the same share of ``num_experts`` (≥ 1): 10 of 64."""
    return max(1, int(round(PAPER["prefetch_budget"] * num_experts / PAPER["num_experts"])))


def scaled_ks(num_experts: int) -> tuple[int, ...]:
    """The paper's Hot Recall k = 10/20/30 of 128 experts as the same share of
    ``num_experts``, rounded up: 5/10/15 of 64."""
    return tuple(max(1, math.ceil(k * num_experts / PAPER["num_experts"]))
                 for k in PAPER["hot_recall_ks"])


def scaled_plan(layout, budget_slots: int, pinned_layers: int, *, semantic_layers: int = 1,
                reserve_slots: int | None = None) -> MemoryPlan:
    """The memory plan of the embedded model under an expert budget of ``budget_slots``
    experts (device budget = backbone + budget), so that :attr:`MemoryPlan.valid_interval`
    applies VisMMOE eq. 10 on the scaled budget: ``L_semantic ≤ L ≤ ⌊(M_avail − C_safe) /
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


def pinned_cache_slots(layout, budget_slots: int, pinned: int) -> int:
    return int(budget_slots - pinned * layout.num_experts)



# -- stage knobs ----------------------------------------------------------------------------
def base_knobs(max_new_tokens: int = 32) -> dict[str, Any]:
    """Knobs every study starts from: the modeled clock prices Qwen3-VL-30B-A3B experts on the
    A100-40GB profile; greedy decoding to the end of the answer, as a served request decodes
    (at most ``max_new_tokens``; the embedded model answers in 1-20 tokens, so a setting that
    changes an answer can change its decode length, which per-token decode times allow for);
    router-lookahead recording off (no stage uses it, so the measured clock does not pay for
    it)."""
    return dict(target_model=TARGET, profile=PROFILE, max_new_tokens=int(max_new_tokens),
                ignore_eos=False, lookahead_depth=0, eviction="lru", prefetch="none",
                compression="none", predictor="none", pinned_layers=1)


def ladder_configs(layout, *, stages: Sequence[Stage] = LADDER, budget_slots: int,
                   pinned_full: int, predictor_path: str | Path | None = None,
                   max_new_tokens: int = 32) -> list[tuple[Stage, dict[str, Any]]]:
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
        k["cache_slots"] = pinned_cache_slots(layout, budget_slots, k["pinned_layers"])
        if k["cache_slots"] < layout.top_k:
            raise InputError(f"stage {st.name!r}: pinned_layers={k['pinned_layers']} leaves "
                             f"{k['cache_slots']} of the {budget_slots} expert slots for the "
                             f"cache, fewer than top-k ({layout.top_k})")
        if PredictorKnobs.in_use(Knobs(**k)):  # predictor=vismmoe, or a prefetch reading it
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
