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
    assert ReaLB(1, 4, mode="all", gate=100.0).decide(0, load, vis).low.all()  # no gate
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


def test_live_low_precision_splits_the_experts_exactly(embedded, tmp_path, monkeypatch):
    """balance=fp4-all runs every expert apart, in low precision. With the quantiser made
    the identity, that split path (offloaded slots and the pinned layer's own weights) gives
    the native run exactly; with NVFP4 it changes what the layers compute, and every routed
    (layer call, expert) ran in low precision."""
    import workbench
    import workbench.precision as precision

    rt = workbench.Runtime(embedded, max_new_tokens=5, pinned_layers=1, cache_slots=64)
    reqs = workbench.mixed_batch(3, text_share=0.34, seed=2)
    nat = rt.run(reqs, store=tmp_path / "n.zarr", ep_ranks=4)
    monkeypatch.setattr(precision, "fake_quant", lambda x, p="nvfp4", axis=None: x.clone())
    ident = rt.run(reqs, store=tmp_path / "i.zarr", ep_ranks=4, balance="fp4-all")
    monkeypatch.undo()
    a, b = workbench.open_run(nat.store), workbench.open_run(ident.store)
    assert ident.low_precision_runs > 0 and nat.low_precision_runs == 0
    assert [r["token_ids"] for r in ident.batch] == [r["token_ids"] for r in nat.batch]
    np.testing.assert_array_equal(a["topk_ids"].values, b["topk_ids"].values)
    np.testing.assert_allclose(a["topk_weights"].values, b["topk_weights"].values, atol=1e-6)
    q = rt.run(reqs, store=tmp_path / "q.zarr", ep_ranks=4, balance="fp4-all")
    c = workbench.open_run(q.store)
    accesses = int((c["hits"] + c["misses"] + c["pinned_accesses"]).sum())
    assert q.low_precision_runs == accesses
    n = min(c.sizes["token"], a.sizes["token"])
    assert np.abs(c["topk_weights"].values[:n] - a["topk_weights"].values[:n]).max() > 1e-3


def test_live_realb_decides_from_the_batch_and_prices_low_precision(embedded, monkeypatch):
    import workbench
    import workbench.precision as precision
    from workbench.errors import KnobError
    from workbench.replay import replay_trace
    from workbench.traces import Trace

    rt = workbench.Runtime(embedded, max_new_tokens=4, target_model="qwen3-vl-30b-a3b",
                           profile="b200")
    reqs = workbench.mixed_batch(4, text_share=0.5, seed=1)
    m1 = rt.run(reqs, record=False, ep_ranks=4, balance="realb-m1")
    allq = rt.run(reqs, record=False, ep_ranks=4, balance="fp4-all")
    assert 0 < m1.low_precision_runs < allq.low_precision_runs
    # the clock alone (the quantiser made the identity: the same routing either way)
    monkeypatch.setattr(precision, "fake_quant", lambda x, p="nvfp4", axis=None: x.clone())
    nat = rt.run(reqs, record=False, ep_ranks=4)
    same = rt.run(reqs, record=False, ep_ranks=4, balance="fp4-all")
    assert same.latency_modeled_s < nat.latency_modeled_s  # B200 has FP4 tensor cores
    h = rt.run(reqs, record=False, ep_ranks=4, balance="fp4-all", profile="h200")
    hn = rt.run(reqs, record=False, ep_ranks=4, profile="h200")
    assert h.latency_modeled_s == pytest.approx(hn.latency_modeled_s)  # no FP4 on Hopper
    tr = Trace(topk_ids=np.zeros((2, 1, 1), np.int16), token_step=np.arange(2), num_experts=4)
    with pytest.raises(KnobError, match="runs experts in low precision live"):
        replay_trace(tr, balance="realb", cache_slots=2)


def test_the_store_records_which_experts_ran_in_low_precision(embedded, tmp_path):
    import workbench

    rt = workbench.Runtime(embedded, max_new_tokens=3)
    reqs = workbench.mixed_batch(3, text_share=0.34, seed=2)
    r = rt.run(reqs, store=tmp_path / "m1.zarr", ep_ranks=4, balance="realb-m1")
    ds = workbench.open_run(r.store)
    low = ds["low_precision"]
    assert low.dims == ("step", "layer", "expert") and int(low.sum()) == r.low_precision_runs > 0
    # a low expert was routed there
    routed = ds["routed_tokens"].sum("modality").values > 0
    assert not (low.values & ~routed).any()
    plain = workbench.open_run(rt.run(reqs, store=tmp_path / "n.zarr").store)
    assert not plain["low_precision"].values.any()
    from pathlib import Path

    old = workbench.open_run(Path(__file__).parent / "data" / "store_v3.zarr")
    assert old["low_precision"].shape == old["resident"].shape and not old["low_precision"].any()


def test_the_store_records_the_controller_per_rank_and_replays_it(embedded, tmp_path):
    """Schema 7: M_d, IB_d, R_vd and the per-rank precision of every layer call are stored;
    the same controller over the store's recorded routing (ds.moe.realb_state(mode)) makes
    exactly the recorded decisions — one implementation, live and on traces."""
    import workbench
    from workbench.errors import InputError
    from workbench.sim.placement import rank_of_expert

    rt = workbench.Runtime(embedded, max_new_tokens=6)
    reqs = workbench.mixed_batch(4, text_share=0.5, seed=3)
    r = rt.run(reqs, store=tmp_path / "r.zarr", ep_ranks=4, balance="realb", realb_tau=1.2)
    ds = workbench.open_run(r.store)
    st = ds.moe.realb_state()
    assert st.sizes["ep_rank"] == 4 and st["m"].dims == ("step", "layer", "ep_rank")
    assert st.attrs["tau"] == 1.2 and "recorded" in st.attrs["source"]
    # the per-expert flags are the per-rank decisions on the routed experts
    owner = rank_of_expert("contiguous", ds.sizes["expert"], 4)
    routed = ds["routed_tokens"].sum("modality").values > 0
    np.testing.assert_array_equal(ds["low_precision"].values,
                                  st["low"].values[:, :, owner] & routed)
    # IB_d from the stored per-rank loads
    load = ds.moe.ep_load().values.astype(float)
    np.testing.assert_allclose(st["ib"].values, load / load.mean(-1, keepdims=True), rtol=1e-6)
    # AIMD: M_d starts at 0.9 and moves by the rule
    m = st["m"].values.astype(float)
    assert np.allclose(m[0], 0.9)
    ibg = st["ib_global"].values
    nxt = np.where((ibg > 1.2)[..., None], m * 0.5, np.minimum(1.0, m + 0.1))
    np.testing.assert_allclose(m[1:], nxt[:-1], rtol=1e-5)
    assert (ibg > 1.2).any() and (m < 0.9).any()
    again = ds.moe.realb_state("realb")
    np.testing.assert_allclose(again["m"].values, m, rtol=1e-5)
    np.testing.assert_array_equal(again["low"].values, st["low"].values)
    fig = ds.moe.plot_realb()
    assert any(t.name == "rank 3" for t in fig.data) and fig.layout.shapes
    # a run without the controller says so; older stores read NaN on one rank
    plain = workbench.open_run(rt.run(reqs[:1], store=tmp_path / "n.zarr").store)
    assert plain.sizes["ep_rank"] == 1 and np.isnan(plain["realb_m"].values).all()
    with pytest.raises(InputError, match="no ReaLB controller"):
        plain.moe.realb_state()
    assert plain.moe.realb_state("fixed", fixed_m=0.0)["m"].shape[-1] == plain.attrs.get(
        "ep_ranks", workbench.Knobs.from_attrs(plain.attrs).ep_ranks)
    from pathlib import Path

    old = workbench.open_run(Path(__file__).parent / "data" / "store_v3.zarr")
    assert old["realb_m"].shape == (*old["hits"].shape, 1) and not old["realb_low"].any()
    with pytest.raises(InputError, match="layer must be in"):
        ds.moe.plot_realb(layer=99)


def test_the_ep_clock_prices_low_experts_and_the_online_switch(embedded, tmp_path):
    """ds.moe.ep_times of a ReaLB run: the experts it ran low cost less on a GPU with FP4,
    the online weight conversion (switch_s) is hidden under the dispatch unless ReaLB-seq,
    FP4-All converts nothing (quantised offline); a profile without FP4 prices no gain."""
    import workbench

    rt = workbench.Runtime(embedded, max_new_tokens=3)
    reqs = workbench.mixed_batch(4, text_share=0.5, seed=1)
    kw = dict(ep_ranks=4, target_model="qwen3-vl-30b-a3b", profile="rtx-5090",
              interconnect="pcie5")
    # the quantiser's effect on routing aside, compare the same routing: price the native run
    nat = workbench.open_run(rt.run(reqs, store=tmp_path / "n.zarr", **kw).store)
    m1 = workbench.open_run(rt.run(reqs, store=tmp_path / "m1.zarr", balance="realb-m1",
                                   **kw).store)
    t_nat, t = nat.moe.ep_times(), m1.moe.ep_times()
    assert (t_nat["switch_s"] == 0).all()
    low = m1["low_precision"].values
    assert low.any()
    counts = m1["routed_tokens"].sum("modality").values
    from workbench.sim.costs import Prices
    from workbench.sim.profiles import get_profile, get_target_model
    from workbench.sim.costs import CostSpec
    from workbench.sim.placement import rank_of_expert

    p = Prices(get_profile("rtx-5090"), CostSpec.from_target(get_target_model(
        "qwen3-vl-30b-a3b")))
    owner = rank_of_expert("contiguous", counts.shape[-1], 4)
    want = np.zeros(t["compute_s"].shape)
    for i, j, x in zip(*np.nonzero(counts)):
        price = p.expert_in("nvfp4") if low[i, j, x] else p.expert
        want[i, j, owner[x]] += price(int(counts[i, j, x]))
    np.testing.assert_allclose(t["compute_s"].values, want, rtol=1e-9)
    sw = t["switch_s"].values
    has_low = low.any(-1)
    assert (sw[has_low] > 0).all()
    seq = m1.moe.ep_times(overlap=False)
    d = t["dispatch_s"].values
    np.testing.assert_allclose(seq["moe_layer_s"].values - t["moe_layer_s"].values,
                               sw + d - np.maximum(sw, d), atol=1e-15)
    assert float(seq["moe_layer_s"].sum()) > float(t["moe_layer_s"].sum())
    allq = workbench.open_run(rt.run(reqs, store=tmp_path / "a.zarr", balance="fp4-all",
                                     **kw).store)
    assert (allq.moe.ep_times()["switch_s"] == 0).all()
    # Hopper has no FP4: the low experts cost what native ones do
    hs = workbench.open_run(rt.run(reqs, store=tmp_path / "h.zarr", balance="realb-m1",
                                   **{**kw, "profile": "h200"}).store)
    assert hs["low_precision"].values.any()
    hc = hs["routed_tokens"].sum("modality").values
    ph = Prices(get_profile("h200"), p.cost)
    want = np.zeros(hc.shape[:2] + (4,))
    for i, j, x in zip(*np.nonzero(hc)):
        want[i, j, owner[x]] += ph.expert(int(hc[i, j, x]))
    np.testing.assert_allclose(hs.moe.ep_times()["compute_s"].values, want, rtol=1e-9)


def test_realb_carry_keeps_m_d_across_runs(embedded, tmp_path):
    """realb_carry: the runtime's next run starts where the last one's AIMD left M_d (a
    server's controller); without it every run starts at 0.9; another rank count has its
    own."""
    import workbench

    rt = workbench.Runtime(embedded, max_new_tokens=3)
    reqs = workbench.mixed_batch(4, text_share=0.5, seed=3)
    kw = dict(ep_ranks=4, balance="realb", realb_tau=1.2, realb_carry=True)
    a = workbench.open_run(rt.run(reqs, store=tmp_path / "a.zarr", **kw).store)
    b = workbench.open_run(rt.run(reqs, store=tmp_path / "b.zarr", **kw).store)
    ma, mb = a["realb_m"].values.astype(float), b["realb_m"].values.astype(float)
    ib = a["realb_ib"].values.max(-1)[-1]
    last = np.where((ib > 1.2)[:, None], ma[-1] * 0.5, np.minimum(1.0, ma[-1] + 0.1))
    np.testing.assert_allclose(mb[0], last, rtol=1e-6)
    assert not np.allclose(mb[0], 0.9)
    fresh = workbench.open_run(rt.run(reqs, store=tmp_path / "c.zarr", ep_ranks=4,
                                      balance="realb", realb_tau=1.2).store)
    assert np.allclose(fresh["realb_m"].values[0], 0.9)
    other = workbench.open_run(rt.run(reqs, store=tmp_path / "d.zarr",
                                      **{**kw, "ep_ranks": 8}).store)
    assert np.allclose(other["realb_m"].values[0], 0.9)


def test_controller_settings_are_checked(embedded, tmp_path):
    """From the hostile probe: every controller setting is range-checked (NaN τ used to run),
    ds.moe.realb names a bad precision or setting, plot_realb a bad layer, ep_times a bad
    overlap; the CLI-equivalent knobs were already checked by param."""
    import workbench
    from workbench.errors import InputError, KnobError

    for kw, frag in ((dict(tau=float("nan")), "tau must be a finite number ≥ 1"),
                     (dict(c=float("inf")), "c must be a finite number ≥ 0"),
                     (dict(m0=2.0), r"m0 must be in 0 … 1"),
                     (dict(decrease=2.0), r"decrease must be in 0 … 1"),
                     (dict(gate=-1.0), "gate must be a finite number ≥ 0"),
                     (dict(fixed_m=5), r"fixed_m must be in 0 … 1")):
        with pytest.raises(InputError, match=frag):
            ReaLB(2, 4, **kw)
    with pytest.raises(InputError, match="ranks must be a whole number"):
        ReaLB(2, 0)
    with pytest.raises(KnobError, match="balance must be one of"):
        ReaLB.for_balance("bogus", 2, 4)
    rt = workbench.Runtime(embedded, max_new_tokens=2)
    ds = workbench.open_run(rt.run("hi", store=tmp_path / "s.zarr", ep_ranks=4,
                                   balance="realb").store)
    with pytest.raises(InputError, match="precision must be one of fp8, nvfp4, not 'int4'"):
        ds.moe.realb("all", precision="int4")
    with pytest.raises(InputError, match="not 'bogus'"):
        ds.moe.realb("all", bogus=1)
    with pytest.raises(InputError, match="mode must be one of"):
        ds.moe.realb("sometimes")
    for layer in (1.7, "1", True, -1, 99):
        with pytest.raises(InputError, match="layer must be in"):
            ds.moe.plot_realb(layer=layer)
    with pytest.raises(InputError, match="overlap must be True, False or None"):
        ds.moe.ep_times(overlap="yes")
    st = ds.moe.realb_state("realb")
    assert {"m", "ib", "vision", "low", "gated", "ib_global"} <= set(st.data_vars)


def test_realb_carry_owns_the_carried_m_d():
    """RealbCarry (Runtime.realb_carry) is the one state runs share: the first run's array is
    handed to every later run under the same key, another key gets its own, clear() forgets."""
    from workbench.sim.realb import RealbCarry

    carry = RealbCarry()
    first = np.full((2, 4), 0.9)
    assert carry.share(("realb", 4, "contiguous"), first) is first
    assert carry.share(("realb", 4, "contiguous"), np.zeros((2, 4))) is first
    other = np.zeros((2, 8))
    assert carry.share(("realb", 8, "contiguous"), other) is other
    carry.clear()
    fresh = np.ones((2, 4))
    assert carry.share(("realb", 4, "contiguous"), fresh) is fresh


def _w4a4_reference(block, low, h, idx, w, precision, down_input):
    """ReaLB's low-precision share of ``low`` experts by hand: weights and the layer input
    quantised → dequantised, and (down_input 'quantised') each expert's down-projection input
    (its own global scale)."""
    import torch
    from torch.nn import functional as F

    from workbench.precision import fake_quant

    ex = block.experts
    gu = torch.stack([fake_quant(ex.gate_up_proj[e].detach(), precision) for e in low])
    dn = torch.stack([fake_quant(ex.down_proj[e].detach(), precision) for e in low])
    hq = fake_quant(h, precision)
    parts = []
    for j, e in enumerate(low):
        tok, pos = torch.where(idx == e)
        g, u = F.linear(hq[tok], gu[j]).chunk(2, -1)
        parts.append((j, tok, pos, F.silu(g) * u))
    out = torch.zeros_like(h)
    for j, tok, pos, mid in parts:
        if down_input == "quantised":  # one global scale per expert
            mid = fake_quant(mid, precision)
        out.index_add_(0, tok, F.linear(mid, dn[j]) * w[tok, pos, None])
    return out


@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
def test_w4a4_quantises_the_down_projection_input(embedded, precision):
    """Issue 39 §6: in low precision (W4A4 for NVFP4, W8A8 for FP8) the down projection takes
    its input quantised too, inside the model's own experts forward; 'native' keeps W4A16
    there (the workbench before the knob). Each equals its hand-quantised reference on a real
    layer of the embedded model, and the two differ."""
    import torch

    from types import SimpleNamespace

    from workbench.runtime.executor import ComputeCall, Executor
    from workbench.runtime.slots import ExpertsView

    b = embedded.layout.blocks[1]
    g = torch.Generator().manual_seed(0)
    T, E = 16, b.num_experts
    h = torch.randn(T, b.experts.gate_up_proj.shape[-1], generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:b.top_k] for _ in range(T)])
    w = torch.rand(T, b.top_k, generator=g)
    low = sorted(set(idx[:, 0].tolist()))[:4]
    view = ExpertsView(b.experts, b.expert_params)
    runner = SimpleNamespace(low_precision=precision, prism=False, low_precision_runs=0)
    out = {}
    for mode in ("quantised", "native"):
        c = ComputeCall(b, None, view, h, idx, w, (), {}, None, None, set(low), False, mode)
        weights = {n: getattr(b.experts, n)[low].detach() for n in b.expert_params}
        with torch.no_grad():
            out[mode] = Executor.run_low(runner, c, low, weights)
            ref = _w4a4_reference(b, low, h, idx, w, precision, mode)
        torch.testing.assert_close(out[mode], ref, rtol=0, atol=1e-6)
    assert (out["quantised"] - out["native"]).abs().max() > 1e-4
    assert runner.low_precision_runs == 2 * len(low)
    # per expert: the same values however the experts are split over calls (cache hits and
    # misses run apart)
    c = ComputeCall(b, None, view, h, idx, w, (), {}, None, None, set(low), False, "quantised")
    with torch.no_grad():
        split = sum(Executor.run_low(runner, c, part, {n: getattr(b.experts, n)[part].detach()
                                                        for n in b.expert_params})
                    for part in (low[:1], low[1:]))
    torch.testing.assert_close(split, out["quantised"], rtol=0, atol=1e-6)


def test_quantises_input_follows_the_weight_into_every_gemm():
    """The weight's slices and transposes keep the rule; each GEMM quantises the other operand
    along the contraction axis (eager F.linear, x @ W, W @ x, batched per entry); other ops
    are untouched."""
    import torch
    from torch.nn import functional as F

    from workbench.precision import fake_quant, quantises_input

    g = torch.Generator().manual_seed(1)
    W = torch.randn(3, 8, 32, generator=g)  # [E, out, in]
    x = torch.randn(5, 32, generator=g)
    Q = quantises_input(W, "nvfp4")
    assert torch.equal(F.linear(x, Q[1]), F.linear(fake_quant(x), W[1]))
    assert torch.equal(x @ Q[1].t(), fake_quant(x) @ W[1].t())
    v = torch.randn(32, 5, generator=g)
    assert torch.equal(Q[2] @ v, W[2] @ fake_quant(v.t()).t())
    xb = torch.randn(3, 32, 1, generator=g)
    want = torch.bmm(W, torch.stack([fake_quant(r.t()).t() for r in xb]))
    assert torch.equal(torch.bmm(Q, xb), want)
    assert type(Q[0] * 2) is type(Q) and torch.equal((Q[0] * 2).as_subclass(torch.Tensor),
                                                       W[0] * 2)


def test_the_down_input_switch_restores_the_w4a16_run_and_old_stores_read_it(embedded,
                                                                             tmp_path,
                                                                             monkeypatch):
    """low_precision_down_input: 'native' is the run of the workbench before the knob (the
    down projection's input unquantised: the same run as 'quantised' with its down-input
    quantiser made a no-op, to the runtime's run-to-run spread), 'quantised' changes what
    the layers compute; a store records the
    knob, and one older than it reads 'native'. A bad value is one KnobError line."""
    import workbench
    import workbench.precision as precision
    from workbench.errors import KnobError

    rt = workbench.Runtime(embedded, max_new_tokens=4, pinned_layers=1, cache_slots=64)
    reqs = workbench.mixed_batch(3, text_share=0.34, seed=2)
    kw = dict(ep_ranks=4, balance="fp4-all")
    nat = rt.run(reqs, store=tmp_path / "n.zarr", low_precision_down_input="native", **kw)
    q = rt.run(reqs, store=tmp_path / "q.zarr", **kw)  # the default: the paper's W4A4
    monkeypatch.setattr(precision, "quantises_input", lambda t, p: t)
    today = rt.run(reqs, store=tmp_path / "t.zarr", **kw)
    monkeypatch.undo()
    a, b, t = (workbench.open_run(r.store) for r in (nat, q, today))
    assert [r["token_ids"] for r in nat.batch] == [r["token_ids"] for r in today.batch]
    np.testing.assert_array_equal(a["topk_ids"].values, t["topk_ids"].values)
    # two runs of one setting differ by float32 rounding here (≈ 2e-7: the live runtime's own
    # run-to-run spread on this CPU), so "the same run" is to 1e-6, as above
    np.testing.assert_allclose(a["topk_weights"].values, t["topk_weights"].values, atol=1e-6)
    assert nat.low_precision_runs == today.low_precision_runs > 0
    n = min(a.sizes["token"], b.sizes["token"])
    assert np.abs(a["topk_weights"].values[:n] - b["topk_weights"].values[:n]).max() > 1e-4
    assert workbench.Knobs.from_attrs(a.attrs).low_precision_down_input == "native"
    assert workbench.Knobs.from_attrs(b.attrs).low_precision_down_input == "quantised"
    from pathlib import Path

    old = workbench.open_run(Path(__file__).parent / "data" / "store_v3.zarr")
    assert workbench.Knobs.from_attrs(old.attrs).low_precision_down_input == "native"
    with pytest.raises(KnobError, match=r"low_precision_down_input.*'w4a16'.*quantised, native"):
        workbench.Knobs(low_precision_down_input="w4a16")
