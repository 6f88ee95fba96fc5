"""MoE-Prism's offline refactoring of every expert of the embedded model (issue 16 §1, §6):
how long it takes here and how good the partitions are — *measured*.

``workbench.prism.refactor.refactor`` on the embedded model: the neuron activations of 64
balanced calibration requests (its own seed; at most ``--max-tokens`` tokens per expert), then
every expert (12 layers × 64 = 768, 64 neurons each) partitioned into N = 4 sub-experts by
greedy initialisation + simulated annealing with the seed's settings (T0 = 100, cooling
0.995, ``--iterations`` 100 000 per expert), K = 2 de-activated sub-experts in the objective,
in parallel over the experts (numba threads; the first call also compiles). Reports the
profile and annealing wall times (goal: ≤ 60 s for the annealing at 100 000 iterations) and
the objective (seed eq. 2, summed over the experts) of the annealed partition against the
greedy start, a random and the contiguous partition.

    python benchmarks/bench_prism_refactor.py [--iterations 100000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numba


def main() -> None:
    from workbench.prism import partition as P
    from workbench.prism import refactor as R

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=P.ITERATIONS)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    rt = workbench.Runtime()
    t0 = time.perf_counter()
    P.anneal_many([P.contiguous(4, 4)[None].astype(float)], 4, iterations=10)  # compile
    compile_s = time.perf_counter() - t0
    ref = R.refactor(rt.lm, R.calibration_requests(a.requests), iterations=a.iterations,
                     max_tokens=a.max_tokens)
    s = ref.summary()
    out = {"iterations": a.iterations, "requests": a.requests, "max_tokens": a.max_tokens,
           "threads": numba.get_num_threads(), "compile_s": compile_s,
           "profile_s": ref.meta["profile_s"], "anneal_s": ref.meta["anneal_s"], **s}
    print(f"{s['experts']} experts ({s['tokens_mean']:.0f} calibration tokens each on average), "
          f"{a.iterations} iterations each on {out['threads']} threads: profile "
          f"{out['profile_s']:.1f} s, annealing {out['anneal_s']:.1f} s (compile "
          f"{compile_s:.1f} s, not included)")
    print("| partition | objective (Σ over experts) | annealed / it |")
    print("|---|---|---|")
    for k, v in s["objective"].items():
        ratio = s["annealed_vs"].get(k)
        print(f"| {k} | {v:.1f} | {'' if ratio is None else f'{ratio:.3f}'} |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
