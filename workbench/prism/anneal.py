"""The compiled annealer of :mod:`workbench.prism.partition` (numba), imported only when a
partition is annealed (importing the solver does not import numba).

The kernels are module-level functions so that numba's on-disk cache (``cache=True``) is reused
by every later process: a kernel defined in a closure, calling another closure's dispatcher,
gets a cache key that differs per process (numba hashes the pickled closure cells, and a
dispatcher pickles with a per-process id), so each run recompiled it (seconds) and added a new
cache entry that nothing read again."""

import numba
import numpy as np

@numba.njit(cache=True, inline="always")
def k_smallest(vals, tmp, K):
    # the sum of the K smallest of a few values: insertion sort into scratch ``tmp``
    n = vals.shape[0]
    for i in range(n):
        x = vals[i]
        j = i - 1
        while j >= 0 and tmp[j] > x:
            tmp[j + 1] = tmp[j]
            j -= 1
        tmp[j + 1] = x
    s = 0.0
    for i in range(K):
        s += tmp[i]
    return s


@numba.njit(cache=True)
def anneal_one(A, assign, N, K, t0, cooling, iters, seed):
    B, C = A.shape
    np.random.seed(seed)
    L = np.zeros((B, N))
    for b in range(B):
        for j in range(C):
            L[b, assign[j]] += A[b, j]
    tmp = np.empty(N)
    row = np.empty(N)
    lost = np.empty(B)  # each token's current K smallest
    cur = 0.0
    for b in range(B):
        lost[b] = k_smallest(L[b], tmp, K)
        cur += lost[b]
    best = cur
    assign = assign.copy()
    best_assign = assign.copy()
    T = t0
    for _ in range(iters):
        i = np.random.randint(C)
        j = np.random.randint(C)
        gi, gj = assign[i], assign[j]
        if gi != gj:
            delta = 0.0
            for b in range(B):
                d = A[b, j] - A[b, i]  # neuron i leaves gi for gj, j the other way
                if d != 0.0:
                    for n in range(N):
                        row[n] = L[b, n]
                    row[gi] += d
                    row[gj] -= d
                    delta += k_smallest(row, tmp, K) - lost[b]
            if delta <= 0.0 or (T > 0.0 and np.random.random() < np.exp(-delta / T)):
                for b in range(B):
                    d = A[b, j] - A[b, i]
                    if d != 0.0:
                        L[b, gi] += d
                        L[b, gj] -= d
                        lost[b] = k_smallest(L[b], tmp, K)
                assign[i], assign[j] = gj, gi
                cur += delta
                if cur < best - 1e-12:
                    best = cur
                    best_assign[:] = assign
        T *= cooling
    return best_assign


@numba.njit(cache=True, parallel=True)
def anneal_batch(A_flat, offsets, C, assigns, N, K, t0, cooling, iters, seeds):
    out = np.empty_like(assigns)
    for e in numba.prange(assigns.shape[0]):
        A = A_flat[offsets[e]:offsets[e + 1]].reshape(-1, C)
        out[e] = anneal_one(A, assigns[e], N, K, t0, cooling, iters, seeds[e])
    return out
