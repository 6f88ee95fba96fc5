"""MACS — modality-aware capacity scaling under expert parallelism (seed 002 §3), torch-free.

One implementation, run live (the offloader hands each MoE layer call's routing, the tokens'
features and the full router probabilities in a :class:`DispatchContext`) and in trace replay
(routing and modality only: the parts that need features or every expert's router
probability refuse to replay, see :meth:`Macs.requires`).

Per (step, layer) group of T tokens routed top-k over E experts:

1. **Semantic weight** (SL, ``macs_semantic_load``): w(x) = σ(−δ·H̃(x)) for a visual token,
   H(x) the Shannon entropy of softmax(z_x) over the feature dims of its MoE input z_x, z-scored
   over the visual tokens of its image (H̃ = (H − μ)/(σ + ε)); 1 for text. Off: w = 1.
2. **Effective visual ratio** R_v = Σ_visual w / Σ w.
3. **Capacity** (DC, ``macs_dynamic_capacity``): C_base = max(min_capacity, ⌈γ0·T·k/E⌉) (the
   static capacity of CAI-MoE Token Drop, token counts); C_j = max(min_capacity,
   C_base·(1 + ρ·m_j·(R_v − 0.5))), m_j = +1 visual / −1 text / 0 shared expert from the
   calibration (:mod:`workbench.sim.macs_calibration`). Off: C_j = C_base.
4. **Selection**: each expert keeps its assignments in ``macs_selection`` order while their
   cumulative effective load Σ w stays ≤ C_j (seed Table 3: ``router`` — router score G(x)_j;
   ``entropy`` — the entropy-weighted score w(x)·G(x)_j (a low-information visual token
   yields its place first; text tokens keep router order); ``retention`` — the token-level
   retention r(x) = w(x)·max_j G(x)_j of eq. 11, the fail-safe drop's order, for every
   expert alike; ``modality-prior`` — text before visual, then router score; ``random`` — a
   seeded shuffle). The rest overflow. The paper names the strategies, not their order
   keys; these are our reading (docs/expert-parallel.md).
5. **Local semantic rerouting** (SR, ``macs_reroute``): an overflow assignment (token x,
   expert j) moves to the expert k on j's rank, not already among x's experts, whose effective
   load leaves room for w(x) (L̃_k + w(x) ≤ C_k) and whose score S = (1−η)·G(x)_k +
   η·cos(z_x, μ_k) is highest (μ_k the calibrated centroid; η = 0 without centroids).
   Overflow assignments are placed in descending retention order; the new slot's combine
   weight is G(x)_k scaled as the router scaled the slot it replaces (top-k renormalisation
   kept). No candidate: the **fail-safe drop** (the assignment goes).

With SL, DC and SR off and ``macs_selection=router`` this is exactly Token Drop (tested).
Ablation rows of seed Table 2: SC = all off; +SL; +SL+DC; +SL+DC+SR (full MACS).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: token-selection strategies (seed Table 3)
SELECTIONS = ("entropy", "retention", "router", "modality-prior", "random")
_EPS = 1e-6


@dataclass
class DispatchContext:
    """What a dispatch may know beyond the routing, for a chunk of T tokens × L layers.

    ``modality`` int8 [T] (0 text); ``layers`` int [L]: the model's layer index of each
    column; ``rank_of_expert`` int [E] (None: one rank); ``features_entropy`` float [T, L]:
    H(x) of each token's MoE input (None: not known — trace replay); ``image_of`` int [T]:
    which image a visual token belongs to (-1 text; None: all visual tokens one image);
    ``gates`` float [T, L, E]: every expert's router probability (None: not known);
    ``affinity`` float [T, L, E]: cos(z_x, μ_k) with the calibrated centroids (None: η acts
    as 0)."""

    modality: np.ndarray
    layers: np.ndarray
    rank_of_expert: np.ndarray | None = None
    features_entropy: np.ndarray | None = None
    image_of: np.ndarray | None = None
    gates: np.ndarray | None = None
    affinity: np.ndarray | None = None
    #: m_j per model layer and expert, int8 [layers, E] (None: the policy's calibration)
    expert_class: np.ndarray | None = None
    #: :func:`image_groups` of ``modality`` and ``image_of`` (None: computed when needed)
    image_groups: tuple[np.ndarray, np.ndarray] | None = None


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64)))


def image_groups(modality: np.ndarray, image_of: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(idx, starts)``: the visual tokens image by image, each image's in token order
    (int64 [n]; a stable sort by image), and where each image's run of them starts, with
    ``n`` last (int64 [images + 1]). ``image_of`` None: all visual tokens one image. What
    :func:`semantic_weights` z-scores over; a live dispatch computes it once per step (every
    layer call of a step has the same tokens)."""
    idx = np.flatnonzero(np.asarray(modality) != 0)
    if image_of is not None and len(idx):  # each image's tokens together, in token order
        img = np.asarray(image_of)[idx]
        order = np.argsort(img, kind="stable")
        idx, img = idx[order], img[order]
        cut = np.flatnonzero(img[1:] != img[:-1]) + 1
    else:
        cut = np.zeros(0, np.int64)
    return idx.astype(np.int64, copy=False), np.r_[0, cut, len(idx)].astype(np.int64)


def semantic_weights(entropy: np.ndarray, modality: np.ndarray, image_of: np.ndarray | None,
                     delta: float, groups: tuple[np.ndarray, np.ndarray] | None = None,
                     compiled: bool = True) -> np.ndarray:
    """w(x) [T, L]: σ(−δ·H̃) for visual tokens (H z-scored over each image's visual tokens,
    per layer), 1 for text. ``entropy`` [T, L]; ``image_of`` [T] the image of each visual
    token (:func:`image_runs`; a text token's entry is not read), None: one image.
    ``groups``: :func:`image_groups` of ``modality`` and ``image_of``, when the caller holds
    it (checked to fit the tokens, not against those two); None: computed here.

    The visual tokens are gathered image by image once, each image's mean and population
    standard deviation are numpy's own ``mean(0)`` and ``std(0)`` steps on that block (the
    same sums in the same order, so the same bits as z-scoring each image's visual tokens
    with them: tested), and one σ runs over them all. With one layer and ``compiled``, the
    z-scores of all images come from one compiled pass (:func:`_zscore_loop`), whose sums are
    numpy's pairwise summation of a contiguous column (tested bit-equal); else a numpy loop
    over the images."""
    H = np.asarray(entropy, np.float64)
    w = np.ones_like(H)
    vis = np.asarray(modality) != 0
    for name, a in (("modality", vis), ("image_of", image_of)):
        if a is not None and np.shape(a) != H.shape[:1]:
            raise ValueError(f"semantic_weights: {name} has shape {np.shape(a)}, the entropy "
                             f"{H.shape}: expected one entry per token ({H.shape[0]})")
    if groups is None:
        idx, starts = image_groups(vis, image_of)
    else:  # the caller's: checked to fit, since the compiled pass reads without bounds checks
        idx, starts = (np.asarray(a, np.int64) for a in groups)
        if (idx.ndim != 1 or starts.ndim != 1 or not len(starts) or starts[0] != 0
                or starts[-1] != len(idx) or (np.diff(starts) < 0).any()
                or (len(idx) and (idx.min() < 0 or idx.max() >= H.shape[0]))):
            raise ValueError(f"semantic_weights: groups must be (token indices in 0 … "
                             f"{H.shape[0] - 1}, non-decreasing starts from 0 to their "
                             f"count), as image_groups gives; got {len(idx)} indices and "
                             f"starts {np.asarray(starts).tolist()[:8]}")
    if not len(idx):
        return w
    if compiled and H.ndim == 2 and H.shape[1] == 1:
        Hv = np.ascontiguousarray(H[idx, 0])
        z = np.empty_like(Hv)
        _kernels()[2](Hv, starts, z, np.empty_like(Hv))
        w[idx, 0] = sigmoid(-float(delta) * z)
        return w
    Hv = H[idx]
    z = np.empty_like(Hv)
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        h = Hv[a:b]
        # numpy's std: x = h − mean (mean = Σh / n), Σx² / n, √ — and x is h − h.mean(0)
        x = h - np.add.reduce(h, 0, keepdims=True) / (b - a)
        sd = np.sqrt(np.add.reduce(x * x, 0) / (b - a))
        z[a:b] = x / (sd + _EPS)
    w[idx] = sigmoid(-float(delta) * z)
    return w


def _pairwise_sum(a, lo, n):
    """Σ a[lo:lo + n] as numpy sums a contiguous float64 run (its ``pairwise_sum``: runs over
    128 split in halves that are multiples of 8; up to 128, eight running sums combined as
    ((0+1)+(2+3))+((4+5)+(6+7)), then the rest one by one; under 8 one by one from 0).
    ``add.reduce`` adds the result to its identity 0: the caller's ``0.0 +``. Compiled
    (:func:`_kernels`), recursive by its compiled name."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    if n <= 128:
        r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
        r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
        i = 8
        m = n - n % 8
        while i < m:
            j = lo + i
            r0 += a[j]
            r1 += a[j + 1]
            r2 += a[j + 2]
            r3 += a[j + 3]
            r4 += a[j + 4]
            r5 += a[j + 5]
            r6 += a[j + 6]
            r7 += a[j + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[lo + i]
            i += 1
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _PAIRWISE(a, lo, n2) + _PAIRWISE(a, lo + n2, n - n2)


def _zscore_loop(h, starts, z, sq):
    """z[a:b] = (h − mean) / (std + ε) for each run ``starts[g]:starts[g + 1]`` of ``h``
    (float64, contiguous), as :func:`semantic_weights`' numpy loop computes it on one layer:
    mean = Σh / n, x = h − mean, std = √(Σx² / n), each Σ numpy's (:func:`_pairwise_sum`).
    ``sq``: scratch as long as ``h``."""
    for g in range(starts.shape[0] - 1):
        a, b = starts[g], starts[g + 1]
        n = b - a
        m = (0.0 + _PAIRWISE(h, a, n)) / n
        for i in range(a, b):
            x = h[i] - m
            z[i] = x
            sq[i] = x * x
        sd = np.sqrt((0.0 + _PAIRWISE(sq, a, n)) / n)
        for i in range(a, b):
            z[i] = z[i] / (sd + _EPS)


def entropy_of_features(z: np.ndarray) -> np.ndarray:
    """Shannon entropy (nats) of softmax over the last axis of ``z`` (float)."""
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    return -(p * np.log(np.clip(p, 1e-300, None))).sum(-1)


def image_runs(modality: np.ndarray, request: np.ndarray | None = None) -> np.ndarray:
    """Image index of each token (-1 for text): a maximal run of consecutive visual tokens of
    one request is one image (Qwen-VL frames every image by vision start/end tokens)."""
    vis = np.asarray(modality) != 0
    out = np.full(vis.shape, -1, np.int64)
    if not vis.any():
        return out
    req = np.zeros(vis.shape, np.int64) if request is None else np.asarray(request, np.int64)
    start = vis & np.r_[True, ~vis[:-1] | (req[1:] != req[:-1])]
    out[vis] = np.cumsum(start)[vis] - 1
    return out


def expert_classes(routed: np.ndarray, tokens: np.ndarray, threshold: float = 0.1
                   ) -> tuple[np.ndarray, np.ndarray]:
    """MACS's expert classes (seed 002 App. A.2) from routing counts: ``routed`` [L, E, M]
    tokens of each modality routed to each expert (M = text, image, …), ``tokens`` [M] the
    tokens of each modality. f_j^m = routed / tokens (the share of modality-m tokens that
    have expert j in their top-k, eq. 12), Δ_j = f_j^visual − f_j^text (visual = every code
    but text), m_j = +1 if Δ_j ≥ threshold, −1 if Δ_j ≤ −threshold, else 0. Returns
    ``(m int8 [L, E], Δ float32 [L, E])``; with no visual or no text token every Δ is 0."""
    routed = np.asarray(routed, np.float64)
    tokens = np.asarray(tokens, np.float64)
    n_text, n_vis = tokens[0], tokens[1:].sum()
    if n_text <= 0 or n_vis <= 0:
        delta = np.zeros(routed.shape[:2])
    else:
        delta = routed[..., 1:].sum(-1) / n_vis - routed[..., 0] / n_text
    m = np.where(delta >= threshold, 1, np.where(delta <= -threshold, -1, 0)).astype(np.int8)
    return m, delta.astype(np.float32)


#: which experts share a rank, by the placement's bytes (a run asks once per layer call; a
#: few placements a process, so the dict stays small: cleared past 16)
_SAME_RANK: dict[bytes, np.ndarray] = {}


def _same_rank(ranks: np.ndarray) -> np.ndarray:
    """bool [E, E]: ``ranks[i] == ranks[j]`` (C order; kept, so callers must not write it)."""
    ranks = np.asarray(ranks, np.int64)
    key = ranks.tobytes()
    m = _SAME_RANK.get(key)
    if m is None:
        if len(_SAME_RANK) >= 16:
            _SAME_RANK.clear()
        m = _SAME_RANK[key] = np.ascontiguousarray(ranks[:, None] == ranks[None, :])
    return m


def macs_group(ids: np.ndarray, gate_w: np.ndarray, w: np.ndarray, modality: np.ndarray,
               classes: np.ndarray | None, capacity_base: float, *, rho: float,
               dynamic_capacity: bool, min_capacity: int, selection: str, seed: int,
               reroute: bool, rank_of_expert: np.ndarray | None, gates: np.ndarray | None,
               affinity: np.ndarray | None, eta: float, num_experts: int,
               compiled: bool = True
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One (step, layer) group. ``ids`` int [T, K] (-1 none), ``gate_w`` [T, K] the router's
    combine weights of them (NaN: unknown), ``w`` [T] semantic weights, ``classes`` int8 [E]
    (m_j; None: all shared), ``gates`` [T, E] / ``affinity`` [T, E] or None.

    Returns ``(new ids [T, K] (-1: dropped), new weights [T, K], rerouted bool [T, K],
    capacity [E])``. The capacity (:func:`_capacity`) and the random selection's keys are
    numpy either way; the rest (priority keys, each expert's order, keep or overflow, the
    fail-safe order, rerouting and, from float32 gates, its scores) runs in
    :func:`_select_loop` (numba) when ``compiled``, else in the numpy reference below it,
    which the tests hold it bit-equal to (the reference of the behaviour; the kernel is its
    fast path). Rerouting's score is computed in the gates' own precision, ``eta`` a Python
    float (a numpy float64 would make numpy widen a float32 product: it is taken as a float).
    """
    T, K = ids.shape
    E = num_experts
    eta = float(eta)  # (a weak scalar: S in the gates' precision, both paths alike)
    new_ids = ids.copy()
    new_w = np.array(gate_w, np.float64, copy=True)
    rerouted = np.zeros((T, K), bool)
    vis = np.asarray(modality) != 0
    w = np.ascontiguousarray(w, np.float64)
    if compiled:
        return _group_compiled(ids, gate_w, w, vis, classes, capacity_base, rho,
                               dynamic_capacity, min_capacity, selection, seed, reroute,
                               rank_of_expert, gates, affinity, eta, E, new_ids, new_w,
                               rerouted)
    # the numpy reference of _select_loop
    cap = _capacity(w, vis, classes, capacity_base, rho, dynamic_capacity, min_capacity, E)
    n = int(np.count_nonzero(ids >= 0))  # the group's assignments
    if not n:
        return new_ids, new_w, rerouted, cap
    _check_selection(selection)
    # the random selection's keys, one per assignment in np.nonzero's order
    rand = np.random.default_rng(seed).random(n) if selection == "random" else np.zeros(0)
    gw = np.ascontiguousarray(gate_w, np.float64)
    ids64 = np.ascontiguousarray(ids, np.int64)
    g_all, same_rank, score_all = _reroute_inputs(T, E, reroute, rank_of_expert, gates,
                                                  affinity, eta)
    t, r = np.nonzero(ids >= 0)
    e = ids[t, r].astype(np.int64)
    score = np.nan_to_num(gw[t, r], nan=0.0)
    if gates is not None:
        g_max = gates.max(1)
    else:  # the largest recorded combine weight of each token (0 when none is recorded)
        g_max = np.where(ids >= 0, np.nan_to_num(gw, nan=0.0), 0.0).max(1)
    retention = w * g_max  # r(x) = w(x) · max_j G(x)_j
    if selection == "entropy":
        key = -w[t] * score
    elif selection == "retention":
        key = -retention[t]
    elif selection == "router":
        key = -score
    elif selection == "modality-prior":
        key = vis[t].astype(np.float64) * 10.0 - score  # text first, then router score
    else:  # random
        key = rand
    # per expert: priority order (key, then top-k rank, then token), keep while Σw ≤ C_j
    order = np.lexsort((t, r, key, e))
    e_s = e[order]
    cw = w[t[order]]
    start = np.r_[0, np.flatnonzero(np.diff(e_s)) + 1]
    seg_id = np.repeat(np.arange(len(start)), np.diff(np.r_[start, len(order)]))
    csum = np.cumsum(cw)
    before = np.r_[0.0, csum][start][seg_id]
    load_in = csum - before  # cumulative effective load within the expert
    keep = load_in <= cap[e_s] + _EPS
    over = order[~keep]
    load = np.zeros(E)
    np.add.at(load, e_s[keep], cw[keep])
    if not len(over):
        return new_ids, new_w, rerouted, cap
    ot, orr = t[over], r[over]
    new_ids[ot, orr] = -1
    new_w[ot, orr] = 0.0
    if not reroute:
        return new_ids, new_w, rerouted, cap
    room = cap + _EPS - load  # effective load each expert can still take
    # most important overflow first (fail-safe order: the lowest retention goes first)
    first = np.argsort(-retention[ot], kind="stable")
    _reroute()(ot[first].astype(np.int64), orr[first].astype(np.int64), w, ids64, new_ids,
               new_w, rerouted, same_rank, room, score_all, g_all, gw, gates is not None,
               np.float64(0.0), np.float64(0.0), 0)
    return new_ids, new_w, rerouted, cap


def _capacity(w: np.ndarray, vis: np.ndarray, classes: np.ndarray | None,
              capacity_base: float, rho: float, dynamic_capacity: bool, min_capacity: int,
              E: int) -> np.ndarray:
    """float64 [E]: each expert's capacity C_j (steps 2–3 of the module docstring) from the
    semantic weights ``w`` [T] (float64, contiguous) and which tokens are visual (``vis``).
    Both paths of :func:`macs_group` call it."""
    cap = np.full(E, float(capacity_base))
    if dynamic_capacity and classes is not None:
        total = w.sum() if w.shape[0] else 0.0
        r_v = float(w[vis].sum() / total) if total > 0 else 0.0
        cap = cap * (1.0 + float(rho) * np.asarray(classes, np.float64) * (r_v - 0.5))
    return np.maximum(cap, float(min_capacity))


def _same_rank_of(rank_of_expert: np.ndarray | None, E: int) -> np.ndarray:
    """:func:`_same_rank` of the placement's ranks (None: every expert on one rank)."""
    return _same_rank(np.zeros(E, np.int64) if rank_of_expert is None
                      else np.asarray(rank_of_expert))


def _check_selection(selection: str) -> None:
    if selection not in SELECTIONS:
        raise ValueError(f"macs_selection must be one of {', '.join(SELECTIONS)}, not "
                         f"{selection!r}")


def _reroute_inputs(T: int, E: int, reroute: bool, rank_of_expert: np.ndarray | None,
                    gates: np.ndarray | None, affinity: np.ndarray | None, eta: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(g_all, same_rank, score_all)`` as the numpy reference reads them: every expert's
    router probability float64 [T, E] (zeros when unknown and rerouting reads it), which
    experts share a rank [E, E], and rerouting's score of every (token, expert) float64
    [T, E], computed in the gates' own precision (e.g. float32, as the router's
    probabilities come) and then widened."""
    g_all = np.zeros((T, E) if reroute else (0, 0)) if gates is None \
        else np.ascontiguousarray(gates, np.float64)
    same_rank = score_all = np.zeros((0, 0))
    if reroute:
        same_rank = _same_rank_of(rank_of_expert, E)
        score_all = (1.0 - eta) * (gates if gates is not None else g_all)
        if affinity is not None:
            score_all = score_all + eta * affinity
        score_all = np.ascontiguousarray(score_all, np.float64)
    return g_all, same_rank, score_all


def _group_compiled(ids, gate_w, w, vis, classes, capacity_base, rho, dynamic_capacity,
                    min_capacity, selection, seed, reroute, rank_of_expert, gates, affinity,
                    eta, E, new_ids, new_w, rerouted):
    """:func:`macs_group`'s compiled path: the capacity (:func:`_capacity`), then the
    selection and the rerouting in one call of :func:`_select_loop`. Where the router's
    probabilities (and the affinity) are float32, as they come live, the kernel reads them as
    they are and computes rerouting's score S = (1−η)·G + η·cos in float32 for the (token,
    expert) pairs it visits only, where the reference builds the whole [T, E] array and
    widens it: each float32 operation rounds alike, so the same bits (≈ 50 µs a prefill call
    of the embedded model's batch of 8 less). Float64 gates get the reference's arrays."""
    T = ids.shape[0]
    n = int(np.count_nonzero(ids >= 0))  # the group's assignments
    if n:
        _check_selection(selection)
    rand = (np.random.default_rng(seed).random(n) if n and selection == "random"
            else np.zeros(0))
    gw = np.ascontiguousarray(gate_w, np.float64)
    ids64 = np.ascontiguousarray(ids, np.int64)
    cap = _capacity(w, vis, classes, capacity_base, rho, dynamic_capacity, min_capacity, E)
    if reroute and gates is not None and gates.dtype == np.float32 and (
            affinity is None or affinity.dtype == np.float32):
        g_all = np.ascontiguousarray(gates)
        score_all = (np.zeros((0, 0), np.float32) if affinity is None
                     else np.ascontiguousarray(affinity))
        same_rank = _same_rank_of(rank_of_expert, E)
        mode, c1, c2 = 1 if affinity is None else 2, np.float32(1.0 - eta), np.float32(eta)
    else:
        g_all, same_rank, score_all = _reroute_inputs(T, E, reroute, rank_of_expert, gates,
                                                      affinity, eta)
        mode, c1, c2 = 0, np.float64(0.0), np.float64(0.0)
    out_ids = ids64.copy()
    _kernels()[1](ids64, gw, w, vis, cap, SELECTIONS.index(selection) if n else 0, rand,
                  g_all, gates is not None, out_ids, new_w, rerouted, reroute, same_rank,
                  score_all, c1, c2, mode)
    new_ids[:] = out_ids
    return new_ids, new_w, rerouted, cap


def _select_loop(ids, gw, w, vis, cap, selection, rand, g_all, has_gates, new_ids, new_w,
                 rerouted, reroute, same_rank, score_all, c1, c2, mode):
    """Steps 4–5 of the module docstring on one group, compiled (:func:`_kernels`): what
    :func:`macs_group`'s numpy reference does after the capacity, with the same float
    operations in the same order, so the same bits. ``ids``/``gw`` [T, K] the routing and its
    combine weights (float64, NaN: unknown), ``w`` [T], ``vis`` bool [T], ``cap`` [E] in
    effective-load units, ``selection`` an index into :data:`SELECTIONS` (``rand``: the
    random selection's keys, one per assignment in ``np.nonzero``'s order), ``g_all``
    [T, E] every expert's router probability when ``has_gates`` (else zeros or empty).
    Drops the overflow from ``new_ids``/``new_w`` (in place) and, with ``reroute``, moves it
    by :func:`_reroute_loop` (``same_rank``, ``score_all``, ``c1``, ``c2``, ``mode``: its).

    The assignments are enumerated as ``np.nonzero`` does (token, then top-k rank); their
    order within an expert is ``np.lexsort((t, r, key, e))``: a stable counting sort by rank
    then by expert gives (expert, rank, token) order, then a stable sort of each expert's
    keys (NaN last, as lexsort). The effective loads are one running sum over that order
    minus its value where the expert starts, as the reference's ``cumsum`` differences (not a
    fresh sum per expert: those could round differently)."""
    T, K = ids.shape
    E = cap.shape[0]
    n = 0
    for x in range(T):
        for s in range(K):
            if ids[x, s] >= 0:
                n += 1
    t = np.empty(n, np.int64)
    r = np.empty(n, np.int64)
    e = np.empty(n, np.int64)
    key = np.empty(n)
    # r(x) = w(x) · max_j G(x)_j: NaN-propagating as numpy's max; without gates the largest
    # recorded combine weight (NaN as 0, an empty slot 0)
    retention = np.empty(T)
    i = 0
    for x in range(T):
        g = -np.inf
        if has_gates:
            for j in range(g_all.shape[1]):
                v = g_all[x, j]
                if v != v:
                    g = v
                    break
                if v > g:
                    g = v
        for s in range(K):
            v = _NAN_TO_NUM(gw[x, s]) if ids[x, s] >= 0 else 0.0
            if not has_gates and (s == 0 or v > g):
                g = v
            if ids[x, s] < 0:
                continue
            t[i], r[i], e[i] = x, s, ids[x, s]
            if selection == 0:  # entropy: w(x)·G(x)_j, highest first
                key[i] = -w[x] * v
            elif selection == 2:  # router
                key[i] = -v
            elif selection == 3:  # modality-prior: text first, then router score
                key[i] = (10.0 if vis[x] else 0.0) - v
            elif selection == 4:  # random
                key[i] = rand[i]
            i += 1
        retention[x] = w[x] * g
    if selection == 1:  # retention
        for i in range(n):
            key[i] = -retention[t[i]]
    by_r = np.empty(n, np.int64)  # (rank, token) order: stable counting sort by rank
    pos = np.zeros(K + 1, np.int64)
    for i in range(n):
        pos[r[i] + 1] += 1
    for k in range(K):
        pos[k + 1] += pos[k]
    for i in range(n):
        by_r[pos[r[i]]] = i
        pos[r[i]] += 1
    start = np.zeros(E + 1, np.int64)  # then by expert, stably: (expert, rank, token)
    for i in range(n):
        start[e[i] + 1] += 1
    for j in range(E):
        start[j + 1] += start[j]
    fill = start[:E].copy()
    order = np.empty(n, np.int64)
    for i in by_r:
        order[fill[e[i]]] = i
        fill[e[i]] += 1
    tmp = np.empty(n, np.int64)
    for j in range(E):  # each expert's assignments by key, ties kept in (rank, token) order
        _SORT(order[start[j]:start[j + 1]], key, tmp)
    load = np.zeros(E)
    over = np.empty(n, np.int64)
    n_over = 0
    csum = 0.0
    base = 0.0
    for i in range(n):
        a = order[i]
        j = e[a]
        if i == 0 or j != e[order[i - 1]]:
            base = csum  # the running sum where expert j's assignments start
        wa = w[t[a]]
        csum += wa
        if csum - base <= cap[j] + 1e-6:  # _EPS
            load[j] += wa
        else:
            over[n_over] = a
            n_over += 1
            new_ids[t[a], r[a]] = -1
            new_w[t[a], r[a]] = 0.0
    if not reroute or n_over == 0:
        return
    over = over[:n_over]
    fail_safe = key  # reused: the fail-safe order's key of each assignment, −r(x)
    for a in over:
        fail_safe[a] = -retention[t[a]]
    _SORT(over, fail_safe, tmp)
    room = cap + 1e-6 - load
    _REROUTE(t[over], r[over], w, ids, new_ids, new_w, rerouted, same_rank, room, score_all,
             g_all, gw, has_gates, c1, c2, mode)


def _nan_to_num(v):
    """``np.nan_to_num`` of one float64: NaN → 0, ±inf → ± the largest float64."""
    if v != v:
        return 0.0
    if v == np.inf:
        return 1.7976931348623157e308
    if v == -np.inf:
        return -1.7976931348623157e308
    return v


def _sort_by(idx, key, tmp):
    """Sort the indices ``idx`` in place by ``key[idx]`` in numpy's stable argsort's order:
    ascending, NaN last, ties in their order in ``idx``. ``tmp``: int scratch, at least as
    long. A merge sort (insertion-sorted runs of 16, then merged bottom-up) on the caller's
    buffers: numba's ``argsort`` allocates on every call, which cost more than the sorting
    on MACS's many short per-expert runs. ``a`` goes before ``b`` iff ``a < b`` or ``b`` is
    NaN and ``a`` is not."""
    n = idx.shape[0]
    for a in range(0, n, 16):
        b = min(a + 16, n)
        for i in range(a + 1, b):
            v = idx[i]
            kv = key[v]
            j = i - 1
            while j >= a:
                ku = key[idx[j]]
                if not (kv < ku or (ku != ku and kv == kv)):
                    break
                idx[j + 1] = idx[j]
                j -= 1
            idx[j + 1] = v
    src, dst = idx, tmp[:n]
    in_tmp = False
    width = 16
    while width < n:
        for a in range(0, n, 2 * width):
            m, b = min(a + width, n), min(a + 2 * width, n)
            i, j = a, m
            for o in range(a, b):
                if i < m and j < b:
                    ki, kj = key[src[i]], key[src[j]]
                    take_j = kj < ki or (ki != ki and kj == kj)
                else:
                    take_j = i >= m
                if take_j:
                    dst[o] = src[j]
                    j += 1
                else:
                    dst[o] = src[i]
                    i += 1
        src, dst = dst, src
        in_tmp = not in_tmp
        width *= 2
    if in_tmp:
        idx[:] = src


def _reroute_loop(ot, orr, w, ids, new_ids, new_w, rerouted, same_rank, room, score_all, g_all,
                  gw, has_gates, c1, c2, mode):
    """Local semantic rerouting of the overflow assignments ``(ot[i], orr[i])``, in that order
    (step 5 of the module docstring): each one in turn, since each takes room from the expert
    it moves to. Changes ``new_ids``, ``new_w``, ``rerouted`` and ``room`` in place. Compiled
    (:func:`_reroute`): as a Python loop it was most of MACS's cost over top-k (146 ms of a
    1.1 s batch-of-8 run, cProfile). The expert chosen is numpy's ``argmax`` of the masked
    scores: the first highest score, a NaN counting as highest. Only the experts of j's rank
    are visited (in expert order, so the same first), not all E for each assignment.

    The score S of (token x, expert e): ``score_all[x, e]`` (``mode`` 0: float64 [T, E],
    computed by the caller); ``c1·g_all[x, e]`` (1) or ``c1·g_all[x, e] + c2·score_all[x,
    e]`` (2) with ``c1`` = 1−η, ``c2`` = η and ``score_all`` the affinity, in the arrays'
    own precision (float32 live) — what the caller's [T, E] array would hold, for the pairs
    visited only."""
    T, K = ids.shape
    E = room.shape[0]
    peers = np.empty((E, E), np.int64)  # peers[j, :n_peers[j]]: the experts on j's rank
    n_peers = np.zeros(E, np.int64)
    for j in range(E):
        for e in range(E):
            if same_rank[j, e]:
                peers[j, n_peers[j]] = e
                n_peers[j] += 1
    used = np.full(E, -1, np.int64)  # used[e] == i: the i-th assignment's token uses e
    for i in range(ot.shape[0]):
        x, slot = ot[i], orr[i]
        wx = w[x]
        j = ids[x, slot]
        for r in range(K):  # not an expert the token already uses
            if ids[x, r] >= 0:
                used[ids[x, r]] = i
            if new_ids[x, r] >= 0:
                used[new_ids[x, r]] = i
        k = -1
        best = -np.inf
        for p in range(n_peers[j]):
            e = peers[j, p]
            if used[e] == i or not room[e] >= wx:  # no room for it (NaN: none)
                continue
            if mode == 0:
                v = score_all[x, e]
            elif mode == 1:  # (1−η)·G in G's precision (float32)
                v = c1 * g_all[x, e]
            else:  # (1−η)·G + η·cos, each product and the sum rounded to float32
                v = c1 * g_all[x, e] + c2 * score_all[x, e]
            if v != v:  # NaN: numpy's argmax stops at the first
                k = e
                break
            if k < 0 or v > best:
                k, best = e, v
        if k < 0:
            continue  # fail-safe drop
        new_ids[x, slot] = k
        # the router's own scaling of the slot it replaces (e.g. top-k renormalisation)
        gj = g_all[x, j]
        scale = gw[x, slot] / gj if has_gates and gj > 0 else 0.0
        new_w[x, slot] = g_all[x, k] * (scale if scale == scale else 0.0)  # NaN → 0
        rerouted[x, slot] = True
        room[k] -= wx


_REROUTE = _SORT = _NAN_TO_NUM = _SELECT = _PAIRWISE = _ZSCORE = None


def _kernels():
    """``(_reroute_loop, _select_loop, _zscore_loop)`` compiled by numba (cached on disk, as
    the replay kernels are); imported on first use so that this module stays importable
    without numba's start-up. ``_select_loop`` calls the compiled ``_sort_by``,
    ``_nan_to_num`` and ``_reroute_loop``, ``_zscore_loop`` (and itself) ``_pairwise_sum``,
    by their global names, bound here before they compile."""
    global _REROUTE, _SORT, _NAN_TO_NUM, _SELECT, _PAIRWISE, _ZSCORE
    if _SELECT is None:
        from numba import njit

        jit = njit(cache=True, error_model="numpy", boundscheck=False)
        _REROUTE, _SORT, _NAN_TO_NUM = jit(_reroute_loop), jit(_sort_by), jit(_nan_to_num)
        _PAIRWISE = jit(_pairwise_sum)
        _SELECT, _ZSCORE = jit(_select_loop), jit(_zscore_loop)
    return _REROUTE, _SELECT, _ZSCORE


def _reroute():
    """:func:`_reroute_loop` compiled (:func:`_kernels`)."""
    return _kernels()[0]


__all__ = ["SELECTIONS", "DispatchContext", "expert_classes", "semantic_weights",
           "entropy_of_features", "image_groups", "image_runs", "macs_group", "sigmoid"]
