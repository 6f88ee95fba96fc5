"""The papers' batch regime and the regime map (issue 39 §4–5): MACS (seed 002 Fig. 2, Table 1)
and ReaLB (seed 004 Table 1: its speedup and FP4-All) over batch size × hardware profile.

Inputs: the embedded model's held-out split (``make_split(HELDOUT_SEED, n)``), run live in
batches of B requests (B = 8 … 256; n = max(B, ``--n-min``) questions per B, the same first n
for every method), greedy, answers scored by exact match; every expert resident; 8 virtual EP
ranks; each method (``workbench.analysis.regimes.METHODS``: vanilla, CAI-MoE Token Drop and
MACS at γ0 = 1 and 0.5 — capacity on the prefill, the knob's default —, FP4-All and ReaLB with
NVFP4 W4A4 emulated inside the experts and the paper's gate Γ = 2048) changes the routing as it
really does. Each batch's prefill steps are then priced by the one EP clock
(``ds.moe.ep_times(profile=, interconnect=)``) as Qwen3-VL-30B-A3B on every hardware row of
``regimes.HARDWARE`` — *modeled*; accuracy and wall times are *measured*.

Reported: the modeled prefill MoE-layer speedup vs vanilla per (method, hardware, B), with the
vanilla prefill's tokens per expert and its busiest expert's tokens beside each profile's
ridge (tokens per expert where an expert stops being memory-bound); the crossover batch where
the speedup passes 1.0 or the computed reason none exists; the papers' operating points; the
accuracy change vs vanilla paired per question (± 2 SE, n stated). Verdicts are generated
from the numbers.

    python benchmarks/regime_map.py [--quick] [--json OUT] [--batches 8 16 …] [--n-min 64]
        [--keep DIR] [--target-model NAME] [--reprice EARLIER_JSON --keep DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP

from workbench.analysis import regimes as G

FULL_BATCHES = (8, 16, 32, 64, 128, 256)
QUICK_BATCHES = (8, 32)


def verdicts(mp: dict, measured: dict) -> list[dict]:
    """The papers' claims against the map (module docstring)."""
    v = []
    rows = mp["rows"]

    def at(method, prof, link):
        return sorted((r for r in rows if r["method"] == method and r["profile"] == prof
                       and r["interconnect"] == link), key=lambda r: r["batch"])

    macs = G.PAPER_POINTS["macs"]
    rs = at("MACS γ0=0.5", macs["profile"], macs["interconnect"])
    if rs:
        best = max(rs, key=lambda r: r["speedup"])
        v.append({"claim": "MACS speeds up a single MoE layer up to 1.97× at γ0 = 0.5 (Fig. 2; "
                           "8 × A100)",
                  "best_speedup_modeled": best["speedup"], "at_batch": best["batch"],
                  "verdict": ("appears (> 1.5×)" if best["speedup"] > 1.5 else
                              "appears, smaller (1 < speedup ≤ 1.5×)" if best["speedup"] > 1.0
                              else "does not appear")})
        v.append({"claim": "the speedup grows with the batch (compute-bound experts)",
                  "speedups": [round(r["speedup"], 3) for r in rs],
                  "verdict": "appears" if all(b >= a for a, b in zip(
                      [r["speedup"] for r in rs], [r["speedup"] for r in rs][1:]))
                  else "does not appear (not monotone)"})
    realb = G.PAPER_POINTS["realb"]
    for method, lo, hi in (("ReaLB", 1.10, 1.32), ("FP4-All", 1.12, 1.41)):
        rs = [r for r in at(method, realb["profile"], realb["interconnect"])
              if r["assignments"] > realb["gate_assignments"]]
        if not rs:
            continue
        sp = [r["speedup"] for r in rs]
        hit = [r["batch"] for r in rs if r["speedup"] >= lo]
        above = [r["batch"] for r in rs if r["speedup"] > 1.0]
        v.append({"claim": f"{method} speeds up by {lo:.2f}–{hi:.2f}× (Table 1) at the batches "
                           f"its gate passes, 8 × RTX 5090 with NVLink",
                  "speedups_modeled": [round(x, 3) for x in sp],
                  "batches": [r["batch"] for r in rs],
                  "verdict": (f"appears (≥ {lo:.2f}× at every batch)" if len(hit) == len(rs)
                              else f"appears at B = {hit} only" if hit
                              else f"smaller: above 1.0 at B = {above} only, never {lo:.2f}×"
                              if above else "does not appear")})
    cells = {(c["batch"], c["method"]): c for c in measured["cells"]}
    for g in ("1", "0.5"):
        res = []
        for b in mp["batches"]:
            m, t = cells.get((b, f"MACS γ0={g}")), cells.get((b, f"Token Drop γ0={g}"))
            if m and t:
                d, se = G.paired(m["correct"], t["correct"])
                res.append((b, d, se))
        if res:
            better = [b for b, d, se in res if d > 2 * se]
            worse = [b for b, d, se in res if d < -2 * se]
            v.append({"claim": f"MACS keeps more answers than Token Drop at γ0 = {g} "
                               f"(Tables 1/4), per batch",
                      "diff_se": [(b, round(d, 3), round(se, 3)) for b, d, se in res],
                      "verdict": (f"appears at B = {better}" if better else
                                  f"opposite at B = {worse}" if worse
                                  else "not resolved at any batch (within 2 SE)")})
    for method in ("MACS γ0=1", "MACS γ0=0.5", "FP4-All", "ReaLB"):
        rs = [r for r in rows if r["method"] == method and r["profile"] == rows[0]["profile"]
              and r["interconnect"] == rows[0]["interconnect"]]
        worse = [r["batch"] for r in rs if r["delta"] + 2 * r["se"] < 0]
        v.append({"claim": f"{method} costs no answers vs vanilla (paired, 2 SE)",
                  "batches_worse_beyond_2se": worse,
                  "verdict": "no loss beyond 2 SE at any batch" if not worse else
                  f"loses answers beyond 2 SE at B = {', '.join(map(str, worse))}"})
    return v


def _fmt(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def report(out: dict) -> str:
    mp = out["map"]
    B = mp["batches"]
    L = [f"Regime map: embedded model, batches {B}, n per batch {out['n_per_batch']}, "
         f"{G.RANKS} virtual EP ranks, priced as {mp['target_model']} (prefill steps; "
         f"*modeled*); accuracy *measured*; {out['elapsed_s']:.0f} s measured\n"]
    load = {c["batch"]: c["load"] for c in out["measured"]["cells"] if c["method"] == "vanilla"}
    L.append("### Vanilla prefill loads (mean over prefill layer calls)\n")
    L.append("| B | prefill tokens | tokens per expert | busiest expert | tokens per rank | "
             "busiest rank |\n|---|---|---|---|---|---|")
    for b in B:
        x = load[b]
        L.append(f"| {b} | {x['tokens']:.0f} | {x['tokens_per_expert']:.0f} | "
                 f"{x['busiest_expert']:.0f} | {x['tokens_per_rank']:.0f} | "
                 f"{x['busiest_rank']:.0f} |")
    L.append("\n### Vanilla prefill MoE layers on each hardware row (modeled ms per batch: "
             "its prefill's 12 MoE layers, dispatch / slowest rank / combine)\n")
    L.append("| hardware | " + " | ".join(f"B={b}" for b in B) + " |\n|" + "---|" * (len(B) + 1))
    for prof, link, _ in mp_hw(out):
        cl = {c["batch"]: {k: v * 1e3 / c["batches"] for k, v in
                           c["clock"][f"{prof}|{link}"].items()}
              for c in out["measured"]["cells"] if c["method"] == "vanilla"}
        L.append(f"| {prof} / {link} | " + " | ".join(
            f"{cl[b]['moe_layer_s']:.2f} ({cl[b]['dispatch_s']:.2f} / "
            f"{cl[b]['compute_s']:.2f} / {cl[b]['combine_s']:.2f})" for b in B) + " |")
    low = {(c["batch"], c["method"]): c["load"].get("low_share", 0.0)
           for c in out["measured"]["cells"]}
    L.append("\nReaLB's prefill (layer call, rank) cells in NVFP4 (measured, live controller): " +
             ", ".join(f"B={b} {low.get((b, 'ReaLB'), 0.0):.1%}" for b in B) + "; FP4-All: " +
             ", ".join(f"{low.get((b, 'FP4-All'), 0.0):.0%}" for b in B))
    L.append("\n### Ridge per profile (tokens per expert where compute = weight read)\n")
    L.append("| profile | interconnect | ridge FLOP/B | ridge tokens (bf16) | ridge tokens (NVFP4 "
             "where it has FP4) | stands for |\n|---|---|---|---|---|---|")
    for prof, link, what in mp_hw(out):
        r = next(r for r in mp["rows"] if r["profile"] == prof and r["interconnect"] == link)
        low = next((x["ridge_tokens_low"] for x in mp["rows"] if x["profile"] == prof
                    and x["precision"] == "nvfp4" and x["supported"]), None)
        L.append(f"| {prof} | {link} | {r['ridge_flop_per_byte']:.0f} | "
                 f"{r['ridge_tokens']:.0f} | {_fmt(low, '.0f')} | {what} |")
    head = "| method | profile | interconnect | " + " | ".join(f"B={b}" for b in B) + \
           " | crossover (speedup > 1 from) | paper's point |\n|" + "---|" * (len(B) + 5)
    L.append("\n### Modeled prefill MoE-layer speedup vs vanilla\n")
    L.append(head)
    for s in mp["series"]:
        sp = dict(zip(s["batches"], s["speedups"]))
        x = s["crossover"]
        cross = (f"B ≤ {x['batch']:g} (every batch)" if x and x["at_smallest"] else
                 f"B = {x['batch']:g} (≈ {x['estimate']:.0f})" if x else f"none: {s['reason']}")
        op = s["paper_point"]
        opt = "–" if op is None else (f"{op['claim']}; batch: {op['batch']}" +
                                      (f"; Γ reached from B = {op['first_batch_in_regime']}"
                                       if op.get("first_batch_in_regime") else ""))
        L.append(f"| {s['method']} | {s['profile']} | {s['interconnect']} | " +
                 " | ".join(f"{sp[b]:.2f}×" if b in sp else "–" for b in B) +
                 f" | {cross} | {opt} |")
    L.append("\n### Accuracy vs vanilla (measured, paired per question; Δ ± 2 SE)\n")
    L.append("| method | " + " | ".join(f"B={b}" for b in B) + " |\n|" + "---|" * (len(B) + 1))
    hw0 = mp_hw(out)[0]
    for m in dict.fromkeys(r["method"] for r in mp["rows"]):
        cells = {r["batch"]: r for r in mp["rows"] if r["method"] == m
                 and (r["profile"], r["interconnect"]) == hw0[:2]}
        L.append(f"| {m} | " + " | ".join(
            f"{cells[b]['accuracy']:.1%} ({cells[b]['delta']:+.3f} ± {2 * cells[b]['se']:.3f}, "
            f"n {cells[b]['n']})" if b in cells else "–" for b in B) + " |")
    L.append("| vanilla | " + " | ".join(
        f"{next(c['accuracy'] for c in out['measured']['cells'] if c['batch'] == b and c['method'] == 'vanilla'):.1%}"
        for b in B) + " |")
    L.append("\n### Verdicts\n")
    for v in out["verdicts"]:
        num = ", ".join(f"{k} {v[k]}" for k in v if k not in ("claim", "verdict"))
        L.append(f"- {v['claim']}: **{v['verdict']}** ({num})")
    return "\n".join(L)


def mp_hw(out: dict) -> list:
    return [tuple(h) for h in out["measured"]["hardware"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"batches {QUICK_BATCHES}, n-min 32 (a smoke run)")
    ap.add_argument("--batches", type=int, nargs="+", help=f"default {FULL_BATCHES}")
    ap.add_argument("--n-min", type=int, default=None,
                    help="questions per batch size at least (default 64; 32 with --quick)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--keep", help="keep the run stores in this folder")
    ap.add_argument("--target-model", default=G.TARGET,
                    help=f"price the routing as this model (default {G.TARGET})")
    ap.add_argument("--reprice", metavar="JSON",
                    help="rerun nothing: price the stores kept (--keep DIR) by the run that "
                         "wrote JSON, with its answers, as --target-model")
    a = ap.parse_args()
    if a.reprice:
        if not a.keep:
            raise SystemExit("--reprice needs --keep DIR: the folder of the kept stores")
        t0 = time.perf_counter()
        prev = json.loads(Path(a.reprice).read_text())
        measured = G.reprice(prev["measured"], a.keep, a.target_model)
        mp = G.regime_map(measured)
        out = {**{k: prev[k] for k in ("batches", "n_per_batch", "max_new_tokens")},
               "measured": measured, "map": mp, "repriced_from": a.reprice,
               "elapsed_s": time.perf_counter() - t0}
        out["verdicts"] = verdicts(mp, measured)
        print(report(out))
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1, default=float))
        return
    batches = tuple(a.batches or (QUICK_BATCHES if a.quick else FULL_BATCHES))
    n_min = a.n_min or (32 if a.quick else 64)
    for b in batches:
        if b < 1:
            raise SystemExit(f"--batches: every batch must be ≥ 1, not {b}")
    t0 = time.perf_counter()
    rt = workbench.Runtime()
    runs, n_per = {}, {}
    with tempfile.TemporaryDirectory() as d:
        work = Path(a.keep) if a.keep else Path(d)
        work.mkdir(parents=True, exist_ok=True)
        for b in batches:
            n = max(b, n_min)
            n -= n % b  # whole batches
            n_per[b] = n
            runs[b] = G.record(b, n, G.METHODS, work, rt, a.max_new_tokens)
            print(f"B = {b}: {n} questions × {len(G.METHODS)} methods recorded "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        measured = G.measure(runs, target_model=a.target_model)
    mp = G.regime_map(measured)
    out = {"batches": list(batches), "n_per_batch": n_per, "max_new_tokens": a.max_new_tokens,
           "measured": measured, "map": mp, "elapsed_s": time.perf_counter() - t0}
    out["verdicts"] = verdicts(mp, measured)
    print(report(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
