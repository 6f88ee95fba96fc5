"""MoE-Prism's partition solver (issue 16 §1; seed 001 §4.2): split an expert's C neurons into N
equal sub-experts so that dropping some of them loses as little as possible.

A *neuron* j of an expert is column j of its fused gate/up projection with row j of its down
projection, so the sub-experts' outputs sum exactly to the expert's. ``M`` [B, C] holds the
neurons' activations act(x·W_gate) ⊙ (x·W_up) over B calibration tokens routed to the expert.
For a partition ``assign`` (neuron → sub-expert 0 … N−1, each sub-expert exactly C/N neurons:
then sub-expert n is one contiguous slice of the permuted fused tensors), token b's sub-expert
norms are L[b, n] = ‖M[b, S_n]‖₁ and the objective (seed eq. 2) is

    Σ_b  (sum of the K smallest of L[b, 0 … N−1])

— the activation mass lost when each token drops its K least active sub-experts; lower is
better. The seed names K "the de-activated sub-experts" without a value; the default here is
K = N // 2 (half of each expert dropped: the middle of the operating range), a setting.

Solver: **greedy** initialisation (neurons by total impact Σ_b |M[b, j]|, most impactful first,
each to the sub-expert with the lowest cumulative impact that still has room), then
**simulated annealing** by swapping two neurons of different sub-expert (sizes stay equal):
a swap that lowers the objective is always taken, one that raises it by Δ with probability
exp(−Δ / T); T starts at ``t0`` (seed: 100) and is multiplied by ``cooling`` (0.995) after every
iteration (seed: 100 000 iterations); the best partition seen is returned. The objective is
computed on |M| scaled so that its mean token L1 norm is 1 (the temperature then means the same
for every expert whatever its activation scale). Compiled with numba: one swap is
O(B × N) (the two changed norms of every token, then its K smallest), and many experts anneal
in parallel (:func:`anneal_many`).
"""

from __future__ import annotations

import numpy as np

from workbench.errors import InputError

T0, COOLING, ITERATIONS = 100.0, 0.995, 100_000


def check_problem(M: np.ndarray, N: int, K: int | None) -> tuple[np.ndarray, int]:
    M = np.asarray(M)
    if M.ndim != 2 or M.shape[1] == 0:
        raise InputError(f"activations must be [tokens, neurons] with neurons, not {M.shape}")
    if not np.isfinite(M).all():
        raise InputError("activations must be finite")
    C = M.shape[1]
    if isinstance(N, bool) or not isinstance(N, (int, np.integer)) or N < 1 or C % N:
        raise InputError(f"subexperts must be a whole number ≥ 1 dividing the {C} neurons, "
                         f"not {N!r}")
    K = N // 2 if K is None else K
    if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or not 0 <= K < N:
        raise InputError(f"the de-activated sub-experts K must be in 0 … {N - 1}, not {K!r}")
    return M, int(K)


def normalised(M: np.ndarray) -> np.ndarray:
    """|M| as float64, scaled so that its mean token L1 norm is 1 (all zeros stay zeros)."""
    A = np.abs(np.asarray(M, np.float64))
    mean = A.sum(1).mean() if A.size else 0.0
    return A / mean if mean > 0 else A


def objective(M: np.ndarray, assign: np.ndarray, N: int, K: int | None = None) -> float:
    """The module docstring's objective of partition ``assign`` [C] on |M| (as given: not
    normalised)."""
    M, K = check_problem(M, N, K)
    A = np.abs(np.asarray(M, np.float64))
    L = np.zeros((A.shape[0], N))
    for n in range(N):
        L[:, n] = A[:, np.asarray(assign) == n].sum(1)
    return float(np.sort(L, axis=1)[:, :K].sum())


def greedy(M: np.ndarray, N: int) -> np.ndarray:
    """The greedy initial partition (module docstring): int64 [C], N groups of C/N."""
    M, _ = check_problem(M, N, None)
    impact = np.abs(np.asarray(M, np.float64)).sum(0)
    C = M.shape[1]
    size = C // N
    load = np.zeros(N)
    room = np.full(N, size)
    assign = np.empty(C, np.int64)
    for j in np.argsort(-impact, kind="stable"):
        open_ = np.nonzero(room > 0)[0]
        n = open_[np.argmin(load[open_])]
        assign[j] = n
        load[n] += impact[j]
        room[n] -= 1
    return assign


def contiguous(C: int, N: int) -> np.ndarray:
    """The trivial partition: neurons in id order, C/N a sub-expert."""
    return np.arange(C, dtype=np.int64) // (C // N)


def random_partition(C: int, N: int, seed: int = 0) -> np.ndarray:
    """A random partition into N groups of C/N."""
    return np.random.default_rng(seed).permutation(contiguous(C, N))


def _kernels():
    """The compiled annealer (numba, cached on disk like the replay kernels and reused by
    later processes: see :mod:`workbench.prism.anneal`)."""
    from workbench.prism import anneal

    return anneal.anneal_one, anneal.anneal_batch


_COMPILED = None


def _compiled():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = _kernels()
    return _COMPILED


def anneal(M: np.ndarray, assign: np.ndarray, N: int, K: int | None = None, *,
           t0: float = T0, cooling: float = COOLING, iterations: int = ITERATIONS,
           seed: int = 0) -> np.ndarray:
    """Simulated annealing from ``assign`` (module docstring): the best partition seen."""
    M, K = check_problem(M, N, K)
    assign = np.asarray(assign, np.int64)
    if assign.shape != (M.shape[1],) or (np.bincount(assign, minlength=N)
                                         != M.shape[1] // N).any():
        raise InputError(f"assign must give each of the {N} sub-experts {M.shape[1] // N} of "
                         f"the {M.shape[1]} neurons")
    one, _ = _compiled()
    return one(normalised(M), assign, N, K, float(t0), float(cooling), int(iterations),
               int(seed))


def anneal_many(Ms: list[np.ndarray], N: int, K: int | None = None, *, t0: float = T0,
                cooling: float = COOLING, iterations: int = ITERATIONS, seed: int = 0,
                progress=None) -> list[np.ndarray]:
    """Greedy then annealing for every expert of ``Ms`` (each [B_e, C], one C), in parallel
    over the experts (numba threads). Returns each expert's partition [C].

    With ``progress`` the experts go in chunks (several per numba thread, so the threads stay
    busy) and ``progress("annealing experts", done, len(Ms))`` follows each chunk; an expert's
    result depends only on its own seed, so chunking changes no partition."""
    if not Ms:
        return []
    Ms = [check_problem(M, N, K)[0] for M in Ms]
    if progress is not None:   # the bar starts before the greedy starts, which take a while
        progress("annealing experts", 0, len(Ms))
    K = N // 2 if K is None else int(K)
    C = Ms[0].shape[1]
    if any(M.shape[1] != C for M in Ms):
        raise InputError("every expert must have the same neurons (one expert shape)")
    A = [normalised(M) for M in Ms]
    offsets = np.zeros(len(A) + 1, np.int64)
    offsets[1:] = np.cumsum([a.size for a in A])
    flat = np.concatenate([a.ravel() for a in A]) if offsets[-1] else np.zeros(0)
    assigns = np.stack([greedy(M, N) for M in Ms])
    seeds = np.arange(len(Ms), dtype=np.int64) + int(seed) * 1_000_003
    _, batch = _compiled()
    n = len(Ms)
    step = n if progress is None else max(64, 8 * _threads())
    out = []
    for a in range(0, n, step):
        b = min(a + step, n)
        out.extend(batch(flat, offsets[a:b + 1], C, assigns[a:b], N, K, float(t0),
                         float(cooling), int(iterations), seeds[a:b]))
        if progress is not None:
            progress("annealing experts", b, n)
    return out


def _threads() -> int:
    import numba

    return int(numba.get_num_threads())


def gate_neurons(M: np.ndarray, assign: np.ndarray, N: int, r: int = 4,
                 active: float = 0.75) -> np.ndarray:
    """The training-free proxy gate (seed 001 §4.3.1): int64 [N, r] — per sub-expert its r
    most *central* neurons. B[t, c] = 1 when |M[t, c]| is among the k_a = ⌈active · C⌉ largest of
    token t's row (seed: k_a = ¾ of the neurons, r = 4); the co-activation C_co = BᵀB; a neuron's
    centrality is its co-activation summed over the other neurons of its own sub-expert; ties go
    to the lower neuron id. A sub-expert's score for a token is then the mean |activation| of its
    gate neurons (:func:`proxy_scores`)."""
    M, _ = check_problem(M, N, None)
    C = M.shape[1]
    assign = np.asarray(assign, np.int64)
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 1 <= r <= C // N:
        raise InputError(f"gate neurons r must be in 1 … {C // N} (a sub-expert's neurons), "
                         f"not {r!r}")
    if not (isinstance(active, (int, float)) and 0 < active <= 1):
        raise InputError(f"active (k_a as a share of the neurons) must be in (0, 1], not "
                         f"{active!r}")
    ka = max(1, int(np.ceil(active * C)))
    A = np.abs(np.asarray(M, np.float64))
    Bm = np.zeros(A.shape, np.float64)
    if A.shape[0]:
        top = np.argpartition(-A, ka - 1, axis=1)[:, :ka]
        np.put_along_axis(Bm, top, 1.0, axis=1)
    co = Bm.T @ Bm
    np.fill_diagonal(co, 0.0)
    out = np.empty((N, r), np.int64)
    for n in range(N):
        members = np.nonzero(assign == n)[0]
        central = co[np.ix_(members, members)].sum(1)
        order = np.lexsort((members, -central))  # most central first, then lower id
        out[n] = members[order[:r]]
    return out


def proxy_scores(activations: np.ndarray, gates: np.ndarray) -> np.ndarray:
    """[T, N]: each sub-expert's proxy score per token — the mean |activation| of its gate
    neurons (``activations`` [T, C]: act(x·W_gate) ⊙ (x·W_up) of those neurons at least)."""
    a = np.abs(np.asarray(activations, np.float64))
    return a[:, np.asarray(gates)].mean(-1)


def permutation(assign: np.ndarray, N: int) -> np.ndarray:
    """The neuron order that makes sub-expert n the contiguous slice n·C/N … (n+1)·C/N − 1
    (stable within a sub-expert)."""
    return np.argsort(np.asarray(assign), kind="stable")


__all__ = ["T0", "COOLING", "ITERATIONS", "anneal", "anneal_many", "contiguous",
           "gate_neurons", "greedy", "normalised", "objective", "permutation", "proxy_scores",
           "random_partition"]
