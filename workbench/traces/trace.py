"""A routing trace: which experts every token of every step was routed to, layer by layer.

Every source (a run store, the importers in :mod:`workbench.traces.formats`) produces a
:class:`Trace`; replay and every analysis read only this. Shapes and invariants:

- ``topk_ids``     int16   [token, layer, k]  expert ids in the router's rank order; -1 = no expert
                                             (the token was not routed there, or the source
                                             dropped that record);
- ``topk_weights`` float32 [token, layer, k]  combine weights (NaN when the source has none);
- ``token_step``   int32   [token]            step (forward pass) of each token, non-decreasing,
                                             every step in ``0 .. num_steps-1`` has ≥ 1 token;
- ``token_modality`` int8  [token]            0 text, 1 image, 2 video;
- ``phase``        int8    [step]             0 prefill, 1 decode;
- ``step_request`` int32   [step]             request of each step (traces may hold several);
- ``pinned``       bool    [layer]            layers the recording run kept resident;
- ``pred_ids``     int16   [token, layer, depth, k] or None: the router of layer ``l + 1 + d``
                                             applied to layer ``l``'s hidden state (recorded live
                                             with router lookahead; -1 where none).
- ``kept``         bool    [token]            False: a visual token that token compression pruned
                                             after the pinned prefix (its routing on the later
                                             layers is -1); default all True.
- ``predicted_ids`` int16 [step, layer, rank] or None: the lookahead predictor's top-B experts of
                                             y_layer, best first (recorded live with predictor /
                                             prefetch = vismmoe; -1 where it did not run);
- ``predicted_scores`` float32 [step, layer, rank] or None: their σ(y_layer) scores (required
                                             with ``predicted_ids``).

Accesses are served in this order: step by step, layer 0 … L-1 within a step, and within a
(step, layer) *group* the distinct routed experts in ascending id order — the order the live
runtime looks them up in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workbench.errors import InputError


@dataclass
class Trace:
    topk_ids: np.ndarray
    token_step: np.ndarray
    num_experts: int
    topk_weights: np.ndarray | None = None
    token_modality: np.ndarray | None = None
    phase: np.ndarray | None = None
    step_request: np.ndarray | None = None
    pinned: np.ndarray | None = None
    pred_ids: np.ndarray | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    kept: np.ndarray | None = None
    predicted_ids: np.ndarray | None = None
    predicted_scores: np.ndarray | None = None

    def __post_init__(self) -> None:
        ids = np.asarray(self.topk_ids)
        if ids.ndim != 3:
            raise InputError(f"trace topk_ids must be [token, layer, k], got shape {ids.shape}")
        self.topk_ids = ids.astype(np.int16, copy=False)
        T, L, _ = ids.shape
        self.token_step = np.asarray(self.token_step, dtype=np.int32)
        if self.token_step.shape != (T,):
            raise InputError(f"trace token_step must have one entry per token ({T}), "
                             f"got shape {self.token_step.shape}")
        if T and (self.token_step[0] != 0 or np.any(np.diff(self.token_step) < 0)
                  or np.any(np.diff(self.token_step) > 1)):
            raise InputError("trace token_step must start at 0 and grow by 0 or 1 per token")
        bad = (ids < -1) | (ids >= self.num_experts)
        if bad.any():
            t, l, j = np.argwhere(bad)[0]
            raise InputError(f"trace expert id {int(ids[t, l, j])} at token {t}, layer {l}, "
                             f"rank {j} is outside 0..{self.num_experts - 1}")
        S = self.num_steps
        if self.topk_weights is None:
            self.topk_weights = np.full(ids.shape, np.nan, np.float32)
        if self.token_modality is None:
            self.token_modality = np.zeros(T, np.int8)
        if self.phase is None:
            self.phase = np.ones(S, np.int8)
        if self.step_request is None:
            self.step_request = np.zeros(S, np.int32)
        if self.pinned is None:
            self.pinned = np.zeros(L, bool)
        if self.kept is None:
            self.kept = np.ones(T, bool)
        self.kept = np.asarray(self.kept, bool)
        self.topk_weights = np.asarray(self.topk_weights, np.float32)
        self.token_modality = np.asarray(self.token_modality, np.int8)
        self.phase = np.asarray(self.phase, np.int8)
        self.step_request = np.asarray(self.step_request, np.int32)
        self.pinned = np.asarray(self.pinned, bool)
        for name, arr, shape in (("topk_weights", self.topk_weights, ids.shape),
                                 ("token_modality", self.token_modality, (T,)),
                                 ("phase", self.phase, (S,)), ("step_request", self.step_request, (S,)),
                                 ("pinned", self.pinned, (L,)), ("kept", self.kept, (T,))):
            if arr.shape != shape:
                raise InputError(f"trace {name} must have shape {shape}, got {arr.shape}")
        if self.pred_ids is not None:
            self.pred_ids = np.asarray(self.pred_ids, np.int16)
            if self.pred_ids.ndim != 4 or self.pred_ids.shape[:2] != (T, L):
                raise InputError(f"trace pred_ids must be [token, layer, depth, k] with "
                                 f"{T} tokens and {L} layers, got {self.pred_ids.shape}")
        if (self.predicted_ids is None) != (self.predicted_scores is None):
            raise InputError("trace predicted_ids and predicted_scores come together (both or "
                             "neither)")
        if self.predicted_ids is not None:
            self.predicted_ids = np.asarray(self.predicted_ids, np.int16)
            self.predicted_scores = np.asarray(self.predicted_scores, np.float32)
            for name, arr in (("predicted_ids", self.predicted_ids),
                              ("predicted_scores", self.predicted_scores)):
                if arr.ndim != 3 or arr.shape[:2] != (S, L):
                    raise InputError(f"trace {name} must be [step, layer, rank] with {S} steps "
                                     f"and {L} layers, got {arr.shape}")
            if self.predicted_scores.shape != self.predicted_ids.shape:
                raise InputError(f"trace predicted_scores must have the shape of predicted_ids "
                                 f"{self.predicted_ids.shape}, got {self.predicted_scores.shape}")
            bad = (self.predicted_ids < -1) | (self.predicted_ids >= self.num_experts)
            if bad.any():
                s_, l_, r_ = np.argwhere(bad)[0]
                raise InputError(f"trace predicted expert id {int(self.predicted_ids[s_, l_, r_])}"
                                 f" at step {s_}, layer {l_}, rank {r_} is outside "
                                 f"0..{self.num_experts - 1}")

    def predicted(self, step: int, layer: int) -> list[tuple[int, float]]:
        """The predictor's ranked ``(expert, score)`` pairs of y_layer in ``step`` (empty where
        it did not run, or the trace has no predictions)."""
        if self.predicted_ids is None:
            return []
        ids, sc = self.predicted_ids[step, layer], self.predicted_scores[step, layer]
        return [(int(e), float(s)) for e, s in zip(ids, sc) if e >= 0]

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.topk_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[2])

    @property
    def num_steps(self) -> int:
        return int(self.token_step[-1]) + 1 if len(self.token_step) else 0

    def __repr__(self) -> str:
        src = self.attrs.get("source", "?")
        return (f"Trace({src}: {self.num_steps} steps, {self.num_tokens} tokens, "
                f"{self.num_layers} layers × {self.num_experts} experts, top-{self.top_k})")

    # -- access order ----------------------------------------------------------------------
    def groups(self) -> "Groups":
        """The accesses in serving order, grouped per (step, layer) (see module docstring)."""
        T, L, K = self.topk_ids.shape
        E = self.num_experts
        step = np.broadcast_to(self.token_step[:, None, None], (T, L, K))
        layer = np.broadcast_to(np.arange(L)[None, :, None], (T, L, K))
        ids = self.topk_ids.astype(np.int64)
        valid = ids >= 0
        code = (step[valid].astype(np.int64) * L + layer[valid]) * E + ids[valid]
        space = self.num_steps * L * E
        if space <= 16 * max(code.size, 1):  # dense enough: counting beats sorting
            counts = np.bincount(code, minlength=space)
            uniq = np.flatnonzero(counts)
            ntok = counts[uniq]
        else:
            uniq, ntok = np.unique(code, return_counts=True)  # sorted: step, layer, expert
        g_code = uniq // E
        starts = np.flatnonzero(np.r_[True, g_code[1:] != g_code[:-1]]) if len(uniq) else \
            np.zeros(0, np.int64)
        ptr = np.r_[starts, len(uniq)].astype(np.int64)
        gc = g_code[starts]
        # tokens per step, and per group the tokens that reach its layer (dense work is priced
        # per token reaching the layer): all of the step's, except pruned tokens (kept False)
        # on the layers where they have no routing (behind the pinned prefix)
        step_tokens = np.bincount(self.token_step, minlength=self.num_steps).astype(np.int64)
        if self.kept.all():
            layer_tokens = step_tokens[gc // L]
        else:
            reach = self.kept[:, None] | (self.topk_ids >= 0).any(-1)  # [token, layer]
            sl = self.token_step.astype(np.int64)[:, None] * L + np.arange(L)[None, :]
            layer_tokens = np.bincount(sl[reach], minlength=self.num_steps * L)[gc]
        return Groups(step=(gc // L).astype(np.int32), layer=(gc % L).astype(np.int32),
                      ptr=ptr, expert=(uniq % E).astype(np.int32),
                      expert_tokens=ntok.astype(np.int32), step_tokens=step_tokens,
                      num_layers=L, num_experts=E,
                      layer_tokens=np.asarray(layer_tokens, np.int64))


@dataclass
class Groups:
    """Accesses grouped per (step, layer), CSR style: group ``g`` accesses
    ``expert[ptr[g]:ptr[g+1]]`` (ascending ids), routed to ``expert_tokens[...]`` tokens each.
    Groups are in serving order; a (step, layer) with no routed token has no group.
    ``step_tokens`` [step]: tokens per step; ``layer_tokens`` [group]: tokens of the group's
    step that reach its layer (fewer than ``step_tokens`` only behind the pinned prefix of a
    pruned prefill; None: the step's tokens)."""

    step: np.ndarray
    layer: np.ndarray
    ptr: np.ndarray
    expert: np.ndarray
    expert_tokens: np.ndarray
    step_tokens: np.ndarray
    num_layers: int
    num_experts: int
    layer_tokens: np.ndarray | None = None

    @property
    def num_groups(self) -> int:
        return len(self.step)

    @property
    def num_accesses(self) -> int:
        return len(self.expert)

    def keys(self) -> np.ndarray:
        """Flat cache key ``layer · E + expert`` of every access."""
        layer_of = np.repeat(self.layer, np.diff(self.ptr))
        return (layer_of.astype(np.int64) * self.num_experts + self.expert).astype(np.int64)
