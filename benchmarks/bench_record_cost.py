"""Absolute cost of recording a run (measured): the same demo request with and without a store,
interleaved in one process, medians.

    python benchmarks/bench_record_cost.py [--repeats 25] [--max-new-tokens 8]

Prints the median unrecorded and recorded wall times and their difference (ms). Run it with
``PYTHONPATH=<tree>`` against another version of the package to compare the two.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY before torch starts
from workbench.models.inputs import Request

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    a = ap.parse_args()
    rt = workbench.Runtime()
    req = Request("what color is the circle?", [str(REPO / "data/demo/scene_0.png")])
    with tempfile.TemporaryDirectory() as d:
        rt.run(req, record=False, max_new_tokens=a.max_new_tokens)  # warm-up
        plain, rec = [], []
        for i in range(a.repeats):
            t = time.perf_counter()
            rt.run(req, record=False, max_new_tokens=a.max_new_tokens)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            rt.run(req, store=Path(d) / f"r{i}.zarr", max_new_tokens=a.max_new_tokens)
            rec.append(time.perf_counter() - t)
    p, r = statistics.median(plain) * 1e3, statistics.median(rec) * 1e3
    print(f"unrecorded {p:.1f} ms, recorded {r:.1f} ms, recording costs {r - p:.1f} ms "
          f"(medians of {a.repeats}, measured)")


if __name__ == "__main__":
    main()
