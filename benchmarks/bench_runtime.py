"""Runtime and telemetry overhead, measured side by side in one process (ratios, not absolutes).

- runtime overhead: the workbench runtime with every expert resident (pinned_layers = all MoE
  layers, no recording) vs the plain transformers ``generate`` of the same model — goal ≤ 1.30×;
- telemetry overhead: the same offloaded run with and without streaming to a zarr store
  — goal ≤ 1.10×.

Variants are interleaved, in a shuffled order each round, after a warm-up, and medians of the per-variant wall times
are compared. Model: the embedded Qwen3-VL-MoE on a demo request (--demo N; or --model DIR, text-only prompt).

    python benchmarks/bench_runtime.py [--repeats 7] [--max-new-tokens 16] [--demo 0] [--ignore-eos] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import torch
from workbench.models.inputs import Request, build_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--cache-slots", type=int, default=64)
    ap.add_argument("--demo", type=int, default=0, help="which bundled demo request (index into data/demo/prompts.json)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="decode exactly --max-new-tokens tokens (all variants alike)")
    ap.add_argument("--lookahead-depth", type=int, default=None,
                    help="router lookahead layers (default: the knob's default)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(2)
    lm = workbench.load(a.model, device="cpu")
    if lm.is_vision:
        from workbench.models.embedded.demo import read_demo

        demo = read_demo(required=True)[a.demo]
        req = Request(demo["prompt"], [demo["image"]] if demo["image"] else [])
        print(f"request: demo {a.demo}, {demo['prompt']!r} (expected answer {demo.get('answer')!r})")
    else:
        req = Request("the quick brown fox")
    L = lm.layout.num_layers
    extra = {} if a.lookahead_depth is None else {"lookahead_depth": a.lookahead_depth}
    common = dict(max_new_tokens=a.max_new_tokens, device="cpu", ignore_eos=a.ignore_eos,
                  **extra)
    # one runtime per configuration, as a user would hold it (per-call knob overrides copy the
    # knobs, ~1 ms, which is not what these ratios are about)
    rt = workbench.Runtime(lm, pinned_layers=L, **common)
    rt_off = workbench.Runtime(lm, pinned_layers=1, cache_slots=a.cache_slots, **common)
    inputs = build_inputs(lm, req, a.max_new_tokens).tensors
    tmp = Path(tempfile.mkdtemp())
    counter = iter(range(10**6))

    def plain():
        with torch.no_grad():
            lm.model.generate(**inputs, max_new_tokens=a.max_new_tokens, do_sample=False,
                              temperature=None, top_p=None, top_k=None,
                              min_new_tokens=a.max_new_tokens if a.ignore_eos else None)

    variants = {
        "plain_generate": plain,
        "runtime_all_resident": lambda: rt.run(req, record=False),
        "offloaded_no_record": lambda: rt_off.run(req, record=False),
        "offloaded_record": lambda: rt_off.run(req, store=tmp / f"r{next(counter)}.zarr"),
    }
    for f in variants.values():  # warm-up
        f()
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    rng = random.Random(0)
    for _ in range(a.repeats):
        rng.shuffle(order)  # no variant always follows the same one (cache/thread after-effects)
        for name in order:
            f = variants[name]
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    steps = rt.run(req, record=False).steps
    out = {
        "model": lm.model_id, "moe_layers": L, "lookahead_depth": rt.knobs.lookahead_depth, "max_new_tokens": a.max_new_tokens,
        "ignore_eos": a.ignore_eos, "steps_per_run": steps,
        "repeats": a.repeats, "cache_slots": a.cache_slots,
        "median_s_measured": med,
        # the process's CPU seconds (every thread's; the recorder's writer thread too): what
        # a busy machine's waits for a core leave out of the wall times
        "median_cpu_s_measured": med_cpu,
        "runtime_overhead_ratio": med["runtime_all_resident"] / med["plain_generate"],
        "runtime_overhead_ratio_cpu": (med_cpu["runtime_all_resident"]
                                       / med_cpu["plain_generate"]),
        "telemetry_overhead_ratio": med["offloaded_record"] / med["offloaded_no_record"],
        "offload_vs_plain_ratio": med["offloaded_no_record"] / med["plain_generate"],
    }
    if a.json:
        print(json.dumps(out))
        return
    print(f"{lm.model_id}: {steps} steps per run (1 prefill + {steps - 1} decode)")
    for k, v in med.items():
        print(f"{k:<24} {v * 1e3:8.1f} ms (median of {a.repeats}, measured)")
    print(f"runtime overhead (all resident / plain generate): {out['runtime_overhead_ratio']:.3f}x"
          f"  (goal <= 1.30x; in CPU time {out['runtime_overhead_ratio_cpu']:.3f}x)")
    print(f"telemetry overhead (record / no record):          {out['telemetry_overhead_ratio']:.3f}x"
          f"  (goal <= 1.10x)")
    print(f"offloaded (cache_slots={a.cache_slots}, pinned 1) / plain:      "
          f"{out['offload_vs_plain_ratio']:.3f}x")


if __name__ == "__main__":
    main()
