"""The VisMMOE reproduction studies (workbench.analysis.vismmoe): stage configurations, scaling,
pruned-token accounting, accuracy at β = 1, the calibration flow, and the verdict logic."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from workbench.analysis import vismmoe as V
from workbench.errors import InputError

LAYOUT = SimpleNamespace(num_layers=8, num_experts=32, top_k=4, expert_bytes=49_152,
                         backbone_bytes=2_510_000)


# -- pure: scaling and stage configurations --------------------------------------------------
def test_scaling_matches_the_paper_shares():
    assert V.expert_budget_slots(8, 32) == 86  # 33.8 % of 256 experts, rounded down
    assert V.expert_budget_slots(48, 128) == 2075  # the paper's own 35.9 GB / 17.3 MB
    assert V.scaled_prefetch_budget(128) == 20 and V.scaled_prefetch_budget(32) == 5
    assert V.scaled_ks(128) == (10, 20, 30) and V.scaled_ks(32) == (3, 5, 8)
    assert V.scaled_plan(LAYOUT, 86, 1).valid_interval == (1, 2)  # ⌊(86 − 4) / 32⌋
    assert V.scaled_plan(LAYOUT, 172, 1).valid_interval == (1, 5)
    assert V.scaled_plan(LAYOUT, 86, 0, semantic_layers=0).valid_interval == (0, 2)
    assert V.chance_jaccard(4, 32) == pytest.approx(0.07498, abs=1e-4)
    assert V.chance_jaccard(1, 1) == 1.0


def test_ladder_stages_differ_as_described():
    cfg = {st.name: k for st, k in V.ladder_configs(LAYOUT, budget_slots=86, pinned_full=2,
                                                    predictor_path="/p")}
    assert list(cfg) == ["base", "+compression", "+prediction & prefetch", "full",
                         "full + hybrid"]
    base, comp, pred, full, hybrid = cfg.values()

    def changed(a, b):
        return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}

    assert base["compression"] == "none" and base["eviction"] == "lru"
    assert base["prefetch"] == "none" and base["predictor"] == "none"
    assert base["pinned_layers"] == 1 and base["cache_slots"] == 86 - 32
    assert base["target_model"] == "qwen3-vl-30b-a3b" and base["profile"] == "a100-40gb"
    assert changed(base, comp) == {"compression", "beta", "lam", "alpha"}
    assert (comp["compression"], comp["beta"], comp["lam"]) == ("affinity", 0.5, 2.0)
    assert changed(comp, pred) == {"predictor", "prefetch", "predictor_path", "prefetch_budget"}
    assert pred["prefetch"] == pred["predictor"] == "vismmoe" and pred["prefetch_budget"] == 5
    assert changed(pred, full) == {"eviction", "pinned_layers", "cache_slots"}
    assert changed(full, hybrid) == {"hybrid"} and hybrid["hybrid"] is True
    # the pinned sweep profiles "full" by name, not the last rung
    assert V.stage_knobs(LAYOUT, "full", budget_slots=86, pinned_full=2,
                         predictor_path="/p") == full
    with pytest.raises(InputError, match="stage must be one of base, "):
        V.stage_knobs(LAYOUT, "fast", budget_slots=86, pinned_full=2, predictor_path="/p")
    assert full["eviction"] == "slab" and full["pinned_layers"] == 2
    assert full["cache_slots"] == 86 - 2 * 32  # the expert budget is the same for every stage
    assert all(k["pinned_layers"] * 32 + k["cache_slots"] == 86 for k in cfg.values())


def test_adding_a_stage_is_one_line_and_inherits_everything():
    stages = (*V.LADDER, V.Stage("+extra", "one more rung", {"seed": 7}))
    cfgs = V.ladder_configs(LAYOUT, stages=stages, budget_slots=86, pinned_full=1,
                            predictor_path="/p")
    (_, full), (st, extra) = cfgs[-2], cfgs[-1]
    assert st.name == "+extra" and extra == {**full, "seed": 7}


def test_ladder_configs_refuse_what_cannot_run():
    with pytest.raises(InputError, match="predictor_path"):
        V.ladder_configs(LAYOUT, budget_slots=86, pinned_full=1)
    with pytest.raises(InputError, match="fewer than top-k"):  # 86 − 3 · 32 < 4
        V.ladder_configs(LAYOUT, budget_slots=86, pinned_full=3, predictor_path="/p")


def test_choose_pinned_lowest_modeled_latency_valid_only_ties_shallower():
    df = pd.DataFrame({"budget_slots": [86, 86, 86, 172, 172],
                       "pinned_layers": [1, 2, 3, 1, 2],
                       "valid": [True, True, False, True, True],
                       "latency_modeled_ms": [5.0, 3.0, 1.0, 2.0, 2.0]})
    assert V.choose_pinned(df, 86) == 2  # 3 is faster but outside the interval
    assert V.choose_pinned(df, 172) == 1  # tie: the shallower prefix leaves more cache
    with pytest.raises(InputError):
        V.choose_pinned(df[~df["valid"]])


def test_normalise_answer():
    assert V.normalise_answer("  Yes.") == "yes"
    assert V.normalise_answer("Two, three!") == "two three"
    assert V.normalise_answer("") == ""


def test_findings_need_more_than_noise():
    lat = np.array([[1.0, 1.1, 0.9, 1.0], [0.5, 0.6, 0.4, 0.5], [0.5, 0.7, 0.3, 0.5]])
    ds = xr.Dataset({"latency_modeled_s": (("stage", "request"), lat),
                     "latency_measured_s": (("stage", "request"), lat)},
                    coords={"stage": ["base", "+compression", "full"]})
    f = {e: ok for e, ok, _ in V.findings(ladder=ds)}
    assert f["+compression lowers the modeled latency"] is True  # −0.5 ± 0
    assert f["full lowers the modeled latency"] is False  # ±0, no change
    assert f["compression lowers the measured latency here"] is True
    sweep = pd.DataFrame({"budget_slots": [1] * 3 + [2] * 2, "pinned_layers": [1, 2, 3, 1, 2],
                          "cache_slots": [9, 8, 7, 9, 8], "valid": [True] * 5,
                          "latency_modeled_ms": [3.0, 1.0, 2.0, 1.0, 2.0]})
    f = {e: ok for e, ok, _ in V.findings(sweep=sweep)}
    assert f["U-shaped latency vs pinned_layers at 1 expert slots"] is True
    assert f["U-shaped latency vs pinned_layers at 2 expert slots"] is False  # two points


# -- on the embedded model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def rt(embedded):
    import workbench

    return workbench.Runtime(embedded, device="cpu", **V.base_knobs(2))


@pytest.fixture(scope="module")
def scenes():
    return V.scenes(V.eval_seed(), 2)


def test_eval_and_calibration_seeds_are_held_out():
    import json

    from workbench.models.embedded import EMBEDDED_MODEL_DIR

    seeds = json.loads((EMBEDDED_MODEL_DIR / "training_log.json").read_text())["seeds"]
    assert V.eval_seed() == seeds["heldout"]
    assert seeds["train_stream"] not in (V.CALIB_SEED, V.PROFILE_SEED, V.eval_seed())
    assert seeds["demo"] not in (V.CALIB_SEED, V.PROFILE_SEED)
    assert len({V.CALIB_SEED, V.PROFILE_SEED, V.eval_seed()}) == 3


def test_token_subset_recounts_and_excludes_pruned_tokens(rt, scenes, tmp_path):
    import workbench

    img, q, _ = scenes[0]
    res = rt.run(q, images=[img], store=tmp_path / "a.zarr", compression="affinity", beta=0.5,
                 pinned_layers=1, cache_slots=54, max_new_tokens=2)
    ds = workbench.open_run(res.store).load()
    everything = V.token_subset(ds, np.ones(ds.sizes["token"], bool))
    np.testing.assert_array_equal(everything["routed_tokens"].values, ds["routed_tokens"].values)
    kept = np.asarray(ds["kept"].values, bool)
    image = np.asarray(ds["token_modality"].values) == 1
    assert (~kept).sum() == res.visual_tokens - res.kept_visual_tokens > 0
    pruned = V.token_subset(ds, image & ~kept)
    c = pruned.moe.expert_counts().values
    assert c[0].sum() == (~kept).sum() * 4  # routed by the pinned layer
    assert c[1:].sum() == 0  # and nowhere behind it
    sub = V.token_subset(ds, image & kept)
    assert (sub.moe.expert_counts().values.sum(1) == res.kept_visual_tokens * 4).all()
    with pytest.raises(InputError):
        V.token_subset(ds, kept[:-1])


def test_characterisation_counts_kept_tokens_only(rt, scenes, tmp_path):
    ch = V.characterise_pruning(rt, scenes[:1], policies=("affinity",), workdir=tmp_path)
    tok = ch["tokens"].isel(request=0)
    n_vis = float(tok.sel(group="visual (raw)").isel(layer=0))
    assert n_vis == 64
    np.testing.assert_array_equal(tok.sel(group="visual (kept: affinity)").values, 32)
    np.testing.assert_array_equal(ch["counts"].sel(group="visual (kept: affinity)").sum(
        "expert").values, 32 * 4)
    lay = rt.lm.layout
    assert (ch["inactive"] >= 0).all() and (ch["inactive"] <= lay.num_experts).all()
    t = V.pruning_table(ch)
    assert t.attrs["layers"] == f"1–{lay.num_layers - 1}"
    assert V.pruning_table(ch, "prefix").attrs["layers"] == "0–0"
    with pytest.raises(InputError):
        V.pruning_table(ch, "middle")
    assert set(ch["run"].values) == {"none", "affinity"}
    assert ch.attrs["modeled"] == "nothing"
    assert ch.attrs["workdir"] == str(tmp_path) and any(tmp_path.glob("*.zarr"))


def test_characterisation_without_a_workdir_leaves_nothing_behind(rt, scenes, tmp_path,
                                                                   monkeypatch):
    """The stores of a study called without ``workdir`` are scratch: the same result, and
    the temporary directory is gone on return (notebooks and CI once leaked one a call)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    ch = V.characterise_pruning(rt, scenes[:1], policies=("random",), beta=0.25)
    assert list(scratch.iterdir()) == []
    assert "workdir" not in ch.attrs
    kept = ch["tokens"].sel(group="visual (kept: random)").isel(request=0).values
    np.testing.assert_array_equal(kept, 16)


def test_accuracy_at_beta_one_equals_no_compression(rt, scenes):
    acc = V.accuracy_vs_beta(rt, scenes, policies=("affinity", "random"), betas=(1.0, 0.5))
    assert bool(acc["same_as_none"].sel(beta=1.0).all())
    np.testing.assert_array_equal(acc["correct"].sel(beta=1.0).values[0],
                                  acc["correct_none"].values)
    t = V.accuracy_table(acc)
    assert list(t.index) == ["none", "affinity", "random"] and t.attrs["questions"] == 2
    assert t.attrs["same_as_none_at_beta_1"] == {"affinity": True, "random": True}
    truth = [V.normalise_answer(a) for _, _, a in scenes]
    assert list(acc["truth"].values) == truth


def test_hot_recall_flow_equals_calibrate_and_drives_the_full_ladder(rt, embedded, scenes,
                                                                    tmp_path):
    from workbench.predictor.calibrate import calibrate
    from workbench.predictor.model import load

    calib = V.scenes(V.CALIB_SEED, 4)
    hr = V.hot_recall_summary(embedded, calib, tmp_path / "pred", steps=5, max_new_tokens=2)
    _, report = calibrate(embedded, [(i, q) for i, q, _ in calib], steps=5, max_new_tokens=2)
    for k in (10, 20, 30):
        assert float(hr["hot_recall"].sel(variant="predictor", k=k)) == pytest.approx(
            report["heldout"][f"k{k}"]["hot_recall"])
        assert float(hr["hot_recall"].sel(variant="without h^(v)", k=k)) == pytest.approx(
            report["ablation_no_visual_summary"]["heldout"][f"k{k}"]["hot_recall"])
    assert load(tmp_path / "pred").cfg.use_visual
    E = embedded.layout.num_experts
    ks = V.scaled_ks(E)
    assert set(ks) <= set(hr["k"].values.tolist())
    np.testing.assert_allclose(hr["random"].sel(k=ks[0]), ks[0] / E)
    assert (hr["x_random"] <= hr["x_random_max"] + 1e-9).all()

    lad = V.ablation_ladder(rt, scenes[:1], pinned_full=1, predictor_path=tmp_path / "pred",
                            max_new_tokens=2)
    assert list(lad["stage"].values) == [s.name for s in V.LADDER]
    assert np.isnan(lad["kept_visual"].sel(stage="base")).all()
    assert (lad["kept_visual"].sel(stage="+compression") == 32).all()
    assert (lad["latency_modeled_s"] > 0).all() and (lad["steps"] == 2).all()
    assert "modeled" in lad.attrs and "measured" in lad.attrs
    t = V.ladder_table(lad)
    assert t["norm. (modeled)"].iloc[0] == 1.0
    assert t["paper norm."]["full"] == pytest.approx(4.91 / 13.17)


def test_scale_findings_pair_the_same_questions_across_scales():
    """Issue 39 §8: compression that costs accuracy at 1× and none at 2× 'costs less at 2×';
    an unchanged cost does not; scenes at a bad scale are one line."""
    q = 8
    def acc(lost_affinity: int) -> xr.Dataset:
        correct = np.ones((2, 1, q), bool)
        correct[0, 0, :lost_affinity] = False  # affinity loses the first questions
        return xr.Dataset({"correct": (("policy", "beta", "question"), correct),
                           "correct_none": ("question", np.ones(q, bool))},
                          coords={"policy": ["affinity", "random"], "beta": [0.5]})
    f = {e: ok for e, ok, _ in V.scale_findings(accuracy={1: acc(6), 2: acc(0)})}
    assert f["affinity compression at β = 0.5 costs less accuracy at 2×"] is True
    assert f["random compression at β = 0.5 costs less accuracy at 2×"] is False
    assert f["affinity's accuracy lead over random at β = 0.5 grows at 2×"] is True
    f = {e: ok for e, ok, _ in V.scale_findings(accuracy={1: acc(6), 2: acc(6)})}
    assert f["affinity compression at β = 0.5 costs less accuracy at 2×"] is False
    with pytest.raises(InputError, match="scale must be a whole number from 1 to 4"):
        V.scenes(1, 1, scale=5)


def test_scene_scale_keeps_2x_scenes_whole_and_restores_the_budget(embedded):
    ip = embedded.image_processor
    (img, _, _), = V.scenes(V.eval_seed(), 1, scale=2)
    grid = lambda: ip([img], return_tensors="pt")["image_grid_thw"][0].tolist()  # noqa: E731
    before = grid()
    with V.scene_scale(embedded, 2):
        assert grid() == [1, 32, 32]  # 256 merged visual tokens, 4x the default's
    assert before == grid() == [1, 16, 16]  # the shipped budget: resized to 128 px
