"""A run's heap frozen for the garbage collector (``workbench.runtime.heap``): wall time of
runs with the ``gc_freeze`` option on and off, and the collector's full collections during
them — *measured*.

The collector's state carries from run to run (its thresholds count allocations since the
last collection of each generation), so the two settings cannot share a process: each
invocation times one of them, and the comparison alternates invocations::

    for o in on off on off; do python benchmarks/bench_gc_freeze.py --gc-freeze $o; done

One process: the embedded model, every expert cached, a mixed batch of 8 (16 new tokens,
recorded to a store as a run is by default), top-k and MACS (γ0 = 1, 8 ranks) alternated for
``--rounds`` rounds after one warm-up round; per setting the median, mean, 90th percentile
and largest wall time of a run, and the full (oldest-generation) collections that ran during
the timed runs and their summed time (``gc.callbacks``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from bench_dispatch import _speed_setup  # the runtime and knobs its --speed times

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gc-freeze", choices=["on", "off"], required=True)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds} is below 1")
    workbench.set_options(gc_freeze=a.gc_freeze == "on")
    rt, knobs = _speed_setup()
    reqs = workbench.mixed_batch(8, text_share=0.5, seed=1)
    settings = {"topk": {}, "macs": dict(dispatch="macs", capacity_factor=1.0, ep_ranks=8)}
    full = {"n": 0, "s": 0.0}
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            full["n"] += 1
            full["s"] += time.perf_counter() - started.pop()

    gc.callbacks.append(on_gc)
    times: dict[str, list[float]] = {n: [] for n in settings}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds + 1):  # the first round warms up
            if r == 1:
                full.update(n=0, s=0.0)
            order = list(settings.items()) if r % 2 else list(settings.items())[::-1]
            for name, kw in order:
                t0 = time.perf_counter()
                rt.run(reqs, store=f"{d}/{r}-{name}.zarr", **knobs, **kw)
                if r:
                    times[name].append(time.perf_counter() - t0)
    gc.callbacks.remove(on_gc)
    out = {"gc_freeze": a.gc_freeze == "on", "rounds": a.rounds,
           "full_collections": full["n"], "full_collections_s": full["s"]}
    for name, ts in times.items():
        s = sorted(ts)
        out[name] = {"median_s": statistics.median(s), "mean_s": statistics.mean(s),
                     "p90_s": s[min(len(s) - 1, int(0.9 * len(s)))], "max_s": s[-1]}
    print(f"gc_freeze={a.gc_freeze}: " + "; ".join(
        f"{n} median {o['median_s'] * 1e3:.0f} ms, mean {o['mean_s'] * 1e3:.0f}, "
        f"p90 {o['p90_s'] * 1e3:.0f}, max {o['max_s'] * 1e3:.0f}"
        for n, o in out.items() if isinstance(o, dict))
        + f" | full collections during {2 * a.rounds} runs: {full['n']}, "
          f"{full['s'] * 1e3:.0f} ms in all (measured)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
