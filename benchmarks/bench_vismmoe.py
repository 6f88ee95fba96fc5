"""VisMMOE reproduced in kind (issue 5 §4) on the embedded model: the ablation ladder, latency vs
pinned_layers, Hot Recall vs random, routing of text / raw visual / pruned visual tokens, and
answer accuracy per compression policy × β. Prints markdown tables (BENCHMARKS.md) and the
command that produced them.

Latencies are *modeled* (the embedded model's routing priced as Qwen3-VL-30B-A3B experts on the
A100-40GB profile) unless a column says *measured* (CPU wall time here); routing statistics,
hit rates, loads, Hot Recall and accuracy are counted on the real model. The study functions
and every scaling decision are in ``workbench/analysis/vismmoe/`` and ``docs/vismmoe.md``.

    nice python benchmarks/bench_vismmoe.py [--scenes 48] [--sweep-scenes 24]
        [--accuracy-questions 200] [--calib-requests 48] [--tokens 32] [--out DIR] [--json]
        [--scale 1[,2]] [--parts ladder,sweep,recall,pruning,accuracy] [--model DIR]

``--scale 1,2`` (issue 39 §8) runs the pruning characterisation and the accuracy study on the
same scenes drawn at each scale (2 = 256 px, every object over 4x the patches; the image
processor keeps each at its size) and says, per larger scale, which of the paper's effects grow
(:func:`workbench.analysis.vismmoe.scale_findings`); the ladder, the sweep and Hot Recall run
at the first scale only.
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
import pandas as pd
import torch

from workbench.analysis import vismmoe as V
from workbench.models.embedded.v2.tasks import SCENE_SIZE, check_scale

PARTS = ("ladder", "sweep", "recall", "pruning", "accuracy")


def _scales(text: str) -> list[int]:
    try:
        out = sorted({check_scale(int(x)) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}" if "scale" in str(e) else
                                         f"{text!r} is not a comma-separated list of whole numbers") from None
    if not out:
        raise argparse.ArgumentTypeError("give at least one scale")
    return out


def _betas(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or not all(0 < b <= 1 for b in out):
        raise argparse.ArgumentTypeError(f"{text!r}: keep ratios are comma-separated numbers in (0, 1]")
    return out


def _parts(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in PARTS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"{text!r}: parts are a comma-separated subset of "
                                         f"{','.join(PARTS)}")
    return out


def markdown(df: pd.DataFrame, fmt: dict[str, str] | None = None, index: bool = True) -> str:
    """A DataFrame as a markdown table; ``fmt`` maps columns to format specs ('%' = percent)."""
    fmt = fmt or {}
    cols = list(df.columns)
    head = ([df.index.name or ""] if index else []) + [str(c) for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i, idx in enumerate(df.index):
        cells = [str(idx)] if index else []
        for c in cols:
            v = df[c].iloc[i]  # per column: iterrows would turn ints into floats
            f = fmt.get(c)
            if isinstance(v, (float, np.floating)) and not np.isfinite(v):
                cells.append("—")
            elif f == "%":
                cells.append(f"{v:.1%}")
            elif f:
                cells.append(format(v, f))
            elif isinstance(v, (float, np.floating)):
                cells.append(f"{v:.3f}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenes", type=int, default=48,
                    help="held-out scenes for the ladder and the routing characterisation")
    ap.add_argument("--sweep-scenes", type=int, default=24, help="held-out scenes per sweep point")
    ap.add_argument("--profile-scenes", type=int, default=8,
                    help="calibration-seed scenes on which 'full' chooses its pinned prefix")
    ap.add_argument("--accuracy-questions", type=int, default=200)
    ap.add_argument("--calib-requests", type=int, default=48)
    ap.add_argument("--calib-steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=32,
                    help="decoded tokens per request at most (decoding stops at the answer's end)")
    ap.add_argument("--budgets", default="",
                    help="expert-slot budgets, comma separated (default: the paper's share, "
                         "86, and twice it)")
    ap.add_argument("--out", help="folder for the calibrated predictor and the run stores "
                                  "(default: a new temporary folder)")
    ap.add_argument("--json", action="store_true", help="also print every result as JSON")
    ap.add_argument("--scale", type=_scales, default=[1],
                    help="scene scales, comma separated, 1-4 (2: the same scenes at 256 px); "
                         "pruning and accuracy run at each, the rest at the first")
    ap.add_argument("--parts", type=_parts, default=list(PARTS),
                    help=f"which studies to run (default all: {','.join(PARTS)})")
    ap.add_argument("--model", help="model folder (default: the shipped embedded model)")
    ap.add_argument("--betas", type=_betas, default=[1.0, 0.7, 0.5],
                    help="keep ratios of the accuracy study, comma separated, in (0, 1] "
                         "(default 1,0.7,0.5; β = 1 checks that no policy changes an answer)")
    a = ap.parse_args()
    torch.set_num_threads(2)
    t_all = time.perf_counter()
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench-vismmoe-"))
    out.mkdir(parents=True, exist_ok=True)
    lm = workbench.load(a.model, device="cpu")
    lay = lm.layout
    rt = workbench.Runtime(lm, device="cpu", **V.base_knobs(a.tokens))
    paper_budget = V.expert_budget_slots(lay.num_layers, lay.num_experts)
    budgets = ([int(b) for b in a.budgets.split(",")] if a.budgets
               else [paper_budget, 2 * paper_budget])
    times: dict[str, float] = {}

    def step(name, fn, *args, **kw):
        res, t = V.timed(fn, *args, **kw)
        times[name] = t
        print(f"[{name}: {t:.1f} s]", file=sys.stderr, flush=True)
        return res

    pred_path = out / "predictor"
    s0 = a.scale[0]
    recall = ladders = sweep = None
    chosen: dict[int, int] = {}
    with V.scene_scale(lm, s0):
        if {"recall", "ladder", "sweep"} & set(a.parts):
            calib = V.scenes(V.CALIB_SEED, a.calib_requests, s0)
            recall = step("calibration + Hot Recall", V.hot_recall_summary, lm, calib, pred_path,
                          steps=a.calib_steps)
        evals = V.scenes(V.eval_seed(), max(a.scenes, a.sweep_scenes), s0)
        if "ladder" in a.parts:
            profile = V.scenes(V.PROFILE_SEED, a.profile_scenes, s0)
            for b in budgets:
                prof = step(f"profiling pinned prefix ({b} slots)", V.pinned_sweep, rt, profile,
                            budgets=[b], predictor_path=pred_path, max_new_tokens=a.tokens)
                chosen[b] = V.choose_pinned(prof)
            ladders = {b: step(f"ladder ({b} slots)", V.ablation_ladder, rt, evals[:a.scenes],
                               budget_slots=b, pinned_full=chosen[b], predictor_path=pred_path,
                               max_new_tokens=a.tokens) for b in budgets}
        if "sweep" in a.parts:
            sweep = step("pinned sweep", V.pinned_sweep, rt, evals[:a.sweep_scenes],
                         budgets=budgets, predictor_path=pred_path, max_new_tokens=a.tokens)
    prunings: dict[int, object] = {}
    accs: dict[int, object] = {}
    for sc in a.scale:
        with V.scene_scale(lm, sc):
            tag = "" if len(a.scale) == 1 else f" at {sc}×"
            if "pruning" in a.parts:
                prunings[sc] = step(f"pruning characterisation{tag}", V.characterise_pruning, rt,
                                    V.scenes(V.eval_seed(), a.scenes, sc),
                                    workdir=out / f"stores-{sc}x")
            if "accuracy" in a.parts:
                accs[sc] = step(f"accuracy{tag}", V.accuracy_vs_beta, rt,
                                V.scenes(V.eval_seed(), a.accuracy_questions, sc),
                                betas=a.betas)
    total = time.perf_counter() - t_all

    cmd = "python benchmarks/bench_vismmoe.py" + "".join(
        " " + shlex.quote(x) for x in sys.argv[1:])
    print(f"```\n{cmd}\n```\n")
    print(f"{'Embedded model' if a.model is None else f'Model `{a.model}`'}, {lay.num_layers} MoE layers × {lay.num_experts} experts, top-"
          f"{lay.top_k}; held-out scenes `make_split({V.eval_seed()}, n)`; "
          + (f"predictor calibrated on `make_split({V.CALIB_SEED}, {a.calib_requests})`; "
             if recall is not None else "")
          + (f"pinned prefix of *full* profiled on `make_split({V.PROFILE_SEED}, "
             f"{a.profile_scenes})`; " if ladders else "")
          + f"{a.tokens} decoded tokens per request at most (stopping at the answer's end); "
          + (f"B = {V.scaled_prefetch_budget(lay.num_experts)}; " if ladders or sweep is not None
             else "")
          + f"total {total / 60:.1f} min.\n")

    for b, lad in (ladders or {}).items():
        t = V.ladder_table(lad)
        print(f"**Ablation ladder, {b} expert slots** ({lad.sizes['request']} scenes; *full* "
              f"pinned prefix {chosen[b]} chosen in the valid interval "
              f"{list(V.scaled_plan(lay, b, 1).valid_interval)}; times modeled unless marked "
              f"measured)\n")
        print(markdown(t, {"norm. (modeled)": "%", "paper norm.": "%", "hit rate": "%",
                           "accuracy": "%", "modeled ms": ".1f", "prefill ms (modeled)": ".1f",
                           "ms / decode token (modeled)": ".2f", "stall ms (modeled)": ".1f",
                           "loads / request": ".1f", "measured ms (median)": ".1f",
                           "pinned": "d", "slots": "d"}))
        print()
    if sweep is not None:
        print(f"**Latency vs pinned_layers** ({a.sweep_scenes} scenes, *full* configuration, "
              f"cache = budget − {lay.num_experts} × pinned)\n")
        sw = sweep[sweep["valid"]].set_index("budget_slots")
        sw.index.name = "budget (slots)"
        print(markdown(sw.drop(columns=["valid"]), {
            "pinned_layers": "d", "cache_slots": "d", "latency_modeled_ms": ".1f",
            "prefill_modeled_ms": ".1f", "decode_modeled_ms_per_token": ".2f", "hit_rate": "%",
            "loads": ".1f", "latency_measured_ms_median": ".1f"}))
        print()
    hr = None
    if recall is not None:
        print(f"**Hot Recall, held out** ({recall.attrs['heldout_requests']} requests, "
              f"{recall.attrs['heldout_samples']} (step, layer) samples, "
              f"{recall.attrs['mean_active_next_layer']:.1f} experts active at the next layer on "
              f"average; predictor cost P50 {recall.attrs['cost_p50_s'] * 1e3:.3f} ms, P99 "
              f"{recall.attrs['cost_p99_s'] * 1e3:.3f} ms measured)\n")
        hr = V.hot_recall_table(recall)
        print(markdown(hr, {"share of experts": "%", "predictor": "%", "random": "%",
                            "oracle": "%", "without h^(v)": "%", "× random": ".2f",
                            "× random at most": ".2f"}))
        print()
    ats = {}
    for sc in a.scale:
        at_scale = ("" if len(a.scale) == 1 and sc == 1 else
                    f", scenes at {sc}× ({SCENE_SIZE * sc} px)")
        pruning = prunings.get(sc)
        if pruning is not None:
            for layers, what in (("after-prefix", "layers behind the pinned prefix, where "
                                                  "pruning acts"),
                                 ("prefix", "the pinned prefix, whose routing affinity scores")):
                pt = V.pruning_table(pruning, layers)
                print(f"**Prefill routing per token group, {what}{at_scale}** (layers "
                      f"{pt.attrs['layers']}; {pruning.sizes['request']} scenes; β = "
                      f"{pruning.attrs['beta']}; measured; Jaccard of unrelated routing "
                      f"{pt.attrs['chance_similarity']:.3f})\n")
                print(markdown(pt, {"tokens / request": ".1f"}))
                print()
            io = V.prefill_io_table(pruning)
            print(f"**Prefill on-demand loads{at_scale}** (offloaded layers, "
                  f"{pruning.attrs['cache_slots']} slots, cold cache per request; measured)\n")
            print(markdown(io, {"prefill loads": ".1f", "prefill hits": ".1f"}))
            print()
            prompt = float(pruning["tokens"].sel(group=["text", "visual (raw)"]).isel(layer=0)
                           .sum("group").mean())
            per_layer = float(io.loc["none", "prefill loads"]) / (
                lay.num_layers - pruning.attrs["pinned_layers"])
            mc = V.modeled_costs(lay.top_k, round(prompt), per_layer)
            print(f"**What the modeled clock charges per MoE layer{at_scale}** (Qwen3-VL-30B-A3B "
                  "costs on A100-40GB; prompt length and prefill experts per layer as measured "
                  "above)\n")
            print(markdown(mc, {"tokens": ".0f", "experts / layer": ".1f",
                                "compute ms / layer": ".3f", "one expert copy ms": ".3f",
                                "copying the layer's experts ms": ".2f",
                                "copies / compute": ".1f"}))
            print()
        acc = accs.get(sc)
        if acc is not None:
            at = ats[sc] = V.accuracy_table(acc)
            print(f"**Answer accuracy{at_scale}** ({at.attrs['questions']} held-out questions, "
                  f"exact match; compression after {acc.attrs['pinned_layers']} pinned layer; "
                  f"β = 1 answers equal no compression for every policy: "
                  f"{all(same.values()) if (same := at.attrs['same_as_none_at_beta_1']) else 'not run'}"
                  f"; accuracy per kind "
                  f"without compression: " + ", ".join(f"{k} {v:.0%}" for k, v in
                                                       at.attrs['per_kind_none'].items()) + ")\n")
            print(markdown(at, {c: "%" for c in at.columns}))
            print()
    print("**What appears** (an effect appears when it has the paper's sign and exceeds two "
          "standard errors of the paired difference)\n")
    items = V.findings(ladders[budgets[0]] if ladders else None, sweep, prunings.get(s0),
                       accs.get(s0), recall)
    for b in budgets[1:] if ladders else []:
        items += [(f"{e} ({b} slots)", ok, txt) for e, ok, txt in V.findings(ladders[b])]
    if len(a.scale) > 1:
        items = [(f"{e} (at {s0}×)", ok, txt) for e, ok, txt in items]
        for sc in a.scale[1:]:
            items += [(f"{e} (at {sc}×)", ok, txt) for e, ok, txt in
                      V.findings(pruning=prunings.get(sc), accuracy=accs.get(sc))]
        items += V.scale_findings(prunings or None, accs or None)
    print(V.findings_markdown(items))
    print()
    print("Time per part (s): " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    if a.json:
        print(json.dumps({
            "ladders": {str(b): V.ladder_table(l).reset_index().to_dict("records")
                        for b, l in (ladders or {}).items()},
            "sweep": sweep.to_dict("records") if sweep is not None else None,
            "hot_recall": hr.reset_index().to_dict("records") if hr is not None else None,
            "pruning": {str(sc): V.pruning_table(p).reset_index().to_dict("records")
                        for sc, p in prunings.items()},
            "accuracy": {str(sc): t.reset_index().to_dict("records") for sc, t in ats.items()},
            "findings": [{"effect": e, "appears": ok, "text": t} for e, ok, t in items],
            "times_s": times}, default=float))

if __name__ == "__main__":
    main()
