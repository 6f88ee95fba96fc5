"""Features and targets of the compression-guided lookahead predictor (VisMMOE §3.3).

Per step s (one forward pass) and MoE layer l the predictor sees

    x_l = [h_l^(r) ; h_l^(h) ; h^(v) ; onehot(l)]

- ``h^(r)`` (routing history, 3E): the *compressed* histogram of recent expert activations, i.e.
  the ``T × k`` routed ids compressed to E bins (share of the step's (token, rank) pairs per
  expert) for layer l and for layer l − 1 of this step (zeros at l = 0), plus the previous
  step's window vector g_l(s − 1) (the target below on the previous step; zeros at step 0).
- ``h^(h)`` (H): mean-pool of layer l's MoE-block *input* hidden states over the retained
  visual tokens the block sees. **Choice:** a step with no visual token at this layer (every
  decode step, text-only prompts) pools over all the step's tokens instead (in decode: the one
  new token), so the feature is never undefined.
- ``h^(v)`` (H): mean-pool of the retained visual embeddings (the language model's input
  embeddings at the visual positions, i.e. the vision tower's merged tokens; only the kept ones
  when compression pruned some). Static per request: computed in the prefill and reused for all
  of decode; zeros for a text-only request. Dropped entirely by the ``use_visual=False``
  ablation (``workbench calibrate --no-visual-summary``).
- ``onehot(l)`` (L): one shared MLP serves every layer, so it is told which layer it is at.

Target: ``g_{l,e} = max_{1≤d≤W} γ^(d−1)·1[e ∈ E_{l+d}]`` where ``E_j`` is the set of experts
layer j activated for any token of the same step. **Last layers:** the window is cut at the
last MoE layer (d ≤ L − 1 − l); the last layer (l = L − 1) has no layer ahead within the step,
so it gives no sample and the predictor is not asked there (no prefetch target either).

:class:`RoutingProbe` records what these need (hooks on the real model: model pre/post hook,
language-model pre hook, MoE-block pre hooks, router forward hooks; all removed on exit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from workbench.models.hooks import Hooks


def window_targets(active: np.ndarray, window: int, decay: float) -> np.ndarray:
    """``g [L, E]`` from ``active [L, E]`` (bool, one step): g[l, e] = max over 1 ≤ d ≤ W,
    l + d < L, of decay^(d−1)·active[l + d, e] (the last layer's row is all zero)."""
    active = np.asarray(active, bool)
    L, E = active.shape
    g = np.zeros((L, E), np.float32)
    for l in range(L):
        for d in range(1, window + 1):
            if l + d >= L:
                break
            g[l] = np.maximum(g[l], (decay ** (d - 1)) * active[l + d])
    return g


def feature_dim(num_layers: int, num_experts: int, hidden: int, use_visual: bool) -> int:
    return 3 * num_experts + hidden + (hidden if use_visual else 0) + num_layers


def build_feature(layer: int, hist: np.ndarray, prev_g: np.ndarray | None,
                  hmean: np.ndarray, hv: np.ndarray | None, num_layers: int,
                  use_visual: bool) -> np.ndarray:
    """``x_l`` of one (step, layer) (see the module docstring). ``hist [L, E]`` this step's
    routing histograms (rows after ``layer`` are not read), ``prev_g [L, E]`` the previous
    step's targets or None, ``hmean [H]``, ``hv [H]`` or None."""
    E = hist.shape[1]
    H = hmean.shape[0]
    parts = [hist[layer], hist[layer - 1] if layer > 0 else np.zeros(E, np.float32),
             prev_g[layer] if prev_g is not None else np.zeros(E, np.float32), hmean]
    if use_visual:
        parts.append(hv if hv is not None else np.zeros(H, np.float32))
    one = np.zeros(num_layers, np.float32)
    one[layer] = 1.0
    parts.append(one)
    return np.concatenate([np.asarray(p, np.float32).reshape(-1) for p in parts])


@dataclass
class StepRecord:
    """What one step leaves for calibration."""

    hist: np.ndarray  # [L, E] float32
    active: np.ndarray  # [L, E] bool
    hmean: np.ndarray  # [L, H] float32
    hv: np.ndarray | None  # [H] (request-static) or None
    visual: bool  # the step had visual tokens


@dataclass
class RoutingProbe:
    """Hooks on a live model that keep, per step, the routing histograms, the pooled MoE inputs
    and the visual summary; optionally calls ``on_layer(probe, layer)`` right after layer
    ``layer``'s router ran (the live predictor).

    ``placement``: a :class:`~workbench.compression.placement.PrunedPlacement` when compression
    is on (to know which visual tokens a pruned layer still sees)."""

    model: torch.nn.Module
    layout: object
    placement: object | None = None
    on_layer: Callable[["RoutingProbe", int], None] | None = None
    on_step_end: Callable[["RoutingProbe"], None] | None = None
    step: int = -1
    steps: list[StepRecord] = field(default_factory=list)
    keep_steps: bool = True
    _hooks: Hooks = field(default_factory=Hooks)

    def __post_init__(self) -> None:
        lay = self.layout
        self.L, self.E = lay.num_layers, lay.num_experts
        self.H = None
        self._reset_request()

    def _reset_request(self) -> None:
        self.vis_full: torch.Tensor | None = None  # bool [S] of the prefill
        self.visual_embeds: torch.Tensor | None = None  # [N, H]
        self._hv: np.ndarray | None = None
        self._hv_kept = False
        self.prev_active: np.ndarray | None = None
        self.hist = self.active = self.hmean = None

    # -- install / remove --------------------------------------------------------------------
    def __enter__(self) -> "RoutingProbe":
        try:
            m, hooks = self.model, self._hooks
            hooks.pre(m, self._model_pre, with_kwargs=True)
            hooks.post(m, self._model_post, with_kwargs=True)
            lm = getattr(getattr(m, "model", None), "language_model", None)
            if lm is not None:
                hooks.pre(lm, self._lm_pre, with_kwargs=True)
            for b in self.layout.blocks:
                hooks.pre(b.block, self._block_pre(b.index), with_kwargs=True)
                hooks.post(b.router, self._router_post(b.index))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        self._hooks.remove()

    # -- hooks --------------------------------------------------------------------------------
    def _model_pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        first = cache is None or (hasattr(cache, "get_seq_length") and cache.get_seq_length() == 0)
        if first:
            self._reset_request()
        elif self.active is not None:
            self.prev_active = self.active.copy()
        self.step += 1
        self.hist = np.zeros((self.L, self.E), np.float32)
        self.active = np.zeros((self.L, self.E), bool)
        self.hmean = None
        self.step_visual = False
        self._n_tokens = int(ids.shape[-1]) if ids is not None else None
        return None

    def _model_post(self, module, args, kwargs, output):
        if self.keep_steps and self.hmean is not None:
            self.steps.append(StepRecord(self.hist.copy(), self.active.copy(), self.hmean.copy(),
                                         self.visual_summary(), self.step_visual))
        if self.on_step_end is not None:
            self.on_step_end(self)
        return None

    def _lm_pre(self, module, args, kwargs):
        emb = kwargs.get("inputs_embeds")
        vm = kwargs.get("visual_pos_masks")
        if emb is not None and vm is not None and emb.shape[1] > 1:
            self.vis_full = vm[0].detach().bool()
            self.visual_embeds = emb[0][self.vis_full].detach()
            self._hv = None
        return None

    def _visual_mask(self, n: int) -> torch.Tensor | None:
        vf = self.vis_full
        if vf is None:
            return None
        if n == vf.numel():
            return vf
        pl = self.placement
        kp = getattr(pl, "keep_positions", None) if pl is not None else None
        if kp is not None and kp.numel() == n:
            return vf[kp.to(vf.device)]
        return None  # a decode step: no visual token

    def _block_pre(self, layer: int):
        def hook(module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            x = hs.detach().reshape(-1, hs.shape[-1])
            if self.H is None:
                self.H = int(x.shape[-1])
            if self.hmean is None:
                self.hmean = np.zeros((self.L, self.H), np.float32)
            mask = self._visual_mask(x.shape[0])
            if mask is not None and bool(mask.any()):
                self.step_visual = True
                pooled = x[mask.to(x.device)].float().mean(0)
            else:
                pooled = x.float().mean(0)
            self.hmean[layer] = pooled.cpu().numpy()
            return None
        return hook

    def _router_post(self, layer: int):
        def hook(module, args, out):
            ids = out[2].detach().reshape(-1).cpu().numpy()
            ids = ids[ids >= 0]
            if ids.size:
                c = np.bincount(ids, minlength=self.E)[: self.E].astype(np.float32)
                self.hist[layer] = c / c.sum()
                self.active[layer] = c > 0
            if self.on_layer is not None:
                self.on_layer(self, layer)
            return None
        return hook

    # -- derived ------------------------------------------------------------------------------
    def visual_summary(self) -> np.ndarray | None:
        """h^(v): mean of the retained visual embeddings (None: no visual token)."""
        ve = self.visual_embeds
        if ve is None or ve.shape[0] == 0:
            return None
        pl = self.placement
        kv = getattr(pl, "kept_visual", None) if pl is not None else None
        if self._hv is None or (kv is not None and not self._hv_kept):
            sel = ve[kv.to(ve.device)] if kv is not None and kv.numel() else ve
            self._hv = sel.float().mean(0).cpu().numpy()
            self._hv_kept = kv is not None
        return self._hv


def request_samples(steps: list[StepRecord], window: int, decay: float, use_visual: bool,
                    num_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(X [n, D], G [n, E], next_active [n, E] bool, layer [n])`` of one request's steps:
    one sample per (step, layer < L − 1)."""
    X, G, A, LY = [], [], [], []
    prev_g = None
    for rec in steps:
        g = window_targets(rec.active, window, decay)
        for l in range(num_layers - 1):
            X.append(build_feature(l, rec.hist, prev_g, rec.hmean[l], rec.hv, num_layers,
                                   use_visual))
            G.append(g[l])
            A.append(rec.active[l + 1])
            LY.append(l)
        prev_g = g
    return (np.asarray(X, np.float32), np.asarray(G, np.float32), np.asarray(A, bool),
            np.asarray(LY, np.int64))


def now() -> float:
    return time.perf_counter()
