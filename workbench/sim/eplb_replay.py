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
- a rebalance moves the weights of every physical slot whose expert changed (statically each
  rank's first E/R slots hold its contiguous experts, its redundant slots are empty): ``moved`` slots ×
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


def eplb_over_time(counts: np.ndarray, ranks: int, redundant: int, window: int,
                   interval: int, *, num_groups: int = 1, num_nodes: int = 1,
                   expert_bytes: float = 0.0, link: Any = None, price=None,
                   hidden_bytes: float = 0.0) -> EPLBResult:
    """The module docstring's schedule on ``counts`` [S, L, E] over ``ranks`` GPUs with
    ``redundant`` extra slots per layer (E + redundant must be a multiple of ``ranks``)."""
    counts = np.asarray(counts, np.float64)
    S, L, E = counts.shape
    P = E + int(redundant)
    per_gpu = P // ranks
    # the static placement: expert e on rank ⌊e·R/E⌋, no replicas
    static_share = np.zeros((L, E, ranks))
    static_share[:, np.arange(E), (np.arange(E) * ranks) // E] = 1.0
    static_load = np.einsum("sle,ler->slr", counts, static_share)
    load = np.empty((S, L, ranks))
    share = static_share
    # the physical slots' experts of the plan in force: statically rank r's first E/R slots
    # hold its contiguous experts and its redundant slots are empty (-1: filling one moves
    # weights); experts not divisible by ranks: no such layout, the first plan moves every slot
    slots = None
    if E % ranks == 0:
        j = np.arange(per_gpu)
        first = np.where(j < E // ranks, j, -1)
        slots = np.tile(np.concatenate([np.where(first >= 0, r * (E // ranks) + first, -1)
                                        for r in range(ranks)]), (L, 1))
    rebalances = []
    compute = np.zeros((S, L, ranks)) if price is not None else None
    for t0 in range(0, S, interval):
        t1 = min(t0 + interval, S)
        if t0 > 0:
            hist = counts[max(0, t0 - window):t0].sum(0)  # [L, E]: the past only
            phy2log, _, logcnt = rebalance_experts(hist, P, num_groups, num_nodes, ranks)
            share = replica_share(phy2log, logcnt, ranks)
            moved = (np.full(phy2log.shape, True) if slots is None else phy2log != slots)
            slots = phy2log
            per_rank = moved.reshape(L, ranks, per_gpu).sum(-1)  # slots each rank receives
            nbytes = float(moved.sum()) * expert_bytes
            seconds = 0.0
            if link is not None and expert_bytes > 0:
                busiest = per_rank.max(1) * expert_bytes  # per layer
                seconds = float(((busiest > 0) * link.latency_s + busiest / link.bandwidth).sum())
            rebalances.append({"step": t0, "slots_moved": int(moved.sum()), "bytes": nbytes,
                               "seconds": seconds})
        load[t0:t1] = np.einsum("sle,ler->slr", counts[t0:t1], share)
        if compute is not None:  # every replica on its share of its expert's tokens
            tokens = np.rint(counts[t0:t1, :, :, None] * share[None]).astype(np.int64)
            secs = np.where(tokens > 0, Prices.many(price, tokens).reshape(tokens.shape), 0.0)
            compute[t0:t1] = secs.sum(2)
    out = EPLBResult(static_imbalance=imbalance(static_load), eplb_imbalance=imbalance(load),
                     load=load, rebalances=rebalances)
    if compute is not None:
        from workbench.sim.ep import phase_s

        disp = (phase_s(load.reshape(-1, ranks), hidden_bytes, link).reshape(S, L)
                if link is not None and hidden_bytes > 0 else np.zeros((S, L)))
        reb = np.zeros(S)
        for r in rebalances:
            reb[r["step"]] += r["seconds"]
        out.compute_s, out.dispatch_s, out.rebalance_s = compute, disp, reb
        out.moe_layer_s = 2 * disp + compute.max(-1)
    return out


__all__ = ["EPLBResult", "eplb_over_time"]
