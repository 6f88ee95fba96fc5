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

import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workbench.errors import InputError
from workbench.traces import limits

_I16 = int(np.iinfo(np.int16).max)
_I32 = int(np.iinfo(np.int32).max)
_CHUNK_SLOTS = 1 << 18   # validation and grouping work on ~this many (token, layer, rank) slots


def _token_chunks(T: int, per_token: int):
    """``(a, b)`` token ranges of about :data:`_CHUNK_SLOTS` slots each (bounded temporaries)."""
    n = max(1, _CHUNK_SLOTS // max(per_token, 1))
    for a in range(0, T, n):
        yield a, min(T, a + n)


def _ints(arr: Any, dtype, name: str, lo: int | None = None, hi: int | None = None,
          shape_names: tuple[str, ...] | None = None) -> np.ndarray:
    """``arr`` as ``dtype`` after checking, chunk by chunk along the first axis, that it holds
    integers in ``lo..hi`` (default: the range of ``dtype``) — so nothing wraps around."""
    a = np.asarray(arr)
    if a.size and a.dtype.kind not in "iub":
        raise InputError(f"trace {name} must hold integers, got dtype {a.dtype}")
    info = np.iinfo(dtype)
    lo = int(info.min) if lo is None else lo
    hi = int(info.max) if hi is None else hi
    if a.size and a.dtype.kind != "b" and (int(np.iinfo(a.dtype).min) < lo
                                          or int(np.iinfo(a.dtype).max) > hi):
        per = a.size // max(a.shape[0], 1) if a.ndim else 1
        for s, e in _token_chunks(a.shape[0] if a.ndim else 1, per):
            c = a[s:e] if a.ndim else a
            bad = (c < lo) | (c > hi)
            if bad.any():
                at = np.argwhere(bad)[0] if a.ndim else ()
                idx = tuple(int(x) for x in at)
                val = int(c[idx]) if a.ndim else int(c)
                if a.ndim:
                    idx = (idx[0] + s, *idx[1:])
                names = shape_names or tuple(f"axis {i}" for i in range(a.ndim))
                where = ", ".join(f"{n} {i}" for n, i in zip(names, idx))
                raise InputError(f"trace {name} {val}" + (f" at {where}" if where else "")
                                 + f" is outside {lo}..{hi}")
    return a.astype(dtype, copy=False)


def _const(value: Any, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A read-only array of ``shape`` holding ``value`` everywhere, costing no memory."""
    return np.broadcast_to(np.asarray(value, dtype), shape)


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
        try:
            E = operator.index(self.num_experts)
        except TypeError:
            E = 0
        if isinstance(self.num_experts, bool) or not 1 <= E <= _I16:
            raise InputError(f"trace num_experts must be an integer in 1..{_I16}, got "
                             f"{limits.show(self.num_experts)}")
        self.num_experts = E
        ids = np.asarray(self.topk_ids)
        if ids.ndim != 3:
            raise InputError(f"trace topk_ids must be [token, layer, k], got shape {ids.shape}")
        T, L, K = ids.shape
        if T > _I32:
            raise InputError(f"a trace holds at most {_I32} tokens, this one {T}")
        self.topk_ids = _ints(ids, np.int16, "expert id", -1, E - 1, ("token", "layer", "rank"))
        ts = np.asarray(self.token_step)
        if ts.shape != (T,):
            raise InputError(f"trace token_step must have one entry per token ({T}), "
                             f"got shape {ts.shape}")
        if T and ts.dtype.kind == "f" and np.isfinite(ts).all() and (ts == np.round(ts)).all():
            ts = ts.astype(np.int64)   # whole numbers in a float array (e.g. an empty cumsum)
        if T and ts.dtype.kind not in "iu":
            raise InputError(f"trace token_step must hold integers, got dtype {ts.dtype}")
        if T:
            if ts[0] != 0:
                raise InputError("trace token_step must start at 0 and grow by 0 or 1 per token")
            for a, b in _token_chunks(T, 1):
                d = np.diff(ts[a:b + 1].astype(np.int64))
                if d.size and (d.min() < 0 or d.max() > 1):
                    raise InputError("trace token_step must start at 0 and grow by 0 or 1 per "
                                     "token")
        self.token_step = ts.astype(np.int32, copy=False)
        S = self.num_steps
        # absent arrays: constant read-only views (no memory), or small per-step arrays
        if self.topk_weights is None:
            self.topk_weights = _const(np.nan, ids.shape, np.float32)
        if self.token_modality is None:
            self.token_modality = _const(0, (T,), np.int8)
        if self.phase is None:
            self.phase = np.ones(S, np.int8)
        if self.step_request is None:
            self.step_request = np.zeros(S, np.int32)
        if self.pinned is None:
            self.pinned = np.zeros(L, bool)
        if self.kept is None:
            self.kept = _const(True, (T,), bool)
        self.kept = np.asarray(self.kept, bool)
        self.topk_weights = np.asarray(self.topk_weights, np.float32)
        self.token_modality = _ints(self.token_modality, np.int8, "token_modality")
        self.phase = _ints(self.phase, np.int8, "phase")
        self.step_request = _ints(self.step_request, np.int32, "step_request")
        self.pinned = np.asarray(self.pinned, bool)
        for name, arr, lo, hi in (("token_modality", self.token_modality, 0, 2),
                                  ("phase", self.phase, 0, 1)):
            if arr.size and (arr.min() < lo or arr.max() > hi):
                raise InputError(f"trace {name} holds {int(arr.min())}..{int(arr.max())}; "
                                 f"codes {lo}..{hi} are allowed")
        for name, arr, shape in (("topk_weights", self.topk_weights, ids.shape),
                                 ("token_modality", self.token_modality, (T,)),
                                 ("phase", self.phase, (S,)),
                                 ("step_request", self.step_request, (S,)),
                                 ("pinned", self.pinned, (L,)), ("kept", self.kept, (T,))):
            if arr.shape != shape:
                raise InputError(f"trace {name} must have shape {shape}, got {arr.shape}")
        if self.pred_ids is not None:
            pred = np.asarray(self.pred_ids)
            if pred.ndim != 4 or pred.shape[:2] != (T, L):
                raise InputError(f"trace pred_ids must be [token, layer, depth, k] with "
                                 f"{T} tokens and {L} layers, got {pred.shape}")
            self.pred_ids = _ints(pred, np.int16, "lookahead expert id", -1, E - 1,
                                  ("token", "layer", "depth", "rank"))
        if (self.predicted_ids is None) != (self.predicted_scores is None):
            raise InputError("trace predicted_ids and predicted_scores come together (both or "
                             "neither)")
        if self.predicted_ids is not None:
            p_ids = np.asarray(self.predicted_ids)
            self.predicted_scores = np.asarray(self.predicted_scores, np.float32)
            for name, arr in (("predicted_ids", p_ids),
                              ("predicted_scores", self.predicted_scores)):
                if arr.ndim != 3 or arr.shape[:2] != (S, L):
                    raise InputError(f"trace {name} must be [step, layer, rank] with {S} steps "
                                     f"and {L} layers, got {arr.shape}")
            if self.predicted_scores.shape != p_ids.shape:
                raise InputError(f"trace predicted_scores must have the shape of predicted_ids "
                                 f"{p_ids.shape}, got {self.predicted_scores.shape}")
            self.predicted_ids = _ints(p_ids, np.int16, "predicted expert id", -1, E - 1,
                                       ("step", "layer", "rank"))

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
    def groups(self, max_bytes: Any = None) -> "Groups":
        """The accesses in serving order, grouped per (step, layer) (see module docstring).

        Built chunk by chunk of tokens into arrays sized once from an upper bound (per step:
        accesses ≤ min(routed slots, layers × experts), groups ≤ min(routed slots, layers)), so
        peak memory is about the result plus one chunk; that bound must fit the memory budget
        (``max_bytes``, else ``WORKBENCH_TRACE_MAX_BYTES``, else 2 GiB:
        :mod:`workbench.traces.limits`), or :class:`InputError` says how much it needs."""
        T, L, K = self.topk_ids.shape
        E = self.num_experts
        S = self.num_steps
        LE = L * E
        step_tokens = np.bincount(self.token_step, minlength=S).astype(np.int64, copy=False)
        routed = np.zeros(S, np.int64)      # routed (token, layer, rank) slots per step
        for a, b in _token_chunks(T, L * K):
            st = self.token_step[a:b]
            s0 = int(st[0])
            nv = (self.topk_ids[a:b] >= 0).sum(axis=(1, 2))
            routed[s0:int(st[-1]) + 1] += np.bincount(st - s0, weights=nv).astype(np.int64)
        A_ub = int(np.minimum(routed, LE).sum())
        G_ub = int(np.minimum(routed, L).sum())
        del routed
        limits.check(A_ub * 8 + G_ub * 24 + (16 * S * L if not self.kept.all() else 0),
                     limits.budget(max_bytes), "trace replay",
                     f"the access groups of {self!r} (up to {A_ub} accesses in {G_ub} groups)")
        # sized by the bound; untouched pages of np.empty cost nothing, and the arrays are cut
        # to size in place at the end
        step = np.empty(G_ub, np.int32)
        layer = np.empty(G_ub, np.int32)
        ptr = np.empty(G_ub + 1, np.int64)
        ptr[0] = 0
        layer_tokens = np.empty(G_ub, np.int64)
        expert = np.empty(A_ub, np.int32)
        ntok = np.empty(A_ub, np.int32)
        all_kept = bool(self.kept.all())
        lay = np.arange(L, dtype=np.int64)
        nr_parts: list[tuple[np.ndarray, np.ndarray]] = []  # (step·L + layer, tokens) not reaching
        carry: tuple[np.ndarray, np.ndarray] | None = None
        g0 = a0 = 0

        def emit(u: np.ndarray, n: np.ndarray) -> None:
            nonlocal g0, a0
            g = u // E
            starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
            gc = g[starts]
            g1, a1 = g0 + gc.size, a0 + u.size
            s_ = gc // L
            step[g0:g1] = s_
            layer[g0:g1] = gc - s_ * L
            ptr[g0 + 1:g1 + 1] = a0 + np.r_[starts[1:], u.size]
            layer_tokens[g0:g1] = step_tokens[s_]
            expert[a0:a1] = u % E
            ntok[a0:a1] = n
            g0, a0 = g1, a1

        for a, b in _token_chunks(T, L * K):
            ids = self.topk_ids[a:b]
            st = self.token_step[a:b].astype(np.int64)
            valid = ids >= 0
            code = ((st[:, None, None] * L + lay[None, :, None]) * E + ids)[valid]
            u, n = _count(code)
            del code
            if carry is not None:  # the step the previous chunk ended in goes on here
                cut = int(np.searchsorted(u, carry[0][-1] // LE * LE + LE)) if carry[0].size \
                    else 0
                u, n = _merge(carry, (u[:cut], n[:cut]), (u[cut:], n[cut:]))
                carry = None
            if b < T and self.token_step[b] == self.token_step[b - 1]:
                cut = int(np.searchsorted(u, int(self.token_step[b - 1]) * LE))
                carry, u, n = (u[cut:], n[cut:]), u[:cut], n[:cut]
            if u.size:
                emit(u, n)
            if not all_kept:
                miss = ~self.kept[a:b, None] & ~valid.any(-1)   # [token, layer] not reached
                sl = (st[:, None] * L + lay[None, :])[miss]
                if sl.size:
                    nr_parts.append(_count(sl))
        if carry is not None and carry[0].size:
            emit(*carry)
        for arr, size in ((step, g0), (layer, g0), (ptr, g0 + 1), (layer_tokens, g0),
                          (expert, a0), (ntok, a0)):
            if arr.size != size:
                arr.resize(size, refcheck=False)
        # per group the tokens that reach its layer (dense work is priced per token reaching
        # the layer): all of the step's, except pruned tokens (kept False) on the layers where
        # they have no routing (behind the pinned prefix)
        if nr_parts:
            nr_code, nr_n = _count(np.concatenate([p[0] for p in nr_parts]),
                                   np.concatenate([p[1] for p in nr_parts]))
            nr_parts.clear()
            for a, b in _token_chunks(g0, 1):
                gc = step[a:b].astype(np.int64) * L + layer[a:b]
                i = np.minimum(np.searchsorted(nr_code, gc), len(nr_code) - 1)
                layer_tokens[a:b] -= np.where(nr_code[i] == gc, nr_n[i], 0)
        return Groups(step=step, layer=layer, ptr=ptr, expert=expert, expert_tokens=ntok,
                      step_tokens=step_tokens, num_layers=L, num_experts=E,
                      layer_tokens=layer_tokens)


def _count(code: np.ndarray, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct ``code`` values (int64) and how often each occurs (or the sum of
    ``weights``), counting densely when the codes are dense enough, else by sorting."""
    if not code.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lo, hi = int(code.min()), int(code.max())
    span = hi - lo + 1
    if span <= 16 * code.size:  # dense enough: counting beats sorting
        cnt = np.bincount(code - lo, weights=weights, minlength=span)
        u = np.flatnonzero(cnt)
        return u.astype(np.int64) + lo, cnt[u].astype(np.int64)
    if weights is None:
        u, n = np.unique(code, return_counts=True)
        return u.astype(np.int64), n.astype(np.int64)
    order = np.argsort(code, kind="stable")
    c = code[order]
    starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    return c[starts].astype(np.int64), np.add.reduceat(weights[order], starts).astype(np.int64)


def _merge(carry, head, tail) -> tuple[np.ndarray, np.ndarray]:
    """``carry`` and ``head`` (codes of the same step, each sorted and distinct) summed, then
    ``tail`` (later steps)."""
    u, n = _count(np.concatenate([carry[0], head[0]]), np.concatenate([carry[1], head[1]]))
    return np.concatenate([u, tail[0]]), np.concatenate([n, tail[1]])


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
