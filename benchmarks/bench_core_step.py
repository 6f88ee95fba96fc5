"""The core's step on a live run's groups, replayed — *measured*, this machine.

Every live layer call hands the core (:meth:`workbench.sim.step.Simulator.step`) one
:class:`~workbench.sim.step.Access`; its per-key Python (lookups, admissions, the transfer
lane, the modeled spans) is what sub-expert offloading multiplies: a batch-8 run with 4
sub-experts per expert sends ≈ 3 600 misses and ≈ 7 000 computed keys through it. This records
the accesses of one live run (a copy of the simulator as the run's first step found it, then
every access in order) and replays them on fresh copies of that simulator, ``--rounds``
times: the wall time of the steps alone, and a digest of every outcome (hits, misses,
evictions, schedule, modeled times and spans) — equal digests mean equal decisions.

Settings: ``subexperts`` (MoE-Prism sub-expert offloading, k_active = N = 4: every sub-expert
a key) and ``experts`` (the same run, whole experts). Compare two trees with the same script
(the digest must not change)::

    for t in OLD NEW OLD NEW; do PYTHONPATH=$t python benchmarks/bench_core_step.py; done
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path


def record(setting: str) -> tuple:
    """(the simulator before the run's first step, the run's accesses) of one live run."""
    import workbench
    from workbench.prism import refactor as R
    from workbench.sim.step import Simulator

    rt = workbench.Runtime()
    lay = rt.lm.layout
    got: dict = {"start": None, "accesses": []}
    step = Simulator.step

    def rec(sim, acc):
        if got["start"] is None:
            got["start"] = copy.deepcopy(sim)
        got["accesses"].append(copy.deepcopy(acc))
        return step(sim, acc)

    # the refactoring is read during the run only: scratch, removed on return
    with tempfile.TemporaryDirectory(prefix="core-step-") as work:
        kw: dict = {}
        if setting == "subexperts":
            R.save(R.random_refactoring(rt.lm, subexperts=4), Path(work) / "p")
            kw = dict(prism=True, prism_offload=True, prism_shortcut=False, prism_k_active=4,
                      prism_refactoring=str(Path(work) / "p"))
        Simulator.step = rec
        try:
            rt.run(workbench.mixed_batch(8, seed=5), max_new_tokens=16, record=False,
                   pinned_layers=1, cache_slots=lay.num_experts * 4, **kw)
        finally:
            Simulator.step = step
    return got["start"], got["accesses"]


def digest(outcomes: list) -> str:
    """sha256 of the outcomes' fields, in order (floats by repr: bit-exact)."""
    h = hashlib.sha256()
    for o in outcomes:
        h.update(repr((o.pinned, o.hits, o.misses, o.host, o.evicted, o.redundant, o.prefetched,
                       o.cancelled, o.prefetch_hits, o.pre_evicted,
                       [repr(a) for a in o.schedule], o.stall_s, o.end_s, o.moved,
                       o.spans)).encode())
    return h.hexdigest()


def measure(setting: str, rounds: int) -> dict:
    start, accesses = record(setting)
    times, dig = [], None
    for _ in range(rounds + 1):  # the first round warms up
        sim = copy.deepcopy(start)
        t0 = time.perf_counter()
        outs = [sim.step(a) for a in accesses]
        times.append(time.perf_counter() - t0)
        d = digest(outs)
        if dig is not None and d != dig:
            raise SystemExit(f"{setting}: two replays of one tree decided differently")
        dig = d
    times = times[1:]
    keys = sum(len(a.experts) for a in accesses)
    return {"groups": len(accesses), "keys": keys, "min_ms": min(times) * 1e3,
            "median_ms": statistics.median(times) * 1e3, "digest": dig}


def main() -> None:
    import workbench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--settings", default="subexperts,experts")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    out = {}
    print(f"the core's steps of one live run, replayed {a.rounds}× (measured; workbench from "
          f"{Path(workbench.__file__).parent.parent}):")
    for s in a.settings.split(","):
        r = out[s] = measure(s, a.rounds)
        print(f"  {s}: {r['groups']} groups, {r['keys']} keys: min {r['min_ms']:.1f} ms, "
              f"median {r['median_ms']:.1f} ms; outcomes {r['digest'][:16]}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
