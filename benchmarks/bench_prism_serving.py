"""A measured serving run driven by MoE-Prism's QoS scheduler, beside the simulation's prediction
(issue 16 §3, "optionally drive the real runtime from the same scheduler") — *measured*.

The embedded model on this machine serves Poisson arrivals in real time
(:func:`workbench.prism.serving.serve`): the scheduler's decision kernel picks each batch and
its level m from a cost table C(m, b); the runtime runs the batch (``prism=True,
prism_k_active=m``, every expert resident, a random partition of N = 4: speed does not depend
on it) and every token is stamped by the wall clock. The same requests, knobs and table then
go through the simulation (:func:`workbench.prism.scheduler.simulate`), and the two are put
side by side (:func:`workbench.prism.serving.compare`): how well the simulation predicts the
machine, and whether the policies rank the same measured as simulated.

The cost table is measured first on this machine (``CostTable.measure``: sizes 1 … 16, 5
rounds; ``--cost FILE`` reuses one). Requests: ``--n`` per point, batch size B = 8, k_min
uniform in 1 … 4, 8 generated tokens on average (± 50 %), held-out image requests (one prompt
length); rates 0.5, 1 and 1.5 × μ_full = B / S_full (S_full: a full batch of the longest
requests at full quality); prism's timeout S_full / 2. Goodput limits, the strict SLO of
``bench_prism_scheduler``: TTFT ≤ S_full, end-to-end ≤ 2 · S_full, TPOT ≤ the largest
C(b, N), b ≤ B.

    python benchmarks/bench_prism_serving.py [--n 48] [--cost FILE] [--json OUT]

≈ 3 min on 2 cores (the table ≈ 1.5 min).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import workbench  # first: sets the process's OpenMP settings before torch starts
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "prism_serving.json"
RATE_FACTORS = (0.5, 1.0, 1.5)
POLICIES = ("prism", "fifo", "fullbatch")


def main() -> None:
    from workbench.prism import refactor as R
    from workbench.prism import scheduler as S
    from workbench.prism import serving as V
    from workbench.prism.costs import CostTable

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=48, help="requests per point")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out-tokens", type=int, default=8)
    ap.add_argument("--cost", help="a measured cost table to reuse (default: measure now)")
    ap.add_argument("--cost-out", default="", help="save the measured table here")
    ap.add_argument("--json", default=str(RESULTS))
    a = ap.parse_args()
    t_start = time.perf_counter()
    rt = workbench.Runtime()
    lay = rt.lm.layout
    work = Path(tempfile.mkdtemp(prefix="prism-serving-"))
    R.save(R.random_refactoring(rt.lm, subexperts=4), work / "p")
    run = dict(prism_refactoring=str(work / "p"), pinned_layers=0,
               cache_slots=lay.num_layers * lay.num_experts)
    if a.cost:
        table = CostTable.load(a.cost)
    else:
        table = CostTable.measure(rt, repeats=5, **run)
        if a.cost_out:
            table.save(a.cost_out, overwrite=True)
    print(f"cost table ({table.clock}), ms:\n{table.summary()}")
    N, B = table.subexperts, a.batch
    spread = 0.5
    hi_out = max(round(a.out_tokens * (1 - spread)), round(a.out_tokens * (1 + spread)))
    decode, _ = table.grid(B)
    s_full = table.prefill(B, N, table.prompt_tokens) + (hi_out - 1) * table(B, N)
    mu = B / s_full
    slo = dict(ttft_slo_s=s_full, e2e_slo_s=2 * s_full,
               tpot_slo_s=float(decode[N - 1, 1:B + 1].max()), timeout_s=s_full / 2)
    print(f"S_full {s_full * 1e3:.0f} ms, μ_full {mu:.1f} requests/s")
    prompts = workbench.batch(a.n, mix="image")
    points = []
    for f in RATE_FACTORS:
        for policy in POLICIES:
            k = S.SchedulerKnobs(policy=policy, batch_size=B, rate=f * mu, requests=a.n,
                                 out_tokens=a.out_tokens, token_spread=spread, seed=3,
                                 prompt_tokens=table.prompt_tokens, **slo)
            drawn = S.Requests.poisson(N, k)
            # every request is a held-out image request: one prompt length, the table's
            req = S.Requests(drawn.arrival_s, drawn.kmin, np.full(a.n, table.prompt_tokens),
                             drawn.out_tokens, N)
            sch = V.serve(rt, req, prompts, table, k, **run)
            c = V.compare(sch, table)
            m, s = c["measured"], c["simulated"]
            points.append({"rate_factor": f, "rate_rps": f * mu, "policy": policy, **c})
            print(f"{f:.1f} μ {policy:9s} measured: {m['throughput_rps']:5.1f} req/s, goodput "
                  f"{m['goodput_rps']:5.1f}, TTFT p50/p99 {m['ttft_s']['p50'] * 1e3:4.0f}/"
                  f"{m['ttft_s']['p99'] * 1e3:4.0f} ms, E2E p99 {m['e2e_s']['p99'] * 1e3:4.0f} ms"
                  f" | simulated: {s['throughput_rps']:5.1f}, goodput {s['goodput_rps']:5.1f}, "
                  f"TTFT {s['ttft_s']['p50'] * 1e3:4.0f}/{s['ttft_s']['p99'] * 1e3:4.0f}, E2E p99 "
                  f"{s['e2e_s']['p99'] * 1e3:4.0f} | same launches {c['same_launches']}",
                  flush=True)
    out = {"command": "python benchmarks/bench_prism_serving.py", "n": a.n, "batch": B,
           "out_tokens": a.out_tokens, "s_full_s": s_full, "mu_rps": mu, "slo": slo,
           "table": table.to_json(), "points": points,
           "wall_s": time.perf_counter() - t_start}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float) + "\n")
        print(f"results: {a.json}")


if __name__ == "__main__":
    main()
