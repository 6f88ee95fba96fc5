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


def test_eplb_over_time_fits_on_the_past_and_balances_stationary_traffic():
    from workbench.sim.eplb_replay import eplb_over_time

    rng = np.random.default_rng(0)
    S, L = 40, 2  # steps, layers (8 experts: len(p))
    p = np.array([0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    counts = np.stack([[rng.multinomial(64, p) for _ in range(L)] for _ in range(S)])
    r = eplb_over_time(counts, ranks=4, redundant=4, window=10, interval=10)
    s = r.summary()
    assert s["rebalances"] == 3 and [b["step"] for b in r.rebalances] == [10, 20, 30]
    assert s["eplb_imbalance_after_first_fit"] < s["static_imbalance_after_first_fit"]
    np.testing.assert_allclose(r.load.sum(-1), counts.sum(-1))  # every token served
    # the plan serving steps 20…29 is the one fitted on steps 10…19, nothing later
    phy2log, _, cnt = rebalance_experts(counts[10:20].sum(0).astype(float), 12, 1, 1, 4)
    want = np.einsum("sle,leg->slg", counts[20:30].astype(float), replica_share(phy2log, cnt, 4))
    np.testing.assert_allclose(r.load[20:30], want)
    # the first plan moves what differs from the static layout (rank r: experts 2r, 2r + 1
    # and an empty redundant slot); later plans only what changed
    first, _, _ = rebalance_experts(counts[0:10].sum(0).astype(float), 12, 1, 1, 4)
    static = np.tile([0, 1, -1, 2, 3, -1, 4, 5, -1, 6, 7, -1], (L, 1))
    from collections import Counter

    def received(new, old):  # expert copies a rank holds now beyond those it held
        return sum(sum((Counter(n) - Counter(o)).values()) for n, o in
                   zip(new.reshape(L, 4, 3).reshape(-1, 3), old.reshape(L, 4, 3).reshape(-1, 3)))

    assert r.rebalances[0]["experts_moved"] == received(first, static) >= 2 * L
    assert all(b["experts_moved"] <= L * 12 for b in r.rebalances[1:])


def test_eplb_over_time_cannot_foresee_a_shift():
    """Traffic that moves from expert 0 to expert 7 at step 20: the plan fitted on steps
    10…19 replicates expert 0 and serves the new traffic no better than it served the old."""
    from workbench.sim.eplb_replay import eplb_over_time

    S, L, E = 30, 1, 8
    counts = np.ones((S, L, E)) * 2
    counts[:20, 0, 0] = 40
    counts[20:, 0, 7] = 40
    r = eplb_over_time(counts, ranks=4, redundant=4, window=10, interval=10)
    before = np.nanmean(r.eplb_imbalance[10:20])
    after = np.nanmean(r.eplb_imbalance[20:30])
    assert before < np.nanmean(r.static_imbalance[10:20]) and after > before
    class Link:  # a 1 GB/s link with 1 ms latency
        latency_s, bandwidth = 1e-3, 1e9
    r = eplb_over_time(counts, 4, 4, 10, 10, expert_bytes=1e6, link=Link())
    b = r.rebalances[0]
    assert b["bytes"] == b["experts_moved"] * 1e6 and b["seconds"] == pytest.approx(1e-3 + 3e6 / 1e9)


def test_ds_moe_eplb_on_a_run(embedded, tmp_path):
    import workbench

    rt = workbench.Runtime(embedded, max_new_tokens=12, ignore_eos=True)
    res = rt.run(workbench.batch(4, seed=2), store=tmp_path / "b.zarr", ep_ranks=4)
    ds = workbench.open_run(res.store)
    r = ds.moe.eplb(redundant=4, window=4, interval=4)
    s = r.summary()
    assert s["rebalances"] == 2 and s["bytes_moved"] > 0 and s["rebalance_s_modeled"] > 0
    np.testing.assert_allclose(r.load.sum(-1), ds["routed_tokens"].sum(("expert", "modality")))
    np.testing.assert_allclose(r.static_imbalance, ds.moe.ep_imbalance(4).values)
    with pytest.raises(workbench.WorkbenchError, match="window must be a whole number"):
        ds.moe.eplb(redundant=4, window=0)
    with pytest.raises(KnobError, match=r"multiple of ep_ranks \(4\)"):
        ds.moe.eplb(redundant=3)


def test_ds_moe_eplb_prices_the_replicas_on_the_ep_clock(embedded, tmp_path):
    """With no rebalance in the run, EPLB's clock is the static EP clock exactly; with
    replicas, every replica reads its weights (compute summed over ranks grows) and each
    rebalance step carries its modeled weight movement."""
    import workbench

    rt = workbench.Runtime(embedded, max_new_tokens=10, ignore_eos=True)
    res = rt.run(workbench.batch(4, seed=2), store=tmp_path / "b.zarr", ep_ranks=4,
                 target_model="qwen3-vl-30b-a3b")
    ds = workbench.open_run(res.store)
    S = ds.sizes["step"]
    static = ds.moe.ep_times()
    none = ds.moe.eplb(redundant=0, window=4, interval=S + 1)
    np.testing.assert_allclose(none.compute_s, static["compute_s"].values, rtol=1e-12)
    np.testing.assert_allclose(none.moe_layer_s, static["moe_layer_s"].values, rtol=1e-12)
    assert not none.rebalance_s.any()
    rep = ds.moe.eplb(redundant=4, window=3, interval=3)
    steps = [r["step"] for r in rep.rebalances]
    assert steps == list(range(3, S, 3)) and (rep.rebalance_s[steps] > 0).all()
    assert rep.rebalance_s.sum() == pytest.approx(rep.summary()["rebalance_s_modeled"])
    served = slice(3, None)
    assert rep.compute_s[served].sum() > none.compute_s[served].sum()  # replicas read weights


def test_eplb_is_a_placement_of_the_ep_views_and_the_ep_replay(embedded, tmp_path,
                                                                monkeypatch):
    """placement=eplb: ds.moe.ep_load / ep_times follow the plans EPLBSchedule makes from the
    run's own past (= ds.moe.eplb), the EP replay streams the same schedule chunk by chunk
    (the same figures with tiny chunks), rebalances carry their modeled seconds on their own
    lane; live MACS/ReaLB refuse it; a size EPLB cannot pack is refused naming the numbers."""
    import workbench
    import workbench.replay.ep as rep
    from workbench.errors import KnobError
    from workbench.sim.ep import imbalance

    rt = workbench.Runtime(embedded, max_new_tokens=10, ignore_eos=True)
    res = rt.run(workbench.batch(4, seed=2), store=tmp_path / "b.zarr", ep_ranks=4,
                 target_model="qwen3-vl-30b-a3b", placement="eplb", eplb_window=3,
                 eplb_interval=3, num_redundant_experts=4)
    ds = workbench.open_run(res.store)
    ref = ds.moe.eplb(redundant=4, window=3, interval=3)
    np.testing.assert_allclose(ds.moe.ep_load().values, ref.load)
    t = ds.moe.ep_times()
    np.testing.assert_allclose(t["compute_s"].values, ref.compute_s)
    np.testing.assert_allclose(t["rebalance_s"].values, ref.rebalance_s)
    assert t["rebalance_s"].values.sum() > 0
    img = ds.moe.ep_load(modality="image").values
    txt = ds.moe.ep_load(modality="text").values
    np.testing.assert_allclose(img + txt, ref.load, atol=1e-9)  # the same plans
    whole = ds.moe.ep_summary()
    assert whole["eplb"]["rebalances"] == len(ref.rebalances)
    assert whole["imbalance"] == pytest.approx(float(np.nanmean(imbalance(ref.load))))
    assert whole["moe_layer_s_modeled"] == pytest.approx(float(t["moe_layer_s"].sum()))
    monkeypatch.setattr(rep, "CHUNK_ACCESSES", 8)  # one or two steps a chunk
    chunked = ds.moe.ep_summary()
    assert chunked["imbalance"] == pytest.approx(whole["imbalance"])
    assert chunked["moe_layer_s_modeled"] == pytest.approx(whole["moe_layer_s_modeled"])
    assert chunked["eplb"] == whole["eplb"]
    for m in ("image", "text"):
        assert chunked["by_modality"][m]["imbalance"] == pytest.approx(
            whole["by_modality"][m]["imbalance"])
    with pytest.raises(KnobError, match="placement 'eplb' replicates"):
        rt.run("x", record=False, ep_ranks=4, placement="eplb", balance="realb")
    with pytest.raises(KnobError, match=r"experts \+ num_redundant_experts \(3\)"):
        rt.run("x", record=False, ep_ranks=4, placement="eplb", num_redundant_experts=3)


@pytest.mark.parametrize("kw, fragment", [
    (dict(interval=-1), "eplb_interval must be a whole number ≥ 1"),
    (dict(interval=0), "eplb_interval must be a whole number ≥ 1"),
    (dict(window=0), "eplb_window must be a whole number ≥ 1"),
    (dict(ranks=0), "ep_ranks must be a whole number ≥ 1"),
    (dict(redundant=10**10), r"at most the 8 experts × 4 ranks = 32"),
    (dict(redundant=2.5), "num_redundant_experts must be a whole number"),
])
def test_eplb_over_time_refuses_sizes_it_cannot_serve(kw, fragment):
    """Hostile sizes are refused up front, naming the value (an interval of -1 used to loop
    forever, 10^10 replicas to allocate gigabytes)."""
    from workbench.sim.eplb_replay import eplb_over_time

    args = {**dict(ranks=4, redundant=0, window=2, interval=2), **kw}
    with pytest.raises(KnobError, match=fragment):
        eplb_over_time(np.ones((4, 2, 8)), **args)


def test_the_ep_views_refuse_eplb_sizes_before_serving(embedded, tmp_path):
    import workbench

    rt = workbench.Runtime(embedded, max_new_tokens=2)
    ds = workbench.open_run(rt.run("hi", store=tmp_path / "s.zarr").store)
    with pytest.raises(KnobError, match="at most the 64 experts"):
        ds.moe.ep_load(4, "eplb", num_redundant_experts=10**10)
    with pytest.raises(KnobError, match=r"multiple of ep_ranks \(3\)"):
        ds.moe.ep_load(3, "eplb")
    with pytest.raises(workbench.WorkbenchError, match="takes eplb_window"):
        ds.moe.ep_load(4, "eplb", bogus=1)
