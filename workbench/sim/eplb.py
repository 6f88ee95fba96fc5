"""EPLB: the expert-parallel load balancer DeepSeek publishes (deepseek-ai/EPLB) and vLLM and
SGLang ship — redundant experts (replicas of the busy ones) packed onto GPUs so that their
estimated loads balance. Our own implementation (numpy, torch-free) of the published
algorithm, issue 15 §3; the README's example is a test.

Given per-layer expert loads ``weight`` [L, E] (e.g. a sliding window of history), ``R``
physical expert slots per layer (``num_replicas`` = E + redundant experts, a multiple of the
GPU count), ``num_groups`` expert groups, ``num_nodes`` nodes and ``num_gpus`` GPUs:

1. **Groups → nodes** (hierarchical policy, used when the nodes divide the groups): the groups'
   loads are packed onto the nodes, ``groups / nodes`` groups each, by :func:`balanced_packing`
   (heaviest first, each into the lightest node that still has room).
2. **Replicas within each node**: :func:`replicate_experts` gives each extra slot to the expert
   whose load per replica is the largest (first such expert on ties).
3. **Replicas → GPUs within each node**: each replica carries its expert's load / replica
   count; :func:`balanced_packing` again, ``R / num_gpus`` replicas per GPU.

Otherwise the **global** policy: the same with one group and one node. Returns, per layer,
``phy2log`` [L, R] (the expert of each physical slot; slot s lives on GPU s // (R / gpus)),
``log2phy`` [L, E, max replicas] (-1 padded) and ``logcnt`` [L, E] (replicas per expert).

Ties: "heaviest first" is a stable sort (equal loads keep expert order) and the lightest pack
is the first such pack — deterministic everywhere (the published code sorts with
``torch.sort``, whose order of equal keys is unspecified).
"""

from __future__ import annotations

import numpy as np

from workbench.errors import KnobError


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the n items of each row of ``weight`` [X, n] into ``num_packs`` packs of exactly
    n / num_packs items, heaviest item first into the lightest pack with room. Returns
    ``(pack index, rank in pack)``, both int64 [X, n]."""
    weight = np.asarray(weight, np.float64)
    X, n = weight.shape
    if n % num_packs:
        raise KnobError(f"{n} items cannot be packed evenly into {num_packs} packs")
    per = n // num_packs
    if per == 1:
        return np.tile(np.arange(n, dtype=np.int64), (X, 1)), np.zeros((X, n), np.int64)
    pack = np.full((X, n), -1, np.int64)
    rank = np.full((X, n), -1, np.int64)
    for i in range(X):
        load = np.zeros(num_packs)
        count = np.zeros(num_packs, np.int64)
        for item in np.argsort(-weight[i], kind="stable"):
            open_ = count < per
            p = int(np.flatnonzero(open_)[np.argmin(load[open_])])
            pack[i, item], rank[i, item] = p, count[p]
            load[p] += weight[i, item]
            count[p] += 1
    return pack, rank


def replicate_experts(weight: np.ndarray, num_phy: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give ``num_phy`` physical slots to the ``num_log`` experts of each row of ``weight``
    [X, num_log]: one each, then every extra slot to the expert with the largest load per
    replica. Returns ``(phy2log [X, num_phy], replica rank [X, num_phy], logcnt [X,
    num_log])``."""
    weight = np.asarray(weight, np.float64)
    X, num_log = weight.shape
    if num_phy < num_log:
        raise KnobError(f"{num_phy} physical experts cannot hold {num_log} experts")
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (X, 1))
    rank = np.zeros((X, num_phy), np.int64)
    cnt = np.ones((X, num_log), np.int64)
    rows = np.arange(X)
    for s in range(num_log, num_phy):
        best = np.argmax(weight / cnt, axis=1)  # first maximum on ties
        phy2log[:, s] = best
        rank[:, s] = cnt[rows, best]
        cnt[rows, best] += 1
    return phy2log, rank, cnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.arange(perm.shape[1])[None, :].repeat(len(perm), 0), 1)
    return inv


def _hierarchical(weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int,
                  num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    L, E = weight.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    # 1. groups → nodes; a "node-major" order of the experts (mlog): node by node, its groups
    # in pack order, each group's experts in order
    g_pack, g_rank = balanced_packing(weight.reshape(L, num_groups, group_size).sum(-1),
                                      num_nodes)
    log2mlog = ((g_pack * groups_per_node + g_rank) * group_size)[:, :, None] \
        + np.arange(group_size)[None, None, :]
    log2mlog = log2mlog.reshape(L, E)
    mlog2log = _inverse(log2mlog)
    # 2. replicas within each node
    per_node = np.take_along_axis(weight, mlog2log, 1).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(per_node, num_phy // num_nodes)
    # 3. replicas → GPUs within each node
    per_phy = np.take_along_axis(per_node / mlogcnt, phy2mlog, 1)
    pack, rank = balanced_packing(per_phy, num_gpus // num_nodes)
    phy2pphy = pack * per_gpu + rank
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, 1).reshape(L, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * (E // num_nodes))[None, :, None]
                 ).reshape(L, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, 1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, 1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, 1)
    return phy2log, pphyrank, logcnt


def rebalance_experts(weight: np.ndarray, num_replicas: int, num_groups: int = 1,
                      num_nodes: int = 1, num_gpus: int = 1
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The EPLB plan for ``weight`` [L, E] (module docstring): ``(phy2log [L, num_replicas],
    log2phy [L, E, max replicas], logcnt [L, E])``. :class:`KnobError` for sizes that do not
    fit (``num_replicas`` a multiple of ``num_gpus``, ≥ E; ``num_gpus`` a multiple of
    ``num_nodes``; ``num_groups`` dividing E)."""
    w = np.asarray(weight, np.float64)
    if w.ndim != 2 or not np.isfinite(w).all() or (w < 0).any():
        raise KnobError("expert loads must be finite, ≥ 0 and shaped [layers, experts]")
    L, E = w.shape
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups),
                    ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise KnobError(f"{name} must be a whole number, not {v!r}")
    checks = ((num_replicas >= E, f"num_replicas ({num_replicas}) must be at least the {E} "
                                  f"experts"),
              (num_replicas <= E * (max(num_gpus, 1) + 1),
               f"num_replicas ({num_replicas}) must be at most the {E} experts × (GPUs + 1) "
               f"= {E * (max(num_gpus, 1) + 1)} (a full copy on every GPU)"),
              (num_gpus >= 1 and num_replicas % num_gpus == 0,
               f"num_replicas ({num_replicas}) must be a multiple of the {num_gpus} GPUs"),
              (num_nodes >= 1 and num_gpus % num_nodes == 0,
               f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})"),
              (num_groups >= 1 and E % num_groups == 0,
               f"num_groups ({num_groups}) must divide the {E} experts"))
    for ok, msg in checks:
        if not ok:
            raise KnobError(msg)
    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, logcnt = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    top = int(logcnt.max())
    log2phy = np.full((L, E, top), -1, np.int64)
    layer = np.repeat(np.arange(L), num_replicas)
    log2phy[layer, phy2log.reshape(-1), rank.reshape(-1)] = np.tile(
        np.arange(num_replicas), L)
    return phy2log, log2phy, logcnt


def replica_share(phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 [L, E, num_gpus]: the share of each expert's tokens each GPU serves under the
    plan (an expert's tokens are split evenly among its replicas, as vLLM's EPLB dispatch
    does). Per-expert counts ``[..., E]`` of layer l times ``share[l]`` are the GPUs' loads."""
    L, P = phy2log.shape
    E = logcnt.shape[1]
    gpu = np.arange(P) // (P // num_gpus)
    share = np.zeros((L, E, num_gpus))
    for l in range(L):
        np.add.at(share[l], (phy2log[l], gpu), 1.0 / logcnt[l, phy2log[l]])
    return share


__all__ = ["balanced_packing", "replicate_experts", "rebalance_experts", "replica_share"]
