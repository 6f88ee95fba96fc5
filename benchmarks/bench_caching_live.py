"""Live cache policies on the embedded model, side by side (issue 4): on-demand LRU, hotness,
live prefetch (speculative, apex), ActiveEvict, and ActiveEvict + budget-aware dynamic top-k with
its quality cost (top-1 agreement and KL vs the unmodified model, teacher-forced).

Every demo request (image and text-only) decodes its real answer, up to --tokens tokens
(--ignore-eos decodes exactly --tokens, continuing past the answer). Costs are *modeled* as
Qwen3-VL-30B-A3B experts (17.3 MB) on the A100-40GB profile; hit rates and loads are counted live.

    python benchmarks/bench_caching_live.py [--tokens 32] [--slots 48,96,192] [--ignore-eos] [--json]
"""

from __future__ import annotations

import argparse
import json

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import torch
from workbench.models.inputs import Request
from workbench.models.embedded.demo import read_demo

VARIANTS = {
    "lru (on demand)": dict(eviction="lru"),
    "hotness": dict(eviction="hotness"),
    "lru + speculative prefetch": dict(eviction="lru", prefetch="speculative"),
    "lru + apex prefetch (lead 2)": dict(eviction="lru", prefetch="apex", prefetch_lead=2),
    "ActiveEvict": dict(eviction="lru", active_evict=True),
    "ActiveEvict + dynamic top-k": dict(eviction="lru", active_evict=True, dynamic_topk=True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32, help="max decoded tokens per request")
    ap.add_argument("--slots", default="48,96,192")
    ap.add_argument("--ignore-eos", action="store_true", help="decode exactly --tokens tokens")
    ap.add_argument("--pinned", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(2)
    lm = workbench.load(None, device="cpu")
    reqs = [Request(d["prompt"], [d["image"]] if d["image"] else []) for d in read_demo(required=True)]
    rt = workbench.Runtime(lm, device="cpu", max_new_tokens=a.tokens, ignore_eos=a.ignore_eos,
                           target_model="qwen3-vl-30b-a3b", profile="a100-40gb",
                           pinned_layers=a.pinned, lookahead_depth=2)
    rows = []
    for slots in (int(s) for s in a.slots.split(",")):
        for name, kv in VARIANTS.items():
            tot = dict(hits=0, misses=0, loads=0, steps=0, stall=0.0, latency=0.0)
            agree, kl, pos = 0.0, 0.0, 0
            for req in reqs:
                if kv.get("dynamic_topk"):
                    q = rt.quality(req, cache_slots=slots, **{k: v for k, v in kv.items()
                                                              if k != "dynamic_topk"})
                    r = q.modified
                    agree += q.agreement * q.positions
                    kl += q.kl_mean * q.positions
                    pos += q.positions
                else:
                    r = rt.run(req, record=False, cache_slots=slots, **kv)
                tot["hits"] += r.hits
                tot["misses"] += r.misses
                tot["loads"] += r.loads
                tot["steps"] += r.steps
                tot["stall"] += r.stall_modeled_s
                tot["latency"] += r.latency_modeled_s
            row = {"cache_slots": slots, "variant": name,
                   "hit_rate": tot["hits"] / max(tot["hits"] + tot["misses"], 1),
                   "loads_per_step": tot["loads"] / tot["steps"],
                   "blocking_io_ms_modeled": tot["stall"] * 1e3 / len(reqs),
                   "latency_ms_modeled": tot["latency"] * 1e3 / len(reqs)}
            if pos:
                row.update(top1_agreement=agree / pos, kl_mean=kl / pos, positions=pos)
            rows.append(row)
            if not a.json:
                extra = (f"  agreement {row['top1_agreement']:.3f}  KL {row['kl_mean']:.2e}"
                         if pos else "")
                print(f"slots {slots:3d}  {name:<30} hit {row['hit_rate']:.3f}  loads/step "
                      f"{row['loads_per_step']:6.2f}  blocking I/O {row['blocking_io_ms_modeled']:8.2f}"
                      f" ms  latency {row['latency_ms_modeled']:8.2f} ms{extra}", flush=True)
    if a.json:
        print(json.dumps({"tokens": a.tokens, "requests": len(reqs), "rows": rows}))


if __name__ == "__main__":
    main()
