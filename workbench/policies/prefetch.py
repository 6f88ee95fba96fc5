"""Prefetch policies: which experts to start copying before a layer asks for them.

A policy is asked once per (step, layer) group, right after that layer's router ran, for an
ordered list of ``(layer, expert)`` candidates for the next ``prefetch_lead`` layers; the cache
loads them in that order (skipping resident ones) up to ``prefetch_budget`` per group, behind the
layer's own demand misses on the transfer lane. What a policy may look at is in
:class:`PrefetchContext`: the recorded router lookahead (``pred``), the previous step's routing
(``previous``) or, for the oracle bound only, the true future (``future``).

Register a new policy with ``@PREFETCH.register("name")``; it then appears in the ``prefetch``
knob's menu, the dashboard and ``--set prefetch=name``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import numpy as np

from workbench.errors import KnobError
from workbench.policies.registry import NeedsFlag, Registry, declared_kwargs


@dataclass
class PrefetchContext:
    """What a prefetch policy sees at one (step, layer) group.

    ``pred(d)``: experts the router of layer ``layer + d`` picks on this layer's hidden states,
    most-routed first (d ≥ 1; empty past the last layer or when the trace has no lookahead).
    ``previous(l)``: experts layer ``l`` used in the previous step, most-routed first.
    ``future(d)``: experts layer ``layer + d`` will really use in this step (oracle only).
    ``predicted()``: the lookahead predictor's ranked ``(expert, score)`` pairs of y_layer
    (score σ(y) ∈ [0, 1]); ``None`` where the caller has none (a policy may then use its own
    live source, see :mod:`workbench.predictor.policy`).
    """

    step: int
    layer: int
    num_layers: int
    lead: int
    pred: Callable[[int], list[int]]
    previous: Callable[[int], list[int]]
    future: Callable[[int], list[int]]
    predicted: Callable[[], list[tuple[int, float]]] | None = None


class PrefetchPolicy(ABC):
    name: str = "abstract"
    #: what the policy needs: "pred_ids" (recorded router lookahead), "predicted_ids" (recorded
    #: predictor outputs; live: the predictor) or "future" (trace replay only)
    needs: frozenset[str] = frozenset()
    needs_future = NeedsFlag("future")
    #: False: the policy never fetches ahead (on demand only)
    fetches = True

    def __init__(self) -> None:
        """The knobs a policy takes are its ``__init__``'s keyword parameters (see
        :mod:`workbench.policies.registry`); the base takes none."""

    @classmethod
    def from_knobs(cls, knobs) -> "PrefetchPolicy":
        """The policy of a run of ``knobs`` (a :class:`~workbench.knobs.Knobs`): a policy that
        takes knobs reads its group's fields; the base gives ``__init__`` the knobs it declares
        (:func:`~workbench.policies.registry.declared_kwargs`)."""
        return cls(**declared_kwargs(cls, knobs))

    @abstractmethod
    def candidates(self, ctx: PrefetchContext) -> list[tuple[int, int]]:
        """Ordered ``(layer, expert)`` pairs to fetch now (may include resident ones)."""


PREFETCH: Registry[PrefetchPolicy] = Registry("prefetch", knob="prefetch")


def _ahead(ctx: PrefetchContext, depths: range, source: Callable[[int], list[int]]
           ) -> list[tuple[int, int]]:
    return [(ctx.layer + d, e) for d in depths if ctx.layer + d < ctx.num_layers
            for e in source(d)]


@PREFETCH.register("none")
class NoPrefetch(PrefetchPolicy):
    """On demand only: an expert is copied when a layer routes to it and finds it missing."""

    fetches = False

    def candidates(self, ctx: PrefetchContext) -> list[tuple[int, int]]:
        return []


@PREFETCH.register("speculative")
class NextLayerSpeculation(PrefetchPolicy):
    """Mixtral-offloading style: the next layer's router applied to this layer's hidden state
    names the experts to fetch for the next layer (one layer ahead, whatever the lead)."""

    needs = frozenset({"pred_ids"})
    source, depths = "pred", staticmethod(lambda lead: range(1, 2))

    def candidates(self, ctx: PrefetchContext) -> list[tuple[int, int]]:
        return _ahead(ctx, range(1, 2), ctx.pred)


@PREFETCH.register("apex")
class RouterGuidedMultiLayer(PrefetchPolicy):
    """Aggressive router-guided prefetch (MoE-APEX-like): the routers of the next
    ``prefetch_lead`` layers applied to this layer's hidden state, nearest layer first."""

    needs = frozenset({"pred_ids"})
    source, depths = "pred", staticmethod(lambda lead: range(1, lead + 1))

    def candidates(self, ctx: PrefetchContext) -> list[tuple[int, int]]:
        return _ahead(ctx, range(1, ctx.lead + 1), ctx.pred)


@PREFETCH.register("previous-step")
class PreviousStep(PrefetchPolicy):
    """Temporal locality: fetch what the next ``prefetch_lead`` layers used in the previous
    step (needs no lookahead, so it works on any trace)."""

    source, depths = "previous", staticmethod(lambda lead: range(1, lead + 1))

    def candidates(self, ctx: PrefetchContext) -> list[tuple[int, int]]:
        return _ahead(ctx, range(1, ctx.lead + 1), lambda d: ctx.previous(ctx.layer + d))


@PREFETCH.register("oracle")
class Oracle(PrefetchPolicy):
    """The bound for any prefetcher: knows the true experts of the next ``prefetch_lead`` layers
    (of this step). Replay only."""

    needs = frozenset({"future"})
    source, depths = "future", staticmethod(lambda lead: range(1, lead + 1))

    def candidates(self, ctx: PrefetchContext) -> list[tuple[int, int]]:
        return _ahead(ctx, range(1, ctx.lead + 1), ctx.future)


def ranked_ids(ids: np.ndarray) -> list[int]:
    """Distinct expert ids (≥ 0) of ``ids``, most-routed first, ties by id."""
    ids = np.asarray(ids)
    ids = ids[ids >= 0]
    if ids.size == 0:
        return []
    u, c = np.unique(ids, return_counts=True)
    return u[np.lexsort((u, -c))].tolist()


def select(candidates, pinned, num_layers: int, num_experts: int, budget: int | None
           ) -> list[int]:
    """Keys ``layer · E + expert`` of ``candidates`` in order: duplicates, pinned layers and
    layers past the last dropped, at most ``budget`` (None: all)."""
    seen: set[int] = set()
    keys: list[int] = []
    if budget is not None and budget < 1:
        return keys
    for layer, e in candidates:
        k = layer * num_experts + e
        if layer < num_layers and not pinned[layer] and k not in seen:
            seen.add(k)
            keys.append(k)
            if budget is not None and len(keys) >= budget:
                break
    return keys


def plan_prefetch(policy: PrefetchPolicy, trace, groups, pinned: np.ndarray, lead: int,
                  budget: int | None, step_offset: int = 0, first_group: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Ask ``policy`` at every group of ``trace`` (a :class:`~workbench.traces.trace.Trace`);
    returns CSR ``(ptr[G+1], keys)`` with keys ``layer · E + expert``, at most ``budget`` per
    group (None: unlimited), duplicates and ``pinned`` (always resident) layers removed, order
    kept. ``ctx.predicted`` serves the trace's recorded predictor outputs (when it has them).
    A policy's ``default_budget`` (if any) stands in for ``budget`` None, as live.
    ``step_offset``: ``trace`` is a slice of a longer one starting at that step
    (:meth:`Trace.step_slice`); ``ctx.step`` is the step in the whole trace, as live.
    ``first_group``: groups before it get no candidates and the policy is not asked (a
    streamed replay's overlap step, asked already: a stateful policy sees each group once)."""
    if budget is None:
        budget = getattr(policy, "default_budget", None)
    if policy.needs & {"pred_ids", "predicted_ids"} and trace.attrs.get("subexpert_of"):
        raise KnobError(
            f"prefetch {policy.name!r} reads lookahead that names whole experts, and this "
            f"replay caches sub-experts (prism_offload=True); choose one of: none, "
            f"previous-step, oracle")
    if "pred_ids" in policy.needs and trace.pred_ids is None:
        raise KnobError(
            f"prefetch {policy.name!r} needs recorded router lookahead (pred_ids), which this "
            f"trace ({trace.attrs.get('source', 'unknown source')}) lacks; record it live with "
            f"lookahead_depth ≥ 1, or choose one of: none, previous-step, oracle")
    if "predicted_ids" in policy.needs and trace.predicted_ids is None:
        raise KnobError(
            f"prefetch {policy.name!r} needs the lookahead predictor's outputs "
            f"(predicted_ids), which this trace ({trace.attrs.get('source', 'unknown source')}) "
            f"does not carry; record a run store live with the predictor on (workbench run "
            f"--set prefetch={policy.name}, or predictor=vismmoe) and replay that, or choose "
            f"one of: none, previous-step, oracle")
    E, L = groups.num_experts, groups.num_layers
    G = groups.num_groups
    if G == 0 or not policy.fetches:
        return np.zeros(G + 1, np.int64), np.zeros(0, np.int64)
    if "source" in type(policy).__dict__:  # a built-in: the same plan, vectorised
        # depths past the step's last layer name nothing: not looped over (a lead of 256 on a
        # 4-layer trace costs what a lead of 3 does)
        return _plan_vectorised(type(policy).source,
                                [d for d in type(policy).depths(lead) if d < L], trace,
                                groups, pinned, budget)
    steps_tokens = np.r_[0, np.cumsum(groups.step_tokens)]
    ranked_cache: dict[tuple[int, int], list[int]] = {}

    def routed(step: int, layer: int) -> list[int]:
        if step < 0:
            return []
        key = (step, layer)
        if key not in ranked_cache:
            a, b = steps_tokens[step], steps_tokens[step + 1]
            ranked_cache[key] = ranked_ids(trace.topk_ids[a:b, layer])
        return ranked_cache[key]

    ptr = [0]
    keys: list[int] = []
    for g in range(G):
        if g < first_group:
            ptr.append(len(keys))
            continue
        s, l = int(groups.step[g]), int(groups.layer[g])
        a, b = steps_tokens[s], steps_tokens[s + 1]

        def pred(d: int, a=a, b=b, l=l) -> list[int]:
            if trace.pred_ids is None or d - 1 >= trace.pred_ids.shape[2]:
                return []
            return ranked_ids(trace.pred_ids[a:b, l, d - 1])

        ctx = PrefetchContext(step=s + step_offset, layer=l, num_layers=L, lead=lead, pred=pred,
                              previous=lambda layer, s=s: routed(s - 1, layer),
                              future=lambda d, s=s, l=l: routed(s, l + d),
                              predicted=(None if trace.predicted_ids is None
                                         else lambda s=s, l=l: trace.predicted(s, l)))
        keys.extend(select(policy.candidates(ctx), pinned, L, E, budget))
        ptr.append(len(keys))
    return np.asarray(ptr, np.int64), np.asarray(keys, np.int64)


def _ranked_csr(group_of: np.ndarray, expert: np.ndarray, count: np.ndarray, n: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """CSR over ``n`` groups of distinct experts, most-counted first, ties by id (the order
    :func:`ranked_ids` gives)."""
    order = np.lexsort((expert, -count, group_of))
    ptr = np.zeros(n + 1, np.int64)
    np.add.at(ptr, group_of + 1, 1)
    return np.cumsum(ptr), expert[order].astype(np.int64)


def _plan_vectorised(source: str, depths: list[int], trace, groups, pinned: np.ndarray,
                     budget: int | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`plan_prefetch` for the built-in policies without a Python call per group: the
    candidates of group (s, l) are, for each depth d in order, the ranked experts of
    ``source`` for layer l + d — "future": step s's own routing; "previous": step s − 1's;
    "pred": step s's router lookahead from layer l. Equal to the per-group path (tested)."""
    E, L, G = groups.num_experts, groups.num_layers, groups.num_groups
    S = len(groups.step_tokens)
    g_step, g_layer = groups.step.astype(np.int64), groups.layer.astype(np.int64)
    if source in ("future", "previous"):
        sizes = np.diff(groups.ptr)
        rptr, rexp = _ranked_csr(np.repeat(np.arange(G), sizes), groups.expert.astype(np.int64),
                                 groups.expert_tokens.astype(np.int64), G)
        table = np.full((S, L), -1, np.int64)
        table[g_step, g_layer] = np.arange(G)
    else:
        pid = trace.pred_ids  # [T, L, D, k]
        T, _, D, K = pid.shape
        tok_step = np.asarray(trace.token_step, np.int64)
        idx_s = np.broadcast_to(tok_step[:, None, None, None], pid.shape)
        idx_l = np.broadcast_to(np.arange(L)[None, :, None, None], pid.shape)
        idx_d = np.broadcast_to(np.arange(D)[None, None, :, None], pid.shape)
        ok = pid >= 0
        code = ((idx_s[ok] * L + idx_l[ok]) * D + idx_d[ok]) * E + pid[ok].astype(np.int64)
        uniq, cnt = np.unique(code, return_counts=True)
        pg = uniq // E
        pgroups, pg_of = np.unique(pg, return_inverse=True)
        rptr, rexp = _ranked_csr(pg_of, uniq % E, cnt, len(pgroups))
        table = np.full((S, L, D), -1, np.int64)
        table[pgroups // (L * D), (pgroups // D) % L, pgroups % D] = np.arange(len(pgroups))
    seg_g, seg_layer, seg_src = [], [], []
    for d in depths:
        tl = g_layer + d
        ok = tl < L
        ok[ok] &= ~pinned[tl[ok]]
        if source == "future":
            src = np.where(ok, table[g_step, np.minimum(tl, L - 1)], -1)
        elif source == "previous":
            src = np.where(ok & (g_step > 0),
                           table[np.maximum(g_step - 1, 0), np.minimum(tl, L - 1)], -1)
        else:
            src = (np.where(ok, table[g_step, g_layer, d - 1], -1) if d - 1 < table.shape[2]
                   else np.full(G, -1, np.int64))
        keep = src >= 0
        seg_g.append(np.flatnonzero(keep))
        seg_layer.append(tl[keep])
        seg_src.append(src[keep])
    sg, sl, ss = (np.concatenate(x) if x else np.zeros(0, np.int64)
                  for x in (seg_g, seg_layer, seg_src))
    order = np.argsort(sg, kind="stable")  # by group, depths in order within a group
    sg, sl, ss = sg[order], sl[order], ss[order]
    start, length = rptr[ss], rptr[ss + 1] - rptr[ss]
    total = int(length.sum())
    seg_of = np.repeat(np.arange(len(sg)), length)
    within = np.arange(total) - np.repeat(np.cumsum(length) - length, length)
    keys = sl[seg_of] * E + rexp[start[seg_of] + within]
    g_of = sg[seg_of]
    if budget is not None:
        first = np.searchsorted(g_of, g_of, side="left")
        sel = (np.arange(total) - first) < budget
        keys, g_of = keys[sel], g_of[sel]
    ptr = np.zeros(G + 1, np.int64)
    np.add.at(ptr, g_of + 1, 1)
    return np.cumsum(ptr), keys.astype(np.int64)
