"""VisMMOE reproduced in kind (issue 5 §4): the studies behind
``notebooks/02_visual_expert_affinity.ipynb`` and ``benchmarks/bench_vismmoe.py``.

Every study runs the real embedded Qwen3-VL-MoE (12 MoE layers × 64 experts, top-4) through
:class:`workbench.Runtime` and returns an xarray Dataset or a pandas DataFrame whose ``attrs``
say which numbers are **modeled** (the discrete-event clock: the run's routing priced as
Qwen3-VL-30B-A3B experts, 17.3 MB each, on the A100-40GB profile — a 12-layer slice of that
model, not the 48-layer model) and which are **measured** (counted on the real model here, or
wall time on this machine's CPU). Each is parameterised by the number of scenes, so the
notebook runs small and the benchmark big.

- :func:`ablation_ladder` — base → +compression → +prediction & prefetch → full (seed
  Table 4).
  The stages are :data:`LADDER`, cumulative: adding a stage is one :class:`Stage` line.
- :func:`pinned_sweep` — latency vs ``pinned_layers`` under a fixed expert budget (VisMMOE Fig. 12).
- :func:`characterise_pruning` — text / raw visual / pruned visual routing statistics and
  heatmaps from run stores (VisMMOE Figs. 1, 3, 4).
- :func:`accuracy_vs_beta` — greedy answers vs the generated ground truth, per policy × β.
- :func:`hot_recall_summary` — held-out Hot Recall of the calibrated predictor vs random, at the
  paper's k and at k scaled to 64 experts (VisMMOE §4.3.2).

Scaling the paper's setting to 12 × 64 experts (decisions, also in ``docs/vismmoe.md``):

- **Expert budget**: Qwen3-VL-30B on A100-40GB gives anchors 21.6 GB + cache 14.3 GB = 35.9 GB
  to routed experts, 33.8 % of its 48 × 128 × 17.3 MB; the same share of 768 experts is
  :func:`expert_budget_slots` = 259 slots. Every configuration spends exactly that:
  ``cache_slots = 259 − 64 · pinned_layers`` (deeper anchoring costs cache, as in the paper).
- **Prefetch budget B and Hot Recall k** scale with the experts per layer: B = 20 · 64/128 = 10,
  k = 10/20/30 → 5/10/15 (the random baseline k/E then matches the paper's 7.8–23.4 %).
- **Pinned prefix**: base, +compression and +prediction keep L_semantic = 1 layer (affinity
  compression reads the prefix routing); *full* picks, inside the valid interval of VisMMOE eq. 10
  on the scaled budget (:func:`scaled_plan`), the depth with the lowest modeled latency on
  separate profiling scenes (the paper's "offline profiling").
- **Scenes**: evaluation on the image requests of the embedded model's held-out split
  (``make_split(HELDOUT_SEED, n, image_only=True)``, never trained on); predictor calibration on ``CALIB_SEED`` scenes and pinned-prefix profiling
  on ``PROFILE_SEED`` scenes (neither the training stream, the held-out split nor the demo
  scenes).

Modules (each re-exported here, so ``from workbench.analysis import vismmoe as V`` reaches every
name below as ``V.<name>``):

- :mod:`~workbench.analysis.vismmoe.config`: constants, :data:`PAPER`, :class:`Stage`,
  :data:`LADDER`, the scaling functions and each stage's knobs;
- :mod:`~workbench.analysis.vismmoe.ladder`: :func:`ablation_ladder`, :func:`ladder_table`;
- :mod:`~workbench.analysis.vismmoe.pinned`: :func:`pinned_sweep`, :func:`choose_pinned`;
- :mod:`~workbench.analysis.vismmoe.routing`: :func:`token_subset`,
  :func:`characterise_pruning`, :func:`pruning_table`, :func:`prefill_io_table`,
  :func:`chance_jaccard`;
- :mod:`~workbench.analysis.vismmoe.accuracy`: :func:`normalise_answer`,
  :func:`accuracy_vs_beta`, :func:`accuracy_table`;
- :mod:`~workbench.analysis.vismmoe.recall`: :func:`hot_recall_summary`,
  :func:`hot_recall_table`;
- :mod:`~workbench.analysis.vismmoe.costs`: :func:`modeled_costs`, :func:`timed`;
- :mod:`~workbench.analysis.vismmoe.verdicts`: :func:`findings`, :func:`findings_markdown`;
- :mod:`~workbench.analysis.vismmoe.figures`: the ``*_figure`` functions.
"""

from __future__ import annotations

from workbench.analysis.vismmoe.accuracy import accuracy_table, accuracy_vs_beta, normalise_answer
from workbench.analysis.vismmoe.config import (CALIB_SEED, LADDER, PAPER, PROFILE, PROFILE_SEED,
                                               RULE, TARGET, Stage, base_knobs, eval_seed,
                                               expert_budget_slots, ladder_configs, scaled_ks,
                                               scaled_plan, scaled_prefetch_budget, scene_scale,
                                               scenes, stage_knobs)
from workbench.analysis.vismmoe.costs import modeled_costs, timed
from workbench.analysis.vismmoe.figures import (heatmaps_figure, ladder_figure, per_layer_figure,
                                                sweep_figure)
from workbench.analysis.vismmoe.verdicts import findings, findings_markdown, scale_findings
from workbench.analysis.vismmoe.ladder import ablation_ladder, ladder_table
from workbench.analysis.vismmoe.pinned import choose_pinned, pinned_sweep
from workbench.analysis.vismmoe.recall import hot_recall_summary, hot_recall_table
from workbench.analysis.vismmoe.routing import (chance_jaccard, characterise_pruning,
                                                prefill_io_table, pruning_table, token_subset)

__all__ = [
    "Stage", "LADDER", "RULE", "PAPER", "TARGET", "PROFILE", "CALIB_SEED", "PROFILE_SEED",
    "eval_seed",
    "scenes", "scene_scale", "scale_findings", "expert_budget_slots", "scaled_prefetch_budget", "scaled_ks", "scaled_plan",
    "base_knobs", "ladder_configs", "stage_knobs", "ablation_ladder", "ladder_table", "pinned_sweep",
    "choose_pinned", "token_subset", "characterise_pruning", "pruning_table",
    "accuracy_vs_beta", "accuracy_table", "normalise_answer", "hot_recall_summary",
    "hot_recall_table", "findings", "findings_markdown", "chance_jaccard",
    "prefill_io_table", "heatmaps_figure", "per_layer_figure", "ladder_figure", "sweep_figure",
    "timed", "modeled_costs",
]
