"""Whether two versions of the code run the dispatch settings of ``bench_dispatch.py --speed``
alike (issue 41's rule: a speed change changes nothing a run computes).

    PYTHONPATH=TREE python benchmarks/check_dispatch_same.py run OUT   # per tree
    python benchmarks/check_dispatch_same.py compare OUT_A OUT_B

``run``: MACS and Expanded Drop (γ0 = 1, 8 ranks) on the demo image request and on the mixed
batch of 8, 16 new tokens, every expert cached, each twice; writes ``OUT`` (JSON: the tokens,
the counters, hits and misses) and ``OUT.<setting>.npz`` (the stored routing: ids and
weights, and the arrays of :data:`STORED`). ``compare``: equal tokens, counters, hits, misses,
ids and :data:`STORED` arrays (bit for bit, where both runs stored them), and the largest
difference of the stored weights between the trees beside the one between two runs of one
tree (the offloader sums expert groups as their copies land: float32 rounding varies).
"""

from __future__ import annotations

import json
import sys
import tempfile

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np

SETTINGS = [(batch, pol, rep) for batch in (1, 8) for pol in ("macs", "capacity-expanded")
            for rep in (0, 1)]
#: the stored arrays of what the dispatch did, compared bit for bit
STORED = ("dispatch_dropped", "dispatch_rerouted", "effective_load", "routed_tokens")


def run(out: str) -> None:
    from workbench.analysis.vismmoe.config import base_knobs
    from workbench.models.embedded.demo import read_demo

    rt = workbench.Runtime()
    lay = rt.lm.layout
    knobs = {**base_knobs(16), "pinned_layers": 0, "ignore_eos": True,
             "cache_slots": lay.num_layers * lay.num_experts}
    demo = next(d for d in read_demo() if d["image"])
    res_all = {"workbench": workbench.__file__}
    with tempfile.TemporaryDirectory() as d:
        for batch, pol, rep in SETTINGS:
            kw = dict(knobs, dispatch=pol, capacity_factor=1.0, ep_ranks=8,
                      store=f"{d}/{batch}{pol}{rep}.zarr")
            res = (rt.run(demo["prompt"], images=[demo["image"]], **kw) if batch == 1
                   else rt.run(workbench.mixed_batch(8, text_share=0.5, seed=1), **kw))
            ds = workbench.open_run(res.store)
            np.savez(f"{out}.{batch}{pol}{rep}.npz", ids=ds["topk_ids"].values,
                     w=ds["topk_weights"].values,
                     **{n: ds[n].values for n in STORED if n in ds})
            res_all[f"{batch} {pol} {rep}"] = {
                "token_ids": res.token_ids, "batch_tokens": [b.get("token_ids") for b in res.batch],
                "hits": res.hits, "misses": res.misses,
                "counts": {k: int(getattr(res, k)) for k in (
                    "dispatch_assigned", "dispatch_dropped", "dispatch_rerouted", "dispatch_added")}}
    with open(out, "w") as f:
        json.dump(res_all, f, indent=1)


def compare(a: str, b: str) -> bool:
    ja, jb = (json.load(open(p)) for p in (a, b))
    same = True
    for batch, pol, rep in SETTINGS:
        key = f"{batch} {pol} {rep}"
        na, nb = (np.load(f"{p}.{batch}{pol}{rep}.npz") for p in (a, b))
        eq = ja[key] == jb[key] and np.array_equal(na["ids"], nb["ids"])
        both = [n for n in STORED if n in na.files and n in nb.files]
        eq &= all(na[n].shape == nb[n].shape and na[n].dtype == nb[n].dtype
                  and na[n].tobytes() == nb[n].tobytes() for n in both)
        same &= eq
        diff = float(np.nanmax(np.abs(na["w"].astype(np.float64) - nb["w"])))
        line = f"{key}: tokens, counters, hits, misses, ids, {', '.join(both)} " \
               f"{'equal' if eq else 'DIFFER'}; " \
               f"weights differ by ≤ {diff:.1e}"
        if rep:
            r0, r1 = (np.load(f"{a}.{batch}{pol}{r}.npz")["w"] for r in (0, 1))
            line += f" (two runs of the first: ≤ {float(np.nanmax(np.abs(r0 - r1))):.1e})"
        print(line)
    return same


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
