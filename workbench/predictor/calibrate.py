"""``workbench calibrate``: record runs of the real model, train the lookahead predictor, report
Hot Recall on held-out requests, save it (safetensors + JSON).

Recording: each request runs through the model's own ``generate`` (greedy, ``max_new_tokens``)
with a :class:`~workbench.predictor.features.RoutingProbe` installed (hooks only, removed
afterwards; no offloading: routing does not depend on where experts live). Requests are
generated scenes (``workbench.models.embedded.v2.tasks.make_split(seed, n)``) or given inputs.

Split: by request (never by step), the last ``max(1, round(holdout · n))`` requests are
held out. Training: full-batch Adam on soft BCE, seeded (``torch.manual_seed``,
deterministic algorithms) so the same inputs and seed give the same weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from workbench.errors import InputError
from workbench.fileio import read_json
from workbench.predictor.features import RoutingProbe, request_samples
from workbench.predictor.model import (LookaheadPredictor, PredictorConfig, hot_recall,
                                       oracle_recall, random_recall)

KS = (10, 20, 30)


@dataclass
class Recorded:
    """Per request: its step records."""

    steps: list[list]  # one list of StepRecord per request
    num_layers: int
    num_experts: int
    hidden_size: int
    model_id: str
    config_hash: str
    seconds: float


def scene_requests(seed: int, n: int) -> list[tuple[Any, str]]:
    from workbench.models.embedded.v2.tasks import make_split

    return [(img, q) for img, q, _ in make_split(seed, n)]


def parse_inputs(items: Sequence[str], prompt: str) -> list[tuple[Any, str]]:
    """``--inputs``: image files (asked ``prompt``) or JSON files of
    ``[{"image": PATH (relative to the JSON), "prompt": TEXT}, …]`` (like data/demo/prompts.json).
    Images are checked from their headers only (:func:`probe_image`) and returned as paths:
    :func:`record` decodes each when its request is served, so memory holds one image at a
    time, not all of up to :data:`MAX_CALIB_REQUESTS` at once."""
    from workbench.models.inputs import probe_image

    def checked(img: Path) -> Path:
        probe_image(img)
        return img

    out: list[tuple[Any, str]] = []
    for it in items:
        p = Path(it)
        if p.is_dir():
            raise InputError(f"input {it!r} is a folder; --inputs takes image files or JSON "
                             f"lists of {{image, prompt}} (a shell glob such as {it}/*.png "
                             f"names the images in it)")
        if not p.is_file():
            raise InputError(f"input {it!r} does not exist" if not p.exists() else
                             f"input {it!r} is not a regular file")
        if p.suffix.lower() == ".json":
            rows = read_json(p, 16 * 2**20, f"input list {it!r}", obj=False)
            if not isinstance(rows, list):
                raise InputError(f"input list {it!r} holds a JSON {type(rows).__name__}; "
                                 f"expected a list of {{\"image\": PATH, \"prompt\": TEXT}}")
            for i, r in enumerate(rows):
                if not isinstance(r, dict) or not isinstance(r.get("prompt"), str) or \
                        not isinstance(r.get("image", ""), (str, type(None))):
                    raise InputError(f"input list {it!r}, entry {i}: {str(r)[:80]!r} is not an "
                                     f"object with a text \"prompt\" and an optional "
                                     f"\"image\" path")
                img = r.get("image")
                out.append((checked(p.parent / img) if img else None, r["prompt"]))
        else:
            out.append((checked(p), prompt))
    return out


#: most requests, training steps and decode steps per request a calibration takes (the CLI's
#: bounds): every request's routing is held in memory, then trained on in one batch
MAX_CALIB_REQUESTS = 10_000
MAX_CALIB_STEPS = 100_000
MAX_RECORDED_TOKENS = 256


def record(lm, requests: list[tuple[Any, str]], max_new_tokens: int = 4,
           progress: Callable[[str, int, int], None] | None = None) -> Recorded:
    """Serve each request (greedy, exactly ``max_new_tokens``) and record its routing;
    ``progress("recording requests", done, total)`` after each (:mod:`workbench.progress`)."""
    from workbench.models.inputs import Request, build_inputs

    t0 = time.perf_counter()
    per_request = []
    probe = RoutingProbe(lm.model, lm.layout)
    gen = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
               temperature=None, top_p=None, top_k=None)
    with probe, torch.no_grad():
        for img, prompt in requests:
            probe.steps = []
            inputs = build_inputs(lm, Request(prompt, [img] if img is not None else []),
                                  max_new_tokens)
            lm.model.generate(**inputs.tensors, **gen)
            per_request.append(list(probe.steps))
            if progress is not None:
                progress("recording requests", len(per_request), len(requests))
    return Recorded(per_request, lm.layout.num_layers, lm.layout.num_experts, int(probe.H or 0),
                    lm.model_id, lm.config_hash, time.perf_counter() - t0)


def dataset(rec: Recorded, idx: Sequence[int], window: int, decay: float, use_visual: bool):
    parts = [request_samples(rec.steps[i], window, decay, use_visual, rec.num_layers)
             for i in idx]
    parts = [p for p in parts if len(p[0])]
    if not parts:
        raise InputError("calibration recorded no (step, layer) sample")
    return tuple(np.concatenate([p[j] for p in parts]) for j in range(4))


def train(cfg: PredictorConfig, X: np.ndarray, G: np.ndarray, steps: int, seed: int,
          lr: float = 3e-3, progress: Callable[[str, int, int], None] | None = None,
          phase: str = "training steps") -> tuple[LookaheadPredictor, list[float]]:
    """Full-batch Adam for ``steps`` steps; ``progress(phase, done, steps)`` every step."""
    torch.manual_seed(seed)
    pred = LookaheadPredictor(cfg)
    x = torch.as_tensor(X)
    g = torch.as_tensor(G)
    pred.x_mean.copy_(x.mean(0))
    pred.x_std.copy_(x.std(0).clamp_min(1e-4) if len(x) > 1 else torch.ones(x.shape[1]))
    opt = torch.optim.Adam(pred.parameters(), lr=lr, weight_decay=1e-4)
    loss_fn = torch.nn.BCEWithLogitsLoss()  # soft targets g ∈ [0, 1]
    losses = []
    pred.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(pred(x), g)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(phase, len(losses), steps)
    return pred.eval(), losses


def evaluate(pred: LookaheadPredictor, X: np.ndarray, A: np.ndarray, layer: np.ndarray,
             num_layers: int) -> dict[str, Any]:
    """Hot Recall@{10,20,30} of the experts layer l + 1 activates among the top-k of y_l:
    overall and per layer (l → l + 1), with random and oracle."""
    s = pred.scores(X)
    out: dict[str, Any] = {"samples": int(len(X))}
    for k in KS:
        hr, rr, orc = hot_recall(s, A, k), random_recall(A, k), oracle_recall(A, k)
        out[f"k{k}"] = {"hot_recall": float(np.nanmean(hr)), "random": float(np.nanmean(rr)),
                        "oracle": float(np.nanmean(orc)),
                        "x_random": float(np.nanmean(hr) / max(np.nanmean(rr), 1e-12)),
                        "per_layer": [float(np.nanmean(hr[layer == l])) if (layer == l).any()
                                      else None for l in range(num_layers - 1)]}
    out["mean_active_next_layer"] = float(A.sum(1).mean()) if len(A) else 0.0
    return out


def call_cost(pred: LookaheadPredictor, X: np.ndarray, n: int = 200) -> dict[str, float]:
    """Measured seconds of one predictor call (one sample, eval, CPU): P50/P99/mean."""
    times = []
    with torch.no_grad():
        for i in range(n):
            x = X[i % len(X)][None]
            t0 = time.perf_counter()
            pred.scores(x)
            times.append(time.perf_counter() - t0)
    t = np.asarray(times)
    return {"calls": n, "p50_s": float(np.percentile(t, 50)), "p99_s": float(np.percentile(t, 99)),
            "mean_s": float(t.mean())}


def calibrate(lm, requests: list[tuple[Any, str]], *, steps: int = 300, seed: int = 0,
              window: int = 5, decay: float = 0.8, use_visual: bool = True,
              holdout: float = 0.25, max_new_tokens: int = 4, ablation: bool = True,
              progress: Callable[[str, int, int], None] | None = None
              ) -> tuple[LookaheadPredictor, dict[str, Any]]:
    """Record, train, evaluate. Returns the predictor and its report (the ablation without
    h^(v) is trained on the same split and reported when ``ablation`` and ``use_visual``).
    ``progress(phase, done, total)`` (:mod:`workbench.progress`) follows its phases:
    "recording requests", "training steps" and, with the ablation, "training steps (ablation
    without h^(v))"."""
    if len(requests) < 2:
        raise InputError(f"calibration needs at least 2 requests (one held out), got "
                         f"{len(requests)}")
    torch.manual_seed(seed)
    rec = record(lm, requests, max_new_tokens, progress)
    n = len(requests)
    n_hold = max(1, int(round(holdout * n)))
    tr, te = list(range(n - n_hold)), list(range(n - n_hold, n))
    report: dict[str, Any] = {"requests": n, "train_requests": len(tr),
                              "heldout_requests": len(te), "record_s": rec.seconds,
                              "window": window, "decay": decay, "steps": steps, "seed": seed}

    def fit(vis: bool):
        cfg = PredictorConfig(rec.num_layers, rec.num_experts, rec.hidden_size, use_visual=vis,
                              window=window, decay=decay, model_id=rec.model_id,
                              config_hash=rec.config_hash)
        Xtr, Gtr, _, _ = dataset(rec, tr, window, decay, vis)
        Xte, _, Ate, Lte = dataset(rec, te, window, decay, vis)
        t0 = time.perf_counter()
        pred, losses = train(cfg, Xtr, Gtr, steps, seed, progress=progress,
                             phase="training steps" if vis == use_visual
                             else "training steps (ablation without h^(v))")
        return pred, {"train_samples": int(len(Xtr)), "train_s": time.perf_counter() - t0,
                      "final_loss": losses[-1] if losses else None,
                      "heldout": evaluate(pred, Xte, Ate, Lte, rec.num_layers),
                      "cost": call_cost(pred, Xte)}

    pred, main = fit(use_visual)
    report.update(main)
    if ablation and use_visual:
        _, abl = fit(False)
        report["ablation_no_visual_summary"] = {"heldout": abl["heldout"]}
    return pred, report


def format_report(r: dict[str, Any]) -> str:
    h = r["heldout"]
    lines = [f"calibration: {r['requests']} requests ({r['train_requests']} train, "
             f"{r['heldout_requests']} held out), {r['train_samples']} training samples, "
             f"{r['steps']} steps, W={r['window']} γ={r['decay']}",
             f"held-out Hot Recall (layer l+1's experts in the top-k of y_l, "
             f"{h['samples']} samples, {h['mean_active_next_layer']:.1f} active experts on "
             f"average):"]
    abl = r.get("ablation_no_visual_summary", {}).get("heldout")
    for k in (10, 20, 30):
        e = h[f"k{k}"]
        line = (f"  @{k}: {e['hot_recall']:.1%}  random {e['random']:.1%} "
                f"({e['x_random']:.2f}×)  oracle {e['oracle']:.1%}")
        if abl:
            line += f"  without h^(v) {abl[f'k{k}']['hot_recall']:.1%}"
        lines.append(line)
    c = r["cost"]
    lines.append(f"predictor cost per call (measured, CPU): P50 {c['p50_s'] * 1e3:.3f} ms, "
                 f"P99 {c['p99_s'] * 1e3:.3f} ms")
    return "\n".join(lines)
