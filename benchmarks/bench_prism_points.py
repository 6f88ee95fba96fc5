"""MoE-Prism's operating points on the embedded model (issue 16 §2, first measurement) —
accuracy *measured*.

A refactoring of the embedded model (64 calibration requests of its own seed, N = 4, 100 000
annealing iterations per expert) and, as a control, one with *random* partitions (the same
profiled activations pick its gate neurons). Then ``--n`` held-out questions in batches of 8
(greedy, exact-match answers, every expert resident) under:

- the original model with top-k′ routing, k′ = 4 (its own), 3, 2, 1 — whole experts dropped
  (the router's best k′ of its top-4, weights renormalised over them: what top-k′ routing of
  a renormalising router gives);
- MoE-Prism with the router's 4 experts, each running its k_active = 4, 3, 2, 1 best
  sub-experts by the proxy gate, annealed and random partitions.

Reported per setting: accuracy, its paired change vs the original model ± 2 SE, and the
share of expert compute it runs (k′/4, or k_active/N). Whether the sub-expert dial keeps more
answers than dropping whole experts at the same compute is the seed's Fig. 9 claim ("a smooth
quality/cost dial instead of a cliff"); a verdict compares them at 75 %, 50 % and 25 %.
Also the wall time of elastic execution with every sub-expert active vs the unmodified runtime
(medians of interleaved rounds on one batch; goal ≤ 1.10×).

The operating points also go into the package (``--ship``, default
``workbench/prism/operating_points.json``, package data): the dashboard's *Elastic experts*
card draws them and cannot read ``benchmarks/``. ``--ship-from RESULTS`` rewrites that file from
a results JSON of this benchmark without running anything.

    python benchmarks/bench_prism_points.py [--n 96] [--json OUT] [--ship PATH | --ship '']
    python benchmarks/bench_prism_points.py --ship-from benchmarks/results/prism_points.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import statistics
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np
import torch

from bench_macs import _batches, paired, verdict

#: where the dashboard reads the operating points (package data of workbench.prism)
SHIPPED = Path(workbench.__file__).resolve().parent / "prism" / "operating_points.json"
SHIPPED_FORMAT = "workbench-prism-points/1"
_ROW = re.compile(r"original, top-(\d+)|MoE-Prism (annealed|random), k_active (\d+)/\d+")


def shipped(out: dict, model_id: str, config_hash: str) -> dict:
    """The operating points of a results dict (:func:`main`'s ``out``) as the dashboard reads
    them: per curve (``top_k``: whole experts dropped; ``prism``: annealed partition;
    ``prism_random``: random partitions) the points ``k``, ``compute_share``, ``accuracy``
    and ``se`` (the accuracy's binomial standard error over the questions), in k order."""
    curves: dict[str, list] = {"top_k": [], "prism": [], "prism_random": []}
    for r in out["rows"]:
        m = _ROW.fullmatch(r["name"])
        if m is None:
            raise ValueError(f"unknown row {r['name']!r}")
        curve = "top_k" if m[1] else "prism" if m[2] == "annealed" else "prism_random"
        n, acc = len(r["correct"]), r["accuracy"]
        curves[curve].append({"k": int(m[1] or m[3]), "compute_share": r["compute_share"],
                              "accuracy": acc, "se": math.sqrt(acc * (1 - acc) / n)})
    return {"format": SHIPPED_FORMAT, "source": "benchmarks/bench_prism_points.py",
            "model_id": model_id, "config_hash": config_hash, "n": out["n"],
            "text_only": out["text_only"], "subexperts": out["subexperts"],
            "curves": {k: sorted(v, key=lambda p: p["k"]) for k, v in curves.items()},
            "verdicts": [{k: x[k] for k in ("claim", "verdict")} for x in out["verdicts"]]}


def ship(out: dict, path: str | Path, model_id: str, config_hash: str) -> None:
    Path(path).write_text(json.dumps(shipped(out, model_id, config_hash), indent=1) + "\n")
    print(f"operating points for the dashboard: {path}")


def top_k_prime(lm, k: int):
    """Forward pre-hooks that keep each token's k best routed experts (by weight,
    renormalised over them) and give the others weight 0 — the output of top-k′ routing (the
    dropped experts still run here, at no weight: the compute share is counted as k′/4)."""

    def pre(module, args, kwargs):
        args = list(args)
        w = args[2] if len(args) > 2 else kwargs["top_k_weights"]
        order = torch.argsort(w, dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(w, dtype=torch.bool).scatter_(-1, order[:, k:], True)
        w = w.masked_fill(drop, 0)
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
        if len(args) > 2:
            args[2] = w
        else:
            kwargs = {**kwargs, "top_k_weights": w}
        return tuple(args), kwargs

    return [b.experts.register_forward_pre_hook(pre, with_kwargs=True) for b in lm.layout.blocks]


def main() -> None:
    from workbench.prism import partition as P
    from workbench.prism import refactor as R

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--iterations", type=int, default=P.ITERATIONS)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--json")
    ap.add_argument("--ship", default=str(SHIPPED),
                    help="also write the operating points the dashboard ships here ('': not)")
    ap.add_argument("--ship-from", metavar="RESULTS",
                    help="only rewrite --ship from a results JSON of this benchmark (the "
                         "embedded model's)")
    a = ap.parse_args()
    if a.ship_from:
        from workbench.models.embedded import EMBEDDED_MODEL_DIR

        raw = (Path(EMBEDDED_MODEL_DIR) / "config.json").read_bytes()  # the loader's hash
        ship(json.loads(Path(a.ship_from).read_text()), a.ship, Path(EMBEDDED_MODEL_DIR).name,
             hashlib.sha256(raw).hexdigest()[:16])
        return
    t_start = time.perf_counter()
    rt = workbench.Runtime()
    lm = rt.lm
    lay = lm.layout
    base = dict(max_new_tokens=a.max_new_tokens, pinned_layers=0,
                cache_slots=lay.num_layers * lay.num_experts, record=False)
    work = Path(tempfile.mkdtemp(prefix="prism-points-"))
    reqs = R.calibration_requests(64)
    ref = R.refactor(lm, reqs, iterations=a.iterations)
    R.save(ref, work / "annealed")
    # the control: random partitions, gate neurons picked on the same activations
    rnd = R.random_control(lm, ref, reqs)
    N = ref.subexperts
    R.save(rnd, work / "random")
    batches, truth, ex = _batches(a.n, 8)

    def run(**kw) -> dict:
        answers, ran, asked = [], 0, 0
        from workbench.analysis.vismmoe.accuracy import normalise_answer

        for reqs_b in batches:
            res = rt.run(reqs_b, **base, **kw)
            answers += [normalise_answer(t) for t in res.texts]
            ran, asked = ran + res.subexperts_ran, asked + res.subexperts_asked
        correct = [x == y for x, y in zip(answers, truth)]
        return {"accuracy": float(np.mean(correct)), "correct": correct,
                "compute_share": ran / asked if asked else None}

    rows = {}
    native = run()
    rows["original, top-4"] = {**native, "compute_share": 1.0}
    for k in (3, 2, 1):
        hooks = top_k_prime(lm, k)
        try:
            rows[f"original, top-{k}"] = {**run(), "compute_share": k / 4}
        finally:
            for h in hooks:
                h.remove()
    for name in ("annealed", "random"):
        for k in ((4, 3, 2, 1) if name == "annealed" else (3, 2, 1)):
            rows[f"MoE-Prism {name}, k_active {k}/{N}"] = run(
                prism=True, prism_refactoring=str(work / name), prism_k_active=k)
    out = {"n": a.n, "text_only": sum(img is None for img, _, _ in ex), "subexperts": N,
           "refactoring": ref.summary(), "rows": []}
    for name, r in rows.items():
        diff, se = paired(r, native)
        out["rows"].append({"name": name, "accuracy": r["accuracy"], "delta": diff, "se": se,
                            "compute_share": r["compute_share"], "correct": r["correct"]})
    v = []
    for k, share in ((3, "75 %"), (2, "50 %"), (1, "25 %")):
        p, o = rows[f"MoE-Prism annealed, k_active {k}/{N}"], rows[f"original, top-{k}"]
        diff, se = paired(p, o)
        v.append({"claim": f"at {share} of the expert compute, sub-experts keep more answers "
                           f"than dropping whole experts (Fig. 9)", "diff": diff, "se": se,
                  "verdict": verdict(diff, se, +1)})
        q = rows[f"MoE-Prism random, k_active {k}/{N}"]
        diff, se = paired(p, q)
        v.append({"claim": f"at {share}, the annealed partition keeps more answers than a "
                           f"random one", "diff": diff, "se": se,
                  "verdict": verdict(diff, se, +1)})
    out["verdicts"] = v
    # wall time: all sub-experts vs the unmodified runtime, one batch, interleaved rounds
    times = {"off": [], "on": []}
    for r in range(6):
        for name, kw in (("off", {}), ("on", dict(prism=True,
                                                  prism_refactoring=str(work / "annealed")))):
            t0 = time.perf_counter()
            rt.run(batches[0], **base, **kw)
            if r:
                times[name].append(time.perf_counter() - t0)
    out["wall_ratio_all_subexperts"] = statistics.median(times["on"]) / statistics.median(
        times["off"])
    out["elapsed_s"] = time.perf_counter() - t_start
    print(f"MoE-Prism operating points: embedded model, {a.n} held-out questions "
          f"({out['text_only']} text-only), N = {N}; refactoring objective annealed / random "
          f"{out['refactoring']['annealed_vs']['random']:.3f}; {out['elapsed_s']:.0f} s\n")
    print("| setting | expert compute | accuracy | Δ vs original ± 2 SE |\n|---|---|---|---|")
    for r in out["rows"]:
        print(f"| {r['name']} | {r['compute_share']:.0%} | {r['accuracy']:.1%} | "
              f"{r['delta']:+.1%} ± {2 * r['se']:.1%} |")
    print("\n| claim | verdict | Δ ± 2 SE |\n|---|---|---|")
    for x in v:
        print(f"| {x['claim']} | {x['verdict']} | {x['diff']:+.1%} ± {2 * x['se']:.1%} |")
    print(f"\nwall time, every sub-expert active vs the unmodified runtime: "
          f"{out['wall_ratio_all_subexperts']:.2f}× (goal ≤ 1.10×)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float))
    if a.ship:
        ship(out, a.ship, lm.model_id, lm.config_hash)


if __name__ == "__main__":
    main()
