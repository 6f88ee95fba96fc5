"""MoE-Prism's sub-expert offloading and QoS scheduler on tiny *text* MoEs of two architectures
(issue 16 §5: "on the embedded model and on tiny text MoEs of two architectures") — routing and
C(m, b) *measured*, offloading latency *modeled*.

The two text MoEs are those of ``bench_prism_text`` (a Qwen3-MoE and a Mixtral, ≈ 265 k
parameters each, 4 layers × 8 experts, top-2, 32 neurons per expert), trained on the seed papers'
text (:func:`bench_prism_text.train`, ``--steps`` steps each, ≈ 3.5 min) — or read from
``--checkpoints DIR`` where ``DIR/<arch>`` already holds one (the training is seeded; a folder
without one is trained into). Per architecture:

- **Refactoring**: :func:`workbench.prism.refactor.refactor` on 64 calibration windows of the
  training text (N = 4, the paper's 100 000 annealing iterations per expert), as in
  ``bench_prism_text``.
- **Sub-expert offloading** (§4; seed Fig. 8): ``--n`` held-out prompts (96 characters each,
  the papers' held-out 10 %) generate ``--max-new-tokens`` characters greedily, one at a time
  (a single stream's decode, the seed's Fig. 8 setting) and in batches of 8, recorded natively and with ``prism=True`` at k_active 2/4 and 3/4; every store is replayed
  over memory budgets (6 … 75 % of the 32 experts, ≥ top-2) with whole-expert and with sub-expert
  offloading (:func:`bench_prism_offload.study`, the one replay core), priced as
  Qwen3-VL-30B-A3B experts on an H200 over PCIe 5.0 (each of the model's 4 MoE layers as one of
  the target's layers).
- **Scheduler** (§3; seed §6.2.2): C(m, b) of the model on this machine
  (:meth:`~workbench.prism.costs.CostTable.measure` on 16 held-out prompts, a random
  partition — speed does not depend on which neurons share a sub-expert — one torch thread,
  ``--repeats`` rounds, default 10), then :func:`bench_prism_scheduler.study` with it: prism vs FIFO,
  FullBatch and FIFO with the original model, throughput under the strict and loose SLOs and
  at overload, 5 seeds, verdicts paired over the seeds. The settings are
  ``bench_prism_scheduler``'s, none changed.

JSON: ``--json`` (default ``benchmarks/results/prism_text_studies.json``).

    python benchmarks/bench_prism_text_studies.py [--checkpoints DIR] [--steps 1500]
        [--n 48] [--arch qwen3_moe mixtral]

Needs ``../shared/seeds`` (exits 2 naming it when absent). ≈ 2.5 min on 2 cores from
checkpoints, ≈ 9 min training them first. Time it on a quiet machine: the cost tables are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import workbench  # first: sets the process's OpenMP settings before torch starts

import bench_prism_offload as OFF
import bench_prism_scheduler as SCH
from bench_prism_text import SEEDS, SIZES, calibration, corpus, train, windows

RESULTS = Path(__file__).resolve().parent / "results" / "prism_text_studies.json"
#: requests per recorded run: one (decode of a single stream, the seed's Fig. 8 setting) and
#: 8 (the embedded model's offloading study)
BATCHES = (1, 8)
TABLE_BATCH = 16  # the cost table's largest batch, the scheduler's batch size
#: memory budgets, % of the 32 experts (at least top-2 slots): the embedded study's plus 37 %,
#: one more step where 32 slots leave few (6 % and 12 % are 2 and 3 slots here)
FRACTIONS = (6, 12, 25, 37, 50, 75)


def checkpoint(arch: str, root: Path, train_text: str, held: str, steps: int) -> tuple[Path,
                                                                                        dict]:
    """``root/arch``: trained now unless it already holds a model (its training record then
    read back from ``training.json`` beside it, when there)."""
    ckpt = root / arch
    rec_file = root / f"{arch}.training.json"
    if (ckpt / "config.json").is_file():
        rec = json.loads(rec_file.read_text()) if rec_file.is_file() else {"reused": True}
        return ckpt, {**rec, "reused": str(ckpt)}
    rec = train(arch, train_text, ckpt, steps, held)
    rec_file.write_text(json.dumps(rec, indent=1) + "\n")
    return ckpt, rec


def one(arch: str, ckpt: Path, train_text: str, held: str, a) -> dict:
    from workbench.prism import refactor as R
    from workbench.prism.costs import CostTable

    rt = workbench.Runtime(str(ckpt))
    lm = rt.lm
    Req = workbench.Request
    work = Path(tempfile.mkdtemp(prefix=f"prism-text-studies-{arch}-"))
    t0 = time.perf_counter()
    ref = R.refactor(lm, calibration(train_text))
    t_ref = time.perf_counter() - t0
    R.save(ref, work / "annealed")
    prompts = [Req(p, []) for p, _ in windows(held, a.n, 96, 0, seed=11)]
    offload = {}
    for size in BATCHES:
        t0 = time.perf_counter()
        into = work / f"batch{size}"
        into.mkdir()
        offload[size] = OFF.study(
            rt, work / "annealed", [prompts[i:i + size] for i in range(0, len(prompts), size)],
            into, a.max_new_tokens, fractions=FRACTIONS)
        offload[size].update(batch_size=size, elapsed_s=time.perf_counter() - t0)
    R.save(R.random_refactoring(lm, subexperts=ref.subexperts), work / "random")
    t0 = time.perf_counter()
    table = CostTable.measure(rt, sizes=(1, 2, 4, 8, TABLE_BATCH), repeats=a.repeats,
                              requests=prompts[:TABLE_BATCH],
                              prism_refactoring=str(work / "random"))
    t_table = time.perf_counter() - t0
    sched = SCH.study(f"{arch} (tiny text MoE), this CPU", table, TABLE_BATCH, a.requests)
    return {"arch": arch, "model_id": lm.model_id, "layers": lm.layout.num_layers,
            "experts": lm.layout.num_experts, "top_k": lm.layout.top_k,
            "subexperts": ref.subexperts, "refactor_s": t_ref,
            "objective": {k: float(v.mean()) for k, v in ref.objective.items()},
            "offload": offload, "cost_table": table.to_json(), "cost_summary": table.summary(),
            "cost_table_s": t_table, "scheduler": sched}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--checkpoints", default="",
                    help="folder of trained checkpoints (<arch>/), reused or trained into")
    ap.add_argument("--steps", type=int, default=1500, help="training steps (when training)")
    ap.add_argument("--n", type=int, default=48, help="held-out prompts (offloading study)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=10,
                    help="rounds of the cost table (its cells take milliseconds: 10 are cheap)")
    ap.add_argument("--requests", type=int, default=20_000, help="simulated requests a point")
    ap.add_argument("--seeds", default=str(SEEDS), help="folder of the seed papers' text")
    ap.add_argument("--json", default=str(RESULTS), help="write every number here ('': not)")
    a = ap.parse_args()
    if a.n < TABLE_BATCH:
        ap.error(f"--n {a.n}: the cost table runs batches of up to {TABLE_BATCH} of the held-out "
                 f"prompts; give at least {TABLE_BATCH}")
    root = Path(a.seeds)
    if not sorted(root.glob("*.txt")):
        ap.exit(2, f"bench_prism_text_studies: no seed papers (*.txt) in {root}; the text "
                   f"MoEs train on them\n")
    t_start = time.perf_counter()
    workbench.set_options(threads=1)  # the cost tables' runs (the CPU default, said aloud)
    train_text, held = corpus(root)
    ck = Path(a.checkpoints) if a.checkpoints else Path(tempfile.mkdtemp(prefix="prism-text-"))
    ck.mkdir(parents=True, exist_ok=True)
    out = {"command": "python benchmarks/bench_prism_text_studies.py", "archs": {}}
    for arch in a.arch:
        path, rec = checkpoint(arch, ck, train_text, held, a.steps)
        res = one(arch, path, train_text, held, a)
        res["training"] = rec
        out["archs"][arch] = res
        for size, off in res["offload"].items():
            print(f"\n## {arch}: sub-expert offloading ({off['n']} held-out prompts in batches "
                  f"of {size}, {off['max_new_tokens']} characters each, N = "
                  f"{off['subexperts']}; modeled {off['target_model']} on {off['profile']})\n")
            OFF.report(off)
        print(f"\n## {arch}: C(m, b) measured here, ms per decode step "
              f"({res['cost_table_s']:.0f} s)\n")
        print(res["cost_summary"] + SCH.native_row(res["cost_table"]["meta"]))
        SCH.report(res["scheduler"])
    out["wall_s"] = time.perf_counter() - t_start
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float) + "\n")
        print(f"\n{out['wall_s']:.0f} s; wrote {a.json}")


if __name__ == "__main__":
    main()
