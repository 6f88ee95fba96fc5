"""Capacity-aware dispatch: which of each token's top-k expert assignments are kept, rerouted or
dropped when experts have a capacity (issue 14, §3). A registry (:data:`DISPATCH`, the
``dispatch`` knob), torch-free, one implementation run two ways: live, the offloader applies
:meth:`Dispatch.apply` to each MoE layer call's routing inside the real experts forward
(``workbench.runtime.offload``); trace replay applies it to a trace's routing before the cache
and EP replays (:func:`dispatch_trace`).

- ``topk`` — the router's choice unchanged (the unconstrained baseline; the default).
- ``capacity-drop`` — CAI-MoE *Token Drop* (He et al., arXiv 2503.05066): per (step, layer)
  every expert has capacity C = max(``min_capacity``, ⌈γ0 · T · k / E⌉) assignments, T the
  step's tokens routed at that layer; an overloaded expert keeps its C highest-scoring
  assignments and drops the rest.

**Order of an expert's assignments** (who is kept): router score (the trace's combine weight)
descending, then the slot's rank in the token's top-k (0 = the router's first choice), then
token index; a weight not recorded (NaN) sorts after every recorded one, so a trace without
weights is ordered by top-k rank, then token. Deterministic: same trace, same result.

Invariants (property-tested): kept + rerouted + dropped = assigned; no expert holds more than
its capacity in any (step, layer); a capacity no expert reaches changes nothing.

**Where capacity acts** (the ``capacity_scope`` knob, :data:`CAPACITY_SCOPES`; issue 39 §3):
``prefill`` dispatches the prefill steps only (phase 0) and leaves every decode step's routing
as the router chose it — CAI-MoE's released modeling files skip capacity when
``sequence_length == 1`` (docs/macs.md, *Where capacity acts*); ``all`` dispatches every step
(the workbench before the knob). One rule, :meth:`Dispatch.acts_on`, read by both the live stage
(:mod:`workbench.runtime.stages.dispatch`) and :func:`dispatch_trace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from workbench.policies.registry import Registry

#: the values of the ``capacity_scope`` knob: the steps capacity-aware dispatch acts on
CAPACITY_SCOPES = ("prefill", "all")
#: a step's phase (the run store's and the trace's ``phase``): 0 prefill, 1 decode
PREFILL, DECODE = 0, 1


def check_scope(scope: str) -> str:
    """``scope`` if it is one of :data:`CAPACITY_SCOPES`, else ValueError in one line."""
    if scope not in CAPACITY_SCOPES:
        raise ValueError(f"capacity_scope must be one of {', '.join(CAPACITY_SCOPES)}, "
                         f"not {scope!r}")
    return scope


@dataclass
class DispatchStats:
    """Assignment counts of a dispatch, summed over (step, layer) groups; ``by_modality``
    the same per modality code; ``max_expert_load_*`` the largest (step, layer, expert) load
    before and after (MACS's "max expert load")."""

    assigned: int = 0
    kept: int = 0
    rerouted: int = 0
    dropped: int = 0
    max_expert_load_before: int = 0
    max_expert_load_after: int = 0
    #: modality code → [assigned, dropped, rerouted]
    by_modality: dict[int, list[int]] = field(default_factory=dict)

    def result(self, names: tuple[str, ...]) -> dict[str, Any]:
        a = self.assigned
        out: dict[str, Any] = {
            "assigned": a, "kept": self.kept, "rerouted": self.rerouted, "dropped": self.dropped,
            "drop_rate": self.dropped / a if a else None,
            "reroute_rate": self.rerouted / a if a else None,
            "max_expert_load_before": self.max_expert_load_before,
            "max_expert_load_after": self.max_expert_load_after,
        }
        if len(self.by_modality) > 1:
            out["by_modality"] = {
                names[c] if c < len(names) else str(c): {
                    "assigned": v[0], "drop_rate": v[1] / v[0] if v[0] else None,
                    "reroute_rate": v[2] / v[0] if v[0] else None}
                for c, v in sorted(self.by_modality.items())}
        return out


class Dispatch:
    """Base of dispatch policies. :meth:`apply` gets one chunk of tokens (all layers) and
    returns the routing it dispatches; the base keeps everything (``topk``)."""

    name = ""
    needs: frozenset[str] = frozenset()
    #: decides per EP rank (reads ``ep_ranks`` and ``placement``): live, not with a placement
    #: that changes over the run (EPLB)
    per_rank = False
    #: changes the router's routing (False: the router's choice, :data:`ROUTER_CHOICE`)
    changes_routing = True
    #: may move an assignment to another expert (the run result counts reroutes)
    reroutes = False
    #: may add assignments beyond the router's top-k (the run result counts them)
    widens = False
    #: what the capacity the dashboard shows is, after "capacity per rank" ("": as set)
    capacity_note = ""
    #: the steps it acts on (:data:`CAPACITY_SCOPES`; set from the ``capacity_scope`` knob by
    #: :meth:`for_knobs`); "all" for a policy made directly, the behaviour before the knob
    capacity_scope = "all"

    def acts_on(self, phase: int) -> bool:
        """Whether the policy dispatches a step of ``phase`` (:data:`PREFILL` or
        :data:`DECODE`): the one place the scope is decided, live and in replay. Under
        ``prefill`` a decode step keeps the router's top-k."""
        return self.capacity_scope == "all" or int(phase) == PREFILL

    @classmethod
    def for_knobs(cls, ep: Any, seed: int = 0) -> "Dispatch":
        """:meth:`from_knobs` with the scope of ``ep`` (``capacity_scope``; absent: "all")."""
        pol = cls.from_knobs(ep, seed)
        pol.capacity_scope = check_scope(getattr(ep, "capacity_scope", "all"))
        return pol

    def apply(self, ids: np.ndarray, weights: np.ndarray, token_step: np.ndarray,
              num_experts: int, context: Any = None) -> np.ndarray:
        """``ids`` int16 [T, L, K] (-1: none), ``weights`` float32 [T, L, K] (NaN: none),
        ``token_step`` [T] non-decreasing (the chunk's steps): the dispatched ids, -1 where an
        assignment was dropped (a new array; ``ids`` is not changed). ``context``: a
        :class:`workbench.sim.macs.DispatchContext` (what else is known of the tokens), for
        the policies that use one."""
        return ids.copy()

    @classmethod
    def from_knobs(cls, ep: Any, seed: int = 0) -> "Dispatch":
        """The policy of a run: ``ep`` is its expert-parallel knob group
        (:class:`workbench.sim.knobs.ExpertParallelKnobs`, the dispatch's fields), ``seed``
        the run's. The base takes none of them."""
        return cls()

    def apply_weighted(self, ids: np.ndarray, weights: np.ndarray, token_step: np.ndarray,
                       num_experts: int, context: Any = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`apply` with the combine weights: ``(ids, weights, rerouted)`` — a dropped
        assignment's weight is 0, ``rerouted`` bool [T, L, K] marks assignments moved to
        another expert (whose new id and weight the arrays hold)."""
        new = self.apply(ids, weights, token_step, num_experts, context)
        w = np.where(new >= 0, weights, 0).astype(np.float32)
        return new, w, np.zeros(ids.shape, bool)

    def max_added(self, num_experts: int) -> int:
        """The most assignments a token may gain beyond the router's top-k (0: none)."""
        return 0

    @classmethod
    def live_only_knobs(cls, ep: Any) -> list[str]:
        """The knobs of ``ep`` (the expert-parallel group) switched on that need the model's
        features or router, which a trace does not record (trace replay refuses them)."""
        return []

    def calibration_needed(self) -> bool:
        """Whether the policy, as set, reads a calibration of the model's experts (MACS's
        classes and centroids, :mod:`workbench.macs.calibration`)."""
        return False

    def fits(self, max_load: int, tokens: int, top_k: int, num_experts: int) -> bool:
        """Whether a group of ``tokens`` tokens × ``top_k`` whose busiest expert has
        ``max_load`` assignments is kept whole (a shortcut the live path takes before
        :meth:`apply`; False: ask :meth:`apply`)."""
        return False


DISPATCH: Registry[Dispatch] = Registry("dispatch", knob="dispatch")
#: the policy that keeps the router's choice (the ``dispatch`` knob's default)
ROUTER_CHOICE = "topk"


@DISPATCH.register("topk")
class TopK(Dispatch):
    """The router's top-k unchanged: no capacity, nothing dropped."""

    changes_routing = False

    def fits(self, max_load, tokens, top_k, num_experts):
        return True


@DISPATCH.register("capacity-drop")
class CapacityDrop(Dispatch):
    """CAI-MoE Token Drop: C = max(min_capacity, ⌈γ0·T·k/E⌉) per expert and (step, layer);
    the lowest-scoring assignments beyond C are dropped (module docstring)."""

    def __init__(self, capacity_factor: float = 1.0, min_capacity: int = 1) -> None:
        self.capacity_factor = float(capacity_factor)
        self.min_capacity = int(min_capacity)

    @classmethod
    def from_knobs(cls, ep: Any, seed: int = 0) -> "CapacityDrop":
        return cls(ep.capacity_factor, ep.min_capacity)

    def capacity(self, tokens: np.ndarray, top_k: Any, num_experts: int) -> np.ndarray:
        """Capacity of every expert for groups of ``tokens`` routed tokens of ``top_k``
        assignments each (a number, or one per group), clipped to 2⁶² (no int64 wrap-around
        for any knob value)."""
        if isinstance(tokens, (int, np.integer)) and isinstance(top_k, (int, np.integer)):
            return np.int64(self.capacity_of(tokens, top_k, num_experts))
        c = np.ceil(self.capacity_factor * np.asarray(tokens, np.float64)
                    * np.asarray(top_k, np.float64) / num_experts)
        return np.minimum(np.maximum(c, self.min_capacity), 2.0 ** 62).astype(np.int64)

    def capacity_of(self, tokens: int, top_k: int, num_experts: int) -> int:
        """:meth:`capacity` of one group, in Python floats: the same IEEE products in the same
        order as the array form, without numpy's per-call cost (the live dispatch asks once
        per layer call)."""
        c = self.capacity_factor * float(tokens) * float(top_k) / num_experts
        return min(max(math.ceil(c), self.min_capacity), 2 ** 62) if c < 2.0 ** 62 else 2 ** 62

    def fits(self, max_load, tokens, top_k, num_experts):
        return max_load <= self.capacity_of(tokens, top_k, num_experts)

    def groups(self, ids: np.ndarray, token_step: np.ndarray, num_experts: int):
        """The chunk's (step, layer) groups that route a token, with their capacity:
        ``(a, b, layer column, group ids [b − a, K], C)`` (token rows a…b of one step)."""
        T, L, _ = ids.shape
        steps = np.asarray(token_step, np.int64)
        if T and (steps == steps[0]).all():  # one step (a live layer call): one run of rows
            bounds = (0, T)
        else:
            bounds = (np.concatenate(([0], np.flatnonzero(np.diff(steps)) + 1, [T])) if T
                      else np.zeros(2, np.int64))
        for a, b in zip(bounds[:-1], bounds[1:]):
            for li in range(L):
                g = ids[a:b, li]
                slots = (g >= 0).sum(1)  # the slots each token fills
                n_tok = int(np.count_nonzero(slots))
                if not n_tok:
                    continue
                k_used = int(slots.max())
                yield int(a), int(b), li, g, float(self.capacity_of(n_tok, k_used, num_experts))

    def apply(self, ids, weights, token_step, num_experts, context=None):
        T, L, K = ids.shape
        out = ids.copy()
        if T == 0:
            return out
        t, l, r = np.nonzero(ids >= 0)
        if not len(t):
            return out
        e = ids[t, l, r].astype(np.int64)
        w = weights[t, l, r].astype(np.float64)
        steps = np.asarray(token_step, np.int64)
        steps = steps - steps.min()  # the chunk's steps from 0 (one base for every index)
        s = steps[t]
        nan = np.isnan(w)
        w = np.where(nan, 0.0, w)
        # group (step, layer, expert); within it: score desc (NaN last), top-k rank, token
        seg = (s * L + l) * num_experts + e
        order = np.lexsort((t, r, -w, nan, seg))
        seg_sorted = seg[order]
        start = np.r_[0, np.flatnonzero(np.diff(seg_sorted)) + 1]
        pos = np.arange(len(order)) - np.repeat(start, np.diff(np.r_[start, len(order)]))
        # per (step, layer): the tokens routed there (any assignment) and the k the router
        # used (the most slots any of them fills: a trace is padded to its widest k, e.g.
        # dynamic top-k's k_max, while a prefill routes top-k)
        n_slots = (ids >= 0).sum(axis=2)  # [T, L]
        n_steps = int(steps.max()) + 1
        per_sl = np.zeros((n_steps, L), np.int64)
        np.add.at(per_sl, steps, (n_slots > 0).astype(np.int64))
        k_used = np.zeros((n_steps, L), np.int64)
        np.maximum.at(k_used, steps, n_slots)
        cap = self.capacity(per_sl, k_used, num_experts)  # [steps, L]
        sl = seg_sorted // num_experts
        drop = pos >= cap.reshape(-1)[sl]
        d = order[drop]
        out[t[d], l[d], r[d]] = -1
        return out


@DISPATCH.register("capacity-expanded")
class CapacityExpanded(CapacityDrop):
    """CAI-MoE *Expanded Drop* (He et al., arXiv 2503.05066; code CASE-Lab-UMD/
    Capacity-Aware-MoE, ``expanded_token_drop``): every token's candidates are its top-k plus
    **every expert of its local device**; then **every** expert keeps its C = max(min_capacity,
    ⌈γ0·T·k/E⌉) highest-probability candidates (not only overloaded ones: an under-loaded
    local expert is filled up to C with extra tokens). A token keeps the experts that kept it:
    from none to k + the experts per rank. Combine weights are the router probabilities of the
    kept pairs, renormalised over them when the router renormalises its top-k (the code:
    ``norm_topk_prob``). The local device of a token: the group's tokens spread evenly over
    the ``ep_ranks`` ranks in order (one rank: every expert is local — the public code's
    single-process runs, i.e. expert-choice routing). Needs every expert's router probability:
    live only."""

    needs = frozenset({"router"})
    per_rank = True
    widens = True

    def __init__(self, capacity_factor: float = 1.0, min_capacity: int = 1, ep_ranks: int = 1,
                 placement: str = "contiguous") -> None:
        super().__init__(capacity_factor, min_capacity)
        self.ep_ranks, self.placement = int(ep_ranks), str(placement)
        self.added = 0

    @classmethod
    def from_knobs(cls, ep: Any, seed: int = 0) -> "CapacityExpanded":
        return cls(ep.capacity_factor, ep.min_capacity, ep.ep_ranks, ep.placement)

    def max_added(self, num_experts):
        return -(-num_experts // self.ep_ranks)  # every expert of the token's rank

    def fits(self, max_load, tokens, top_k, num_experts):
        return False  # under-loaded experts take extra tokens: every group changes

    def apply(self, ids, weights, token_step, num_experts, context=None):
        return self.apply_weighted(ids, weights, token_step, num_experts, context)[0]

    def apply_weighted(self, ids, weights, token_step, num_experts, context=None):
        """As :meth:`Dispatch.apply_weighted`, but the last axis widens to K + M: the first K
        columns are the token's own slots (-1 where lost), then the experts it gained."""
        from workbench.sim.placement import rank_of_expert

        if context is None or context.gates is None:
            raise ValueError("capacity-expanded needs every expert's router probability "
                             "(live runs only)")
        T, L, K = ids.shape
        ranks = rank_of_expert(self.placement, num_experts, self.ep_ranks)
        parts: list[tuple[int, int, int, np.ndarray, np.ndarray]] = []
        width = K
        for a, b, li, g, cap in self.groups(ids, token_step, num_experts):
            g = np.asarray(g, np.int64)
            w = np.asarray(weights[a:b, li], np.float64)
            rows = (g >= 0).any(1)
            # the router renormalises its top-k when the kept weights of a token sum to 1
            renorm = bool(np.allclose(np.where(g >= 0, np.nan_to_num(w), 0).sum(1)[rows],
                                      1.0, atol=1e-3))
            new, nw = expanded_group(g, context.gates[a:b, li], cap, ranks, renorm)
            parts.append((a, b, li, new, nw))
            width = max(width, new.shape[1])
        out = np.full((T, L, width), -1, np.int16)
        out_w = np.zeros((T, L, width), np.float32)
        out[:, :, :K] = ids
        out_w[:, :, :K] = np.where(ids >= 0, np.nan_to_num(weights), 0)
        for a, b, li, new, nw in parts:
            out[a:b, li, :] = -1
            out_w[a:b, li, :] = 0
            out[a:b, li, :new.shape[1]] = new
            out_w[a:b, li, :new.shape[1]] = nw
        self.added += int((out[:, :, K:] >= 0).sum())
        return out, out_w, np.zeros(out.shape, bool)


def expanded_group(ids: np.ndarray, gates: np.ndarray, capacity: float,
                   rank_of_expert: np.ndarray, renormalise: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    """CAI-MoE *Expanded Drop* on one (step, layer) group (see :class:`CapacityExpanded`).
    ``ids`` int [T, K] (-1: none; a row of -1 is no token), ``gates`` float [T, E] every
    expert's router probability. Returns ``(ids [T, K + M], weights [T, K + M])``: the first
    K columns the token's own slots (the expert, or -1 where it lost it), then the experts it
    gained (-1 padding); weights are router probabilities, renormalised over the kept experts
    when the router renormalises its top-k (``renormalise``)."""
    T, K = ids.shape
    E = gates.shape[1]
    real = (ids >= 0).any(1)
    cand = np.zeros((T, E), bool)
    t, r = np.nonzero(ids >= 0)
    cand[t, ids[t, r]] = True
    R = int(rank_of_expert.max()) + 1 if len(rank_of_expert) else 1
    pos = np.cumsum(real) - 1  # each real token's position among the group's tokens
    n = int(real.sum())
    src = (pos * R) // max(n, 1)  # tokens spread evenly over the ranks, in order
    cand |= real[:, None] & (rank_of_expert[None, :] == src[:, None])
    # each expert keeps its C highest-probability candidates (ties: token order)
    score = np.where(cand, np.asarray(gates, np.float64), -np.inf)
    order = np.argsort(-score, axis=0, kind="stable")
    rank_in = np.empty_like(order)
    np.put_along_axis(rank_in, order, np.arange(T)[:, None].repeat(E, 1), axis=0)
    keep = cand & (rank_in < capacity)
    own = np.where(ids >= 0, ids, 0)
    kept_own = (ids >= 0) & keep[np.arange(T)[:, None], own]
    new_own = np.where(kept_own, ids, -1)
    gained = keep.copy()
    gained[t, ids[t, r]] = False
    M = int(gained.sum(1).max()) if T else 0
    extra = np.full((T, M), -1, np.int64)
    if M:
        g_score = np.where(gained, gates, -np.inf)
        top = np.argsort(-g_score, axis=1, kind="stable")[:, :M]
        ok = np.take_along_axis(gained, top, 1)
        extra = np.where(ok, top, -1)
    new = np.concatenate([new_own, extra], 1)
    w = np.where(new >= 0, np.take_along_axis(np.asarray(gates, np.float64),
                                              np.maximum(new, 0), 1), 0.0)
    if renormalise:
        s = w.sum(1, keepdims=True)
        w = np.where(s > 0, w / np.where(s > 0, s, 1), 0.0)
    return new, w


@DISPATCH.register("macs")
class Macs(CapacityDrop):
    """MACS (seed 002 §3, :mod:`workbench.sim.macs`): semantic (entropy-weighted) load,
    modality-aware capacity from the calibrated expert classes, local semantic rerouting,
    fail-safe drop; each a switch, so SC, +SL, +DC, +SR (seed Table 2) are settings, and the
    token selection one of seed Table 3's strategies. Groups are (step, layer) as for Token
    Drop. ``classes`` int8 [layers, E] (m_j; None: the context's, else every expert shared).
    ``rerouted``/``dropped`` count what :meth:`apply_weighted` did, over its calls."""

    per_rank = True
    reroutes = True
    capacity_note = " (base, before MACS's scaling)"

    def __init__(self, capacity_factor: float = 1.0, min_capacity: int = 1,
                 macs_delta: float = 1.5, macs_rho: float = 0.6, macs_eta: float = 0.5,
                 macs_semantic_load: bool = True, macs_dynamic_capacity: bool = True,
                 macs_reroute: bool = True, macs_selection: str = "entropy", seed: int = 0,
                 ep_ranks: int = 1, placement: str = "contiguous",
                 classes: np.ndarray | None = None) -> None:
        super().__init__(capacity_factor, min_capacity)
        self.delta, self.rho, self.eta = float(macs_delta), float(macs_rho), float(macs_eta)
        self.semantic_load = bool(macs_semantic_load)
        self.dynamic_capacity = bool(macs_dynamic_capacity)
        self.reroute = bool(macs_reroute)
        self.selection = str(macs_selection)
        self.seed = int(seed)
        self.ep_ranks, self.placement = int(ep_ranks), str(placement)
        self.classes = None if classes is None else np.asarray(classes, np.int8)
        self.rerouted = 0
        self.dropped = 0
        self.last_weights: np.ndarray | None = None
        #: the rank of each expert, by the number of experts (int64 [E])
        self._ranks: dict[int, np.ndarray] = {}

    @classmethod
    def live_only_knobs(cls, ep: Any) -> list[str]:
        """+SL reads the model's features, +SR every expert's router probability."""
        return [n for n in ("macs_semantic_load", "macs_reroute") if getattr(ep, n)]

    def calibration_needed(self) -> bool:
        """Dynamic capacity reads the calibrated expert classes, rerouting (η > 0) their
        centroids."""
        return self.dynamic_capacity or (self.reroute and self.eta > 0)

    @classmethod
    def from_knobs(cls, ep: Any, seed: int = 0) -> "Macs":
        return cls(ep.capacity_factor, ep.min_capacity, ep.macs_delta, ep.macs_rho, ep.macs_eta,
                   ep.macs_semantic_load, ep.macs_dynamic_capacity, ep.macs_reroute,
                   ep.macs_selection, seed, ep.ep_ranks, ep.placement)

    def fits(self, max_load, tokens, top_k, num_experts):
        # semantic weights are ≤ 1 (effective load ≤ count); the smallest capacity a dynamic
        # one can give is C_base·(1 − ρ/2)
        c = float(self.capacity_of(tokens, top_k, num_experts))
        if self.dynamic_capacity:
            c = max(float(self.min_capacity), c * (1.0 - 0.5 * abs(self.rho)))
        return max_load <= c

    def apply(self, ids, weights, token_step, num_experts, context=None):
        return self.apply_weighted(ids, weights, token_step, num_experts, context)[0]

    def apply_weighted(self, ids, weights, token_step, num_experts, context=None):
        from workbench.sim.macs import macs_group, semantic_weights
        from workbench.sim.placement import rank_of_expert

        T, L, K = ids.shape
        out = ids.copy()
        # every group that routes a token is written whole below; one that routes none keeps
        # its -1 ids and weight 0 (what nan_to_num'd weights where ids >= 0 would give it)
        out_w = np.zeros(ids.shape)
        rer = np.zeros(ids.shape, bool)
        if T == 0:
            return out, out_w.astype(np.float32), rer
        mod = (np.zeros(T, np.int8) if context is None else np.asarray(context.modality))
        layers = (np.arange(L) if context is None else np.asarray(context.layers))
        classes = self.classes if self.classes is not None else (
            None if context is None else context.expert_class)
        ranks = self._ranks.get(num_experts)
        if ranks is None:  # one placement a policy: built once, not per layer call
            ranks = self._ranks[num_experts] = rank_of_expert(self.placement, num_experts,
                                                              self.ep_ranks)
        if self.semantic_load and context is not None and context.features_entropy is not None:
            w_all = semantic_weights(context.features_entropy, mod, context.image_of,
                                     self.delta, context.image_groups)
        else:
            w_all = np.ones((T, L))
        #: the semantic weights w(x) [T, L] of the last call (the effective load's units)
        self.last_weights = w_all
        steps = np.asarray(token_step, np.int64)
        for a, b, li, g_ids, c_base in self.groups(ids, token_step, num_experts):
            cls = None if classes is None else classes[int(layers[li])]
            new, nw, rr, _ = macs_group(
                g_ids, np.asarray(weights[a:b, li], np.float64), w_all[a:b, li],
                mod[a:b], cls, c_base, rho=self.rho,
                dynamic_capacity=self.dynamic_capacity, min_capacity=self.min_capacity,
                selection=self.selection, seed=self.seed + int(steps[a]) * 7919 + li,
                reroute=self.reroute, rank_of_expert=ranks,
                gates=None if context is None or context.gates is None
                else context.gates[a:b, li],
                affinity=None if context is None or context.affinity is None
                else context.affinity[a:b, li],
                eta=self.eta, num_experts=num_experts)
            out[a:b, li] = new
            out_w[a:b, li] = nw
            rer[a:b, li] = rr
        self.rerouted += int(rer.sum())
        self.dropped += int(((ids >= 0) & (out < 0)).sum())
        return out, out_w.astype(np.float32), rer


def _segments(ids: np.ndarray, token_step: np.ndarray, num_experts: int):
    """``(distinct (step, layer, expert) cells, their assignment counts)`` of a chunk, cells as
    ``(step · L + layer) · E + expert`` with steps from the chunk's first: O(assignments)
    memory (a dense count over steps × layers × experts could be gigabytes for a small file
    declaring a large E)."""
    t, l, r = np.nonzero(ids >= 0)
    if not len(t):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    steps = np.asarray(token_step, np.int64)
    s = steps[t] - steps.min()
    seg = (s * ids.shape[1] + l) * num_experts + ids[t, l, r].astype(np.int64)
    return np.unique(seg, return_counts=True)


def _expert_loads(ids: np.ndarray, token_step: np.ndarray, num_experts: int) -> int:
    """The largest (step, layer, expert) assignment count of a chunk."""
    _, counts = _segments(ids, token_step, num_experts)
    return int(counts.max()) if len(counts) else 0


def dispatch_trace(trace: Any, policy: Dispatch, chunk_accesses: int = 1 << 20):
    """``(dispatched trace, DispatchStats)``: ``trace``'s routing through ``policy``, chunk of
    steps by chunk (capacity is per (step, layer): chunks never split a step). The new trace
    shares every array but ``topk_ids``; ``topk`` returns the trace itself."""
    stats = DispatchStats()
    if isinstance(policy, TopK) or type(policy) is Dispatch:
        a = int((np.asarray(trace.topk_ids) >= 0).sum())
        stats.assigned = stats.kept = a
        return trace, stats
    E = trace.num_experts
    out_ids = np.empty_like(trace.topk_ids)
    ts = np.asarray(trace.token_step)
    mod = np.asarray(trace.token_modality)
    context = _replay_context(trace, policy)
    phase = np.asarray(trace.phase)
    for s0, s1 in trace.step_chunks(chunk_accesses):
        a, b = (int(x) for x in np.searchsorted(ts, [s0, s1], "left"))
        ids = trace.topk_ids[a:b]
        # the steps the scope dispatches (Dispatch.acts_on); the others keep their routing
        acts = np.array([policy.acts_on(p) for p in (0, 1)])[
            np.clip(phase[ts[a:b]], 0, 1).astype(np.int64)]
        new, rer = ids.copy(), np.zeros(ids.shape, bool)
        rows = np.flatnonzero(acts)
        if len(rows):
            ctx = None if context is None else replace(context, modality=mod[a:b][rows])
            sub, _, sub_rer = policy.apply_weighted(
                ids[rows], np.asarray(trace.topk_weights[a:b])[rows], ts[a:b][rows], E, ctx)
            new[rows], rer[rows] = sub[:, :, :ids.shape[2]], sub_rer[:, :, :ids.shape[2]]
        out_ids[a:b] = new
        before, after = ids >= 0, new >= 0
        n_before, n_after = int(before.sum()), int(after.sum())
        stats.assigned += n_before
        stats.kept += n_after - int(rer.sum())
        stats.rerouted += int(rer.sum())
        stats.dropped += n_before - n_after
        stats.max_expert_load_before = max(stats.max_expert_load_before,
                                           _expert_loads(ids, ts[a:b], E))
        stats.max_expert_load_after = max(stats.max_expert_load_after,
                                          _expert_loads(new, ts[a:b], E))
        per_tok_before = before.sum(axis=(1, 2))
        per_tok_drop = per_tok_before - after.sum(axis=(1, 2))
        per_tok_rer = rer.sum(axis=(1, 2))
        for c in np.unique(mod[a:b]):
            m = mod[a:b] == c
            v = stats.by_modality.setdefault(int(c), [0, 0, 0])
            v[0] += int(per_tok_before[m].sum())
            v[1] += int(per_tok_drop[m].sum())
            v[2] += int(per_tok_rer[m].sum())
    out = trace.step_slice(0, trace.num_steps)
    out.topk_ids = out_ids
    out.attrs = {**trace.attrs, "dispatch": policy.name}
    return out, stats


def _replay_context(trace: Any, policy: Dispatch):
    """What replay knows of a trace's tokens for ``policy``: modality and layers; a MACS
    without a calibration of its own takes its expert classes from the trace itself
    (in-sample, said in the replay's output)."""
    if not isinstance(policy, Macs):
        return None
    from workbench.sim.macs import DispatchContext

    classes = None
    if policy.classes is None and policy.dynamic_capacity:
        classes = trace_expert_classes(trace)[0]
    return DispatchContext(modality=np.zeros(0, np.int8), layers=np.arange(trace.num_layers),
                           expert_class=classes)


def trace_expert_classes(trace: Any, threshold: float = 0.1,
                         chunk_accesses: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """MACS expert classes ``(m, Δ)`` [L, E] from a trace's own routing (every token, by
    modality; :func:`workbench.sim.macs.expert_classes`), chunk by chunk."""
    from workbench.sim.macs import expert_classes

    L, E = trace.num_layers, trace.num_experts
    M = 3
    routed = np.zeros((L, E, M), np.int64)
    tokens = np.zeros(M, np.int64)
    ts = np.asarray(trace.token_step)
    mod = np.clip(np.asarray(trace.token_modality, np.int64), 0, M - 1)
    for s0, s1 in trace.step_chunks(chunk_accesses):
        a, b = (int(x) for x in np.searchsorted(ts, [s0, s1], "left"))
        ids = np.asarray(trace.topk_ids[a:b], np.int64)
        t, l, r = np.nonzero(ids >= 0)
        np.add.at(routed, (l, ids[t, l, r], mod[a:b][t]), 1)
        tokens += np.bincount(mod[a:b], minlength=M)
    return expert_classes(routed, tokens, threshold)


def check_capacity(ids: np.ndarray, token_step: np.ndarray, num_experts: int,
                   capacity: Any) -> None:
    """Raise AssertionError naming the first (step, layer, expert) over ``capacity`` (an array
    [steps, layers] or a number): the invariant the property tests hold."""
    L = ids.shape[1]
    cells, cnt = _segments(ids, token_step, num_experts)
    cap = np.asarray(capacity)
    limit = cap.reshape(-1)[cells // num_experts] if cap.ndim else cap
    over = np.flatnonzero(cnt > limit)
    if len(over):
        i, c = int(cells[over[0]]), int(cnt[over[0]])
        raise AssertionError(f"step {i // num_experts // L}, layer {i // num_experts % L}, "
                             f"expert {i % num_experts}: {c} assignments over capacity")


__all__ = ["DISPATCH", "CAPACITY_SCOPES", "PREFILL", "DECODE", "check_scope", "Dispatch", "TopK",
           "CapacityDrop", "CapacityExpanded", "Macs",
           "expanded_group", "trace_expert_classes", "DispatchStats", "dispatch_trace",
           "check_capacity"]
