"""ActiveEvict's figures on the embedded default model (issue 39 §7): dynamic top-k (Fig. 8),
the importance ablation (Fig. 7) and the α sweep (Fig. 9).

Live runs over the held-out requests of :mod:`bench_caching_live` (``--per-kind`` of every task
kind, each decoding its real answer, at most ``--tokens`` tokens), on the same runtime (costs
*modeled* as Qwen3-VL-30B-A3B experts on the A100-40GB profile, ``pinned_layers=1``, router
lookahead 2). Every run is recorded to a temporary store so decode steps can be told from the
prefill; blocking I/O is the modeled compute-lane stall. Each request is its own run (the
cache starts empty).

**Fig. 8, dynamic top-k** (ActiveEvict on, off/on): over cache sizes × the release slack
``ae_rmax`` (r_max of eq. 16: the redundancy slots the pre-eviction frees beyond the predicted
misses, which is what the free-slot budget B − H_l of eq. 18 holds at the next gate). Per
budget: decode blocking I/O per decode step and per request (total), decode loads per step, the
mean k and the share of decode (step, offloaded layer) pairs narrowed, answers correct vs
expected (free-running greedy, with and without), and top-1 agreement / KL against the
reference (teacher-forced, :meth:`workbench.Runtime.quality`).

**Fig. 7, importance ablation** (dynamic top-k off): prediction-only (α = 0), hotness-only
(α = 1), full (α = the knob's default), with on-demand LRU beside: blocking I/O and hit rate.
**Fig. 9**: α over ``--alphas`` at the same sizes.

Verdicts are computed from the numbers (:func:`verdicts`): the paper's −7…13 % blocking I/O at
< 1 % accuracy loss (Fig. 8); full below both ablations at every size (Fig. 7); α's best value
interior (Fig. 9).

    python benchmarks/bench_activeevict.py [--per-kind 6] [--tokens 32]
        [--fig8-slots 16,64,128,256] [--fig8-rmax 2,0] [--slots 64,128,256]
        [--alphas 0,0.25,0.5,0.75,1] [--figs 8,7] [--quick] [--json PATH]
    python benchmarks/bench_activeevict.py --reverdict SAVED.json   # verdicts only, no runs
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np
import torch

from bench_caching_live import heldout, make_runtime
from bench_macs import paired
from workbench.analysis.vismmoe.accuracy import normalise_answer
from workbench.policies.active_evict import ActiveEvictKnobs

ALPHA_DEFAULT = ActiveEvictKnobs.param.ae_alpha.default
RMAX_DEFAULT = ActiveEvictKnobs.param.ae_rmax.default
PAPER_IO_CUT = (0.07, 0.13)  # Fig. 8: −7 … 13 % blocking I/O
PAPER_ACC_LOSS = 0.01  # Fig. 8: < 1 % accuracy-proxy loss


class Study:
    """Runs configurations over the request set, once each (memoised on the knobs)."""

    def __init__(self, rt, reqs, truth, work: Path, pinned: int) -> None:
        self.rt, self.reqs, self.truth, self.work, self.pinned = rt, reqs, truth, work, pinned
        self._memo: dict[tuple, dict] = {}
        self.runs = 0

    def config(self, **kn) -> dict:
        """Totals of one knob set over every request (free-running greedy, recorded)."""
        key = tuple(sorted(kn.items()))
        if key in self._memo:
            return self._memo[key]
        t = dict(steps=0, dec_steps=0, stall=0.0, dec_stall=0.0, loads=0, dec_loads=0,
                 hits=0, misses=0, dec_hits=0, dec_misses=0, k=[], correct=[], per_req=[])
        for i, req in enumerate(self.reqs):
            store = self.work / f"run-{len(self._memo)}-{i}.zarr"
            res = self.rt.run(req, store=store, overwrite=True, **kn)
            self.runs += 1
            ds = workbench.open_run(store)
            stall = ds["stall_modeled_s"].values
            loads, hits, misses = (ds[v].values for v in ("loads", "hits", "misses"))
            t["steps"] += len(stall)
            t["dec_steps"] += len(stall) - 1  # step 0 is the prefill
            t["stall"] += float(stall.sum())
            t["per_req"].append(float(stall.sum()) * 1e3)
            t["dec_stall"] += float(stall[1:].sum())
            t["loads"] += int(loads.sum())
            t["dec_loads"] += int(loads[1:].sum())
            t["hits"] += int(hits.sum())
            t["misses"] += int(misses.sum())
            t["dec_hits"] += int(hits[1:].sum())
            t["dec_misses"] += int(misses[1:].sum())
            t["k"].extend(ds["topk_used"].values[1:, self.pinned:].ravel().tolist())
            t["correct"].append(normalise_answer(res.texts[0]) == self.truth[i])
            shutil.rmtree(store, ignore_errors=True)
        n, k = len(self.reqs), np.array([x for x in t.pop("k") if x > 0])
        top_k = self.rt.lm.layout.top_k
        row = {"blocking_io_ms_per_request": t["stall"] * 1e3 / n,
               "decode_blocking_io_ms_per_step": t["dec_stall"] * 1e3 / max(t["dec_steps"], 1),
               "loads_per_step": t["loads"] / t["steps"],
               "decode_loads_per_step": t["dec_loads"] / max(t["dec_steps"], 1),
               "hit_rate": t["hits"] / max(t["hits"] + t["misses"], 1),
               "decode_hit_rate": t["dec_hits"] / max(t["dec_hits"] + t["dec_misses"], 1),
               "mean_k": float(k.mean()) if len(k) else float("nan"),
               "narrowed_share": float((k < top_k).mean()) if len(k) else float("nan"),
               "accuracy": float(np.mean(t["correct"])), "correct": t["correct"],
               "blocking_io_ms_each": t["per_req"],
               "decode_steps": t["dec_steps"], "requests": n}
        self._memo[key] = row
        return row

    def quality(self, **kn) -> dict:
        """Top-1 agreement and KL of dynamic top-k against its reference (teacher-forced)."""
        agree = kl = 0.0
        pos = 0
        kl_max = 0.0
        for req in self.reqs:
            q = self.rt.quality(req, **kn)
            self.runs += 2
            agree += q.agreement * q.positions
            kl += q.kl_mean * q.positions
            kl_max = max(kl_max, q.kl_max)
            pos += q.positions
        return {"top1_agreement": agree / max(pos, 1), "kl_mean": kl / max(pos, 1),
                "kl_max": kl_max, "positions": pos}


def fig8(st: Study, slots: list[int], rmaxes: list[int]) -> list[dict]:
    rows = []
    for s in slots:
        for r in rmaxes:
            kn = dict(cache_slots=s, eviction="lru", active_evict=True, ae_rmax=r,
                      ae_alpha=ALPHA_DEFAULT)
            off, on = st.config(**kn), st.config(**kn, dynamic_topk=True)
            q = st.quality(**kn)
            d, se = paired(on, off)
            cut = 1 - on["decode_blocking_io_ms_per_step"] / off["decode_blocking_io_ms_per_step"]
            rows.append({"cache_slots": s, "ae_rmax": r, "off": off, "on": on, **q,
                         "decode_blocking_io_cut": cut,
                         "blocking_io_cut": 1 - on["blocking_io_ms_per_request"]
                         / off["blocking_io_ms_per_request"],
                         "decode_loads_cut": 1 - on["decode_loads_per_step"]
                         / off["decode_loads_per_step"],
                         "accuracy_diff": d, "accuracy_diff_se": se})
            print(f"fig8 slots {s:4d} r_max {r}: narrowed {on['narrowed_share']:.3f} mean k "
                  f"{on['mean_k']:.3f}  decode I/O {off['decode_blocking_io_ms_per_step']:.2f}"
                  f" → {on['decode_blocking_io_ms_per_step']:.2f} ms/step ({-cut:+.1%})  "
                  f"decode loads {off['decode_loads_per_step']:.2f} → "
                  f"{on['decode_loads_per_step']:.2f}  accuracy {off['accuracy']:.3f} → "
                  f"{on['accuracy']:.3f}  agreement {q['top1_agreement']:.4f} KL "
                  f"{q['kl_mean']:.2e}  [{st.runs} runs]", flush=True)
    return rows


def fig79(st: Study, slots: list[int], alphas: list[float]) -> list[dict]:
    rows = []
    for s in slots:
        lru = st.config(cache_slots=s, eviction="lru")
        rows.append({"cache_slots": s, "variant": "lru (on demand)", "alpha": None, **lru})
        for a in sorted(set(alphas) | {0.0, 1.0, ALPHA_DEFAULT}):
            r = st.config(cache_slots=s, eviction="lru", active_evict=True, ae_alpha=a,
                          ae_rmax=RMAX_DEFAULT)
            name = {0.0: "prediction-only", 1.0: "hotness-only"}.get(a, "full" if a ==
                                                                       ALPHA_DEFAULT else "")
            rows.append({"cache_slots": s, "variant": f"ActiveEvict α={a:g}"
                         + (f" ({name})" if name else ""), "alpha": a, **r})
        for r in rows:
            if r["cache_slots"] == s:
                print(f"fig7/9 slots {s:4d} {r['variant']:<34} hit {r['hit_rate']:.3f}  "
                      f"blocking I/O {r['blocking_io_ms_per_request']:7.2f} ms/request  decode "
                      f"{r['decode_blocking_io_ms_per_step']:.3f} ms/step  [{st.runs} runs]",
                      flush=True)
    return rows


def verdicts(f8: list[dict], f79: list[dict]) -> dict:
    """The paper's claims against the numbers."""
    v: dict = {}
    if f8:
        v["fig8"] = fig8_verdict(f8)
    if f79:
        v.update(fig79_verdicts(f79))
    return v


def fig8_verdict(f8: list[dict]) -> dict:
    """Fig. 8: −7…13 % blocking I/O (decode, where dynamic top-k acts) at < 1 % accuracy
    loss (answers correct and top-1 agreement), at some budget where it narrows k."""
    acted = [r for r in f8 if r["on"]["narrowed_share"] > 0]
    ok = [r for r in acted if r["off"]["accuracy"] - r["on"]["accuracy"] < PAPER_ACC_LOSS
          and 1 - r["top1_agreement"] < PAPER_ACC_LOSS]
    hit = [r for r in ok if r["decode_blocking_io_cut"] >= PAPER_IO_CUT[0]]
    return {
        "claim": "dynamic top-k cuts blocking I/O by 7–13 % at < 1 % accuracy loss",
        "budgets_where_it_acts": [(r["cache_slots"], r["ae_rmax"]) for r in acted],
        "best_decode_io_cut": max((r["decode_blocking_io_cut"] for r in f8), default=0.0),
        "budgets_meeting_claim": [(r["cache_slots"], r["ae_rmax"]) for r in hit],
        "verdict": ("appears" if hit else "does not appear"
                    + (" (dynamic top-k never narrowed k)" if not acted else
                       " (it acts, but the I/O cut stays below 7 % or the accuracy loss "
                       "reaches 1 %)"))}


def fig79_verdicts(f79: list[dict]) -> dict:
    """Fig. 7: full below both ablations; Fig. 9: the best α interior."""
    v: dict = {}
    by: dict = {}
    for r in f79:
        by.setdefault(r["cache_slots"], {})[r["alpha"]] = r
    f7, f9 = [], []

    def beyond_2se(a: dict, b: dict) -> bool:
        """a's blocking I/O below b's by more than 2 SE of the per-request differences."""
        d = np.array(a["blocking_io_ms_each"]) - np.array(b["blocking_io_ms_each"])
        se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("inf")
        return bool(d.mean() < -2 * se)

    for s, d in sorted(by.items()):
        io = {a: r["blocking_io_ms_per_request"] for a, r in d.items()}
        full, pred, hot, lru = io[ALPHA_DEFAULT], io[0.0], io[1.0], io[None]
        f7.append({"cache_slots": s, "full_vs_prediction_only": full / pred - 1,
                   "full_vs_hotness_only": full / hot - 1, "full_vs_lru": full / lru - 1,
                   "full_beats_both": full < pred and full < hot,
                   "beyond_2se": beyond_2se(d[ALPHA_DEFAULT], d[0.0])
                   and beyond_2se(d[ALPHA_DEFAULT], d[1.0]),
                   "in_paper_range": -0.16 <= full / pred - 1 <= -0.08
                   and -0.32 <= full / hot - 1 <= -0.13})
        alphas = sorted(a for a in io if a is not None)
        best = min(alphas, key=lambda a: (io[a], a))
        interior = 0.0 < best < 1.0
        f9.append({"cache_slots": s, "best_alpha": best, "interior": interior,
                   "interior_beyond_2se": interior and beyond_2se(d[best], d[0.0])
                   and beyond_2se(d[best], d[1.0]),
                   "best_vs_hotness_only": io[best] / io[1.0] - 1,
                   "best_vs_prediction_only": io[best] / io[0.0] - 1,
                   "plateau_within_1pct": [a for a in alphas if io[a] <= 1.01 * io[best]],
                   "alphas_beating_lru": [a for a in alphas if io[a] < lru]})
    v["fig7"] = {"claim": "full importance beats prediction-only (−8…16 %) and hotness-only / "
                          "LRU (−13…32 %) at every cache size",
                 "per_size": f7,
                 "verdict": ("appears in sign" if all(x["full_beats_both"] for x in f7) else
                             "appears in sign at some sizes" if any(x["full_beats_both"]
                                                                    for x in f7)
                             else "does not appear")
                 + f" (beyond 2 SE at {sum(x['beyond_2se'] for x in f7)} of {len(f7)} sizes, "
                   f"in the paper's range at {sum(x['in_paper_range'] for x in f7)})"}
    v["fig9"] = {"claim": "an interior α is best, on a broad plateau below LRU",
                 "per_size": f9,
                 "verdict": ("appears in sign" if all(x["interior"] for x in f9) else
                             "appears in sign at some sizes" if any(x["interior"] for x in f9)
                             else "does not appear")
                 + f" (interior optimum beyond 2 SE of both ends at "
                   f"{sum(x['interior_beyond_2se'] for x in f9)} of {len(f9)} sizes)"}
    return v


def report(v: dict) -> None:
    for name, x in v.items():
        print(f"{name}: {x['verdict']} — {x['claim']}")
        for row in x.get("per_size", []):
            print("   ", {k: (round(val, 4) if isinstance(val, float) else val)
                          for k, val in row.items()})
    if "fig8" in v:
        print(f"fig8 budgets where dynamic top-k acts: {v['fig8']['budgets_where_it_acts']}; "
              f"best decode blocking-I/O cut {v['fig8']['best_decode_io_cut']:.1%}; budgets "
              f"meeting the claim: {v['fig8']['budgets_meeting_claim']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-kind", type=int, default=6, help="held-out requests of every kind")
    ap.add_argument("--tokens", type=int, default=32, help="max decoded tokens per request")
    ap.add_argument("--fig8-slots", default="16,64,128,256")
    ap.add_argument("--fig8-rmax", default="2,0", help="ae_rmax values of Fig. 8")
    ap.add_argument("--slots", default="64,128,256", help="cache sizes of Figs. 7 and 9")
    ap.add_argument("--alphas", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--pinned", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--figs", default="8,7", help="studies to run: 8 (dynamic top-k), "
                                                   "7 (Figs. 7 and 9)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 request per kind, 8 tokens, one size per figure")
    ap.add_argument("--json", help="write every number here (nothing is written by default)")
    ap.add_argument("--reverdict", metavar="JSON",
                    help="recompute the verdicts of a saved --json output (runs nothing)")
    a = ap.parse_args()
    if a.reverdict:
        out = json.loads(Path(a.reverdict).read_text())
        out["verdicts"] = verdicts(out["fig8"], out["fig7_9"])
        report(out["verdicts"])
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        return
    if a.quick:
        a.per_kind, a.tokens, a.fig8_slots, a.slots, a.alphas = 1, 8, "64", "64", "0,0.5,1"
        a.fig8_rmax = "0"
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    lm = workbench.load(None, device="cpu")
    reqs, truth = heldout(a.per_kind)
    rt = make_runtime(lm, a.tokens, pinned=a.pinned)
    work = Path(tempfile.mkdtemp(prefix="bench-activeevict-"))
    try:
        st = Study(rt, reqs, truth, work, a.pinned)
        figs = set(a.figs.split(","))
        f8 = fig8(st, [int(s) for s in a.fig8_slots.split(",")],
                  [int(r) for r in a.fig8_rmax.split(",")]) if "8" in figs else []
        f79 = fig79(st, [int(s) for s in a.slots.split(",")],
                    [float(x) for x in a.alphas.split(",")]) if "7" in figs else []
    finally:
        shutil.rmtree(work, ignore_errors=True)
    v = verdicts(f8, f79)
    report(v)
    wall = time.perf_counter() - t0
    print(f"{len(reqs)} held-out requests ({a.per_kind} per kind), {st.runs} runs, "
          f"{wall:.0f} s wall (measured)")
    if a.json:
        out = {"args": vars(a), "requests": len(reqs), "alpha_default": ALPHA_DEFAULT,
               "fig8": f8, "fig7_9": f79, "verdicts": v, "runs": st.runs, "wall_s": wall}
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
