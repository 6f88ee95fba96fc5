"""EPLB (issue 15 §3): our implementation of deepseek-ai/EPLB's algorithm against its README
example and the edge cases vLLM's EPLB meets."""

import numpy as np
import pytest

from workbench.errors import KnobError
from workbench.sim.eplb import (balanced_packing, rebalance_experts, replica_share,
                                replicate_experts)

README_WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
# the README's printed output (deepseek-ai/EPLB, "Interface and Example")
README_PHY2LOG = np.array([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


def test_readme_example():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    np.testing.assert_array_equal(phy2log, README_PHY2LOG)
    assert (logcnt.sum(1) == 16).all()
    for l in range(2):  # log2phy inverts phy2log, -1 padded
        for e in range(12):
            slots = [s for s in log2phy[l, e] if s >= 0]
            assert len(slots) == logcnt[l, e] and all(phy2log[l, s] == e for s in slots)


def _gpu_loads(weight, phy2log, logcnt, gpus):
    share = replica_share(phy2log, logcnt, gpus)
    return np.einsum("le,leg->lg", weight.astype(float), share)


def test_balances_better_than_no_replicas():
    loads = _gpu_loads(README_WEIGHT, *rebalance_experts(README_WEIGHT, 16, 4, 2, 8)[::2], 8)
    np.testing.assert_allclose(loads.sum(1), README_WEIGHT.sum(1))  # every token served
    plain = README_WEIGHT.reshape(2, 4, 3).sum(-1)  # 12 experts on 4 GPUs, contiguous
    assert (loads.max(1) / loads.mean(1) < plain.max(1) / plain.mean(1)).all()


def test_edge_cases_vllm_meets():
    # equal loads: the extra slots go to the first experts, one each; every GPU equal load
    w = np.full((1, 8), 10.0)
    phy2log, _, cnt = rebalance_experts(w, 12, 1, 1, 4)
    assert cnt[0].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    loads = _gpu_loads(w, phy2log, cnt, 4)
    assert loads.max() - loads.min() <= 10.0
    # extreme skew: one expert takes everything: every redundant slot replicates it
    w = np.zeros((1, 8))
    w[0, 3] = 1000.0
    _, _, cnt = rebalance_experts(w, 16, 1, 1, 8)
    assert cnt[0, 3] == 9 and cnt.sum() == 16
    # experts not divisible by the GPUs (12 experts, 8 GPUs): 16 slots, global policy
    w = README_WEIGHT[:1].astype(float)
    phy2log, _, cnt = rebalance_experts(w, 16, 3, 2, 8)  # 2 nodes do not divide 3 groups
    assert sorted(set(phy2log[0].tolist())) == list(range(12))
    assert _gpu_loads(w, phy2log, cnt, 8).sum() == pytest.approx(w.sum())


def test_building_blocks():
    pack, rank = balanced_packing(np.array([[5.0, 1, 4, 2]]), 2)
    assert pack.tolist() == [[0, 0, 1, 1]] and rank.tolist() == [[0, 1, 0, 1]]  # 5+1 | 4+2
    # 6/1 is the largest load per replica, then 6/2 = 3 ties with expert 2's 3/1: the first
    phy2log, r, cnt = replicate_experts(np.array([[6.0, 2.0, 3.0]]), 5)
    assert phy2log.tolist() == [[0, 1, 2, 0, 0]] and cnt.tolist() == [[3, 1, 1]]
    assert r.tolist() == [[0, 0, 0, 1, 2]]


@pytest.mark.parametrize("args, fragment", [
    ((README_WEIGHT, 10, 4, 2, 8), "at least the 12 experts"),
    ((README_WEIGHT, 18, 4, 2, 8), "multiple of the 8 GPUs"),
    ((README_WEIGHT, 16, 4, 3, 8), "multiple of num_nodes"),
    ((README_WEIGHT, 16, 5, 1, 8), "must divide the 12 experts"),
    ((-README_WEIGHT, 16, 4, 2, 8), "finite, ≥ 0"),
])
def test_bad_sizes_are_refused(args, fragment):
    with pytest.raises(KnobError, match=None) as e:
        rebalance_experts(*args)
    assert fragment in str(e.value)
