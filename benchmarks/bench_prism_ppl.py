"""MoE-Prism's operating points by perplexity (issue 16 §2; seed Table 2, Fig. 9) — *measured*.

The embedded model's held-out questions (``make_split(eval_seed(), --n)``, never trained on;
the split's own mix of scenes, digit strips and text-only puzzles) are scored by
:func:`workbench.prism.quality.score`: the reference answer, then the end-of-sequence token,
teacher-forced after each prompt through the runtime (every expert resident, batches of 8),
negative log-likelihood per token in nats. Perplexity = exp(mean NLL per token). The model was
trained on answer cross-entropy only, so its prompts are not text it models: the held-out
*text-only* questions are reported as a subset of the answers (image / text-only columns), not
as prompt perplexity. "Accuracy" here is teacher-forced exact match: every answer token and the
EOS was the model's argmax (= greedy decoding reproduces the answer token for token).

Settings (compute share = the routed experts' compute a token runs; K = sub-experts of N = 4
per token over the router's 4 experts, 16 = the full model):

- **original, top-k′** (k′ = 4, 3, 2, 1): the router's best k′ experts, weights renormalised
  (``bench_prism_points.top_k_prime``'s hooks) — whole experts dropped; K = 4·k′.
- **MoE-Prism annealed, k_active** 4 … 1: the annealed refactoring
  (``R.refactor(lm, R.calibration_requests(64))``, 100 000 iterations per expert), the
  router's 4 experts each running its k_active best sub-experts by the proxy gate; K = 4·k_active.
- **MoE-Prism random, k_active** 3 … 1: the control — random partitions, gate neurons picked on
  the same profiled activations (as ``bench_prism_points``; k_active 4 equals the full model
  for any partition, not rerun).
- **MoE-Prism annealed, global K** (``--no-global``: skipped) 15 … 1: ``prism_k`` — each token
  runs its K best sub-experts among its router's 4 experts' 16 (proxy score × routing weight),
  the seed's K of Table 2; any K, not only multiples of 4.
- **grid** (``--no-grid``: skipped): top-k′ × k_active (annealed), k′, k_active ∈ {1, 2, 3}
  — the compute levels the two knobs give together today (K = k′·k_active).

**Operating points** (seed: "over 4 times more distinct, stable operating points"). The seed
counts operating points as the settings of the number of activated units K — "Mixtral … only
has 2 activated experts per token, offering only 2 distinct quality levels (activating 1 or 2)"
(§1), Table 2 and Fig. 9 over K in sub-expert units: with N = 4, 4× the original's K′ values.
It does not define *stable*. Ours, stated: a **distinct** operating point is a distinct compute
level K (where several settings of the grid reach one K, the lowest-NLL one — chosen on
the same answers, so the grid's curve is slightly optimistic); it is **stable** when its
perplexity is at most ρ × the full model's — ρ = 2 by default (``--stable-ratio``): the
lowest-K rows the seed reports in Table 2 are 1.17–1.62× its highest-K rows' PPL (DeepSeek
K′ 2 vs 5, Qwen3 and OLMoE K′ 3 vs 6), so a point within 2× is one the seed shows as usable
— and no cheaper level of the same curve is better beyond 2 paired SE (a dominated point is
not one a scheduler would pick; the seed's "predictable" curve, §6.3.1).
Counts are also given at ρ = 1.25, 1.10 and 1.05, and, stricter, the **resolved quality
levels**: stable levels, walked from the most compute down, each counted when its NLL is
above the last counted one's beyond 2 paired SE (the seed's "distinct quality levels").

Verdicts are generated from the numbers: an effect of the seed "appears" when the difference
has its sign beyond two standard errors paired over the questions (each answer a cluster of
tokens: Δ = Σ d_i / Σ n_i, SE = √m·sd(d)/Σ n), "does not appear" when it has the opposite sign
beyond two SE, else "not resolved at this n". JSON: ``--json`` (default
``benchmarks/results/prism_ppl.json``).

    python benchmarks/bench_prism_ppl.py [--n 96] [--no-grid] [--stable-ratio 2] [--json OUT]

≈ 5–6 min on 2 cores (the refactoring ≈ 40–75 s, each setting ≈ 10–15 s); ≈ 3.5 min with
``--no-grid``.
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

from bench_macs import _batches, verdict
from bench_prism_points import top_k_prime

RESULTS = Path(__file__).resolve().parent / "results" / "prism_ppl.json"
RHOS = (2.0, 1.25, 1.10, 1.05)
TOP_K = 4  # the embedded model's router


def _subset_ppl(s, mask: np.ndarray) -> float | None:
    n = s.counts[mask].sum()
    return math.exp(float(s.sum_nll[mask].sum() / n)) if n else None


def _paired_acc(a, b) -> tuple[float, float]:
    d = a.exact.astype(float) - b.exact.astype(float)
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


def count_points(levels: list[dict], scores: dict, full_key: str, rho: float) -> dict:
    """``levels``: one dict per distinct K (``K``, ``key``: the setting reaching it with the
    lowest NLL). Stable: PPL ≤ rho × the full model's and no cheaper level of the curve has a
    lower NLL beyond 2 paired SE; resolved: stable levels walked from the most compute down
    whose NLL is above the last counted level's beyond 2 paired SE."""
    from workbench.prism.quality import paired_nll

    full = scores[full_key]

    def dominated(lv) -> bool:  # a cheaper level of the curve is better beyond 2 SE
        for o in levels:
            if o["K"] < lv["K"]:
                d, se = paired_nll(scores[lv["key"]], scores[o["key"]])
                if d > 2 * se:
                    return True
        return False

    stable = [lv for lv in sorted(levels, key=lambda x: -x["K"])
              if scores[lv["key"]].mean_nll - full.mean_nll <= math.log(rho)
              and not dominated(lv)]
    resolved, last = [], None
    for lv in stable:
        if last is None:
            resolved.append(lv["K"])
            last = lv
            continue
        d, se = paired_nll(scores[lv["key"]], scores[last["key"]])
        if d > 2 * se:
            resolved.append(lv["K"])
            last = lv
    return {"rho": rho, "stable": len(stable), "stable_K": [lv["K"] for lv in stable],
            "resolved": len(resolved), "resolved_K": resolved}


def main() -> None:
    from workbench.prism import quality as Q
    from workbench.prism import refactor as R

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=96, help="held-out questions")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--no-grid", action="store_true", help="skip top-k′ × k_active")
    ap.add_argument("--no-global", action="store_true", help="skip the global K = 1 … 15")
    ap.add_argument("--stable-ratio", type=float, default=RHOS[0],
                    help="a point is stable when its PPL ≤ this × the full model's")
    ap.add_argument("--json", default=str(RESULTS), help="write every number here ('': not)")
    a = ap.parse_args()
    t_start = time.perf_counter()
    rt = workbench.Runtime()
    lm = rt.lm
    lay = lm.layout
    if lay.top_k != TOP_K:
        raise SystemExit(f"this study is written for a top-{TOP_K} router, not {lay.top_k}")
    base = dict(pinned_layers=0, cache_slots=lay.num_layers * lay.num_experts)
    batches, _, ex = _batches(a.n, a.batch)
    reqs = [r for b in batches for r in b]
    answers = [ans for _, _, ans in ex]
    text_only = np.array([img is None for img, _, _ in ex])
    work = Path(tempfile.mkdtemp(prefix="prism-ppl-"))
    t0 = time.perf_counter()
    cal = R.calibration_requests(64)
    ref = R.refactor(lm, cal)
    t_refactor = time.perf_counter() - t0
    R.save(ref, work / "annealed")
    N = ref.subexperts
    t0 = time.perf_counter()
    R.save(R.random_control(lm, ref, cal), work / "random")
    t_random = time.perf_counter() - t0

    scores, settings = {}, {}

    def run(key: str, k_prime: int, k_active: int, partition: str | None, name: str,
            k_total: int | None = None) -> None:
        hooks = top_k_prime(lm, k_prime) if k_prime < TOP_K else []
        kw = dict(base)
        if partition is not None:
            kw.update(prism=True, prism_refactoring=str(work / partition))
            kw.update(prism_k=k_total) if k_total is not None else kw.update(
                prism_k_active=k_active)
        t = time.perf_counter()
        try:
            s = Q.score(rt, reqs, answers, batch_size=a.batch, **kw)
        finally:
            for h in hooks:
                h.remove()
        share = (k_prime / TOP_K) * (s.compute_share if s.compute_share is not None else 1.0)
        scores[key] = s
        settings[key] = {"name": name, "k_prime": k_prime, "k_active": k_active,
                         "partition": partition,
                         "K": k_total if k_total is not None else k_prime * k_active,
                         "compute_share": share, "wall_s": time.perf_counter() - t}

    run("top4", 4, N, None, "original, top-4 (full model)")
    for k in (3, 2, 1):
        run(f"top{k}", k, N, None, f"original, top-{k}")
    for k in (4, 3, 2, 1):
        run(f"prism{k}", TOP_K, k, "annealed", f"MoE-Prism annealed, k_active {k}/{N}")
    for k in (3, 2, 1):
        run(f"random{k}", TOP_K, k, "random", f"MoE-Prism random, k_active {k}/{N}")
    if not a.no_global:  # the seed's K: a token's K best of its routed experts' sub-experts
        for K in range(TOP_K * N - 1, 0, -1):
            run(f"global{K}", TOP_K, None, "annealed", f"MoE-Prism annealed, global K {K}",
                k_total=K)
    if not a.no_grid:
        for kp in (3, 2, 1):
            for k in (3, 2, 1):
                run(f"grid{kp}x{k}", kp, k, "annealed",
                    f"top-{kp} × MoE-Prism k_active {k}/{N}")
    full = scores["top4"]
    rows = []
    for key, st in settings.items():
        s = scores[key]
        d, se = Q.paired_nll(s, full)
        da, sea = _paired_acc(s, full)
        rows.append({"key": key, **st, "mean_nll": s.mean_nll, "ppl": s.ppl,
                     "ppl_image": _subset_ppl(s, ~text_only),
                     "ppl_text_only": _subset_ppl(s, text_only),
                     "delta_nll": d, "se": se, "accuracy": float(s.exact.mean()),
                     "delta_accuracy": da, "se_accuracy": sea,
                     "sum_nll": s.sum_nll.tolist(), "exact": s.exact.tolist()})

    # curves of operating points: one level per distinct K, the best setting reaching it
    def levels(keys):
        best: dict[int, str] = {}
        for k in keys:
            K = settings[k]["K"]
            if K not in best or scores[k].mean_nll < scores[best[K]].mean_nll:
                best[K] = k
        return [{"K": K, "key": k, "compute_share": settings[k]["compute_share"]}
                for K, k in sorted(best.items(), reverse=True)]

    curves = {
        "original (top-k′)": levels(["top4", "top3", "top2", "top1"]),
        "MoE-Prism annealed (k_active)": levels(["prism4", "prism3", "prism2", "prism1"]),
        "MoE-Prism random (k_active)": levels(["top4", "random3", "random2", "random1"]),
    }
    if not a.no_global:
        curves["MoE-Prism annealed (global K)"] = levels(
            ["prism4"] + [f"global{K}" for K in range(TOP_K * N - 1, 0, -1)])
    if not a.no_grid:
        curves["top-k′ × MoE-Prism k_active (grid)"] = levels(
            [k for k in settings if settings[k]["partition"] in (None, "annealed")
             and not k.startswith("global")])
    rhos = sorted({a.stable_ratio, *RHOS}, reverse=True)
    counts = {c: [count_points(lv, scores, "top4", r) for r in rhos] for c, lv in curves.items()}

    v = []

    def claim(text, x, y, sign=1):  # x better than y: lower NLL
        d, se = Q.paired_nll(scores[y], scores[x])
        v.append({"claim": text, "diff_nll": d, "se": se,
                  "verdict": verdict(d, se, sign)})

    d_all = float(np.abs(scores["prism4"].sum_nll - full.sum_nll).max())
    v.append({"claim": "with every sub-expert active MoE-Prism scores the full model's NLL "
                       "(exactness)", "max_abs_diff_nll_per_answer": d_all,
              "verdict": "appears" if d_all <= 1e-4 else "does not appear"})
    for k, share in ((3, "75 %"), (2, "50 %"), (1, "25 %")):
        claim(f"at {share} of the expert compute, sub-experts give a lower PPL than dropping "
              f"whole experts (Table 2, Fig. 9)", f"prism{k}", f"top{k}")
        claim(f"at {share}, the annealed partition gives a lower PPL than a random one",
              f"prism{k}", f"random{k}")
    if not a.no_global:  # the seed's K over the routed experts' sub-experts
        for K, share in ((12, "75 %"), (8, "50 %"), (4, "25 %")):
            claim(f"at {share}, a global K = {K} gives a lower PPL than dropping whole experts",
                  f"global{K}", f"top{K // N}")
            claim(f"at {share}, a global K = {K} gives a lower PPL than k_active {K // TOP_K} "
                  f"per expert", f"global{K}", f"prism{K // TOP_K}")
    if not a.no_grid:  # the two knobs together: another way to a quarter of the compute
        claim("at 25 %, top-2 × k_active 2 gives a lower PPL than top-1 (whole experts)",
              "grid2x2", "top1")
        claim("at 25 %, top-2 × k_active 2 gives a lower PPL than k_active 1 of 4 experts",
              "grid2x2", "prism1")
    primary = {c: next(x for x in cs if x["rho"] == a.stable_ratio) for c, cs in counts.items()}
    orig = primary["original (top-k′)"]["stable"]
    for c, p in primary.items():
        if c.startswith("original"):
            continue
        ratio = p["stable"] / orig if orig else float("inf")
        v.append({"claim": f"{c}: over 4× the original's distinct, stable operating points "
                           f"(ρ = {a.stable_ratio:g})",
                  "count": p["stable"], "original": orig, "ratio": ratio,
                  "verdict": "appears" if ratio > 4 else
                  "does not appear" + (" (4× exactly)" if ratio == 4 else "")})
    out = {"n": a.n, "text_only": int(text_only.sum()), "subexperts": N, "top_k": TOP_K,
           "tokens": int(full.counts.sum()), "stable_ratio": a.stable_ratio,
           "refactoring": ref.summary(), "refactor_s": t_refactor, "random_control_s": t_random,
           "rows": rows, "curves": curves, "counts": counts, "verdicts": v}
    out["elapsed_s"] = time.perf_counter() - t_start

    print(f"MoE-Prism operating points by perplexity: embedded model, {a.n} held-out answers "
          f"({out['text_only']} text-only), {out['tokens']} tokens with EOS, N = {N}; "
          f"refactoring {t_refactor:.0f} s (annealed / random objective "
          f"{out['refactoring']['annealed_vs']['random']:.3f}); {out['elapsed_s']:.0f} s\n")
    print("| setting | K /16 | expert compute | PPL | PPL image | PPL text-only | "
          "Δ NLL vs full ± 2 SE (nats/token) | accuracy (teacher-forced) |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['K']} | {r['compute_share']:.0%} | {r['ppl']:.4f} | "
              f"{r['ppl_image']:.4f} | {r['ppl_text_only']:.4f} | "
              f"{r['delta_nll']:+.4f} ± {2 * r['se']:.4f} | {r['accuracy']:.1%} |")
    print("\n| curve | levels K (best setting) | " +
          " | ".join(f"stable ρ={r:g}" for r in rhos) + " | resolved levels (ρ = "
          f"{a.stable_ratio:g}) |\n|---|---|" + "---|" * len(rhos) + "---|")
    for c, cs in counts.items():
        lv = ", ".join(f"{x['K']}" for x in curves[c])
        p = primary[c]
        print(f"| {c} | {lv} | " + " | ".join(str(x["stable"]) for x in cs) +
              f" | {p['resolved']} (K {', '.join(map(str, p['resolved_K']))}) |")
    print("\n| claim | verdict | numbers |\n|---|---|---|")
    for x in v:
        if "diff_nll" in x:
            num = f"Δ NLL {x['diff_nll']:+.4f} ± {2 * x['se']:.4f}"
        elif "ratio" in x:
            num = f"{x['count']} vs {x['original']} ({x['ratio']:.2f}×)"
        else:
            num = f"max |Δ| per answer {x['max_abs_diff_nll_per_answer']:.1e} nats"
        print(f"| {x['claim']} | {x['verdict']} | {num} |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float) + "\n")
        print(f"\n{a.json}")


if __name__ == "__main__":
    main()
