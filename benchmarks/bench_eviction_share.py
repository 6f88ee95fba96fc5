"""Share of Belady's hits per eviction policy on the real decode traces (issue 40 §1).

Every online eviction policy in the registry (``needs`` neither the future nor a predictor)
replays each decode trace in ``../shared/data`` with a global pool of 64 and 128 slots and no
pinned layers; the table gives its hits over Belady's (the oracle, same settings). Replay hit
counts are exact (no timing is involved), so one run is the measurement.

    python benchmarks/bench_eviction_share.py            # the table
    python benchmarks/bench_eviction_share.py --json out.json --slots 32,64,128
    python benchmarks/bench_eviction_share.py --horizons 0,1,8,32,64,96,128   # foresight

Traces (Mixtral-8x7B served by vLLM, 32 layers × 8 experts, top-2; see the data's README):
``he-p0`` and ``he-p1`` are HumanEval problems 0 (83 decode steps) and 1 (255) of
``humaneval_2_routing.jsonl``; ``raw-p0-decode`` the decode steps of ``routing_raw.jsonl``
(problem 0 again, recorded in emission order: the same request as ``he-p0``). reuse-eta's
constants were chosen looking at ``he-p0`` (``tuned``); ``he-p1`` was printed alongside during
that design, so no trace here is a clean held-out set (``seen``).

The whole study (every size 5–50 %, prefill and decode apart, the embedded model's runs too,
cache-aware routing): ``benchmarks/eviction_study.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from workbench.policies.eviction import EVICTION
from workbench.replay.engine import replay
from workbench.traces import read_jsonl

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("WORKBENCH_SHARED", HERE.parents[1] / "shared"))
DATA = SHARED / "data" / "traces" / "mixtral-8x7b-vllm"


def decode_traces():
    """(name, role, trace) of every decode trace in the shared data."""
    he = DATA / "humaneval_2_routing.jsonl"
    yield "he-p0", "tuned", read_jsonl(he, num_experts=8, problem=0)
    yield "he-p1", "seen", read_jsonl(he, num_experts=8, problem=1)
    raw = read_jsonl(DATA / "routing_raw.jsonl", num_experts=8)
    yield "raw-p0-decode", "tuned (same request)", raw.step_slice(1, raw.num_steps)


def online_policies() -> list[str]:
    out = []
    for name in EVICTION.available():
        cls = EVICTION.get(name)
        if not cls.needs:  # no future (an oracle), no predictor (the traces have none)
            out.append(name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--horizons", type=lambda s: [int(x) for x in s.split(",")],
                    help="instead: the foresight table, the belady-horizon oracle's share of "
                         "Belady at these horizons (layer turns; 32 = one Mixtral token), e.g. "
                         "0,1,8,32,64,96,128")
    a = ap.parse_args()
    if not DATA.exists():
        sys.exit(f"the shared traces are not at {DATA} (set WORKBENCH_SHARED)")
    if a.horizons:
        return foresight(a)
    policies = online_policies()
    rows = []
    head = f"{'trace':<14} {'role':<21} {'slots':>5} {'belady':>7}  " + "  ".join(
        f"{p:>11}" for p in policies)
    print(head)
    print("-" * len(head))
    for name, role, tr in decode_traces():
        for slots in a.slots:
            kw = dict(cache_slots=slots, pinned_layers=0, scope="global")
            bel = int(replay(tr, eviction="belady", **kw).hits.sum())
            share = {}
            for p in policies:
                h = int(replay(tr, eviction=p, **kw).hits.sum())
                share[p] = h / bel if bel else float("nan")
                rows.append(dict(trace=name, role=role, steps=tr.num_steps, slots=slots,
                                 policy=p, hits=h, belady_hits=bel, share=share[p]))
            print(f"{name:<14} {role:<21} {slots:>5} {bel:>7}  " + "  ".join(
                f"{share[p]:>11.3f}" for p in policies), flush=True)
    best = {}
    for r in rows:
        best.setdefault((r["trace"], r["slots"]), []).append((r["share"], r["policy"]))
    print("\nbest online policy per (trace, slots):")
    for (t, s), v in best.items():
        top = max(sh for sh, _ in v)
        names = ", ".join(p for sh, p in v if sh == top)
        print(f"  {t:<14} {s:>4} slots: {top:.3f} of Belady ({names})")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


def foresight(a) -> None:
    """The foresight table: how far ahead an eviction policy must see the routing to reach a
    share of Belady's hits (``workbench.analysis.eviction_study.foresight_study``)."""
    from workbench.analysis.eviction_study import foresight_needed, foresight_study

    df = foresight_study({n: t for n, _, t in decode_traces()}, slots=a.slots,
                         horizons=a.horizons)
    t = df.pivot_table(index=["trace", "slots"], columns="horizon", values="share", sort=False)
    print("share of Belady's hits of Belady seeing h layer turns ahead (LRU beyond), decode:")
    print(t.round(3).to_string())
    print("\nleast horizon studied reaching 0.90 of Belady:")
    print(foresight_needed(df).to_string())
    if a.json:
        Path(a.json).write_text(df.to_json(orient="records", indent=1))


if __name__ == "__main__":
    main()
