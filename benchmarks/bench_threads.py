"""CPU threads of a run: wall time of the embedded model under each OpenMP setting, on an idle
machine and while another process holds a core — *measured*.

Each setting runs in its own process (OpenMP reads its environment once, when torch starts):
a batch of 8 mixed requests, 16 new tokens, every expert resident, the unmodified runtime and
MoE-Prism with every sub-expert active (a random partition; more, smaller ops), median of
``--rounds`` runs after a warm-up. "busy" starts one ``while True: pass`` process beside it
(one of the two cores of the dev machines taken, as a notebook kernel, the dashboard's server
or a test run take it).

Settings: ``workbench default`` (what ``import workbench`` gives: passive OpenMP waits, and
runs on the CPU with one intra-op thread unless the user said otherwise — the ``threads``
option); ``2 threads, passive waits`` (the default before this benchmark); ``2 threads,
active waits`` (OpenMP's spinning); ``threads=2 option`` (two threads through the option,
passive waits).

    python benchmarks/bench_threads.py [--rounds 5] [--json benchmarks/results/threads.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "threads.json"

_CHILD = r"""
import json, statistics, sys, tempfile, time
from pathlib import Path
import workbench, torch
from workbench.prism import refactor as R
rounds = int(sys.argv[1])
if len(sys.argv) > 2:
    workbench.set_options(threads=int(sys.argv[2]))
rt = workbench.Runtime()
lay = rt.lm.layout
work = Path(tempfile.mkdtemp())
R.save(R.random_refactoring(rt.lm, subexperts=4), work / "p")
reqs = workbench.mixed_batch(8, seed=5)
base = dict(pinned_layers=0, cache_slots=lay.num_layers * lay.num_experts, record=False,
            max_new_tokens=16)
runs = {"native": {}, "prism 4/4": dict(prism=True, prism_refactoring=str(work / "p"))}
times = {r: [] for r in runs}
for i in range(rounds + 1):
    for r, kw in runs.items():
        t = time.perf_counter()
        rt.run(reqs, **base, **kw)
        if i:
            times[r].append(time.perf_counter() - t)
print(json.dumps({r: statistics.median(t) for r, t in times.items()}))
"""

SETTINGS = {
    "workbench default": ({}, None),
    "2 threads, passive waits": ({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}, None),
    "2 threads, active waits": ({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}, None),
    "threads=2 option": ({}, 2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=str(RESULTS))
    a = ap.parse_args()
    out = {"command": "python benchmarks/bench_threads.py", "cpus": os.cpu_count(),
           "rounds": a.rounds, "results": {}}
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "WORKBENCH_THREADS")}
    for load in ("idle", "busy"):
        for name, (env, opt) in SETTINGS.items():
            hog = None
            if load == "busy":
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                time.sleep(0.5)
            try:
                args = [sys.executable, "-c", _CHILD, str(a.rounds)] + (
                    [str(opt)] if opt is not None else [])
                p = subprocess.run(args, env={**base_env, **env}, capture_output=True,
                                   text=True, timeout=1800,
                                   cwd=Path(__file__).resolve().parent)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            if p.returncode:
                raise SystemExit(f"{name} ({load}) failed:\n{p.stderr[-2000:]}")
            med = json.loads(p.stdout.strip().splitlines()[-1])
            out["results"].setdefault(load, {})[name] = med
            print(f"{load:5s} {name:28s} " + ", ".join(f"{r} {s:.3f} s" for r, s in med.items()),
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
