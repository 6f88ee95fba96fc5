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
- ``subexpert_ran`` bool [token, layer, k, N] or None: MoE-Prism — the sub-experts of its expert
                                             each routed slot ran (only where ``topk_ids`` ≥ 0;
                                             None: whole experts, N = 1). Replay prices each
                                             expert's op by them, and :meth:`as_subexperts`
                                             makes the trace whose keys are the sub-experts.

Accesses are served in this order: step by step, layer 0 … L-1 within a step, and within a
(step, layer) *group* the distinct routed experts in ascending id order — the order the live
runtime looks them up in.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from workbench.errors import InputError
from workbench.traces import limits

_I16 = int(np.iinfo(np.int16).max)
_I32 = int(np.iinfo(np.int32).max)
_CHUNK_SLOTS = 1 << 18   # validation works on ~this many (token, layer, rank) slots at a time
#: (layer, expert) keys above which replay renumbers a trace's expert ids to those in use
#: (real models have at most ~10⁴: Qwen3-VL-30B 48 × 128)
COMPACT_KEYS = 1 << 20


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


def _distinct_experts(ids: np.ndarray) -> None:
    """One rule for every format: a token's experts at one layer are distinct (a router picks
    k different experts). Replay would count a repeated one twice. Checked chunk by chunk."""
    T, L, K = ids.shape
    if K < 2 or not T:
        return
    for a, b in _token_chunks(T, L * K):
        c = np.sort(ids[a:b], axis=-1)
        dup = (c[..., 1:] == c[..., :-1]) & (c[..., 1:] >= 0)
        if dup.any():
            t, layer, _ = (int(x) for x in np.argwhere(dup)[0])
            row = [int(x) for x in ids[a + t, layer]]
            raise InputError(f"trace token {a + t}, layer {layer}: expert ids {row} repeat; a "
                             f"token's experts at one layer are distinct (-1 = none may repeat)")


def _finite_or_none(w: np.ndarray) -> None:
    """One rule for every format: a combine weight is a finite float32, or NaN (none recorded);
    ±inf is refused (the JSON-lines reader refused it, the others passed it on). Replay never
    reads weights; analyses that sum them must not meet inf. Checked chunk by chunk."""
    if w.ndim != 3 or not w.size or (w.strides and all(st == 0 for st in w.strides)):
        return  # a constant view (no weights): nothing to check
    T, L, K = w.shape
    for a, b in _token_chunks(T, L * K):
        bad = np.isinf(w[a:b])
        if bad.any():
            t, layer, r = (int(x) for x in np.argwhere(bad)[0])
            raise InputError(f"trace token {a + t}, layer {layer}, rank {r}: weight "
                             f"{float(w[a + t, layer, r])} is not finite; weights are finite "
                             f"numbers, or NaN where none was recorded")


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
    subexpert_ran: np.ndarray | None = None

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
        _distinct_experts(self.topk_ids)
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
        _finite_or_none(self.topk_weights)
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

        if self.subexpert_ran is not None:
            ran = np.asarray(self.subexpert_ran)
            if ran.dtype != bool or ran.ndim != 4 or ran.shape[:3] != (T, L, K):
                raise InputError(f"trace subexpert_ran must be bool [token, layer, k, N] with "
                                 f"shape ({T}, {L}, {K}, N), got {ran.dtype} {ran.shape}")
            N = ran.shape[3]
            if not 1 <= N or E * N > _I16:
                raise InputError(f"trace subexpert_ran has {N} sub-experts an expert; "
                                 f"1 … {_I16 // E} allowed with {E} experts")
            for a, b in _token_chunks(T, L * K * N):
                if (ran[a:b] & (self.topk_ids[a:b, :, :, None] < 0)).any():
                    raise InputError("trace subexpert_ran marks a sub-expert of a slot routed "
                                     "to no expert (topk_ids -1)")
            self.subexpert_ran = ran if N > 1 else None

    @property
    def subexperts(self) -> int:
        """N, the sub-experts an expert has (MoE-Prism; 1: whole experts)."""
        return 1 if self.subexpert_ran is None else int(self.subexpert_ran.shape[3])

    def ran_experts(self) -> "Trace":
        """This trace with a routed expert that ran none of its sub-experts (a global K passed
        it over) removed from the token's slots (-1), as the live cache never looks it up;
        itself when every routed expert ran some."""
        if self.subexpert_ran is None:
            return self
        idle = np.zeros(self.topk_ids.shape, bool)
        for a, b in _token_chunks(self.topk_ids.shape[0], self.subexpert_ran[0].size or 1):
            idle[a:b] = (self.topk_ids[a:b] >= 0) & ~self.subexpert_ran[a:b].any(-1)
        if not idle.any():
            return self
        out = object.__new__(Trace)
        out.__dict__.update(self.__dict__)
        out.topk_ids = np.where(idle, np.int16(-1), self.topk_ids)
        return out

    def as_subexperts(self) -> "Trace":
        """The trace whose experts are this one's sub-experts: expert e's sub-expert s is id
        ``e·N + s`` of ``E·N``, a token's slot (layer, k) becoming the N slots (layer, k·N + s),
        -1 where it ran none. ``attrs["subexpert_of"]`` = N (replay prices such a trace's keys
        as parts of their experts). Lookahead and predictor outputs (of experts) are dropped."""
        N = self.subexperts
        if N == 1:
            raise InputError("this trace has no sub-experts (recorded without prism)")
        T, L, K = self.topk_ids.shape
        sub = np.full((T, L, K * N), -1, np.int16)
        for a, b in _token_chunks(T, L * K * N):  # bounded temporaries
            ids = self.topk_ids[a:b].astype(np.int16)[..., None] * np.int16(N) + np.arange(
                N, dtype=np.int16)
            sub[a:b] = np.where(self.subexpert_ran[a:b], ids, -1).reshape(b - a, L, K * N)
        out = object.__new__(Trace)
        out.__dict__.update(self.__dict__)
        out.topk_ids, out.num_experts = sub, self.num_experts * N
        out.topk_weights = _const(np.nan, sub.shape, np.float32)
        out.pred_ids = out.predicted_ids = out.predicted_scores = out.subexpert_ran = None
        out.attrs = {**self.attrs, "subexpert_of": N}
        return out

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

    # -- replay state ----------------------------------------------------------------------
    def compact_experts(self, max_keys: int = COMPACT_KEYS) -> "Trace":
        """This trace with its expert ids renumbered ``0 .. n-1`` in ascending order, ``n`` =
        the distinct ids its routing and recorded predictions use, when ``layers × experts``
        exceeds ``max_keys``; else itself.

        Replay keeps state per (layer, expert) key; a 52-byte file declaring expert 32766 of
        layer 4095 made it allocate 4096 × 32767 keys (8.4 GB). The renumbering keeps every
        key's order (ids ascending within a layer, layers in order), so every policy, tie and
        bound replays the same; results are per (step, layer), where ids do not appear.
        ``attrs["experts_compacted"]`` says what was done."""
        L, E = self.num_layers, self.num_experts
        if L * E <= max_keys:
            return self
        seen = np.zeros(E, bool)
        for arr in (self.topk_ids, self.pred_ids, self.predicted_ids):
            if arr is None or not arr.size:
                continue
            per = arr.size // max(arr.shape[0], 1)
            for a, b in _token_chunks(arr.shape[0], per):
                c = arr[a:b]
                seen[c[c >= 0]] = True
        used = np.flatnonzero(seen)
        if len(used) == E:
            return self
        # one past the end holds -1: an id of -1 (no expert) indexes it and stays -1
        lut = np.full(E + 1, -1, np.int16)
        lut[used] = np.arange(len(used), dtype=np.int16)

        def remap(arr: np.ndarray | None) -> np.ndarray | None:
            return None if arr is None else lut[np.asarray(arr)]

        return replace(
            self, topk_ids=remap(self.topk_ids), pred_ids=remap(self.pred_ids),
            predicted_ids=remap(self.predicted_ids), num_experts=max(1, len(used)),
            attrs={**self.attrs, "experts_compacted": f"{len(used)} expert ids in use of {E} "
                                                      f"declared, renumbered for replay"})

    def step_chunks(self, accesses: int) -> list[tuple[int, int]]:
        """Consecutive step ranges ``[(s0, s1), …]`` covering every step, each routing about
        ``accesses`` (token, layer, expert) slots (at least one step each: a step is never
        split). A streamed replay works through them one at a time."""
        S = self.num_steps
        if S == 0:
            return []
        ends = np.cumsum(routed_per_step(self.topk_ids, self.token_step, S))
        cuts = np.searchsorted(ends, np.arange(accesses, int(ends[-1]), accesses), "right") + 1
        bounds = np.unique(np.r_[0, np.minimum(cuts, S), S])
        return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def step_slice(self, s0: int, s1: int) -> "Trace":
        """Steps ``s0 .. s1-1`` as a trace of their own (steps renumbered from 0), sharing this
        trace's arrays (views; only ``token_step`` is new). Not checked again: its arrays are
        parts of this checked trace."""
        ts = self.token_step
        a, b = (int(x) for x in np.searchsorted(ts, [s0, s1], "left"))
        out = object.__new__(Trace)
        out.__dict__.update(self.__dict__)
        for name in ("topk_ids", "topk_weights", "token_modality", "pred_ids", "kept",
                     "subexpert_ran"):
            arr = getattr(self, name)
            setattr(out, name, None if arr is None else arr[a:b])
        out.token_step = (ts[a:b] - np.int32(s0)).astype(np.int32, copy=False)
        for name in ("phase", "step_request", "predicted_ids", "predicted_scores"):
            arr = getattr(self, name)
            setattr(out, name, None if arr is None else arr[s0:s1])
        return out

    # -- access order ----------------------------------------------------------------------
    def groups(self, max_bytes: Any = None) -> "Groups":
        """The accesses in serving order, grouped per (step, layer) (see module docstring).

        One compiled pass over the tokens (numba; :func:`_fill_groups`), O(tokens × layers ×
        k), writing into arrays sized once from an upper bound (per step: accesses ≤ min(routed
        slots, layers × experts), groups ≤ min(routed slots, layers)) and cut to size in place;
        its only other memory is O(layers × experts) of scratch. That bound must fit the memory
        budget (``max_bytes``, else ``WORKBENCH_TRACE_MAX_BYTES``, else 2 GiB:
        :mod:`workbench.traces.limits`), or :class:`InputError` says how much it needs."""
        T, L, K = self.topk_ids.shape
        E = self.num_experts
        S = self.num_steps
        LE = L * E
        routed_per_step, fill_groups = _group_kernels()
        step_tokens = np.bincount(self.token_step, minlength=S).astype(np.int64, copy=False)
        routed = np.zeros(S, np.int64)      # routed (token, layer, rank) slots per step
        if T:
            routed_per_step(self.topk_ids, self.token_step, routed)
        A_ub = int(np.minimum(routed, LE).sum())
        G_ub = int(np.minimum(routed, L).sum())
        del routed
        all_kept = bool(self.kept.all())
        limits.check(A_ub * 8 + G_ub * 24 + (16 * S * L if not all_kept else 0),
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
        g0 = a0 = 0
        if T:
            # a kept mask of all True (the common case, often a broadcast view) is not read
            kept = np.zeros(0, np.bool_) if all_kept else np.ascontiguousarray(self.kept)
            g0, a0 = fill_groups(self.topk_ids, self.token_step, kept, all_kept, E, step_tokens,
                                 step, layer, ptr, layer_tokens, expert, ntok,
                                 np.zeros(LE, np.int64), np.zeros(L * ((E + 63) // 64), np.uint64),
                                 np.zeros(L, np.int64), _DEBRUIJN)
        for arr, size in ((step, g0), (layer, g0), (ptr, g0 + 1), (layer_tokens, g0),
                          (expert, a0), (ntok, a0)):
            if arr.size != size:
                arr.resize(size, refcheck=False)
        return Groups(step=step, layer=layer, ptr=ptr, expert=expert, expert_tokens=ntok,
                      step_tokens=step_tokens, num_layers=L, num_experts=E,
                      layer_tokens=layer_tokens)


def routed_per_step(topk_ids: np.ndarray, token_step: np.ndarray, steps: int) -> np.ndarray:
    """int64 [steps]: the routed (id ≥ 0) (token, layer, k) slots of each step, ``topk_ids``
    int16 [T, L, K] and ``token_step`` int32 [T] in 0 … steps − 1 (unchecked: a trace's, or
    a caller's checked batch). One compiled pass (:func:`_routed_per_step`)."""
    routed = np.zeros(steps, np.int64)
    _group_kernels()[0](topk_ids, token_step, routed)
    return routed


def _routed_per_step(ids, token_step, routed):
    """``routed[s] +=`` the routed (id ≥ 0) slots of every token of step ``s``."""
    T, L, K = ids.shape
    for t in range(T):
        n = 0
        for l in range(L):
            for r in range(K):
                if ids[t, l, r] >= 0:
                    n += 1
        routed[token_step[t]] += n


# de Bruijn table: the index of the lowest set bit of a uint64 ``x`` is
# _DEBRUIJN[((x & -x) * _DEBRUIJN_MUL) >> 58] (numba has no count-trailing-zeros)
_DEBRUIJN_MUL = 0x03F79D71B4CB0A89
_DEBRUIJN = np.zeros(64, np.int64)
for _i in range(64):
    _DEBRUIJN[((((1 << _i) * _DEBRUIJN_MUL) & ((1 << 64) - 1)) >> 58)] = _i
del _i


def _fill_groups(ids, token_step, kept, all_kept, E, step_tokens, out_step, out_layer, out_ptr,
                 out_ltok, out_expert, out_ntok, cnt, seen, nr, debruijn):
    """Group ``ids`` [token, layer, k] (tokens in step order) per (step, layer): for each step,
    count every (layer, expert) it routes to (``cnt``) and mark it in the layer's bitmap
    ``seen`` (⌈E/64⌉ words per layer), then emit its layers in order, each a group of its
    distinct experts ascending (set bits, lowest first) with their counts, and the step's
    tokens less those that do not reach the layer (``kept`` False and no routing there).
    Scratch ``cnt``/``seen``/``nr`` are zero between steps. Returns (groups, accesses)."""
    T, L, K = ids.shape
    W = (E + 63) // 64
    mul = np.uint64(_DEBRUIJN_MUL)
    one = np.uint64(1)
    g0 = 0
    a0 = 0
    t = 0
    while t < T:
        s = token_step[t]
        t1 = t
        while t1 < T and token_step[t1] == s:
            t1 += 1
        for tok in range(t, t1):
            for l in range(L):
                base = l * E
                routed = False
                for r in range(K):
                    e = ids[tok, l, r]
                    if e >= 0:
                        routed = True
                        cnt[base + e] += 1
                        w = l * W + (e >> 6)
                        seen[w] |= one << np.uint64(e & 63)
                if not all_kept and not routed and not kept[tok]:
                    nr[l] += 1
        for l in range(L):
            a_start = a0
            base = l * E
            for w in range(l * W, l * W + W):
                x = seen[w]
                if x == 0:
                    continue
                seen[w] = 0
                e0 = (w - l * W) * 64
                while x:
                    low = x & (~x + one)
                    e = e0 + debruijn[np.int64((low * mul) >> np.uint64(58))]
                    out_expert[a0] = e
                    out_ntok[a0] = cnt[base + e]
                    cnt[base + e] = 0
                    a0 += 1
                    x ^= low
            if a0 > a_start:
                out_step[g0] = s
                out_layer[g0] = l
                out_ltok[g0] = step_tokens[s] - nr[l]
                out_ptr[g0 + 1] = a0
                g0 += 1
            nr[l] = 0
        t = t1
    return g0, a0


_KERNELS: tuple | None = None


def _group_kernels():
    """(:func:`_routed_per_step`, :func:`_fill_groups`) compiled by numba on first use (and
    cached on disk), so that importing traces does not import numba."""
    global _KERNELS
    if _KERNELS is None:
        from numba import njit

        jit = njit(cache=True, nogil=True, error_model="numpy", boundscheck=False)
        _KERNELS = (jit(_routed_per_step), jit(_fill_groups))
    return _KERNELS


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
        """Flat cache key ``layer · E + expert`` (int64) of every access. One array of the
        accesses' size, added to in place (the temporaries of a chained expression cost
        several times that in page faults: 0.05–0.7 s per 10 M accesses, measured)."""
        out = np.repeat(self.layer.astype(np.int64) * self.num_experts, np.diff(self.ptr))
        out += self.expert
        return out
