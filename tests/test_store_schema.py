"""Schema versions of run stores: a store written by schema 3 reads in the names and meaning of
schema 4, and everything downstream (``ds.moe``, trace loading, replay) gives the same numbers.

``tests/data/store_v3.zarr`` was recorded by the schema-3 code (commit ce5ef06) with::

    workbench calibrate --out PRED --requests 4 --steps 30
    workbench run --image data/demo/scene_0.png --prompt "what color is the circle?" \\
        --set max_new_tokens=6 --set ignore_eos=true --set pinned_layers=1 --set cache_slots=64 \\
        --set predictor=vismmoe --set prefetch_budget=8 --set predictor_path=PRED \\
        --set device=cpu --store tests/data/store_v3.zarr

(the embedded model; the predictor records ``predicted_ids`` but changes nothing else, as
prefetch is off). Schema 3 named the predictor's order dim ``rank`` and booked the pinned
layer's accesses as ``hits``, so its ``hits.sum()`` (157) disagreed with the run's
``RunResult.hits`` (123, stored in the attr ``summary``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

import workbench
from workbench.analysis import open_run  # ds.moe registered
from workbench.cli import main
from workbench.errors import StoreError
from workbench.telemetry.events import TEXT, LayerEvent, StepEvent
from workbench.telemetry.schema import SCHEMA, SCHEMA_VERSION, disk_schema
from workbench.telemetry.store import Recorder
from workbench.traces.formats import from_store, load_trace

V3 = Path(__file__).parent / "data" / "store_v3.zarr"
TINY = Path(__file__).parent / "data" / "qwen3-vl-moe-tiny"  # the embedded model that recorded V3
REPO = Path(__file__).resolve().parents[1]

#: what ``ds.moe`` gave on the fixture with the schema-3 code (before the change)
OLD_HIT_RATE = 0.4900398406374502
OLD_HIT_RATE_WITH_PINNED = 0.5508771929824562
OLD_HIT_RATE_BY_STEP = [0.0, 0.39285714285714285, 1.0, 1.0, 1.0, 1.0]
OLD_HIT_RATE_BY_LAYER_WITH_PINNED = [1.0, 0.47058823529411764, 0.4444444444444444,
                                     0.4444444444444444, 0.45714285714285713,
                                     0.5135135135135135, 0.5263157894736842, 0.5714285714285714]
OLD_SUMMARY = {"steps": 6, "tokens": 85, "hit_rate": OLD_HIT_RATE, "hits": 123, "misses": 128,
               "loads": 128, "evictions": 64, "host_runs": 0}


def _raw(name: str) -> np.ndarray:
    """A stored array of the fixture as zarr reads it, cut to the committed steps (no workbench
    code involved)."""
    g = zarr.open_group(str(V3), mode="r")
    return np.asarray(g[name][: g.attrs["committed"]["step"]])


@pytest.fixture(scope="module")
def v3():
    return open_run(V3)


def test_the_fixture_is_a_schema_3_store_on_disk():
    """Guards the fixture itself: old names, old meaning, small."""
    root = json.loads((V3 / "zarr.json").read_text())["attributes"]
    assert root["schema_version"] == 3 < SCHEMA_VERSION
    meta = json.loads((V3 / "predicted_ids" / "zarr.json").read_text())
    assert meta["dimension_names"] == ["step", "layer", "rank"]
    assert (V3 / "rank").is_dir() and not (V3 / "pinned_accesses").exists()
    pinned = np.asarray(zarr.open_group(str(V3), mode="r")["pinned"][:])
    assert pinned.tolist() == [True] + [False] * 7
    hits = _raw("hits")
    assert (hits[:, 0] > 0).all()  # schema 3: the pinned layer's accesses were hits
    assert int(hits.sum()) == 157 != json.loads(root["summary"])["hits"] == 123
    assert sum(f.stat().st_size for f in V3.rglob("*") if f.is_file()) < 300_000
    assert disk_schema(3)["predicted_ids"].dims == ("step", "layer", "rank")
    assert "pinned_accesses" not in disk_schema(3) and disk_schema(SCHEMA_VERSION) is SCHEMA
    assert "dispatch_dropped" not in disk_schema(4)


def test_a_schema_3_store_reads_with_pred_order_and_split_hits(v3):
    ds = v3
    assert ds.attrs["schema_version"] == 3  # the files' version
    assert "rank" not in ds.dims and "rank" not in ds.variables
    for name in ("predicted_ids", "predicted_scores"):
        assert ds[name].dims == ("step", "layer", "pred_order")
        np.testing.assert_array_equal(ds[name].values, _raw(name))
    assert ds["pred_order"].values.tolist() == list(range(8))
    assert (ds.predicted_ids.values[:, :-1] >= 0).all()  # the predictor ran (not the last layer)
    # hits: cache lookups only; the pinned layer's are pinned_accesses; their sum is the stored
    raw = _raw("hits")
    pinned = ds.pinned.values
    np.testing.assert_array_equal(ds.hits.values + ds.pinned_accesses.values, raw)
    assert (ds.hits.values[:, pinned] == 0).all() and (ds.pinned_accesses.values[:, ~pinned]
                                                        == 0).all()
    np.testing.assert_array_equal(ds.pinned_accesses.values[:, pinned], raw[:, pinned])
    np.testing.assert_array_equal(ds.misses.values, _raw("misses"))
    # no sub-experts before schema 8: each expert one, run by every routed token
    assert ds.subexpert_tokens.dims[3] == "subexpert" and ds.sizes["subexpert"] == 1
    np.testing.assert_array_equal(ds.subexpert_tokens.isel(subexpert=0).values,
                                  ds.routed_tokens.values)
    np.testing.assert_array_equal(ds.subexpert_ran.values[..., 0], ds.topk_ids.values >= 0)
    np.testing.assert_array_equal(ds.subexpert_ran.isel(token=slice(3, 9), layer=2).values,
                                  (ds.topk_ids.values >= 0)[3:9, 2, :, None])
    np.testing.assert_array_equal(ds.subexpert_tokens.isel(step=1, subexpert=0).values,
                                  ds.routed_tokens.values[1])
    summary = json.loads(ds.attrs["summary"])  # RunResult of the recording run
    assert int(ds.hits.sum()) == summary["hits"] and int(ds.misses.sum()) == summary["misses"]
    assert ds.pinned_accesses.dtype == ds.hits.dtype == np.int32
    assert ds.pinned_accesses.attrs["description"] == SCHEMA["pinned_accesses"].doc
    # lazy reads by position agree with the whole array (ints drop dims, slices keep them)
    full = ds.hits.values
    assert int(ds.hits.isel(step=2, layer=0)) == 0 and int(ds.hits.isel(step=2, layer=3)) \
        == full[2, 3]
    np.testing.assert_array_equal(ds.hits[1:4, 0:3].values, full[1:4, 0:3])
    np.testing.assert_array_equal(ds.pinned_accesses.isel(layer=0).values, raw[:, 0])
    np.testing.assert_array_equal(ds.pinned_accesses.isel(step=-1).values,
                                  np.where(pinned, raw[-1], 0))


def test_ds_moe_on_the_schema_3_store_gives_the_numbers_it_gave_before(v3):
    ds = v3
    assert ds.moe.hit_rate() == OLD_HIT_RATE
    assert ds.moe.hit_rate(include_pinned=True) == OLD_HIT_RATE_WITH_PINNED
    np.testing.assert_array_equal(ds.moe.hit_rate(by="step").values, OLD_HIT_RATE_BY_STEP)
    np.testing.assert_array_equal(ds.moe.hit_rate(by="layer", include_pinned=True).values,
                                  OLD_HIT_RATE_BY_LAYER_WITH_PINNED)
    s = ds.moe.summary()
    assert {k: s[k] for k in OLD_SUMMARY} == OLD_SUMMARY
    # the predictor's order dim, renamed, feeds Hot Recall (k up to its size B = 8)
    hr = ds.moe.hot_recall(8, window=1)
    assert np.isnan(hr.values[-1]) and (hr["samples"].values[:-1] == 6).all()
    assert ((hr.values[:-1] >= 0) & (hr.values[:-1] <= 1)).all()
    with pytest.raises(ValueError, match=r"k must be an int in 1..8"):
        ds.moe.hot_recall(9, window=1)


def test_traces_and_replay_of_the_schema_3_store(v3, assert_replays_live):
    ds = v3
    trace = load_trace(V3)
    np.testing.assert_array_equal(trace.predicted_ids, _raw("predicted_ids"))
    np.testing.assert_array_equal(trace.predicted_scores, _raw("predicted_scores"))
    # a Dataset of the store read by plain xarray keeps the old dim name: still a trace
    raw_ds = xr.open_zarr(V3, consolidated=False).isel(step=slice(0, 6), token=slice(0, 85))
    assert raw_ds.predicted_ids.dims == ("step", "layer", "rank")
    old = from_store(raw_ds)
    np.testing.assert_array_equal(old.predicted_ids, trace.predicted_ids)
    np.testing.assert_array_equal(old.topk_ids, trace.topk_ids)
    # replay with the run's own knobs reproduces the live run on the offloaded layers
    r = ds.moe.replay()
    off = ~ds.pinned.values
    np.testing.assert_array_equal(r.hits[:, off], ds.hits.values[:, off])
    np.testing.assert_array_equal(r.misses, ds.misses.values)
    np.testing.assert_array_equal(r.evictions, ds.evictions.values)
    assert r.metrics()["hits"] == int(ds.hits.sum()) == 123
    # the recorded predictions (pred_order) drive the vismmoe prefetch in replay
    pf = ds.moe.replay(prefetch="vismmoe")
    assert pf.metrics()["prefetch_loads"] > 0 and pf.metrics()["hits"] > r.metrics()["hits"]


def test_cli_replay_of_the_schema_3_store(capsys):
    assert main(["replay", str(V3), "--set", "cache_slots=32", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["metrics"]
    assert m["accesses"] == m["hits"] + m["misses"] == 123 + 128  # the run's offloaded lookups


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The fixture's request and knobs recorded now (schema 4), predictor off: it does not change
    routing or caching, and the calibrated predictor is not part of the fixture. The request ran
    on the embedded model of the time, ``qwen3-vl-moe-tiny``, since retired: this test is why
    ``tests/data/qwen3-vl-moe-tiny`` (its weights and configs) and the demo scene it was asked
    about (``tests/data/store_v3_scene_0.png``) are kept."""
    from workbench.knobs import Knobs
    from workbench.runtime.runtime import Runtime

    attrs = open_run(V3).attrs
    assert json.loads(attrs["images"]) == ["data/demo/scene_0.png"]  # the old demo scene
    knobs = Knobs.from_attrs(attrs).copy(predictor="none", predictor_path=None)
    store = tmp_path_factory.mktemp("v4") / "run.zarr"
    rt = Runtime(workbench.load(TINY, device="cpu"), knobs=knobs)
    res = rt.run(attrs["prompt"], [V3.parent / "store_v3_scene_0.png"], store=store)
    return res, open_run(store)


def test_a_fresh_store_counts_hits_as_the_run_result(fresh):
    res, ds = fresh
    assert ds.attrs["schema_version"] == SCHEMA_VERSION == 8
    assert int(ds.hits.sum()) == res.hits and int(ds.misses.sum()) == res.misses
    pinned = ds.pinned.values
    assert pinned.any() and (ds.hits.values[:, pinned] == 0).all()
    # every step routes the pinned layer: its distinct experts are pinned_accesses
    np.testing.assert_array_equal(
        ds.pinned_accesses.values[:, pinned],
        (ds.routed_tokens.sum("modality") > 0).sum("expert").values[:, pinned])
    assert ds.predicted_ids.dims == ("step", "layer", "pred_order") and ds.sizes["pred_order"] == 1
    assert json.loads(ds.attrs["summary"])["hits"] == res.hits


def test_schema_3_and_a_fresh_recording_of_the_same_run_agree(v3, fresh):
    """Deterministic parts (routing and cache decisions on the CPU; not timings, not the
    predictor's outputs) are equal, and so is every ``ds.moe`` figure built from them."""
    _, new = fresh
    old = v3
    assert new.sizes["step"] == old.sizes["step"] and new.sizes["token"] == old.sizes["token"]
    for name in ("token_id", "generated_token", "topk_ids", "routed_tokens", "hits", "misses",
                 "pinned_accesses", "loads", "evictions", "resident", "pinned"):
        np.testing.assert_array_equal(new[name].values, old[name].values, err_msg=name)
    for kw in ({}, {"include_pinned": True}):
        assert new.moe.hit_rate(**kw) == old.moe.hit_rate(**kw)
        for by in ("step", "layer"):
            xr.testing.assert_identical(new.moe.hit_rate(by=by, **kw),
                                        old.moe.hit_rate(by=by, **kw))
    s_new, s_old = new.moe.summary(), old.moe.summary()
    for key in ("steps", "tokens", "hit_rate", "hits", "misses", "loads", "evictions"):
        assert s_new[key] == s_old[key], key
    xr.testing.assert_identical(new.moe.expert_counts("image"), old.moe.expert_counts("image"))
    xr.testing.assert_identical(new.moe.working_set(window=2), old.moe.working_set(window=2))
    xr.testing.assert_identical(new.moe.layer_similarity(), old.moe.layer_similarity())
    m_new, m_old = new.moe.replay().metrics(), old.moe.replay().metrics()
    for key in ("accesses", "hits", "misses", "evictions", "transfers"):
        assert m_new[key] == m_old[key], key


# -- the recorder: pinned layers, the pred_order dim --------------------------------------------
def _step(pinned_hits: list[int]) -> StepEvent:
    """One step of 2 text tokens over 2 layers (layer 0 pinned, routed to experts 0, 1, 2)."""
    ids = np.array([[0, 1], [2, 0]], np.int16)
    w = np.full(ids.shape, 0.5, np.float32)
    return StepEvent(step=0, phase=0, token_ids=np.array([5, 6]),
                     modality=np.full(2, TEXT, np.int8),
                     layers=[LayerEvent(layer=0, pinned=True, topk_ids=ids, topk_weights=w,
                                        hits=pinned_hits),
                             LayerEvent(layer=1, pinned=False, topk_ids=ids, topk_weights=w,
                                        hits=[0], misses=[1, 2])])


@pytest.mark.parametrize("pinned_hits", [[0, 1, 2], []])
def test_a_pinned_layer_is_booked_as_pinned_accesses_never_as_hits(tmp_path, pinned_hits):
    """Whatever a pinned layer's event lists as hits (today every routed expert), the store
    books its distinct routed experts as pinned_accesses; hits/misses are the cache's."""
    with Recorder(tmp_path / "r.zarr", 2, 4, 2, attrs={}, pinned=[True, False]) as rec:
        rec.add(_step(pinned_hits))
    ds = open_run(tmp_path / "r.zarr")
    assert ds.hits.values.tolist() == [[0, 1]] and ds.misses.values.tolist() == [[0, 2]]
    assert ds.pinned_accesses.values.tolist() == [[3, 0]]
    assert ds.loads.values.tolist() == [[0, 2]]


def test_the_pred_order_dim(tmp_path):
    with Recorder(tmp_path / "a.zarr", 2, 4, 2, attrs={}, pinned=[True, False]) as rec:
        rec.add(_step([]))
    assert open_run(tmp_path / "a.zarr").sizes["pred_order"] == 1  # predictor off
    step = _step([])
    step.predicted_ids = np.array([[3, 1, -1], [2, 0, 1]], np.int16)
    step.predicted_scores = np.array([[0.9, 0.5, 0], [0.8, 0.7, 0.6]], np.float32)
    path = tmp_path / "p.zarr"
    with Recorder(path, 2, 4, 2, attrs={}, pinned=[True, False], pred_order=3) as rec:
        rec.add(step)
    ds = open_run(path)
    assert ds.predicted_ids.dims == ("step", "layer", "pred_order")
    np.testing.assert_array_equal(ds.predicted_ids.values[0], step.predicted_ids)
    assert json.loads((path / "predicted_ids" / "zarr.json").read_text())[
        "dimension_names"] == ["step", "layer", "pred_order"]


# -- old stores: overwrite and tampering ------------------------------------------------------
def test_a_new_run_may_overwrite_a_schema_3_store(tmp_path):
    """``--overwrite`` deletes only a provable run store: one of schema 3 (with its ``rank``
    folder) is one."""
    store = tmp_path / "old.zarr"
    shutil.copytree(V3, store)
    with Recorder(store, 2, 4, 2, attrs={}, pinned=[True, False], overwrite=True) as rec:
        rec.add(_step([]))
    ds = open_run(store)
    assert ds.attrs["schema_version"] == SCHEMA_VERSION and ds.sizes["layer"] == 2
    assert not (store / "rank").exists()


def test_a_tampered_schema_3_store_is_refused_naming_it(tmp_path):
    store = tmp_path / "old.zarr"
    shutil.copytree(V3, store)
    good = (store / "hits" / "c.0.0").read_bytes()
    (store / "hits" / "c.0.0").write_bytes(b"\x00garbage" * 10)
    # the counts are read at open (their invariants are checked there, issue 26)
    with pytest.raises(StoreError, match=rf"run store '{store}'.*array 'hits' chunk"):
        open_run(store)
    (store / "hits" / "c.0.0").write_bytes(good)
    (store / "pinned" / "c" / "0").write_bytes(b"junk")  # read at open: which layers split
    with pytest.raises(StoreError, match=rf"run store '{store}'.*array 'pinned'"):
        open_run(store)
    meta = json.loads((store / "predicted_ids" / "zarr.json").read_text())
    meta["dimension_names"] = ["step", "layer", "pred_order"]  # schema 4's name in a v3 store
    (store / "predicted_ids" / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"'predicted_ids' has dimensions .* the schema says "
                                         r"\['step', 'layer', 'rank'\]"):
        open_run(store)


def test_a_store_older_than_dispatch_reads_nothing_dropped():
    """Schema 5 added ``dispatch_dropped``; the schema-3 fixture (and any store ≤ 4) reads it
    as zeros shaped like ``routed_tokens`` (no dispatch existed), costing no memory."""
    ds = workbench.open_run(V3)
    d = ds["dispatch_dropped"]
    assert d.dims == ds["routed_tokens"].dims and d.shape == ds["routed_tokens"].shape
    assert int(d.sum()) == 0


def test_a_live_dispatch_records_what_it_dropped(embedded, demo_inputs, tmp_path):
    """``dispatch_dropped`` holds, per (step, layer, expert, modality), the tokens the live
    dispatch took away: routed + dropped = what the router chose; the total is the run's."""
    img, prompt, _ = next(d for d in demo_inputs if d[0] is not None)
    rt = workbench.Runtime(embedded, max_new_tokens=3)
    res = rt.run(prompt, images=[img], store=tmp_path / "d.zarr", dispatch="capacity-drop",
                 capacity_factor=0.5)
    ds = workbench.open_run(res.store)
    dropped = ds["dispatch_dropped"]
    assert int(dropped.sum()) == res.dispatch_dropped > 0
    routed = ds["routed_tokens"].sum("expert").isel(step=0)
    chosen = routed + dropped.sum("expert").isel(step=0)
    k = ds.sizes["k"]
    tokens = ds["token_modality"].values[ds["token_step"].values == 0]
    for m, code in (("text", 0), ("image", 1)):  # every prefill token chose k experts
        np.testing.assert_array_equal(chosen.sel(modality=m).values,
                                      np.full(ds.sizes["layer"], k * int((tokens == code).sum())))
    assert int(dropped.sel(modality="image").sum()) > 0


def test_drops_per_rank_and_modality(embedded, demo_inputs, tmp_path):
    """``ds.moe.ep_dropped``: the dropped assignments on the rank of the expert they were
    taken from; kept + dropped per rank = what the router sent that rank."""
    img, prompt, _ = next(d for d in demo_inputs if d[0] is not None)
    rt = workbench.Runtime(embedded, max_new_tokens=2)
    top = workbench.open_run(rt.run(prompt, images=[img], store=tmp_path / "t.zarr").store)
    drop = workbench.open_run(rt.run(prompt, images=[img], store=tmp_path / "d.zarr",
                                     dispatch="capacity-drop", capacity_factor=0.5).store)
    for m in (None, "image", "text"):
        kept = drop.moe.ep_load(8, "contiguous", m).isel(step=0, layer=0)
        gone = drop.moe.ep_dropped(8, "contiguous", m).isel(step=0, layer=0)
        want = top.moe.ep_load(8, "contiguous", m).isel(step=0, layer=0)
        np.testing.assert_array_equal(kept + gone, want)  # layer 0: same input both runs
    assert int(top.moe.ep_dropped(8).sum()) == 0


def test_opening_a_subset_of_the_arrays_reads_those_as_a_whole_open_does(fresh, tmp_path):
    """``open_run(path, variables=…)``: only the named arrays, each equal to the whole open's,
    with the same coordinates, steps and attributes; a store of an older schema opens whole; a name that is no array of the schema, or no name,
    is refused naming it; ``from_store`` of the routing arrays (``TRACE_ARRAYS``, what the
    CLI's EP summary opens) gives the trace ``from_store`` of the whole Dataset gives."""
    from workbench.traces.formats import TRACE_ARRAYS

    res, whole = fresh
    part = open_run(res.store, variables=["topk_ids", "phase", "pinned", "kept"])
    assert set(part.data_vars) == {"topk_ids", "phase", "pinned", "kept"}
    for name in part.data_vars:
        np.testing.assert_array_equal(part[name].values, whole[name].values, err_msg=name)
    assert dict(part.sizes).items() <= dict(whole.sizes).items()
    assert part.sizes["step"] == whole.sizes["step"] and part.attrs == whole.attrs
    steps_only = open_run(res.store, variables="token_step")  # no array indexed by step
    assert list(steps_only.data_vars) == ["token_step"]
    assert steps_only.sizes["step"] == whole.sizes["step"]
    a, b = from_store(open_run(res.store, variables=TRACE_ARRAYS)), from_store(whole)
    for name in ("topk_ids", "token_step", "topk_weights", "token_modality", "phase",
                 "pinned", "pred_ids", "predicted_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or np.array_equal(x, y), name
    assert set(TRACE_ARRAYS) <= {*SCHEMA, "pinned"}
    # the EP summary the CLI prints from the routing arrays is the whole store's
    routing = open_run(res.store, variables=TRACE_ARRAYS)
    assert routing.moe.ep_summary(ranks=4) == whole.moe.ep_summary(ranks=4)
    assert "hits" in open_run(V3, variables=["topk_ids"]).data_vars  # schema 3: whole
    import itertools

    for bad, said in ((["topk_ids", "nope"], "'nope' is no array of the run schema"),
                      ([3], "3 is no array"), (7, "not int 7"),
                      (itertools.repeat("topk_ids"), "more than 2")):
        with pytest.raises(StoreError, match=said):
            open_run(res.store, variables=bad)


def test_a_subset_of_the_arrays_is_checked_as_the_whole_store_is(fresh, tmp_path):
    """A subset of the arrays is refused where the whole store is, for what it returns: a
    dimension left to its coordinate alone (a tampered coordinate as long as 2⁴⁰ is refused by
    name, not allocated); a check that reads a second array (hits + misses at most the
    experts: ``hits`` alone opens ``misses`` to check it, then leaves it out); the steps of
    a subset with no array indexed by step (a tampered committed extent of 2²⁸ steps is
    refused by the step array opened to check it, not allocated)."""
    res, _ = fresh

    def tampered(name: str, edit) -> Path:
        store = tmp_path / name
        shutil.copytree(res.store, store)
        edit(store)
        return store

    def doc(store, rel, change):
        f = store / rel
        meta = json.loads(f.read_text())
        change(meta)
        f.write_text(json.dumps(meta))

    store = tampered("coord.zarr", lambda s: doc(s, "expert/zarr.json",
                                                 lambda m: m.update(shape=[1 << 40])))
    for variables in (["topk_ids"], None):
        with pytest.raises(StoreError, match="coordinate 'expert' has shape"):
            open_run(store, variables=variables)

    def many_hits(store):
        arr = zarr.open_array(store / "hits", mode="r+")
        arr[0, 0] = 100_000

    store = tampered("hits.zarr", many_hits)
    for variables in (["hits"], ["misses"], None):
        with pytest.raises(StoreError, match=r"hits \+ misses at most"):
            open_run(store, variables=variables)
    assert list(open_run(res.store, variables=["hits"]).data_vars) == ["hits"]

    store = tampered("steps.zarr", lambda s: doc(
        s, "zarr.json", lambda m: m["attributes"]["committed"].update(step=1 << 28)))
    for variables in ("token_step", None):
        with pytest.raises(StoreError):
            open_run(store, variables=variables)
