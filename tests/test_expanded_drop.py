"""CAI-MoE Expanded Drop (``dispatch=capacity-expanded``, issue 14 §3): candidates = top-k +
the local device's experts, every expert keeps its C most probable candidates."""

import numpy as np
import pytest

import workbench
from workbench.errors import KnobError
from workbench.sim.dispatch import expanded_group


def _case(seed, T=20, K=2, E=8):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    ids[rng.random(T) < 0.1] = -1  # rows that are no token
    gates = rng.random((T, E))
    gates /= gates.sum(1, keepdims=True)
    return ids, gates


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_every_expert_keeps_at_most_c_of_its_candidates(ranks):
    E = 8
    roe = (np.arange(E) * ranks) // E
    for seed in range(30):
        ids, gates = _case(seed)
        cap = float(1 + seed % 4)
        new, w = expanded_group(ids, gates, cap, roe, renormalise=True)
        T, K = ids.shape
        load = np.bincount(new[new >= 0], minlength=E)
        assert (load <= cap).all()
        real = (ids >= 0).any(1)
        assert (new[~real] < 0).all()
        # own slots: the token's expert or -1; gained experts are local to its source rank
        assert ((new[:, :K] == ids) | (new[:, :K] == -1)).all()
        pos = np.cumsum(real) - 1
        src = (pos * ranks) // max(int(real.sum()), 1)
        for t, c in zip(*np.nonzero(new[:, K:] >= 0)):
            e = new[t, K + c]
            assert roe[e] == src[t] and e not in ids[t]
        # each expert keeps its most probable candidates: a dropped candidate never beats a kept one
        for e in range(E):
            kept = [t for t in range(T) if e in new[t]]
            if len(kept) == cap:
                cands = [t for t in range(T) if real[t] and (e in ids[t] or roe[e] == src[t])]
                lost = set(cands) - set(kept)
                assert all(gates[t, e] <= min(gates[kept, e]) for t in lost)
        s = w.sum(1)
        has = (new >= 0).any(1)
        np.testing.assert_allclose(s[has], 1.0, rtol=1e-9)


def test_ample_capacity_keeps_every_candidate():
    ids, gates = _case(1, T=10)
    E = 8
    new, _ = expanded_group(ids, gates, 1000.0, np.zeros(E, np.int64), renormalise=False)
    real = (ids >= 0).any(1)
    assert ((new >= 0).sum(1)[real] == E).all()  # one rank: every expert is local


def test_live_expanded_drop_and_replay_refusal(embedded, tmp_path):
    rt = workbench.Runtime(embedded, max_new_tokens=4)
    reqs = workbench.mixed_batch(4, text_share=0.5, seed=2)
    res = rt.run(reqs, store=tmp_path / "e.zarr", dispatch="capacity-expanded",
                 capacity_factor=1.0, ep_ranks=8)
    assert res.dispatch_added > 0 and res.dispatch_dropped > 0
    assert "added" in res.summary()
    ds = workbench.open_run(res.store)
    lay = embedded.layout
    assert ds.sizes["k"] == lay.top_k + lay.num_experts // 8
    routed = int(ds["routed_tokens"].sum())
    assert routed == res.dispatch_assigned - res.dispatch_dropped + res.dispatch_added
    from workbench.replay import replay_trace
    from workbench.traces import Trace, load_trace

    tr = load_trace(res.store)
    plain = Trace(topk_ids=tr.topk_ids, token_step=tr.token_step, num_experts=tr.num_experts)
    with pytest.raises(KnobError, match="needs every expert's router probability"):
        replay_trace(plain, dispatch="capacity-expanded", capacity_factor=2.0)


def test_an_expanded_drop_store_replays_with_its_own_knobs(embedded, tmp_path):
    """The store's k widens past E with one rank (k + E): replay needs at most E slots at a
    time, so the run's own cache size replays (review finding)."""
    from workbench.replay import replay_trace

    rt = workbench.Runtime(embedded, max_new_tokens=3)
    res = rt.run("describe the scene.", images=["data/demo/scene_1.png"],
                 store=tmp_path / "ce.zarr", dispatch="capacity-expanded", cache_slots=64)
    ds = workbench.open_run(res.store)
    assert ds.sizes["k"] > 64
    r = replay_trace(ds)
    np.testing.assert_array_equal(r.hits, ds["hits"].values)
