"""Transfer order (issue 39 §1): ``fifo`` against ``demand-first`` on the modeled transfer lane,
for each prefetch policy, on real routing traces.

Traces:
- the shared Mixtral-8x7B decode trace (../shared/data/traces/mixtral-8x7b-vllm/
  humaneval_2_routing.jsonl; 32 layers × 8 experts, top-2): prefetch none / previous-step /
  oracle (it carries no router lookahead, so no speculative);
- runs of the embedded model recorded here (the bundled demo requests, ``--new-tokens`` tokens
  each, router lookahead recorded with ``lookahead_depth=2``): none / speculative /
  previous-step / oracle.

Every row is a trace replay (``workbench.replay.engine.replay``, the compiled engine: it equals
the python one under both orders, ``tests/test_transfer_order.py``). Each trace is priced as
``--target-model`` experts on ``--profile`` (times are **modeled**, not measured). Columns:
transfers (copies made: demand loads + prefetches − cancelled), demand loads, stalled groups
(offloaded (step, layer) groups whose compute waited on the transfer lane), blocking I/O and
latency (modeled seconds), prefetches issued, and prefetches cancelled (demand-first: not
started when their layer had run).

    python benchmarks/bench_transfer_order.py [--slots-mixtral 64] [--slots-embedded 24]
        [--new-tokens 8] [--json PATH]

(``--slots-mixtral`` takes several sizes: 24 and 64 by default.)

``--speed``: instead, the replay engines side by side on the shared Mixtral trace under
demand-first with prefetch — each eviction policy of the compiled kernel × previous-step /
oracle at the first ``--slots-mixtral`` size: the wall time of one ``replay()`` call on each
engine (*measured*, the trace already loaded; median of ``--repeats`` runs, the two engines
interleaved run by run after one warm-up call each), and a check that both gave the same
metrics (all but the measured ones).

    python benchmarks/bench_transfer_order.py --speed [--repeats 5] [--slots-mixtral 24]
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

from workbench.replay import kernel as K
from workbench.replay.engine import replay
from workbench.sim.lane import TRANSFER_ORDERS
from workbench.traces import from_store, read_jsonl

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WORKBENCH_SHARED", REPO.parent / "shared"))
MIXTRAL = SHARED / "data/traces/mixtral-8x7b-vllm/humaneval_2_routing.jsonl"


def embedded_traces(new_tokens: int, root: Path) -> list:
    """The demo requests run live on the embedded model (lookahead recorded), one trace each."""
    import workbench
    from workbench.models.embedded import EMBEDDED_MODEL_DIR
    from workbench.models.embedded.demo import read_demo

    lm = workbench.load(EMBEDDED_MODEL_DIR, device="cpu")
    rt = workbench.Runtime(lm, device="cpu", max_new_tokens=new_tokens, ignore_eos=True)
    out = []
    for i, p in enumerate(read_demo()):
        path = root / f"demo{i}.zarr"
        rt.run(p["prompt"], [p["image"]] if p["image"] else [], store=path,
               lookahead_depth=2)
        out.append(from_store(path))
    return out


def row(trace_name: str, traces: list, prefetch: str, order: str, **kw) -> dict:
    tot: dict = {}
    for tr in traces:
        r = replay(tr, prefetch=prefetch, transfer_order=order, **kw)
        m = r.metrics()
        stalls = int((np.asarray(r.stall_s)[:, ~r.pinned] > 0).sum())
        for k, v in (("transfers", m["transfers"]), ("demand_loads", m["demand_loads"]),
                     ("demand_stalls", stalls), ("blocking_io_s", m["blocking_io_s"]),
                     ("latency_s", m["latency_s"]), ("prefetches", m["prefetch_loads"]),
                     ("cancelled", m["cancelled_prefetches"])):
            tot[k] = tot.get(k, 0) + v
        tot["engine"] = r.config["engine"]
    return {"trace": trace_name, "prefetch": prefetch, "order": order, **tot}


MEASURED = ("replay_s_measured", "accesses_per_s_measured")


def speed_rows(trace, slots: int, repeats: int, **common) -> list[dict]:
    """Fast vs python engine wall time (measured) of demand-first replays with prefetch."""
    rows = []
    for eviction in K.POLICY_CODES:
        for pf in ("previous-step", "oracle"):
            kw = dict(eviction=eviction, prefetch=pf, transfer_order="demand-first",
                      cache_slots=slots, **common)
            walls: dict[str, list[float]] = {"fast": [], "python": []}
            metrics = {}
            for engine in walls:  # warm-up (the kernel is compiled or loaded from its cache)
                replay(trace, engine=engine, **kw)
            for _ in range(repeats):
                for engine in walls:
                    t0 = time.perf_counter()
                    r = replay(trace, engine=engine, **kw)
                    walls[engine].append(time.perf_counter() - t0)
                    metrics[engine] = {k: v for k, v in r.metrics().items() if k not in MEASURED}
            fast, py = (statistics.median(walls[e]) for e in ("fast", "python"))
            rows.append({"eviction": eviction, "prefetch": pf, "slots": slots,
                         "fast_ms": 1e3 * fast, "python_ms": 1e3 * py, "speedup": py / fast,
                         "cancelled": metrics["fast"]["cancelled_prefetches"],
                         "identical": metrics["fast"] == metrics["python"]})
    return rows


def speed(a, common: dict) -> None:
    if not MIXTRAL.exists():
        print(f"(shared trace absent at {MIXTRAL}: nothing to time)")
        return
    trace = read_jsonl(MIXTRAL)
    slots = a.slots_mixtral[0]
    rows = speed_rows(trace, slots, a.repeats, **common)
    print(f"shared Mixtral-8x7B trace: {trace.num_steps} steps × {trace.num_layers} layers × "
          f"{trace.num_experts} experts, top-{trace.top_k}; demand-first, prefetch lead "
          f"{a.lead}, {slots} slots, 1 pinned layer; wall time of one replay() call "
          f"(measured, median of {a.repeats})\n")
    print("| eviction | prefetch | fast engine (ms) | python engine (ms) | speed-up | "
          "cancelled prefetches | identical metrics |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['eviction']} | {r['prefetch']} | {r['fast_ms']:.1f} | "
              f"{r['python_ms']:.0f} | {r['speedup']:.0f}× | {r['cancelled']} | "
              f"{'yes' if r['identical'] else 'NO'} |")
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots-mixtral", type=int, nargs="+", default=[24, 64])
    ap.add_argument("--slots-embedded", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--lead", type=int, default=2)
    ap.add_argument("--profile", default="a100-40gb")
    ap.add_argument("--target-model", default="qwen3-vl-30b-a3b")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--speed", action="store_true",
                    help="time the fast and python replay engines (demand-first, prefetch)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    common = dict(prefetch_lead=a.lead, profile=a.profile, target_model=a.target_model)
    if a.speed:
        speed(a, common)
        return
    rows = []
    if MIXTRAL.exists():
        mix = [read_jsonl(MIXTRAL)]
        for slots in a.slots_mixtral:
            for pf in ("none", "previous-step", "oracle"):
                for order in TRANSFER_ORDERS:
                    rows.append(row(f"mixtral-8x7b (shared), {slots} slots", mix, pf, order,
                                    cache_slots=slots, **common))
    else:
        print(f"(shared trace absent at {MIXTRAL}: Mixtral rows skipped)")
    with tempfile.TemporaryDirectory() as d:
        emb = embedded_traces(a.new_tokens, Path(d))
        for pf in ("none", "speculative", "previous-step", "oracle"):
            for order in TRANSFER_ORDERS:
                rows.append(row(f"embedded ({len(emb)} demo runs), {a.slots_embedded} slots",
                                emb, pf, order,
                                cache_slots=a.slots_embedded, **common))
    print(f"prefetch lead {a.lead}; pinned layers 1 (the default); priced as "
          f"{a.target_model} on {a.profile} (times modeled)\n")
    print("| trace | prefetch | order | transfers | demand loads | stalled groups | "
          "blocking I/O (modeled s) | latency (modeled s) | prefetches | cancelled |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trace']} | {r['prefetch']} | {r['order']} | {r['transfers']} | "
              f"{r['demand_loads']} | {r['demand_stalls']} | {r['blocking_io_s']:.3f} | "
              f"{r['latency_s']:.3f} | {r['prefetches']} | {r['cancelled']} |")
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
