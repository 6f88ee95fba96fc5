"""Low-precision emulation and ReaLB's bookkeeping: what they cost on this CPU (issue 15 §6) —
*measured*, side by side in one process.

1. ``workbench.fake_quant(x, "nvfp4")`` (and ``"fp8"``) on a 4096 × 4096 float32 tensor vs
   torchao's NVFP4 quantise → dequantise (``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=amax /
   (448 · 6)).dequantize()``: the two-level scaling) on the same tensor, medians of ``--rounds`` interleaved runs. torchao is an optional dependency: install
   it beside the project (``pip install --no-deps --target DIR torchao==0.18.0``, then
   ``PYTHONPATH=DIR``); without it that row says so. The values are checked equal too.
2. ReaLB's controller and precision bookkeeping in a live run, beyond the fake quantisation
   itself: a mixed batch of 8 over 8 ranks (every expert resident), ``balance`` = none vs
   ``realb`` with a gate no call reaches (the controller decides every layer call, nothing
   switches) vs ``realb-m1`` with the quantiser made the identity (the controller plus the split
   path that runs the chosen ranks' experts apart) — wall-time ratios, medians of interleaved
   rounds.

    python benchmarks/bench_precision.py [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import torch

import workbench.precision as precision


def quantiser(rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 4096, generator=g) * torch.logspace(-3, 2, 4096)[None, :]
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

        def ao(t):
            # the two-level scaling NVFP4 defines: an FP32 global scale amax / (448 · 6)
            return NVFP4Tensor.to_nvfp4(t, per_tensor_scale=t.abs().max() / (448 * 6)
                                        ).dequantize(torch.float32)
    except Exception as e:  # noqa: BLE001 — optional dependency
        ao, why = None, f"{type(e).__name__}: {e}"
    fns = {"fake_quant nvfp4": lambda t: precision.fake_quant(t, "nvfp4"),
           "fake_quant fp8": lambda t: precision.fake_quant(t, "fp8")}
    if ao is not None:
        fns["torchao NVFP4 to_nvfp4().dequantize()"] = ao
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds + 1):  # round 0 warms up
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn(x)
            if r:
                times[k].append(time.perf_counter() - t0)
    out = {k: {"median_s": statistics.median(v)} for k, v in times.items()}
    if ao is not None:
        base = out["torchao NVFP4 to_nvfp4().dequantize()"]["median_s"]
        out["fake_quant nvfp4"]["ratio_vs_torchao"] = out["fake_quant nvfp4"]["median_s"] / base
        out["values_equal_torchao"] = bool(torch.equal(precision.fake_quant(x, "nvfp4"), ao(x)))
    else:
        out["torchao"] = f"not installed ({why})"
    return out


def bookkeeping(rounds: int) -> dict:
    rt = workbench.Runtime(max_new_tokens=16, pinned_layers=0, cache_slots=64 * 12)
    reqs = workbench.mixed_batch(8, text_share=0.5, seed=1)
    kw = dict(record=False, ep_ranks=8)
    real = precision.fake_quant
    configs = {"none": {}, "realb, gate never reached": dict(balance="realb", realb_gate=1e12),
               "realb-m1, identity quantiser": dict(balance="realb-m1")}
    times: dict[str, list[float]] = {k: [] for k in configs}
    runs = {}
    for r in range(rounds + 1):
        for name, c in configs.items():
            if "identity" in name:
                precision.fake_quant = lambda t, p="nvfp4", axis=None: t
            try:
                t0 = time.perf_counter()
                res = rt.run(reqs, **kw, **c)
                dt = time.perf_counter() - t0
            finally:
                precision.fake_quant = real
            if r:
                times[name].append(dt)
            runs[name] = res.low_precision_runs
    base = statistics.median(times["none"])
    return {k: {"median_s": statistics.median(v), "ratio": statistics.median(v) / base,
                "low_precision_runs": runs[k]} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {"threads": torch.get_num_threads(), "quantiser": quantiser(a.rounds),
           "bookkeeping": bookkeeping(a.rounds)}
    print("| quantise → dequantise, 4096 × 4096 float32 | median ms | × torchao |")
    print("|---|---|---|")
    for k, v in out["quantiser"].items():
        if isinstance(v, dict):
            ratio = v.get("ratio_vs_torchao")
            print(f"| {k} | {v['median_s'] * 1e3:.1f} | "
                  f"{'' if ratio is None else f'{ratio:.2f}'} |")
    for k in ("values_equal_torchao", "torchao"):
        if k in out["quantiser"]:
            print(f"{k}: {out['quantiser'][k]}")
    print("\n| live run (batch of 8, 8 ranks) | median s | × none | expert runs apart |")
    print("|---|---|---|---|")
    for k, v in out["bookkeeping"].items():
        print(f"| {k} | {v['median_s']:.3f} | {v['ratio']:.3f} | {v['low_precision_runs']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
