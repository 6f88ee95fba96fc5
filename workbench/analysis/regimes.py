"""The regime map (issue 39 §4–5): where the papers' expert-parallel speedups exist.

MACS (seed 002 Fig. 2: a single MoE layer up to 1.97× at γ0 = 0.5) and ReaLB (seed 004
Table 1: 1.10–1.32× end to end; FP4-All up to 1.41×) gain by shortening the slowest rank's
expert GEMMs. On the modeled clock an expert over ``n`` tokens costs
``max(n·F / rate, bytes / bandwidth)`` (:meth:`HardwareProfile.compute_time`), so a gain
needs the busy experts past the profile's *ridge*: ``n* = rate · expert_bytes /
(bandwidth · F)`` tokens (:func:`ridge_tokens`). Below it an expert's time is its weight read,
which dropping tokens (MACS) does not shorten.

What this module does, on *recorded* runs (live batches of the embedded model, one store per
batch, routing as the mechanism made it):

- :func:`record` runs each method (:data:`METHODS`) on the held-out split in batches of ``B``
  requests (the same ``n`` questions for every ``B``; greedy; exact match) and keeps each
  batch's store and the answers (*measured*);
- :func:`prefill_clock` prices a store's prefill steps with the one EP clock,
  :meth:`workbench.analysis.accessor.MoEAccessor.ep_times` (its ``profile`` /
  ``interconnect`` / ``target_model`` arguments: the same routing on every hardware profile;
  *modeled*), :func:`prefill_load` reads the tokens per expert and per rank;
- :func:`regime_map` makes the rows (method × hardware × batch: modeled prefill MoE-layer
  speedup vs ``vanilla``, tokens per expert and the busiest expert's, the ridge, accuracy
  paired per question vs ``vanilla``), :func:`crossover` the batch where a speedup passes 1.0
  and :func:`no_crossover_reason` the computed reason where none does.

Units: seconds (*modeled*), tokens = (token, expert) assignments of the prefill step, batches
in requests. Only the prefill steps are priced: the papers' benchmarks are prefill-heavy
(ReaLB App. G: decode < 10 % of a batch's tokens; MACS scores short answers) and capacity acts
there (``capacity_scope=prefill``, docs/macs.md).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

#: the model both papers price (MACS Tables 1/4 and Fig. 2; ReaLB Tables 1/4)
TARGET = "qwen3-vl-30b-a3b"
#: expert-parallel ranks of both papers (MACS §4.1 "8-way EP"; ReaLB §5 eight GPUs)
RANKS = 8
#: ReaLB's LB gate (seed 004 §5: "Γ = 2048 (256 × 8 ranks)"), the aggregate load of a layer
#: call (routed assignments, every rank's summed) above which the controller acts
REALB_GATE = 2048.0

#: method → (family, live knobs, precision its experts may run in); ``vanilla`` is the
#: baseline of every speedup and accuracy difference
METHODS: dict[str, tuple[str, dict[str, Any], str]] = {
    "vanilla": ("baseline", {}, "native"),
    "Token Drop γ0=1": ("macs", dict(dispatch="capacity-drop", capacity_factor=1.0), "native"),
    "Token Drop γ0=0.5": ("macs", dict(dispatch="capacity-drop", capacity_factor=0.5),
                          "native"),
    "MACS γ0=1": ("macs", dict(dispatch="macs", capacity_factor=1.0), "native"),
    "MACS γ0=0.5": ("macs", dict(dispatch="macs", capacity_factor=0.5), "native"),
    "FP4-All": ("realb", dict(balance="fp4-all", low_precision="nvfp4"), "nvfp4"),
    "ReaLB": ("realb", dict(balance="realb", low_precision="nvfp4"), "nvfp4"),
}

#: (profile, interconnect, what it stands for): the hardware axis of the map
HARDWARE: tuple[tuple[str, str, str], ...] = (
    ("a100-40gb", "nvlink-a100", "MACS's GPUs (8 × A100, 8-way EP; §4.1)"),
    ("rtx-5090", "pcie5", "ReaLB's GPUs as measured (8 × RTX 5090, PCIe Gen5; §5, Table 3)"),
    ("rtx-5090", "nvlink-h100", "ReaLB's GPUs with an NVLink all-to-all (its App. emulates "
                                "H20 NVLink; NVLink 4, 900 GB/s, stands in)"),
    ("h200", "nvlink-h200", "H200 SXM, NVLink 4 (FP8, no FP4)"),
    ("b200", "nvlink-b200", "HGX B200, NVLink 5 (FP4)"),
)

#: the papers' operating points, as they state them (``profile``/``interconnect``: the row of
#: :data:`HARDWARE` they ran on; ``gate_assignments``: the aggregate load (routed assignments
#: of a layer call) above which the method acts, None where the paper names none)
PAPER_POINTS: dict[str, dict[str, Any]] = {
    "macs": {"profile": "a100-40gb", "interconnect": "nvlink-a100",
             "claim": "single MoE layer up to 1.97× (Fig. 2, Qwen3-VL, γ0 → 0.5)",
             "batch": "not stated (8-way EP, DeepSpeed, 8 × A100; §4.1)",
             "gate_assignments": None},
    "realb": {"profile": "rtx-5090", "interconnect": "nvlink-h100",
              "claim": "1.10–1.32× end to end (Table 1); Qwen-VL prefill-only 1.10–1.12× "
                       "(Table 4); FP4-All up to 1.41×",
              "batch": "continuous batches, max-num-seqs 12, prefill-dominated; acts when the "
                       "load passes Γ = 2048 = 256 × 8 ranks (§5)",
              "gate_assignments": REALB_GATE},
}


def ridge_tokens(profile: str, target_model: str = TARGET, precision: str = "native"
                 ) -> float:
    """Tokens per expert at which one expert's modeled compute equals its weight read on
    ``profile`` (the roofline ridge in tokens: ``rate · bytes / (bandwidth · F)``, rate and
    bytes of ``precision`` as :meth:`HardwareProfile.precision_compute_time` prices them; a
    precision the GPU lacks is priced native, so is its ridge). Below it the expert is
    memory-bound: its time does not depend on its tokens."""
    from workbench.sim.profiles import get_profile, get_target_model

    p, m = get_profile(profile), get_target_model(target_model)
    rate, bits = p.device_flops, 16.0
    if precision != "native" and p.supports(precision):
        rate = p.fp8_flops if precision == "fp8" else p.fp4_flops
        bits = 8.0 if precision == "fp8" else 4.0 + 8.0 / 16
    return rate * m.expert_bytes * bits / 16.0 / (p.device_mem_bandwidth
                                                   * m.expert_flops_per_token)


def _prefill(ds: Any) -> np.ndarray:
    return np.asarray(ds["phase"].values) == 0


def prefill_clock(ds: Any, profile: str, interconnect: str, target_model: str = TARGET
                  ) -> dict[str, float]:
    """The modeled EP clock of a run's prefill steps on ``profile`` / ``interconnect``,
    summed over steps and MoE layers (seconds, *modeled*): ``moe_layer_s`` and its parts
    ``dispatch_s``, ``compute_s`` (the slowest rank), ``combine_s``, ``switch_s`` (ReaLB's
    conversion). One implementation: :meth:`MoEAccessor.ep_times`."""
    t = ds.moe.ep_times(profile=profile, interconnect=interconnect, target_model=target_model)
    pre = _prefill(ds)
    return {"moe_layer_s": float(t["moe_layer_s"].values[pre].sum()),
            "dispatch_s": float(t["dispatch_s"].values[pre].sum()),
            "compute_s": float(t["compute_s"].values[pre].max(-1).sum()),
            "combine_s": float(t["combine_s"].values[pre].sum()),
            "switch_s": float(t["switch_s"].values[pre].sum())}


def prefill_load(ds: Any) -> dict[str, float]:
    """Loads of a run's prefill layer calls (means over them; assignments = routed (token,
    expert) pairs as kept by the run's dispatch): ``tokens`` (prefill tokens per step),
    ``tokens_per_expert`` (mean assignments per expert), ``busiest_expert`` (the most loaded
    expert's), ``tokens_per_rank`` (mean per rank), ``busiest_rank``, ``assignments`` (per
    layer call, every rank's summed: what ReaLB's gate compares), ``low_share`` (ReaLB's
    (layer call, rank) cells in low precision); ``calls``: the layer calls averaged over."""
    pre = _prefill(ds)
    counts = np.asarray(ds["routed_tokens"].sum("modality").values, np.int64)[pre]  # S L E
    rank = np.asarray(ds.moe.ep_load().values)[pre]  # S L R: the run's ranks and placement
    top_k = ds.moe.top_k
    return {"tokens": float(counts.sum(-1).mean() / top_k) if counts.size else 0.0,
            "assignments": float(counts.sum(-1).mean()) if counts.size else 0.0,
            "tokens_per_expert": float(counts.mean()) if counts.size else 0.0,
            "busiest_expert": float(counts.max(-1).mean()) if counts.size else 0.0,
            "tokens_per_rank": float(rank.mean()) if rank.size else 0.0,
            "busiest_rank": float(rank.max(-1).mean()) if rank.size else 0.0,
            "low_share": _low_share(ds, pre),
            "calls": int(counts.shape[0] * counts.shape[1])}


def _low_share(ds: Any, pre: np.ndarray) -> float:
    """Share of the prefill's (layer call, rank) cells a live ReaLB / FP4-All controller ran
    in low precision (``realb_low``; 0 in a run without one)."""
    if "realb_low" not in ds or ds.sizes.get("ep_rank", 1) <= 1:
        return 0.0
    decided = ~np.isnan(np.asarray(ds["realb_m"].values))[pre]
    low = np.asarray(ds["realb_low"].values, bool)[pre]
    return float(low[decided].mean()) if decided.any() else 0.0


def record(batch: int, n: int, methods: Iterable[str], workdir: str | Path,
           runtime: Any = None, max_new_tokens: int = 24) -> dict[str, dict[str, Any]]:
    """Run every method of ``methods`` (:data:`METHODS`) live on the first ``n`` held-out
    questions in batches of ``batch`` requests, one store per batch under ``workdir``.
    Returns per method: ``stores`` (paths), ``correct`` (bool per question, exact match after
    ``normalise_answer``), ``wall_s`` (*measured*). Every expert resident, 8 virtual EP ranks,
    costs as :data:`TARGET`; ReaLB's controller carries M_d from batch to batch (a server's)
    and starts fresh per method; capacity acts on the prefill (the knob's default)."""
    from workbench.errors import InputError

    methods = list(methods)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise InputError(f"regime method {bad[0]!r} is unknown; known: {', '.join(METHODS)}")
    for name, v in (("batch", batch), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise InputError(f"{name} must be a whole number ≥ 1, not {v!r}")
    import workbench
    from workbench.analysis.vismmoe.accuracy import normalise_answer
    from workbench.analysis.vismmoe.config import eval_seed
    from workbench.models.embedded.v2.tasks import make_split
    from workbench.models.inputs import Request

    ex = make_split(eval_seed(), n)
    reqs = [Request(q, [img] if img is not None else []) for img, q, _ in ex]
    truth = [normalise_answer(a) for _, _, a in ex]
    rt = runtime if runtime is not None else workbench.Runtime()
    lay = rt.lm.layout
    base = dict(max_new_tokens=max_new_tokens, pinned_layers=0,
                cache_slots=lay.num_layers * lay.num_experts, ep_ranks=RANKS,
                target_model=TARGET, lookahead_depth=0, prefetch="none",
                realb_gate=REALB_GATE, realb_carry=True)
    workdir = Path(workdir)
    out: dict[str, dict[str, Any]] = {}
    for name in methods:
        knobs = METHODS[name][1]
        rt.realb_carry.clear()
        answers, stores, wall = [], [], 0.0
        for i in range(0, n, batch):
            store = store_path(workdir, batch, name, i // batch)
            t0 = time.perf_counter()
            res = rt.run(reqs[i:i + batch], store=store, **{**base, **knobs})
            wall += time.perf_counter() - t0
            answers += [normalise_answer(t) for t in res.texts]
            stores.append(store)
        out[name] = {"stores": stores, "wall_s": wall,
                     "correct": [a == t for a, t in zip(answers, truth)]}
    return out


def store_path(workdir: str | Path, batch: int, method: str, index: int) -> Path:
    """Where :func:`record` writes the ``index``-th batch of ``method`` at batch size
    ``batch`` (methods numbered in :data:`METHODS` order): :func:`reprice` finds it again."""
    return Path(workdir) / f"b{batch}-{list(METHODS).index(method)}-{index}.zarr"


def reprice(previous: dict[str, Any], workdir: str | Path, target_model: str = TARGET,
            hardware: Sequence[tuple[str, str, str]] = HARDWARE) -> dict[str, Any]:
    """:func:`measure` again over the stores a :func:`record` kept in ``workdir``, with the
    answers ``previous`` (an earlier :func:`measure`'s result) recorded — the same routing
    priced as another ``target_model`` or on other ``hardware``; nothing reruns."""
    runs: dict[int, dict[str, dict[str, Any]]] = {}
    for c in previous["cells"]:
        stores = [store_path(workdir, c["batch"], c["method"], i) for i in range(c["batches"])]
        missing = [p for p in stores if not p.exists()]
        if missing:
            from workbench.errors import InputError

            raise InputError(f"reprice: the store {missing[0]} is missing; record the runs "
                             f"with a kept folder (benchmarks/regime_map.py --keep DIR)")
        runs.setdefault(c["batch"], {})[c["method"]] = {
            "stores": stores, "correct": c["correct"], "wall_s": c["wall_s"]}
    return measure(runs, hardware, target_model)


def paired(a: Sequence[bool], b: Sequence[bool]) -> tuple[float, float]:
    """Mean and standard error of (a correct − b correct) over the same questions."""
    d = np.asarray(a, float) - np.asarray(b, float)
    se = d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return float(d.mean()), float(se)


def measure(runs: dict[int, dict[str, dict[str, Any]]],
            hardware: Sequence[tuple[str, str, str]] = HARDWARE,
            target_model: str = TARGET) -> dict[str, Any]:
    """The numbers of the map from recorded runs ``{batch: record(...)}``: per (batch,
    method) the accuracy, loads and, per hardware row, the prefill clock. JSON-ready; the
    map itself is :func:`regime_map` of this."""
    import workbench

    cells = []
    for B, by_method in sorted(runs.items()):
        for name, r in by_method.items():
            stores = [workbench.open_run(s) for s in r["stores"]]
            loads = [prefill_load(ds) for ds in stores]
            w = np.array([x["calls"] for x in loads], float)
            load = {k: float(np.average([x[k] for x in loads], weights=w))
                    for k in loads[0] if k != "calls"}
            clock = {}
            for prof, link, _ in hardware:
                parts = [prefill_clock(ds, prof, link, target_model) for ds in stores]
                clock[f"{prof}|{link}"] = {k: float(sum(p[k] for p in parts))
                                           for k in parts[0]}
            cells.append({"batch": int(B), "method": name, "n": len(r["correct"]),
                          "batches": len(stores), "correct": [bool(c) for c in r["correct"]],
                          "accuracy": float(np.mean(r["correct"])), "wall_s": r["wall_s"],
                          "load": load, "clock": clock})
    return {"target_model": target_model, "ranks": RANKS, "realb_gate": REALB_GATE,
            "hardware": [list(h) for h in hardware], "cells": cells}


def crossover(batches: Sequence[float], speedups: Sequence[float]) -> dict[str, Any] | None:
    """Where a speedup passes 1.0 as the batch grows: the first batch from which it stays
    above 1.0 over every larger measured batch (``batch``), and the batch where it crosses
    1.0 interpolated linearly in log2(batch) between that batch and the one before
    (``estimate``; the batch itself when it is the first measured). None: it is not above 1.0
    at the largest batch."""
    b = np.asarray(batches, float)
    s = np.asarray(speedups, float)
    order = np.argsort(b)
    b, s = b[order], s[order]
    if not len(s) or not s[-1] > 1.0:
        return None
    i = len(s) - 1
    while i > 0 and s[i - 1] > 1.0:
        i -= 1
    if i == 0:
        return {"batch": float(b[0]), "estimate": float(b[0]), "at_smallest": True}
    x0, x1 = math.log2(b[i - 1]), math.log2(b[i])
    f = (1.0 - s[i - 1]) / (s[i] - s[i - 1])
    return {"batch": float(b[i]), "estimate": float(2 ** (x0 + f * (x1 - x0))),
            "at_smallest": False}


def no_crossover_reason(rows: Sequence[dict[str, Any]]) -> str:
    """Why a (method, hardware) series never passes 1.0, computed from its largest batch's
    row: the precision the profile lacks; the busiest expert below the ridge (memory-bound);
    or, compute-bound, how much of the slowest rank's work the method removed and what it
    added (communication, conversion)."""
    r = max(rows, key=lambda x: x["batch"])
    B = r["batch"]
    if r["precision"] != "native" and not r["supported"]:
        return (f"{r['profile']} has no {r['precision']} tensor cores: its experts are priced "
                f"native, so there is nothing to gain (ReaLB's conversion still costs)")
    if r["busiest_expert"] < r["ridge_tokens"]:
        return (f"memory-bound up to B = {B}: the busiest expert takes {r['busiest_expert']:.0f} "
                f"tokens (mean over prefill layer calls) < the ridge {r['ridge_tokens']:.0f} "
                f"({r['ridge_flop_per_byte']:.0f} FLOP/B): its time is its weight read")
    inv = lambda x: 1.0 / x if x else float("nan")  # noqa: E731  (method's time / vanilla's)
    return (f"compute-bound at B = {B} (busiest expert {r['busiest_expert']:.0f} ≥ ridge "
            f"{r['ridge_tokens']:.0f} tokens), but the slowest rank's compute takes "
            f"{inv(r['compute_ratio']):.2f}× vanilla's (its assignments "
            f"{inv(r['busiest_rank_ratio']):.2f}×) and communication + conversion "
            f"{inv(r['comm_ratio']):.2f}×")


def regime_map(measured: dict[str, Any]) -> dict[str, Any]:
    """Rows and crossovers from :func:`measure`'s numbers (no store needed). A row: one
    (method, hardware, batch) with ``speedup`` (modeled prefill MoE layers, vanilla / method),
    ``compute_ratio`` / ``comm_ratio`` (its parts), the method's loads, the profile's ridge
    (``ridge_tokens``, ``ridge_flop_per_byte``) and ``regime`` (compute- or memory-bound: the
    vanilla busiest expert against the native ridge), accuracy and its paired difference vs
    vanilla (``delta`` ± ``se``, n questions). ``series``: per (method, hardware) the
    crossover or the reason there is none, and the paper's operating point when the row is
    its hardware."""
    from workbench.sim.profiles import get_profile

    target = measured["target_model"]
    cells = {(c["batch"], c["method"]): c for c in measured["cells"]}
    batches = sorted({c["batch"] for c in measured["cells"]})
    rows = []
    for prof, link, what in measured["hardware"]:
        key = f"{prof}|{link}"
        ridge = ridge_tokens(prof, target)
        for (B, name), c in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if name == "vanilla" or (B, "vanilla") not in cells:
                continue
            v = cells[(B, "vanilla")]
            family, _, precision = METHODS.get(name, ("other", {}, "native"))
            vc, mc = v["clock"][key], c["clock"][key]
            comm = lambda x: x["dispatch_s"] + x["combine_s"] + x["switch_s"]  # noqa: E731
            delta, se = paired(c["correct"], v["correct"])
            supported = get_profile(prof).supports(precision)
            rows.append({
                "method": name, "family": family, "profile": prof, "interconnect": link,
                "hardware": what, "batch": B, "precision": precision, "supported": supported,
                "speedup": vc["moe_layer_s"] / mc["moe_layer_s"] if mc["moe_layer_s"] else None,
                "compute_ratio": vc["compute_s"] / mc["compute_s"] if mc["compute_s"] else None,
                "comm_ratio": comm(vc) / comm(mc) if comm(mc) else None,
                "moe_layer_ms_vanilla": vc["moe_layer_s"] * 1e3,
                "moe_layer_ms": mc["moe_layer_s"] * 1e3,
                "tokens": v["load"]["tokens"], "assignments": v["load"]["assignments"],
                "tokens_per_expert": v["load"]["tokens_per_expert"],
                "busiest_expert": v["load"]["busiest_expert"],
                "busiest_expert_method": c["load"]["busiest_expert"],
                "tokens_per_rank": v["load"]["tokens_per_rank"],
                "busiest_rank_ratio": (v["load"]["busiest_rank"] / c["load"]["busiest_rank"]
                                       if c["load"]["busiest_rank"] else None),
                "ridge_tokens": ridge, "ridge_flop_per_byte": get_profile(prof).ridge_intensity,
                "ridge_tokens_low": ridge_tokens(prof, target, precision),
                "regime": ("compute-bound" if v["load"]["busiest_expert"] >= ridge
                           else "memory-bound"),
                "low_share": c["load"].get("low_share", 0.0),
                "accuracy": c["accuracy"], "accuracy_vanilla": v["accuracy"], "delta": delta,
                "se": se, "n": c["n"]})
    series = []
    for prof, link, what in measured["hardware"]:
        for name in dict.fromkeys(r["method"] for r in rows):
            rs = sorted((r for r in rows if r["method"] == name and r["profile"] == prof
                         and r["interconnect"] == link), key=lambda r: r["batch"])
            if not rs:
                continue
            # a precision the GPU lacks is priced native: any ratio off 1.0 there is the
            # routing's noise or the conversion, not the effect — no crossover to report
            lacks = rs[0]["precision"] != "native" and not rs[0]["supported"]
            x = None if lacks else crossover([r["batch"] for r in rs],
                                             [r["speedup"] for r in rs])
            point = PAPER_POINTS.get(rs[0]["family"])
            here = point is not None and (point["profile"], point["interconnect"]) == (prof, link)
            op = None
            if here:
                need = point["gate_assignments"]
                op = {"claim": point["claim"], "batch": point["batch"],
                      "first_batch_in_regime": next((r["batch"] for r in rs
                                                     if r["assignments"] > need), None)
                      if need is not None else None}
            series.append({"method": name, "family": rs[0]["family"], "profile": prof,
                           "interconnect": link, "batches": [r["batch"] for r in rs],
                           "speedups": [r["speedup"] for r in rs], "crossover": x,
                           "reason": None if x is not None else no_crossover_reason(rs),
                           "paper_point": op})
    return {"batches": batches, "rows": rows, "series": series, "target_model": target}
