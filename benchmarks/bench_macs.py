"""MACS reproduced in kind on the embedded model (issue 14 §4; seed 002): capacity-aware
dispatch under 8 virtual expert-parallel ranks, live inside the real experts forward.

Inputs: the embedded model's held-out split (``make_split(HELDOUT_SEED, n)``: generated
scenes, digit strips and text-only puzzles, never trained on), run together in batches of
``--batch`` requests (the split's own modality mix), greedy, answers scored by exact match
after ``normalise_answer``. Every expert fits in the cache (answers never depend on it).
Costs: the modeled EP clock prices Qwen3-VL-30B-A3B experts and hidden states (dispatch
all-to-all, the slowest rank's experts, combine) on NVLink (A100) — *modeled*; accuracy, drop
and reroute rates and wall times are *measured*. The MACS calibration is the one shipped
beside the model (its own seed, not the held-out split).

Stages (each a table in the output and a key of the JSON):

- ``methods`` (seed Tables 1/4): vanilla top-k, CAI-MoE Token Drop and Expanded Drop, MACS
  without rerouting and full MACS at γ0 = 1.0 and 0.5 — accuracy retained vs vanilla (paired per question,
  ± 2 SE), drop and reroute rates, max expert load (seed Fig. 4), modeled MoE-layer time and
  its dispatch / compute / combine breakdown (seed Figs. 2–3).
- ``ablation`` (Table 2): SC (static capacity, token counts, router order = Token Drop), +SL
  (entropy-weighted load and selection), +DC (modality-aware capacity), +SR (rerouting).
- ``selection`` (Table 3): random, router, modality-prior, entropy (w·G_j) and retention
  (eq. 11's w·max G, our second reading) (SL on, DC and SR off) at γ0 = 1.5, 1.0, 0.5.
- ``gamma`` (Fig. 8): full MACS drop and reroute rates and modeled speedup, γ0 0.05 … 5.
- ``sensitivity`` (Figs. 5–6): δ and ρ at γ0 = 0.5.

Verdicts are generated from the numbers: an effect of the paper "appears" when the difference
has the paper's sign beyond two standard errors (paired over questions), "does not appear"
when it has the opposite sign beyond two SE, else "not resolved at n".

Capacity acts where ``--capacity-scope`` says (the knob ``capacity_scope``; default the knob's
default, ``prefill``: decode steps keep the router's top-k, docs/macs.md *Where capacity acts*).

    python benchmarks/bench_macs.py [--n 48] [--batch 8] [--json OUT] [--quick]
        [--capacity-scope prefill|all] [--no-sensitivity]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np

from workbench.analysis.vismmoe.accuracy import normalise_answer
from workbench.analysis.vismmoe.config import eval_seed

RANKS = 8
TARGET = "qwen3-vl-30b-a3b"
MACS_OFF = dict(macs_semantic_load=False, macs_dynamic_capacity=False, macs_reroute=False,
                macs_selection="router")


def _batches(n: int, size: int):
    from workbench.models.embedded.v2.tasks import make_split
    from workbench.models.inputs import Request

    ex = make_split(eval_seed(), n)
    reqs = [Request(q, [img] if img is not None else []) for img, q, _ in ex]
    truth = [normalise_answer(a) for _, _, a in ex]
    return [reqs[i:i + size] for i in range(0, n, size)], truth, ex


class Runner:
    """Runs one configuration over every batch; keeps answers, counters and EP figures."""

    def __init__(self, batches, truth, workdir: Path, max_new_tokens: int,
                 capacity_scope: str | None = None) -> None:
        self.rt = workbench.Runtime()
        lay = self.rt.lm.layout
        self.base = dict(max_new_tokens=max_new_tokens, pinned_layers=0,
                         cache_slots=lay.num_layers * lay.num_experts, ep_ranks=RANKS,
                         target_model=TARGET, lookahead_depth=0, prefetch="none")
        if capacity_scope is not None:
            self.base["capacity_scope"] = capacity_scope
        self.batches, self.truth, self.dir = batches, truth, workdir
        self.n_runs = 0

    def run(self, **knobs) -> dict:
        answers, assigned, dropped, rerouted, wall = [], 0, 0, 0, 0.0
        ep = {"moe_layer_s_modeled": 0.0, "dispatch_s_modeled": 0.0, "compute_s_modeled": 0.0,
              "combine_s_modeled": 0.0}
        max_load = None
        imb = []
        for reqs in self.batches:
            self.n_runs += 1
            store = self.dir / f"r{self.n_runs}.zarr"
            t0 = time.perf_counter()
            res = self.rt.run(reqs, store=store, **self.base, **knobs)
            wall += time.perf_counter() - t0
            answers += [normalise_answer(t) for t in res.texts]
            assigned += res.dispatch_assigned
            dropped += res.dispatch_dropped
            rerouted += res.dispatch_rerouted
            ds = workbench.open_run(store)
            s = ds.moe.ep_summary()
            for k in ep:
                ep[k] += float(s[k] or 0.0)
            imb.append(s["imbalance"])
            # max expert load per layer (MACS Fig. 4): the busiest expert of any step
            m = ds["routed_tokens"].sum("modality").max(("step", "expert")).values
            max_load = m if max_load is None else np.maximum(max_load, m)
        correct = [a == t for a, t in zip(answers, self.truth)]
        return {"knobs": knobs, "answers": answers, "correct": correct,
                "accuracy": float(np.mean(correct)), "assigned": assigned,
                "drop_rate": dropped / assigned if assigned else 0.0,
                "reroute_rate": rerouted / assigned if assigned else 0.0,
                "max_expert_load": [int(x) for x in max_load], "imbalance": float(np.mean(imb)),
                "wall_s": wall, **ep}


def paired(a: dict, b: dict) -> tuple[float, float]:
    """Mean and SE of (a correct − b correct) over the questions."""
    d = np.array(a["correct"], float) - np.array(b["correct"], float)
    se = d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return float(d.mean()), float(se)


def verdict(diff: float, se: float, sign: int) -> str:
    """The paper's effect of sign ``sign`` (+1: a > b) appears beyond 2 SE, or not."""
    if not np.isfinite(se):
        return "not resolved"
    if sign * diff > 2 * se:
        return "appears"
    if sign * diff < -2 * se:
        return "does not appear (opposite sign beyond 2 SE)"
    return "not resolved at this n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=48, help="held-out questions")
    ap.add_argument("--batch", type=int, default=8, help="requests run together")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--quick", action="store_true", help="methods only (a smoke run)")
    ap.add_argument("--capacity-scope", choices=("prefill", "all"), default=None,
                    help="where capacity acts (the capacity_scope knob; default: its default)")
    ap.add_argument("--no-sensitivity", action="store_true",
                    help="skip the δ and ρ sweeps (Figs. 5–6)")
    a = ap.parse_args()
    from workbench.knobs import Knobs

    scope = a.capacity_scope or Knobs().capacity_scope
    batches, truth, ex = _batches(a.n, a.batch)
    out: dict = {"n": a.n, "batch": a.batch, "ranks": RANKS, "target_model": TARGET,
                 "text_only": sum(img is None for img, _, _ in ex), "capacity_scope": scope}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        R = Runner(batches, truth, Path(d), a.max_new_tokens, scope)
        van = R.run()
        out["vanilla"] = van

        def row(name, r):
            diff, se = paired(r, van)
            ret = r["accuracy"] / van["accuracy"] if van["accuracy"] else float("nan")
            speed = van["moe_layer_s_modeled"] / r["moe_layer_s_modeled"] \
                if r["moe_layer_s_modeled"] else float("nan")
            return {"name": name, "accuracy": r["accuracy"], "retained": ret, "delta": diff,
                    "se": se, "drop_rate": r["drop_rate"], "reroute_rate": r["reroute_rate"],
                    "max_expert_load": max(r["max_expert_load"]), "imbalance": r["imbalance"],
                    "speedup_modeled": speed, "moe_layer_s_modeled": r["moe_layer_s_modeled"],
                    "dispatch_s_modeled": r["dispatch_s_modeled"],
                    "compute_s_modeled": r["compute_s_modeled"],
                    "combine_s_modeled": r["combine_s_modeled"], "wall_s": r["wall_s"],
                    "correct": r["correct"]}

        methods = {}
        for g in (1.0, 0.5):
            methods[g] = {
                "Token Drop": R.run(dispatch="capacity-drop", capacity_factor=g),
                "Expanded Drop": R.run(dispatch="capacity-expanded", capacity_factor=g),
                "MACS w/o rerouting": R.run(dispatch="macs", capacity_factor=g,
                                            macs_reroute=False),
                "MACS": R.run(dispatch="macs", capacity_factor=g)}
        out["methods"] = {str(g): [row(k, v) for k, v in m.items()] for g, m in methods.items()}

        def partial():  # what is done so far, in case the study is stopped before its end
            if a.json:
                done = {**out, "elapsed_s": time.perf_counter() - t_start, "partial": True}
                done["verdicts"] = verdicts(done)
                Path(a.json).write_text(json.dumps(done, indent=1, default=float))

        partial()
        if not a.quick:
            abl = {}
            for g in (1.0, 0.5):
                sc = methods[g]["Token Drop"]  # SC = Token Drop (tested identical rule)
                sl = R.run(dispatch="macs", capacity_factor=g, macs_dynamic_capacity=False,
                           macs_reroute=False)
                dc = methods[g]["MACS w/o rerouting"]
                sr = methods[g]["MACS"]
                abl[str(g)] = [row("SC", sc), row("+SL", sl), row("+SL+DC", dc),
                               row("+SL+DC+SR", sr)]
            out["ablation"] = abl
            partial()
            sel = {}
            for g in (1.5, 1.0, 0.5):
                sel[str(g)] = [row(s, R.run(dispatch="macs", capacity_factor=g,
                                            macs_dynamic_capacity=False, macs_reroute=False,
                                            macs_selection=s))
                               for s in ("random", "router", "modality-prior", "retention",
                                         "entropy")]
            out["selection"] = sel
            partial()
            out["gamma"] = [row(f"γ0={g:g}", R.run(dispatch="macs", capacity_factor=g))
                            for g in (0.05, 0.25, 0.5, 1.0, 1.8, 3.0, 5.0)]
            partial()
        if not a.quick and not a.no_sensitivity:
            out["delta"] = [row(f"δ={x:g}", R.run(dispatch="macs", capacity_factor=0.5,
                                                  macs_delta=x)) for x in (0.5, 1.5, 3.0)]
            out["rho"] = [row(f"ρ={x:g}", R.run(dispatch="macs", capacity_factor=0.5,
                                                macs_rho=x)) for x in (0.0, 0.3, 0.6, 0.9)]
    out["elapsed_s"] = time.perf_counter() - t_start
    out["verdicts"] = verdicts(out)
    print(report(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float))


def _find(rows, name):
    return next(r for r in rows if r["name"] == name)


def verdicts(out: dict) -> list[dict]:
    """The paper's claims against the numbers (module docstring)."""
    v = []

    def claim(text, a, b, sign=1):
        d = np.array(a["correct"], float) - np.array(b["correct"], float)
        se = d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        v.append({"claim": text, "diff": float(d.mean()), "se": float(se),
                  "verdict": verdict(float(d.mean()), float(se), sign)})

    for g, rows in out["methods"].items():
        claim(f"MACS keeps more answers than Token Drop at γ0 = {g} (Tables 1/4)",
              _find(rows, "MACS"), _find(rows, "Token Drop"))
        claim(f"MACS keeps more answers than Expanded Drop at γ0 = {g} (Tables 1/4)",
              _find(rows, "MACS"), _find(rows, "Expanded Drop"))
        claim(f"Expanded Drop keeps more answers than Token Drop at γ0 = {g} (Tables 1/4)",
              _find(rows, "Expanded Drop"), _find(rows, "Token Drop"))
        claim(f"rerouting adds accuracy at γ0 = {g} (MACS vs w/o rerouting)",
              _find(rows, "MACS"), _find(rows, "MACS w/o rerouting"))
        m, van = _find(rows, "MACS"), out["vanilla"]
        v.append({"claim": f"MACS lowers the max expert load vs vanilla at γ0 = {g} (Fig. 4: "
                           f"711 → 95)",
                  "vanilla": max(van["max_expert_load"]), "macs": m["max_expert_load"],
                  "verdict": "appears" if m["max_expert_load"] < max(van["max_expert_load"])
                  else "does not appear"})
        v.append({"claim": f"MACS speeds up the modeled MoE layer at γ0 = {g} (up to 1.97× "
                           f"at 0.5)", "speedup_modeled": m["speedup_modeled"],
                  "verdict": "appears" if m["speedup_modeled"] > 1.0 else "does not appear"})
    for g, rows in out.get("ablation", {}).items():
        names = [r["name"] for r in rows]
        for prev, cur in zip(names, names[1:]):
            claim(f"{cur} beats {prev} at γ0 = {g} (Table 2)", _find(rows, cur),
                  _find(rows, prev))
    for g, rows in out.get("selection", {}).items():
        for other in ("random", "router", "modality-prior", "retention"):
            claim(f"entropy-weighted selection beats {other} at γ0 = {g} (Table 3)",
                  _find(rows, "entropy"), _find(rows, other))
    if "gamma" in out:
        drops = [r["drop_rate"] for r in out["gamma"]]
        v.append({"claim": "the drop rate falls as γ0 grows (Fig. 8)", "drop_rates": drops,
                  "verdict": "appears" if all(x >= y for x, y in zip(drops, drops[1:]))
                  else "does not appear (not monotone)"})
    if "rho" in out:
        r6, r9 = _find(out["rho"], "ρ=0.6"), _find(out["rho"], "ρ=0.9")
        claim("ρ above 0.8 cannibalises (ρ = 0.6 beats 0.9 at γ0 = 0.5; Fig. 6)", r6, r9)
    return v


def report(out: dict) -> str:
    van = out["vanilla"]
    L = [f"MACS in kind: embedded model, {out['n']} held-out questions ({out['text_only']} "
         f"text-only) in batches of {out['batch']}, {out['ranks']} virtual EP ranks, modeled "
         f"as {out['target_model']}; vanilla accuracy {van['accuracy']:.1%}, max expert load "
         f"{max(van['max_expert_load'])}, imbalance {van['imbalance']:.2f}, modeled MoE layers "
         f"{van['moe_layer_s_modeled'] * 1e3:.1f} ms; capacity_scope "
         f"{out.get('capacity_scope', 'all')}; {out['elapsed_s']:.0f} s measured\n"]
    head = ("| γ0 | method | accuracy | retained | Δ vs vanilla ± 2 SE | drop | reroute | max "
            "expert load | imbalance | modeled MoE ms (dispatch / compute / combine) | "
            "speedup (modeled) |\n|---|---|---|---|---|---|---|---|---|---|---|")

    def lines(title, groups):
        L.append(f"\n### {title}\n\n{head}")
        for g, rows in groups:
            for r in rows:
                L.append(
                    f"| {g} | {r['name']} | {r['accuracy']:.1%} | {r['retained']:.1%} | "
                    f"{r['delta']:+.3f} ± {2 * r['se']:.3f} | {r['drop_rate']:.1%} | "
                    f"{r['reroute_rate']:.1%} | {r['max_expert_load']} | {r['imbalance']:.2f} | "
                    f"{r['moe_layer_s_modeled'] * 1e3:.1f} ({r['dispatch_s_modeled'] * 1e3:.1f} / "
                    f"{r['compute_s_modeled'] * 1e3:.1f} / {r['combine_s_modeled'] * 1e3:.1f}) | "
                    f"{r['speedup_modeled']:.2f}× |")

    lines("Methods (Tables 1/4)", out["methods"].items())
    if "ablation" in out:
        lines("Ablation (Table 2)", out["ablation"].items())
    if "selection" in out:
        lines("Token selection (Table 3)", out["selection"].items())
    if "gamma" in out:
        lines("γ0 sweep, full MACS (Fig. 8)", [("", out["gamma"])])
    if "delta" in out:
        lines("δ at γ0 = 0.5 (Fig. 5)", [("0.5", out["delta"])])
        lines("ρ at γ0 = 0.5 (Fig. 6)", [("0.5", out["rho"])])
    L.append("\n### Verdicts\n")
    for v in out["verdicts"]:
        num = (f"Δ {v['diff']:+.3f} ± {2 * v['se']:.3f}" if "diff" in v else
               ", ".join(f"{k} {v[k]}" for k in v if k not in ("claim", "verdict")))
        L.append(f"- {v['claim']}: **{v['verdict']}** ({num})")
    return "\n".join(L)


if __name__ == "__main__":
    main()
