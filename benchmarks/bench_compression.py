"""Measured cost of visual-token compression per request (seed VisMMOE §1a: P50 / P99).

For every demo request with an image (data/demo/prompts.json) and each policy, ``Runtime.run`` serves the request
``--repeats`` times with ``compression=<policy>`` and records the two costs the placement
measures (``RunResult.compression_select_s``: prefix-routing tensor + the policy's selection;
``compression_saliency_s``: the vision-attention recomputation), then prints P50 / P99 / mean
in milliseconds over all runs of a policy. Model: the embedded Qwen3-VL-MoE (or --model DIR).

    python benchmarks/bench_compression.py [--repeats 5] [--beta 0.5] [--pinned-layers 2] [--json]
"""

from __future__ import annotations

import argparse
import json

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--pinned-layers", type=int, default=2)
    ap.add_argument("--policies", default="random,saliency,affinity")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from workbench.models.embedded.demo import read_demo

    scenes = [d for d in read_demo(required=True) if d["image"]]  # compression acts on visual tokens
    rt = workbench.Runtime(a.model, max_new_tokens=1, pinned_layers=a.pinned_layers)
    out = {}
    for policy in a.policies.split(","):
        sel, sal = [], []
        for _ in range(a.repeats):
            for s in scenes:
                r = rt.run(s["prompt"], [s["image"]], record=False, compression=policy,
                           beta=a.beta)
                sel.append(r.compression_select_s * 1e3)
                sal.append(r.compression_saliency_s * 1e3)
        out[policy] = {name: {"p50_ms": float(np.percentile(v, 50)),
                              "p99_ms": float(np.percentile(v, 99)),
                              "mean_ms": float(np.mean(v)), "runs": len(v)}
                       for name, v in (("select", sel), ("saliency", sal))}
    if a.json:
        print(json.dumps({"model": rt.lm.model_id, "beta": a.beta,
                          "pinned_layers": a.pinned_layers, "results": out}, indent=2))
        return
    print(f"model {rt.lm.model_id} · beta {a.beta} · pinned_layers {a.pinned_layers}")
    for policy, r in out.items():
        for name, v in r.items():
            print(f"{policy:>9} {name:>8}: P50 {v['p50_ms']:.3f} ms  P99 {v['p99_ms']:.3f} ms  "
                  f"mean {v['mean_ms']:.3f} ms  ({v['runs']} runs)")


if __name__ == "__main__":
    main()
