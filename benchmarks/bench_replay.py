"""Replay throughput (issue 4 goal: ≥ 5 M expert accesses/s on one core for LRU), and the same
flattened trace through libCacheSim, side by side in one process (medians of --repeats).

Trace: the real Mixtral-8x7B decode trace (../shared/data/traces/…/humaneval_2_routing.jsonl)
tiled --tile times (each tile a new request), so the numbers cover ~1 M accesses. Grouped
replay = the workbench's (step, layer) semantics with the modeled clock; "kernel" is the compiled
loop alone, "end-to-end" adds grouping, pricing and prefetch planning. Flattened = one key per
access, the classic cache simulation both tools run; their hit counts are asserted equal.

    python benchmarks/bench_replay.py [--tile 50] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from workbench.replay.engine import replay
from workbench.replay.flat import flat_hits
from workbench.traces import Trace, read_jsonl

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WORKBENCH_SHARED", REPO.parent / "shared"))
MIXTRAL = SHARED / "data/traces/mixtral-8x7b-vllm/humaneval_2_routing.jsonl"


def tiled(trace: Trace, n: int) -> Trace:
    steps = trace.num_steps
    return Trace(
        topk_ids=np.concatenate([trace.topk_ids] * n),
        token_step=np.concatenate([trace.token_step + i * steps for i in range(n)]),
        num_experts=trace.num_experts,
        step_request=np.concatenate([trace.step_request + i * (trace.step_request.max() + 1)
                                     for i in range(n)]),
        attrs={"source": f"{trace.attrs['source']} ×{n}"})


def median_time(f, repeats: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tile", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not MIXTRAL.exists():
        raise SystemExit(f"needs the Mixtral trace at {MIXTRAL}")
    tr = tiled(read_jsonl(MIXTRAL, num_experts=8), a.tile)
    kw = dict(cache_slots=a.slots, pinned_layers=0, target_model="qwen3-vl-30b-a3b")
    replay(tr, **kw)  # compile / load the numba cache
    rows = {}
    for ev, pf in (("lru", "none"), ("lfu", "none"), ("hotness", "none"), ("belady", "none"),
                   ("lru", "oracle")):
        t, res = median_time(lambda: replay(tr, eviction=ev, prefetch=pf, **kw), a.repeats)
        kernel = statistics.median(
            replay(tr, eviction=ev, prefetch=pf, **kw).elapsed_s for _ in range(a.repeats))
        rows[f"grouped {ev}, prefetch {pf}"] = {
            "accesses": res.accesses, "hit_rate": res.hit_rate,
            "kernel_accesses_per_s": res.accesses / kernel,
            "end_to_end_accesses_per_s": res.accesses / t}
    keys = tr.groups().keys()
    flat_hits(keys[:100], a.slots)
    nxt = np.full(len(keys), -1, np.int64)
    last: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        nxt[i] = last.get(int(keys[i]), -1)
        last[int(keys[i])] = i
    for ev in ("lru", "belady"):
        t, hits = median_time(lambda: flat_hits(keys, a.slots, ev), a.repeats)
        rows[f"flattened {ev} (workbench)"] = {"accesses": len(keys), "hits": hits,
                                               "end_to_end_accesses_per_s": len(keys) / t}
    try:
        import libcachesim as lcs
    except ImportError:
        lcs = None
    if lcs is not None:
        rec = np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
        arr = np.zeros(len(keys), rec)
        arr["t"], arr["id"], arr["size"], arr["next"] = np.arange(len(keys)), keys + 1, 1, nxt
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.oracleGeneral.bin"
            arr.tofile(path)
            for name, cls in (("lru", lcs.LRU), ("belady", lcs.Belady)):
                def run():
                    reader = lcs.TraceReader(str(path),
                                             trace_type=lcs.TraceType.ORACLE_GENERAL_TRACE)
                    return cls(cache_size=a.slots).process_trace(reader)[0]

                t, miss_ratio = median_time(run, a.repeats)
                hits = round((1 - miss_ratio) * len(keys))
                ours = rows[f"flattened {name} (workbench)"]["hits"]
                assert hits == ours, f"{name}: libCacheSim {hits} hits, workbench {ours}"
                rows[f"flattened {name} (libCacheSim)"] = {
                    "accesses": len(keys), "hits": hits,
                    "end_to_end_accesses_per_s": len(keys) / t}
    out = {"trace": repr(tr), "cache_slots": a.slots, "repeats": a.repeats, "rows": rows}
    if a.json:
        print(json.dumps(out))
        return
    print(f"{tr!r}, cache_slots={a.slots}, medians of {a.repeats} (measured, one core)")
    for name, r in rows.items():
        k = r.get("kernel_accesses_per_s")
        print(f"  {name:<34} {r['accesses']:>9} accesses  "
              + (f"kernel {k / 1e6:6.1f} M/s  " if k else " " * 21)
              + f"end-to-end {r['end_to_end_accesses_per_s'] / 1e6:6.2f} M/s")


if __name__ == "__main__":
    main()
