"""MoE-Prism's optional low-cost router fine-tune (seed §4.3.2): a trained sub-expert gate.

The seed finetunes "only the gating network, freezing all the other weights", with a
curriculum of increasing k: per token the router scores the sub-experts, the top k run, and
the model is trained end to end. What we built (and where it differs):

- **The gate**: per MoE layer one linear map W_l [E·N, H] (no bias), keeping the router's
  "standard architectural type (a linear layer)". A token x scores sub-expert s of a routed
  expert e as σ(W_l[e·N + s] · x). It replaces the training-free proxy gate's score in
  :meth:`~workbench.prism.execute.PrismView.choose` (``prism_router``): per expert its
  k_active best, or with a global K the token's K best by score × routing weight, exactly as
  the proxy's. The model's own router still picks the experts.
- **Combination: unchanged.** The chosen sub-experts' outputs are summed with the expert's
  routing weight, as with the proxy gate, so every sub-expert active still computes the
  expert exactly. The seed re-weights them by the router's softmax instead; we keep the
  invariant and train only the *choice*.
- **Training**: a straight-through top-k mask. In the forward the chosen sub-experts have
  weight 1 and the others 0, which is exactly what inference computes. In the backward the
  gradient goes through softmax(scores) over the expert's N sub-experts, so every sub-expert,
  chosen or not, learns whether adding it would lower the loss. The sub-experts run through
  the model's own experts forward (:class:`~workbench.runtime.slots.ExpertsView` over the
  sub-expert layout), as in the runtime. Every model weight is frozen; only W trains.
- **Objective**: the seed's is cross-entropy on its training data. Ours, so that it needs no
  labels and works for any model, is the cross-entropy against the *full* model's own
  next-token distribution (self-distillation: KL(full ‖ elastic)) over every real position of
  the calibration requests.
- **Curriculum**: k_active grows from 1 to N − 1 in equal stages over the steps (k = N
  computes the full model, so it has nothing left to learn).

Saved as safetensors + JSON (``router.safetensors``, ``router.json``; no pickle, never
overwritten silently), naming the model and a hash of the refactoring it was trained for;
:func:`load` refuses another model's, another refactoring's or a malformed one.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from workbench.errors import InputError

FORMAT = "workbench-prism-router/1"
WEIGHTS, CONFIG = "router.safetensors", "router.json"

__all__ = ["Router", "finetune", "load", "refactoring_hash", "save"]


@dataclass
class Router:
    """A trained sub-expert gate: ``weight`` float32 [L, E·N, H], row e·N + s scoring
    sub-expert s of expert e; ``meta`` what it was trained for and how."""

    weight: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)


def refactoring_hash(ref) -> str:
    """A short hash of a refactoring's neuron permutation (what makes its sub-experts)."""
    return hashlib.sha256(np.ascontiguousarray(ref.perm, dtype=np.int64).tobytes()
                          ).hexdigest()[:16]


def _curriculum(step: int, steps: int, N: int) -> int:
    """k_active at ``step`` of ``steps``: 1 … N − 1 in equal stages (N = 1: 1)."""
    top = max(1, N - 1)
    return min(top, 1 + step * top // max(1, steps))


def finetune(lm, ref, requests: Sequence[Any], steps: int = 200, lr: float = 1e-2,
             batch_size: int = 8, seed: int = 0, log: Callable[[str], None] | None = None
             ) -> Router:
    """Train a sub-expert gate for ``lm`` (a loaded model) and its refactoring ``ref`` on
    ``requests`` (module docstring): ``steps`` Adam steps of ``batch_size`` requests each
    (cycled in a seeded order). The model is unchanged afterwards."""
    import torch

    from workbench.models.inputs import build_batch_inputs
    from workbench.prism.execute import model_form, subexpert_rows, to_subexpert_layout
    from workbench.runtime.slots import ExpertsView

    if not requests:
        raise InputError("finetune needs calibration requests, got none")
    for name, v, lo in (("steps", steps, 1), ("batch_size", batch_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InputError(f"{name} must be a whole number ≥ {lo}, not {v!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise InputError(f"lr must be a number > 0, not {lr!r}")
    model, blocks = lm.model, lm.layout.blocks
    N = ref.subexperts
    L, E = len(blocks), lm.layout.num_experts
    H = int(blocks[0].experts.gate_up_proj.shape[2])
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    W = torch.nn.Parameter(torch.randn(L, E * N, H, generator=g).mul_(0.01).to(dev))
    opt = torch.optim.Adam([W], lr=lr)
    k_now = [1]
    installed = []

    def hook(l, view, sub_w):
        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            T, k = top_k_index.shape
            ids = top_k_index.long().clamp(max=E - 1)
            scores = (hidden_states.detach().float() @ W[l].T).reshape(T, E, N)
            scores = torch.gather(scores, 1, ids[..., None].expand(T, k, N))  # [T, k, N]
            hard = torch.zeros_like(scores).scatter_(-1, scores.topk(k_now[0], -1).indices,
                                                     1.0)
            soft = scores.softmax(-1)
            mask = hard + soft - soft.detach()  # forward: the hard choice; backward: soft
            sub_ids = (top_k_index.long()[..., None] * N + torch.arange(N, device=dev))
            w = top_k_weights[..., None].to(mask.dtype) * mask
            return view(sub_w, range(E * N), E * N, hidden_states,
                        sub_ids.reshape(T, -1).to(top_k_index.dtype),
                        w.reshape(T, -1).to(top_k_weights.dtype), *args, **kwargs)
        return forward

    requires = {p: p.requires_grad for p in model.parameters()}
    t0 = time.perf_counter()
    losses: list[float] = []
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for l, b in enumerate(blocks):
            ex = b.experts
            gu, down = to_subexpert_layout(ex.gate_up_proj.data, ex.down_proj.data,
                                           torch.as_tensor(ref.perm[l]), N)
            sub_w = model_form(subexpert_rows({"gate_up_proj": gu, "down_proj": down}, N))
            view = ExpertsView(ex, b.expert_params)
            ex.forward = hook(l, view, sub_w)
            installed.append(ex)
        order = np.random.default_rng(seed).permutation(len(requests))
        at = 0
        for step in range(steps):
            idx = [order[(at + i) % len(order)] for i in range(min(batch_size, len(order)))]
            at += len(idx)
            inputs = build_batch_inputs(lm, [requests[i] for i in idx])
            tensors = inputs.tensors
            valid = torch.as_tensor(np.asarray(inputs.valid).reshape(
                tensors["input_ids"].shape), device=dev)
            with torch.no_grad():  # the teacher: the full model (every sub-expert)
                k_now[0] = N
                teacher = model(**tensors).logits.float().log_softmax(-1)
            k_now[0] = _curriculum(step, steps, N)
            student = model(**tensors).logits.float().log_softmax(-1)
            kl = (teacher.exp() * (teacher - student)).sum(-1)  # KL(full ‖ elastic) per position
            loss = kl[valid].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if log is not None and (step % 25 == 0 or step == steps - 1):
                log(f"  router step {step} (k_active {k_now[0]}): KL {losses[-1]:.4f} nats")
    finally:
        for ex in installed:
            ex.__dict__.pop("forward", None)
        for p, r in requires.items():
            p.requires_grad_(r)
    meta = {"format": FORMAT, "model_id": lm.model_id, "config_hash": lm.config_hash,
            "refactoring_hash": refactoring_hash(ref), "layers": L, "experts": E,
            "subexperts": N, "hidden": H, "steps": steps, "lr": lr,
            "batch_size": batch_size, "seed": seed, "requests": len(requests),
            "objective": "KL(full model || elastic) per real position (self-distillation)",
            "curriculum": f"k_active 1 … {max(1, N - 1)} in equal stages",
            "loss_first": losses[0], "loss_last": losses[-1],
            "loss_curve": [float(x) for x in losses[:: max(1, steps // 50)]],
            "seconds": time.perf_counter() - t0}
    return Router(weight=W.detach().float().cpu().numpy(), meta=meta)


def save(router: Router, out: str | Path, overwrite: bool = False) -> Path:
    """Write ``router`` into folder ``out`` (created); an existing one is replaced only with
    ``overwrite``."""
    from workbench.tensorfiles import save_folder

    return save_folder(out, WEIGHTS, CONFIG, {"weight": router.weight.astype(np.float32)},
                       router.meta, FORMAT, "MoE-Prism router", overwrite)


def load(path: str | Path, lm=None, ref=None) -> Router:
    """The trained gate in folder ``path``, checked: its header, the weight's shape, dtype and
    finiteness; with ``lm`` that it is this model's (config and shape), with ``ref`` that it
    was trained for this refactoring. :class:`InputError` naming what is wrong."""
    from workbench.fileio import shorten
    from workbench.tensorfiles import load_header, load_weights

    path = Path(path)
    meta, (L, E, N, H) = load_header(path, CONFIG, FORMAT, "MoE-Prism router",
                                     ("layers", "experts", "subexperts", "hidden"))
    if lm is not None:
        lay = lm.layout
        H_model = int(lay.blocks[0].experts.gate_up_proj.shape[2])
        if meta.get("config_hash") != lm.config_hash or (L, E, H) != (
                lay.num_layers, lay.num_experts, H_model):
            raise InputError(
                f"the router in {str(path)!r} was trained for "
                f"{shorten(meta.get('model_id'))} (config {shorten(meta.get('config_hash'))}, "
                f"{L} layers × {E} experts, hidden {H}), "
                f"not for {lm.model_id!r} (config {lm.config_hash}, {lay.num_layers} × "
                f"{lay.num_experts}, hidden {H_model})")
    if ref is not None:
        mine = refactoring_hash(ref)
        if meta.get("refactoring_hash") != mine or N != ref.subexperts:
            raise InputError(
                f"the router in {str(path)!r} was trained for refactoring "
                f"{shorten(meta.get('refactoring_hash'))} ({N} sub-experts), not for the run's "
                f"({mine}, {ref.subexperts} sub-experts): retrain it on this refactoring")
    t = load_weights(path, WEIGHTS, 4 * L * E * N * H + (1 << 20))
    w = t.get("weight")
    if w is None or w.shape != (L, E * N, H) or w.dtype != np.float32:
        raise InputError(f"{str(path / WEIGHTS)!r}: weight must be float32 of shape "
                         f"{(L, E * N, H)}, not "
                         f"{None if w is None else (str(w.dtype), w.shape)}")
    if not np.isfinite(w).all():
        raise InputError(f"{str(path / WEIGHTS)!r}: weight holds values that are not finite")
    return Router(weight=w, meta=meta)
