"""Vision saliency: head-averaged attention each merged visual token receives.

``output_attentions=True`` cannot be used on Qwen3-VL-MoE's vision tower (transformers 5.x
records the attention module's *output*, not its weights), so :class:`VisionSaliency` hooks the
attention module of one vision block and recomputes the attention weights from the module's own
``qkv`` projection and rotary embedding: per image (``cu_seqlens`` segment) and per head,
A = softmax(q kᵀ · scaling) (``[n, n]``, one head at a time, so peak memory is n² floats); the
attention *received* by patch j is the mean over queries of A[:, j], averaged over heads.

Patches → merged tokens: the processor lays patches out block-major over m×m windows and the
merger flattens consecutive groups of m², so merged token i is patches ``[m²i, m²i + m²)`` and
its score is their mean. Merged tokens run in the order of the image placeholders of the
sequence, so ``scores[i]`` belongs to the i-th visual position (several images: concatenated).

Units: attention mass (each query's row sums to 1, so the mean over tokens of the per-patch
score is 1/n per image). Scores are raw; policies normalise them (min-max).
"""

from __future__ import annotations

import time

import torch

from workbench.models.hooks import Hooks


class VisionSaliency:
    """Context manager: hook ``visual.blocks[block].attn`` and keep ``scores`` (``[N]`` float32,
    CPU) of the last vision forward, plus ``seconds`` (measured time of the recomputation).

    ``check=True`` also rebuilds proj(A·V) and asserts it equals the module's output (slow;
    for tests)."""

    def __init__(self, visual: torch.nn.Module, block: int = -1, check: bool = False) -> None:
        self.visual = visual
        self.block = block
        self.check = check
        self.m2 = int(visual.spatial_merge_size) ** 2
        self.scores: torch.Tensor | None = None
        self.seconds = 0.0
        self._hooks = Hooks()

    def __enter__(self) -> "VisionSaliency":
        self._hooks.post(self.visual.blocks[self.block].attn, self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        self._hooks.remove()

    def reset(self) -> None:
        self.scores = None
        self.seconds = 0.0

    @torch.no_grad()
    def _hook(self, attn, args, kwargs, output) -> None:
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            apply_rotary_pos_emb_vision)

        t0 = time.perf_counter()
        x = args[0] if args else kwargs["hidden_states"]
        cu = kwargs["cu_seqlens"]
        cos, sin = kwargs["position_embeddings"]
        S = x.shape[0]
        q, k, v = attn.qkv(x).reshape(S, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)  # [S, H, D]
        received, outs = [], []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # one image / frame each
            qi, ki, vi = (t[a:b].transpose(0, 1).float() for t in (q, k, v))  # [H, n, D]
            acc = torch.zeros(b - a, device=x.device)
            per_head = []
            for h in range(qi.shape[0]):
                A = torch.softmax(qi[h] @ ki[h].T * attn.scaling, dim=-1)  # [n, n]
                acc += A.mean(0)
                if self.check:
                    per_head.append(A @ vi[h])
            received.append(acc / qi.shape[0])
            if self.check:
                outs.append(torch.stack(per_head, 1).reshape(b - a, -1))
        if self.check:
            mine = attn.proj(torch.cat(outs).to(x.dtype))
            if not torch.allclose(mine, output, atol=1e-4, rtol=1e-4):
                raise AssertionError("vision saliency: recomputed attention does not reproduce "
                                     f"the block's output (max |Δ| {(mine - output).abs().max()})")
        per_patch = torch.cat(received)
        scores = per_patch.view(-1, self.m2).mean(-1).float().cpu()
        # several vision forwards in one request (images then videos): concatenate
        self.scores = scores if self.scores is None else torch.cat([self.scores, scores])
        self.seconds += time.perf_counter() - t0
