"""ReaLB's controller (issue 15 §2): hotspot ranks, the vision threshold, AIMD, the gate and
the variants, on hand-built loads; and its modeled effect over per-step counts."""

import numpy as np
import pytest

from workbench.sim.realb import ReaLB, realb_over_time


def test_hotspot_vision_ranks_switch_and_aimd_follows_the_global_imbalance():
    ctl = ReaLB(layers=1, ranks=4)  # M_d starts at 0.9
    load = np.array([40.0, 10, 10, 20])  # mean 20: IB = 2, .5, .5, 1
    vis = np.array([38.0, 0, 9, 10])  # R_v = .95, 0, .9, .5
    d = ctl.decide(0, load, vis)
    assert d.low.tolist() == [True, False, False, False]  # IB > 1 and R_v .95 > .9
    assert d.ib_global == 2.0 and d.gated
    np.testing.assert_allclose(ctl.m[0], 0.45)  # IB_global 2 > τ 1.5: halved
    d = ctl.decide(0, np.array([22.0, 20, 19, 19]), np.array([5.0, 20, 0, 0]))
    assert not d.low.any()  # rank 0 hot but R_v .23 < .45; rank 1 not hot
    np.testing.assert_allclose(ctl.m[0], 0.55)  # balanced (IB 1.1): +0.1
    for _ in range(10):
        ctl.decide(0, np.ones(4), np.zeros(4))
    np.testing.assert_allclose(ctl.m[0], 1.0)  # capped at 1


def test_gate_and_variants():
    load, vis = np.array([40.0, 10, 10, 20]), np.array([30.0, 0, 0, 0])
    gated = ReaLB(1, 4, gate=100.0)  # aggregate 80 ≤ Γ: nothing switches, M_d unchanged
    d = gated.decide(0, load, vis)
    assert not d.gated and not d.low.any() and (gated.m == 0.9).all()
    m1 = ReaLB(1, 4, mode="fixed", fixed_m=0.0)  # ReaLB-m1: every hot rank with any vision
    assert m1.decide(0, load, vis).low.tolist() == [True, False, False, False]
    assert (m1.m == 0.0).all()
    assert ReaLB(1, 4, mode="all").decide(0, load, vis).low.all()
    assert not ReaLB(1, 4, mode="none").decide(0, load, vis).low.any()
    with pytest.raises(ValueError, match="mode must be one of"):
        ReaLB(1, 4, mode="fp4")


def test_over_time_prices_the_slowest_rank_in_its_precision():
    S, L, E, R = 3, 2, 8, 4
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 30, (S, L, E))
    counts[:, :, 0] = 200  # rank 0 (experts 0, 1) hot
    visual = counts.copy()
    visual[:, :, 2:] = 0  # only rank 0's tokens are visual
    roe = np.arange(E) * R // E
    out = realb_over_time(counts, visual, roe, R, ReaLB(L, R, mode="fixed", fixed_m=0.5),
                          lambda n: 1e-6 * n, lambda n: 0.25e-6 * n)
    assert out["low"][:, :, 0].all() and not out["low"][:, :, 1:].any()
    native = counts[..., :2].sum(-1) * 1e-6
    np.testing.assert_allclose(out["compute_native_s"], native)
    others = np.stack([counts[..., 2 * r:2 * r + 2].sum(-1) for r in range(1, 4)], -1).max(-1)
    np.testing.assert_allclose(out["compute_s"], np.maximum(native / 4, others * 1e-6))


def test_ds_moe_realb_on_a_batch(embedded, tmp_path):
    """ReaLB over a recorded batch: FP4-All on B200 is faster than native (modeled), the
    controller switches only hot visual ranks, a profile without FP4 prices no speedup."""
    import workbench

    rt = workbench.Runtime(embedded, max_new_tokens=4)
    res = rt.run(workbench.mixed_batch(4, text_share=0.5, seed=1), store=tmp_path / "b.zarr",
                 ep_ranks=4, target_model="qwen3-vl-30b-a3b")
    ds = workbench.open_run(res.store)
    allfp4 = ds.moe.realb("all")
    assert allfp4["supported"] and allfp4["speedup_modeled"] > 1.0 and allfp4["low_share"] > 0.9
    r = ds.moe.realb("realb")
    assert 0.0 <= r["low_share"] < allfp4["low_share"]
    assert 1.0 <= r["speedup_modeled"] <= allfp4["speedup_modeled"] + 1e-12
    assert ds.moe.realb("none")["speedup_modeled"] == pytest.approx(1.0)
    h = ds.moe.realb("all", profile="h200")
    assert not h["supported"] and h["speedup_modeled"] == pytest.approx(1.0)
