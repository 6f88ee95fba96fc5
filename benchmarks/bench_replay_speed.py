"""Replay speed on any trace (issue 11): flattened LRU / Belady against libCacheSim, cost
against trace length, and ``workbench replay`` end to end with a cProfile breakdown.

Traces come from ``benchmarks/zipf_trace.py`` (deterministic, seeded): every (token, layer)
routes to k distinct of E experts, zipf(alpha) popularity, 32 layers, one token per step. The
flattened trace is the replay's serving order as one key per access (``layer · E + expert``),
the classic cache simulation libCacheSim runs too. All times are *measured* wall-clock on one
core (numba and libCacheSim both run single-threaded); each comparison runs its contenders
interleaved, repeat by repeat, in one process, and reports medians.

    python benchmarks/bench_replay_speed.py flat     # vs libCacheSim: E × k × slots grid
    python benchmarks/bench_replay_speed.py linear   # 1×, 4×, 16× the trace length
    python benchmarks/bench_replay_speed.py e2e      # workbench replay <trace.npy>, profiled
    python benchmarks/bench_replay_speed.py billion  # 10⁹ accesses, Belady: time and memory

``flat`` needs libCacheSim's Python bindings (``pip install libcachesim``; in the ``test``
extra, not a dependency of the package): without them it says so and times ours alone.
Ours = :func:`workbench.replay.flat_hits` end to end (relabelling the keys and, for Belady,
finding every next access included); libCacheSim = ``process_trace`` over an oracleGeneral file
(the next accesses precomputed in the file, reading included). Hit counts are asserted equal.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from zipf_trace import zipf_flat_keys, zipf_routing  # noqa: E402

from workbench.replay.flat import flat_hits  # noqa: E402
from workbench.traces import Trace  # noqa: E402

LAYERS = 32
TARGET = "qwen3-vl-30b-a3b"  # prices the .npy trace (it carries no model sizes)


def flat_keys(experts: int, k: int, steps: int, alpha: float, seed: int) -> np.ndarray:
    """The replay's accesses in serving order, one key ``layer · E + expert`` each."""
    ids = zipf_routing(steps, LAYERS, experts, k, alpha, seed)
    return Trace(topk_ids=ids, token_step=np.arange(steps), num_experts=experts).groups().keys()


def interleaved(fns: dict, repeats: int) -> dict:
    """{name: (median seconds, results)}: every repeat runs each function once, in turn."""
    times: dict = {n: [] for n in fns}
    out: dict = {n: [] for n in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            out[name].append(f())
            times[name].append(time.perf_counter() - t0)
    return {n: (statistics.median(times[n]), out[n]) for n in fns}


# -- flat: ours against libCacheSim -------------------------------------------------------------
def oracle_general(keys: np.ndarray, path: Path) -> None:
    """libCacheSim's oracleGeneral binary trace: (time u32, id u64, size u32, next access
    i64 (-1: never)), one record per access."""
    order = np.argsort(keys, kind="stable")
    nxt = np.full(len(keys), -1, np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    rec = np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
    arr = np.zeros(len(keys), rec)
    arr["t"], arr["id"], arr["size"], arr["next"] = np.arange(len(keys)), keys + 1, 1, nxt
    arr.tofile(path)


def run_flat(a) -> dict:
    try:
        import libcachesim as lcs
    except ImportError:
        lcs = None
        print("libCacheSim's Python bindings are not installed (pip install libcachesim): "
              "timing the workbench alone, no comparison", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for E in a.experts:
            for k in a.k:
                if k > E:
                    continue
                steps = max(1, a.accesses // (LAYERS * k))
                keys = flat_keys(E, k, steps, a.alpha, a.seed)
                n_keys = LAYERS * E
                path = Path(d) / f"zipf-{E}-{k}.oracleGeneral.bin"
                if lcs is not None:
                    oracle_general(keys, path)
                flat_hits(keys[:1000], 8, "lru")  # load the compiled kernels
                flat_hits(keys[:1000], 8, "belady")
                for slots in a.slots:
                    fns = {}
                    for ev in ("lru", "belady"):
                        fns[f"ours {ev}"] = (lambda ev=ev: flat_hits(keys, slots, ev))
                        if lcs is not None:
                            cls = {"lru": lcs.LRU, "belady": lcs.Belady}[ev]

                            def lib(cls=cls):
                                reader = lcs.TraceReader(
                                    str(path), trace_type=lcs.TraceType.ORACLE_GENERAL_TRACE)
                                miss_ratio = cls(cache_size=slots).process_trace(reader)[0]
                                return round((1 - miss_ratio) * len(keys))

                            fns[f"lcs {ev}"] = lib
                    res = interleaved(fns, a.repeats)
                    for ev in ("lru", "belady"):
                        ours_t, (ours_h, *_) = res[f"ours {ev}"]
                        row = dict(E=E, k=k, slots=slots, eviction=ev, accesses=len(keys),
                                   keys=n_keys, hits=ours_h, ours_maccs=len(keys) / ours_t / 1e6)
                        if lcs is not None:
                            lcs_t, (lcs_h, *_) = res[f"lcs {ev}"]
                            assert lcs_h == ours_h, f"{ev} E={E} k={k} slots={slots}: " \
                                                    f"libCacheSim {lcs_h} hits, ours {ours_h}"
                            row.update(lcs_maccs=len(keys) / lcs_t / 1e6, ratio=lcs_t / ours_t)
                        rows.append(row)
                        print(_flat_line(row), flush=True)
    return {"mode": "flat", "repeats": a.repeats, "alpha": a.alpha, "rows": rows}


def _flat_line(r: dict) -> str:
    s = (f"E={r['E']:>3} k={r['k']} slots={r['slots']:>4} {r['eviction']:<6} "
         f"{r['accesses']:>9} acc  hits {r['hits']:>9}  ours {r['ours_maccs']:6.1f} M/s")
    if "lcs_maccs" in r:
        s += f"  libCacheSim {r['lcs_maccs']:6.1f} M/s  ours/libCacheSim {r['ratio']:.2f}×"
    if r["slots"] >= r["keys"]:
        s += "  (slots ≥ keys: every key fits)"
    return s


# -- linear: cost against trace length ----------------------------------------------------------
def run_linear(a) -> dict:
    from workbench.replay import kernel as K
    from workbench.replay import replay_trace
    from workbench.replay.engine import replay

    # the compiled loop's own time (summed over a streamed replay's chunks): engine.replay's
    # elapsed_s also holds its preparation
    kernel_s: list[float] = []
    run = K.KernelState.run

    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = run(*args, **kw)
        kernel_s.append(time.perf_counter() - t0)
        return out

    def kernel_time(f):
        kernel_s.clear()
        f()
        return sum(kernel_s)

    K.KernelState.run = timed
    rows = []
    base = zipf_routing(a.base_steps * max(a.scales), LAYERS, 64, 8, a.alpha, a.seed)
    try:
        for scale in a.scales:
            steps = a.base_steps * scale
            tr = Trace(topk_ids=base[:steps], token_step=np.arange(steps), num_experts=64)
            keys = tr.groups().keys()
            kw = dict(cache_slots=a.slots, pinned_layers=0, target_model=TARGET)
            fns = {
                "groups()": lambda: tr.groups(),
                "flat LRU": lambda: flat_hits(keys, a.slots, "lru"),
                "flat Belady": lambda: flat_hits(keys, a.slots, "belady"),
                "grouped LRU kernel": lambda: kernel_time(
                    lambda: replay(tr, eviction="lru", **kw)),
                "grouped Belady kernel": lambda: kernel_time(
                    lambda: replay(tr, eviction="belady", **kw)),
                "replay_trace (LRU + Belady ceiling)": lambda: replay_trace(
                    tr, eviction="lru", **kw),
            }
            for f in fns.values():  # compiled code loaded, caches warm
                f()
            res = interleaved(fns, a.repeats)
            for name, (t, outs) in res.items():
                if "kernel" in name:
                    t = statistics.median(outs)
                rows.append(dict(scale=scale, name=name, accesses=len(keys),
                                 ns_per_access=t / len(keys) * 1e9, seconds=t))
            print(f"{scale:>2}× ({len(keys):>9} accesses): " + "  ".join(
                f"{r['name']} {r['ns_per_access']:.1f}" for r in rows if r["scale"] == scale)
                + "  ns/access", flush=True)
    finally:
        K.KernelState.run = run
    return {"mode": "linear", "slots": a.slots, "repeats": a.repeats, "rows": rows}


# -- e2e: workbench replay <trace.npy>, profiled ------------------------------------------------
CATEGORIES = (  # (label, function names whose cumulative time it is), first match wins
    ("load the .npy trace", ("load_trace",)),
    ("Trace.groups()", ("groups",)),
    ("pricing (Prices.many)", ("many", "priced")),
    ("prefetch plan", ("plan_prefetch",)),
    ("Belady's future (occurrences)", ("_belady_future", "_occurrences", "occurrences")),
    ("Groups.keys()", ("keys",)),
    ("compiled kernel (KernelState.run)", ("simulate", "run")),
    ("results, metrics", ("add", "result", "metrics", "to_dataset")),
)


def profile_breakdown(stats: pstats.Stats, total: float) -> list[tuple[str, float]]:
    """Seconds per category: cumulative time of the named functions (a call inside another
    named one is counted once, under the outer; e.g. keys() inside _occurrences)."""
    cum: dict[str, float] = {}
    st = stats.stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    names = {n: label for label, fns in CATEGORIES for n in fns}
    for (file, _line, name), (_cc, _nc, _tt, ct, callers) in st.items():
        if name not in names or "workbench" not in file:
            continue
        # leave out the part called from another counted function
        inner = sum(v[3] for (cf, _cl, cn), v in callers.items()
                    if cn in names and "workbench" in cf)
        cum[names[name]] = cum.get(names[name], 0.0) + ct - inner
    rows = [(label, cum.get(label, 0.0)) for label, _ in CATEGORIES]
    rows.append(("other (CLI, knobs, printing, …)", total - sum(v for _, v in rows)))
    return rows


def run_e2e(a) -> dict:
    from workbench import cli
    from workbench.replay import kernel as K

    with tempfile.TemporaryDirectory() as d:
        trace = Path(a.trace) if a.trace else Path(d) / "zipf.npy"
        if not a.trace:
            np.save(trace, zipf_routing(a.steps, LAYERS, 64, 8, a.alpha, a.seed))
        small = Path(d) / "small.npy"
        np.save(small, zipf_routing(200, LAYERS, 64, 8, a.alpha, a.seed))
        extra = ["--no-belady"] if a.no_belady else []
        args = ["replay", str(trace), "--set", f"target_model={TARGET}", *a.set_args, *extra]
        null = open(os.devnull, "w")
        real_out = sys.stdout
        sys.stdout = null
        try:
            cli.main(["replay", str(small), "--set", f"target_model={TARGET}", *a.set_args])
            # each kernel chunk's own time (the CLI's replay runs the knobs' policy, then the
            # Belady ceiling; each streamed in chunks)
            kern: list[tuple[int, float]] = []
            run = K.KernelState.run

            def timed(self, *args, **kw):
                t0 = time.perf_counter()
                out = run(self, *args, **kw)
                kern.append((self.policy, time.perf_counter() - t0))
                return out

            K.KernelState.run = timed
            walls = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                cli.main(args)
                walls.append(time.perf_counter() - t0)
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            cli.main(args)
            prof.disable()
            prof_wall = time.perf_counter() - t0
            K.KernelState.run = run
            sys.stdout = real_out
            cli.main(args)  # its output once, for the record
        finally:
            sys.stdout = real_out
            null.close()
        from workbench.traces import load_trace

        tr = load_trace(trace)
        acc = tr.groups().num_accesses
        # the whole process, interpreter start and imports included
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "workbench.cli", *args], check=True,
                       stdout=subprocess.DEVNULL)
        process_wall = time.perf_counter() - t0
    codes = {v: k for k, v in K.POLICY_CODES.items()}
    per_policy: dict[str, float] = {}
    for code, t in kern:  # summed over chunks and repeats
        name = codes.get(code, str(code))
        per_policy[name] = per_policy.get(name, 0.0) + t
    wall = statistics.median(walls)
    out = {"mode": "e2e", "trace": repr(tr), "accesses": acc, "repeats": a.repeats,
           "replay_wall_s": wall, "replay_maccs": acc / wall / 1e6,
           "process_wall_s": process_wall,
           # mean per replay: the timed repeats and the profiled one
           "kernel_s": {p: v / (a.repeats + 1) for p, v in per_policy.items()},
           "profile_wall_s": prof_wall,
           "profile": profile_breakdown(pstats.Stats(prof), prof_wall)}
    print(f"\n{out['trace']}: {acc} accesses; `workbench replay` in process, median of "
          f"{a.repeats}: {wall:.2f} s = {out['replay_maccs']:.2f} M accesses/s (measured)")
    print(f"  as a new process (interpreter start and imports included): {process_wall:.2f} s")
    for p, t in out["kernel_s"].items():
        print(f"  compiled kernel, {p}: {t:.3f} s = {acc / t / 1e6:.1f} M accesses/s")
    print(f"  cProfile of one run ({prof_wall:.2f} s under the profiler):")
    for label, t in out["profile"]:
        print(f"    {label:<36} {t:7.3f} s  {t / prof_wall:6.1%}")
    return out


def _rss() -> int:
    """This process's resident memory now, bytes (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_billion(a) -> dict:
    """Belady's hits (and, with ``--lru``, LRU's) over ``--accesses`` flat zipf accesses held
    as ``uint16`` keys (``zipf_flat_keys``; generation not timed), each cache size once: wall
    time and the process's peak resident memory over what it held before the trace."""
    import resource

    n = int(a.accesses)
    base = _rss()
    t = time.perf_counter()
    keys = zipf_flat_keys(n, LAYERS, a.experts, a.k, a.alpha, a.seed)
    gen_s = time.perf_counter() - t
    flat_hits(keys[:1000], 8, "belady")  # load the compiled kernels (keys' own dtype)
    if a.lru:
        flat_hits(keys[:1000], 8, "lru")
    n = len(keys)
    out = {"accesses": n, "keys": f"{LAYERS} layers × {a.experts} experts, top-{a.k}, zipf "
           f"{a.alpha}, seed {a.seed}, {keys.dtype}", "generate_s": gen_s, "runs": []}
    print(f"{n:,} accesses ({keys.nbytes / 1e9:.2f} GB of {keys.dtype} keys) generated in "
          f"{gen_s:.1f} s (not timed below)", flush=True)
    for slots in a.slots:
        for ev in ("belady", "lru") if a.lru else ("belady",):
            t = time.perf_counter()
            hits = flat_hits(keys, slots, ev)
            dt = time.perf_counter() - t
            out["runs"].append({"policy": ev, "slots": slots, "s": dt, "hits": hits,
                                "hit_rate": hits / n, "maccs": n / dt / 1e6})
            print(f"  {ev:<7} {slots:>6} slots: {dt:7.1f} s = {n / dt / 1e6:6.1f} M accesses/s, "
                  f"hit rate {hits / n:.4f} (measured)", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.update(peak_rss=peak, base_rss=base, bytes_per_access=(peak - base) / n)
    print(f"  peak resident memory {peak / 1e9:.2f} GB, {(peak - base) / n:.2f} bytes per "
          f"access over the {base / 1e9:.2f} GB held before the trace (keys included)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("flat", help="flattened LRU / Belady against libCacheSim")
    f.add_argument("--experts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8, 64, 256])
    f.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    f.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")],
                   default=[64, 256, 1024, 4096])
    f.add_argument("--accesses", type=int, default=10_240_000,
                   help="about this many accesses per trace (steps = accesses / (32 k))")
    lin = sub.add_parser("linear", help="cost at 1×, 4×, 16× the trace length")
    lin.add_argument("--base-steps", type=int, default=2500)
    lin.add_argument("--scales", type=lambda s: [int(x) for x in s.split(",")],
                     default=[1, 4, 16])
    lin.add_argument("--slots", type=int, default=256)
    e = sub.add_parser("e2e", help="workbench replay <trace.npy>, end to end and profiled")
    e.add_argument("--trace", help=".npy trace (default: the issue's, generated)")
    e.add_argument("--no-belady", action="store_true",
                   help="pass --no-belady (skip the Belady bound, the second replay)")
    e.add_argument("--steps", type=int, default=40_000)
    e.add_argument("--set", dest="set_args", action="append", default=[],
                   help="--set NAME=VALUE passed to workbench replay (repeatable)")
    b = sub.add_parser("billion", help="10⁹ accesses with the Belady bound: time and memory")
    b.add_argument("--accesses", type=float, default=1e9)
    b.add_argument("--experts", type=int, default=64)
    b.add_argument("--k", type=int, default=8)
    b.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[256])
    b.add_argument("--lru", action="store_true", help="also time LRU on the same keys")
    for p in (f, lin, e, b):
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--alpha", type=float, default=1.3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", help="also write the results to this JSON file")
    a = ap.parse_args()
    if a.mode == "e2e":
        a.set_args = [x for s in a.set_args for x in ("--set", s)]
    out = {"flat": run_flat, "linear": run_linear, "e2e": run_e2e,
           "billion": run_billion}[a.mode](a)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
