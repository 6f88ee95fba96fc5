"""MoE-Prism's partition solver and proxy gate (issue 16 §1): hand-built activations."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from workbench.errors import InputError
from workbench.prism import partition as P


def test_objective_by_hand():
    # 2 tokens, 4 neurons, 2 sub-experts of 2; K = 1: each token loses its smaller group
    M = np.array([[1.0, -2.0, 0.5, 0.0], [0.0, 1.0, 3.0, -1.0]])
    a = np.array([0, 0, 1, 1])  # L = [[3, 0.5], [1, 4]] → 0.5 + 1
    assert P.objective(M, a, 2, 1) == pytest.approx(1.5)
    assert P.objective(M, np.array([0, 1, 0, 1]), 2, 1) == pytest.approx(min(1.5, 2) + min(3, 2))
    assert P.objective(M, a, 2, 0) == 0.0


def test_greedy_balances_impact_with_equal_sizes():
    M = np.array([[8.0, 7, 1, 1, 1, 1]])
    g = P.greedy(M, 2)
    assert np.bincount(g).tolist() == [3, 3]
    assert g[0] != g[1]  # the two heaviest in different groups (lowest load first)


def test_annealing_finds_the_optimum_of_a_small_case_and_never_worsens():
    """C = 8 into 2 groups: every balanced partition enumerated; the annealer's result is
    the optimum (or ties it) and never worse than its greedy start; the result is balanced."""
    rng = np.random.default_rng(3)
    M = rng.standard_normal((40, 8)) * (rng.random((40, 8)) < 0.4)
    best = min(P.objective(M, np.array([int(i in c) for i in range(8)]), 2, 1)
               for c in itertools.combinations(range(8), 4))
    g = P.greedy(M, 2)
    a = P.anneal(M, g, 2, 1, iterations=20_000, seed=1)
    assert np.bincount(a).tolist() == [4, 4]
    assert P.objective(M, a, 2, 1) == pytest.approx(best)
    assert P.objective(M, a, 2, 1) <= P.objective(M, g, 2, 1)


def test_structure_is_recovered_and_beats_the_baselines():
    """Neurons in 4 blocks, each token active on one block: the best partition puts each
    block in one sub-expert (objective 0 with K = 3); annealing finds it, contiguous-by-id
    and random partitions of shuffled ids do not."""
    rng = np.random.default_rng(0)
    C, N, B = 32, 4, 200
    block = rng.permutation(np.repeat(np.arange(N), C // N))
    M = np.zeros((B, C))
    for b in range(B):
        cols = block == rng.integers(N)
        M[b, cols] = rng.gamma(2.0, 1.0, cols.sum())
    a = P.anneal_many([M], N, 3, iterations=50_000)[0]
    assert P.objective(M, a, N, 3) == pytest.approx(0.0, abs=1e-9)
    assert P.objective(M, P.contiguous(C, N), N, 3) > 0
    assert P.objective(M, P.random_partition(C, N, 1), N, 3) > 0
    perm = P.permutation(a, N)
    assert sorted(perm.tolist()) == list(range(C))
    assert (np.diff(a[perm]) >= 0).all()  # sub-expert n is a contiguous slice


def test_gate_neurons_are_the_most_co_active_of_their_sub_expert():
    # neurons 0-3 in group 0: 0, 1, 2 always fire together, 3 alone; group 1: 4-7
    M = np.zeros((6, 8))
    M[:3, [0, 1, 2]] = 1.0
    M[3:, 3] = 1.0
    M[:, 4:] = np.array([1.0, 0.9, 0.1, 0.05])
    g = P.gate_neurons(M, np.array([0, 0, 0, 0, 1, 1, 1, 1]), 2, r=2, active=3 / 8)
    assert set(g[0]) <= {0, 1, 2} and set(g[1]) == {4, 5}
    s = P.proxy_scores(M, g)
    assert s.shape == (6, 2) and s[0, 0] == pytest.approx(1.0) and s[4, 0] == 0.0


@pytest.mark.parametrize("args, fragment", [
    ((np.ones((2, 6)), 4), "dividing the 6 neurons"),
    ((np.ones((2, 8)), 0), "whole number ≥ 1"),
    ((np.ones((2, 8)), True), "whole number ≥ 1"),
    ((np.full((2, 8), np.nan), 2), "finite"),
    ((np.ones(8), 2), r"\[tokens, neurons\]"),
])
def test_bad_input_is_refused(args, fragment):
    with pytest.raises(InputError, match=fragment):
        P.greedy(*args)


def test_bad_k_and_assignments_are_refused():
    M = np.ones((2, 8))
    with pytest.raises(InputError, match=r"K must be in 0 … 3"):
        P.objective(M, P.contiguous(8, 4), 4, 4)
    with pytest.raises(InputError, match="each of the 4 sub-experts 2"):
        P.anneal(M, np.zeros(8, np.int64), 4)
    with pytest.raises(InputError, match="gate neurons r must be in 1 … 2"):
        P.gate_neurons(M, P.contiguous(8, 4), 4, r=3)
    with pytest.raises(InputError, match="one expert shape"):
        P.anneal_many([np.ones((2, 8)), np.ones((2, 4))], 2)
