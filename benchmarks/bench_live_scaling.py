"""Live cost of the offloaded runtime vs expert-cache size and expert count (measured).

A tiny random Qwen3-MoE (16 MoE layers × E experts, top-8, hidden 64; built here with the real
transformers classes and saved with ``save_pretrained``, no download) generates 48 tokens past
its end-of-sequence token (``ignore_eos``), with:

- ``plain_generate``: the model's own ``generate``, nothing installed;
- ``all_resident``: the workbench runtime with every expert resident (``pinned_layers`` = all);
- ``offloaded``: nothing pinned (``pinned_layers=0``), every routed expert in the host store and
  a cache of ``cache_slots`` slots, for slots 64 → 4096 (capped at layers × E: the row where
  every expert fits is marked ``all fit``).

The cache lives for one run (each ``Runtime.run`` builds its offloader and slot pool afresh; the
benchmark checks that a repeated run has the same loads), so even when every expert fits, each
expert's first use in a run is a miss. Beside the whole run the benchmark reports the *tail*: the
decode steps of the second half of the run (per-token times from the streamer), where, when all
experts fit, nearly every lookup is a hit — its hit rate is given with it (from the per-step
counters of the warm-up run, which is recorded to a temporary store; routing and LRU are
deterministic, so the timed runs see the same hits).

Variants of one E are timed side by side in one process, in a shuffled order each round, after a
warm-up; the figures are medians over the rounds. Ratios (× all resident, × plain generate) are
the point; absolute times depend on the machine. A cProfile of one offloaded run (E = 128,
512 slots; warm process) lists the top functions by own time.

    python benchmarks/bench_live_scaling.py                 # default grid, 3 rounds
    python benchmarks/bench_live_scaling.py --quick         # E = 128 only, 1 round (< 1 min)
    python benchmarks/bench_live_scaling.py --full          # every power of two, 3 rounds
    python benchmarks/bench_live_scaling.py --device cuda    # on a GPU
        [--experts 32,64] [--slots 64,512] [--repeats 3] [--tokens 48] [--out PATH] [--json]

Results: a JSON file (default ``benchmarks/results/live_scaling.json``) and a markdown table.
The default grid is 23 variants × 4 runs of 48 tokens: a few minutes on 2 idle cores when an
offloaded run costs about what an all-resident one does; the code before the per-layer fix (a
run's cost grows with the slot pool) took 24 min on a busy 2-core machine.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
LAYERS = 16
TOP_K = 8
HIDDEN = 64
MOE_INTERMEDIATE = 32
PROMPT = "the quick brown fox jumps over the lazy dog"
PROFILE_AT = (128, 512)  # (experts, cache slots) of the cProfile run

ALL_SLOTS = [64, 128, 256, 512, 1024, 2048, 4096]
GRIDS = {
    # experts → cache slots (each capped at layers × experts; the cap itself is always added)
    "quick": {128: [128, 512, 2048]},
    "default": {32: [64, 256], 64: [64, 256], 128: [64, 128, 256, 512, 1024],
                256: [64, 512]},
    "full": {e: ALL_SLOTS for e in (32, 64, 128, 256)},
}
REPEATS = {"quick": 1, "default": 3, "full": 3}


def build_checkpoint(num_experts: int, folder: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-MoE checkpoint (every layer sparse) with the character tokenizer of
    :mod:`workbench.models.tiny`."""
    import transformers as tf
    from workbench.models.tiny import tiny_tokenizer

    cfg = tf.Qwen3MoeConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        moe_intermediate_size=MOE_INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=num_experts, num_experts_per_tok=TOP_K, decoder_sparse_step=1,
        norm_topk_prob=True, bos_token_id=0, eos_token_id=1, pad_token_id=0,
        max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


class _Stamps:
    """transformers streamer protocol: the time each generated token arrives."""

    def __init__(self, skip_prompt: bool = True) -> None:
        self.t: list[float] = []
        self._prompt = skip_prompt  # generate's streamer gets the prompt first

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def tail_per_token(stamps: list[float]) -> float:
    """Seconds per token over the second half of the decode steps."""
    h = len(stamps) // 2
    return (stamps[-1] - stamps[h]) / max(len(stamps) - 1 - h, 1)


def tail_hit_rate(store: str, tokens: int) -> float | None:
    """Hit rate of the offloaded layers over the same tail steps, from a recorded run."""
    ds = workbench.open_run(store)
    hits, misses = ds["hits"].values, ds["misses"].values  # [step, layer]
    # step s produces token s: the tail (tokens h .. n-1 after the first) = steps h+1 .. n-1
    h = tokens // 2
    hh, mm = hits[h + 1:].sum(), misses[h + 1:].sum()
    return float(hh / (hh + mm)) if hh + mm else None


def bench_experts(num_experts: int, slots: list[int], repeats: int, tokens: int, device: str,
                  tmp: Path, rng: random.Random, log, profile: bool
                  ) -> tuple[list[dict], dict | None]:
    """Rows of one expert count; with ``profile`` and E = 128, also the cProfile of one
    offloaded run at 512 slots (its own runtime, after the timed rounds)."""
    from workbench.models.inputs import Request, build_inputs

    t_build = time.perf_counter()
    folder = build_checkpoint(num_experts, tmp / f"qwen3moe-e{num_experts}")
    lm = workbench.load(folder, device=device)
    L = lm.layout.num_layers
    common = dict(max_new_tokens=tokens, ignore_eos=True, device=device)
    req = Request(PROMPT)
    inputs = build_inputs(lm, req, tokens).tensors
    cap = L * num_experts
    slot_list = sorted({min(s, cap) for s in slots} | {cap})
    runtimes = {"all_resident": workbench.Runtime(lm, pinned_layers=L, **common)}
    for s in slot_list:
        runtimes[f"offloaded@{s}"] = workbench.Runtime(lm, pinned_layers=0, cache_slots=s,
                                                       **common)

    def plain(stamps: _Stamps):
        with torch.no_grad():
            lm.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, temperature=None, top_p=None, top_k=None,
                              streamer=stamps)

    def runner(rt):
        def f(stamps: _Stamps):
            return rt.run(req, record=False, on_token=lambda tok, text: stamps.put(None))

        return f

    variants = {"plain_generate": plain, **{k: runner(v) for k, v in runtimes.items()}}
    # warm-up: every variant once; the runtimes' warm-up is recorded (untimed) for the
    # per-step counters of the tail hit rate
    warm: dict[str, object] = {}
    tail_hr: dict[str, float | None] = {}
    for name, rt in runtimes.items():
        res = rt.run(req, store=tmp / f"e{num_experts}-{name.replace('@', '-')}.zarr")
        warm[name] = res
        tail_hr[name] = tail_hit_rate(res.store, tokens) if name != "all_resident" else None
    plain(_Stamps())
    log(f"E={num_experts}: built and warmed up in {time.perf_counter() - t_build:.1f} s "
        f"({len(variants)} variants)")

    times = {k: [] for k in variants}
    tails = {k: [] for k in variants}
    last: dict[str, object] = {}
    order = list(variants)
    for r in range(repeats):
        rng.shuffle(order)
        for name in order:
            # a runtime's on_token gets generated tokens only; generate's streamer the prompt too
            st = _Stamps(skip_prompt=name == "plain_generate")
            t0 = time.perf_counter()
            out = variants[name](st)
            times[name].append(time.perf_counter() - t0)
            tails[name].append(tail_per_token(st.t))
            if out is not None:
                last[name] = out
                assert len(st.t) == tokens, (name, len(st.t))
        log(f"E={num_experts}: round {r + 1}/{repeats} done")
    med = {k: statistics.median(v) for k, v in times.items()}
    tail = {k: statistics.median(v) for k, v in tails.items()}
    rows = []
    for name in variants:
        res = last.get(name)
        row = {"experts": num_experts, "variant": name.split("@")[0],
               "cache_slots": int(name.split("@")[1]) if "@" in name else None,
               "median_s": med[name], "times_s": times[name],
               "ratio_vs_resident": med[name] / med["all_resident"],
               "ratio_vs_plain": med[name] / med["plain_generate"],
               "tail_ms_per_token": tail[name] * 1e3,
               "tail_ratio_vs_resident": tail[name] / tail["all_resident"]}
        if name.startswith("offloaded"):
            w = warm[name]
            row.update(all_fit=row["cache_slots"] >= cap, hits=res.hits, misses=res.misses,
                       loads=res.loads, evictions=res.evictions, hit_rate=res.hit_rate,
                       tail_hit_rate=tail_hr[name],
                       # the cache is per run: a repeated run loads exactly as much again
                       same_loads_as_first_run=res.loads == w.loads)
        rows.append(row)
    prof = None
    if profile and num_experts == PROFILE_AT[0]:
        rt = workbench.Runtime(lm, pinned_layers=0, cache_slots=min(PROFILE_AT[1], cap), **common)
        prof = profile_run(rt)
        log(f"E={num_experts}: profile done")
    return rows, prof


def profile_run(rt, top: int = 10) -> dict:
    """cProfile of one offloaded run of the (warm) runtime ``rt``: the top functions by own
    time."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    res = rt.run(PROMPT, record=False)
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof)
    entries = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        short = file if file.startswith(("~", "<")) else "/".join(Path(file).parts[-3:])
        entries.append({"function": f"{short}:{line}({fn})" if line else fn,
                        "ncalls": nc, "tottime_s": tt, "cumtime_s": ct})
    entries.sort(key=lambda e: -e["tottime_s"])
    return {"experts": rt.lm.layout.num_experts, "cache_slots": rt.knobs.cache_slots,
            "wall_s_profiled": wall, "total_tt_s": st.total_tt,  # type: ignore[attr-defined]
            "loads": res.loads, "hit_rate": res.hit_rate, "top_tottime": entries[:top]}


def table(rows: list[dict]) -> str:
    head = ("| E | variant | cache slots | median s | × all resident | × plain | "
            "tail ms/token | tail × all resident | loads | hit rate | tail hit rate |")
    lines = [head, "| " + " | ".join(["---"] * 11) + " |"]
    for r in rows:
        slots = ("" if r["cache_slots"] is None else
                 f"{r['cache_slots']}" + (" (all fit)" if r.get("all_fit") else ""))
        hr = "" if r.get("hit_rate") is None else f"{r['hit_rate']:.1%}"
        thr = "" if r.get("tail_hit_rate") is None else f"{r['tail_hit_rate']:.1%}"
        lines.append(
            f"| {r['experts']} | {r['variant']} | {slots} | {r['median_s']:.2f} | "
            f"{r['ratio_vs_resident']:.2f} | {r['ratio_vs_plain']:.2f} | "
            f"{r['tail_ms_per_token']:.1f} | {r['tail_ratio_vs_resident']:.2f} | "
            f"{r.get('loads', '')} | {hr} | {thr} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="E = 128 only, 3 cache sizes, 1 round")
    g.add_argument("--full", action="store_true", help="every E and every power of two")
    ap.add_argument("--experts", help="comma-separated expert counts (overrides the grid)")
    ap.add_argument("--slots", help="comma-separated cache slots (overrides the grid)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (median)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per run")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile run")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/live_scaling.json"))
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    a = ap.parse_args(argv)
    mode = "quick" if a.quick else "full" if a.full else "default"
    grid = dict(GRIDS[mode])
    if a.experts:
        es = [int(x) for x in a.experts.split(",")]
        grid = {e: grid.get(e, ALL_SLOTS) for e in es}
    if a.slots:
        ss = [int(x) for x in a.slots.split(",")]
        grid = {e: ss for e in grid}
    repeats = a.repeats or REPEATS[mode]
    torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_live_scaling: error: --device cuda but no CUDA device is present")

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    load_before = _loadavg()
    rng = random.Random(0)
    rows: list[dict] = []
    prof = None
    with tempfile.TemporaryDirectory(prefix="bench-live-scaling-") as d:
        tmp = Path(d)
        with workbench.set_options(workspace=tmp / "runs"):
            for e, slots in grid.items():
                r, p = bench_experts(e, slots, repeats, a.tokens, a.device, tmp, rng, log,
                                     profile=not a.no_profile)
                rows += r
                prof = p or prof
    out = {
        "benchmark": "live_scaling", "mode": mode, "device": a.device,
        "device_name": (torch.cuda.get_device_name() if a.device == "cuda"
                        else platform.processor() or platform.machine()),
        "workbench_source": str(Path(workbench.__file__).resolve().parent),
        "git_head": _git_head(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": a.threads, "python": platform.python_version(),
        # 1-minute load average before and after: other processes on the machine skew timings
        "loadavg_1min": [load_before, _loadavg()], "cpu_count": os.cpu_count(),
        "model": {"arch": "qwen3_moe (random)", "moe_layers": LAYERS, "top_k": TOP_K,
                  "hidden_size": HIDDEN, "moe_intermediate_size": MOE_INTERMEDIATE,
                  "experts": list(grid)},
        "prompt": PROMPT, "max_new_tokens": a.tokens, "ignore_eos": True, "repeats": repeats,
        "cache_cold_each_run": all(r.get("same_loads_as_first_run", True) for r in rows),
        "rows": rows, "profile": prof, "wall_s": time.perf_counter() - t_start,
        "command": "python benchmarks/bench_live_scaling.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
    }
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=_json_default) + "\n")
    if a.json:
        print(json.dumps(out, default=_json_default))
        return
    print(f"live cost vs cache size ({a.device}, {a.tokens} new tokens, median of {repeats}, "
          f"measured; tail = second half of the decode steps)\n")
    print(table(rows))
    if prof is not None:
        print(f"\ncProfile, E={prof['experts']}, {prof['cache_slots']} slots "
              f"({prof['wall_s_profiled']:.2f} s profiled), top {len(prof['top_tottime'])} by "
              f"own time:\n")
        print("| function | calls | own s | cumulative s |\n| --- | --- | --- | --- |")
        for p in prof["top_tottime"]:
            print(f"| `{p['function']}` | {p['ncalls']} | {p['tottime_s']:.3f} | "
                  f"{p['cumtime_s']:.3f} |")
    print(f"\nwritten {path} ({out['wall_s']:.0f} s)")


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _git_head() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.bool_,)):
        return bool(o)
    raise TypeError(type(o).__name__)


if __name__ == "__main__":
    main()
