"""MoE-Prism's neuron activation profiler (issue 16 §1; seed 001 §4.2): the activations
act(x·W_gate) ⊙ (x·W_up) of every expert's neurons on the tokens the router sends it.

Every supported architecture keeps its routed experts fused the transformers-5 way:
``gate_up_proj`` [E, 2I, H] (the gate's I rows, then the up projection's) and ``down_proj``
[E, H, I], the experts forward computing ``act_fn(gate) * up`` then ``linear(·, down_proj[e])``.
A neuron j is row j (gate) and row I + j (up) of ``gate_up_proj[e]`` with column j of
``down_proj[e]``: the expert's output is Σ_j A[:, j] · down_proj[e][:, j], so any partition of
the neurons splits it into sub-experts that sum to it exactly (:func:`check_layout` verifies
this against the model's own experts forward).

The profiler hooks each MoE block's experts module (a forward pre-hook: its hidden states and
routing), runs the model's forward (prefill) over calibration requests in batches, and keeps
the activations of the first ``max_tokens`` tokens routed to each (layer, expert) — the
annealer's work grows with them (:mod:`workbench.prism.partition`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from workbench.errors import InputError, UnsupportedArchitectureError


def neuron_layout(block) -> tuple[int, int]:
    """``(I, H)`` of a MoE block's fused experts; :class:`UnsupportedArchitectureError` for a
    layout other than gate_up_proj [E, 2I, H] + down_proj [E, H, I] with an ``act_fn``."""
    ex = block.experts
    gu, down = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    if getattr(ex, "has_bias", False) or getattr(ex, "is_transposed", False) \
            or getattr(ex, "gate_up_proj_bias", None) is not None:
        raise UnsupportedArchitectureError(
            f"MoE-Prism slices the experts' weights only: {type(ex).__name__} has expert biases "
            f"or a transposed layout, which it does not support yet")
    if gu is None or down is None or not hasattr(ex, "act_fn") or gu.dim() != 3 \
            or down.dim() != 3 or gu.shape[1] % 2 or down.shape[2] != gu.shape[1] // 2 \
            or down.shape[1] != gu.shape[2]:
        raise UnsupportedArchitectureError(
            f"MoE-Prism needs fused experts gate_up_proj [E, 2I, H] and down_proj [E, H, I] "
            f"with an act_fn; {type(ex).__name__} has "
            f"{tuple(gu.shape) if gu is not None else None} and "
            f"{tuple(down.shape) if down is not None else None}")
    return int(down.shape[2]), int(down.shape[1])


def activations(block, expert: int, x):
    """A [T, I]: the neurons' activations of ``expert`` of ``block`` on hidden states ``x``
    [T, H] (torch, the experts' dtype and device)."""
    import torch.nn.functional as F

    ex = block.experts
    gate, up = F.linear(x, ex.gate_up_proj[expert]).chunk(2, dim=-1)
    return ex.act_fn(gate) * up


def check_layout(block, expert: int, x) -> float:
    """max |Σ_j A[:, j]·down[:, j] − the experts forward's output| for ``x`` routed to
    ``expert`` alone with weight 1 (0 up to float rounding when :func:`neuron_layout` holds)."""
    import torch
    import torch.nn.functional as F

    T = x.shape[0]
    idx = torch.full((T, 1), expert, dtype=torch.long, device=x.device)
    w = torch.ones((T, 1), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        own = block.experts(x, idx, w)
        mine = F.linear(activations(block, expert, x), block.experts.down_proj[expert])
    return float((own - mine).abs().max())


def neuron_activations(lm, requests: Sequence[Any], max_tokens: int = 128,
                       batch_size: int = 8, progress=None) -> list[list[np.ndarray]]:
    """``[layer][expert]`` → float32 [B_e, I]: the activations of the first ``max_tokens``
    tokens (padding excluded) routed to each expert over ``requests`` (module docstring).
    ``progress("profiling requests", done, total)`` after each batch
    (:mod:`workbench.progress`)."""
    import torch

    from workbench.models.hooks import prefill_experts

    if not requests:
        raise InputError("the profiler needs at least one calibration request")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InputError(f"max_tokens must be a whole number ≥ 1, not {max_tokens!r}")
    lay = lm.layout
    for b in lay.blocks:
        neuron_layout(b)
    E = lay.num_experts
    rows: list[list[list[np.ndarray]]] = [[[] for _ in range(E)] for _ in lay.blocks]
    have = np.zeros((len(lay.blocks), E), np.int64)

    def on_experts(b, hs, idx):
        ids = idx.detach().cpu().numpy().astype(np.int64)
        for e in np.unique(ids[(ids >= 0) & (ids < E)]):
            room = max_tokens - int(have[b.index, e])
            if room <= 0:
                continue
            tok = np.nonzero((ids == e).any(1))[0][:room]
            a = activations(b, int(e), hs[torch.as_tensor(tok, device=hs.device)])
            rows[b.index][e].append(a.detach().float().cpu().numpy())
            have[b.index, e] += len(tok)

    prefill_experts(lm, requests, batch_size, on_experts, progress=progress)
    I = neuron_layout(lay.blocks[0])[0]
    return [[np.concatenate(r) if r else np.zeros((0, I), np.float32) for r in layer]
            for layer in rows]


__all__ = ["activations", "check_layout", "neuron_activations", "neuron_layout"]
