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
                                           [--settings resident,offloaded]
                                           [--no-offload] [--model CHECKPOINT]
                                           [--kernels fused,per-subexpert,auto]
                                           [--layout-cache-mb MB]
    python benchmarks/bench_prism_speed.py --calls offload-one --compare OLD_TREE [--rounds 7]

``--calls SETTING --compare OLD_TREE``: whole runs on a shared machine vary by ±20 % from run to
run, more than a change to the sub-expert path moves them. This records every
``PrismView.choose``, ``_fused`` and ``run_blocks`` call of one offloaded run of SETTING (all,
half, one, offload-all, offload-half, offload-one), then replays the recorded calls through
this tree's code and through OLD_TREE's (every method of its ``PrismView``, ``SubExpertStage``
and ``Prices`` swapped in, and each view's gate rows captured again by its ``capture_gates``;
other state the two trees must keep alike), interleaved: per kind of call, the summed wall
time over the run's calls, min and median of ``--rounds`` replays (measured).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import workbench


def replay_calls(setting: str, old_tree: str, rounds: int) -> dict:
    """``--calls``: see the module docstring. Returns ``{kind: {old|new: {min_ms,
    median_ms}}}``; ``price`` is the sub-expert stage's per-call pricing, its ``choose``
    included."""
    import importlib.util

    import torch

    from workbench.prism import refactor as R
    from workbench.prism.execute import PrismView
    from workbench.runtime.stages.subexperts import SubExpertStage
    from workbench.sim.costs import Prices

    # (class, the old tree's file defining it): every method of either tree's class is
    # swapped in for that tree's replays (a method only one tree has is absent in the other)
    swaps = [(PrismView, "workbench/prism/execute.py"),
             (SubExpertStage, "workbench/runtime/stages/subexperts.py"),
             (Prices, "workbench/sim/costs.py")]
    modules: dict[str, Any] = {}
    impl: dict[str, dict] = {"new": {}, "old": {}}
    # the old files are loaded from copies: numba caches a module's compiled functions beside
    # its file under the module's name, which here is not the one the old tree imports it by
    copies = Path(tempfile.mkdtemp(prefix="prism-calls-old-"))
    for cls, rel in swaps:
        copy_of = copies / rel.replace("/", "_")
        shutil.copyfile(Path(old_tree) / rel, copy_of)
        spec = importlib.util.spec_from_file_location(
            "old_" + rel.replace("/", "_").removesuffix(".py"), copy_of)
        modules[rel] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[rel])  # (dataclasses look their module up)
        trees = {"new": vars(cls), "old": vars(getattr(modules[rel], cls.__name__))}
        names = {n for d in trees.values() for n, v in d.items()
                 if inspect.isfunction(v) and not n.startswith("__")}
        for tree, d in trees.items():
            impl[tree].update({(cls, n): d.get(n) for n in names})
    dense = {"new": getattr(PrismView, "DENSE_MACS", 0),
             "old": getattr(modules["workbench/prism/execute.py"].PrismView, "DENSE_MACS", 0)}

    captured: list[tuple] = []  # (view, capture_gates' arguments): the proxy gate's rows

    def use(tree: str) -> None:
        for (cls, name), f in impl[tree].items():
            if f is not None:
                setattr(cls, name, f)
            elif name in vars(cls):
                delattr(cls, name)
        PrismView.DENSE_MACS = dense[tree]
        for view, a in captured:  # each tree keeps the gate rows in its own attributes
            PrismView.capture_gates(view, *a)

    rt = workbench.Runtime()
    lay = rt.lm.layout
    work = Path(tempfile.mkdtemp(prefix="prism-calls-"))
    R.save(R.random_refactoring(rt.lm, subexperts=4), work / "p")
    N = 4
    k_active = {"all": N, "half": N // 2, "one": 1}[setting.removeprefix("offload-")]
    kw = dict(prism=True, prism_refactoring=str(work / "p"), prism_shortcut=False,
              prism_k_active=k_active, prism_offload=setting.startswith("offload-"))
    kinds = ("price", "choose", "_fused", "run_blocks")
    written = ("keys", "key_ids", "tokens", "low", "compute_s")  # what price sets on a call
    calls: list[tuple] = []

    def recorder(cls, kind):
        f = impl["new"][(cls, kind)]

        def rec(self, *a, **k):
            if kind == "price":
                call = a[0]
                calls.append((kind, self, a, k, {n: copy.copy(getattr(call, n))
                                                 for n in written}))
            elif kind == "choose":
                calls.append((kind, self, a, k, None))
            elif kind == "run_blocks" or k.get("present") is None:  # not run_blocks' own
                calls.append((kind, self, a, k, (self._chosen_call, self._ran_call.clone())))
            return f(self, *a, **k)
        return rec

    for cls, kind in ((SubExpertStage, "price"), (PrismView, "choose"),
                      (PrismView, "_fused"), (PrismView, "run_blocks")):
        setattr(cls, kind, recorder(cls, kind))

    def capture(view, *a):
        captured.append((view, a))
        return impl["new"][(PrismView, "capture_gates")](view, *a)

    PrismView.capture_gates = capture
    try:
        rt.run(workbench.mixed_batch(8, seed=5), max_new_tokens=16, record=False,
               pinned_layers=1, cache_slots=lay.num_experts * 4, **kw)
    finally:
        use("new")

    def play(tree: str) -> dict[str, float]:
        use(tree)
        t = dict.fromkeys(kinds, 0.0)
        with torch.no_grad():
            for kind, obj, a, k, state in calls:
                if kind == "price":  # the call as the stage got it
                    for n, v in state.items():
                        setattr(a[0], n, copy.copy(v))
                elif state is not None:  # the layer call's state when the call came
                    obj._chosen_call, obj._ran_call = state[0], state[1].clone()
                f = getattr(type(obj), kind)
                t0 = time.perf_counter()
                if "rows" in k and "rows" not in inspect.signature(f).parameters:
                    # a tree whose run_blocks takes compact blocks: the slots' copy it was
                    # handed (the executor's gather) is timed with it
                    kw = dict(k)
                    at = torch.as_tensor(list(kw.pop("rows")), dtype=torch.long)
                    f(obj, {n: x.index_select(0, at) for n, x in a[0].items()}, *a[1:], **kw)
                else:  # a keyword a tree's method does not take (newer than it) is left out
                    takes = inspect.signature(f).parameters
                    f(obj, *a, **{n: v for n, v in k.items() if n in takes})
                t[kind] += time.perf_counter() - t0
        return t

    from workbench.runtime.threads import threads_for_run

    times: dict[str, list[dict]] = {"old": [], "new": []}
    try:
        with threads_for_run(rt.lm.device):  # the intra-op threads a run uses
            for r in range(rounds):
                for tree in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    times[tree].append(play(tree))
    finally:
        use("new")
    counts = {kind: sum(c[0] == kind for c in calls) for kind in kinds}
    out = {}
    print(f"{setting}: the calls of one run ({counts}), replayed {rounds}× per tree, "
          f"interleaved (measured, ms summed over the run's calls; price includes choose):")
    for kind, n in counts.items():
        if not n:
            continue
        out[kind] = {tree: {"min_ms": min(x[kind] for x in times[tree]) * 1e3,
                            "median_ms": statistics.median(x[kind] for x in times[tree]) * 1e3}
                     for tree in ("old", "new")}
        o, w = out[kind]["old"], out[kind]["new"]
        print(f"  {kind} ({n} calls): old {o['min_ms']:.1f} ms (median {o['median_ms']:.1f}), "
              f"new {w['min_ms']:.1f} ms (median {w['median_ms']:.1f})")
    return out


def main() -> None:
    from roundstats import median_ci
    from workbench.prism import refactor as R

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the runtime's)")
    ap.add_argument("--layout-cache-mb", type=int, metavar="MB",
                    help="MoE-Prism layouts kept between runs (workbench.set_options("
                         "prism_layout_cache_bytes=…); default: the workbench's, the larger "
                         "of 256 MiB and half the available host memory)")
    ap.add_argument("--kernels", default="fused",
                    help="prism_kernel values to time, comma-separated (each sub-expert "
                         "setting once per kernel; default: fused; auto: the knob's default)")
    ap.add_argument("--model", help="a checkpoint folder instead of the embedded model (e.g. "
                                    "benchmarks/wide_model.py's: experts as wide as a real "
                                    "model's)")
    ap.add_argument("--json")
    ap.add_argument("--no-offload", dest="offload", action="store_false",
                    help="leave out the sub-expert offloading runs (prism_offload)")
    ap.add_argument("--settings", default="resident,offloaded",
                    help="which settings, comma-separated (default: resident,offloaded)")
    ap.add_argument("--calls", choices=["all", "half", "one", "offload-all", "offload-half",
                                        "offload-one"],
                    help="instead: replay one run's sub-expert calls through two trees")
    ap.add_argument("--compare", metavar="OLD_TREE", help="--calls: the other tree")
    a = ap.parse_args()
    if a.calls:
        if not a.compare:
            ap.error("--calls needs --compare OLD_TREE")
        if not (Path(a.compare) / "workbench" / "prism" / "execute.py").is_file():
            ap.error(f"--compare {a.compare!r} is not a workbench tree (no "
                     f"workbench/prism/execute.py in it)")
        res = replay_calls(a.calls, a.compare, a.rounds)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        return
    if a.layout_cache_mb is not None:
        if a.layout_cache_mb < 0:
            ap.error(f"--layout-cache-mb {a.layout_cache_mb} is negative")
        workbench.set_options(prism_layout_cache_bytes=a.layout_cache_mb << 20)
    rt = workbench.Runtime(a.model, **({"device": a.device} if a.device else {}))
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
    wanted = a.settings.split(",")
    if not wanted or not set(wanted) <= set(settings):
        ap.error(f"--settings takes {', '.join(settings)}, not {a.settings!r}")
    settings = {n: s for n, s in settings.items() if n in wanted}
    runs = {"native": {}, f"prism {N}/{N}": dict(prism=True),
            f"prism {N}/{N}, sub-expert path": dict(prism=True, prism_shortcut=False),
            f"prism {N // 2}/{N}": dict(prism=True, prism_k_active=N // 2),
            f"prism 1/{N}": dict(prism=True, prism_k_active=1)}
    if a.offload:  # MoE-Prism's sub-expert offloading (the offloaded setting only)
        runs.update({f"prism_offload {k}/{N}": dict(prism=True, prism_offload=True,
                                                    prism_shortcut=False, prism_k_active=k)
                     for k in (N, N // 2, 1)})
    from workbench.prism.execute import layout_budget
    from workbench.prism.knobs import KERNEL_CHOICES

    kernels = a.kernels.split(",")
    if not kernels or not set(kernels) <= set(KERNEL_CHOICES):
        ap.error(f"--kernels takes {', '.join(KERNEL_CHOICES)}, not {a.kernels!r}")
    def sub_path(kw: dict) -> bool:  # not the whole-expert shortcut: a kernel runs it
        return bool(kw) and (not kw.get("prism_shortcut", True) or kw.get("prism_k")
                             or (kw.get("prism_k_active") or N) < N)

    # each sub-expert setting once per kernel (the shortcut runs whole experts: no kernel)
    runs = {r if kn == "fused" else f"{r} [{kn}]": dict(kw, prism_kernel=kn) if kw else kw
            for kn in kernels for r, kw in runs.items() if kn == "fused" or sub_path(kw)}
    if "fused" not in kernels:  # the unmodified run is every ratio's base
        runs = {"native": {}, **runs}
    out = {"model": a.model or "embedded", "kernels": kernels,
           "prism_layout_cache_bytes": workbench.get_options()["prism_layout_cache_bytes"],
           "layout_budget_bytes_at_start": layout_budget(), "device": str(rt.lm.device),
           "batch": a.batch, "max_new_tokens": a.max_new_tokens, "subexperts": N,
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
        # each round's run ÷ the same round's unmodified run: drift across rounds cancels
        per_round = {r: statistics.median(x / b for x, b in zip(t, times["native"]))
                     for r, t in times.items() if t}
        # a 95 % interval of each median (distribution-free; None: too few rounds)
        ci = {r: median_ci([x / b for x, b in zip(t, times["native"])])
              for r, t in times.items() if t}
        out["settings"][sname] = {
            "median_s": med, "ratio": {r: med[r] / med["native"] for r in med},
            "ratio_per_round": per_round, "ratio_per_round_ci95": ci,
            # every sub-expert active, on every path that ran: the native answers
            "all_equal_native": all(tokens[r] == tokens["native"] for r in tokens if any(
                r.startswith(n) for n in (f"prism {N}/{N}", f"prism_offload {N}/{N}")))}
        print(f"{sname}: " + ", ".join(
            f"{r} {med[r]:.3f} s ({med[r] / med['native']:.2f}×; per round {per_round[r]:.2f}×"
            + (f", 95 % {ci[r][0]:.2f}–{ci[r][1]:.2f}" if ci[r] and r != "native" else "")
            + ")" for r in med)
              + f"; all sub-experts = native answers: "
                f"{out['settings'][sname]['all_equal_native']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
