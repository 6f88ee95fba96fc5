"""The CPU copy worker's throughput on sub-expert blocks — *measured*, this machine.

Sub-expert offloading (MoE-Prism, ``prism_offload``) copies 4× the cache keys of a whole-expert
run in blocks of ¼ expert: ≈ 2 600 copies in a batch-8 run of the embedded model, each a
``gate_up`` block [2c, H] and a ``down`` block [H, c] (H = 64, c = 32: 24 KiB). On CPU one
worker thread plays the copy engine (:class:`workbench.runtime.transfer.TransferEngine`); what
it spends per copy beyond the bytes is Python holding the GIL the compute thread wants.

Submits ``--copies`` copies at once and waits for the last, ``--repeats`` times after a warm-up:
median wall time from the first submit to the last landing, and the summed spans the worker
measured around its copies. ``--batch 1,20``: one submit per copy, then
``submit_many`` of 20 at a time (a layer's run of loads). Compare two trees with the same
script::

    for t in OLD NEW OLD NEW; do PYTHONPATH=$t python benchmarks/bench_transfer_engine.py; done
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def measure(copies: int, repeats: int, batch: int = 1, H: int = 64, c: int = 32) -> dict:
    """``batch`` 1: a :meth:`~TransferEngine.submit` per copy (views of a slot and a host
    block, made once, as the runtime keeps them); ``batch`` b > 1:
    :meth:`~TransferEngine.submit_many` of b copies at a time (what the executor submits for
    a layer's run of loads)."""
    import torch

    import workbench
    from workbench.runtime.transfer import TransferEngine

    blocks = 64
    src = {"gate_up": torch.randn(blocks, 2 * c, H), "down": torch.randn(blocks, H, c)}
    dst = {"gate_up": torch.empty(blocks, 2 * c, H), "down": torch.empty(blocks, H, c)}
    src_v = [{n: t[i] for n, t in src.items()} for i in range(blocks)]
    dst_v = [{n: t[i] for n, t in dst.items()} for i in range(blocks)]
    eng = TransferEngine(torch.device("cpu"))

    def once() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        if batch == 1:
            trs = [eng.submit(i, i % blocks, dst_v[i % blocks], src_v[i % blocks])
                   for i in range(copies)]
        else:
            trs = []
            for j in range(0, copies, batch):
                at = [i % blocks for i in range(j, min(j + batch, copies))]
                # (distinct slots within a job: batch ≤ 64)
                trs += eng.submit_many(list(range(j, j + len(at))), at, dst, src, at)
        t1 = time.perf_counter()
        for tr in trs:
            tr.wait()
        t2 = time.perf_counter()
        eng.drain()
        # a job's copies share its interval: each counted once
        spans = {(tr.start, tr.end) for tr in trs}
        return t1 - t0, t2 - t0, sum(e - s for s, e in spans)

    try:
        for _ in range(3):  # warm-up
            once()
        runs = [once() for _ in range(repeats)]
    finally:
        eng.close()
    med = [statistics.median(r[i] for r in runs) * 1e3 for i in range(3)]
    out = {"copies": copies, "batch": batch, "submit_ms": med[0], "all_landed_ms": med[1],
           "worker_spans_ms": med[2], "per_copy_us": med[1] / copies * 1e3,
           "workbench": str(Path(workbench.__file__).parent.parent)}
    how = "one submit each" if batch == 1 else f"submit_many of {batch}"
    print(f"{copies} copies of [{2 * c}, {H}] + [{H}, {c}] float32 blocks ({how}), median of "
          f"{repeats} (measured; workbench from {out['workbench']}): submitted in "
          f"{med[0]:.1f} ms, all landed after {med[1]:.1f} ms ({out['per_copy_us']:.1f} µs a "
          f"copy); the worker's spans sum to {med[2]:.1f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=2584)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", default="1",
                    help="copies per submission, comma-separated settings run one after "
                         "another (1: one submit each; e.g. 1,20)")
    a = ap.parse_args()
    sizes = [int(b) for b in a.batch.split(",")]
    if a.copies < 1 or a.repeats < 1 or not all(1 <= b <= 64 for b in sizes):
        ap.error("--copies and --repeats must be ≥ 1, --batch sizes from 1 to 64")
    for b in sizes:
        measure(a.copies, a.repeats, b)


if __name__ == "__main__":
    main()
