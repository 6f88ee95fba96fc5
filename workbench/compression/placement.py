"""Faithful placement of visual-token pruning in a live Qwen3-VL-MoE model (hooks only).

:class:`PrunedPlacement` is a context manager that makes the model run its **pinned prefix**
(MoE layers ``0 … pinned_layers − 1``) on the full token stream and every later decoder layer on
the text tokens plus the kept visual tokens only. On exit every hook is removed and the model is
exactly as before.

Invariants (verified against the model run on the input with the pruned tokens removed at their
original M-RoPE positions: bitwise-equal logits with ``pinned_layers = 0``, see
``tests/test_compression.py``):

- **Selection** runs once per request, in the pre-hook of the first pruned decoder layer, when
  the prefix routing (router hooks on the pinned MoE layers: top-k ids ``[S, k]``) and the vision
  saliency are complete — or earlier, when the offloader's router lookahead asks for the keep
  set (:meth:`PrunedPlacement.prefill_keep_mask`) and the policy's inputs are complete. Kept positions = all text positions ∪ kept visual positions, in original
  order.
- **Every** pruned layer gets sliced copies of the loop invariants of the text model's layer loop:
  ``position_embeddings`` (cos, sin), ``position_ids`` and a materialised 4-D attention mask;
  ``hidden_states`` is sliced once, at the first pruned layer. Deepstack injections into pruned
  layers (``pinned < len(deepstack)``) use the kept visual features only.
- **KV cache**: each ``DynamicCache`` layer grows independently (layers before the boundary hold
  S prompt tokens, later ones |keep|); decode with sdpa needs nothing; a materialised decode mask
  (sized from layer 0) is sliced on its key axis with ``[keep, S, S+1, …]``.
- **Decode positions** continue from the original M-RoPE positions because ``generate`` carries
  the 4-row ``position_ids`` forward. Not supported (refused by :func:`check_supported`): batch
  size > 1, video tokens, models other than Qwen3-VL-MoE. A second ``generate`` on a pruned cache
  or chunked prefill would use layer 0's cache length and is not used by the workbench.

Measured costs (seconds, ``perf_counter``): ``select_s`` (building the prefix routing tensor and
running the policy) and ``saliency_s`` (the vision-attention recomputation) of the request.
"""

from __future__ import annotations

import re
import time
import numpy as np
import torch

from workbench.compression.policies import CompressionPolicy, SelectionInput
from workbench.compression.saliency import VisionSaliency
from workbench.errors import InputError, KnobError
from workbench.models.hooks import Hooks


def _decoder_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name + ".")
    if m is None:
        raise KnobError(f"compression cannot find the decoder layer of MoE block {name!r}")
    return int(m.group(1))


def check_supported(model: torch.nn.Module, input_ids: torch.Tensor | None = None) -> None:
    """Raise :class:`KnobError` / :class:`InputError` if compression cannot run on this
    model / input (see module docstring)."""
    inner = getattr(model, "model", None)
    tm = getattr(inner, "language_model", None)
    if (getattr(inner, "visual", None) is None or tm is None
            or not hasattr(tm, "_deepstack_process")
            or getattr(model.config, "model_type", "") not in ("qwen3_vl_moe",)):
        raise KnobError(
            f"compression needs a Qwen3-VL-MoE vision model; this model is "
            f"{getattr(model.config, 'model_type', type(model).__name__)!r}: use compression=none")
    if input_ids is not None:
        if input_ids.shape[0] != 1:
            raise InputError(f"compression runs one request at a time (batch size 1), not a "
                             f"batch of {input_ids.shape[0]}")
        vid = getattr(model.config, "video_token_id", None)
        if vid is not None and bool((input_ids == vid).any()):
            raise InputError("compression supports image tokens only; this request has video "
                             "tokens: use compression=none")


class PrunedPlacement:
    """Context manager pruning visual tokens behind the pinned prefix (module docstring).

    Args:
        model: the transformers Qwen3-VL-MoE ``...ForConditionalGeneration``.
        layout: the adapter's :class:`~workbench.models.adapter.MoELayout` (MoE block names).
        pinned_layers: MoE layers that run on the full stream (0 … ``layout.num_layers``).
        policy: a :class:`CompressionPolicy` (``select`` gets a :class:`SelectionInput`).
        saliency_check: let the saliency hook verify its recomputation (slow; tests).

    After the prefill: ``keep_positions`` (``LongTensor [S_kept]``, sorted), ``kept_visual``
    (indices into the N visual tokens), ``S_full``, ``num_visual``, ``select_s``,
    ``saliency_s``. ``keep_positions`` is ``None`` while no prefill with pruning happened.
    """

    def __init__(self, model: torch.nn.Module, layout, pinned_layers: int,
                 policy: CompressionPolicy, *, saliency_check: bool = False) -> None:
        check_supported(model)
        self.model = model
        self.tm = model.model.language_model
        self.pinned = int(pinned_layers)
        self.policy = policy
        self.num_experts = int(layout.num_experts)
        blocks = layout.blocks
        self.prefix_routers = [b.router for b in blocks[: self.pinned]]
        # first decoder layer that sees the pruned stream (None: nothing is pruned)
        self.boundary = (_decoder_index(blocks[self.pinned].name)
                         if self.pinned < len(blocks) else None)
        self.saliency = (VisionSaliency(model.model.visual, check=saliency_check)
                         if policy.needs_saliency else None)
        self._hooks = Hooks()
        self._reset()
        self.select_s = 0.0
        self.saliency_s = 0.0
        self.num_visual = 0

    def _reset(self) -> None:
        self.prefill = False
        self.S_full: int | None = None
        self.visual_pos = torch.zeros(0, dtype=torch.long)
        self.routing: dict[int, torch.Tensor] = {}
        self.keep_positions: torch.Tensor | None = None
        self.kept_visual: torch.Tensor | None = None

    # -- install / remove -----------------------------------------------------------------
    def __enter__(self) -> "PrunedPlacement":
        try:
            if self.boundary is not None:
                if self.saliency is not None:
                    self.saliency.__enter__()
                hooks = self._hooks
                hooks.pre(self.tm, self._text_pre, with_kwargs=True)
                for i, r in enumerate(self.prefix_routers):
                    hooks.post(r, self._router_hook(i))
                for l, layer in enumerate(self.tm.layers):
                    if l >= self.boundary:
                        hooks.pre(layer, self._layer_pre, with_kwargs=True)
                self._orig_ds = self.tm._deepstack_process
                hooks.override(self.tm, "_deepstack_process", self._deepstack)
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        self._hooks.remove()
        if self.saliency is not None:
            self.saliency.remove()

    # -- results ----------------------------------------------------------------------------
    def kept_mask(self, num_tokens: int | None = None) -> np.ndarray:
        """bool ``[S]``: True for tokens every layer saw (all True when nothing was pruned)."""
        S = self.S_full if self.S_full is not None else (num_tokens or 0)
        mask = np.ones(S, bool)
        if self.keep_positions is not None:
            mask[:] = False
            mask[self.keep_positions.numpy()] = True
        return mask

    def prefill_keep_mask(self, moe_layer: int) -> np.ndarray | None:
        """bool ``[S]`` of the tokens that will reach the layers behind the pinned prefix, asked
        during a prefill by pinned MoE layer ``moe_layer`` once its router has run (the router
        lookahead restricts its predictions for later layers to these tokens). The selection is
        made here, earlier than the first pruned layer, when its inputs are complete: the vision
        saliency always is; the prefix routing is once every pinned layer has routed
        (``moe_layer = pinned_layers − 1``). Only a policy that ignores the prefix routing
        (:attr:`~workbench.compression.policies.CompressionPolicy.needs_prefix_routing` False:
        ``random``) is decided before that. Deciding early does not change the selection. ``None``: not a prefill, not yet
        decidable, or nothing pruned."""
        if not self.prefill or self.boundary is None or moe_layer >= self.pinned:
            return None
        if self.keep_positions is None:
            complete = all(i in self.routing for i in range(self.pinned))
            if self.policy.needs_prefix_routing and not complete:
                return None
            self._decide()
        if self.keep_positions.numel() == self.S_full:
            return None
        return self.kept_mask()

    def scatter_event(self, ev) -> None:
        """Put a prefill :class:`StepEvent`'s pruned-layer routing back at the original token
        positions (``topk_ids``/``pred_ids`` −1, ``topk_weights`` 0 for pruned tokens) and set
        ``ev.kept``, so the event is ``[S, …]``-aligned on every layer like an unpruned one."""
        if self.keep_positions is None or len(ev.token_ids) != self.S_full:
            return
        kp = self.keep_positions.numpy()
        S = self.S_full
        ev.kept = self.kept_mask()
        for le in ev.layers:
            if le.topk_ids.shape[0] != len(kp) or len(kp) == S:
                continue
            ids = np.full((S, *le.topk_ids.shape[1:]), -1, le.topk_ids.dtype)
            ids[kp] = le.topk_ids
            w = np.zeros((S, *le.topk_weights.shape[1:]), le.topk_weights.dtype)
            w[kp] = le.topk_weights
            le.topk_ids, le.topk_weights = ids, w
            for name in ("pred_ids", "sub_chosen"):  # −1: none
                a = getattr(le, name)
                if a is not None and a.shape[0] == len(kp):
                    p = np.full((S, *a.shape[1:]), -1, a.dtype)
                    p[kp] = a
                    setattr(le, name, p)

    # -- hooks ------------------------------------------------------------------------------
    def _text_pre(self, mod, args, kwargs):
        emb = kwargs.get("inputs_embeds")
        cache = kwargs.get("past_key_values")
        if emb is None or emb.shape[1] <= 1 or (cache is not None and cache.get_seq_length() > 0):
            self.prefill = False
            return None
        if emb.shape[0] != 1:
            raise InputError(f"compression runs one request at a time (batch size 1), not a "
                             f"batch of {emb.shape[0]}")
        self._reset()
        self.prefill = True
        self.S_full = int(emb.shape[1])
        vm = kwargs.get("visual_pos_masks")
        if vm is not None:
            self.visual_pos = vm[0].nonzero().squeeze(1).cpu()
        return None

    def _router_hook(self, i: int):
        def hook(mod, args, out):
            if self.prefill:
                self.routing[i] = out[2].detach()  # router indices [S, k]
        return hook

    def _decide(self) -> None:
        t0 = time.perf_counter()
        n = int(self.visual_pos.numel())
        sal = None
        if self.saliency is not None:
            sal = self.saliency.scores
            self.saliency_s = self.saliency.seconds
            self.saliency.reset()
            if n and (sal is None or sal.numel() != n):
                raise RuntimeError(f"vision saliency has {None if sal is None else sal.numel()} "
                                   f"scores for {n} visual tokens")
        prefix = None
        if self.pinned > 0 and n and all(i in self.routing for i in range(self.pinned)):
            vp = self.visual_pos
            prefix = torch.stack([self.routing[i].to("cpu")[vp] for i in range(self.pinned)])
        kv = (self.policy.select(SelectionInput(n, self.num_experts, sal, prefix))
              if n else torch.zeros(0, dtype=torch.long))
        kv = torch.as_tensor(kv, dtype=torch.long).sort().values
        mask = torch.ones(self.S_full, dtype=torch.bool)
        mask[self.visual_pos] = False
        mask[self.visual_pos[kv]] = True
        self.kept_visual = kv
        self.keep_positions = mask.nonzero().squeeze(1)
        self.num_visual = n
        self.select_s = time.perf_counter() - t0

    def _layer_pre(self, layer, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        if self.prefill:
            if self.keep_positions is None:
                self._decide()
            if self.keep_positions.numel() == self.S_full:
                return None  # nothing pruned
            kp = self.keep_positions.to(hs.device)
            if hs.shape[1] == self.S_full:  # first pruned layer
                hs = hs[:, kp]
            cos, sin = kwargs["position_embeddings"]
            kwargs["position_embeddings"] = (cos[:, kp], sin[:, kp])
            if kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = kwargs["position_ids"][:, kp]
            am = kwargs.get("attention_mask")
            if isinstance(am, torch.Tensor):  # [B, 1, S, S] (eager, padding)
                kwargs["attention_mask"] = am[:, :, kp][..., kp]
        else:
            am = kwargs.get("attention_mask")
            if (isinstance(am, torch.Tensor) and self.keep_positions is not None
                    and self.keep_positions.numel() != self.S_full):
                cache = kwargs["past_key_values"]
                want = cache.layers[layer.self_attn.layer_idx].get_seq_length() + hs.shape[1]
                if am.shape[-1] != want:  # sized against layer 0 (full)
                    kvi = torch.cat([self.keep_positions,
                                     torch.arange(self.S_full, am.shape[-1])]).to(am.device)
                    kwargs["attention_mask"] = am[..., kvi]
        if args:
            return (hs, *args[1:]), kwargs
        kwargs["hidden_states"] = hs
        return args, kwargs

    def _deepstack(self, hidden_states, visual_pos_masks, visual_embeds):
        if visual_pos_masks.shape[1] != hidden_states.shape[1]:  # a pruned layer
            kp = self.keep_positions.to(visual_pos_masks.device)
            visual_pos_masks = visual_pos_masks[:, kp]
            visual_embeds = visual_embeds[self.kept_visual.to(visual_embeds.device)]
        return self._orig_ds(hidden_states, visual_pos_masks, visual_embeds)
