"""MACS (issue 14 §3, seed 002 §3): semantic load, modality-aware capacity, local semantic
rerouting and fail-safe drop — the core on hand-built groups and random routing, the live
path on the embedded model, replay on traces, and the calibration files."""

import json

import numpy as np
import pytest

import workbench
from workbench.errors import InputError, KnobError
from workbench.macs.calibration import calibrate, calibration_requests, load, save
from workbench.sim.dispatch import CapacityDrop, Macs
from workbench.sim.macs import (entropy_of_features, expert_classes, image_groups, image_runs,
                                macs_group, semantic_weights)


def _random_routing(rng, T, L, K, E):
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)])
                    for _ in range(T)]).astype(np.int16)
    ids[rng.random(ids.shape) < 0.1] = -1
    w = rng.random(ids.shape).astype(np.float32)
    w[rng.random(ids.shape) < 0.2] = 0.5  # ties
    return ids, w


def test_every_switch_off_is_token_drop():
    """SC (static capacity, token counts, router order) is exactly CAI-MoE Token Drop."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        T, L, K, E = (int(rng.integers(1, 40)), int(rng.integers(1, 3)),
                      int(rng.integers(1, 5)), int(rng.integers(4, 16)))
        ids, w = _random_routing(rng, T, L, K, E)
        steps = np.sort(rng.integers(0, 3, T))
        g = float(rng.choice([0.25, 0.5, 1.0, 2.0]))
        sc = Macs(g, 1, macs_semantic_load=False, macs_dynamic_capacity=False,
                  macs_reroute=False, macs_selection="router")
        np.testing.assert_array_equal(sc.apply(ids, w, steps, E),
                                      CapacityDrop(g, 1).apply(ids, w, steps, E))


def _group(T=12, K=2, E=8, seed=1):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    ids[:, 0] = 0  # everyone wants expert 0: it overflows
    gates = rng.random((T, E))
    gates /= gates.sum(1, keepdims=True)
    gw = np.take_along_axis(gates, ids, 1)
    return ids, gw, gates


def test_effective_load_never_exceeds_capacity_and_reroutes_stay_on_rank():
    rng = np.random.default_rng(3)
    for trial in range(50):
        ids, gw, gates = _group(T=int(rng.integers(4, 30)), K=2, E=8, seed=trial)
        T = len(ids)
        w = rng.uniform(0.1, 1.0, T)
        mod = (rng.random(T) < 0.5).astype(np.int8)
        classes = rng.integers(-1, 2, 8).astype(np.int8)
        ranks = np.arange(8) // 4
        aff = rng.uniform(-1, 1, (T, 8))
        new, nw, rer, cap = macs_group(
            ids, gw, w, mod, classes, 2.0, rho=0.6, dynamic_capacity=True, min_capacity=1,
            selection="entropy", seed=0, reroute=True, rank_of_expert=ranks, gates=gates,
            affinity=aff, eta=0.5, num_experts=8)
        load = np.zeros(8)
        t, r = np.nonzero(new >= 0)
        np.add.at(load, new[t, r], w[t])
        assert (load <= cap + 1e-9).all()
        for x, s in zip(*np.nonzero(rer)):
            assert ranks[new[x, s]] == ranks[ids[x, s]]  # local: the same rank
            assert new[x, s] not in np.delete(new[x], s) and new[x, s] not in ids[x]
            # G(x)_k scaled like the slot it replaced (here the router did not rescale)
            assert nw[x, s] == pytest.approx(gates[x, new[x, s]])
        # kept + rerouted + dropped = assigned
        assert (new >= 0).sum() + ((new < 0) & (ids >= 0)).sum() == (ids >= 0).sum()


def test_dynamic_capacity_follows_the_visual_ratio():
    ids, gw, gates = _group(T=10)
    classes = np.array([1, -1, 0, 0, 0, 0, 0, 0], np.int8)
    kw = dict(rho=0.6, dynamic_capacity=True, min_capacity=1, selection="router", seed=0,
              reroute=False, rank_of_expert=None, gates=None, affinity=None, eta=0.0,
              num_experts=8)
    vis = np.ones(10, np.int8)
    *_, cap = macs_group(ids, gw, np.ones(10), vis, classes, 4.0, **kw)
    assert cap[0] == pytest.approx(4 * (1 + 0.6 * 0.5)) and cap[1] == pytest.approx(4 * 0.7)
    assert cap[2] == 4.0
    *_, cap = macs_group(ids, gw, np.ones(10), np.zeros(10, np.int8), classes, 4.0, **kw)
    assert cap[0] == pytest.approx(4 * 0.7) and cap[1] == pytest.approx(4 * 1.3)
    # semantic weights lower R_v: visual tokens of weight 0.25 against text of weight 1
    mod = np.r_[np.ones(5, np.int8), np.zeros(5, np.int8)]
    w = np.r_[np.full(5, 0.25), np.ones(5)]
    *_, cap = macs_group(ids, gw, w, mod, classes, 4.0, **kw)
    assert cap[0] == pytest.approx(4 * (1 + 0.6 * (0.2 - 0.5)))


def test_fail_safe_drops_the_lowest_retention_first():
    """No rank has room: overflow is dropped, and the tokens kept are the highest
    w(x)·max G(x) (entropy-weighted selection)."""
    T, E = 6, 4
    ids = np.zeros((T, 1), np.int64)  # all on expert 0, capacity 2
    gates = np.full((T, E), 0.1)
    gates[:, 0] = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    w = np.array([0.1, 1.0, 1.0, 0.2, 1.0, 1.0])
    new, _, rer, _ = macs_group(
        ids, gates[:, :1], w, np.zeros(T, np.int8), None, 2.0, rho=0.6,
        dynamic_capacity=False, min_capacity=1, selection="entropy", seed=0, reroute=True,
        rank_of_expert=np.arange(E), gates=gates, affinity=None, eta=0.0, num_experts=E)
    # retention w·max G = .09 .8 .7 .12 .5 .4 → the two kept fill Σw ≤ 2: tokens 1 and 2
    assert new[:, 0].tolist() == [-1, 0, 0, -1, -1, -1] and not rer.any()


def test_selection_strategies_differ_and_random_is_seeded():
    ids, gw, gates = _group(T=16, seed=5)
    mod = np.r_[np.ones(8, np.int8), np.zeros(8, np.int8)]
    w = np.linspace(0.2, 1.0, 16)
    kw = dict(rho=0.6, dynamic_capacity=False, min_capacity=1, seed=7, reroute=False,
              rank_of_expert=None, gates=gates, affinity=None, eta=0.0, num_experts=8)
    kept = {s: tuple(macs_group(ids, gw, w, mod, None, 3.0, selection=s, **kw)[0][:, 0])
            for s in ("entropy", "router", "modality-prior", "random")}
    assert len(set(kept.values())) > 1
    prior = np.array(kept["modality-prior"])
    assert (prior[8:] >= 0).sum() >= (prior[:8] >= 0).sum()  # text first
    again = macs_group(ids, gw, w, mod, None, 3.0, selection="random", **kw)[0][:, 0]
    assert tuple(again) == kept["random"]
    with pytest.raises(ValueError, match="macs_selection must be one of"):
        macs_group(ids, gw, w, mod, None, 3.0, selection="best", **kw)


def test_semantic_weights_and_image_runs():
    z = np.random.default_rng(0).normal(size=(7, 16))
    z[1] *= 20  # a peaked feature: low entropy → high weight
    H = entropy_of_features(z)
    assert H[1] < H[0] and np.all(H <= np.log(16) + 1e-9)
    mod = np.array([0, 1, 1, 1, 0, 1, 1], np.int8)
    req = np.array([0, 0, 0, 0, 0, 0, 1])
    runs = image_runs(mod, req)
    assert runs.tolist() == [-1, 0, 0, 0, -1, 1, 2]  # a new request starts a new image
    w = semantic_weights(H[:, None], mod, runs, 1.5)[:, 0]
    assert w[0] == w[4] == 1.0 and ((w[mod == 1] > 0) & (w[mod == 1] < 1)).all()
    assert w[1] == max(w[1:4])
    assert w[6] == pytest.approx(0.5)  # an image of one token: z-score 0 → σ(0)


def test_semantic_weights_are_numpys_z_score_bit_for_bit():
    """The semantic weights gather each image's visual tokens once and run one σ: the same
    bits as z-scoring every image with numpy's own ``mean(0)`` / ``std(0)`` (interleaved
    images, one-token images, constant entropy, several layers, no image ids)."""
    from workbench.sim.macs import sigmoid

    def reference(H, mod, img, delta):
        w = np.ones_like(H)
        vis = mod != 0
        img = np.where(vis, 0, -1) if img is None else img
        for i in np.unique(img[vis]):
            h = H[img == i]
            w[img == i] = sigmoid(-delta * ((h - h.mean(0)) / (h.std(0) + 1e-6)))
        return w

    rng = np.random.default_rng(3)
    for trial in range(300):
        # one layer (a live call: the compiled pass) past numpy's pairwise blocks of 128
        T, L = int(rng.integers(1, [200, 3000][trial % 2])), int(rng.integers(1, 4))
        L = 1 if trial % 4 < 2 else L
        H = rng.random((T, L)) * float(rng.choice([1e-3, 1, 5])) + float(rng.choice([0, 3]))
        if trial % 7 == 0:
            H[:] = 1.25
        mod = (rng.random(T) < rng.random()).astype(np.int8)
        img = [image_runs(mod, np.sort(rng.integers(0, 4, T))), None,
               np.where(mod != 0, rng.integers(0, 3, T), -1)][trial % 3]
        delta = float(rng.choice([0.0, 1.5, 3.0]))
        want = reference(H, mod, img, delta).tobytes()
        for compiled in (True, False):
            assert semantic_weights(H, mod, img, delta, compiled=compiled).tobytes() == want
        # the stage's groups, computed once per step, are what it would compute here
        groups = image_groups(mod, img)
        assert semantic_weights(H, mod, img, delta, groups).tobytes() == want
    # groups that do not fit the tokens are refused (the compiled pass has no bounds checks)
    H, mod = np.arange(1.0, 7.0)[:, None], np.ones(6, np.int8)
    idx, starts = image_groups(mod, None)
    for bad in ((idx, np.array([0, 4_000_000])), (idx, np.array([1, 6])),
                (idx + 3, starts), (idx, np.array([0, 4, 2, 6]))):
        with pytest.raises(ValueError, match="semantic_weights: groups must be"):
            semantic_weights(H, mod, None, 1.5, bad)
    for bad in (dict(modality=np.ones(3, np.int8)), dict(image_of=np.zeros(5, np.int64))):
        args = dict(entropy=np.ones((4, 1)), modality=np.ones(4, np.int8), image_of=None,
                    delta=1.5) | bad
        with pytest.raises(ValueError, match=f"semantic_weights: {next(iter(bad))} has shape"):
            semantic_weights(**args)


def test_capacity_of_one_group_is_the_array_forms():
    """``capacity_of`` (Python floats, one group) gives what ``capacity`` gives on arrays,
    up to the 2⁶² clip; ``fits`` and ``groups`` use it."""
    rng = np.random.default_rng(4)
    for _ in range(500):
        g = float(rng.choice([1e-3, 0.25, 1.0, 1.8, 7.3, 1e9, 1e30]))
        pol = CapacityDrop(g, int(rng.integers(0, 9)))
        T, K, E = int(rng.integers(0, 5000)), int(rng.integers(1, 9)), int(rng.integers(1, 257))
        want = int(pol.capacity(np.array([T]), np.array([K]), E)[0])
        assert pol.capacity_of(T, K, E) == want == int(pol.capacity(T, K, E))
        assert pol.fits(want, T, K, E) and not pol.fits(want + 1, T, K, E)


def test_expert_classes_from_counts():
    routed = np.zeros((1, 3, 3))
    routed[0, 0] = [10, 80, 0]  # visual-leaning
    routed[0, 1] = [60, 20, 0]  # text-leaning
    routed[0, 2] = [50, 50, 0]  # shared
    m, d = expert_classes(routed, np.array([100, 100, 0]))
    assert m.tolist() == [[1, -1, 0]] and d[0, 0] == pytest.approx(0.7)
    m, _ = expert_classes(routed, np.array([100, 0, 0]))
    assert (m == 0).all()


def test_replay_runs_sc_and_dc_and_refuses_what_needs_the_model():
    from workbench.replay import replay_trace
    from workbench.traces import Trace

    rng = np.random.default_rng(2)
    ids, w = _random_routing(rng, 60, 2, 2, 8)
    tr = Trace(topk_ids=ids, topk_weights=w, token_step=np.repeat(np.arange(6), 10),
               token_modality=(rng.random(60) < 0.5).astype(np.int8), num_experts=8)
    # a trace without phases is all decode: capacity on every step
    off = dict(macs_semantic_load=False, macs_reroute=False, capacity_scope="all")
    res = replay_trace(tr, dispatch="macs", capacity_factor=0.5, cache_slots=4, **off)
    d = res.extra["dispatch"]
    assert d["policy"] == "macs" and d["dropped"] > 0 and d["rerouted"] == 0
    assert d["classes"] == "this trace (in-sample)"
    sc = replay_trace(tr, dispatch="macs", capacity_factor=0.5, cache_slots=4,
                      macs_dynamic_capacity=False, macs_selection="router", **off)
    drop = replay_trace(tr, dispatch="capacity-drop", capacity_factor=0.5, cache_slots=4,
                        capacity_scope="all")
    assert sc.extra["dispatch"]["dropped"] == drop.extra["dispatch"]["dropped"]
    assert sc.hits.sum() == drop.hits.sum()
    with pytest.raises(KnobError, match="macs_semantic_load=true needs the model's features"):
        replay_trace(tr, dispatch="macs", macs_reroute=False)


@pytest.fixture(scope="module")
def macs_run(embedded, tmp_path_factory):
    rt = workbench.Runtime(embedded, max_new_tokens=6)
    reqs = workbench.mixed_batch(6, text_share=0.5, seed=4)
    store = tmp_path_factory.mktemp("macs") / "m.zarr"
    res = rt.run(reqs, store=store, dispatch="macs", capacity_factor=1.0, ep_ranks=4)
    return rt, reqs, res, workbench.open_run(store)


def test_live_macs_reroutes_and_drops_and_the_store_says_so(macs_run):
    rt, reqs, res, ds = macs_run
    assert res.dispatch_rerouted > 0 and res.dispatch_dropped > 0
    assert int(ds["dispatch_rerouted"].sum()) == res.dispatch_rerouted
    assert int(ds["dispatch_dropped"].sum()) == res.dispatch_dropped
    # a rerouted slot holds its new expert: every stored id is a real expert or -1
    ids = ds["topk_ids"].values
    assert ((ids >= -1) & (ids < ds.sizes["expert"])).all()
    assert "rerouted" in res.summary()
    # reroutes stay on the rank of the expert they left (4 ranks, contiguous)
    full = rt.run(reqs, record=False, dispatch="macs", capacity_factor=1.0, ep_ranks=4,
                  macs_reroute=False)
    assert full.dispatch_rerouted == 0


def test_live_macs_needs_a_calibration_only_when_a_switch_uses_it(embedded, tmp_path):
    rt = workbench.Runtime(embedded, max_new_tokens=2)
    with pytest.raises(InputError, match="no MACS calibration in"):
        rt.run("count from 1 to 3.", record=False, dispatch="macs",
               macs_calibration=str(tmp_path / "none"))
    res = rt.run("count from 1 to 3.", record=False, dispatch="macs",
                 macs_calibration=str(tmp_path / "none"), macs_dynamic_capacity=False,
                 macs_eta=0.0)
    assert res.dispatch_assigned > 0


def test_calibration_round_trip_and_hostile_files(embedded, tmp_path):
    cal = calibrate(embedded, calibration_requests(8, seed=1))
    lay = embedded.layout
    assert cal.classes.shape == (lay.num_layers, lay.num_experts)
    assert cal.meta["visual_tokens"] > 0 and cal.meta["text_tokens"] > 0
    assert (cal.counts.sum(1) > 0).all()
    out = save(cal, tmp_path / "c")
    with pytest.raises(InputError, match="already holds a MACS calibration"):
        save(cal, out)
    back = load(out, lay.num_layers, lay.num_experts, embedded.config_hash)
    np.testing.assert_array_equal(back.classes, cal.classes)
    with pytest.raises(InputError, match="is for 12 layers × 64 experts; this model has 3 × 64"):
        load(out, 3, 64)
    with pytest.raises(InputError, match="was made for config_hash"):
        load(out, config_hash="other")
    meta = json.loads((out / "macs.json").read_text())
    (out / "macs.json").write_text("{")
    with pytest.raises(InputError, match="is not valid JSON"):
        load(out)
    (out / "macs.json").write_text(json.dumps({**meta, "format": "x"}))
    with pytest.raises(InputError, match="is not a workbench-macs-calibration/1 file"):
        load(out)
    (out / "macs.json").write_text(json.dumps(meta))
    from safetensors.numpy import load_file, save_file

    t = load_file(str(out / "macs.safetensors"))
    bad = dict(t, classes=np.full_like(t["classes"], 3))
    save_file(bad, str(out / "macs.safetensors"))
    with pytest.raises(InputError, match="classes must be −1, 0 or \\+1"):
        load(out)
    bad = dict(t, delta=np.full_like(t["delta"], np.nan))
    save_file(bad, str(out / "macs.safetensors"))
    with pytest.raises(InputError, match="'delta' holds NaN"):
        load(out)
    bad = {k: v for k, v in t.items() if k != "centroids"}
    save_file(bad, str(out / "macs.safetensors"))
    with pytest.raises(InputError, match="expected"):
        load(out)
    (out / "macs.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(InputError, match="not a safetensors file"):
        load(out)


def test_shipped_calibration_matches_the_embedded_model(embedded):
    from workbench.macs.calibration import default_path

    path = default_path(embedded.path, embedded.config_hash)
    cal = load(path, embedded.layout.num_layers, embedded.layout.num_experts,
               embedded.config_hash)
    s = cal.summary()
    assert s["visual_experts"] > 0 and s["text_experts"] > 0


def test_cli_calibrate_macs(tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "cal"
    assert main(["calibrate-macs", "--out", str(out), "--requests", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["out"] == str(out) and got["layers"] == 12
    assert main(["calibrate-macs", "--out", str(out), "--requests", "4"]) == 2
    assert "already holds a MACS calibration" in capsys.readouterr().err
    assert main(["calibrate-macs", "--requests", "1"]) == 2
    assert "--requests must be from 2 to 4096" in capsys.readouterr().err


def test_ds_moe_reports_drop_and_reroute_rates(macs_run):
    _, _, res, ds = macs_run
    rates = ds.moe.dispatch_rates()
    a = rates["all"]
    assert a["dropped"] == res.dispatch_dropped and a["rerouted"] == res.dispatch_rerouted
    assert a["assigned"] == res.dispatch_assigned
    assert {"text", "image"} <= set(rates)
    assert sum(rates[m]["rerouted"] for m in ("text", "image", "video") if m in rates) == \
        a["rerouted"]
    per_rank = ds.moe.ep_rerouted(ranks=4)
    assert int(per_rank.sum()) == res.dispatch_rerouted and per_rank.sizes["rank"] == 4


def test_ep_view_shows_what_macs_rerouted(macs_run):
    from workbench.ui.views import ep_view_figure

    _, _, res, ds = macs_run
    fig = ep_view_figure(ds, 4, "contiguous")
    bars = {t.name: np.asarray(t.y, float) for t in fig.data if t.type == "bar"}
    key = "rerouted (overflow moved on the rank)"
    assert key in bars and bars[key].sum() > 0 and "rerouted" in fig.layout.title.text
    line = next(t for t in fig.data if t.name and t.name.startswith("capacity per rank"))
    # 16 experts a rank × the mean base capacity ⌈γ0 · T · k / E⌉ of the steps
    tokens = ds["step_tokens"].values
    want = np.mean(np.maximum(np.ceil(1.0 * tokens * 4 / 64), 1)) * 16
    assert float(line.y[0]) == pytest.approx(want)


def test_store_keeps_the_effective_load(macs_run, embedded, tmp_path):
    """MACS's effective load per (step, layer, expert, modality): the visual tokens weigh
    w(x) < 1, text tokens 1; a run without MACS stores its counts."""
    _, _, res, ds = macs_run
    eff = ds["effective_load"]
    routed = ds["routed_tokens"]
    assert float(eff.sel(modality="text").sum()) == pytest.approx(
        float(routed.sel(modality="text").sum()))
    img_eff, img_n = float(eff.sel(modality="image").sum()), int(routed.sel(modality="image").sum())
    assert 0 < img_eff < img_n
    per_rank = ds.moe.ep_load(ranks=4, effective=True)
    assert per_rank.dtype.kind == "f"
    assert float(per_rank.sum()) == pytest.approx(float(eff.sum()), rel=1e-5)
    plain = workbench.Runtime(embedded, max_new_tokens=2).run(
        "count from 1 to 3.", store=tmp_path / "p.zarr")
    pds = workbench.open_run(plain.store)
    np.testing.assert_array_equal(pds["effective_load"].values, pds["routed_tokens"].values)
    old = workbench.open_run(__import__("pathlib").Path(__file__).parent / "data" /
                             "store_v3.zarr")
    np.testing.assert_array_equal(old["effective_load"].values, old["routed_tokens"].values)


def test_ep_times_per_step_and_layer_sum_to_the_summary(macs_run):
    """ds.moe.ep_times keeps per (step, layer) what ep_summary sums (one clock)."""
    _, _, _, ds = macs_run
    t = ds.moe.ep_times(ranks=4)
    s = ds.moe.ep_summary(ranks=4)
    assert t["compute_s"].dims == ("step", "layer", "rank") and t.sizes["rank"] == 4
    assert float(t["dispatch_s"].sum()) == pytest.approx(s["dispatch_s_modeled"], rel=1e-9)
    assert float(t["compute_s"].max("rank").sum()) == pytest.approx(s["compute_s_modeled"],
                                                                    rel=1e-9)
    assert float(t["moe_layer_s"].sum()) == pytest.approx(s["moe_layer_s_modeled"], rel=1e-9)
    np.testing.assert_array_equal(t["load"].values, ds.moe.ep_load(ranks=4).values)


def test_ep_timeline_view_draws_the_modeled_ep_clock(macs_run):
    from workbench.ui.views import ep_timeline_view_figure

    _, _, _, ds = macs_run
    fig = ep_timeline_view_figure(ds, 4, "contiguous")
    names = {t.name for t in fig.data}
    assert {"dispatch (all-to-all)", "expert compute", "combine (all-to-all)"} <= names
    lanes = set(next(t for t in fig.data if t.name == "expert compute").y)
    assert lanes == {f"rank {r}" for r in range(4)}
    t = ds.moe.ep_times(4).sel(step=0)
    total = float(t["moe_layer_s"].sum()) * 1e3
    assert f"{total:.2f} ms of MoE layers" in fig.layout.title.text
    assert "ep_ranks = 1" in ep_timeline_view_figure(ds, 1, "contiguous").layout.annotations[0].text


def test_replay_view_shows_the_traces_ep_load(macs_run, tmp_path):
    """The dashboard's replay study carries the replayed trace's EP load over the Expert
    parallel card's ranks (issue 14 §5), the figures `workbench replay --set ep_ranks` gives."""
    from workbench.replay import replay_trace
    from workbench.traces import load_trace
    from workbench.ui.replay import study
    from workbench.ui.views import replay_table_html

    _, _, res, ds = macs_run
    tr = load_trace(res.store)
    st = study(tr, ["lru"], points=3, ep=(4, "round-robin"))
    assert st.ep["ranks"] == 4 and st.ep["placement"] == "round-robin"
    want = replay_trace(tr, belady=False, ep_ranks=4, placement="round-robin",
                        cache_slots=st.at_slots).extra["ep"]
    assert st.ep["imbalance"] == pytest.approx(want["imbalance"])
    assert f"imbalance <b>{want['imbalance']:.2f}</b>" in replay_table_html(st)
    assert study(tr, ["lru"], points=3, ep=(1, "contiguous")).ep is None
    bad = study(tr, ["lru"], points=3, ep=(65, "contiguous"))
    assert isinstance(bad, type(st)) and "ep_ranks" in bad.ep


def test_calibration_centroids_must_fit_the_model(embedded, tmp_path):
    cal = calibrate(embedded, calibration_requests(4, seed=2))
    bad = type(cal)(**{**cal.__dict__, "centroids": cal.centroids[..., :7]})
    out = save(bad, tmp_path / "narrow")
    with pytest.raises(InputError, match="centroids have 7 features, this model's MoE input "
                                         "has 64"):
        load(out, 12, 64, embedded.config_hash, hidden_size=64)
    rt = workbench.Runtime(embedded, max_new_tokens=2)
    with pytest.raises(InputError, match="centroids have 7 features"):
        rt.run("count from 1 to 3.", record=False, dispatch="macs", macs_calibration=str(out))
    with pytest.raises(InputError, match="MACS calibration folder '/proc/self/macs': cannot "):
        save(cal, "/proc/self/macs", overwrite=True)


def test_a_runtime_reads_its_calibration_again_only_when_the_files_change(embedded, tmp_path):
    """Every run reads its MACS calibration twice (the knob check, then the set-up): the
    runtime keeps the one it loaded, read-only, until a file is rewritten or replaced; a
    broken replacement is refused, not served from what was kept."""
    out = save(calibrate(embedded, calibration_requests(4, seed=2)), tmp_path / "m")
    rt = workbench.Runtime(embedded, max_new_tokens=2)
    knobs = rt.knobs.set(dispatch="macs", macs_calibration=str(out))
    first = rt.macs_calibration(knobs)
    assert rt.macs_calibration(knobs) is first and not first.centroids.flags.writeable
    rt.run("count from 1 to 3.", record=False, dispatch="macs", macs_calibration=str(out))
    assert rt.macs_calibration(knobs) is first
    other = calibrate(embedded, calibration_requests(4, seed=3))
    save(other, out, overwrite=True)
    again = rt.macs_calibration(knobs)
    assert again is not first
    np.testing.assert_array_equal(again.centroids, other.centroids.astype(np.float16))
    (out / "macs.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="MACS calibration"):
        rt.macs_calibration(knobs)


def test_compiled_rerouting_equals_its_python_source():
    """The rerouting loop runs compiled (numba); its own source, run as Python, gives the same
    moves on random groups with ties and NaN scores (numpy's argmax: the first highest, a NaN
    counting as highest)."""
    from workbench.sim import macs as M

    rng = np.random.default_rng(3)
    moved = 0
    for trial in range(200):
        T, E, K = int(rng.integers(1, 30)), int(rng.choice([4, 8, 16])), 2
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
        ids[rng.random((T, K)) < 0.1] = -1
        score = np.round(rng.random((T, E)), 1)  # ties
        score[rng.random((T, E)) < 0.02] = np.nan
        g = rng.random((T, E))
        gw = np.where(ids >= 0, rng.random((T, K)), np.nan)
        ranks = rng.integers(0, 2, E)
        ot = rng.integers(0, T, 2 * T).astype(np.int64)
        orr = rng.integers(0, K, 2 * T).astype(np.int64)
        keep = ids[ot, orr] >= 0
        ot, orr = ot[keep], orr[keep]
        w = rng.random(T)
        room0 = rng.random(E) * 2
        # the score given (mode 0), or computed from float32 gates and affinity (1, 2)
        mode = trial % 3
        g32, a32 = g.astype(np.float32), score.astype(np.float32)
        c1, c2 = (np.float64(0), np.float64(0)) if not mode else (np.float32(0.7),
                                                                   np.float32(0.3))
        outs = []
        for fn in (M._reroute_loop, M._reroute()):
            new_ids, new_w = ids.copy(), gw.copy()
            rerouted, room = np.zeros((T, K), bool), room0.copy()
            fn(ot, orr, w, ids, new_ids, new_w, rerouted, ranks[:, None] == ranks[None, :],
               room, score if not mode else a32, g if not mode else g32, gw,
               bool(trial % 2), c1, c2, mode)
            outs.append((new_ids, new_w, rerouted, room))
        for a, b in zip(*outs):
            np.testing.assert_array_equal(a, b)
        moved += int(outs[0][2].sum())
    assert moved > 100  # the loop moved assignments, ties and NaN scores among them


def test_compiled_group_equals_the_numpy_reference():
    """macs_group's compiled path (numba, from the priority order on) gives the numpy
    reference's ids, weights, rerouted flags and capacities bit for bit, on random groups:
    every selection, with and without dynamic capacity, rerouting, gates and affinity; NaN
    and ±inf combine weights, NaN gates and semantic weights; tied keys; loads near the
    capacity; int16 and int64 ids; empty and all-empty groups. The compiled path computes
    the capacity (numpy's pairwise sums: groups past 128 tokens too) and, from float32 gates
    and affinity, rerouting's scores itself; float64 gates and classes numpy broadcasts take
    the reference's arrays."""
    from workbench.sim.macs import SELECTIONS

    rng = np.random.default_rng(7)
    moved = dropped = 0
    for trial in range(600):
        T = int(rng.integers(0, 40) if trial % 9 else rng.integers(100, 400))
        E = int(rng.choice([4, 8, 16]))
        K = int(rng.integers(1, min(E, 4) + 1))
        ids = np.array([rng.choice(E, K, replace=False) for _ in range(T)],
                       np.int16 if trial % 2 else np.int64).reshape(T, K)
        ids[rng.random((T, K)) < (0.1 if trial % 7 else 1.0)] = -1  # every 7th: all empty
        gw = np.round(rng.random((T, K)), 1).astype(np.float32)  # ties
        gw[rng.random((T, K)) < 0.1] = np.nan
        gw[rng.random((T, K)) < 0.02] = np.inf * rng.choice([-1, 1])  # nan_to_num's ±max
        w = (np.ones(T), np.round(rng.random(T), 1), rng.random(T))[trial % 3]  # ties
        gates = rng.random((T, E)).astype(np.float32) if trial % 4 else None
        aff = rng.random((T, E)).astype(np.float32) if trial % 5 else None
        if trial % 11 == 0 and T:  # NaN semantic weight, gate and affinity
            w[0] = np.nan
            if gates is not None:
                gates[-1, 0] = np.nan
            if aff is not None:
                aff[0, -1] = np.nan
        if gates is not None and trial % 13 == 0:  # float64 gates: the reference's scores
            gates = gates.astype(np.float64)
        kw = dict(rho=0.6, dynamic_capacity=bool(trial % 2), min_capacity=int(trial % 3),
                  selection=SELECTIONS[trial % len(SELECTIONS)], seed=trial,
                  reroute=bool((trial // 2) % 3), rank_of_expert=rng.integers(0, 2, E),
                  gates=gates, affinity=aff, num_experts=E,
                  # products that round in float32 (not 0.5's); a numpy scalar as a float
                  eta=(0.3, 0.5, 0.7, 0.0, 1.0, np.float64(0.3))[trial % 6])
        c_base = float(rng.integers(1, 6)) - rng.random()  # fractional: loads near it
        classes = rng.integers(-1, 2, E if trial % 17 else 1).astype(np.int8)
        args = (ids, gw, w, rng.integers(0, 2, T).astype(np.int8), classes, c_base)
        ref = macs_group(*args, **kw, compiled=False)
        fast = macs_group(*args, **kw, compiled=True)
        for a, b in zip(ref, fast):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
        moved += int(ref[2].sum())
        dropped += int(((ids >= 0) & (ref[0] < 0)).sum())
    assert moved > 100 and dropped > 100  # both paths moved and dropped assignments
