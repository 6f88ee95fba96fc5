"""EPLB on real routing, scored on future traffic (issue 15 §3) — load only, no model.

The real Mixtral-8x7B decode trace (../shared/data/traces/mixtral-8x7b-vllm/
humaneval_2_routing.jsonl: 32 layers × 8 experts, top-2, one token per step), ``b``
consecutive decode steps served as one batch step (a stand-in for a decode batch of b
tokens). 8 experts on 4 or 8 ranks (GPUs), ``redundant`` extra slots per layer; EPLB
(:func:`workbench.sim.eplb_replay.eplb_over_time`) refits every ``interval`` batch steps on
the last ``window`` and serves the next ones — it never sees the traffic it is scored on. For
each setting: the mean imbalance (max/mean rank load per (step, layer)) of the static
contiguous placement and of EPLB over the steps a fitted plan served, the rebalances, and the
bytes they move at Mixtral's expert size (3 × 4096 × 14336 bf16 = 352 MB; *modeled*
seconds on NVLink H100). Also an *oracle* plan fitted on the very steps it serves (what
history cannot reach).

    python benchmarks/bench_eplb.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WORKBENCH_SHARED", REPO.parent / "shared"))
MIXTRAL = SHARED / "data/traces/mixtral-8x7b-vllm/humaneval_2_routing.jsonl"
EXPERT_BYTES = 3 * 4096 * 14336 * 2


def step_counts(trace, b: int) -> np.ndarray:
    """[S, L, E] routed tokens per (batch step, layer, expert), b decode steps a batch step."""
    ids = np.asarray(trace.topk_ids, np.int64)
    step = np.asarray(trace.token_step, np.int64) // b
    S, L, E = int(step.max()) + 1, ids.shape[1], trace.num_experts
    out = np.zeros((S, L, E))
    t, l, r = np.nonzero(ids >= 0)
    np.add.at(out, (step[t], l, ids[t, l, r]), 1)
    return out


def oracle(counts, ranks, redundant, interval):
    """Each interval served by the plan fitted on itself (the bound history cannot reach)."""
    from workbench.sim.ep import imbalance
    from workbench.sim.eplb import rebalance_experts, replica_share

    S, L, E = counts.shape
    ib = []
    for t0 in range(interval, S, interval):
        c = counts[t0:t0 + interval]
        phy2log, _, cnt = rebalance_experts(c.sum(0), E + redundant, 1, 1, ranks)
        ib.append(imbalance(np.einsum("sle,ler->slr", c, replica_share(phy2log, cnt, ranks))))
    if not ib:
        return None
    return float(np.nanmean(np.concatenate(ib)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    if not MIXTRAL.exists():
        sys.exit(f"bench_eplb: the Mixtral trace is not at {MIXTRAL} (../shared absent)")
    from workbench.sim.eplb_replay import eplb_over_time
    from workbench.sim.profiles import get_interconnect
    from workbench.traces import load_trace

    trace = load_trace(MIXTRAL)
    link = get_interconnect("nvlink-h100")
    rows = []
    print("| batch | ranks | redundant | window / interval | static imbalance | EPLB "
          "(history) | oracle (fit on the served steps) | rebalances | GB moved | modeled s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in (4, 8):
        counts = step_counts(trace, b)
        for ranks, redundant in ((4, 0), (4, 4), (8, 8)):
            for window, interval in ((8, 4), (16, 8)):
                r = eplb_over_time(counts, ranks, redundant, window, interval,
                                   expert_bytes=EXPERT_BYTES, link=link)
                s = r.summary()
                orc = oracle(counts, ranks, redundant, interval)
                row = {"batch": b, "steps": counts.shape[0], "ranks": ranks,
                       "redundant": redundant, "window": window, "interval": interval,
                       **s, "oracle_imbalance": orc}
                rows.append(row)
                print(f"| {b} | {ranks} | {redundant} | {window} / {interval} | "
                      f"{s['static_imbalance_after_first_fit']:.3f} | "
                      f"{s['eplb_imbalance_after_first_fit']:.3f} | "
                      f"{'—' if orc is None else format(orc, '.3f')} | "
                      f"{s['rebalances']} | {s['bytes_moved'] / 1e9:.1f} | "
                      f"{s['rebalance_s_modeled']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
