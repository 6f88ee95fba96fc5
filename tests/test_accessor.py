"""ds.moe accessor and the viz figure builders: synthetic Datasets and stores, plus one tiny-model
run end to end."""

from __future__ import annotations

import json

import numpy as np
import plotly.graph_objects as go
import pytest
import xarray as xr

import workbench.analysis  # noqa: F401  (registers ds.moe)
from workbench.telemetry.events import IMAGE, TEXT, LayerEvent, Span, StepEvent
from workbench.telemetry.store import Recorder, open_run
from workbench.viz.heatmap import (expert_heatmap, hit_rate_figure, latency_figure,
                                   timeline_figure)


# -- synthetic data --------------------------------------------------------------------------
def synthetic(S=5, L=4, E=8, k=2, T=None, seed=0, pinned=(True, False, False, False),
              spans=0) -> xr.Dataset:
    """A Dataset shaped like ``open_run``'s: random hits/misses/routing, tokens of both modalities
    (the first half of each prefill token block is image). Schema 4 counters: hits and misses
    on offloaded layers only, a pinned layer's accesses in ``pinned_accesses``."""
    rng = np.random.default_rng(seed)
    pin = np.asarray(pinned, bool)
    T = T if T is not None else S * 3
    token_step = np.sort(rng.integers(0, S, T)).astype(np.int32)
    token_mod = rng.integers(0, 2, T).astype(np.int8)
    topk = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)])
                     for _ in range(T)]).astype(np.int16)  # [T, L, k]
    routed = np.zeros((S, L, E, 3), np.int32)
    for t in range(T):
        for l in range(L):
            routed[token_step[t], l, topk[t, l], token_mod[t]] += 1
    n = max(spans, 1)
    data = {
        "phase": ("step", (np.arange(S) > 0).astype(np.int8)),
        "step_tokens": ("step", np.bincount(token_step, minlength=S).astype(np.int32)),
        "latency_measured_s": ("step", rng.uniform(0.01, 0.1, S)),
        "latency_modeled_s": ("step", rng.uniform(1e-4, 1e-3, S)),
        "stall_measured_s": ("step", rng.uniform(0, 0.01, S)),
        "stall_modeled_s": ("step", rng.uniform(0, 1e-4, S)),
        "transfer_bytes": ("step", rng.integers(0, 1000, S)),
        "transfer_bytes_modeled": ("step", rng.integers(0, 1000, S)),
        "hits": (("step", "layer"), rng.integers(0, 5, (S, L)).astype(np.int32) * ~pin),
        "misses": (("step", "layer"), rng.integers(0, 5, (S, L)).astype(np.int32) * ~pin),
        "pinned_accesses": (("step", "layer"), rng.integers(1, 5, (S, L)).astype(np.int32) * pin),
        "loads": (("step", "layer"), rng.integers(0, 5, (S, L)).astype(np.int32)),
        "evictions": (("step", "layer"), rng.integers(0, 5, (S, L)).astype(np.int32)),
        "routed_tokens": (("step", "layer", "expert", "modality"), routed),
        "token_step": ("token", token_step),
        "token_modality": ("token", token_mod),
        "topk_ids": (("token", "layer", "k"), topk),
        "pinned": ("layer", np.asarray(pinned, bool)),
        "span_clock": ("span", rng.integers(0, 2, n).astype(np.int8)),
        "span_lane": ("span", rng.integers(0, 3, n).astype(np.int8)),
        "span_step": ("span", rng.integers(0, S, n).astype(np.int32)),
        "span_layer": ("span", rng.integers(-1, L, n).astype(np.int16)),
        "span_expert": ("span", rng.integers(-1, E, n).astype(np.int16)),
        "span_start_s": ("span", rng.uniform(0, 1, n)),
    }
    ds = xr.Dataset(data, coords={"step": np.arange(S), "layer": np.arange(L),
                                  "expert": np.arange(E), "k": np.arange(k),
                                  "modality": ["text", "image", "video"]},
                    attrs={"top_k": k, "phase_names": ["prefill", "decode"],
                           "lane_names": ["compute", "transfer", "stall"],
                           "clock_names": ["measured", "modeled"], "status": "complete"})
    ds["span_end_s"] = ds["span_start_s"] + rng.uniform(0, 0.1, n)
    return ds


def routing_ds(used: np.ndarray) -> xr.Dataset:
    """Dataset with only ``routed_tokens`` (text) from a bool/int [step, layer, expert] array."""
    S, L, E = used.shape
    rt = np.zeros((S, L, E, 3), np.int32)
    rt[..., 0] = used
    return xr.Dataset({"routed_tokens": (("step", "layer", "expert", "modality"), rt)},
                      coords={"step": np.arange(S), "layer": np.arange(L),
                              "expert": np.arange(E), "modality": ["text", "image", "video"]},
                      attrs={"top_k": 2})


def topk_ds(topk: list, modality: list, E: int = 8) -> xr.Dataset:
    """Dataset with only per-token routing: ``topk`` [T][L][k] expert ids."""
    a = np.asarray(topk, np.int16)
    return xr.Dataset({"topk_ids": (("token", "layer", "k"), a),
                       "token_modality": ("token", np.asarray(modality, np.int8))},
                      coords={"layer": np.arange(a.shape[1]), "expert": np.arange(E),
                              "modality": ["text", "image", "video"]})


# -- hit rate ------------------------------------------------------------------------------------
def test_hit_rate_is_hits_over_accesses_of_offloaded_layers():
    ds = synthetic()
    h = ds.hits.values[:, 1:].sum()
    m = ds.misses.values[:, 1:].sum()
    assert ds.moe.hit_rate() == pytest.approx(h / (h + m))
    # include_pinned: the pinned prefix's accesses count as hits
    ha, ma = ds.hits.values.sum() + ds.pinned_accesses.values.sum(), ds.misses.values.sum()
    assert ds.moe.hit_rate(include_pinned=True) == pytest.approx(ha / (ha + ma))
    assert ds.moe.hit_rate(include_pinned=True, by="layer").values[0] == 1.0

    per_layer = ds.moe.hit_rate(by="layer")
    assert per_layer.dims == ("layer",)
    assert np.isnan(per_layer.values[0])  # pinned layer excluded
    hl, ml = ds.hits.values.sum(0), ds.misses.values.sum(0)
    np.testing.assert_allclose(per_layer.values[1:], hl[1:] / (hl[1:] + ml[1:]))

    per_step = ds.moe.hit_rate(by="step")
    hs, ms = ds.hits.values[:, 1:].sum(1), ds.misses.values[:, 1:].sum(1)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(per_step.values, hs / (hs + ms))


def test_hit_rate_and_summary_same_in_the_schema_3_meaning():
    """A Dataset in the schema ≤ 3 meaning (a pinned layer's accesses booked as its hits, no
    pinned_accesses) gives the numbers of its schema-4 split."""
    ds = synthetic()
    old = ds.drop_vars("pinned_accesses")
    old["hits"] = ds.hits + ds.pinned_accesses
    assert int(old.hits.sum()) > int(ds.hits.sum())  # the two meanings really differ
    for kw in ({}, {"include_pinned": True}):
        assert old.moe.hit_rate(**kw) == ds.moe.hit_rate(**kw)
        for by in ("layer", "step"):
            np.testing.assert_array_equal(old.moe.hit_rate(by=by, **kw).values,
                                          ds.moe.hit_rate(by=by, **kw).values)
    assert old.moe.summary() == ds.moe.summary()


def test_hit_rate_nan_without_accesses():
    ds = synthetic()
    ds["hits"][:] = 0
    ds["misses"][:, 2] = 0
    assert np.isnan(ds.moe.hit_rate(by="layer").values[2])
    assert ds.moe.hit_rate(by="layer").values[1] == 0.0
    ds["misses"][:] = 0
    assert np.isnan(ds.moe.hit_rate())
    assert np.isnan(ds.moe.hit_rate(by="step").values).all()


# -- working set, concentration --------------------------------------------------------------
def test_working_set_of_hand_made_routing():
    used = np.zeros((4, 2, 4), int)
    used[0, 0, [0, 1]] = 1       # step 0: (0,0) (0,1) (1,3)
    used[0, 1, 3] = 5
    used[1, 0, [0, 1]] = 2       # step 1: (0,0) (0,1)
    used[2, 1, [0, 1, 2]] = 1    # step 2: (1,0) (1,1) (1,2)
    # step 3: nothing
    ds = routing_ds(used)
    assert ds.moe.working_set().values.tolist() == [3, 2, 3, 0]
    assert ds.moe.working_set(window=1).values.tolist() == [3, 2, 3, 0]
    assert ds.moe.working_set(window=2).values.tolist() == [3, 3, 5, 3]
    assert ds.moe.working_set(window=3).values.tolist() == [3, 3, 6, 5]
    assert ds.moe.working_set(window=100).values.tolist() == [3, 3, 6, 6]


def test_concentration_entropy_inactive():
    used = np.zeros((1, 2, 4), int)
    used[0, 0] = [6, 2, 2, 0]  # layer 0: top-2 share 8/10, one inactive expert
    used[0, 1] = [1, 1, 1, 1]  # layer 1: uniform
    ds = routing_ds(used)
    np.testing.assert_allclose(ds.moe.concentration().values, [0.8, 0.5])  # top_k = 2
    np.testing.assert_allclose(ds.moe.concentration(top=1).values, [0.6, 0.25])
    p = np.array([0.6, 0.2, 0.2])
    np.testing.assert_allclose(ds.moe.entropy().values, [-(p * np.log2(p)).sum(), 2.0])
    assert ds.moe.inactive_experts().values.tolist() == [1, 0]
    # no image tokens at all: every expert inactive, concentration and entropy undefined
    assert ds.moe.inactive_experts(modality="image").values.tolist() == [4, 4]
    assert np.isnan(ds.moe.concentration(modality="image").values).all()
    assert np.isnan(ds.moe.entropy(modality="image").values).all()


# -- layer similarity --------------------------------------------------------------------------
def test_layer_similarity_is_mean_token_jaccard():
    topk = [
        [[0, 1], [0, 1], [2, 3]],  # text: l0=l1 (J=1), l1/l2 disjoint (0), l0/l2 0
        [[0, 1], [1, 2], [1, 2]],  # image: l0/l1 J=1/3, l1=l2, l0/l2 1/3
    ]
    ds = topk_ds(topk, [TEXT, IMAGE])
    sim = ds.moe.layer_similarity()
    assert sim.dims == ("layer", "layer2")
    expect = np.array([[1, (1 + 1 / 3) / 2, (0 + 1 / 3) / 2],
                       [(1 + 1 / 3) / 2, 1, (0 + 1) / 2],
                       [(0 + 1 / 3) / 2, (0 + 1) / 2, 1]])
    np.testing.assert_allclose(sim.values, expect)
    np.testing.assert_allclose(ds.moe.layer_similarity("text").values,
                               [[1, 1, 0], [1, 1, 0], [0, 0, 1]])
    np.testing.assert_allclose(np.diagonal(ds.moe.layer_similarity("image").values, 1),
                               [1 / 3, 1])
    assert np.isnan(ds.moe.layer_similarity("video").values).all()


def test_layer_similarity_ignores_padding():
    ds = topk_ds([[[0, 1], [0, -1]], [[2, 3], [-1, -1]]], [TEXT, TEXT])
    # token 0: {0,1} vs {0} = 1/2; token 1 has no experts at layer 1 → not counted
    assert ds.moe.layer_similarity().values[0, 1] == pytest.approx(0.5)


# -- expert counts with modalities, phases and steps (through a real store) ------------------
def _layer_event(layer: int, ids: np.ndarray) -> LayerEvent:
    return LayerEvent(layer=layer, pinned=False, topk_ids=ids,
                      topk_weights=np.full(ids.shape, 0.5, np.float32))


@pytest.fixture(scope="module")
def image_store(tmp_path_factory):
    """A store written by Recorder from hand-made events: a prefill of 4 image + 2 text tokens,
    then 3 text decode steps. Image tokens go to experts 4..7, text tokens to 0..3."""
    path = tmp_path_factory.mktemp("img") / "run.zarr"
    L, E, k = 2, 8, 2
    rng = np.random.default_rng(1)
    with Recorder(path, L, E, k, attrs={"top_k": k}, pinned=[True, False]) as rec:
        for step in range(4):
            mod = np.array([IMAGE] * 4 + [TEXT] * 2 if step == 0 else [TEXT], np.int8)
            T = len(mod)
            layers = []
            for l in range(L):
                ids = np.stack([rng.choice(4, k, replace=False) + (4 if m == IMAGE else 0)
                                for m in mod]).astype(np.int16)
                layers.append(_layer_event(l, ids))
            spans = [Span(1, lane, step, 0, -1, step + 0.1 * lane, step + 0.1 * lane + 0.05)
                     for lane in range(3)]
            rec.add(StepEvent(step=step, phase=0 if step == 0 else 1,
                              token_ids=np.arange(T), modality=mod, layers=layers, spans=spans,
                              latency_measured_s=0.1, latency_modeled_s=0.001))
    return open_run(path)


def test_modality_filtering_on_a_store_with_image_tokens(image_store):
    ds = image_store
    text = ds.moe.expert_counts("text")
    image = ds.moe.expert_counts("image")
    everything = ds.moe.expert_counts()
    assert text.dims == ("layer", "expert")
    assert int(image.sum()) == 4 * 2 * 2  # 4 image tokens × 2 layers × top-2
    assert int(text.sum()) == 5 * 2 * 2  # 2 + 3 text tokens
    assert int(image[:, :4].sum()) == 0 and int(text[:, 4:].sum()) == 0
    np.testing.assert_array_equal(everything.values, text.values + image.values)
    assert int(ds.moe.expert_counts("video").sum()) == 0
    # independent count from the per-token routing
    ids = ds.topk_ids.values[ds.token_modality.values == IMAGE]
    for l in range(2):
        np.testing.assert_array_equal(image.values[l], np.bincount(ids[:, l].ravel(),
                                                                   minlength=8))


def test_phase_and_step_selection(image_store):
    ds = image_store
    assert int(ds.moe.expert_counts(phase="prefill").sum()) == 6 * 2 * 2
    assert int(ds.moe.expert_counts(phase="decode").sum()) == 3 * 2 * 2
    assert int(ds.moe.expert_counts("image", phase="decode").sum()) == 0
    assert int(ds.moe.expert_counts(steps=slice(1, 2)).sum()) == 2 * 2 * 2  # inclusive
    assert int(ds.moe.expert_counts(steps=3).sum()) == 4
    assert int(ds.moe.expert_counts(steps=[0, 3], phase="decode").sum()) == 4


# -- figures -------------------------------------------------------------------------------------
def test_heatmap_shape_and_normalisation(image_store):
    fig = image_store.moe.heatmap(modality="image")
    assert isinstance(fig, go.Figure)
    z = np.asarray(fig.data[0].z, float)
    assert z.shape == (2, 8)  # [layers × experts]
    np.testing.assert_allclose(z.sum(axis=1), 1.0)
    assert "image" in fig.layout.title.text
    raw = image_store.moe.heatmap(modality="text", normalize=False, phase="decode")
    np.testing.assert_array_equal(raw.data[0].z,
                                  image_store.moe.expert_counts("text", phase="decode").values)


def test_expert_heatmap_fast_at_full_size():
    counts = xr.DataArray(np.random.default_rng(0).integers(0, 50, (48, 128)),
                          dims=("layer", "expert"),
                          coords={"layer": np.arange(48), "expert": np.arange(128)},
                          attrs={"units": "tokens"})
    # (its speed is benchmarks/' business: no test asserts wall time on a shared machine)
    fig = expert_heatmap(counts.T, "x")  # any dim order in, [layer, expert] out
    assert np.asarray(fig.data[0].z).shape == (48, 128)
    assert fig.layout.yaxis.title.text == "MoE layer"


def test_latency_and_hit_rate_figures_label_their_clock():
    ds = synthetic()
    fig = latency_figure(ds)
    names = [t.name for t in fig.data]
    assert len(names) == 2 and "measured" in names[0] and "modeled" in names[1]
    np.testing.assert_allclose(fig.data[1].y, ds.latency_modeled_s.values * 1e3)
    assert "measured" in fig.layout.yaxis.title.text
    assert "modeled" in fig.layout.yaxis2.title.text
    hr = hit_rate_figure(ds)
    assert [t.type for t in hr.data] == ["bar", "scatter"]
    np.testing.assert_allclose(hr.data[1].y, ds.moe.hit_rate(by="step").values)


def test_timeline_lanes_and_clock_filter():
    ds = synthetic(S=6, spans=4000)
    fig = timeline_figure(ds, clock="modeled", steps=slice(1, 3))
    assert [t.name for t in fig.data] == ["compute (modeled)", "transfer (modeled)",
                                          "stall (modeled)"]
    keep = (ds.span_clock.values == 1) & (ds.span_step.values >= 1) & (ds.span_step.values <= 3)
    assert sum(len(t.x) for t in fig.data) == keep.sum()
    for i, t in enumerate(fig.data):
        m = keep & (ds.span_lane.values == i)
        np.testing.assert_allclose(np.sort(np.asarray(t.base, float)),
                                   np.sort(ds.span_start_s.values[m] * 1e3))
    assert "modeled" in fig.layout.xaxis.title.text
    assert fig.layout.title.text == "timeline, modeled clock (steps 1-3)"  # not "slice(1, 3, None)"
    assert timeline_figure(ds, steps=2).layout.title.text.endswith("(step 2)")
    from workbench.viz.heatmap import integer_ticks, latency_figure

    assert integer_ticks([0, 1]) == {"tickmode": "linear", "tick0": 0, "dtick": 1}  # not 0, 0.5, 1
    assert integer_ticks(range(500))["dtick"] == 42 and integer_ticks([]) == {}
    assert latency_figure(ds).layout.xaxis.dtick >= 1
    measured = timeline_figure(ds, clock="measured")
    assert sum(len(t.x) for t in measured.data) == (ds.span_clock.values == 0).sum()


# -- bad arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize("call, words", [
    (lambda m: m.expert_counts(modality="audio"), ["modality", "'audio'", "'image'"]),
    (lambda m: m.heatmap(modality="Image"), ["modality", "'Image'", "'text'"]),
    (lambda m: m.expert_counts(phase="warmup"), ["phase", "'warmup'", "'decode'"]),
    (lambda m: m.expert_counts(steps="0:3"), ["steps", "'0:3'", "slice"]),
    (lambda m: m.expert_counts(steps=[99]), ["steps", "99"]),
    (lambda m: m.hit_rate(by="expert"), ["by", "'expert'", "'layer'"]),
    (lambda m: m.working_set(window=0), ["window", "0"]),
    (lambda m: m.concentration(top=9), ["top", "9", "1..8"]),
    (lambda m: m.layer_similarity(modality="all_text"), ["modality", "'all_text'"]),
])
def test_bad_arguments_raise_value_error_naming_them(call, words):
    ds = synthetic()
    with pytest.raises(ValueError) as e:
        call(ds.moe)
    for w in words:
        assert w in str(e.value)


def test_bad_clock():
    with pytest.raises(ValueError, match="clock.*'wall'"):
        timeline_figure(synthetic(), clock="wall")


# -- a real (tiny) run -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tiny_ckpt, tmp_path_factory):
    """One offloaded run of the tiny random qwen2_moe (text only): (RunResult, Dataset)."""
    import workbench

    store = tmp_path_factory.mktemp("tiny_run") / "r.zarr"
    rt = workbench.Runtime(tiny_ckpt("qwen2_moe"), cache_slots=4, pinned_layers=1,
                           max_new_tokens=6, device="cpu")
    res = rt.run("hello world", store=store)
    return res, workbench.open_run(store)


def test_tiny_run_end_to_end(tiny_run):
    res, ds = tiny_run
    s = ds.moe.summary()
    assert s["steps"] == res.steps == ds.sizes["step"]
    for key in ("hits", "misses", "loads", "evictions"):
        assert s[key] == getattr(res, key), key
    assert s["hit_rate"] == pytest.approx(res.hit_rate, nan_ok=True)
    assert s["latency_measured_s"] == pytest.approx(res.latency_measured_s)
    assert s["latency_modeled_s"] == pytest.approx(res.latency_modeled_s)
    assert s["transfer_bytes_measured"] == res.transfer_bytes
    assert s["transfer_bytes_modeled"] == res.transfer_bytes_modeled
    # every routed token goes to top_k experts in every layer; text only
    total = int(ds.step_tokens.sum()) * ds.attrs["top_k"] * ds.sizes["layer"]
    assert int(ds.moe.expert_counts().sum()) == total
    assert int(ds.moe.expert_counts("text").sum()) == total
    assert int(ds.moe.expert_counts("image").sum()) == 0
    assert (ds.moe.working_set().values <= ds.sizes["layer"] * ds.sizes["expert"]).all()
    sim = ds.moe.layer_similarity()
    np.testing.assert_allclose(np.diagonal(sim.values), 1.0)
    assert ((sim.values >= 0) & (sim.values <= 1)).all()
    for fig in (hit_rate_figure(ds), latency_figure(ds), timeline_figure(ds),
                timeline_figure(ds, "measured"), ds.moe.heatmap()):
        assert isinstance(fig, go.Figure) and len(fig.data) > 0


# -- VisMMOE: Hot Recall and visual tokens of a real run (issue 5) -----------------------------
def _recall_by_sets(ds: xr.Dataset, k: int, window: int) -> np.ndarray:
    """Hot Recall@k per layer from the per-token routing (``topk_ids``, ``token_step``) and the
    recorded ranking, with Python sets: an independent computation of ``ds.moe.hot_recall``."""
    ids = ds["predicted_ids"].values
    topk = ds["topk_ids"].values
    tstep = ds["token_step"].values
    S, L = ids.shape[:2]
    out = np.full(L, np.nan)
    for l in range(L):
        vals = []
        for s in range(S):
            if (ids[s, l] < 0).all():
                continue
            used = topk[tstep == s]
            ahead = {int(e) for j in range(l + 1, min(l + window, L - 1) + 1)
                     for e in used[:, j].ravel() if e >= 0}
            if ahead:
                vals.append(len(ahead & {int(e) for e in ids[s, l, :k]}) / len(ahead))
        if vals:
            out[l] = np.mean(vals)
    return out


def test_hot_recall_of_a_vismmoe_run_matches_a_set_computation(vismmoe_run):
    path, res = vismmoe_run
    ds = open_run(path)
    W = json.loads(ds.attrs["knob.window"])
    E = ds.sizes["expert"]
    for k, window in ((10, None), (20, None), (10, 1), (3, 2)):
        hr = ds.moe.hot_recall(k, window=window)
        want = _recall_by_sets(ds, k, W if window is None else window)
        np.testing.assert_allclose(hr.values, want, rtol=1e-12, equal_nan=True)
        assert hr.dims == ("layer",) and hr.attrs["k"] == k
        assert np.isnan(hr.values[-1]) and (hr["samples"].values[:-1] == res.steps).all()
        rnd = ds.moe.hot_recall(k, window=window, baseline="random")
        np.testing.assert_allclose(rnd.values[:-1], min(k, E) / E)
        orc = ds.moe.hot_recall(k, window=window, baseline="oracle")
        assert (orc.values[:-1] >= hr.values[:-1] - 1e-12).all()  # nothing beats the oracle
    # the decode steps alone: one token a step, so few experts ahead and a sharper recall
    dec = ds.moe.hot_recall(10, phase="decode")
    assert (dec["samples"].values[:-1] == res.steps - 1).all()


def test_hot_recall_refuses_runs_without_predictions_and_bad_arguments(vismmoe_run, tiny_run):
    _, ds_plain = tiny_run
    with pytest.raises(ValueError, match="predicted_ids.*predictor=vismmoe"):
        ds_plain.moe.hot_recall()
    ds = open_run(vismmoe_run[0])
    B = ds.sizes["pred_order"]
    for bad in (0, B + 1, 2.5, True):
        with pytest.raises(ValueError, match=f"k must be an int in 1..{B}"):
            ds.moe.hot_recall(bad)
    with pytest.raises(ValueError, match="window must be"):
        ds.moe.hot_recall(window=0)
    with pytest.raises(ValueError, match="baseline must be None, 'random' or 'oracle'"):
        ds.moe.hot_recall(baseline="best")


def test_visual_tokens_of_a_compressed_run(vismmoe_run):
    path, res = vismmoe_run
    ds = open_run(path)
    vt = ds.moe.visual_tokens()
    grid = json.loads(ds.attrs["image_grid_thw"])
    m = ds.attrs["spatial_merge_size"]
    rows, cols = grid[0][1] // m, grid[0][2] // m
    assert json.loads(vt.attrs["grids"]) == [[rows, cols]]
    assert vt.sizes["visual_token"] == rows * cols == res.visual_tokens
    assert int(vt["kept"].sum()) == res.kept_visual_tokens < res.visual_tokens
    # row-major cells, each once
    np.testing.assert_array_equal(vt["row"].values * cols + vt["col"].values,
                                  np.arange(rows * cols))
    assert (ds["token_modality"].values[vt["token"].values] == IMAGE).all()
    old = ds.copy()
    del old.attrs["image_grid_thw"]  # as a store written before the grid was recorded
    with pytest.raises(ValueError, match="image_grid_thw"):
        old.moe.visual_tokens()


def test_ep_load_per_rank_and_modality_on_a_store(image_store):
    """Image tokens route to experts 4..7, text to 0..3: with 2 contiguous ranks every image
    assignment lands on rank 1 and every text one on rank 0 (issue 14)."""
    ds = image_store
    load = ds.moe.ep_load(ranks=2, placement="contiguous")
    assert load.dims == ("step", "layer", "rank") and load.shape == (4, 2, 2)
    assert int(load.sum()) == int((ds.topk_ids.values >= 0).sum())
    img = ds.moe.ep_load(ranks=2, placement="contiguous", modality="image")
    txt = ds.moe.ep_load(ranks=2, placement="contiguous", modality="text")
    assert int(img[..., 0].sum()) == 0 and int(img.sum()) == 4 * 2 * 2
    assert int(txt[..., 1].sum()) == 0
    np.testing.assert_array_equal(load.values, img.values + txt.values)
    ib = ds.moe.ep_imbalance(ranks=2, placement="contiguous", modality="image")
    assert float(ib.sel(step=0).max()) == 2.0 and bool(ib.sel(step=1).isnull().all())
    # round-robin spreads both modalities over both ranks
    rr = ds.moe.ep_load(ranks=2, placement="round-robin", modality="image")
    assert int(rr[..., 0].sum()) > 0 and int(rr[..., 1].sum()) > 0
    s = ds.moe.ep_summary(ranks=2, placement="contiguous")
    assert s["by_modality"]["image"]["imbalance"] == 2.0
    assert s["rank_share"] == pytest.approx([20 / 36, 16 / 36])  # text 5×2×2, image 4×2×2
    with pytest.raises(Exception, match="ep_ranks must be"):
        ds.moe.ep_load(ranks=9)
