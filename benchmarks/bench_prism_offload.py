"""MoE-Prism sub-expert offloading vs whole-expert offloading (issue 16 §4; seed 001 Fig. 8) —
routing *measured* on the embedded model, latency *modeled*.

The embedded model is refactored (``--requests`` calibration requests, N = 4, the paper's
100 000 annealing iterations) and runs ``--n`` held-out questions in batches of 8 with
``prism=True`` at k_active 2 and 3 of 4 (and once natively, prism off), each batch recorded to
a run store. Every store is then replayed (the one simulation core, :mod:`workbench.replay`)
over memory budgets — an expert cache of ``cache_slots`` expert-sized slots, no pinned layer —
twice: **whole-expert** offloading (a routed expert is fetched whole though only its k_active
sub-experts run) and **sub-expert** offloading (``prism_offload``: the same memory in slots of
1/4 of an expert; only the sub-experts a token runs are fetched). Both price the same compute
(an expert's op: the FLOPs of its sub-expert runs, the bytes of the distinct sub-experts read).
Priced as Qwen3-VL-30B-A3B experts on an H200 over PCIe 5 (``--profile``, ``--target``).

Reported per budget: the mean modeled latency of a decode step, the prefill's, the hit rate
of the cache's own keys (experts, or sub-experts: the share of the bytes the tokens ran that
were resident) and the bytes copied per decode step. Verdicts come from the numbers.

    python benchmarks/bench_prism_offload.py [--n 48] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np

from bench_macs import _batches

TARGET = "qwen3-vl-30b-a3b"
PROFILE = "h200"
SEED_DELTA = -0.1036  # seed 001 Fig. 8: sub-expert offloading, decode latency vs expert offloading


def _replays(stores: list[Path], slots: int, sub: bool, profile: str, target: str) -> dict:
    """One granularity at one budget over every store: decode/prefill latency, hits, bytes."""
    dec, pre, hits, acc, moved, steps = [], [], 0, 0, 0.0, 0
    for path in stores:
        ds = workbench.open_run(path)
        r = workbench.replay_trace(ds, cache_slots=slots, pinned_layers=0, profile=profile,
                                   target_model=target, prefetch="none", prism_offload=sub,
                                   belady=False)
        phase = ds.phase.values
        dec += list(r.step_latency_s[phase == 1])
        pre += list(r.step_latency_s[phase == 0])
        hits += int(r.hits.sum())
        acc += r.accesses
        moved += r.loads * r.expert_bytes
        steps += int((phase == 1).sum())
    return {"decode_step_s": float(np.mean(dec)), "prefill_s": float(np.mean(pre)),
            "hit_rate": hits / acc if acc else None,
            "bytes_per_decode_step": moved / max(steps, 1)}


def study(rt, refactoring: Path, batches: list, work: Path, max_new_tokens: int = 24,
          k_actives=(2, 3), fractions=(6, 12, 25, 50, 75), profile: str = PROFILE,
          target: str = TARGET) -> dict:
    """Record ``batches`` (lists of requests) with ``rt`` natively and with ``prism=True`` at
    each of ``k_actives`` (the refactoring in ``refactoring``), every expert resident, then
    replay every store at budgets of ``fractions`` % of the experts, whole-expert and
    sub-expert offloading; returns every row and the verdicts."""
    import workbench.prism.refactor as R

    lay = rt.lm.layout
    L, E = lay.num_layers, lay.num_experts
    N = R.load(refactoring, rt.lm).subexperts
    record = dict(max_new_tokens=max_new_tokens, pinned_layers=0, cache_slots=L * E,
                  prefetch="none")
    settings = {"native": {}, **{f"k_active {k}/{N}": dict(
        prism=True, prism_refactoring=str(refactoring), prism_k_active=k) for k in k_actives}}
    stores: dict[str, list[Path]] = {}
    for name, kw in settings.items():
        stores[name] = []
        for i, reqs in enumerate(batches):
            path = work / f"{name.replace('/', '-').replace(' ', '_')}_{i}.zarr"
            rt.run(reqs, store=path, **record, **kw)
            stores[name].append(path)
    budgets = sorted({max(lay.top_k, L * E * f // 100) for f in fractions})  # ≥ top-k
    out = {"n": sum(len(b) for b in batches), "subexperts": N, "profile": profile,
           "target_model": target, "experts": L * E, "budgets": budgets,
           "max_new_tokens": max_new_tokens, "rows": []}
    for name in settings:
        for slots in budgets:
            row = {"setting": name, "cache_slots": slots,
                   "whole": _replays(stores[name], slots, False, profile, target)}
            if name != "native":
                row["sub"] = _replays(stores[name], slots, True, profile, target)
                row["decode_delta"] = (row["sub"]["decode_step_s"]
                                       / row["whole"]["decode_step_s"] - 1)
            out["rows"].append(row)
    v = []
    for name in settings:
        if name == "native":
            continue
        deltas = [r["decode_delta"] for r in out["rows"] if r["setting"] == name]
        best = min(deltas)
        v.append({"claim": f"{name}: sub-expert offloading lowers the modeled decode-step "
                           f"latency vs whole-expert offloading at the same memory (seed Fig. 8:"
                           f" {SEED_DELTA:+.2%})",
                  "deltas": deltas,
                  "verdict": ("appears at every budget" if max(deltas) < 0 else
                              "appears at some budgets" if best < 0 else "does not appear")
                             + f" (best {best:+.1%}, at "
                             f"{budgets[deltas.index(best)]} of {L * E} expert slots)"})
    out["verdicts"] = v
    return out


def report(out: dict) -> None:
    """The study's table and verdicts, as markdown."""
    print("| setting | slots (of %d) | whole: decode ms | sub: decode ms | Δ | whole: hit rate "
          "| sub: hit rate | whole: MB/decode step | sub: MB/decode step |" % out["experts"])
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        w, s = r["whole"], r.get("sub")
        print(f"| {r['setting']} | {r['cache_slots']} | {w['decode_step_s'] * 1e3:.3f} | "
              + (f"{s['decode_step_s'] * 1e3:.3f} | {r['decode_delta']:+.1%} | " if s else
                 "— | — | ")
              + f"{w['hit_rate']:.1%} | " + (f"{s['hit_rate']:.1%} | " if s else "— | ")
              + f"{w['bytes_per_decode_step'] / 1e6:.1f} | "
              + (f"{s['bytes_per_decode_step'] / 1e6:.1f} |" if s else "— |"))
    print("\n| claim | verdict |\n|---|---|")
    for x in out["verdicts"]:
        print(f"| {x['claim']} | {x['verdict']} |")


def main() -> None:
    from workbench.prism import refactor as R

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    rt = workbench.Runtime()
    work = Path(tempfile.mkdtemp(prefix="prism-offload-"))
    ref = R.refactor(rt.lm, R.calibration_requests(a.requests))
    R.save(ref, work / "p")
    batches, _, _ = _batches(a.n, 8)
    out = study(rt, work / "p", batches, work, a.max_new_tokens, profile=a.profile,
                target=a.target)
    out["elapsed_s"] = time.perf_counter() - t0
    print(f"MoE-Prism sub-expert offloading: embedded model, {a.n} held-out questions in "
          f"batches of 8, N = {out['subexperts']}; modeled {a.target} on {a.profile}; "
          f"{out['elapsed_s']:.0f} s\n")
    report(out)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
