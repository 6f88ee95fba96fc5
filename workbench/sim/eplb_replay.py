"""EPLB over time (issue 15 §3): a plan fitted on a sliding window of past load, rebalanced every
``interval`` steps, scored on the traffic that follows — what vLLM and SGLang run, measured the
way none of them reports it (on *future* traffic, with the bytes each rebalance moves).

:func:`eplb_over_time` takes per-(step, layer, expert) routed counts ``[S, L, E]`` (a run
store's ``routed_tokens`` summed over modalities, or a trace's) and:

- steps ``[0, interval)`` run on the static placement (contiguous: no history yet);
- at every step ``t`` that is a multiple of ``interval`` (t > 0), the plan is refitted by
  :func:`workbench.sim.eplb.rebalance_experts` on the loads of steps ``[t − window, t)`` and
  serves steps ``[t, t + interval)`` — a plan never sees the traffic it is scored on;
- each expert's tokens are split evenly among its replicas (:func:`replica_share`), each rank's
  load per (step, layer) is its share of the routed tokens;
- a rebalance moves to each rank the weights of every expert it now holds and did not hold
  before (statically each rank's first E/R slots hold its contiguous experts, its redundant
  slots are empty; a replica changing slots within a rank moves nothing): ``moved`` experts ×
  ``expert_bytes``, priced (``link``) as one all-to-all whose busiest receiver takes its slots'
  bytes (``Interconnect.all_to_all_s``-style: latency + bytes / bandwidth) — *modeled*.

With ``price`` (an expert's modeled seconds for a token count, :meth:`Prices.expert`) the
result also holds the EP clock of every (step, layer): each rank runs every expert it holds a
replica of on its share of the tokens (rounded to whole tokens; a replica reads all its
weights) — ``compute_s`` [S, L, R] — and, with ``hidden_bytes``, the dispatch and combine
all-to-alls of the replicated loads; ``rebalance_s`` [S] is the modeled weight movement at the
steps that rebalance (its own lane: the model stalls for it unless the move is hidden).

Torch-free; the loads are the same as ``ds.moe.ep_load``'s with a static placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workbench.sim.costs import Prices
from workbench.sim.ep import imbalance
from workbench.sim.eplb import rebalance_experts, replica_share
from workbench.sim.placement import check_eplb


@dataclass
class EPLBResult:
    """Per-(step, layer) imbalance (max/mean over ranks; NaN where nothing was routed) of the
    static placement and of EPLB, the rebalances (step, slots moved, bytes, modeled seconds)
    and the per-rank loads of EPLB ``[S, L, R]``."""

    static_imbalance: np.ndarray
    eplb_imbalance: np.ndarray
    load: np.ndarray
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    #: with ``price``: [S, L, R] modeled expert compute per rank, [S, L] dispatch (= combine)
    #: and MoE-layer seconds (dispatch + slowest rank + combine), [S] rebalance seconds
    compute_s: np.ndarray | None = None
    dispatch_s: np.ndarray | None = None
    moe_layer_s: np.ndarray | None = None
    rebalance_s: np.ndarray | None = None

    def summary(self) -> dict[str, Any]:
        after = self.eplb_imbalance
        served = np.zeros(after.shape[0], bool)
        first = self.rebalances[0]["step"] if self.rebalances else after.shape[0]
        served[first:] = True  # steps a fitted plan served
        def mean(a):
            return float(np.nanmean(a)) if np.isfinite(a).any() else None
        return {
            "static_imbalance": mean(self.static_imbalance),
            "eplb_imbalance": mean(after),
            "static_imbalance_after_first_fit": mean(self.static_imbalance[served]),
            "eplb_imbalance_after_first_fit": mean(after[served]),
            "rebalances": len(self.rebalances),
            "bytes_moved": float(sum(r["bytes"] for r in self.rebalances)),
            "rebalance_s_modeled": float(sum(r["seconds"] for r in self.rebalances)),
        }


def check_sizes(experts: int, ranks: int, redundant: int, window: int, interval: int) -> None:
    """:class:`KnobError` unless EPLB can serve these sizes
    (:func:`workbench.sim.placement.check_eplb`: the knob check and this are one rule)."""
    check_eplb(experts, ranks, redundant, window, interval)


class EPLBSchedule:
    """EPLB served step by step (the module docstring's schedule), fed chunks of per-(step,
    layer, expert) counts in step order (:meth:`serve`) — so a replay of any length keeps
    O(window × layers × experts) of history. ``plans`` records every rebalance's
    ``(step, phy2log, logcnt)`` so other views of the same traffic (one modality's tokens) can
    be served by the same plans (:meth:`share_at`)."""

    def __init__(self, layers: int, experts: int, ranks: int, redundant: int, window: int,
                 interval: int, *, num_groups: int = 1, num_nodes: int = 1,
                 expert_bytes: float = 0.0, link: Any = None, price=None) -> None:
        check_sizes(experts, ranks, redundant, window, interval)
        L, E = int(layers), int(experts)
        self.L, self.E, self.R = L, E, int(ranks)
        self.P = E + int(redundant)
        self.per_gpu = self.P // self.R
        self.window, self.interval = int(window), int(interval)
        self.num_groups, self.num_nodes = num_groups, num_nodes
        self.expert_bytes, self.link, self.price = float(expert_bytes), link, price
        # the static placement: expert e on rank ⌊e·R/E⌋, no replicas
        self.static = np.zeros((L, E, self.R))
        self.static[:, np.arange(E), (np.arange(E) * self.R) // E] = 1.0
        self.share = self.static
        # the physical slots' experts of the plan in force: statically rank r's first E/R
        # slots hold its contiguous experts and its redundant slots are empty (-1: filling one
        # moves weights); experts not divisible by ranks: no such layout, the first plan moves
        # every slot
        self.slots = None
        if E % self.R == 0:
            j = np.arange(self.per_gpu)
            first = np.where(j < E // self.R, j, -1)
            self.slots = np.tile(np.concatenate(
                [np.where(first >= 0, r * (E // self.R) + first, -1) for r in range(self.R)]),
                (L, 1))
        self.history = np.zeros((0, L, E))  # the last ``window`` steps' counts
        self.step = 0  # the next step to serve
        self.rebalances: list[dict[str, Any]] = []
        self.plans: list[tuple[int, np.ndarray, np.ndarray]] = []

    def _rebalance(self, t: int) -> None:
        hist = self.history[-self.window:].sum(0)  # [L, E]: the past only
        phy2log, _, logcnt = rebalance_experts(hist, self.P, self.num_groups, self.num_nodes,
                                               self.R)
        self.share = replica_share(phy2log, logcnt, self.R)
        # a rank receives the weights of every expert it now holds and did not before (a
        # replica moving between two slots of one rank crosses no link)
        new = phy2log.reshape(self.L, self.R, self.per_gpu)
        per_rank = np.full((self.L, self.R), self.per_gpu, np.int64)
        if self.slots is not None:
            old = self.slots.reshape(self.L, self.R, self.per_gpu)
            E1 = self.E + 1  # copies of each expert per (layer, rank); -1 (empty) counts last
            idx = (np.arange(self.L * self.R)[:, None] * E1)

            def copies(x):
                ids = np.where(x < 0, self.E, x).reshape(self.L * self.R, -1)
                return np.bincount((idx + ids).ravel(), minlength=self.L * self.R * E1
                                   ).reshape(self.L, self.R, E1)[..., :self.E]

            # copies it holds now beyond those it held (a multiset difference)
            per_rank = np.maximum(copies(new) - copies(old), 0).sum(-1)
        moved = per_rank
        self.slots = phy2log
        nbytes = float(moved.sum()) * self.expert_bytes
        seconds = 0.0
        if self.link is not None and self.expert_bytes > 0:
            busiest = per_rank.max(1) * self.expert_bytes  # per layer
            seconds = float(((busiest > 0) * self.link.latency_s
                             + busiest / self.link.bandwidth).sum())
        self.rebalances.append({"step": t, "experts_moved": int(moved.sum()), "bytes": nbytes,
                                "seconds": seconds})
        self.plans.append((t, phy2log, logcnt))

    def serve(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Serve the next ``len(counts)`` steps (``counts`` [s, L, E]): each step's per-rank
        load [s, L, R] under the plan in force (refitted first at every multiple of
        ``interval``), and with ``price`` each rank's modeled compute [s, L, R] (every replica
        on its share of its expert's tokens, rounded to whole tokens)."""
        counts = np.asarray(counts, np.float64)
        n = counts.shape[0]
        load = np.empty((n, self.L, self.R))
        compute = np.zeros((n, self.L, self.R)) if self.price is not None else None
        i = 0
        while i < n:
            t = self.step + i
            if t > 0 and t % self.interval == 0 and (
                    not self.rebalances or self.rebalances[-1]["step"] != t):
                self._rebalance(t)
            j = min(n, i + self.interval - t % self.interval)  # up to the next rebalance
            c = counts[i:j]
            load[i:j] = np.einsum("sle,ler->slr", c, self.share)
            if compute is not None:
                compute[i:j] = self._priced(c, self.share)
            self.history = np.concatenate([self.history, c])[-self.window:]
            i = j
        self.step += n
        return load, compute

    def _priced(self, c: np.ndarray, share: np.ndarray) -> np.ndarray:
        tokens = np.rint(c[:, :, :, None] * share[None]).astype(np.int64)
        secs = np.where(tokens > 0, Prices.many(self.price, tokens).reshape(tokens.shape), 0.0)
        return secs.sum(2)

    def share_at(self, step: int) -> np.ndarray:
        """[L, E, R]: the share of each expert's tokens each rank served at ``step`` (a step
        already served)."""
        share = self.static
        for t, phy2log, logcnt in self.plans:
            if t > step:
                break
            share = replica_share(phy2log, logcnt, self.R)
        return share

    def served_under_plans(self, counts: np.ndarray, step0: int) -> np.ndarray:
        """Per-rank loads [s, L, R] of other ``counts`` (e.g. one modality's) of the steps
        ``step0 …`` under the plans that served them (no refitting)."""
        counts = np.asarray(counts, np.float64)
        out = np.empty((counts.shape[0], self.L, self.R))
        bounds = sorted({0, counts.shape[0], *[t - step0 for t, _, _ in self.plans
                                               if 0 < t - step0 < counts.shape[0]]})
        for a, b in zip(bounds, bounds[1:]):
            out[a:b] = np.einsum("sle,ler->slr", counts[a:b], self.share_at(step0 + a))
        return out


def eplb_over_time(counts: np.ndarray, ranks: int, redundant: int, window: int,
                   interval: int, *, num_groups: int = 1, num_nodes: int = 1,
                   expert_bytes: float = 0.0, link: Any = None, price=None,
                   hidden_bytes: float = 0.0) -> EPLBResult:
    """The module docstring's schedule on ``counts`` [S, L, E] over ``ranks`` GPUs with
    ``redundant`` extra slots per layer (E + redundant must be a multiple of ``ranks``): one
    :class:`EPLBSchedule` served the whole array."""
    counts = np.asarray(counts, np.float64)
    if counts.ndim != 3:
        from workbench.errors import InputError

        raise InputError(f"counts must be [steps, layers, experts], not shape {counts.shape}")
    S, L, E = counts.shape
    sched = EPLBSchedule(L, E, ranks, redundant, window, interval, num_groups=num_groups,
                         num_nodes=num_nodes, expert_bytes=expert_bytes, link=link,
                         price=price)
    # the packing's own checks (groups, nodes) before anything is served
    rebalance_experts(np.ones((1, E)), E + int(redundant), num_groups, num_nodes, ranks)
    load, compute = sched.serve(counts)
    static_load = np.einsum("sle,ler->slr", counts, sched.static)
    out = EPLBResult(static_imbalance=imbalance(static_load), eplb_imbalance=imbalance(load),
                     load=load, rebalances=sched.rebalances)
    if compute is not None:
        from workbench.sim.ep import phase_s

        disp = (phase_s(load.reshape(-1, ranks), hidden_bytes, link).reshape(S, L)
                if link is not None and hidden_bytes > 0 else np.zeros((S, L)))
        reb = np.zeros(S)
        for r in sched.rebalances:
            reb[r["step"]] += r["seconds"]
        out.compute_s, out.dispatch_s, out.rebalance_s = compute, disp, reb
        out.moe_layer_s = 2 * disp + compute.max(-1)
    return out


__all__ = ["EPLBResult", "EPLBSchedule", "check_sizes", "eplb_over_time"]
