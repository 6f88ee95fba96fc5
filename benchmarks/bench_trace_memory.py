"""Peak memory of loading large routing traces (issue 10, item 9), before replay and after
``Trace.groups()`` (the access groups replay builds next).

Generates each trace into a temporary folder (nothing is kept unless --dir is given) and loads
it in a fresh Python process, which reports its peak RSS (``VmHWM``) after its imports,
after ``load_trace`` and after ``groups()``, and the wall times. Cases (``--cases``):

- ``npy``:      vLLM-style routed experts ``[seq_len, 32, 2]`` int32 (Mixtral-8x7B's shape),
                200 MB;
- ``npy-wide``: ``[seq_len, 48, 8]`` int32 (Qwen3-30B-A3B's shape: 48 layers, 128 experts,
                top-8), 200 MB;
- ``wbtrace``:  our text format, 32 layers × 8 experts × top-2 with weights, 225 MB;
- ``wbtrace-narrow``: 1 layer × 8 experts × top-2 without weights (many short lines), 225 MB;
- ``jsonl``:    per-(token, layer) JSON lines, 32 layers × top-2 with weights, 100 MB.

``--scale`` multiplies every size (e.g. 0.25 to measure code that needs more memory than the
machine has); ``--cap-gb`` runs each child under ``RLIMIT_AS`` of that many GiB, so a loader
that needs more fails with ``MemoryError`` (reported) instead of taking the machine down.
To measure another version of the code, put its ``workbench`` package first on PYTHONPATH
(e.g. ``git archive <commit> workbench | tar -x -C /tmp/before`` and
``PYTHONPATH=/tmp/before``): the child imports whatever ``workbench`` Python finds.

    python benchmarks/bench_trace_memory.py [--cases npy,wbtrace] [--scale 1] [--cap-gb 0]
                                            [--replay] [--dir DIR] [--json]

``--replay`` also replays each trace (LRU, 64 slots, Belady bound included) in a second child
(load, then replay: no ``groups()`` of its own first) and reports its peak; the ``tiny-*`` cases are the hostile files of issue 26 (a few bytes declaring
expert 32766 of layer 4095).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MB = 1e6


# -- generators (deterministic, written in slices so the generator itself stays small) ---------
def _routing(rng: np.random.Generator, T: int, L: int, K: int, E: int) -> np.ndarray:
    """[T, L, K] distinct expert ids per (token, layer)."""
    keys = rng.random((T, L, E), dtype=np.float32)
    return np.argpartition(keys, K, axis=-1)[..., :K].astype(np.int32)


def make_npy(path: Path, mb: float, L: int, K: int, E: int) -> dict:
    T = max(1, int(mb * MB / (L * K * 4)))
    rng = np.random.default_rng(0)
    hdr = {"descr": np.dtype(np.int32).str, "fortran_order": False, "shape": (T, L, K)}
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, hdr)
        for a in range(0, T, 4096):
            f.write(_routing(rng, min(T, a + 4096) - a, L, K, E).tobytes())
    return {"tokens": T, "shape": f"[{T}, {L}, {K}] int32"}


def make_wbtrace(path: Path, mb: float, L: int, K: int, E: int, weights: bool) -> dict:
    from workbench.traces.formats import _fmt_weight

    rng = np.random.default_rng(1)
    pool = [_fmt_weight(np.float32(x)) for x in rng.random(512, dtype=np.float32)]
    T, size, step = 0, 0, 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        head = f"wbtrace\tversion=1\tlayers={L}\texperts={E}\ttop_k={K}\n@pinned\t-\n"
        f.write(head)
        size += len(head)
        while size < mb * MB:
            ids = _routing(rng, 4096, L, K, E).tolist()
            wi = rng.integers(0, len(pool), (4096, L, K)).tolist()
            lines = []
            for t in range(4096):
                s = step + t // 4          # 4 tokens per step
                if weights:
                    fields = [",".join(f"{e}:{pool[w]}" for e, w in zip(ids[t][l], wi[t][l]))
                              for l in range(L)]
                else:
                    fields = [",".join(map(str, ids[t][l])) for l in range(L)]
                lines.append(f"{s}\t0\tdecode\ttext\t" + "\t".join(fields) + "\n")
            chunk = "".join(lines)
            f.write(chunk)
            size += len(chunk)
            T += 4096
            step += 1024
    return {"tokens": T, "shape": f"{L} layers × top-{K}" + (", weights" if weights else "")}


def make_jsonl(path: Path, mb: float, L: int, K: int, E: int) -> dict:
    rng = np.random.default_rng(2)
    T, size = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * MB:
            ids = _routing(rng, 1024, L, K, E).tolist()
            w = np.round(rng.random((1024, L, K)), 4).tolist()
            lines = [json.dumps({"problem_id": 0, "layer": l, "token_idx": T + t,
                                 "experts": ids[t][l], "gating_probs": w[t][l]}) + "\n"
                     for t in range(1024) for l in range(L)]
            chunk = "".join(lines)
            f.write(chunk)
            size += len(chunk)
            T += 1024
    return {"tokens": T, "shape": f"{L} layers × top-{K}, weights"}


def make_tiny(path: Path, kind: str) -> dict:
    """A tiny hostile file declaring expert 32766 of layer 4095 (issue 26): 52 bytes of JSON
    lines, an 8 KB .npy, or a .wbtrace header alone."""
    if kind == "jsonl":
        path.write_text('{"layer":4095,"token_idx":0,"experts":[32766]}\n')
    elif kind == "npy":
        a = np.full((1, 4096, 1), -1, np.int16)
        a[0, 0, 0] = 32766
        with open(path, "wb") as f:
            np.save(f, a)
    else:
        path.write_text("wbtrace\tversion=1\tlayers=4096\texperts=32767\ttop_k=1\n")
    return {"tokens": 1 if kind != "wbtrace" else 0, "shape": "layer 4095, expert 32766"}


CASES = {
    "tiny-jsonl": ("jsonl", 0, lambda p, mb: make_tiny(p, "jsonl")),
    "tiny-npy": ("npy", 0, lambda p, mb: make_tiny(p, "npy")),
    "tiny-wbtrace": ("wbtrace", 0, lambda p, mb: make_tiny(p, "wbtrace")),
    "npy": ("npy", 200, lambda p, mb: make_npy(p, mb, 32, 2, 8)),
    "npy-wide": ("npy", 200, lambda p, mb: make_npy(p, mb, 48, 8, 128)),
    "wbtrace": ("wbtrace", 225, lambda p, mb: make_wbtrace(p, mb, 32, 2, 8, True)),
    "wbtrace-narrow": ("wbtrace", 225, lambda p, mb: make_wbtrace(p, mb, 1, 2, 8, False)),
    "jsonl": ("jsonl", 100, lambda p, mb: make_jsonl(p, mb, 32, 2, 8)),
}


# -- the measured child --------------------------------------------------------------------------
def _rss() -> int:
    """This process's peak RSS so far: VmHWM (Linux; ``ru_maxrss`` would include the parent's
    peak, which Linux keeps across exec), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(path: str) -> None:
    from workbench.traces import load_trace

    out: dict = {"base_rss": _rss()}
    try:
        t0 = time.perf_counter()
        tr = load_trace(path)
        out.update(trace=repr(tr), load_s=time.perf_counter() - t0, load_rss=_rss())
        if os.environ.get("BENCH_REPLAY"):  # replay alone: it builds what it needs
            from workbench.replay import replay_trace

            t0 = time.perf_counter()
            res = replay_trace(tr, cache_slots=64, pinned_layers=0, belady=True)
            m = res.metrics()
            out.update(replay_s=time.perf_counter() - t0, replay_rss=_rss(),
                       replay_hits=m["hits"], belady_hit_rate=m["belady_hit_rate"])
        else:
            t0 = time.perf_counter()
            out["accesses"] = tr.groups().num_accesses
            out.update(groups_s=time.perf_counter() - t0, groups_rss=_rss())
    except MemoryError as e:
        out["error"] = f"MemoryError {e}".strip()
    print(json.dumps(out))


def measure(path: Path, cap_gb: float, replay: bool = False) -> dict:
    def limit() -> None:
        if cap_gb:
            cap = int(cap_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           **({"BENCH_REPLAY": "1"} if replay else {})}
    r = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True,
                       text=True, preexec_fn=limit, env=env)
    lines = r.stdout.strip().splitlines()
    if r.returncode or not lines:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {r.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every file size")
    ap.add_argument("--cap-gb", type=float, default=0, help="RLIMIT_AS of each child (0 = none)")
    ap.add_argument("--dir", help="generate into (and keep, and reuse) this folder")
    ap.add_argument("--replay", action="store_true",
                    help="also replay each trace (LRU, 64 slots, Belady bound included) and "
                         "report the peak after it")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case {unknown[0]!r}; cases: {', '.join(CASES)}")
    tmp = None
    if a.dir:
        d = Path(a.dir)
        d.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="wb-trace-mem-")
        d = Path(tmp.name)
    rows = []
    try:
        for case in cases:
            suffix, mb, make = CASES[case]
            mb *= a.scale
            path = d / f"{case}-{mb:g}MB.{suffix}"
            info_path = path.with_name(path.name + ".json")
            if path.exists() and info_path.exists():
                info = json.loads(info_path.read_text())
            else:
                info = make(path, mb)
                info_path.write_text(json.dumps(info))
            res = measure(path, a.cap_gb)
            if a.replay:  # in a process of its own: its peak is the replay's alone
                res.update({k: v for k, v in measure(path, a.cap_gb, True).items()
                            if k.startswith("replay") or k in ("belady_hit_rate", "error")})
            rows.append({"case": case, "file_mb": path.stat().st_size / MB, **info, **res})
    finally:
        if tmp is not None:
            tmp.cleanup()
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    cap = f"; each child under RLIMIT_AS {a.cap_gb:g} GiB" if a.cap_gb else ""
    print(f"peak RSS of a fresh process (measured{cap})")
    rep = " peak, load + replay | replay |" if a.replay else ""
    print("| case | file | shape | tokens | after imports | peak, load_trace | "
          "peak, + groups() | load | groups |" + rep)
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if a.replay else ""))

    def mb_(r: dict, key: str) -> str:
        return f"{r[key] / MB:.0f} MB" if key in r else "—"

    def s_(r: dict, key: str) -> str:
        return f"{r[key]:.1f} s" if key in r else "—"

    for r in rows:
        err = f" ({r['error']})" if "error" in r else ""
        size = f"{r['file_mb']:.0f} MB" if r["file_mb"] >= 1 else f"{r['file_mb'] * MB:.0f} bytes"
        print(f"| {r['case']} | {size} | {r.get('shape', '?')} | "
              f"{r.get('tokens', '?')} | {mb_(r, 'base_rss')} | {mb_(r, 'load_rss')} | "
              f"{mb_(r, 'groups_rss')}{err} | {s_(r, 'load_s')} | {s_(r, 'groups_s')} |"
              + (f" {mb_(r, 'replay_rss')} | {s_(r, 'replay_s')} |" if a.replay else ""))


if __name__ == "__main__":
    main()
