"""The offload unit (issue 39 §2): the VisMMOE ablation ladder (Table 4 in kind) from the
paper's own base, Hugging Face accelerate's layer-wise offloading (``offload_unit=layerwise``),
and from the workbench's per-expert cache (``offload_unit=expert``), on the embedded model.

Rungs (cumulative as in ``workbench.analysis.vismmoe.LADDER``; every rung names its unit):

- base: layerwise | layerwise-prefetch | expert (pinned prefix 1, cache = budget − 64, LRU);
- +compression: layerwise | expert (affinity, β 0.5, λ 2, α 0.1);
- +prediction & prefetch: the per-expert cache with the calibrated predictor's prefetches
  (a prefetch policy needs the per-expert cache: offload_unit=expert);
- full: slab eviction, pinned prefix 1 (the valid-interval depth ``bench_vismmoe.py`` chose).

Latencies are *modeled* (the embedded model's routing priced as Qwen3-VL-30B-A3B experts on
A100-40GB), except the column marked *measured* (CPU wall time here); hits, misses, loads and
accuracy are counted on the real model. Prints markdown and the command.

    nice python benchmarks/bench_offload_unit.py [--scenes 48] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np
import torch

from workbench.analysis import vismmoe as V
from workbench.analysis.vismmoe.config import RULE, Stage

COMP = {"compression": "affinity", "beta": 0.5, "lam": 2.0, "alpha": 0.1}
STAGES = (
    Stage("base: layerwise", "accelerate's hooks: a layer's 64 experts copied in, synchronously",
          {"offload_unit": "layerwise"}),
    Stage("base: layerwise-prefetch", "the next layer copied while this one computes",
          {"offload_unit": "layerwise-prefetch"}),
    Stage("base: expert", "per-expert cache, on-demand loads, LRU", {"offload_unit": "expert"}),
    Stage("+compression: layerwise", "affinity compression on the layer-wise base",
          {"offload_unit": "layerwise", **COMP}),
    Stage("+compression: expert", "affinity compression on the per-expert cache",
          {"offload_unit": "expert"}),
    Stage("+prediction & prefetch", "predictor + vismmoe prefetch (per-expert cache)",
          {"predictor": "vismmoe", "prefetch": "vismmoe"}),
    Stage("full", "slab eviction, pinned prefix chosen (1)", {"eviction": "slab",
                                                             "pinned_layers": RULE}),
)
#: the paper's Table 4 rows each rung stands for (None: no row)
PAPER_ROW = {"base: layerwise": "base", "+compression: layerwise": "+compression",
             "+prediction & prefetch": "+prediction & prefetch", "full": "full"}
KT = {"base": 3.89, "+compression": 3.71, "+prediction & prefetch": 2.34, "full": 2.21}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenes", type=int, default=48)
    ap.add_argument("--calib-requests", type=int, default=48)
    ap.add_argument("--calib-steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--pinned-full", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench-unit-"))
    out.mkdir(parents=True, exist_ok=True)
    lm = workbench.load(None, device="cpu")
    lay = lm.layout
    rt = workbench.Runtime(lm, device="cpu", **V.base_knobs(a.tokens))
    budget = V.expert_budget_slots(lay.num_layers, lay.num_experts)
    V.hot_recall_summary(lm, V.scenes(V.CALIB_SEED, a.calib_requests), out / "predictor",
                         steps=a.calib_steps)
    t_cal = time.perf_counter() - t0
    lad = V.ablation_ladder(rt, V.scenes(V.eval_seed(), a.scenes), stages=STAGES,
                            budget_slots=budget, pinned_full=a.pinned_full,
                            predictor_path=out / "predictor", max_new_tokens=a.tokens)
    (out / "ladder.json").write_text(json.dumps(lad.to_dict(), default=str))
    total = time.perf_counter() - t0
    m = lad.mean("request")
    lat = m["latency_modeled_s"].to_series()
    n = lad.sizes["request"]
    paper = V.PAPER["ladder_s"]
    cmd = "python benchmarks/bench_offload_unit.py" + "".join(
        " " + shlex.quote(x) for x in sys.argv[1:])
    print(f"```\n{cmd}\n```\n")
    print(f"Embedded model ({lay.num_layers} MoE layers × {lay.num_experts} experts, top-"
          f"{lay.top_k}), {n} held-out scenes, budget {budget} expert slots (cache "
          f"{budget - lay.num_experts} beside 1 pinned layer), at most {a.tokens} tokens; "
          f"calibration {t_cal / 60:.1f} min, total {total / 60:.1f} min (measured).\n")
    print("| rung | modeled ms | % of layerwise base (modeled) | % of expert base (modeled) "
          "| paper HF % | paper KTransformers % | prefill ms (modeled) | ms / decode token "
          "(modeled) | stall ms (modeled) | hit rate | loads / request | measured ms (median) "
          "| accuracy |")
    print("|" + " --- |" * 13)
    lw, ex = lat["base: layerwise"], lat["base: expert"]
    for st in lad["stage"].values:
        s = str(st)
        h, mi = float(lad["hits"].sel(stage=s).sum()), float(lad["misses"].sel(stage=s).sum())
        row = PAPER_ROW.get(s)
        hf = f"{paper[row] / paper['base']:.1%}" if row else "—"
        kt = f"{KT[row] / KT['base']:.1%}" if row else "—"
        print(f"| {s} | {lat[s] * 1e3:.1f} | {lat[s] / lw:.1%} | {lat[s] / ex:.1%} | {hf} | "
              f"{kt} | {float(m['prefill_modeled_s'].sel(stage=s)) * 1e3:.1f} | "
              f"{float(m['decode_modeled_s'].sel(stage=s)) * 1e3:.1f} | "
              f"{float(m['stall_modeled_s'].sel(stage=s)) * 1e3:.1f} | "
              f"{h / (h + mi) if h + mi else float('nan'):.1%} | "
              f"{float(m['loads'].sel(stage=s)):.0f} | "
              f"{float(lad['latency_measured_s'].sel(stage=s).median()) * 1e3:.0f} | "
              f"{float(m['correct'].sel(stage=s)):.1%} |")
    # paired ratios per request, ±2 SE
    print()
    for a_, b_ in (("base: expert", "base: layerwise"),
                   ("base: layerwise-prefetch", "base: layerwise")):
        r = (lad["latency_modeled_s"].sel(stage=a_) / lad["latency_modeled_s"].sel(stage=b_)
             ).values
        print(f"- {a_} / {b_} (modeled, per request): {r.mean():.3f} ± "
              f"{2 * r.std(ddof=1) / np.sqrt(len(r)):.3f} (2 SE)")
    print()
    print(json.dumps({"latency_modeled_s": {str(k): float(v) for k, v in lat.items()},
                      "scenes": n, "budget_slots": budget}))


if __name__ == "__main__":
    main()
