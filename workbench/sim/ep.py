"""Expert parallelism (EP): which rank each routed (token, expert) lands on, per-rank load, and
the modeled cost of an EP MoE layer. Torch-free; live runs, stores and trace replay use it.

Ranks are *virtual*: every routed (token, expert) is attributed to the rank that owns the
expert under an EP placement (:data:`workbench.sim.placement.EP_PLACEMENT`); nothing here knows
where ranks live, so real ``torch.distributed`` ranks can feed the same functions later.

**Load** of rank r in a (step, layer) group: the (token, expert) assignments it receives, i.e.
the tokens routed to its experts summed over them (a token routed to two experts of one rank
counts twice: each is one expert computation). Metrics per group, as the EP literature reports
them:

- imbalance IB = max / mean over ranks (MACS, ReaLB; 1 = perfectly balanced);
- balancedness = mean / max (vLLM's and SGLang's EPLB logs; 1 = balanced);
- imbalance ratio = (max − mean) / mean (TensorRT-LLM's);

``mean`` is over all R ranks (a rank with nothing to do counts as 0). Groups with no routed
token are skipped. Trace-level figures are means over groups; ``max_rank_load`` the largest
single-rank load of any group.

**Modeled EP clock** of one MoE layer (MACS Fig. 3: dispatch / compute / combine): dispatch is
an all-to-all in which each rank receives the hidden states of its assignments that originate
on other ranks (tokens spread evenly over ranks, so a fraction (R − 1)/R of them), priced on the
interconnect; compute is the slowest rank's expert work (each expert's tokens priced as the
cache replay prices them); combine sends the outputs back (the same bytes). All *modeled*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

def _per_group_rank(g_ptr: np.ndarray, expert: np.ndarray, values: np.ndarray,
                    rank_of_expert: np.ndarray, ranks: int) -> np.ndarray:
    """float64 ``[groups, ranks]``: ``values`` (one per access) summed per group and rank of
    the access's expert. One ``bincount``: O(accesses)."""
    G = len(g_ptr) - 1
    if G <= 0:
        return np.zeros((0, ranks))
    cell = np.repeat(np.arange(G, dtype=np.int64) * ranks, np.diff(g_ptr))
    cell += rank_of_expert[np.asarray(expert, np.int64)]
    return np.bincount(cell, weights=values, minlength=G * ranks).reshape(G, ranks)


def rank_load(g_ptr: np.ndarray, expert: np.ndarray, expert_tokens: np.ndarray,
              rank_of_expert: np.ndarray, ranks: int) -> np.ndarray:
    """int64 ``[groups, ranks]``: assignments each rank receives in each group (CSR ``g_ptr``
    over the accesses ``expert`` / ``expert_tokens`` of :class:`~workbench.traces.trace.Groups`)."""
    return _per_group_rank(g_ptr, expert, expert_tokens, rank_of_expert, ranks).astype(np.int64)


def rank_compute_s(g_ptr: np.ndarray, expert: np.ndarray, comp_s: np.ndarray,
                   rank_of_expert: np.ndarray, ranks: int) -> np.ndarray:
    """float64 ``[groups, ranks]``: modeled expert-compute seconds of each rank in each group
    (``comp_s`` per access: its expert's work on its tokens)."""
    return _per_group_rank(g_ptr, expert, comp_s, rank_of_expert, ranks)


def counts_per_rank(counts: np.ndarray, rank_of_expert: np.ndarray, ranks: int) -> np.ndarray:
    """``[..., ranks]``: per-expert ``counts`` ``[..., experts]`` (a store's
    ``routed_tokens`` or ``dispatch_dropped``: int64; ``effective_load``: float64) summed
    over the experts each rank owns."""
    counts = np.asarray(counts)
    dt = np.float64 if counts.dtype.kind == "f" else np.int64
    owner = np.zeros((len(rank_of_expert), ranks), dt)
    owner[np.arange(len(rank_of_expert)), rank_of_expert] = 1
    return counts.astype(dt) @ owner


def imbalance(load: np.ndarray) -> np.ndarray:
    """max / mean over the last axis (ranks) of ``load``; NaN where nothing was routed."""
    load = np.asarray(load, np.float64)
    mean = load.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, load.max(axis=-1) / mean, np.nan)


def load_volatility(load: np.ndarray, window: int = 4) -> dict[str, float]:
    """How much a per-(step, layer) load ``[S, L, N]`` (N ranks or experts) moves between
    iterations — ReaLB's argument against history-based balancing (seed 004 Fig. 2):

    - ``hot_change``: the share of consecutive step pairs (per layer, both with load) whose
      busiest of the N changes;
    - ``history_corr``: the mean Pearson correlation, over (step, layer), of a step's load with
      the mean of its ``window`` previous steps (what a history-based plan is fitted on; 1:
      the past predicts the next step's shape exactly; NaN where a side is constant);
    - ``history_hot_hit``: the share of steps whose busiest is the busiest of that history.

    Steps with no load are skipped; a step's history is the steps before it that had some."""
    load = np.asarray(load, np.float64)
    S, L, N = load.shape
    live = load.sum(-1) > 0
    hot = load.argmax(-1)
    both = live[1:] & live[:-1]
    change = (hot[1:] != hot[:-1])[both]
    corr, hits = [], []
    for l in range(L):
        idx = np.nonzero(live[:, l])[0]
        for j in range(1, len(idx)):
            past = load[idx[max(0, j - window):j], l].mean(0)
            now = load[idx[j], l]
            hits.append(past.argmax() == now.argmax())
            if past.std() > 0 and now.std() > 0:
                corr.append(float(np.corrcoef(past, now)[0, 1]))
    return {"hot_change": float(change.mean()) if change.size else float("nan"),
            "history_corr": float(np.mean(corr)) if corr else float("nan"),
            "history_hot_hit": float(np.mean(hits)) if hits else float("nan"),
            "pairs": int(change.size), "window": int(window)}


def group_metrics(load: np.ndarray) -> dict[str, np.ndarray]:
    """Per-group ``max``, ``mean`` and the three ratios (module docstring) of ``load``
    ``[groups, ranks]``, for the groups with any load (``used``: which)."""
    load = np.asarray(load)
    mx = load.max(axis=1) if load.size else np.zeros(len(load))
    mean = load.sum(axis=1) / max(load.shape[1], 1)
    used = mx > 0
    mx, mean = mx[used].astype(np.float64), mean[used]
    return {"used": used, "max": mx, "mean": mean, "imbalance": mx / mean,
            "balancedness": mean / mx, "imbalance_ratio": (mx - mean) / mean}


@dataclass
class EPSummary:
    """Trace-level EP figures, accumulated group chunk by group chunk (:meth:`add`), so a
    replay of any length keeps O(ranks) state. ``label``: what the loads are (e.g. a
    modality)."""

    ranks: int
    placement: str
    groups: int = 0
    sum_imbalance: float = 0.0
    sum_balancedness: float = 0.0
    sum_ratio: float = 0.0
    sum_max: float = 0.0
    max_rank_load: int = 0
    worst_imbalance: float = 0.0
    rank_totals: np.ndarray | None = None
    times: dict[str, float] = field(default_factory=dict)

    def add(self, load: np.ndarray, times: dict[str, float] | None = None) -> None:
        m = group_metrics(load)
        n = int(m["used"].sum())
        if self.rank_totals is None:
            self.rank_totals = np.zeros(self.ranks, np.int64)
        self.rank_totals += np.asarray(load, np.int64).sum(axis=0) if len(load) else 0
        if n:
            self.groups += n
            self.sum_imbalance += float(m["imbalance"].sum())
            self.sum_balancedness += float(m["balancedness"].sum())
            self.sum_ratio += float(m["imbalance_ratio"].sum())
            self.sum_max += float(m["max"].sum())
            self.max_rank_load = max(self.max_rank_load, int(m["max"].max()))
            self.worst_imbalance = max(self.worst_imbalance, float(m["imbalance"].max()))
        for k, v in (times or {}).items():
            self.times[k] = self.times.get(k, 0.0) + v

    def result(self) -> dict[str, Any]:
        """Plain numbers (JSON): means over groups, the largest loads, per-rank shares, and the
        modeled EP times summed over the MoE layers (seconds; absent when unpriced)."""
        n = self.groups
        totals = self.rank_totals if self.rank_totals is not None else np.zeros(self.ranks)
        total = float(totals.sum())
        mean_total = total / self.ranks if self.ranks else 0.0
        out: dict[str, Any] = {
            "ranks": self.ranks, "placement": self.placement, "groups": n,
            "imbalance": self.sum_imbalance / n if n else None,
            "balancedness": self.sum_balancedness / n if n else None,
            "imbalance_ratio": self.sum_ratio / n if n else None,
            "max_rank_load": self.max_rank_load,
            "mean_max_rank_load": self.sum_max / n if n else None,
            "worst_imbalance": self.worst_imbalance if n else None,
            "rank_share": [float(x) / total for x in totals] if total else None,
            # the whole trace summed first: far more balanced than any one group
            "aggregate_imbalance": float(totals.max()) / mean_total if total else None,
        }
        if self.times:
            out.update({f"{k}_modeled": v for k, v in self.times.items()})
        return out


def phase_s(load: np.ndarray, hidden_bytes: float, link: Any) -> np.ndarray:
    """Modeled seconds of one all-to-all phase (dispatch, or combine: the same bytes back) of
    each group of ``load`` ``[groups, ranks]``: the busiest receiver's remote share ((R − 1)/R
    of its assignments, tokens spread evenly over ranks) of ``hidden_bytes`` each, over
    ``link`` (latency once per group that moves anything)."""
    R = load.shape[1] if load.ndim == 2 else 1
    remote = np.asarray(load, np.float64).max(axis=1) * (hidden_bytes * (R - 1) / R)
    return np.where(remote > 0, link.latency_s, 0.0) + remote / link.bandwidth


def layer_times(load: np.ndarray, compute: np.ndarray | None, hidden_bytes: float,
                link: Any | None) -> dict[str, float]:
    """Modeled seconds, summed over the groups of ``load`` ``[groups, ranks]`` (one MoE layer
    execution each): ``dispatch_s``, ``compute_s`` (slowest rank), ``combine_s``,
    ``moe_layer_s`` (their sum) and ``compute_balanced_s`` (every rank at the mean: what a
    perfect balance would take). ``link``: an :class:`~workbench.sim.profiles.Interconnect`
    (its all-to-all per group, vectorised), None: no communication priced. Only the parts
    there are prices for."""
    R = load.shape[1] if load.ndim == 2 else 1
    out: dict[str, float] = {}
    if link is not None and hidden_bytes > 0 and len(load):
        out["dispatch_s"] = out["combine_s"] = float(phase_s(load, hidden_bytes, link).sum())
    if compute is not None and len(compute):
        out["compute_s"] = float(compute.max(axis=1).sum())
        out["compute_balanced_s"] = float(compute.sum() / R)
    if "dispatch_s" in out and "compute_s" in out:
        out["moe_layer_s"] = out["dispatch_s"] + out["compute_s"] + out["combine_s"]
    return out
