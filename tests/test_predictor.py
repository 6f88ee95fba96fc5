"""Compression-guided lookahead predictor (issue 5 §2): targets, features, calibration, files,
Hot Recall, CLI and the prefetch registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench.predictor.features import build_feature, feature_dim, window_targets
from workbench.predictor.model import hot_recall, load, oracle_recall, random_recall, save


def test_window_targets_hand_made():
    # 4 layers × 3 experts; layer j activates expert j % 3
    active = np.zeros((4, 3), bool)
    for j in range(4):
        active[j, j % 3] = True
    g = window_targets(active, window=2, decay=0.5)
    # layer 0: d=1 → layer 1 (expert 1) weight 1; d=2 → layer 2 (expert 2) weight 0.5
    np.testing.assert_allclose(g[0], [0.0, 1.0, 0.5])
    np.testing.assert_allclose(g[1], [0.5, 0.0, 1.0])  # layer 2 (e2) 1, layer 3 (e0) 0.5
    np.testing.assert_allclose(g[2], [1.0, 0.0, 0.0])  # window cut at the last layer
    np.testing.assert_allclose(g[3], [0.0, 0.0, 0.0])  # last layer: nothing ahead
    # max, not sum: an expert active at d=1 and d=2 keeps weight 1
    both = np.array([[0, 0], [1, 0], [1, 0]], bool)
    np.testing.assert_allclose(window_targets(both, 5, 0.8)[0], [1.0, 0.0])


def test_feature_shapes():
    L, E, H = 4, 6, 5
    hist = np.random.default_rng(0).random((L, E)).astype(np.float32)
    x = build_feature(2, hist, None, np.ones(H, np.float32), np.ones(H, np.float32), L, True)
    assert x.shape == (feature_dim(L, E, H, True),) == (3 * E + 2 * H + L,)
    np.testing.assert_array_equal(x[:E], hist[2])
    np.testing.assert_array_equal(x[E:2 * E], hist[1])
    assert x[-L:].tolist() == [0, 0, 1, 0]
    x0 = build_feature(0, hist, None, np.ones(H, np.float32), None, L, False)
    assert x0.shape == (3 * E + H + L,)
    assert not x0[E:3 * E].any()  # no layer −1, no previous step


def test_recall_metrics():
    s = np.array([[0.9, 0.1, 0.8, 0.2]])
    a = np.array([[True, True, False, False]])
    assert hot_recall(s, a, 2)[0] == 0.5
    assert random_recall(a, 2)[0] == 0.5
    assert oracle_recall(a, 1)[0] == 0.5 and oracle_recall(a, 2)[0] == 1.0


@pytest.fixture(scope="module")
def lm():
    from workbench.models.loading import load as load_model

    return load_model(None, device="cpu")


@pytest.fixture(scope="module")
def calibrated(lm):
    from workbench.predictor.calibrate import calibrate, scene_requests

    return calibrate(lm, scene_requests(0, 10), steps=120, seed=0, max_new_tokens=2)


def test_tiny_calibration_saves_reloads_and_beats_random(calibrated, lm, tmp_path):
    pred, rep = calibrated
    lay = lm.layout
    assert pred.cfg.num_layers == lay.num_layers and pred.cfg.num_experts == lay.num_experts
    h = rep["heldout"]
    for k in (10, 20):
        assert h[f"k{k}"]["hot_recall"] > h[f"k{k}"]["random"]
        assert len(h[f"k{k}"]["per_layer"]) == lay.num_layers - 1
    assert "ablation_no_visual_summary" in rep
    assert rep["cost"]["p50_s"] > 0 and rep["cost"]["p99_s"] >= rep["cost"]["p50_s"]
    out = save(pred, tmp_path / "p", rep)
    # the files hold tensors only: safetensors loads them without pickle
    from safetensors.torch import load_file

    sd = load_file(str(out / "predictor.safetensors"))
    assert set(sd) == set(pred.state_dict())
    again = load(out)
    x = np.random.default_rng(1).random((3, pred.cfg.in_dim)).astype(np.float32)
    np.testing.assert_array_equal(pred.scores(x), again.scores(x))


def test_calibration_is_deterministic(lm):
    from workbench.predictor.calibrate import calibrate, scene_requests

    a, _ = calibrate(lm, scene_requests(3, 4), steps=20, seed=1, max_new_tokens=1,
                     ablation=False)
    b, _ = calibrate(lm, scene_requests(3, 4), steps=20, seed=1, max_new_tokens=1,
                     ablation=False)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_probe_hooks_removed(lm):
    from workbench.predictor.features import RoutingProbe

    before = [(len(b.block._forward_pre_hooks), len(b.router._forward_hooks))
              for b in lm.layout.blocks]
    with RoutingProbe(lm.model, lm.layout):
        pass
    assert before == [(len(b.block._forward_pre_hooks), len(b.router._forward_hooks))
                      for b in lm.layout.blocks]


def test_live_run_with_vismmoe_prefetch(calibrated, lm, tmp_path):
    from workbench.runtime.runtime import Runtime

    pred, rep = calibrated
    save(pred, tmp_path / "p", rep)
    from workbench.knobs import Knobs

    rt = Runtime(lm, knobs=Knobs(prefetch="vismmoe", predictor_path=str(tmp_path / "p"),
                                   cache_slots=16, max_new_tokens=2, device="cpu"))
    res = rt.run("what shape is red?", ["data/demo/scene_0.png"], record=False)
    assert res.predictor_cost["calls"] > 0
    assert res.predictor_cost["p99_s"] >= res.predictor_cost["p50_s"]


def test_cli_refuses_existing_out_and_missing_model(tmp_path, capsys):
    from workbench.cli import main

    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "predictor.json").write_text("{}")  # (an empty folder counts as new)
    assert main(["calibrate", "--out", str(tmp_path / "exists")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["calibrate", "--out", str(tmp_path / "new"), "--model",
                 str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_policy_in_prefetch_menu():
    from workbench.knobs import Knobs
    from workbench.policies.prefetch import PREFETCH, PrefetchContext

    assert "vismmoe" in PREFETCH.available()
    k = Knobs()
    assert "vismmoe" in k.group("prefetch").param["prefetch"].objects
    assert (k.window, k.decay, k.predictor) == (5, 0.8, "none")
    pol = PREFETCH.create("vismmoe", window=2, decay=0.5)
    ctx = PrefetchContext(step=0, layer=1, num_layers=4, lead=1, pred=lambda d: [],
                          previous=lambda l: [], future=lambda d: [],
                          predicted=lambda: [(3, 0.9), (5, 0.6)])
    # (2,3):0.9, (2,5):0.6 vs (3,3):0.45, (3,5):0.3
    assert pol.candidates(ctx) == [(2, 3), (2, 5), (3, 3), (3, 5)]


@pytest.mark.parametrize("knobs", [dict(cache_slots=16, pinned_layers=0),
                                   dict(cache_slots=20, pinned_layers=1, prefetch_budget=6,
                                        window=3, decay=0.7)])
def test_live_vismmoe_prefetch_equals_replay(calibrated, lm, tmp_path, knobs,
                                            assert_replays_live):
    """The predictor's outputs are recorded per (step, layer) (predicted_ids/_scores), so
    replaying a vismmoe run reproduces it exactly, as for the other prefetch policies."""
    import workbench
    from workbench.errors import KnobError
    from workbench.analysis import open_run
    from workbench.traces import from_store

    pred, rep = calibrated
    save(pred, tmp_path / "p", rep)
    rt = workbench.Runtime(lm, device="cpu", max_new_tokens=6, ignore_eos=True)
    path = tmp_path / "vis.zarr"
    rt.run("what shape is red?", ["data/demo/scene_0.png"], store=path, prefetch="vismmoe",
           predictor_path=str(tmp_path / "p"), **knobs)
    ds = open_run(path)
    B = knobs.get("prefetch_budget") or 20
    L = lm.layout.num_layers
    assert ds["predicted_ids"].dims == ("step", "layer", "pred_order")
    assert ds.sizes["pred_order"] == B
    ids = ds["predicted_ids"].values
    assert (ids[:, : L - 1] >= 0).all() and (ids[:, L - 1] == -1).all()  # none past the last
    assert int(ds["prefetches"].sum()) > 0
    # the budget as documented: at most B prefetches issued per layer step (prefetch_budget,
    # None = the predictor's B = 20), counted where they are issued
    assert int(ds["prefetches"].values.max()) <= B
    tr = from_store(ds)
    assert tr.predicted_ids.shape == (ds.sizes["step"], L, B)
    res = ds.moe.replay()
    assert res.config["prefetch"] == "vismmoe"
    assert_replays_live(res, ds)
    # the over-fetch the dashboard and the CLI report: one definition, live and in replay
    import json as _json
    summary = _json.loads(ds.attrs["summary"]) if isinstance(ds.attrs["summary"], str) \
        else ds.attrs["summary"]
    m = res.metrics()
    assert summary["redundant_prefetches"] == m["redundant_transfers"]
    assert summary["prefetches"] == m["prefetch_loads"]
    assert summary["redundant_share"] == pytest.approx(m["redundant_share"])
    # a run without the predictor records no predictions (rank 1, all -1) and replay refuses
    plain = tmp_path / "plain.zarr"
    rt.run("what shape is red?", ["data/demo/scene_0.png"], store=plain, max_new_tokens=2,
           cache_slots=16)
    dp = open_run(plain)
    assert dp.sizes["pred_order"] == 1 and (dp["predicted_ids"].values == -1).all()
    assert from_store(dp).predicted_ids is None
    with pytest.raises(KnobError, match="needs the lookahead predictor's outputs"):
        dp.moe.replay(prefetch="vismmoe")
