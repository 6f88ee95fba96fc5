"""MoE-Prism elastic execution: wall time vs the unmodified runtime (issue 16 §6: every
sub-expert active ≤ 1.10×) — *measured* on this machine.

The embedded model, one batch (a mixed batch of 8, greedy), every expert resident (the cost of
running sub-experts, not of offloading) and, second, offloaded with a small cache. Every
sub-expert active is timed twice: as a run gets it (``prism_shortcut``, default: whole experts,
the layout unchanged) and through the sub-expert path itself (``prism_shortcut=False``); then
k_active N/2 and 1, and, offloaded, MoE-Prism's sub-expert offloading (``prism_offload``: the
cache holds sub-experts) at k_active N, N/2 and 1. Rounds are interleaved (native, prism all,
prism k_active N/2, …) and the first round is dropped, so the ratios are side by side; the
partition is random (speed does not depend on it).

    python benchmarks/bench_prism_speed.py [--rounds 7] [--device cpu|cuda] [--json FILE]
                                           [--no-offload]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import workbench


def main() -> None:
    from workbench.prism import refactor as R

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the runtime's)")
    ap.add_argument("--json")
    ap.add_argument("--no-offload", dest="offload", action="store_false",
                    help="leave out the sub-expert offloading runs (prism_offload)")
    a = ap.parse_args()
    rt = workbench.Runtime(**({"device": a.device} if a.device else {}))
    lay = rt.lm.layout
    work = Path(tempfile.mkdtemp(prefix="prism-speed-"))
    ref = R.random_refactoring(rt.lm, subexperts=4)
    R.save(ref, work / "p")
    N = ref.subexperts
    reqs = workbench.mixed_batch(a.batch, seed=5)
    settings = {
        "resident": dict(pinned_layers=0, cache_slots=lay.num_layers * lay.num_experts),
        "offloaded": dict(pinned_layers=1, cache_slots=lay.num_experts * 4),
    }
    runs = {"native": {}, f"prism {N}/{N}": dict(prism=True),
            f"prism {N}/{N}, sub-expert path": dict(prism=True, prism_shortcut=False),
            f"prism {N // 2}/{N}": dict(prism=True, prism_k_active=N // 2),
            f"prism 1/{N}": dict(prism=True, prism_k_active=1)}
    if a.offload:  # MoE-Prism's sub-expert offloading (the offloaded setting only)
        runs.update({f"prism_offload {k}/{N}": dict(prism=True, prism_offload=True,
                                                    prism_shortcut=False, prism_k_active=k)
                     for k in (N, N // 2, 1)})
    out = {"device": str(rt.lm.device), "batch": a.batch, "max_new_tokens": a.max_new_tokens, "subexperts": N,
           "rounds": a.rounds, "settings": {}}
    for sname, s in settings.items():
        times: dict[str, list[float]] = {r: [] for r in runs}
        tokens = {}
        for i in range(a.rounds):
            for rname, kw in runs.items():
                if kw.get("prism_offload") and sname == "resident":
                    continue  # every expert resident: nothing is offloaded
                if kw:
                    kw = dict(kw, prism_refactoring=str(work / "p"))
                t0 = time.perf_counter()
                res = rt.run(reqs, max_new_tokens=a.max_new_tokens, record=False, **s, **kw)
                if i:
                    times[rname].append(time.perf_counter() - t0)
                tokens[rname] = [r["token_ids"] for r in res.batch]
        med = {r: statistics.median(t) for r, t in times.items() if t}
        out["settings"][sname] = {
            "median_s": med, "ratio": {r: med[r] / med["native"] for r in med},
            # every sub-expert active, on every path that ran: the native answers
            "all_equal_native": all(tokens[r] == tokens["native"] for r in (
                f"prism {N}/{N}", f"prism {N}/{N}, sub-expert path",
                f"prism_offload {N}/{N}") if r in tokens)}
        print(f"{sname}: " + ", ".join(f"{r} {med[r]:.3f} s ({med[r] / med['native']:.2f}×)"
                                       for r in med)
              + f"; all sub-experts = native answers: "
                f"{out['settings'][sname]['all_equal_native']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
