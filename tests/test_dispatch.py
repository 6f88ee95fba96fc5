"""Capacity-aware dispatch (issue 14, §3): the `dispatch` registry, CAI-MoE Token Drop on
traces, its invariants as property tests, and its effect in replay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import distinct_ids
from workbench.errors import KnobError
from workbench.knobs import Knobs
from workbench.replay import replay_trace
from workbench.sim.dispatch import DISPATCH, CapacityDrop, check_capacity, dispatch_trace
from workbench.traces import Trace


def _trace(T=200, L=3, E=8, K=2, seed=0, weights=True, p_step=0.3) -> Trace:
    rng = np.random.default_rng(seed)
    ids = distinct_ids(rng, (T, L, K), E, none_share=0.1)
    w = np.where(ids >= 0, rng.random(ids.shape), np.nan).astype(np.float32) if weights else None
    steps = np.cumsum(rng.random(T) < p_step)
    mod = (rng.random(T) < 0.5).astype(np.int8)
    return Trace(topk_ids=ids, token_step=steps - steps[0], num_experts=E, topk_weights=w,
                 token_modality=mod)


def _capacity(tr: Trace, pol: CapacityDrop) -> np.ndarray:
    S, L = tr.num_steps, tr.num_layers
    n = np.zeros((S, L), np.int64)
    np.add.at(n, tr.token_step, (tr.topk_ids >= 0).any(axis=2).astype(np.int64))
    return pol.capacity(n, tr.top_k, tr.num_experts)


def test_registry_and_knobs():
    assert DISPATCH.available()[:2] == ["topk", "capacity-drop"]
    k = Knobs(dispatch="capacity-drop", capacity_factor=0.5)
    assert k.dispatch == "capacity-drop" and k.capacity_factor == 0.5
    for bad in (dict(capacity_factor=0), dict(capacity_factor=-1), dict(min_capacity=-1),
                dict(dispatch="nope")):
        with pytest.raises(KnobError):
            Knobs(**bad)


def test_token_drop_keeps_the_highest_scores_by_hand():
    """One step, one layer, 4 experts, top-1, 4 tokens all on expert 2 with scores
    .1 .9 .5 .7; γ0 = 1: C = ⌈1·4·1/4⌉ = 1, so only token 1 (score .9) stays."""
    ids = np.array([[[2]], [[2]], [[2]], [[2]]], np.int16)
    w = np.array([[[.1]], [[.9]], [[.5]], [[.7]]], np.float32)
    out = CapacityDrop(1.0).apply(ids, w, np.zeros(4, np.int64), 4)
    np.testing.assert_array_equal(out[:, 0, 0], [-1, 2, -1, -1])
    out = CapacityDrop(2.0).apply(ids, w, np.zeros(4, np.int64), 4)  # C = 2: .9 and .7
    np.testing.assert_array_equal(out[:, 0, 0], [-1, 2, -1, 2])
    # without weights: the top-k rank, then the token, decides
    ids2 = np.array([[[2, 1]], [[1, 2]], [[2, 0]]], np.int16)
    nan = np.full(ids2.shape, np.nan, np.float32)
    out = CapacityDrop(1.0, min_capacity=1).apply(ids2, nan, np.zeros(3, np.int64), 3)
    # C = ⌈3·2/3⌉ = 2 per expert; expert 2 has (t0, rank 0), (t1, rank 1), (t2, rank 0):
    # the two rank-0 assignments stay, t1's rank-1 one is dropped
    np.testing.assert_array_equal(out[:, 0], [[2, 1], [1, -1], [2, 0]])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), gamma=st.sampled_from([0.05, 0.25, 0.5, 1.0, 1.8, 5.0]),
       min_cap=st.integers(0, 3), weights=st.booleans(), E=st.integers(2, 12),
       K=st.integers(1, 3))
def test_token_drop_invariants(seed, gamma, min_cap, weights, E, K):
    K = min(K, E)
    tr = _trace(T=60, L=2, E=E, K=K, seed=seed, weights=weights)
    pol = CapacityDrop(gamma, min_cap)
    out, stats = dispatch_trace(tr, pol, chunk_accesses=17)
    r = stats.result(("text", "image", "video"))
    # kept + rerouted + dropped = assigned; a dropped slot was routed; nothing new routed
    assert r["kept"] + r["rerouted"] + r["dropped"] == r["assigned"] == int((tr.topk_ids >= 0).sum())
    assert r["kept"] == int((out.topk_ids >= 0).sum())
    assert np.all((out.topk_ids == tr.topk_ids) | (out.topk_ids == -1))
    # no expert over its capacity in any (step, layer)
    check_capacity(out.topk_ids, out.token_step, E, _capacity(tr, pol))
    # deterministic, chunking aside
    again, _ = dispatch_trace(tr, pol)
    np.testing.assert_array_equal(again.topk_ids, out.topk_ids)
    assert r["max_expert_load_after"] <= r["max_expert_load_before"]
    if "by_modality" in r:
        total = sum(v["assigned"] for v in r["by_modality"].values())
        assert total == r["assigned"]


def test_a_capacity_nobody_reaches_equals_topk():
    tr = _trace(seed=3)
    out, stats = dispatch_trace(tr, CapacityDrop(capacity_factor=100.0))
    np.testing.assert_array_equal(out.topk_ids, tr.topk_ids)
    assert stats.dropped == 0
    a = replay_trace(tr, belady=False, cache_slots=6, pinned_layers=0)
    b = replay_trace(tr, belady=False, cache_slots=6, pinned_layers=0, dispatch="capacity-drop",
                     capacity_factor=100.0)
    assert a.metrics()["hits"] == b.metrics()["hits"]
    assert b.extra["dispatch"]["drop_rate"] == 0.0


def test_replay_with_token_drop_reports_drops_and_lowers_the_straggler(tmp_path, capsys):
    """A tight capacity drops assignments; the replay's cache and EP figures are those of the
    dispatched routing (fewer accesses, a smaller busiest rank)."""
    from workbench.cli import main

    tr = _trace(T=600, L=4, E=8, K=2, seed=5, p_step=0.05)  # ~20 tokens a step
    base = replay_trace(tr, belady=False, ep_ranks=4, cache_slots=8, pinned_layers=0)
    drop = replay_trace(tr, belady=False, ep_ranks=4, cache_slots=8, pinned_layers=0,
                        dispatch="capacity-drop", capacity_factor=0.5)
    d = drop.extra["dispatch"]
    assert 0 < d["drop_rate"] < 1 and d["max_expert_load_after"] < d["max_expert_load_before"]
    assert set(d["by_modality"]) == {"text", "image"}
    assert drop.metrics()["accesses"] <= base.metrics()["accesses"]
    assert drop.extra["ep"]["mean_max_rank_load"] < base.extra["ep"]["mean_max_rank_load"]
    p = tmp_path / "t.npy"
    np.save(p, tr.topk_ids)
    assert main(["replay", str(p), "--set", "dispatch=capacity-drop", "--set",
                 "capacity_factor=0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dispatch"]["policy"] == "capacity-drop" and out["dispatch"]["dropped"] >= 0


def test_live_runs_refuse_a_dispatch_until_it_runs_inside_the_model():
    from workbench.knobs import ModelShape

    k = Knobs(dispatch="capacity-drop")
    with pytest.raises(KnobError, match="dispatch 'capacity-drop'"):
        k.check(ModelShape(num_layers=4, top_k=2, num_experts=8), live=True)
    k.check(ModelShape(num_layers=4, top_k=2, num_experts=8), live=False)
