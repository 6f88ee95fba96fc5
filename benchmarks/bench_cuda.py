"""The offloaded runtime on a GPU: exactness, transfers on the copy stream and live cost (measured).

Three parts, each run on the device it is given (``--device cuda`` by default; ``--device cpu``
is a dry run of the same code here) and each guarded: a part that fails writes its error into
the JSON and the others still run. First it checks that transformers' ``grouped_mm`` experts
path (every model here runs it) works in float32 on the device; if not, every part uses
transformers' own loop fallback and the JSON says so.

1. **exactness** — the embedded Qwen3-VL-MoE (float32) on a demo request with an image and on a
   text-only one, ``ignore_eos``: the workbench runtime with nothing pinned and a small expert
   cache (misses on every step), on demand and with prefetch (``previous-step``; ``speculative``
   over a router lookahead of 1), plus one pinned layer with a cache of top-k slots and all
   layers resident, must give the same greedy tokens as the model's own ``generate`` on the same
   device; the next-token scores of every step (read by a logits processor, the same in both)
   are compared too (max |Δ| over finite entries). The plain ``generate`` run twice (its own
   noise floor) and on the CPU (the cross-device difference) are recorded beside it, and each
   tiny architecture of :mod:`workbench.models.tiny` goes through the :class:`Offloader` on the
   device (logits of one forward and greedy tokens). Device memory held at the first generated
   token is recorded per variant (CUDA).
2. **transfers** — host → device bandwidth of copies from pinned and pageable host memory for
   sizes from one embedded expert (48 KiB) through one Qwen3-VL-30B-A3B expert (bf16, 9 MiB) to
   64 MiB (CUDA events; median of 3); the :class:`TransferEngine`'s throughput on a stream of
   expert copies (host submit cost, measured span per copy, modeled link time of the ``h200``
   profile); whether a copy on the engine's stream overlaps compute queued after it (copy
   alone, compute alone, both: the overlapped share of the shorter); and the spans of a live
   offloaded run with and without prefetch (every drained transfer once, ``submitted ≤ start
   ≤ end`` inside the run, copy-busy time vs measured stall — ``hidden_share`` = 1 − stall /
   busy — and measured vs modeled per-copy time); and what installing and removing the
   Offloader costs per run (on CUDA every offloaded expert goes to a pinned host store and back).
3. **live** — :mod:`bench_live_scaling` ``--quick`` on the device (called in this process):
   offloaded vs all-resident vs plain ``generate`` ratios of the random 16-layer Qwen3-MoE.

    python benchmarks/bench_cuda.py --out DIR                   # on the GPU (about 2 min)
    python benchmarks/bench_cuda.py --device cpu --out DIR      # dry run here
        [--parts exactness,transfers,live] [--tokens 12]

Results: ``DIR/cuda.json`` (rewritten after each part, so a run cut short keeps what it had),
``DIR/cuda.md`` (the markdown summary, also printed) and ``DIR/live_scaling.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")  # for child processes; this one flushes itself

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
PARTS = ("exactness", "transfers", "live", "batch", "realb", "prism")
KiB, MiB = 1024, 1024 * 1024
#: one routed expert of Qwen3-VL-30B-A3B in bf16: gate_up [2·768, 2048] + down [2048, 768]
QWEN3_30B_EXPERT_BYTES = 3 * 2048 * 768 * 2
TEXT_PROMPT = "count from 7 to 9."


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:6.1f} s] {msg}", file=sys.stderr, flush=True)


T_START = time.perf_counter()


# -- helpers -------------------------------------------------------------------------------------
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class ScoreLog:
    """transformers logits processor that keeps a CPU copy of every step's scores."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.rows.append(scores.detach().float().cpu())
        return scores

    def stacked(self) -> torch.Tensor:
        return torch.cat(self.rows, 0) if self.rows else torch.zeros(0)


def score_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """max |a − b| over the entries finite in both, and whether the ±inf pattern agrees."""
    if a.shape != b.shape:
        return {"same_shape": False, "shapes": [list(a.shape), list(b.shape)]}
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    d = (a[both] - b[both]).abs()
    return {"same_shape": True, "max_abs_diff": float(d.max()) if d.numel() else 0.0,
            "inf_pattern_equal": bool(torch.equal(fa, fb) and torch.equal(a[~fa], b[~fb])),
            "allclose_1e-4": bool(torch.allclose(a[both], b[both], atol=1e-4, rtol=1e-4))}


@contextlib.contextmanager
def spy_drains():
    """Every transfer any :class:`TransferEngine` hands over while inside (a list)."""
    from workbench.runtime.transfer import TransferEngine

    got: list = []
    orig = TransferEngine.drain

    def drain(self):
        out = orig(self)
        got.extend(out)
        return out

    TransferEngine.drain = drain
    try:
        yield got
    finally:
        TransferEngine.drain = orig


def union_s(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of intervals."""
    total, end = 0.0, -float("inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def mem_now(dev: torch.device) -> int | None:
    return int(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else None


def json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, (Path, torch.device, torch.dtype)):
        return str(o)
    raise TypeError(type(o).__name__)


# -- environment ---------------------------------------------------------------------------------
def part_env(dev: torch.device) -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
           "numpy": np.__version__, "workbench_source": str(Path(workbench.__file__).parent),
           "git_head": _git_head(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "device": str(dev),
           "cuda_available": torch.cuda.is_available()}
    for name in ("xarray", "zarr", "numcodecs", "param", "huggingface_hub", "tokenizers",
                 "pandas"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 — recorded, not fatal
            out[name] = f"unavailable: {type(e).__name__}: {e}"
    if dev.type == "cuda" and torch.cuda.is_available():
        t0 = time.perf_counter()
        torch.zeros(1, device=dev)
        sync(dev)
        p = torch.cuda.get_device_properties(dev)
        out.update(device_name=p.name, capability=f"{p.major}.{p.minor}",
                   total_memory_bytes=int(p.total_memory),
                   multiprocessors=int(p.multi_processor_count),
                   cuda_init_s=time.perf_counter() - t0,
                   allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    else:
        out["device_name"] = platform.processor() or platform.machine()
    if dev.type != "cuda" or torch.cuda.is_available():
        out["grouped_mm_float32"] = grouped_mm_probe(dev)
    return out


def grouped_mm_probe(dev: torch.device) -> str:
    """Whether transformers' grouped_mm path (the experts forward of every model here) runs in
    float32 on ``dev`` and agrees with its own loop fallback; if not, every later part uses the
    fallback (``_can_use_grouped_mm`` patched to False) and the JSON says so."""
    from transformers.integrations import moe

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 64, generator=g).to(dev)
    w = torch.randn(3, 32, 64, generator=g).to(dev)  # [E, out, in], used transposed as in
    offs = torch.tensor([5, 5, 24], dtype=torch.int32, device=dev)  # _grouped_linear
    try:
        got = moe._grouped_mm(x, w.transpose(-2, -1), offs)
        ref = torch.cat([x[0:5] @ w[0].T, x[5:5] @ w[1].T, x[5:24] @ w[2].T])
        sync(dev)
        if torch.allclose(got, ref, atol=1e-4, rtol=1e-4):
            return f"ok (uses grouped_mm: {moe._can_use_grouped_mm(x, w, offs)})"
        bad = f"wrong: max |diff| {float((got - ref).abs().max()):.3g}"
    except Exception as e:  # noqa: BLE001
        bad = f"failed: {type(e).__name__}: {e}"
    moe._can_use_grouped_mm = lambda *a, **k: False
    return bad + "; every part below uses transformers' grouped_mm fallback"


# -- 1. exactness --------------------------------------------------------------------------------
def part_exactness(dev: torch.device, tokens: int) -> dict:
    from workbench.models.embedded.demo import read_demo
    from workbench.models.inputs import Request, build_inputs

    t0 = time.perf_counter()
    lm = workbench.load(None, device=str(dev))
    lay = lm.layout
    L, E, K = lay.num_layers, lay.num_experts, lay.top_k
    log(f"exactness: embedded model loaded on {dev} in {time.perf_counter() - t0:.1f} s "
        f"({L} MoE layers x {E} experts, top-{K}, {lay.expert_bytes} B per expert)")
    demo = read_demo(required=True)[0]
    requests = {"demo0_image": Request(demo["prompt"], [demo["image"]]),
                "text": Request(TEXT_PROMPT)}
    small = 2 * K  # nothing pinned: every layer misses while it runs
    variants = {
        "offloaded": dict(pinned_layers=0, cache_slots=small),
        "offloaded_prefetch_previous_step": dict(pinned_layers=0, cache_slots=small,
                                                 prefetch="previous-step"),
        "offloaded_prefetch_speculative": dict(pinned_layers=0, cache_slots=small,
                                               prefetch="speculative", lookahead_depth=1),
        "pinned1_topk_slots": dict(pinned_layers=1, cache_slots=K),
        "all_resident": dict(pinned_layers=L),
    }
    common = dict(max_new_tokens=tokens, ignore_eos=True, device=dev.type, profile="h200")
    out: dict = {"model": lm.model_id, "dtype": lm.dtype, "moe_layers": L, "experts": E,
                 "top_k": K, "expert_bytes": lay.expert_bytes, "max_new_tokens": tokens,
                 "cache_slots_small": small, "requests": {}, "variants": {
                     k: {kk: vv for kk, vv in v.items()} for k, v in variants.items()}}

    def plain(model_lm, req) -> tuple[list[int], torch.Tensor]:
        from transformers import LogitsProcessorList

        inputs = build_inputs(model_lm, req, tokens).tensors
        rec = ScoreLog()
        with torch.no_grad():
            seq = model_lm.model.generate(
                **inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                temperature=None, top_p=None, top_k=None,
                logits_processor=LogitsProcessorList([rec]))
        n = inputs["input_ids"].shape[-1]
        return seq[0, n:].tolist(), rec.stacked()

    cpu_lm = workbench.load(None, device="cpu") if dev.type == "cuda" else None
    out["processor"] = _processor_name(lm)
    rows = []
    for rname, req in requests.items():
        r: dict = {"runs": {}}
        out["requests"][rname] = r
        try:
            try:
                ref_tokens, ref_scores = plain(lm, req)
            except Exception as e:  # noqa: BLE001
                # the GPU image has torchvision, so transformers' AutoProcessor loads there
                # (on the CPU machines it does not and the PIL image processor serves): if
                # that path fails, record it and fall back to the PIL one
                if lm.processor is None or not req.images:
                    raise
                r["processor_error"] = f"{type(e).__name__}: {e}"
                log(f"exactness: {rname}: {_processor_name(lm)} failed ({e}); PIL processor")
                for m in (lm, cpu_lm):
                    _pil_processor(m)
                out["processor"] = _processor_name(lm)
                ref_tokens, ref_scores = plain(lm, req)
            again_tokens, again_scores = plain(lm, req)
            r.update(plain_tokens=ref_tokens,
                     plain_text=lm.tokenizer.decode(ref_tokens, skip_special_tokens=True).strip(),
                     plain_repeat_tokens_equal=again_tokens == ref_tokens,
                     plain_repeat_scores=score_diff(again_scores, ref_scores))
            if cpu_lm is not None:
                cpu_tokens, cpu_scores = plain(cpu_lm, req)
                r["plain_cpu_tokens_equal"] = cpu_tokens == ref_tokens
                r["plain_cpu_scores"] = score_diff(cpu_scores, ref_scores)
        except Exception as e:  # noqa: BLE001 — this request's failure is recorded
            r["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
            log(f"exactness: {rname}: plain generate FAILED: {type(e).__name__}: {e}")
            continue
        for vname, kv in variants.items():
            try:
                run = runtime_vs_plain(lm, req, dev, ref_tokens, ref_scores, **common, **kv)
            except Exception as e:  # noqa: BLE001
                run = {"tokens_equal": False,
                       "error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"}
            r["runs"][vname] = run
            rows.append((rname, vname, run))
            log(f"exactness: {rname} / {vname}: tokens equal {run['tokens_equal']}, "
                f"max |dscore| {run.get('max_abs_diff', float('nan')):.2e}, "
                f"{run.get('misses')} misses, {run.get('loads')} loads"
                + (f" — ERROR {run['error'].splitlines()[0]}" if "error" in run else ""))
    errors = [rn for rn, r in out["requests"].items() if "error" in r]
    out["all_tokens_equal"] = bool(rows) and not errors and all(
        run["tokens_equal"] for _, _, run in rows)
    out["max_abs_score_diff"] = max((run.get("max_abs_diff", float("inf"))
                                     for _, _, run in rows), default=None)
    out["tiny_architectures"] = tiny_architectures(dev)
    out["tiny_all_equal"] = all(c.get("tokens_equal") and c.get("logits_allclose")
                                for a in out["tiny_architectures"].values()
                                for c in (a.get("cases") or [{}]))
    return out


def runtime_vs_plain(lm, req, dev: torch.device, ref_tokens: list[int],
                     ref_scores: torch.Tensor, **knobs) -> dict:
    """One runtime run of ``req`` with ``knobs``, compared with the plain generate's tokens and
    scores; with its counters, clocks and device memory."""
    rt = workbench.Runtime(lm, **knobs)
    rec = ScoreLog()
    mem: dict = {}

    def first_token(tok, text):
        if not mem:
            mem["at_first_token"] = mem_now(dev)

    before = mem_now(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    res = rt.run(req, record=False, logits_processor=[rec], on_token=first_token)
    sync(dev)
    return {"tokens_equal": list(res.token_ids) == ref_tokens,
            **score_diff(rec.stacked(), ref_scores),
            "tokens": list(res.token_ids), "steps": res.steps, "hits": res.hits,
            "misses": res.misses, "loads": res.loads, "prefetches": res.prefetches,
            "evictions": res.evictions, "hit_rate": res.to_json()["hit_rate"],
            "transfer_bytes": res.transfer_bytes,
            "latency_measured_s": res.latency_measured_s,
            "latency_modeled_s": res.latency_modeled_s,
            "stall_measured_s": res.stall_measured_s, "stall_modeled_s": res.stall_modeled_s,
            "device_bytes_before_run": before,
            "device_bytes_at_first_token": mem.get("at_first_token"),
            "device_peak_bytes": (int(torch.cuda.max_memory_allocated(dev))
                                  if dev.type == "cuda" else None)}


def _processor_name(lm) -> str:
    p = lm.processor if lm.processor is not None else lm.image_processor
    return type(p).__name__ + (" (AutoProcessor)" if lm.processor is not None else "")


def _pil_processor(lm) -> None:
    """Serve images through the PIL image processor, as on machines without torchvision."""
    if lm is None or lm.processor is None:
        return
    import transformers as tf

    lm.image_processor = tf.AutoImageProcessor.from_pretrained(lm.path, local_files_only=True,
                                                               backend="pil")
    lm.processor = None


def tiny_architectures(dev: torch.device) -> dict:
    """Every tiny architecture through the Offloader on ``dev``: one forward's logits and the
    greedy tokens, inside vs outside (as tests/test_exactness.py does on CPU)."""
    from workbench.models.adapter import find_moe_blocks
    from workbench.models.tiny import TINY_ARCHITECTURES, greedy_outputs, tiny_inputs, tiny_model
    from workbench.policies.eviction import EVICTION
    from workbench.runtime.executor import StepProbe
    from workbench.runtime.offload import Offloader

    out: dict = {}
    for arch in TINY_ARCHITECTURES:
        try:
            model = tiny_model(arch).to(dev)
            inputs = {k: v.to(dev) for k, v in tiny_inputs(model, arch).items()}
            ref_logits, ref_tokens = greedy_outputs(model, inputs)
            layout = find_moe_blocks(model)
            cases = []
            for slots, pinned in ((layout.top_k, 0), (layout.top_k + 1, 1)):
                probe = StepProbe(time.perf_counter())
                with Offloader(layout, slots, pinned, EVICTION.create("lru"), dev,
                               probe) as off:
                    logits, toks = greedy_outputs(model, inputs)
                    c = off.cache.counters()
                sync(dev)
                cases.append({
                    "cache_slots": slots, "pinned_layers": pinned,
                    "tokens_equal": bool(torch.equal(toks, ref_tokens)),
                    "logits_allclose": bool(torch.allclose(logits, ref_logits, atol=1e-5,
                                                           rtol=1e-4)),
                    "max_abs_logit_diff": float((logits - ref_logits).abs().max()),
                    "misses": int(c["misses"].sum()), "loads": int(c["loads"].sum())})
            with torch.no_grad():  # the context gave every weight back
                restored = bool(torch.equal(model(**inputs).logits, ref_logits))
            out[arch] = {"cases": cases, "restored_after": restored}
        except Exception as e:  # noqa: BLE001 — one architecture's failure is a finding
            out[arch] = {"error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc(limit=6)}
        log(f"exactness: tiny {arch}: {out[arch].get('error') or out[arch]['cases']}")
    return out


# -- 2. transfers --------------------------------------------------------------------------------
def part_transfers(dev: torch.device) -> dict:
    from workbench.sim.profiles import get_profile

    prof = get_profile("h200")
    out: dict = {"modeled_profile": prof.name, "modeled_link_GBps": prof.link_bandwidth / 1e9,
                 "modeled_link_latency_us": prof.link_latency_s * 1e6}
    lm = workbench.load(None, device=str(dev))
    eb = lm.layout.expert_bytes
    sizes = sorted({eb, 256 * KiB, MiB, 4 * MiB, QWEN3_30B_EXPERT_BYTES, 64 * MiB})
    out["bandwidth"] = [guarded(h2d_bandwidth, dev, n, prof) for n in sizes]
    for row in out["bandwidth"]:
        log(f"transfers: {row.get('bytes', '?'):>9} B  pinned {row.get('pinned_GBps')} GB/s  "
            f"pageable {row.get('pageable_GBps')} GB/s {row.get('error', '')}")
    out["engine_stream"] = [guarded(engine_throughput, dev, lm, prof, n_copies=256),
                            guarded(engine_throughput, dev, None, prof, n_copies=32,
                                    nbytes=QWEN3_30B_EXPERT_BYTES)]
    out["engine_overlap"] = guarded(engine_overlap, dev)
    log(f"transfers: overlap {out['engine_overlap']}")
    out["runtime_spans"] = {name: guarded(runtime_spans, dev, lm, prof, **kv) for name, kv in {
        "offloaded": dict(),
        "offloaded_prefetch_previous_step": dict(prefetch="previous-step"),
        "offloaded_prefetch_speculative": dict(prefetch="speculative", lookahead_depth=1),
    }.items()}
    out["runtime_spans_all_valid"] = all(r.get("all_valid") for r in out["runtime_spans"].values())
    out["offloader_install_remove"] = guarded(install_cost, dev, lm)
    return out


def install_cost(dev: torch.device, lm, rounds: int = 3) -> dict:
    """Seconds to install and remove the Offloader (nothing pinned) around nothing: what every
    ``Runtime.run`` pays besides its steps (on CUDA: every offloaded expert copied to a pinned
    host store, the slot pool allocated, the experts copied back at the end)."""
    from workbench.policies.eviction import EVICTION
    from workbench.runtime.executor import StepProbe
    from workbench.runtime.offload import Offloader

    lay = lm.layout
    enter, leave = [], []
    for _ in range(rounds):
        sync(dev)
        t0 = time.perf_counter()
        off = Offloader(lay, 2 * lay.top_k, 0, EVICTION.create("lru"), dev, StepProbe(t0))
        off.__enter__()
        sync(dev)
        t1 = time.perf_counter()
        off.__exit__(None, None, None)
        sync(dev)
        leave.append(time.perf_counter() - t1)
        enter.append(t1 - t0)
    return {"routed_expert_bytes": lay.routed_bytes, "install_s": statistics.median(enter),
            "remove_s": statistics.median(leave)}


def guarded(fn, *args, **kwargs) -> dict:
    """``fn(*args, **kwargs)``, or ``{"error": …}`` when it raises (one measurement's failure
    does not lose the others)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        log(f"{fn.__name__}: FAILED: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"}


def h2d_bandwidth(dev: torch.device, nbytes: int, prof, rounds: int = 3) -> dict:
    """GB/s of ``nbytes`` host → device copies from pinned and from pageable memory (median of
    ``rounds``; each round times enough copies for ~256 MiB, or at least 5)."""
    reps = max(5, min(2000, (256 * MiB) // nbytes))
    row: dict = {"bytes": nbytes, "copies_per_round": reps,
                 "modeled_GBps": nbytes / prof.transfer_time(nbytes) / 1e9,
                 "modeled_us_per_copy": prof.transfer_time(nbytes) * 1e6}
    for kind in ("pinned", "pageable"):
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        if kind == "pinned" and dev.type == "cuda":
            src = src.pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        sync(dev)
        gpu, wall = [], []
        for _ in range(rounds):
            if dev.type == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                e0.record()
                for _ in range(reps):
                    dst.copy_(src, non_blocking=True)
                e1.record()
                e1.synchronize()
                wall.append(time.perf_counter() - t0)
                gpu.append(e0.elapsed_time(e1) / 1e3)
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    dst.copy_(src)
                wall.append(time.perf_counter() - t0)
        t = statistics.median(gpu or wall)
        row[f"{kind}_GBps"] = nbytes * reps / t / 1e9
        row[f"{kind}_us_per_copy"] = t / reps * 1e6
        row[f"{kind}_wall_GBps"] = nbytes * reps / statistics.median(wall) / 1e9
        assert bool((dst[:16] == 7).all())
    return row


def engine_throughput(dev: torch.device, lm, prof, n_copies: int, nbytes: int | None = None
                      ) -> dict:
    """A stream of expert copies through one :class:`TransferEngine`: host submit cost, the
    measured span of each copy, and the stream's effective bandwidth. ``lm``: copy the embedded
    model's real experts (layer 0, its fused tensors); else ``nbytes`` blobs split 2:1 like
    gate_up/down."""
    from workbench.runtime.transfer import TransferEngine

    pin = dev.type == "cuda"
    if lm is not None:
        b = lm.layout.blocks[0]
        host = {n: getattr(b.experts, n).detach().to("cpu") for n in b.expert_params}
        host = {n: (t.pin_memory() if pin else t) for n, t in host.items()}
        E = b.num_experts
        srcs = [{n: t[i % E] for n, t in host.items()} for i in range(n_copies)]
        label = f"embedded expert ({lm.layout.expert_bytes} B)"
    else:
        n = nbytes // 4
        blob = torch.randn(4, n)
        blob = blob.pin_memory() if pin else blob
        srcs = [{"gate_up_proj": blob[i % 4, : 2 * n // 3], "down_proj": blob[i % 4, 2 * n // 3:]}
                for i in range(n_copies)]
        label = f"Qwen3-VL-30B-A3B-sized expert ({nbytes} B)"
    slots = 16
    pool = {k: torch.empty((slots, *v.shape), dtype=v.dtype, device=dev)
            for k, v in srcs[0].items()}
    eng = TransferEngine(dev)
    try:
        for i in range(4):  # warm-up
            eng.submit(("w", i), i, {k: v[i % slots] for k, v in pool.items()}, srcs[i]).wait()
        eng.drain()
        sync(dev)
        t0 = time.perf_counter()
        trs = [eng.submit((0, i), i % slots, {k: v[i % slots] for k, v in pool.items()}, s)
               for i, s in enumerate(srcs)]
        t_submitted = time.perf_counter()
        trs[-1].wait()
        t_done = time.perf_counter()
        got = []
        deadline = time.perf_counter() + 30
        while len(got) < len(trs) and time.perf_counter() < deadline:
            got += eng.drain()
            time.sleep(0.0005)
        ok = all(torch.equal(pool[k][(n_copies - 1) % slots].cpu(), srcs[-1][k]) for k in pool)
    finally:
        eng.close()
    spans = [t.end - t.start for t in got]
    total = sum(t.nbytes for t in got)
    first, last = min(t.start for t in got), max(t.end for t in got)
    per = got[0].nbytes
    return {"what": label, "copies": n_copies, "drained": len(got),
            "drained_each_once": len({id(t) for t in got}) == len(got) == n_copies,
            "data_landed": ok, "bytes_per_copy": per,
            "submit_us_per_copy": (t_submitted - t0) / n_copies * 1e6,
            "wall_s_submit_to_last_landed": t_done - t0,
            "span_us_median": statistics.median(spans) * 1e6 if spans else None,
            "span_us_max": max(spans) * 1e6 if spans else None,
            "effective_GBps": total / max(last - first, 1e-12) / 1e9,
            "modeled_us_per_copy": prof.transfer_time(per) * 1e6,
            "all_valid": all(t0 <= t.submitted <= t.start <= t.end <= t_done + 0.005
                             for t in got)}


def engine_overlap(dev: torch.device) -> dict:
    """A copy on the engine's stream, then compute on the current stream queued after it: the
    copy alone, the compute alone and both (medians of 3); overlap = (copy + compute − both) /
    min(copy, compute): 1 = fully hidden, 0 = serialised."""
    from workbench.runtime.transfer import TransferEngine

    cuda = dev.type == "cuda"
    nbytes = 256 * MiB if cuda else 16 * MiB
    src = torch.empty(nbytes // 4)
    src = src.pin_memory() if cuda else src
    dst = {"w": torch.empty(nbytes // 4, device=dev)}
    n = 4096 if cuda else 384
    a = torch.randn(n, n, device=dev)
    eng = TransferEngine(dev)

    def copy():
        return eng.submit(("x", 0), 0, dst, {"w": src})

    def compute(reps: int):
        x = a
        for _ in range(reps):
            x = a @ x
            x = x / x.norm()
        return x

    def timed(f) -> float:
        sync(dev)
        t0 = time.perf_counter()
        f()
        sync(dev)
        return time.perf_counter() - t0

    try:
        copy().wait()
        compute(2)
        t_copy = statistics.median(timed(lambda: copy().wait()) for _ in range(3))
        # size the compute to about the copy's time
        t1 = statistics.median(timed(lambda: compute(4)) for _ in range(3)) / 4
        reps = max(1, int(round(t_copy / max(t1, 1e-9))))
        t_comp = statistics.median(timed(lambda: compute(reps)) for _ in range(3))

        def both():
            tr = copy()
            compute(reps)
            tr.wait()

        t_both = statistics.median(timed(both) for _ in range(3))
        eng.drain()
    finally:
        eng.close()
    overlap = (t_copy + t_comp - t_both) / max(min(t_copy, t_comp), 1e-12)
    return {"copy_bytes": nbytes, "matmul_n": n, "matmuls": reps, "copy_s": t_copy,
            "compute_s": t_comp, "both_s": t_both, "overlap_share": overlap,
            "copy_GBps": nbytes / t_copy / 1e9}


def runtime_spans(dev: torch.device, lm, prof, **knobs) -> dict:
    """One offloaded run (nothing pinned, a small cache, 16 tokens): the drained transfers'
    spans, checked and summed, against the run's stall and the modeled per-copy time."""
    K = lm.layout.top_k
    rt = workbench.Runtime(lm, pinned_layers=0, cache_slots=2 * K, max_new_tokens=16,
                           ignore_eos=True, device=dev.type, profile="h200", **knobs)
    rt.run("warm up", record=False)
    with spy_drains() as got:
        t_before = time.perf_counter()
        res = rt.run(TEXT_PROMPT, record=False)
        t_after = time.perf_counter()
    spans = [(t.start, t.end) for t in got]
    dur = [e - s for s, e in spans]
    busy = union_s(spans)
    bad = [t for t in got if not (t_before <= t.submitted <= t.start <= t.end <= t_after)]
    per_copy_modeled = prof.transfer_time(rt.cost_spec().expert_bytes)
    return {
        "knobs": knobs, "loads": res.loads, "prefetches": res.prefetches, "misses": res.misses,
        "drained": len(got), "drained_each_once": len({id(t) for t in got}) == len(got),
        "drained_le_loads": len(got) <= res.loads, "invalid_spans": len(bad),
        "negative_spans": sum(d < 0 for d in dur), "all_valid": not bad and bool(got),
        "span_us_median": statistics.median(dur) * 1e6 if dur else None,
        "span_us_max": max(dur) * 1e6 if dur else None,
        "modeled_us_per_copy": per_copy_modeled * 1e6,
        "transfer_busy_s": busy, "stall_measured_s": res.stall_measured_s,
        "stall_modeled_s": res.stall_modeled_s,
        # 1 − stall / copy-busy time: 1 = every copy hidden behind compute; below 0 = the
        # compute waited longer than the copies took (wake-ups, queueing behind other copies)
        "hidden_share": (1 - res.stall_measured_s / busy) if busy > 0 else None,
        "latency_measured_s": res.latency_measured_s,
        "latency_modeled_s": res.latency_modeled_s, "transfer_bytes": res.transfer_bytes,
        "run_wall_s": t_after - t_before}


# -- 4. batches and capacity-aware dispatch -------------------------------------------------------
def part_batch(dev: torch.device, tokens: int = 16) -> dict:
    """A mixed batch of 8 held-out requests on the device: each greedy answer equals the
    request run alone (offloaded, 24 slots); the dispatches (Token Drop, Expanded Drop, MACS)
    run inside the real experts forward on the device; wall times side by side (3 rounds,
    interleaved, medians)."""
    import statistics

    rt = workbench.Runtime(device=dev.type, max_new_tokens=tokens, cache_slots=24,
                           pinned_layers=0)
    reqs = workbench.mixed_batch(8, text_share=0.5, seed=1)
    out: dict = {"requests": len(reqs), "tokens": tokens}
    b = rt.run(reqs, record=False)
    alone = [rt.run(r, record=False).token_ids for r in reqs]
    out["answers_equal_alone"] = [x["token_ids"] == y for x, y in zip(b.batch, alone)]
    out["all_equal"] = all(out["answers_equal_alone"])
    configs = {"topk": {}, "capacity-drop γ0=1": dict(dispatch="capacity-drop"),
               "capacity-expanded γ0=1": dict(dispatch="capacity-expanded", ep_ranks=8),
               "macs γ0=1": dict(dispatch="macs", ep_ranks=8),
               "topk, 8 ranks": dict(ep_ranks=8)}
    times: dict[str, list[float]] = {k: [] for k in configs}
    counts: dict[str, dict] = {}
    for r in range(4):  # round 0 warms up
        for name, kw in configs.items():
            t0 = time.perf_counter()
            res = rt.run(reqs, record=False, **kw)
            if r:
                times[name].append(time.perf_counter() - t0)
            counts[name] = {"assigned": res.dispatch_assigned, "dropped": res.dispatch_dropped,
                            "rerouted": res.dispatch_rerouted, "added": res.dispatch_added,
                            "answers_equal_topk": sum(
                                x["token_ids"] == y["token_ids"]
                                for x, y in zip(res.batch, b.batch))}
    base = statistics.median(times["topk"])
    out["runs"] = {k: {"median_s": statistics.median(v),
                       "ratio": statistics.median(v) / base, **counts[k]}
                   for k, v in times.items()}
    return out


def part_realb(dev: torch.device, tokens: int = 16) -> dict:
    """ReaLB live on the device (issue 15): ``fake_quant`` on the device vs on the CPU (the
    same values?) and its time on a 4096 × 4096 float32 tensor; a mixed batch of 8 over 8
    ranks with ``balance`` = none / fp4-all / realb-m1 (low-precision expert runs, answers
    equal to native, wall medians of 3 interleaved rounds); the split path with the quantiser
    made the identity gives the native tokens exactly."""
    import statistics

    import workbench.precision as precision

    out: dict = {"tokens": tokens, "fake_quant": {}}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 4096, generator=g) * torch.logspace(-3, 2, 4096)[None, :]
    for p in ("nvfp4", "fp8"):
        cpu = precision.fake_quant(x, p)
        xd = x.to(dev)
        on = precision.fake_quant(xd, p)
        sync(dev)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            precision.fake_quant(xd, p)
            sync(dev)
            ts.append(time.perf_counter() - t0)
        diff = (on.cpu() - cpu).abs()
        out["fake_quant"][p] = {"max_abs_diff_vs_cpu": float(diff.max()),
                                "values_differing": int((diff > 0).sum()),
                                "median_s_4096sq": statistics.median(ts)}
    rt = workbench.Runtime(device=dev.type, max_new_tokens=tokens, pinned_layers=0,
                           cache_slots=64 * 12)
    reqs = workbench.mixed_batch(8, text_share=0.5, seed=1)
    kw = dict(ep_ranks=8, record=False)
    nat = rt.run(reqs, **kw)
    real = precision.fake_quant
    precision.fake_quant = lambda t, p="nvfp4", axis=None: t.clone()
    try:
        ident = rt.run(reqs, balance="fp4-all", **kw)
    finally:
        precision.fake_quant = real
    out["identity_split_equal_native"] = [a["token_ids"] == b["token_ids"]
                                          for a, b in zip(ident.batch, nat.batch)]
    out["identity_low_runs"] = ident.low_precision_runs
    configs = {"none": {}, "fp4-all": dict(balance="fp4-all"),
               "realb-m1": dict(balance="realb-m1"), "realb": dict(balance="realb")}
    times: dict[str, list[float]] = {k: [] for k in configs}
    runs: dict[str, dict] = {}
    for r in range(4):  # round 0 warms up
        for name, c in configs.items():
            t0 = time.perf_counter()
            res = rt.run(reqs, **kw, **c)
            if r:
                times[name].append(time.perf_counter() - t0)
            runs[name] = {"low_precision_runs": res.low_precision_runs,
                          "answers_equal_native": sum(a["token_ids"] == b["token_ids"]
                                                      for a, b in zip(res.batch, nat.batch))}
    base = statistics.median(times["none"])
    out["runs"] = {k: {"median_s": statistics.median(v), "ratio": statistics.median(v) / base,
                       **runs[k]} for k, v in times.items()}
    return out


def part_prism(dev: torch.device, tokens: int = 16) -> dict:
    """MoE-Prism's elastic execution on the device: a refactoring of random partitions
    (exactness holds for any; numpy only), a mixed batch of 8 offloaded (24 slots, one pinned
    layer) — every sub-expert active must give the native tokens; k_active 2 runs half;
    wall medians of 3 interleaved rounds."""
    import statistics

    from workbench.prism import refactor as R

    rt = workbench.Runtime(device=dev.type, max_new_tokens=tokens, cache_slots=24,
                           pinned_layers=1)
    ref = R.random_refactoring(rt.lm, subexperts=4, r=4)
    folder = Path(tempfile.mkdtemp(prefix="prism-")) / "p"
    R.save(ref, folder)
    reqs = workbench.mixed_batch(8, text_share=0.5, seed=1)
    configs = {"native": {}, "prism, all 4": dict(prism=True, prism_refactoring=str(folder)),
               "prism, k_active 2": dict(prism=True, prism_refactoring=str(folder),
                                          prism_k_active=2)}
    times: dict[str, list[float]] = {k: [] for k in configs}
    runs: dict = {}
    for r in range(4):
        for name, kw in configs.items():
            t0 = time.perf_counter()
            runs[name] = rt.run(reqs, record=False, **kw)
            if r:
                times[name].append(time.perf_counter() - t0)
    nat = runs["native"]
    base = statistics.median(times["native"])
    # the store of a device run with sub-experts: replay (the core, on the host) equals it
    store = folder.parent / "run.zarr"
    rt.run(reqs, store=store, **configs["prism, k_active 2"])
    ds = workbench.open_run(store)
    rep = workbench.replay_trace(ds)
    replay_ok = bool((rep.hits == ds.hits.values).all() and np.allclose(
        rep.step_latency_s, ds.latency_modeled_s.values, rtol=1e-9))
    # sub-expert offloading on the device: the same tokens, fewer bytes copied, replay = live
    sub_store = folder.parent / "sub.zarr"
    sub = rt.run(reqs, store=sub_store, prism_offload=True, **configs["prism, k_active 2"])
    whole = runs["prism, k_active 2"]
    sds = workbench.open_run(sub_store)
    srep = workbench.replay_trace(sds)
    offload = {
        "answers_equal_whole": sum(a["token_ids"] == b["token_ids"]
                                   for a, b in zip(sub.batch, whole.batch)),
        "transfer_bytes_whole": whole.transfer_bytes, "transfer_bytes_sub": sub.transfer_bytes,
        "replay_equals_live": bool((srep.hits == sds.hits.values).all() and np.allclose(
            srep.step_latency_s, sds.latency_modeled_s.values, rtol=1e-9))}
    # GPU–CPU hybrid with sub-experts: misses run on the host copy (the chosen sub-experts
    # follow the tokens to the host), and a global K: the same answers as on the device
    hyb = rt.run(reqs, record=False, hybrid=True, target_model="qwen3-vl-30b-a3b",
                 **configs["prism, k_active 2"])
    dev_k = rt.run(reqs, record=False, target_model="qwen3-vl-30b-a3b",
                   **configs["prism, k_active 2"])
    offload["hybrid_answers_equal_device"] = sum(
        a["token_ids"] == b["token_ids"] for a, b in zip(hyb.batch, dev_k.batch))
    offload["hybrid_host_runs"] = hyb.host_runs
    return {"tokens": tokens, "replay_equals_live": replay_ok, "offload": offload,
            "compute_share": ds.moe.compute_share(), "runs": {
        k: {"median_s": statistics.median(v), "ratio": statistics.median(v) / base,
            "answers_equal_native": sum(a["token_ids"] == b["token_ids"]
                                        for a, b in zip(runs[k].batch, nat.batch)),
            "subexperts_ran": runs[k].subexperts_ran,
            "subexperts_asked": runs[k].subexperts_asked} for k, v in times.items()}}


# -- 3. live cost --------------------------------------------------------------------------------
def _live_scaling():
    """The sibling benchmark ``bench_live_scaling`` as a module (run in this process)."""
    spec = importlib.util.spec_from_file_location(
        "bench_live_scaling", REPO / "benchmarks" / "bench_live_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def part_live(dev: torch.device, out_dir: Path) -> dict:
    mod = _live_scaling()
    path = out_dir / "live_scaling.json"
    threads = torch.get_num_threads()
    try:
        mod.main(["--quick", "--device", dev.type, "--out", str(path)])
    except SystemExit as e:
        raise RuntimeError(f"bench_live_scaling exited: {e}") from None
    finally:
        torch.set_num_threads(threads)
    data = json.loads(path.read_text())
    keep = ("experts", "variant", "cache_slots", "all_fit", "median_s", "ratio_vs_resident",
            "ratio_vs_plain", "tail_ms_per_token", "tail_ratio_vs_resident", "loads",
            "hit_rate", "tail_hit_rate")
    return {"file": path.name, "device_name": data.get("device_name"),
            "wall_s": data.get("wall_s"), "cache_cold_each_run": data.get("cache_cold_each_run"),
            "rows": [{k: r.get(k) for k in keep} for r in data["rows"]],
            "profile_top": [(p["function"], p["tottime_s"])
                            for p in (data.get("profile") or {}).get("top_tottime", [])[:5]]}


# -- summary -------------------------------------------------------------------------------------
def summary(res: dict) -> str:
    env = res.get("env", {})
    lines = [f"# bench_cuda: {env.get('device_name')} ({res['device']}), torch "
             f"{env.get('torch')}, transformers {env.get('transformers')}", "",
             f"experts forward (transformers grouped_mm, float32): "
             f"{env.get('grouped_mm_float32')}", ""]
    for p in PARTS + ("env", "device"):
        if p in res.get("errors", {}):
            lines.append(f"**{p} failed**: `{res['errors'][p].strip().splitlines()[-1]}`\n")
    for name, fn in (("exactness", _md_exactness), ("transfers", _md_transfers),
                     ("live", _md_live), ("batch", _md_batch), ("realb", _md_realb),
                     ("prism", _md_prism)):
        if res.get(name):
            try:
                lines += fn(res[name], res)
            except Exception as e:  # noqa: BLE001 — the JSON holds everything anyway
                lines += [f"({name}: summary failed: {type(e).__name__}: {e})", ""]
    lines.append(f"wall {res.get('wall_s', 0):.0f} s")
    return "\n".join(lines)


def _f(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "" if x is None else format(x * scale, spec)


def _err(d: dict) -> str:
    return d["error"].strip().splitlines()[0] if "error" in d else ""


def _md_exactness(ex: dict, res: dict) -> list[str]:
    lines = [f"## Exactness (embedded model, {ex['max_new_tokens']} tokens, ignore_eos; "
             f"small cache = {ex['cache_slots_small']} slots; inputs via {ex.get('processor')})",
             "", f"all greedy tokens equal: **{ex.get('all_tokens_equal')}** · max |Δ score| "
             f"{_f(ex.get('max_abs_score_diff'), '.2e')} · tiny architectures all equal: "
             f"**{ex.get('tiny_all_equal')}**", "",
             "| request | variant | tokens equal | max abs Δ score | misses | loads | "
             "prefetches | stall meas ms | stall modeled ms | device MB at 1st token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rn, r in ex["requests"].items():
        if "error" in r:
            lines.append(f"| {rn} | plain generate FAILED: `{_err(r)}` | | | | | | | | |")
            continue
        extra = (f"plain repeat equal {r['plain_repeat_tokens_equal']} (Δ "
                 f"{_f(r['plain_repeat_scores'].get('max_abs_diff'), '.1e')})")
        if "plain_cpu_tokens_equal" in r:
            extra += (f", plain CPU equal {r['plain_cpu_tokens_equal']} (Δ "
                      f"{_f(r['plain_cpu_scores'].get('max_abs_diff'), '.1e')})")
        if "processor_error" in r:
            extra += f"; AutoProcessor failed: `{r['processor_error'].splitlines()[0]}`"
        lines.append(f"| {rn} | plain generate: {r['plain_text']!r} | — | {extra} | | | | | | |")
        for vn, v in r["runs"].items():
            if "error" in v:
                lines.append(f"| {rn} | {vn} | FAILED: `{_err(v)}` | | | | | | | |")
                continue
            lines.append(
                f"| {rn} | {vn} | {v['tokens_equal']} | {_f(v.get('max_abs_diff'), '.2e')} | "
                f"{v['misses']} | {v['loads']} | {v['prefetches']} | "
                f"{_f(v['stall_measured_s'], '.2f', 1e3)} | "
                f"{_f(v['stall_modeled_s'], '.2f', 1e3)} | "
                f"{_f(v['device_bytes_at_first_token'], '.1f', 1e-6)} |")
    tiny = ex.get("tiny_architectures", {})
    bad = {a: (t.get("error") or t["cases"]) for a, t in tiny.items()
           if "error" in t or not all(c["tokens_equal"] and c["logits_allclose"]
                                      for c in t["cases"])}
    return lines + ["", f"tiny architectures through the Offloader on {res['device']}: "
                    f"{len(tiny) - len(bad)}/{len(tiny)} equal" + (f"; not: {bad}" if bad else ""),
                    ""]


def _md_transfers(tr: dict, res: dict) -> list[str]:
    lines = [f"## Host → device copies (modeled link of profile {tr['modeled_profile']}: "
             f"{tr['modeled_link_GBps']:.1f} GB/s + {tr['modeled_link_latency_us']:.0f} µs)", "",
             "| bytes | pinned GB/s | pinned µs/copy | pageable GB/s | pageable µs/copy | "
             "modeled GB/s |", "| --- | --- | --- | --- | --- | --- |"]
    for b in tr["bandwidth"]:
        lines.append(f"| {b.get('bytes', _err(b))} | {_f(b.get('pinned_GBps'))} | "
                     f"{_f(b.get('pinned_us_per_copy'), '.1f')} | {_f(b.get('pageable_GBps'))} | "
                     f"{_f(b.get('pageable_us_per_copy'), '.1f')} | {_f(b.get('modeled_GBps'))} |")
    lines += ["", "| engine stream | copies | submit µs/copy | span µs (median) | effective GB/s "
              "| modeled µs/copy | valid, each once, landed |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for e in tr["engine_stream"]:
        if "error" in e:
            lines.append(f"| FAILED: `{_err(e)}` | | | | | | |")
            continue
        lines.append(f"| {e['what']} | {e['copies']} | {_f(e['submit_us_per_copy'], '.1f')} | "
                     f"{_f(e['span_us_median'], '.1f')} | {_f(e['effective_GBps'])} | "
                     f"{_f(e['modeled_us_per_copy'], '.1f')} | {e['all_valid']}, "
                     f"{e['drained_each_once']}, {e['data_landed']} |")
    o = tr["engine_overlap"]
    lines += ["", f"copy overlap: FAILED `{_err(o)}`" if "error" in o else
              f"copy on the engine's stream vs compute after it: copy {o['copy_s'] * 1e3:.2f} ms, "
              f"compute {o['compute_s'] * 1e3:.2f} ms, both {o['both_s'] * 1e3:.2f} ms → overlap "
              f"share **{o['overlap_share']:.2f}** (1 = hidden, 0 = serialised)", "",
              "| live run (16 tokens, nothing pinned) | loads | prefetches | drained | invalid "
              "spans | span µs median | modeled µs/copy | busy ms | stall ms | hidden share | "
              "latency meas / modeled ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, s in tr["runtime_spans"].items():
        if "error" in s:
            lines.append(f"| {n} | FAILED: `{_err(s)}` | | | | | | | | | |")
            continue
        lines.append(f"| {n} | {s['loads']} | {s['prefetches']} | {s['drained']} | "
                     f"{s['invalid_spans']} | {_f(s['span_us_median'], '.1f')} | "
                     f"{_f(s['modeled_us_per_copy'], '.1f')} | "
                     f"{_f(s['transfer_busy_s'], '.2f', 1e3)} | "
                     f"{_f(s['stall_measured_s'], '.2f', 1e3)} | {_f(s['hidden_share'])} | "
                     f"{_f(s['latency_measured_s'], '.1f', 1e3)} / "
                     f"{_f(s['latency_modeled_s'], '.1f', 1e3)} |")
    ic = tr.get("offloader_install_remove") or {}
    if ic:
        lines += ["", f"offloader install / remove per run: FAILED `{_err(ic)}`" if "error" in ic
                  else f"offloader install / remove per run (nothing pinned, "
                  f"{ic['routed_expert_bytes'] / 1e6:.1f} MB of routed experts): "
                  f"{ic['install_s'] * 1e3:.1f} ms / {ic['remove_s'] * 1e3:.1f} ms"]
    return lines + [""]


def _md_live(lv: dict, res: dict) -> list[str]:
    lines = [f"## Live cost (bench_live_scaling --quick on {lv['device_name']})", "",
             "| E | variant | slots | median s | × all resident | × plain | tail ms/token | "
             "hit rate |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in lv["rows"]:
        lines.append(f"| {r['experts']} | {r['variant']} | {r['cache_slots'] or ''}"
                     f"{' (all fit)' if r.get('all_fit') else ''} | {_f(r['median_s'], '.3f')} | "
                     f"{_f(r['ratio_vs_resident'])} | {_f(r['ratio_vs_plain'])} | "
                     f"{_f(r['tail_ms_per_token'])} | {_f(r.get('hit_rate'), '.1%')} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/cuda"),
                    help="folder for cuda.json, cuda.md and live_scaling.json")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated parts to run (of {', '.join(PARTS)})")
    ap.add_argument("--tokens", type=int, default=12, help="new tokens of the exactness runs")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "cuda.json"
    dev = torch.device(a.device)
    res: dict = {"benchmark": "cuda", "device": a.device, "parts": parts, "errors": {},
                 "part_wall_s": {},
                 "command": "python benchmarks/bench_cuda.py " + " ".join(
                     sys.argv[1:] if argv is None else argv)}

    def save() -> None:
        res["wall_s"] = time.perf_counter() - T_START
        path.write_text(json.dumps(res, indent=1, default=json_default) + "\n")

    def run_part(name: str, fn) -> None:
        t0 = time.perf_counter()
        log(f"{name}: start")
        try:
            res[name] = fn()
        except BaseException as e:  # noqa: BLE001 — recorded; the other parts still run
            if isinstance(e, KeyboardInterrupt):
                raise
            res["errors"][name] = traceback.format_exc()
            log(f"{name}: FAILED: {type(e).__name__}: {e}")
        res["part_wall_s"][name] = time.perf_counter() - t0
        save()
        log(f"{name}: done in {res['part_wall_s'][name]:.1f} s")

    run_part("env", lambda: part_env(dev))
    if dev.type == "cuda" and not torch.cuda.is_available():
        res["errors"]["device"] = "--device cuda but torch sees no CUDA device"
        save()
        print(f"bench_cuda: error: {res['errors']['device']}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-cuda-") as d, \
            workbench.set_options(workspace=Path(d) / "runs"):
        if "exactness" in parts:
            run_part("exactness", lambda: part_exactness(dev, a.tokens))
        if "transfers" in parts:
            run_part("transfers", lambda: part_transfers(dev))
        if "live" in parts:
            run_part("live", lambda: part_live(dev, out_dir))
        if "batch" in parts:
            run_part("batch", lambda: part_batch(dev))
        if "realb" in parts:
            run_part("realb", lambda: part_realb(dev))
        if "prism" in parts:
            run_part("prism", lambda: part_prism(dev))
    save()
    try:
        md = summary(res)
    except Exception:  # noqa: BLE001 — the JSON is the result; the summary only shows it
        md = "summary failed:\n" + traceback.format_exc()
    (out_dir / "cuda.md").write_text(md + "\n")
    print(md, flush=True)
    print(f"\nwritten {path} ({res['wall_s']:.0f} s); errors in: "
          f"{', '.join(res['errors']) or 'none'}", flush=True)
    return 1 if res["errors"] else 0


def _md_batch(bt: dict, res: dict) -> list[str]:
    lines = [f"## A batch of {bt['requests']} mixed requests ({bt['tokens']} tokens)", "",
             f"each answer equals the request run alone: **{bt['all_equal']}** "
             f"({sum(bt['answers_equal_alone'])}/{bt['requests']})", "",
             "| run | median s | × topk | assigned | dropped | rerouted | added | answers = "
             "topk |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k, v in bt["runs"].items():
        lines.append(f"| {k} | {v['median_s']:.3f} | {v['ratio']:.2f} | {v['assigned']} | "
                     f"{v['dropped']} | {v['rerouted']} | {v['added']} | "
                     f"{v['answers_equal_topk']}/{bt['requests']} |")
    return lines + [""]


def _md_realb(rb: dict, res: dict) -> list[str]:
    lines = [f"## ReaLB live: a batch of 8 mixed requests over 8 ranks ({rb['tokens']} tokens)",
             "", "fake_quant on the device vs the CPU (4096 × 4096 float32, wide range): " +
             "; ".join(f"{p}: max |Δ| {v['max_abs_diff_vs_cpu']:.2e}, {v['values_differing']} "
                       f"values differ, {v['median_s_4096sq'] * 1e3:.2f} ms"
                       for p, v in rb["fake_quant"].items()), "",
             f"split path with the identity quantiser equals native: "
             f"**{all(rb['identity_split_equal_native'])}** "
             f"({sum(rb['identity_split_equal_native'])}/8; {rb['identity_low_runs']} expert "
             f"runs apart)", "",
             "| balance | median s | × none | low-precision expert runs | answers = native |",
             "| --- | --- | --- | --- | --- |"]
    for k, v in rb["runs"].items():
        lines.append(f"| {k} | {v['median_s']:.3f} | {v['ratio']:.2f} | "
                     f"{v['low_precision_runs']} | {v['answers_equal_native']}/8 |")
    return lines + [""]


def _md_prism(pr: dict, res: dict) -> list[str]:
    lines = [f"## MoE-Prism elastic execution: a batch of 8, offloaded ({pr['tokens']} tokens)",
             "", "| run | median s | × native | answers = native | sub-experts run |",
             "| --- | --- | --- | --- | --- |"]
    for k, v in pr["runs"].items():
        share = (f"{v['subexperts_ran'] / v['subexperts_asked']:.0%}"
                 if v["subexperts_asked"] else "")
        lines.append(f"| {k} | {v['median_s']:.3f} | {v['ratio']:.2f} | "
                     f"{v['answers_equal_native']}/8 | {share} |")
    if "replay_equals_live" in pr:
        lines += ["", f"A k_active 2 run recorded on the device: the store's compute share "
                      f"{pr['compute_share']:.0%}; its trace replay (the simulation core) "
                      f"equals the live run (hits, modeled latency per step): "
                      f"{pr['replay_equals_live']}"]
    if "offload" in pr:
        o = pr["offload"]
        lines += ["", f"Sub-expert offloading (`prism_offload`, k_active 2): answers equal "
                      f"whole-expert offloading's {o['answers_equal_whole']}/8; bytes copied "
                      f"{o['transfer_bytes_sub'] / 1e6:.1f} MB vs {o['transfer_bytes_whole'] / 1e6:.1f}"
                      f" MB whole; replay of its store equals the live run: "
                      f"{o['replay_equals_live']}"]
        if "hybrid_host_runs" in o:
            lines += ["", f"Hybrid mode with sub-experts (k_active 2): {o['hybrid_host_runs']} "
                          f"misses ran on the host; answers equal the device-only run's "
                          f"{o['hybrid_answers_equal_device']}/8"]
    return lines + [""]


def _git_head() -> str | None:
    return _live_scaling()._git_head()


if __name__ == "__main__":
    sys.exit(main())
