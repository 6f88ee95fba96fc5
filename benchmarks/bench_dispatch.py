"""Accuracy cost of capacity-aware dispatch on the embedded model (issue 14, §3): CAI-MoE Token
Drop (``dispatch=capacity-drop``) at γ0 from 0.5 to 5 against the router's top-k, live, inside
the real experts forward.

Questions: the embedded model's held-out split (``make_split(HELDOUT_SEED, n)``: generated
scenes and text-only prompts, never trained on), greedy answers, exact match after
``normalise_answer``. One request at a time (batched requests are the next part of issue 14):
the capacity binds in the prefill (a decode step's one token cannot overflow), so what is
measured is the cost of dropping prompt tokens' expert assignments. Every expert fits in the
cache (answers never depend on it). Everything is measured.

    python benchmarks/bench_dispatch.py [--n 60] [--gammas 0.5,1,1.8,5] [--json OUT]
    python benchmarks/bench_dispatch.py --speed 7 [--batch 8] [--only topk,macs] [--json OUT]
    python benchmarks/bench_dispatch.py --ep-summary 25 [--json OUT]
    python benchmarks/bench_dispatch.py --macs-parts 9 [--json OUT]

``--speed`` times whichever ``workbench`` is imported: run it with ``PYTHONPATH`` pointing at
another tree to compare two versions of the code with the same harness.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np

from workbench.analysis.vismmoe.accuracy import normalise_answer
from workbench.analysis.vismmoe.config import base_knobs, eval_seed
from workbench.cli import _run_ep  # the EP summary `workbench run` prints


def _speed_setup() -> tuple:
    """The runtime and knobs the wall-time measurements run with: 16 new tokens, no EOS stop,
    every expert cached (nothing pinned)."""
    rt = workbench.Runtime()
    lay = rt.lm.layout
    return rt, {**base_knobs(16), "pinned_layers": 0, "ignore_eos": True,
                "cache_slots": lay.num_layers * lay.num_experts}


def speed(repeats: int, batch: int = 1, only: set[str] | None = None,
          profile: str | None = None) -> dict:
    """Wall time of one run (the demo image request, 16 new tokens, every expert cached):
    top-k, Token Drop with a capacity nobody reaches (the dispatch's own cost), Token Drop at
    γ0 = 1, and top-k with 8 virtual EP ranks plus the run's EP summary from its store (what
    ``workbench run --set ep_ranks=8`` adds). Interleaved (every other round in reverse
    order), medians, the per-round ratios' median and quartiles, and the ratio of each
    setting's fastest run to top-k's; measured: wall seconds and the process's CPU seconds
    (all its threads) per run. ``only``: the settings whose name
    up to its first comma is one of these (None: all; ``topk`` is always run, the base).
    ``profile``: afterwards, one more run of that setting under cProfile; prints where the
    dispatch's time goes (the functions of the dispatch stage, MACS and the router)."""
    import statistics
    import tempfile

    from roundstats import median_ci
    from workbench.models.embedded.demo import read_demo

    demo = next(d for d in read_demo() if d["image"])
    reqs = workbench.mixed_batch(batch, text_share=0.5, seed=1) if batch > 1 else None
    rt, knobs = _speed_setup()
    configs = {"topk": {}, "capacity-drop, nothing overflows": dict(
        dispatch="capacity-drop", capacity_factor=1000.0),
        "capacity-drop, γ0 = 1": dict(dispatch="capacity-drop", capacity_factor=1.0),
        "topk + 8 virtual EP ranks (summary from the store)": dict(ep_ranks=8),
        "macs, γ0 = 1, 8 ranks (every switch on)": dict(dispatch="macs", capacity_factor=1.0,
                                                        ep_ranks=8),
        "capacity-expanded, γ0 = 1, 8 ranks": dict(dispatch="capacity-expanded",
                                                   capacity_factor=1.0, ep_ranks=8)}
    if only:
        configs = {k: v for k, v in configs.items() if k == "topk" or k.split(",")[0] in only}
    times: dict[str, list[float]] = {k: [] for k in configs}
    cpu: dict[str, list[float]] = {k: [] for k in configs}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        for r in range(repeats + 1):  # the first round warms up
            # every other round in reverse order: a setting's place in the round (after
            # which run, how long since the round began) does not bias its ratio
            for name, extra in (list(configs.items()) if r % 2 == 0 else
                                list(configs.items())[::-1]):
                t0, c0 = time.perf_counter(), time.process_time()
                # (the setting's place, not a hash of its name: string hashes vary per
                # process, and two settings sharing a store name would refuse the second)
                store = f"{d}/{r}-{list(configs).index(name)}.zarr"
                if reqs is not None:
                    res = rt.run(reqs, store=store, **knobs, **extra)
                else:
                    res = rt.run(demo["prompt"], images=[demo["image"]], store=store,
                                 **knobs, **extra)
                if extra.get("ep_ranks"):  # the summary the CLI prints after such a run
                    _run_ep(res, SimpleNamespace(ep_ranks=extra["ep_ranks"]))
                if r:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
    base, base_cpu = statistics.median(times["topk"]), statistics.median(cpu["topk"])
    out = {}
    what = f"a mixed batch of {batch}" if reqs is not None else "the demo image request"
    load1 = os.getloadavg()
    print(f"\none run of {what} (16 new tokens), median of {repeats}, interleaved (measured; "
          f"workbench from {Path(workbench.__file__).parent.parent}; load average "
          f"{load0[0]:.2f} → {load1[0]:.2f}):")
    for name, ts in times.items():
        m, c = statistics.median(ts), statistics.median(cpu[name])
        # each round's run ÷ the same round's top-k run: drift across rounds cancels
        rounds = [t / b for t, b in zip(ts, times["topk"])]
        per_round = statistics.median(rounds)
        # (inclusive: quartiles among the rounds measured, not extrapolated past them)
        q1, _, q3 = (statistics.quantiles(rounds, n=4, method="inclusive") if len(rounds) > 1
                     else [per_round] * 3)
        # a busy machine only adds time: the fastest run of each setting is the least
        # disturbed reading of what it costs
        fastest = min(ts) / min(times["topk"])
        ci = median_ci(rounds)  # (None: too few rounds for a 95 % interval)
        out[name] = {"median_s": m, "ratio": m / base, "cpu_s": c, "ratio_cpu": c / base_cpu,
                     "ratio_per_round": per_round, "ratio_per_round_quartiles": [q1, q3],
                     "ratio_per_round_ci95": ci, "min_s": min(ts), "ratio_of_fastest": fastest}
        print(f"  {name}: {m * 1e3:.0f} ms = {m / base:.3f}× top-k wall "
              f"(median of per-round ratios {per_round:.3f}, quartiles {q1:.3f}–{q3:.3f}"
              + (f", 95 % interval of the median {ci[0]:.3f}–{ci[1]:.3f}" if ci else "")
              + f"; fastest runs {fastest:.3f}×); CPU {c * 1e3:.0f} ms = {c / base_cpu:.3f}×")
    ranks = "topk + 8 virtual EP ranks (summary from the store)"
    if ranks in times:  # MACS and Expanded Drop run 8 ranks: also against top-k with 8 ranks
        for name in (n for n in times if n.startswith(("macs", "capacity-expanded"))):
            rounds = [t / b for t, b in zip(times[name], times[ranks])]
            ci = median_ci(rounds)
            out[name]["ratio_per_round_vs_ranks"] = statistics.median(rounds)
            out[name]["ratio_per_round_vs_ranks_ci95"] = ci
            print(f"  {name} ÷ top-k with 8 ranks, median of per-round ratios "
                  f"{statistics.median(rounds):.3f}"
                  + (f" (95 % interval {ci[0]:.3f}–{ci[1]:.3f})" if ci else ""))
    out["load_average"] = [load0[0], load1[0]]
    if profile:
        import cProfile
        import pstats

        name = next(k for k in configs if k.split(",")[0] == profile)
        with tempfile.TemporaryDirectory() as d, cProfile.Profile() as pr:
            if reqs is not None:
                rt.run(reqs, store=f"{d}/p.zarr", **knobs, **configs[name])
            else:
                rt.run(demo["prompt"], images=[demo["image"]], store=f"{d}/p.zarr", **knobs,
                       **configs[name])
        print(f"\ncProfile of one more run of {name}:")
        pstats.Stats(pr).sort_stats("cumulative").print_stats(
            r"_layer|stages/dispatch.py|sim/macs.py|sim/dispatch.py|adapter.py.*route", 14)
    return out


def ep_summary_speed(repeats: int) -> dict:
    """Wall time of the EP summary ``workbench run --set ep_ranks=8`` prints after a run
    (the CLI's ``_run_ep``) and of its parts, on the store of a mixed batch of 8 (16 new
    tokens, 8 virtual ranks): medians of ``repeats`` calls after one warm-up, in ms
    (measured). Since stop 60 the run sums the summary as its store is written
    (``RunResult.ep``, the ``EPStream`` part: asserted equal to the store's) and ``_run_ep``
    only hands it on. Runs with any tree (``PYTHONPATH``): a part the tree lacks is left
    out."""
    import statistics
    import tempfile

    from workbench.knobs import Knobs
    from workbench.traces import from_store

    rt, knobs = _speed_setup()
    reqs = workbench.mixed_batch(8, text_share=0.5, seed=1)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        res = rt.run(reqs, store=f"{d}/run.zarr", ep_ranks=8, **knobs)
        store = res.store
        ds = workbench.open_run(store)
        parts = {"the CLI's summary (cli._run_ep)":
                 lambda: _run_ep(res, SimpleNamespace(ep_ranks=8)),
                 "open_run(store).moe.ep_summary()":
                 lambda: workbench.open_run(store).moe.ep_summary(),
                 "open_run(store)": lambda: workbench.open_run(store),
                 "Knobs.from_attrs(ds.attrs)": lambda: Knobs.from_attrs(ds.attrs),
                 "from_store(ds)": lambda: from_store(ds),
                 "ds.moe.ep_summary() (an opened store)": lambda: ds.moe.ep_summary()}
        try:  # the routing arrays only (what the CLI opens since stop 53)
            from workbench.traces.formats import TRACE_ARRAYS
        except ImportError:
            pass
        else:
            parts["open_run(store, variables=TRACE_ARRAYS)"] = (
                lambda: workbench.open_run(store, variables=TRACE_ARRAYS))
        try:  # the arrays the EP summary reads (what the CLI opens since stop 57)
            from workbench.replay.ep import EP_ARRAYS
        except ImportError:
            pass
        else:
            parts["open_run(store, variables=EP_ARRAYS)"] = (
                lambda: workbench.open_run(store, variables=EP_ARRAYS))
            parts["open_run(store, variables=EP_ARRAYS).moe.ep_summary()"] = (
                lambda: workbench.open_run(store, variables=EP_ARRAYS).moe.ep_summary())
        try:  # since stop 60 the run sums it as its store is written (RunResult.ep)
            from workbench.replay.ep import EPStream
        except ImportError:
            pass
        else:
            whole = workbench.open_run(store)
            cols = {n: whole[n].values for n in ("topk_ids", "token_step", "token_modality",
                                                 "kept", "phase")}
            pinned, L, E, K = (whole.pinned.values, whole.sizes["layer"],
                               whole.sizes["expert"], whole.sizes["k"])

            def stream() -> dict:
                st = EPStream.for_store(dict(whole.attrs), pinned, L, E, K)
                st.add_columns(cols)  # what the recorder hands it, the run's one batch
                return st.result()

            assert stream() == ds.moe.ep_summary()
            parts["EPStream: set up, fed the run's columns, result (what a run adds)"] = stream
        for name, f in parts.items():
            f()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            out[name] = statistics.median(ts) * 1e3
    print(f"EP summary of a batch-8 run's store, median of {repeats} (measured; workbench from "
          f"{Path(workbench.__file__).parent.parent}):")
    for name, ms in out.items():
        print(f"  {name}: {ms:.2f} ms")
    return out


def macs_parts(repeats: int) -> dict:
    """Where MACS's live dispatch spends a run (a mixed batch of 8, 16 new tokens, γ0 = 1, 8
    ranks, every switch on, every expert cached): each part's summed wall seconds in one run,
    median of ``repeats`` runs after one warm-up, in ms (measured; ``perf_counter`` around each
    call, so a part includes the parts it calls). Runs with any tree (``PYTHONPATH``): a part
    the tree lacks is left out. The dispatch's share of a run is ``DispatchStage.route`` plus
    the set-up (``DispatchStage.from_knobs``, and ``Runtime.macs_calibration`` as the knob
    check calls it)."""
    import functools
    import statistics
    import tempfile

    from workbench.models.adapter import MoEBlock
    from workbench.runtime.runtime import Runtime
    from workbench.runtime.stages.dispatch import DispatchStage
    from workbench.sim import dispatch as SD
    from workbench.sim import macs as SM

    acc: dict[str, float] = {}

    def timed(owner, name: str, label: str) -> None:
        f = getattr(owner, name, None)
        if f is None:
            return

        @functools.wraps(f)
        def w(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                acc[label] = acc.get(label, 0.0) + time.perf_counter() - t0
        # a classmethod's getattr is bound already: the plain wrapper, called on the class,
        # passes its arguments through
        setattr(owner, name, w)

    parts = [(DispatchStage, "route"), (DispatchStage, "_context"),
             (DispatchStage, "from_knobs"), (Runtime, "macs_calibration"),
             (SD.Macs, "fits"), (SD.Macs, "apply_weighted"), (SM, "semantic_weights"),
             (SM, "macs_group"), (MoEBlock, "route")]
    saved = [(o, n, o.__dict__.get(n)) for o, n in parts]
    for o, n in parts:
        timed(o, n, f"{o.__name__.rsplit('.', 1)[-1]}.{n}")
    rt, knobs = _speed_setup()
    reqs = workbench.mixed_batch(8, text_share=0.5, seed=1)
    runs: list[dict[str, float]] = []
    try:
        with tempfile.TemporaryDirectory() as d:
            for r in range(repeats + 1):
                acc.clear()
                t0 = time.perf_counter()
                rt.run(reqs, store=f"{d}/{r}.zarr", **knobs, dispatch="macs",
                       capacity_factor=1.0, ep_ranks=8)
                acc["the run"] = time.perf_counter() - t0
                if r:
                    runs.append(dict(acc))
    finally:
        for o, n, f in saved:
            if f is not None:
                setattr(o, n, f)
    out = {k: statistics.median(x.get(k, 0.0) for x in runs) * 1e3
           for k in sorted({k for x in runs for k in x})}
    print(f"MACS's live dispatch in a run of a mixed batch of 8, median of {repeats} (ms, "
          f"measured; workbench from {Path(workbench.__file__).parent.parent}):")
    for k, ms in out.items():
        print(f"  {k}: {ms:.1f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=60, help="held-out questions")
    ap.add_argument("--gammas", default="0.5,1,1.8,5")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--speed", type=int, default=0, metavar="REPEATS",
                    help="instead: the wall time of dispatch and EP bookkeeping (§6)")
    ap.add_argument("--batch", type=int, default=1,
                    help="--speed: run a mixed batch of this many requests (default: one)")
    ap.add_argument("--profile", metavar="SETTING",
                    help="--speed: then profile one run of this setting (e.g. macs)")
    ap.add_argument("--only", default="",
                    help="--speed: these settings (comma-separated names up to their first "
                         "comma, e.g. topk,macs; default: all)")
    ap.add_argument("--ep-summary", type=int, default=0, metavar="REPEATS",
                    help="instead: the wall time of a run's EP summary and its parts")
    ap.add_argument("--macs-parts", type=int, default=0, metavar="REPEATS",
                    help="instead: where MACS's live dispatch spends a run")
    a = ap.parse_args()
    if a.macs_parts:
        res = macs_parts(a.macs_parts)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return
    if a.ep_summary:
        res = ep_summary_speed(a.ep_summary)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return
    if a.speed:
        res = speed(a.speed, a.batch, set(filter(None, a.only.split(","))) or None, a.profile)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return
    from workbench.models.embedded.v2.tasks import make_split, question_kind

    examples = make_split(eval_seed(), a.n)
    rt = workbench.Runtime()
    lay = rt.lm.layout
    knobs = {**base_knobs(32), "pinned_layers": 0,
             "cache_slots": lay.num_layers * lay.num_experts}
    gammas = [float(g) for g in a.gammas.split(",")]
    truth = [normalise_answer(ans) for _, _, ans in examples]
    rows = {"topk": {"correct": [], "dropped": 0, "assigned": 0}}
    rows.update({g: {"correct": [], "dropped": 0, "assigned": 0, "same": []} for g in gammas})
    t0 = time.perf_counter()
    for i, (img, q, _) in enumerate(examples):
        images = [img] if img is not None else []
        ref = rt.run(q, images=images, record=False, **knobs)
        ref_ans = normalise_answer(ref.text)
        rows["topk"]["correct"].append(ref_ans == truth[i])
        for g in gammas:
            res = rt.run(q, images=images, record=False, dispatch="capacity-drop",
                         capacity_factor=g, **knobs)
            r = rows[g]
            ans = normalise_answer(res.text)
            r["correct"].append(ans == truth[i])
            r["same"].append(ans == ref_ans)
            r["dropped"] += res.dispatch_dropped
            r["assigned"] += res.dispatch_assigned
    elapsed = time.perf_counter() - t0
    n = len(examples)
    base = np.array(rows["topk"]["correct"], float)
    kinds = [question_kind(q) for _, q, _ in examples]
    images = sum(1 for img, _, _ in examples if img is not None)
    print(f"held-out questions: {n} ({images} with an image, {n - images} text only), greedy, "
          f"exact match; measured in {elapsed:.0f} s\n")
    print("| dispatch | γ0 | drop rate (prefill + decode) | accuracy | retained (vs topk) | "
          "paired Δ ± 2 SE | answers unchanged |")
    print("|---|---|---|---|---|---|---|")
    print(f"| topk | — | 0.0% | {base.mean():.1%} | 100% | — | 100% |")
    out = {"n": n, "images": images, "kinds": kinds, "topk_accuracy": float(base.mean()),
           "rows": []}
    for g in gammas:
        r = rows[g]
        c = np.array(r["correct"], float)
        d = c - base
        se = d.std(ddof=1) / math.sqrt(n) if n > 1 else float("nan")
        drop = r["dropped"] / r["assigned"] if r["assigned"] else 0.0
        retained = c.mean() / base.mean() if base.mean() else float("nan")
        print(f"| capacity-drop | {g:g} | {drop:.1%} | {c.mean():.1%} | {retained:.1%} | "
              f"{d.mean():+.3f} ± {2 * se:.3f} | {np.mean(r['same']):.0%} |")
        out["rows"].append({"capacity_factor": g, "drop_rate": drop, "accuracy": float(c.mean()),
                            "retained": float(retained), "delta": float(d.mean()),
                            "se": float(se), "unchanged": float(np.mean(r["same"]))})
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
