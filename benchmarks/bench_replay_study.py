"""The dashboard's replay study of one run, *measured*: what a finished run costs the replay view.

A run's replay view replays the run's store for every eviction policy and Belady over a range
of cache sizes (:func:`workbench.ui.replay.study`, ``DataStore.replay_study``): 9 policies × 13
sizes today. Served, it runs on the page's event loop (issue 37: a value typed right after a
run ended waited for it), so this is the time that loop is taken, in slices since the change
that introduced this script. Reported: the whole study with an empty memo (median of
``--repeats``), the time per replay point, and how long one slice of ``ReplayView.SLICE_S``
holds the loop (the longest), all wall-clock on this machine.

    python benchmarks/bench_replay_study.py [--store RUN.zarr] [--repeats 3] [--load N] [--json]

Without ``--store`` it records one run of the embedded model first (``workbench run`` on a
demo scene, 8 new tokens) into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _record(folder: Path) -> Path:
    out = folder / "bench-study.zarr"
    subprocess.run([str(Path(sys.executable).with_name("workbench")), "run", "--image",
                    str(REPO / "data" / "demo" / "scene_9.png"), "--prompt", "describe the scene.",
                    "--max-new-tokens", "8", "--store", str(out)], check=True, cwd=folder,
                   stdout=subprocess.DEVNULL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", default=None, help="a run store (default: record one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="busy-looping processes beside it (default 0)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from loadgen import busy

    with busy(a.load):
        out = _measure(a)
    out["load"] = a.load
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k:>16}: {v}")


def _measure(a) -> dict:
    from workbench.policies.eviction import EVICTION
    from workbench.replay import as_trace
    from workbench.telemetry.reader import open_run
    from workbench.ui import replay as R

    tmp = tempfile.TemporaryDirectory(prefix="bench-study-")
    store = Path(a.store) if a.store else _record(Path(tmp.name))
    trace = as_trace(open_run(store))
    policies = EVICTION.available()
    R.study(trace, policies, memo={})  # warm: imports, the compiled kernel
    whole = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        s = R.study(trace, policies, memo={})
        whole.append(time.perf_counter() - t)
    out = {"store": str(store), "policies": policies, "points": len(s.curves),
           "study_s": statistics.median(whole), "study_s_all": whole,
           "per_point_ms": statistics.median(whole) / len(s.curves) * 1e3}
    if hasattr(R, "study_steps"):  # the sliced study (as served): the longest hold of the loop
        from workbench.ui.views import ReplayView

        steps, holds = R.study_steps(trace, policies, memo={}), []
        while True:
            t = time.perf_counter()
            got = R.advance(steps, time.monotonic() + ReplayView.SLICE_S)
            holds.append(time.perf_counter() - t)
            if isinstance(got, R.ReplayStudy):
                break
        out.update(slice_s=ReplayView.SLICE_S, slices=len(holds),
                   longest_hold_s=max(holds), median_hold_s=statistics.median(holds),
                   sliced_total_s=sum(holds))
    return out


if __name__ == "__main__":
    main()
