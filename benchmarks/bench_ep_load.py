"""Expert-parallel load of real routing (issue 14, part 2): how imbalanced are real MoE layers
when their experts are spread over R ranks, and how fast is an EP replay?

1. The real Mixtral-8x7B decode trace (../shared/data/traces/…/humaneval_2_routing.jsonl,
   32 layers × 8 experts, top-2, one token per step): per (step, layer) group, imbalance
   max/mean over ranks, balancedness mean/max, the largest rank load, for R = 2, 4, 8 and both
   placements — and the same loads summed over the whole trace (``aggregate_imbalance``). One
   token per step makes a group 2 assignments; ``batch`` b serves b consecutive steps as one
   (a stand-in for a decode batch of b tokens).
2. The OLMoE authors' aggregated counts (../shared/data/routing-counts/olmoe-authors: OLMoE
   16 × 64 top-8, Mixtral 32 × 8 top-2; ~209 k tokens per domain, layers 0, 7, 15): the
   imbalance of the per-rank sums of those counts, for R = 2 … 64. These are sums over a whole
   corpus — a floor of what one batch sees, not a batch's imbalance.
3. Speed: ``workbench replay --set ep_ranks=8`` in process on the Mixtral trace tiled to about
   1 M accesses (goal ≥ 5 M accesses/s end to end), with and without the Belady bound.

    python benchmarks/bench_ep_load.py [--tile 100] [--repeats 3] [--json OUT]

Everything here is measured from real data except the ``*_modeled`` times (none are printed
here). No model runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
SHARED = Path(os.environ.get("WORKBENCH_SHARED", REPO.parent / "shared"))
MIXTRAL = SHARED / "data/traces/mixtral-8x7b-vllm/humaneval_2_routing.jsonl"
COUNTS = SHARED / "data/routing-counts/olmoe-authors"


def batched(trace, b: int):
    """``trace`` with ``b`` consecutive decode steps served as one step: a stand-in for a
    decode batch of ``b`` tokens (same request, consecutive positions — the closest this
    single-request trace comes to a batch)."""
    from workbench.traces import Trace

    return Trace(topk_ids=trace.topk_ids, token_step=trace.token_step // b,
                 num_experts=trace.num_experts, attrs=dict(trace.attrs))


def mixtral_table(trace) -> list[dict]:
    from workbench.replay import replay_trace

    rows = []
    for b in (1, 8, 32, 128):
        tr = batched(trace, b)
        for placement in ("contiguous", "round-robin"):
            for R in (2, 4, 8):
                ep = replay_trace(tr, belady=False, ep_ranks=R,
                                  placement=placement).extra["ep"]
                rows.append({"batch": b, "placement": placement, "ranks": R, **{k: ep[k] for k in (
                    "imbalance", "balancedness", "imbalance_ratio", "max_rank_load",
                    "worst_imbalance", "aggregate_imbalance")}})
    return rows


def dispatch_table(trace) -> list[dict]:
    """CAI-MoE Token Drop on the batched Mixtral trace: drop rate, the largest expert load and
    the EP imbalance after it, for γ0 from 0.25 to 5 (8 ranks)."""
    from workbench.replay import replay_trace

    rows = []
    for b in (32, 128):
        tr = batched(trace, b)
        for gamma in (None, 0.25, 0.5, 1.0, 1.8, 5.0):
            # the Mixtral trace records decode tokens only (phase 1): capacity on every step
            kw = {} if gamma is None else dict(dispatch="capacity-drop", capacity_factor=gamma,
                                               capacity_scope="all")
            res = replay_trace(tr, belady=False, ep_ranks=8, **kw)
            d = res.extra.get("dispatch", {})
            ep = res.extra["ep"]
            rows.append({"batch": b, "capacity_factor": gamma,
                         "drop_rate": d.get("drop_rate", 0.0),
                         "max_expert_load": d.get("max_expert_load_after"),
                         "imbalance": ep["imbalance"],
                         "mean_max_rank_load": ep["mean_max_rank_load"]})
    return rows


def counts_table() -> list[dict]:
    from workbench.sim.placement import rank_of_expert

    rows = []
    for model in ("olmoe", "mistral"):
        for f in sorted((COUNTS / model / "expert_counts").glob("*.json")):
            doc = json.loads(f.read_text())
            for layer, counts in doc["data"].items():
                c = np.asarray(counts, np.float64)
                E = len(c)
                for R in (2, 4, 8, 16, 32, 64):
                    if R > E:
                        continue
                    per = np.bincount(rank_of_expert("contiguous", E, R), weights=c,
                                      minlength=R)
                    rows.append({"model": model, "domain": f.stem, "layer": int(layer),
                                 "experts": E, "ranks": R,
                                 "expert_imbalance": float(c.max() / c.mean()),
                                 "rank_imbalance": float(per.max() / per.mean())})
    return rows


def speed(trace, repeats: int) -> dict:
    from workbench.replay import replay_trace

    acc = trace.groups().num_accesses
    out = {"accesses": acc}
    for belady in (False, True):
        replay_trace(trace, belady=belady, ep_ranks=8)  # compiled code warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            replay_trace(trace, belady=belady, ep_ranks=8, target_model="qwen3-vl-30b-a3b")
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out["belady" if belady else "no_belady"] = {"seconds": t, "maccs": acc / t / 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tile", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if not MIXTRAL.exists():
        sys.exit(f"the real Mixtral trace is not at {MIXTRAL} (set WORKBENCH_SHARED)")
    from bench_replay import tiled

    from workbench.traces import load_trace

    trace = load_trace(MIXTRAL)
    res = {"mixtral": mixtral_table(trace), "dispatch": dispatch_table(trace),
           "counts": counts_table() if COUNTS.exists() else [],
           "speed": speed(tiled(trace, a.tile), a.repeats)}
    print(f"Mixtral-8x7B decode trace ({trace!r}), per (step, layer) group, measured:")
    print("| batch (steps) | placement | ranks | imbalance (max/mean) | balancedness (mean/max) | "
          "(max−mean)/mean | worst group | max rank load | whole trace summed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["mixtral"]:
        print(f"| {r['batch']} | {r['placement']} | {r['ranks']} | {r['imbalance']:.3f} | "
              f"{r['balancedness']:.3f} | {r['imbalance_ratio']:.3f} | "
              f"{r['worst_imbalance']:.2f} | {r['max_rank_load']} | "
              f"{r['aggregate_imbalance']:.3f} |")
    print("\nCAI-MoE Token Drop (dispatch=capacity-drop) on the batched trace, 8 ranks:")
    print("| batch | γ0 | drop rate | max expert load | imbalance (max/mean) | mean busiest rank |")
    print("|---|---|---|---|---|---|")
    for r in res["dispatch"]:
        g = "topk" if r["capacity_factor"] is None else f"{r['capacity_factor']:g}"
        mel = "—" if r["max_expert_load"] is None else r["max_expert_load"]
        print(f"| {r['batch']} | {g} | {r['drop_rate']:.1%} | {mel} | {r['imbalance']:.3f} | "
              f"{r['mean_max_rank_load']:.1f} |")
    if res["counts"]:
        print("\nOLMoE authors' counts (contiguous placement), imbalance max/mean, "
              "median [min–max] over domains and layers:")
        print("| model | per expert | R=2 | 4 | 8 | 16 | 32 | 64 |")
        print("|---|---|---|---|---|---|---|---|")
        for model in ("olmoe", "mistral"):
            rs = [r for r in res["counts"] if r["model"] == model]
            ex = sorted({(r["domain"], r["layer"]): r["expert_imbalance"] for r in rs}.values())
            cells = []
            for R in (2, 4, 8, 16, 32, 64):
                v = [r["rank_imbalance"] for r in rs if r["ranks"] == R]
                cells.append(f"{statistics.median(v):.2f} [{min(v):.2f}–{max(v):.2f}]"
                             if v else "—")
            print(f"| {model} | {statistics.median(ex):.2f} [{ex[0]:.2f}–{ex[-1]:.2f}] | "
                  + " | ".join(cells) + " |")
    s = res["speed"]
    print(f"\nEP replay (ep_ranks=8, priced as Qwen3-VL-30B-A3B) of the trace tiled ×{a.tile} "
          f"({s['accesses']:,} accesses), in process, median of {a.repeats}:")
    for k, label in (("no_belady", "without the Belady bound"), ("belady", "with it")):
        print(f"  {label}: {s[k]['seconds']:.2f} s = {s[k]['maccs']:.1f} M accesses/s")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
