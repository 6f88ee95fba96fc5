"""Live cache policies on the embedded model, side by side (issue 4): on-demand LRU, hotness,
live prefetch (speculative, apex), ActiveEvict, and ActiveEvict + budget-aware dynamic top-k with
its quality cost (top-1 agreement and KL vs the unmodified model, teacher-forced).

Generated held-out requests, ``--per-kind`` of every task kind (text-only kinds included:
``make_demo(HELDOUT_SEED, per_kind)``), each decoding its real answer, up to --tokens tokens
(--ignore-eos decodes exactly --tokens, continuing past the answer). Costs are *modeled* as
Qwen3-VL-30B-A3B experts (17.3 MB) on the A100-40GB profile; hit rates and loads are counted live.
The bounds are replays of the on-demand LRU runs' recorded routing (the same core): Belady
(the offline optimal eviction) and LRU with the oracle prefetcher (the next layer's true
experts, lead 1).

    python benchmarks/bench_caching_live.py [--tokens 32] [--slots 64,128,256] [--per-kind 2]
                                            [--ignore-eos] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import torch

from workbench.models.inputs import Request
from workbench.models.embedded.v2.tasks import QUESTION_KINDS, make_demo
from workbench.models.embedded.v2.train import HELDOUT_SEED

VARIANTS = {
    "lru (on demand)": dict(eviction="lru"),
    "hotness": dict(eviction="hotness"),
    "lru + speculative prefetch": dict(eviction="lru", prefetch="speculative"),
    "lru + apex prefetch (lead 2)": dict(eviction="lru", prefetch="apex", prefetch_lead=2),
    "ActiveEvict": dict(eviction="lru", active_evict=True),
    "ActiveEvict + dynamic top-k": dict(eviction="lru", active_evict=True, dynamic_topk=True),
}


def heldout(per_kind: int) -> tuple[list[Request], list[str]]:
    """The held-out request set: ``per_kind`` generated requests of every task kind
    (``make_demo(HELDOUT_SEED, per_kind)``, text-only kinds included) and their expected
    answers (normalised as the accuracy checks compare them)."""
    from workbench.analysis.vismmoe.accuracy import normalise_answer

    demo = make_demo(HELDOUT_SEED, per_kind)
    return ([Request(q, [img] if img is not None else []) for img, q, _ in demo],
            [normalise_answer(a) for _, _, a in demo])


def make_runtime(lm, tokens: int, *, ignore_eos: bool = False, pinned: int = 1):
    """The runtime every live caching benchmark uses: costs *modeled* as Qwen3-VL-30B-A3B
    experts on the A100-40GB profile, ``pinned`` layers resident, router lookahead depth 2."""
    return workbench.Runtime(lm, device="cpu", max_new_tokens=tokens, ignore_eos=ignore_eos,
                             target_model="qwen3-vl-30b-a3b", profile="a100-40gb",
                             pinned_layers=pinned, lookahead_depth=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32, help="max decoded tokens per request")
    ap.add_argument("--slots", default="64,128,256")
    ap.add_argument("--per-kind", type=int, default=2, help="held-out requests of every kind")
    ap.add_argument("--ignore-eos", action="store_true", help="decode exactly --tokens tokens")
    ap.add_argument("--pinned", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(2)
    lm = workbench.load(None, device="cpu")
    reqs, _ = heldout(a.per_kind)
    work = Path(tempfile.mkdtemp(prefix="bench-caching-"))
    rt = make_runtime(lm, a.tokens, ignore_eos=a.ignore_eos, pinned=a.pinned)
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
                elif name == "lru (on demand)":  # recorded: the bounds replay its routing
                    i = reqs.index(req)
                    r = rt.run(req, store=work / f"lru-{slots}-{i}.zarr", overwrite=True,
                               cache_slots=slots, **kv)
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
            if name == "lru (on demand)":
                rows_bounds = bounds(work, slots, len(reqs))
            if not a.json:
                extra = (f"  agreement {row['top1_agreement']:.3f}  KL {row['kl_mean']:.2e}"
                         if pos else "")
                print(f"slots {slots:3d}  {name:<30} hit {row['hit_rate']:.3f}  loads/step "
                      f"{row['loads_per_step']:6.2f}  blocking I/O {row['blocking_io_ms_modeled']:8.2f}"
                      f" ms  latency {row['latency_ms_modeled']:8.2f} ms{extra}", flush=True)
        for row in rows_bounds:
            rows.append(row)
            if not a.json:
                print(f"slots {slots:3d}  {row['variant']:<30} hit {row['hit_rate']:.3f}  "
                      f"loads/step {row['loads_per_step']:6.2f}  blocking I/O "
                      f"{row['blocking_io_ms_modeled']:8.2f} ms  latency "
                      f"{row['latency_ms_modeled']:8.2f} ms", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps({"tokens": a.tokens, "requests": len(reqs), "rows": rows}))
    else:
        kinds = sorted({k for k in QUESTION_KINDS})
        print(f"{len(reqs)} held-out requests ({a.per_kind} of each kind: {', '.join(kinds)}); "
              f"{sum(1 for r in reqs if not r.images)} text-only")


def bounds(work: Path, slots: int, n: int) -> list[dict]:
    """Belady and the oracle prefetcher, replayed on the recorded LRU runs of ``slots``."""
    out = []
    for label, kv in (("Belady (replay, bound)", dict(eviction="belady")),
                      ("lru + oracle prefetch (replay, bound)", dict(eviction="lru",
                                                                       prefetch="oracle"))):
        tot = dict(hits=0, acc=0, loads=0, steps=0, stall=0.0, latency=0.0)
        for i in range(n):
            ds = workbench.open_run(work / f"lru-{slots}-{i}.zarr")
            m = ds.moe.io_metrics(cache_slots=slots, **kv)
            tot["hits"] += m["hits"]
            tot["acc"] += m["hits"] + m["misses"]
            tot["loads"] += m["transfers"]
            tot["steps"] += ds.sizes["step"]
            tot["stall"] += m["blocking_io_s"]
            tot["latency"] += m["latency_s"]
        out.append({"cache_slots": slots, "variant": label,
                    "hit_rate": tot["hits"] / max(tot["acc"], 1),
                    "loads_per_step": tot["loads"] / tot["steps"],
                    "blocking_io_ms_modeled": tot["stall"] * 1e3 / n,
                    "latency_ms_modeled": tot["latency"] * 1e3 / n})
    return out


if __name__ == "__main__":
    main()
