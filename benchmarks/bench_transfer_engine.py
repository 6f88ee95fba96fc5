"""The CPU copy worker's throughput on sub-expert blocks — *measured*, this machine.

Sub-expert offloading (MoE-Prism, ``prism_offload``) copies 4× the cache keys of a whole-expert
run in blocks of ¼ expert: ≈ 2 600 copies in a batch-8 run of the embedded model, each a
``gate_up`` block [2c, H] and a ``down`` block [H, c] (H = 64, c = 32: 24 KiB). On CPU one
worker thread plays the copy engine (:class:`workbench.runtime.transfer.TransferEngine`); what
it spends per copy beyond the bytes is Python holding the GIL the compute thread wants.

Submits ``--copies`` copies at once and waits for the last, ``--repeats`` times after a warm-up:
median wall time from the first submit to the last landing, and the summed spans the worker
measured around its copies. Compare two trees with the same script::

    for t in OLD NEW OLD NEW; do PYTHONPATH=$t python benchmarks/bench_transfer_engine.py; done
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def measure(copies: int, repeats: int, H: int = 64, c: int = 32) -> dict:
    import torch

    import workbench
    from workbench.runtime.transfer import TransferEngine

    blocks = 64
    src = [{"gate_up": torch.randn(2 * c, H), "down": torch.randn(H, c)} for _ in range(blocks)]
    dst = [{"gate_up": torch.empty(2 * c, H), "down": torch.empty(H, c)} for _ in range(blocks)]
    eng = TransferEngine(torch.device("cpu"))

    def once() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        trs = [eng.submit(i, i % blocks, dst[i % blocks], src[i % blocks])
               for i in range(copies)]
        t1 = time.perf_counter()
        for tr in trs:
            tr.wait()
        t2 = time.perf_counter()
        eng.drain()
        return t1 - t0, t2 - t0, sum(tr.end - tr.start for tr in trs)

    try:
        for _ in range(3):  # warm-up
            once()
        runs = [once() for _ in range(repeats)]
    finally:
        eng.close()
    med = [statistics.median(r[i] for r in runs) * 1e3 for i in range(3)]
    out = {"copies": copies, "submit_ms": med[0], "all_landed_ms": med[1],
           "worker_spans_ms": med[2], "per_copy_us": med[1] / copies * 1e3,
           "workbench": str(Path(workbench.__file__).parent.parent)}
    print(f"{copies} copies of [{2 * c}, {H}] + [{H}, {c}] float32 blocks, median of {repeats} "
          f"(measured; workbench from {out['workbench']}): submitted in {med[0]:.1f} ms, all "
          f"landed after {med[1]:.1f} ms ({out['per_copy_us']:.1f} µs a copy); the worker's "
          f"spans sum to {med[2]:.1f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=2584)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    if a.copies < 1 or a.repeats < 1:
        ap.error("--copies and --repeats must be ≥ 1")
    measure(a.copies, a.repeats)


if __name__ == "__main__":
    main()
