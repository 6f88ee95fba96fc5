"""Dashboard logic without a browser: DataStore state, views, safety checks, A/B, live tail."""

from __future__ import annotations

import io
import os
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import workbench
from workbench.errors import InputError, ModelLoadError
from workbench.ui.datastore import (MAX_UPLOAD_BYTES, DataStore, ab_deltas, check_image_upload,
                                    demo_inputs, list_runs, resolve_run_path, safe_run_name,
                                    selected_steps, share_difference)
from workbench.ui.views import (DeltasView, deltas_html, DiffHeatmapView, HeatmapView, HitRateView,
                                LatencyView, ReplayView, TimelineView)

REPO = Path(__file__).resolve().parents[1]
KNOBS = dict(cache_slots=3, pinned_layers=1, max_new_tokens=6, device="cpu")


def _png(size=(16, 16), fmt="PNG", mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, (200, 30, 30) if mode == "RGB" else 0).save(buf, format=fmt)
    return buf.getvalue()


def _store(tmp_path, ckpt, **knobs) -> DataStore:
    s = DataStore(workspace=tmp_path / "ws", model=ckpt)
    s.knobs.set(**{**KNOBS, **knobs})
    return s


@pytest.fixture(scope="module")
def two_runs(tiny_ckpt, tmp_path_factory):
    """A workspace with two finished runs of the same request: 3 slots (a) and 12 slots (b)."""
    ws = tmp_path_factory.mktemp("ab")
    s = _store(ws, tiny_ckpt("qwen3_moe"))
    for name, slots in (("a", 3), ("b", 12)):
        s.knobs.set(cache_slots=slots)
        s.start_run(name=name, prompt="the same request for both runs")
        s.wait()
        assert not s.error, s.error
    return s


# -- names and paths ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["../x", "..", "a/../../b", "/etc/passwd", "a/b", "a\\b",
                                 "..\\x", ".hidden", "", "  ", "x" * 120, "C:evil", "ok..zarr",
                                 "a b", "run\x00"])
def test_run_names_cannot_escape_the_workspace(bad, tmp_path):
    with pytest.raises(InputError):
        resolve_run_path(tmp_path, bad)


def test_good_run_names_get_the_store_suffix(tmp_path):
    assert safe_run_name("my-run_1.v2") == "my-run_1.v2.zarr"
    assert safe_run_name("r.zarr") == "r.zarr"
    assert resolve_run_path(tmp_path, "r1") == tmp_path.resolve() / "r1.zarr"


def test_symlink_out_of_the_workspace_is_rejected(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside.zarr"
    ws.mkdir()
    outside.mkdir()
    (outside / "zarr.json").write_text("{}")
    (ws / "evil.zarr").symlink_to(outside, target_is_directory=True)
    with pytest.raises(InputError, match="outside the workspace"):
        resolve_run_path(ws, "evil")


def test_store_methods_refuse_escaping_names_before_doing_anything(tmp_path):
    s = DataStore(workspace=tmp_path / "ws")
    with pytest.raises(InputError):
        s.open("../../etc")
    with pytest.raises(InputError):
        s.start_run(name="../escape", prompt="hi")
    with pytest.raises(InputError, match="not a store"):
        s.open("missing")
    assert not s.running and s._job is None
    assert not (tmp_path / "escape.zarr").exists()


def test_workspace_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_WORKSPACE", str(tmp_path / "env-ws"))
    assert DataStore().workspace_path == tmp_path / "env-ws"
    monkeypatch.delenv("WORKBENCH_WORKSPACE")
    with workbench.set_options(workspace=tmp_path / "opt-ws"):
        assert DataStore().workspace_path == tmp_path / "opt-ws"


# -- uploads ------------------------------------------------------------------------------------
def test_upload_accepts_png_and_jpeg_and_stores_a_png(tmp_path):
    s = DataStore(workspace=tmp_path / "ws")
    assert check_image_upload(_png(fmt="JPEG"), "a.jpg").size == (16, 16)
    path = s.accept_upload(_png(), "scene.png")
    assert s.image == str(path) and path.parent == tmp_path / "ws" / "uploads"
    with Image.open(path) as im:
        assert im.format == "PNG"


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (b"GIF89a not really", "not a readable"),
    (b"\x89PNG\r\n\x1a\n truncated", "not a readable"),
    (b"#!/bin/sh\nrm -rf /\n", "not a readable"),
    (_png(fmt="GIF", mode="P"), "only PNG and JPEG"),
    (_png(fmt="BMP"), "only PNG and JPEG"),
    (_png(size=(5000, 4000), mode="L"), "pixels"),
])
def test_upload_rejects_other_types_and_bombs(data, match, tmp_path):
    s = DataStore(workspace=tmp_path / "ws")
    with pytest.raises(InputError, match=match):
        s.accept_upload(data, "x.png")  # the extension is not trusted
    assert s.image is None


def test_upload_size_limit():
    big = b"\x89PNG\r\n\x1a\n" + b"\0" * MAX_UPLOAD_BYTES
    with pytest.raises(InputError, match="MB"):
        check_image_upload(big, "big.png")


def test_demo_inputs_skip_missing_and_escaping_images(tmp_path):
    (tmp_path / "scene_0.png").write_bytes(_png())
    (tmp_path / "prompts.json").write_text(json.dumps([
        {"image": "scene_0.png", "prompt": "what color?", "answer": "red"},
        {"image": "../scene_0.png", "prompt": "escape"},
        {"image": "missing.png", "prompt": "gone"}]))
    items = demo_inputs(tmp_path)
    assert [i["prompt"] for i in items] == ["what color?"]
    assert demo_inputs(tmp_path / "nowhere") == []


def test_a_text_only_model_is_offered_text_requests_only(tiny_ckpt, tmp_path):
    """With a text-only --model the demo menu lists the text-only demos, the first screen is
    one of them, batches are text, and no image upload is offered."""
    from workbench.ui.widgets import input_widgets

    (tmp_path / "scene_0.png").write_bytes(_png())
    (tmp_path / "prompts.json").write_text(json.dumps([
        {"image": "scene_0.png", "prompt": "what color is the circle?", "answer": "red"},
        {"image": None, "prompt": "count from 3 to 5.", "answer": "3 4 5"}]))
    s = _store(tmp_path, tiny_ckpt())
    w = input_widgets(s, tmp_path)
    assert list(w["demo"].options) == ["(text only, no image)", "text only — count from 3 to 5."]
    assert (s.prompt, s.image, s.batch_mix) == ("count from 3 to 5.", None, "text")
    assert not w["upload"].visible and "text-only model" in w["upload_hint"].object
    v = input_widgets(DataStore(workspace=tmp_path / "ws2"), tmp_path)  # the embedded (VL)
    assert len(v["demo"].options) == 3 and v["upload"].visible
    # the inputs follow the model chosen later: VL → text-only → VL
    vs = DataStore(workspace=tmp_path / "ws3")
    v = input_widgets(vs, tmp_path)
    assert vs.image is not None and vs.batch_mix == "mixed"  # the first demo has an image
    vs.model = str(tiny_ckpt())
    assert list(v["demo"].options) == ["(text only, no image)", "text only — count from 3 to 5."]
    assert (vs.image, vs.prompt, vs.batch_mix) == (None, "count from 3 to 5.", "text")
    assert not v["upload"].visible and "text-only model" in v["upload_hint"].object
    vs.model = None
    assert len(v["demo"].options) == 3 and v["upload"].visible and vs.batch_mix == "mixed"
    assert vs.prompt == "count from 3 to 5."  # the shown request stays


def test_a_demo_request_shows_its_expected_answer_beside_the_models(tmp_path):
    """The menu has text-only entries (``"image": null``) and each entry's expected answer; after a
    run of that request the answer view shows it, marked right or wrong; an edited prompt is no
    longer the demo's, so it has no expected answer."""
    import xarray as xr

    from workbench.ui.views import answer_view

    (tmp_path / "scene_0.png").write_bytes(_png())
    (tmp_path / "prompts.json").write_text(json.dumps([
        {"image": "scene_0.png", "prompt": "what color is the circle?", "answer": "red", "kind": "color"},
        {"image": None, "prompt": "count from 3 to 5.", "answer": "3 4 5", "kind": "sequence"}]))
    items = demo_inputs(tmp_path)
    assert [(i["image"] is None, i["answer"], i["kind"]) for i in items] == [
        (False, "red", "color"), (True, "3 4 5", "sequence")]
    assert items[1]["label"].startswith("text only")
    s = DataStore(workspace=tmp_path / "ws")
    view = answer_view(s)

    def shown() -> str:
        return view.object() if callable(view.object) else str(view.object)

    s.use_demo(items[1])
    assert (s.image, s.prompt, s.expected) == (None, "count from 3 to 5.", "3 4 5")
    s.param.update(dataset=xr.Dataset(attrs={"prompt": "count from 3 to 5."}), answer="3 4 5", running=False)
    assert "data-testid='expected'" in shown() and "data-match='true'" in shown() and "3 4 5" in shown()
    s.answer = "3 4"
    assert "data-match='false'" in shown()
    s.running = True  # no verdict on an answer still streaming
    assert "data-testid='expected'" not in shown()
    s.running = False
    s.use_demo(items[0])
    assert s.expected == "red" and s.image == str(tmp_path / "scene_0.png")
    s.prompt = "what color is the square?"  # edited: not the demo request any more
    assert s.expected == "" and "data-testid='expected'" not in shown()


# -- runs: state transitions -----------------------------------------------------------------------
def test_run_state_transitions(tiny_ckpt, tmp_path):
    s = _store(tmp_path, tiny_ckpt("qwen3_moe"))
    seen = []
    s.param.watch(lambda e: seen.append(e.new), "running")
    path = s.start_run(prompt="hello there")
    assert s.running and s.run_name == path.name and s.dataset is None
    assert path.parent == tmp_path / "ws" and path.name.startswith("run-")
    with pytest.raises(InputError, match="already in progress"):
        s.start_run(prompt="again")
    s.wait()
    assert seen == [True, False]
    assert not s.error and s.status.startswith("complete")
    ds = s.dataset
    assert ds is not None and ds.attrs["status"] == "complete"
    assert ds.sizes["step"] == 6 and s.progress == s.progress_max == 6
    assert s.answer == json.loads(ds.attrs["summary"])["text"]
    assert [r.name for r in s.runs] == [path.name] and s.runs[0].status == "complete"
    assert json.loads(ds.attrs["knob.cache_slots"]) == 3


def test_own_run_streams_while_it_goes(tiny_ckpt, tmp_path, monkeypatch):
    """Progress, answer and the dataset (re-read from the store) update before the run ends."""
    from workbench.runtime import runtime as rtmod

    run = rtmod.Runtime.run

    def slow_run(self, *args, on_token=None, **kw):
        def slower(token, text):
            time.sleep(0.05)
            on_token(token, text)
        return run(self, *args, on_token=slower, **kw)

    monkeypatch.setattr(rtmod.Runtime, "run", slow_run)
    s = _store(tmp_path, tiny_ckpt("qwen3_moe"), max_new_tokens=30)
    seen = []
    with workbench.set_options(flush_every=1):
        s.start_run(prompt="stream into the dashboard")
        deadline = time.time() + 60
        while s.running and time.time() < deadline:
            s.poll()
            steps = s.dataset.sizes["step"] if s.dataset is not None else 0
            seen.append((s.progress, steps, s.answer, s.running))
            time.sleep(0.05)
        s.wait()  # the end is shown before the store's final write: its last steps after it
    assert not s.running and s.dataset.sizes["step"] == 30
    mid = [x for x in seen if x[3] and 0 < x[1] < 30]
    assert mid, seen  # the plots' dataset grew while the run was going
    assert any(p > 0 and a for p, _, a, _ in mid)  # tokens appear as generated
    assert [x[1] for x in seen] == sorted(x[1] for x in seen)


def test_knob_change_applies_to_the_next_run_only(tiny_ckpt, tmp_path):
    s = _store(tmp_path, tiny_ckpt("qwen3_moe"))
    s.start_run(name="first", prompt="p")
    s.knobs.set(cache_slots=5)  # while running: the run keeps its snapshot
    s.wait()
    assert json.loads(s.dataset.attrs["knob.cache_slots"]) == 3
    s.start_run(name="second", prompt="p")
    s.wait()
    assert json.loads(s.dataset.attrs["knob.cache_slots"]) == 5
    with pytest.raises(InputError, match="already exists"):
        s.start_run(name="second", prompt="p")


def test_the_regime_knobs_act_on_runs_started_from_the_dashboard(tiny_ckpt, tmp_path):
    """Issue 39's knobs (offload unit, transfer order, capacity scope), edited in the dashboard's
    knob cards, reach the next run as they do from the CLI: the run records each value and its
    counts show the mechanism acted (tiny model: 3 layers × 8 experts, top-2, no pinned layer)."""
    from workbench.ui.widgets import knob_panels

    s = _store(tmp_path, tiny_ckpt("qwen3_moe"), cache_slots=16, pinned_layers=0,
               max_new_tokens=4)
    w = {n: wd for p in knob_panels(s.knobs).values() for n, wd in p._widgets.items()}

    def run(name: str) -> dict:
        s.start_run(name=name, prompt="the same request for every run")
        s.wait()
        assert not s.error, s.error
        summary = json.loads(s.dataset.attrs["summary"])
        for knob in ("offload_unit", "transfer_order", "capacity_scope"):
            assert json.loads(s.dataset.attrs[f"knob.{knob}"]) == w[knob].value
        return summary

    expert = run("expert")
    w["offload_unit"].value = "layerwise"
    layerwise = run("layerwise")
    # accelerate's hooks: every layer copies all its experts at every step, none kept
    assert layerwise["loads"] == 8 * 3 * layerwise["steps"] > expert["loads"]
    assert layerwise["hits"] == 0 and layerwise["token_ids"] == expert["token_ids"]

    w["offload_unit"].value, w["cache_slots"].value, w["prefetch"].value = \
        "expert", 6, "previous-step"
    order = {}
    for o in ("fifo", "demand-first"):
        w["transfer_order"].value = o
        order[o] = run(o)
    # demand-first cancels the prefetches whose layer ran before they started; FIFO copies them
    assert order["fifo"]["cancelled_prefetches"] == 0 < order["demand-first"]["cancelled_prefetches"]
    assert order["demand-first"]["loads"] < order["fifo"]["loads"]

    w["prefetch"].value, w["ep_ranks"].value, w["dispatch"].value = "none", 2, "capacity-drop"
    w["capacity_factor"].value, w["min_capacity"].value = 0.5, 0
    s.batch_size, s.batch_mix = 4, "text"  # decode steps of one request never overflow
    scope = {}
    for sc in ("prefill", "all"):
        w["capacity_scope"].value = sc
        scope[sc] = run(f"scope-{sc}")
    assert scope["prefill"]["dispatch_assigned"] == scope["all"]["dispatch_assigned"]
    assert 0 < scope["prefill"]["dispatch_dropped"] < scope["all"]["dispatch_dropped"]


def test_bad_knob_for_the_model_is_reported_not_raised(tiny_ckpt, tmp_path):
    from workbench.errors import KnobError

    s = _store(tmp_path, tiny_ckpt("qwen3_moe"), cache_slots=1)  # top-k is 2
    try:  # refused before the run starts when the model is loaded already, else by the run
        s.start_run(prompt="p")
        s.wait()
        err = s.error
    except KnobError as e:
        err = str(e)
    assert "cache_slots must be at least 2" in err
    assert not s.running and s.run_name is None and s.dataset is None
    assert list_runs(s.workspace_path) == []


def test_empty_prompt_is_rejected_before_the_thread(tmp_path):
    s = DataStore(workspace=tmp_path / "ws")
    with pytest.raises(InputError, match="prompt is empty"):
        s.start_run(prompt="   ")
    assert s._job is None


def test_stop_ends_the_run_early(tiny_ckpt, tmp_path):
    s = _store(tmp_path, tiny_ckpt("qwen3_moe"), max_new_tokens=200)
    s.start_run(prompt="a long one")
    deadline = time.time() + 60
    while s._job is not None and s._job.tokens < 2 and time.time() < deadline:
        time.sleep(0.01)
    s.stop()
    s.wait()
    assert not s.running and not s.error
    assert s.status.startswith("stopped") and s.dataset.sizes["step"] < 200
    # the Runs list says so too (issue 37 §8: it said "complete · N steps")
    assert [r.label for r in list_runs(s.workspace_path)][0].split(" · ")[1] == "stopped"


def test_the_end_is_shown_before_the_store_is_written(tiny_ckpt, tmp_path, monkeypatch):
    """Issue 37 §1: the page shows a run ended (Run enabled, the status line) as soon as
    generation has ended (``Runtime.run``'s ``on_result``), with a note while the store's
    final write goes on; a second Run may start then (a store of its own: the model pool
    starts it once the first store is written). Once written, the note goes and the store's
    last steps are shown. The store's write is held here by a gate on ``Recorder.close``."""
    import threading

    from workbench.telemetry.store import Recorder

    gate, closing = threading.Event(), threading.Event()
    close = Recorder.close

    def held_close(self, *a, **kw):
        closing.set()
        assert gate.wait(60), "the test never opened the gate"
        return close(self, *a, **kw)

    monkeypatch.setattr(Recorder, "close", held_close)
    woken = []
    s = _store(tmp_path, tiny_ckpt("qwen3_moe"), max_new_tokens=4)
    s.wake = lambda: woken.append(time.monotonic())
    first = s.start_run(prompt="first", name="first")
    try:
        assert closing.wait(60), "the run never reached its store's final write"
        assert woken, "the run's thread did not ask for a poll when generation ended"
        assert s.streaming
        s.poll()
        assert not s.running and s.status.endswith("· writing the store …"), s.status
        assert s.status.startswith("complete: first.zarr · 4 tokens")
        assert s.streaming  # the views below the first screen wait for the last steps
        s.poll()  # nothing new until the store is written
        assert s.status.endswith("· writing the store …")
        second = s.start_run(prompt="second", name="second")  # refused before: in progress
        assert second != first
    finally:
        gate.set()
    s.wait()
    assert not s.running and not s.error and s.run_name == "second.zarr"
    assert workbench.open_run(first).attrs["status"] == "complete"
    assert "writing the store" not in s.status and s.dataset.attrs["status"] == "complete"
    assert not s.streaming


def test_views_below_the_first_screen_wait_for_a_streaming_run(two_runs, monkeypatch):
    """While this session's run streams, a view below the first screen (``live`` False) says
    once that it is drawn at the run's end instead of redrawing at every commit; the first
    screen's views follow each commit; anything but the run (a filter) still redraws it."""
    from workbench.ui.views import WAITING_FOR_END, EPView

    s = two_runs
    s.open("a")
    heat, ep = HeatmapView(s), EPView(s)
    monkeypatch.setattr(DataStore, "streaming", property(lambda self: True))
    n_heat, n_ep = heat.redraws, ep.redraws
    for _ in range(2):  # two commits of a streaming run (as the tail sets them)
        s.dataset = s.dataset.copy()
    assert heat.redraws == n_heat + 2 and ep.redraws == n_ep
    assert WAITING_FOR_END[:30] in ep.pane.object.layout.annotations[0].text.replace("<br>", " ")
    s.step_range = (1, 3)  # a filter: drawn with what is there
    assert ep.redraws == n_ep + 1
    s.step_range = None
    monkeypatch.undo()
    s.dataset = s.dataset.copy()  # the last steps, read once the store is written
    assert ep.redraws == n_ep + 3


def test_sessions_showing_one_finished_run_share_its_routing_and_replays(two_runs):
    """A new page showing the newest run replayed it all again (seconds under load): the
    routing of a finished store and the replays made on it are shared by the sessions of the
    process (``_SHARED_TRACES``), keyed by the store's identity."""
    s = two_runs
    s.open("a")
    first = s.replay_study()
    other = DataStore(workspace=s.workspace_path)
    other.open("a")
    assert other.replay_trace() is s.replay_trace() and other._replay_memo is s._replay_memo
    again = other.replay_study()
    assert again.curves.equals(first.curves) and again.table.equals(first.table)
    other.open("b")
    assert other.replay_trace() is not s.replay_trace()


# -- views ----------------------------------------------------------------------------------------
def test_filter_changes_redraw_only_the_views_that_use_them(two_runs):
    s = two_runs
    s.open("a")
    views = {v.view: v for v in (HeatmapView(s), HitRateView(s), LatencyView(s),
                                 TimelineView(s))}
    before = {k: v.redraws for k, v in views.items()}
    heat0 = np.array(views["heatmap"].pane.object.data[0].z, float)
    s.modality = "image"  # a text-only run: no image tokens anywhere
    assert views["heatmap"].redraws == before["heatmap"] + 1
    assert all(views[k].redraws == before[k] for k in ("hit_rate", "latency", "timeline"))
    assert np.isnan(np.array(views["heatmap"].pane.object.data[0].z, float)).all()
    s.modality = "text"
    np.testing.assert_allclose(np.array(views["heatmap"].pane.object.data[0].z, float), heat0)

    s.clock = "measured"
    assert views["timeline"].redraws == before["timeline"] + 1
    assert "measured" in views["timeline"].pane.object.layout.xaxis.title.text
    assert views["latency"].redraws == before["latency"]

    s.phase = "prefill"
    lat = views["latency"].pane.object
    assert list(lat.data[0].x) == [0] and "measured" in lat.data[0].name
    assert "modeled" in lat.data[1].name
    s.phase = "all"
    s.step_range = (2, 4)
    assert list(views["hit_rate"].pane.object.data[1].x) == [2, 3, 4]
    spans = {int(c[0]) for tr in views["timeline"].pane.object.data for c in tr.customdata}
    assert spans <= {2, 3, 4}
    s.step_range = None


def test_views_show_a_placeholder_without_a_run(tmp_path):
    s = DataStore(workspace=tmp_path / "ws")
    for cls in (HeatmapView, HitRateView, LatencyView, TimelineView, DiffHeatmapView):
        fig = cls(s).pane.object
        assert fig.layout.meta["view"] == cls.view and len(fig.data) == 0


def test_adopt_the_knobs_of_a_stored_run(two_runs, tmp_path):
    s = DataStore(workspace=two_runs.workspace)
    with pytest.raises(InputError, match="no run is shown"):
        s.adopt_knobs()
    s.open("a")
    s.knobs.set(cache_slots=50, eviction="lru", max_new_tokens=99)
    s.adopt_knobs()
    assert (s.knobs.cache_slots, s.knobs.max_new_tokens) == (3, 6)


def test_selected_steps(two_runs):
    ds = two_runs.open("a")
    assert list(selected_steps(ds)) == list(range(6))
    assert list(selected_steps(ds, (1, 3))) == [1, 2, 3]
    assert list(selected_steps(ds, None, "prefill")) == [0]
    assert list(selected_steps(ds, (1, 3), "prefill")) == []
    with pytest.raises(InputError):
        selected_steps(ds, None, "warmup")


# -- A/B ------------------------------------------------------------------------------------------
def test_ab_deltas_and_difference_heatmap(two_runs):
    s = two_runs
    a = s.open("a")
    with pytest.raises(InputError):
        DataStore(workspace=s.workspace).pin_baseline()  # nothing shown
    s.pin_baseline()
    assert s.baseline_name == "a.zarr"
    b = s.open("b")
    rows = {r["metric"]: r for r in s.deltas()}
    sa, sb = a.moe.summary(), b.moe.summary()
    for key in ("hit_rate", "loads", "misses", "latency_measured_s", "latency_modeled_s"):
        assert rows[key]["current"] == pytest.approx(sb[key])
        assert rows[key]["baseline"] == pytest.approx(sa[key])
        assert rows[key]["delta"] == pytest.approx(sb[key] - sa[key])
    assert rows["loads"]["relative"] == pytest.approx((sb["loads"] - sa["loads"]) / sa["loads"])
    # more slots: fewer loads, a higher hit rate (same request, LRU is a stack algorithm)
    assert rows["loads"]["delta"] < 0 and rows["hit_rate"]["delta"] > 0
    assert ab_deltas(a, a)[0]["delta"] == 0

    # same request, same model → same routing: the difference heatmap is zero
    d = share_difference(b, a)
    assert d.dims == ("layer", "expert") and np.abs(d.values).max() == 0
    # against a run of another request it is current share − baseline share
    s.start_run(name="c", prompt="a different request altogether, longer")
    s.wait()
    c = s.dataset
    d = share_difference(c, a, modality="text")
    ca, cc = a.moe.expert_counts("text").values, c.moe.expert_counts("text").values
    np.testing.assert_allclose(
        d.values, cc / cc.sum(1, keepdims=True) - ca / ca.sum(1, keepdims=True), atol=1e-12)

    html = DeltasView(s).pane.object
    assert "hit rate" in html and "current: <b>c</b>" in html and "baseline: <b>a</b>" in html
    # c vs a: cache_slots 3 → 12 (c ran after b) and another request, said above the table
    assert "cache_slots 3 → 12" in html and "different requests" in html
    from workbench.ui.datastore import ab_context

    same = ab_context(b, a)  # b vs a: only the cache differs, same model, request and pricing
    assert same == {"differing": [("cache_slots", 12, 3)], "warnings": []}
    assert "knobs that differ (baseline → current): none" in deltas_html(rows.values(), "a", "a", ab_context(a, a))
    names = [t.name for t in HitRateView(s).pane.object.data]
    assert "baseline, per step" in names and "current, per step" in names
    assert any("baseline" in t.name for t in LatencyView(s).pane.object.data)
    assert len(DiffHeatmapView(s).pane.object.data) == 1
    s.clear_baseline()
    assert s.deltas() == [] and s.baseline is None


# -- live tail ------------------------------------------------------------------------------------
#: the other process's run: long enough (at 0.08 s a step) for the tail to see it grow in 3+
#: sizes between its 2nd step and its end, which is all the test needs of its length
LIVE_STEPS = 16
WRITER = textwrap.dedent(f"""
    import sys, time, workbench
    workbench.set_options(flush_every=1)
    rt = workbench.Runtime(sys.argv[1], cache_slots=3, pinned_layers=1,
                           max_new_tokens={LIVE_STEPS}, device="cpu")
    rt.run("written by another process", store=sys.argv[2],
           on_token=lambda t, s: time.sleep(0.08))
""")


def test_live_tail_of_a_store_written_by_another_process(tiny_ckpt, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    store = ws / "live.zarr"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tiny_ckpt("qwen3_moe")),
                             str(store)], stderr=subprocess.PIPE)
    try:
        s = DataStore(workspace=ws, refresh_s=0.0)
        deadline = time.time() + 90
        while not any(r.name == "live.zarr" and r.steps >= 2 for r in s.refresh()):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.time() < deadline, "writer made no progress"
            time.sleep(0.05)
        assert s.runs[0].status == "running"
        s.open("live")
        first = s.dataset.sizes["step"]
        assert s.live and "live tail" in s.status
        seen = [first]
        while proc.poll() is None and time.time() < deadline:
            s.poll()
            seen.append(s.dataset.sizes["step"])
            time.sleep(0.1)
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()
        s.poll()
        assert s.dataset.attrs["status"] == "complete" and s.dataset.sizes["step"] == LIVE_STEPS
        assert len(set(seen)) > 2 and seen == sorted(seen)  # it grew while being written
        assert not s.live and s.runs[0].status == "complete"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- replay view ----------------------------------------------------------------------------------
def _curves(fig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {t.name: (np.asarray(t.x, int), np.asarray(t.y, float)) for t in fig.data
            if t.mode != "markers"}


def test_replay_view_draws_policy_curves_under_the_belady_ceiling(two_runs):
    from workbench.policies.eviction import EVICTION
    from workbench.policies.prefetch import PREFETCH
    from workbench.replay import SCOPES
    from workbench.ui import replay as R

    assert R.SCOPES is SCOPES  # the replay package's own, not a copy
    assert DataStore.param["replay_scope"].objects == list(SCOPES)
    assert R.cache_sizes(4, 224, 5) == [4, 59, 114, 169, 224]
    log = R.cache_sizes(4, 224, 8, spacing="log")
    assert log[0] == 4 and log[-1] == 224 and log == sorted(set(log)) and log[1] < 10
    s0 = DataStore(workspace=two_runs.workspace, replay_evictions=["lru"], replay_scope="per-layer")
    assert (s0.replay_evictions, s0.replay_scope) == (["lru"], "per-layer")
    s = DataStore(workspace=two_runs.workspace)
    v = ReplayView(s)
    assert v.pane.object.layout.meta["view"] == "replay" and len(v.pane.object.data) == 0
    assert "no run" in v.message
    s.open("a")  # a real recorded run: 3 slots, LRU, first layer pinned
    fig = v.pane.object
    assert fig.layout.meta["view"] == "replay" and fig.layout.uirevision == "a.zarr"
    curves = _curves(fig)
    ceil_x, ceiling = curves.pop("belady (ceiling)")
    # the registry's online policies (oracles other than the ceiling are drawn on request)
    assert set(curves) == {p for p in EVICTION.available() if not EVICTION.get(p).needs_future}
    for name, (x, y) in curves.items():
        assert list(x) == list(ceil_x) and len(x) >= 2
        assert (ceiling >= y - 1e-12).all(), f"{name} above Belady: {y} > {ceiling}"
    # the recorded run's own hit rate lies on the replayed LRU curve (live and replay agree)
    (own,) = [t for t in fig.data if t.mode == "markers"]
    x, y = curves["lru"]
    assert own.x[0] == 3 and y[list(x).index(3)] == pytest.approx(own.y[0])
    assert "<table" in v.table.object and "modeled" in v.table.object

    # changing a setting replays (no model run) and redraws only this view
    hit = HitRateView(s)
    n, n_hit = v.redraws, hit.redraws
    s.replay_evictions = ["lfu"]
    assert v.redraws == n + 1 and hit.redraws == n_hit
    assert set(_curves(v.pane.object)) == {"lfu", "belady (ceiling)"}
    s.replay_slots = (4, 6)
    assert set(_curves(v.pane.object)["lfu"][0]) <= {4, 5, 6}

    # Belady bounds every policy at every size, in both scopes and under every prefetch policy
    trace = s.replay_trace()
    for scope in SCOPES:
        for pf in PREFETCH.available():
            try:
                df = R.replay_curves(trace, scope=scope, prefetch=pf, prefetch_lead=2)
            except workbench.WorkbenchError as e:
                assert "lookahead" in str(e)  # only policies that need router lookahead
                continue
            tab = df.pivot(index="cache_slots", columns="eviction", values="hit_rate")
            assert (tab.max(axis=1) <= tab[R.CEILING] + 1e-12).all(), (scope, pf, tab)

    # a prefetch policy the run cannot serve stays in the menu; the view says why
    s.replay_evictions = EVICTION.available()
    trace.pred_ids = None  # as if recorded without router lookahead
    s._replay_memo.clear()
    n = v.redraws
    s.replay_knobs.prefetch = "speculative"  # a replay knob (the prefetch widget sets it)
    assert v.redraws == n + 1 and s.replay_revision > 0
    assert v.study is None and "lookahead" in v.message and len(v.pane.object.data) == 0
    assert "lookahead" in v.table.object
    assert "speculative" in s.replay_knobs.group("prefetch").param["prefetch"].objects


def test_a_served_replay_view_replays_in_slices_and_draws_the_same(two_runs):
    """Served, the replay view makes its study in slices of ``SLICE_S`` seconds, one per
    event-loop tick (a whole study held the loop for 2-11 s after a run ended, and a value
    typed then waited that long): the study is a generator advanced slice by slice, each slice
    makes at least one point and says how far it got, a change meanwhile starts a new study,
    and the finished figure and table are those of a study made at once."""
    from bokeh.document import Document

    from workbench.ui import replay as R
    from workbench.ui.views import TickQueue

    s = DataStore(workspace=two_runs.workspace)
    s.open("a")
    whole = s.replay_study()  # at once: the reference
    s._replay_memo.clear()
    steps = s.replay_study_steps()
    assert R.advance(steps, deadline=0.0) == (1, len(whole.curves))  # one point per slice
    assert R.advance(steps, deadline=0.0) == (2, len(whole.curves))  # the same study goes on
    rest = R.advance(steps)
    assert rest.curves.equals(whole.curves) and rest.table.equals(whole.table)

    v = ReplayView(s)
    v._ticks = ticks = TickQueue(Document())  # as served: its redraws go on the session's queue
    s._replay_memo.clear()
    v.SLICE_S, v.PROGRESS_EVERY_S = 0.0, 0.0  # one point per slice, each said
    n = v.redraws
    v.redraw()
    said = [v.message]
    while ticks.pending:
        ticks._one()  # the event loop's next tick
        said.append(v.message)
    assert len(said) == len(whole.curves) + 1 and v.redraws == n + len(said)  # + the figure
    assert said[0] == f"replaying … 1 of {len(whole.curves)} points"
    assert [int(m.split()[2]) for m in said[:-1]] == list(range(1, len(said)))
    assert v.study is not None and v.study.curves.equals(whole.curves)
    assert v.study.table.equals(whole.table) and "<table" in v.table.object
    assert len(v.pane.object.data) > 1

    v.PROGRESS_EVERY_S = 3600.0  # progress said once: the page is left alone after that
    s._replay_memo.clear()
    n = v.redraws
    v.redraw()
    while ticks.pending:
        ticks._one()
    assert v.redraws == n + 2 and v.study.curves.equals(whole.curves)

    s._replay_memo.clear()  # a change between two slices: a new study, for it
    v.redraw()
    assert ticks.pending and v.message.startswith("replaying")
    s.replay_evictions = ["lru"]  # the watcher queues a redraw under the view's key
    while ticks.pending:
        ticks._one()
    assert set(v.study.curves.eviction) == {"lru", R.CEILING}


def test_replay_curves_of_a_layerwise_unit_start_at_a_whole_layer(two_runs):
    """A layer-wise offload unit holds whole layers (issue 39 §2): the curves leave out the
    caches that cannot hold one (they would refuse the whole study), and say so when none can."""
    from workbench.sim.unit import slots_needed
    from workbench.ui import replay as R

    s = DataStore(workspace=two_runs.workspace)
    s.open("a")
    trace = s.replay_trace()
    k = R.recorded_knobs(trace).copy(offload_unit="layerwise")
    need = slots_needed("layerwise", trace.num_experts, trace.num_layers - R.pinned_prefix(trace))
    df = R.replay_curves(trace, ["lru"], knobs=k)
    assert need > 0 and df.cache_slots.min() >= need and df.transfers.gt(0).all()
    with pytest.raises(workbench.WorkbenchError, match="holds whole layers"):
        R.replay_curves(trace, ["lru"], sizes=[need - 1], knobs=k)


def test_replay_waits_for_a_live_run(two_runs):
    s = DataStore(workspace=two_runs.workspace)
    s.open("b")
    s.dataset = s.dataset.assign_attrs(status="running")  # as a live tail would show it
    v = ReplayView(s)
    assert "still being written" in v.message and len(v.pane.object.data) == 0


RECORDED = dict(eviction="lfu", cache_slots=5, prefetch="speculative", prefetch_lead=2,
                prefetch_budget=3, hybrid=True, profile="rtx-3090", hotness_decay=0.6)


def test_dashboard_replay_of_a_run_is_replay_trace(tiny_ckpt, tmp_path):
    """One replay entry point: the dashboard recovers every knob of a run that
    ``workbench.replay_trace`` recovers (non-default eviction, slots, prefetch, its lead and
    budget, hybrid, profile), so its replay at the run's own policy and size gives the same
    metrics as ``replay_trace(store)`` — which reproduces the live run."""
    import workbench.replay
    from workbench.ui.replay import _KEEP

    s = _store(tmp_path, tiny_ckpt("qwen3_moe"), **RECORDED)
    s.start_run(name="rec", prompt="a request recorded with other knobs")
    s.wait()
    assert not s.error, s.error
    d = DataStore(workspace=s.workspace)  # a new session opens the stored run
    d.open("rec")
    assert {k: getattr(d.replay_knobs, k) for k in RECORDED} == RECORDED
    assert d.replay_revision == 0  # taking the run's knobs is not a change
    d.replay_evictions = ["lfu", "lru"]
    st = d.replay_study()
    assert st.at_slots == 5 and st.own[0] == 5 and "lfu + speculative prefetch" in st.own[2]
    row = st.table[st.table.eviction == "lfu"].iloc[0]
    ref = workbench.replay.replay_trace(d._path).metrics()
    assert ref["hit_rate"] == pytest.approx(d.dataset.moe.hit_rate())  # = the live run
    for key in _KEEP:
        if key in ref:
            assert row[key] == pytest.approx(ref[key], nan_ok=True), key
    assert st.settings["prefetch"] == "speculative" and st.settings["knobs"]["hybrid"] is True
    # a replay knob changed in the view is a what-if; opening the run again takes its own back
    d.replay_knobs.prefetch = "none"
    assert d.replay_revision == 1
    other = d.replay_study().table
    assert other[other.eviction == "lfu"].iloc[0]["prefetch_loads"] == 0
    d.open("rec")
    assert d.replay_knobs.prefetch == "speculative"
    assert d.knobs.prefetch == "none"  # the next run's knobs never moved


def test_replay_of_a_run_with_unreadable_knobs_says_why(two_runs, tmp_path):
    import shutil

    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copytree(two_runs.workspace_path / "a.zarr", ws / "bad.zarr")
    meta = ws / "bad.zarr" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["knob.prefetch_lead"] = "{oops"
    meta.write_text(json.dumps(doc))
    s = DataStore(workspace=ws)
    v = ReplayView(s)
    s.open("bad")
    assert v.study is None and "knob.prefetch_lead" in v.message and "{oops" in v.message


# -- the model pool (runtime) ---------------------------------------------------------------------
def test_model_pool_loads_each_key_once_and_serialises_runs(tmp_path):
    import threading

    from workbench.runtime.pool import ModelPool

    loads, started = [], threading.Event()

    class Fake:
        def __init__(self, key):
            self.key = key

    def loader(path, dtype, device):
        loads.append((path, dtype, device))
        started.wait(5)  # every caller arrives while the load is still going
        return Fake((path, dtype, device))

    pool = ModelPool(capacity=2, loader=loader)
    got = []
    threads = [threading.Thread(target=lambda: got.append(pool.get(tmp_path, "float32", "cpu")))
               for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    started.set()
    for t in threads:
        t.join(10)
    assert len(loads) == 1 and len(got) == 6 and all(g is got[0] for g in got)
    assert pool.key(tmp_path, "float32", "cpu") in pool and len(pool) == 1
    # capacity: the oldest model leaves; its run lock stays the same object
    first = got[0]
    lock = pool.run_lock(first)
    pool.get(tmp_path / "b", "float32", "cpu")
    pool.get(tmp_path / "c", "float32", "cpu")
    assert pool.loaded() == [pool.key(tmp_path / n, "float32", "cpu") for n in ("b", "c")]
    assert pool.run_lock(first) is lock is pool.run_lock(tmp_path, "float32", "cpu")
    # one run at a time per model
    order = []

    def run(tag):
        with pool.exclusive(first):
            order.append(f"{tag}+")
            time.sleep(0.05)
            order.append(f"{tag}-")

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert all(order[i][:-1] == order[i + 1][:-1] for i in range(0, 6, 2)), order
    # a failed load keeps nothing and is tried again
    bad = ModelPool(loader=lambda *k: (_ for _ in ()).throw(ModelLoadError("nope")))
    for _ in range(2):
        with pytest.raises(ModelLoadError, match="nope"):
            bad.get(tmp_path)
    assert len(bad) == 0
    with pytest.raises(ValueError, match="capacity"):
        ModelPool(capacity=0)


def test_dashboard_sessions_share_the_runtime_pool(tiny_ckpt, tmp_path):
    from workbench.models.loading import load
    from workbench.runtime.pool import ModelPool, default_pool

    assert DataStore(workspace=tmp_path / "w0").pool is default_pool()
    loads = []

    def loader(path, dtype, device):
        loads.append(path)
        return load(path, dtype=dtype, device=device)

    pool = ModelPool(loader=loader)
    ckpt = tiny_ckpt("qwen3_moe")
    for i in range(2):  # two sessions, one model load
        s = DataStore(workspace=tmp_path / "ws", model=ckpt, pool=pool)
        s.knobs.set(**KNOBS)
        s.start_run(name=f"r{i}", prompt="shared model")
        s.wait()
        assert not s.error, s.error
    assert loads == [str(ckpt)] and pool.loaded() == [pool.key(ckpt, "float32", "cpu")]
    # notebooks: a Runtime around the pool's model
    rt = pool.runtime(ckpt, KNOBS)
    assert rt.lm is pool.get(ckpt, "float32", "cpu") and rt.knobs.cache_slots == 3
    assert len(loads) == 1


def test_the_pool_and_the_metadata_reader_import_no_torch():
    code = ("import sys, workbench.runtime.pool, workbench.telemetry.metadata; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- widgets and app ------------------------------------------------------------------------------
def test_knob_widgets_come_from_the_knob_classes_and_registries(tmp_path):
    from workbench.policies.eviction import EVICTION, LRU
    from workbench.ui.widgets import knob_panels

    @EVICTION.register("test-ui-policy")
    class _P(LRU):
        """A policy registered after import."""

    try:
        s = DataStore(workspace=tmp_path / "ws")
        panels = knob_panels(s.knobs)
        assert set(panels) == set(s.knobs.groups)
        ev = panels["cache"]._widgets["eviction"]
        assert "test-ui-policy" in ev.options
        slots = panels["cache"]._widgets["cache_slots"]
        slots.value = 17
        assert s.knobs.cache_slots == 17  # the widget edits the knob
        from workbench.policies.prefetch import PREFETCH
        from workbench.ui.replay import replay_knob_names
        from workbench.ui.widgets import replay_widgets

        rw = replay_widgets(s)  # the replay view's menus come from the registries too
        assert "test-ui-policy" in list(rw["evictions"].options)
        # the replay knobs' widgets are the knob classes' own, over the replay knobs
        assert list(rw["knobs"]) == replay_knob_names()
        assert {"prefetch", "prefetch_lead", "prefetch_budget", "target_model", "profile",
                "hybrid", "hotness_decay"} <= set(rw["knobs"])
        assert not {"cache_slots", "eviction", "pinned_layers"} & set(rw["knobs"])
        pf = rw["knobs"]["prefetch"]._wb_widget
        assert list(pf.options) == PREFETCH.available()
        pf.value = "previous-step"
        assert s.replay_knobs.prefetch == "previous-step" and s.knobs.prefetch == "none"
        assert s.replay_revision == 1
        lead = rw["knobs"]["prefetch_lead"]._wb_widget
        assert type(lead).__name__ == type(panels["prefetch"]._widgets["prefetch_lead"]).__name__
    finally:
        EVICTION._classes.pop("test-ui-policy", None)


def test_build_app_without_a_server(two_runs):
    from workbench.ui.app import build_app

    s = DataStore(workspace=two_runs.workspace, model=two_runs.model)
    app = build_app(s, template=False, preload=False, poll_ms=0)
    assert app._wb_store is s and s.run_name == s.runs[0].name  # the newest run is shown
    assert len(app._wb_views["heatmap"].pane.object.data) == 1
    assert app._wb_views["replay"].study is not None  # the replay view follows the shown run
    assert app._wb_views["scheduler"].study is not None  # simulated at once outside a server
    import panel as pn  # the Elastic experts knobs sit in the main column, beside their views

    titles = {c.title.split(" (")[0]: side for side, col in (("sidebar", app[0]), ("main", app[1]))
              for c in col.select(pn.Card)}
    assert titles["Elastic experts"] == "main" and titles["Expert cache"] == "sidebar"
    tpl = build_app(DataStore(workspace=two_runs.workspace), preload=False)
    try:
        assert tpl.title.startswith("workbench") and tpl._wb_poll is not None
    finally:
        tpl._wb_poll.stop()


def test_serve_binds_the_loopback_address(tmp_path, monkeypatch, capfd):
    """``workbench.ui.serve()`` (what ``workbench dashboard`` calls) answers on 127.0.0.1, at
    /dashboard as ``panel serve apps/dashboard.py`` does (and / redirects there). Served from a
    thread of this process (``threaded=True``, every other argument the command's): a process
    of its own would only add its imports, and what it prints is captured here all the same.
    The redirect of / is read, not followed: following it would only build the page fetched
    just before once more."""
    import http.client
    import socket
    import urllib.parse
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("WORKBENCH_WORKSPACE", str(tmp_path / "ws"))
    from workbench.ui.app import serve

    server = serve(port=port, threaded=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/dashboard", timeout=30).read()
                break
            except OSError:
                assert server.is_alive() and time.time() < deadline, capfd.readouterr()
                time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", "/")
            root = conn.getresponse()
            to = urllib.parse.urljoin(f"http://127.0.0.1:{port}/", root.getheader("Location", ""))
        finally:
            conn.close()
        assert b"workbench" in page and root.status in (301, 302, 303, 307, 308)
        assert to == f"http://127.0.0.1:{port}/dashboard", to
    finally:
        server.stop()
        server.join(timeout=20)
    out = "".join(capfd.readouterr())
    assert f"http://127.0.0.1:{port}/dashboard" in out
    listening = [c for c in out.splitlines() if "0.0.0.0" in c]
    assert not listening, out


# -- VisMMOE surface (issue 5 §5) ------------------------------------------------------------------
def _cells(fig, state: str) -> int:
    return sum(len(t.x) for t in fig.data if (t.meta or {}).get("cells") == state)


def test_token_overlay_counts_kept_and_pruned_cells(vismmoe_run, two_runs):
    from workbench.ui.views import TokenOverlayView, token_overlay_view_figure

    path, res = vismmoe_run
    s = DataStore(workspace=path.parent)
    s.open(path.name)  # as the dashboard loads it
    v = TokenOverlayView(s)
    fig = v.pane.object
    assert fig.layout.meta["view"] == "tokens"
    assert _cells(fig, "kept") == res.kept_visual_tokens
    assert _cells(fig, "pruned") == res.visual_tokens - res.kept_visual_tokens > 0
    ds = s.dataset
    image_kept = ds["kept"].values[ds["token_modality"].values == 1]
    assert _cells(fig, "kept") == int(image_kept.sum())
    assert [t.type for t in fig.data].count("image") == 1  # the demo image, from its path
    assert f"{res.kept_visual_tokens} of {res.visual_tokens} kept" in fig.layout.title.text
    # an in-memory image is not in the store: the same cells on a canvas, saying so
    canvas = ds.moe.token_overlay(images=[None])
    assert _cells(canvas, "pruned") == _cells(fig, "pruned") and not [
        t for t in canvas.data if t.type == "image"]
    assert "PIL image" in canvas.layout.annotations[0].text
    # a run without compression: an honest placeholder
    s2 = DataStore(workspace=two_runs.workspace)
    s2.open("a")
    none = token_overlay_view_figure(s2.dataset)
    assert len(none.data) == 0 and "compression = none" in none.layout.annotations[0].text


def test_merged_token_cells_follow_the_models_rope_positions(embedded):
    """The raster order of ``merged_token_cells`` is the model's own: the M-RoPE (h, w)
    positions ``get_rope_index`` gives the visual tokens, on a non-square image."""
    import torch

    from workbench.analysis.accessor import merged_token_cells
    from workbench.models.inputs import Request, build_inputs

    img = Image.new("RGB", (160, 96), (10, 200, 30))
    inp = build_inputs(embedded, Request("what is it?", [img]))
    t = inp.tensors
    merge = embedded.model.config.vision_config.spatial_merge_size
    image, row, col, grids = merged_token_cells(t["image_grid_thw"].tolist(), merge)
    assert grids[0][0] != grids[0][1]
    with torch.no_grad():
        pos, _ = embedded.model.model.get_rope_index(
            t["input_ids"], t["mm_token_type_ids"], image_grid_thw=t["image_grid_thw"])
    vis = inp.modality == 1
    h, w = pos[1, 0].numpy()[vis], pos[2, 0].numpy()[vis]
    np.testing.assert_array_equal(h - h.min(), row)
    np.testing.assert_array_equal(w - w.min(), col)


def test_hot_recall_view_with_random_baseline(vismmoe_run, two_runs):
    from workbench.ui.views import HotRecallView, hot_recall_view_figure

    path, _ = vismmoe_run
    s = DataStore(workspace=path.parent)
    s.open(path.name)
    fig = HotRecallView(s).pane.object
    names = [t.name for t in fig.data]
    assert names[0].startswith("predictor") and names[1].startswith("random")
    want = s.dataset.moe.hot_recall(10)
    np.testing.assert_allclose(np.asarray(fig.data[0].y, float), want.values, equal_nan=True)
    np.testing.assert_allclose(np.asarray(fig.data[1].y, float)[:-1],
                               10 / s.dataset.sizes["expert"])
    s2 = DataStore(workspace=two_runs.workspace)
    s2.open("a")
    none = hot_recall_view_figure(s2.dataset)
    assert len(none.data) == 0 and "predictor = vismmoe" in none.layout.annotations[0].text


def test_vismmoe_card_holds_the_four_knobs_and_drives_them(tmp_path):
    from workbench.ui.widgets import VISMMOE_KNOBS, knob_cards, vismmoe_panel

    s = DataStore(workspace=tmp_path / "ws")
    panel = vismmoe_panel(s.knobs)
    w = panel._wb_widgets
    assert list(w) == ["compression", "beta", "lam"] == list(VISMMOE_KNOBS)
    assert type(w["beta"]).__name__ == "EditableFloatSlider"
    assert "affinity" in w["compression"].options  # menu from the registry
    for name, value in (("compression", "affinity"), ("beta", 0.7), ("lam", 3.0)):
        w[name].value = value
        assert getattr(s.knobs, name) == value  # the widget edits the knob
    s.knobs.set(beta=0.3)
    assert w["beta"].value == 0.3  # one param object: the knob moves the widget
    # the VisMMOE card comes first and holds its whole group; every knob is in exactly one
    # card, and no two cards share a title (the pinned prefix is in Expert cache)
    import panel as pn

    cards = knob_cards(s.knobs)
    closed = [c for c in cards if c.collapsed]
    assert closed and not any(c.objects for c in closed)  # built when first opened
    for c in closed:
        c.collapsed = False
    assert all(c.objects for c in cards)
    assert cards[0].title.startswith("VisMMOE")
    titles = [c.title for c in cards]
    assert len(titles) == len(set(titles))
    shown = [n for c in cards for p in c.select(pn.Param) for n in p._widgets
             if n != "_title"]
    from workbench.ui.prism import prism_knob_widgets  # Elastic experts: in the main column

    shown += list(prism_knob_widgets(s, 4)._wb_widgets)
    assert sorted(shown) == sorted(s.knobs.names())
    first = [n for p in cards[0].select(pn.Param) for n in p._widgets]
    assert {"compression", "beta", "lam", "alpha"} <= set(first)
    cache = next(c for c in cards if c.title == "Expert cache")
    assert "pinned_layers" in [n for p in cache.select(pn.Param) for n in p._widgets]


def test_live_knob_menus_disable_the_replay_only_choices():
    """Belady and the oracle prefetcher need the future: the live knob cards show them disabled
    (they cannot be picked and refused only after Run); the replay menus keep them."""
    import panel as pn

    from workbench.knobs import Knobs
    from workbench.ui.widgets import knob_cards, knob_panels

    k = Knobs()
    oracles = ["belady", "belady-horizon"]
    live = {n: w for p in knob_panels(k, live=True).values() for n, w in p._widgets.items()}
    assert live["eviction"].disabled_options == oracles and "belady" in live["eviction"].options
    assert live["prefetch"].disabled_options == ["oracle"]
    assert all(not getattr(w, "disabled_options", None)
               for p in knob_panels(k).values() for w in p._widgets.values())
    cards = knob_cards(k)  # what the dashboard shows
    widgets = [w for c in cards for w in c.select(pn.widgets.Select)]
    assert any(w.disabled_options == oracles for w in widgets)


def test_a_refused_run_keeps_the_shown_run_and_the_baseline(two_runs):
    """Knobs a live run refuses are refused before anything starts: the shown run, the pinned
    baseline and the A/B card stay; the reason is raised for the error banner."""
    from workbench.errors import KnobError

    s = two_runs
    s.open("a")
    s.pin_baseline()
    s.open("b")
    before = (s.run_name, s.dataset, s.baseline_name, s.answer)
    for bad in ({"eviction": "belady"}, {"prefetch": "oracle"}, {"eviction": "slab"}):
        s.knobs.set(**bad)
        try:
            with pytest.raises(KnobError):
                s.start_run(prompt="refused")
        finally:
            s.knobs.set(eviction="lru", prefetch="none")
        assert (s.run_name, s.dataset, s.baseline_name, s.answer) == before and not s.running
    assert not (s.workspace_path / "refused.zarr").exists()


def test_a_run_exports_its_tables_and_figures(two_runs, tmp_path):
    """``ds.moe.export``: the headline, per-step and per-layer tables and the figures, derived
    from the store; the per-step table adds up to the summary."""
    import pandas as pd

    ds = workbench.open_run(two_runs.workspace_path / "a.zarr")
    paths = ds.moe.export(tmp_path / "out", figures=("html", "json"))
    names = sorted(p.name for p in paths)
    assert names == sorted(["summary.json", "per_step.csv", "per_layer.csv",
                            *(f"{f}.{x}" for f in ("heatmap", "hit_rate", "latency", "timeline")
                              for x in ("html", "json"))])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    steps = pd.read_csv(tmp_path / "out" / "per_step.csv", index_col="step")
    assert len(steps) == summary["steps"] and steps.hits.sum() == summary["hits"]
    assert steps.misses.sum() == summary["misses"] and steps.loads.sum() == summary["loads"]
    assert steps.latency_modeled_s.sum() == pytest.approx(summary["latency_modeled_s"])
    assert set(steps.phase) <= {"prefill", "decode"}
    layers = pd.read_csv(tmp_path / "out" / "per_layer.csv", index_col="layer")
    assert len(layers) == ds.sizes["layer"] and "hit_rate" in layers
    assert "plotly" in (tmp_path / "out" / "heatmap.html").read_text()[:5000].lower()
    assert not list((tmp_path / "out").glob(".*.tmp"))  # written whole
    with pytest.raises(Exception, match="figures"):
        ds.moe.export(tmp_path / "x", figures=("png",))


def test_the_export_button_zips_the_shown_run(two_runs, tmp_path):
    import zipfile

    from workbench.ui.widgets import export_zip, runs_widgets

    s = two_runs
    s.open("a")
    button = runs_widgets(s)["export"]
    with zipfile.ZipFile(button.callback()) as z:
        names = set(z.namelist())
    assert {"a/summary.json", "a/per_step.csv", "a/per_layer.csv", "a/heatmap.html"} <= names
    empty = DataStore(workspace=tmp_path / "ws")
    with zipfile.ZipFile(export_zip(empty)) as z:  # nothing shown: said, not raised
        assert z.namelist() == ["README.txt"] and "no run is shown" in z.read("README.txt").decode()


def test_compare_several_runs_in_one_table_and_figure(two_runs):
    """workbench.compare_runs: a row per run with the knobs that differ (only cache_slots here)
    and the headline numbers, and every run's hit rate per step overlaid."""
    ws = two_runs.workspace_path
    table, fig = workbench.compare_runs([ws / "a.zarr", ws / "b.zarr"])
    assert list(table.index) == ["a", "b"] and list(table.cache_slots) == [3, 12]
    assert "eviction" not in table and "model" not in table and "prompt" not in table
    a = workbench.open_run(ws / "a.zarr").moe.summary()
    assert table.loc["a", "hit_rate"] == pytest.approx(a["hit_rate"])
    assert table.loc["a", "loads"] == a["loads"]
    assert [t.name for t in fig.data] == ["a", "b"]
    with pytest.raises(workbench.WorkbenchError, match="list of one or more runs"):
        workbench.compare_runs(ws / "a.zarr")


def test_the_compare_card_shows_the_picked_runs(two_runs):
    from workbench.ui.views import CompareView

    v = CompareView(two_runs)
    assert {"a.zarr", "b.zarr"} <= set(v.choice.options)
    v.choice.value = ["a.zarr"]
    assert "two or more" in v.table.object and not v.pane.visible
    v.choice.value = ["a.zarr", "b.zarr"]
    assert "cache_slots" in v.table.object and "hit_rate" in v.table.object
    assert v.pane.visible and [t.name for t in v.pane.object.data] == ["a", "b"]


def test_the_answer_card_shows_the_image_the_run_used(tmp_path):
    import xarray as xr

    from workbench.ui.views import answer_view

    img = tmp_path / "scene.png"
    img.write_bytes(_png((40, 30)))
    s = DataStore(workspace=tmp_path / "ws")
    view = answer_view(s)
    shown = lambda: view.object() if callable(view.object) else str(view.object)  # noqa: E731
    s.param.update(dataset=xr.Dataset(attrs={"prompt": "what color?", "images": json.dumps([str(img)])}),
                   answer="red")
    assert "data-testid='answer-image'" in shown() and "data:image/png;base64," in shown()
    for images in ([str(tmp_path / "gone.png")], [str(tmp_path)], []):  # missing, a folder, none
        s.dataset = xr.Dataset(attrs={"prompt": "p", "images": json.dumps(images)})
        assert "answer-image" not in shown()


def test_the_model_menu_lists_the_workspace_models_and_takes_another_folder(two_runs, tiny_ckpt, tmp_path):
    """The Request card's model menu: the embedded default, the folders the workspace's runs
    used, and any checkpoint folder typed in (a folder without config.json is refused)."""
    from workbench.ui.widgets import EMBEDDED_LABEL, model_widgets

    s = DataStore(workspace=two_runs.workspace)
    w = model_widgets(s)
    used = str(tiny_ckpt("qwen3_moe"))
    assert w["model"].options[EMBEDDED_LABEL] == "" and used in w["model"].options.values()
    w["model"].value = used
    assert s.model == used
    w["model"].value = ""
    assert s.model is None
    w["other"].value = str(tmp_path)  # no config.json
    assert w["message"].visible and "not a checkpoint folder" in w["message"].object and s.model is None
    other = str(tiny_ckpt("mixtral"))
    w["other"].value = other
    assert s.model == other and other in w["model"].options.values()


def test_ab_gives_measured_latency_over_repeats(tiny_ckpt, tmp_path):
    """Measured latency in the A/B table is the median over the workspace's repeats of each
    run (same model, request and knobs), with its range; a delta inside the ranges, or with a
    single run on a side, is marked as noise and left uncoloured (issue 13, item 6)."""
    from workbench.ui.datastore import MEASURED_METRICS, ab_deltas, repeat_key
    from workbench.ui.views import deltas_html

    s = _store(tmp_path, tiny_ckpt("qwen3_moe"))
    for name, slots in (("a1", 3), ("a2", 3), ("a3", 3), ("b1", 12)):
        s.knobs.set(cache_slots=slots)
        s.start_run(name=name, prompt="the same request")
        s.wait()
        assert not s.error, s.error
    s.refresh()
    s.open("a1")
    a = s.dataset
    s.open("b1")
    b = s.dataset
    assert repeat_key(a.attrs) is not None and repeat_key(a.attrs) != repeat_key(b.attrs)
    ra, rb = s.repeats(a, "a1.zarr"), s.repeats(b, "b1.zarr")
    assert all(len(ra[m]) == 3 for m in MEASURED_METRICS)  # a1 and its two repeats
    assert all(len(rb[m]) == 1 for m in MEASURED_METRICS)
    assert ra["latency_measured_s"][0] == pytest.approx(a.moe.summary()["latency_measured_s"])
    rows = {r["metric"]: r for r in ab_deltas(a, b, {"current": ra, "baseline": rb})}
    lat = rows["latency_measured_s"]
    assert lat["current"] == pytest.approx(float(np.median(ra["latency_measured_s"])))
    assert lat["current_spread"]["n"] == 3 and lat["baseline_spread"]["n"] == 1
    assert lat["noise"]  # one baseline run: nobody knows the noise
    assert "current_spread" not in rows["latency_modeled_s"]  # modeled: deterministic
    html_ = deltas_html(list(rows.values()), "a1", "b1")
    assert "n=3" in html_ and "one run: noise unknown" in html_
    # two sides with several repeats each: overlapping ranges are noise, disjoint ones are not
    r = ab_deltas(a, b, {"current": {"latency_measured_s": [1.0, 1.2, 1.1]},
                         "baseline": {"latency_measured_s": [1.15, 1.3]}})
    assert next(x for x in r if x["metric"] == "latency_measured_s")["noise"]
    r = ab_deltas(a, b, {"current": {"latency_measured_s": [1.0, 1.1]},
                         "baseline": {"latency_measured_s": [2.0, 2.2]}})
    row = next(x for x in r if x["metric"] == "latency_measured_s")
    assert not row["noise"] and row["delta"] == pytest.approx(1.05 - 2.1)


def test_hit_rate_title_reports_the_transfers_it_cost(two_runs):
    """Where the hit rate is shown, so is what it cost: loads per access (issue 13, item 5)."""
    from workbench.ui.views import hit_rate_view_figure

    s = two_runs
    s.open("a")
    ds = s.dataset
    title = hit_rate_view_figure(ds).layout.title.text
    per = float(ds["loads"].sum()) / float(ds["hits"].sum() + ds["misses"].sum())
    assert f"{per:.2f} loads per access" in title
    assert "evicted unused" not in title  # no prefetch in this run


def test_ep_view_follows_the_expert_parallel_card_without_rerunning(vismmoe_run, two_runs):
    """The EP view draws the shown run's routing over the card's ep_ranks / placement; changing
    them redraws (virtual ranks: nothing reruns), bars per modality for an image run."""
    from workbench.ui.views import EPView, ep_view_figure

    path, _ = vismmoe_run
    s = DataStore(workspace=path.parent)
    s.open(path.name)
    view = EPView(s)
    fig = view.pane.object
    assert len(fig.data) == 0 and "ep_ranks = 1" in fig.layout.annotations[0].text
    n = view.redraws
    s.knobs.group("ep").ep_ranks = 4
    assert view.redraws == n + 1
    fig = view.pane.object
    bars = {t.name: np.asarray(t.y, float) for t in fig.data if t.type == "bar"}
    assert set(bars) == {"text tokens", "image tokens"} and all(len(v) == 4 for v in bars.values())
    full = workbench.open_run(path)  # the dashboard's dataset leaves the routing on disk
    load = full.moe.ep_load(4, "contiguous")
    groups = int((load.sum("rank") > 0).sum())
    np.testing.assert_allclose(sum(bars.values()), load.sum(("step", "layer")).values / groups)
    heat = next(t for t in fig.data if t.type == "heatmap")
    np.testing.assert_allclose(np.asarray(heat.z, float),
                               full.moe.ep_imbalance(4).values.T, equal_nan=True)
    assert "EP over 4 ranks (contiguous)" in fig.layout.title.text
    s.knobs.group("ep").placement = "round-robin"
    assert view.redraws == n + 2 and "round-robin" in view.pane.object.layout.title.text
    s.step_range = (1, 2)
    assert list(next(t for t in view.pane.object.data if t.type == "heatmap").x) == [1, 2]
    assert len(ep_view_figure(None, 4, "contiguous").data) == 0


def test_a_refusal_only_the_loaded_model_finds_brings_the_shown_run_back(two_runs,
                                                                          monkeypatch):
    """A refusal the run thread finds (the model was not loaded yet when Run was pressed, so
    the pre-check could not ask it: here, prefetch=vismmoe without a calibrated predictor)
    used to leave an empty page; the run shown before comes back (the browser test met this
    on a busy machine)."""
    s = two_runs
    s.open("b")
    before = (s.run_name, s.dataset)
    monkeypatch.setattr(s.pool, "peek", lambda *a, **k: None)  # "not loaded yet"
    s.knobs.set(prefetch="vismmoe")
    try:
        s.start_run(prompt="refused later")
        s.wait()
    finally:
        s.knobs.set(prefetch="none")
    assert s.error and "predictor" in s.error
    assert (s.run_name, s.dataset) == before and not s.running
    # the page says nothing was stored and shows the previous run's answer, not "—"
    assert "nothing stored" in s.status and "failed" not in s.status and "b" in s.status
    assert s.answer == s._answer_of(s.dataset)


def test_a_refused_widget_value_is_said_beside_it_and_no_run_starts(tmp_path):
    """A value typed into a knob widget that the knob refuses (issue 37 §2): the knob keeps its
    last good value, the CLI's message appears right under the widget, nothing is raised into
    Panel (which logged a traceback), and Run refuses while the widget holds it; correcting
    the widget clears all of it."""
    from workbench.errors import InputError
    from workbench.ui.datastore import held_refusals
    from workbench.ui.widgets import knob_panels, vismmoe_panel

    s = DataStore(workspace=tmp_path / "ws")
    s.prompt = "how many shapes?"
    cache = knob_panels(s.knobs, groups=["cache"])["cache"]
    slots = cache._widgets["cache_slots"]
    beta = vismmoe_panel(s.knobs)._wb_widgets["beta"]
    before = s.knobs.cache_slots
    for typed in (0, -5):
        slots._value_edit.value = typed  # the slider's text box, as a user types into it
        assert slots.value == typed and s.knobs.cache_slots == before
    alert = [o for o in cache._widget_box.objects if "wb-refused-cache_slots" in o.css_classes]
    assert len(alert) == 1 and alert[0].visible
    box = cache._widget_box.objects
    assert box.index(alert[0]) == box.index(slots) + 1  # beside the widget
    assert "cache_slots must be at least 1, not -5" in alert[0].object
    beta._value_edit.value = 0.0  # an exclusive bound: raised a ValueError into Panel before
    assert s.knobs.beta == 0.5 and set(held_refusals(s.knobs)) == {"cache_slots", "beta"}
    with pytest.raises(InputError, match="cache_slots box holds .* at least 1, not -5.*1 more"):
        s.start_run()
    assert not s.running and not list((tmp_path / "ws").glob("*.zarr"))
    s.error = "stale"  # another message: left alone
    slots._value_edit.value = 12
    beta._value_edit.value = 0.7
    assert (s.knobs.cache_slots, s.knobs.beta) == (12, 0.7) and not held_refusals(s.knobs)
    assert not alert[0].visible
    s.knobs.set(cache_slots=20)
    assert slots.value == 20  # the knob still moves its widget


def test_the_alert_of_a_refused_run_goes_once_its_cause_is_fixed(tmp_path):
    """The red alert of a Run refused before it started stays while the cause does and goes
    at the next poll after the knob is fixed (issue 37 §4)."""
    from workbench.errors import KnobError

    s = DataStore(workspace=tmp_path / "ws")
    s.prompt = "count from 2 to 8."
    s.knobs.set(eviction="belady")
    with pytest.raises(KnobError) as e:
        s.start_run()
    s.error = str(e.value)  # what the app does with it
    s.poll()
    assert s.error == str(e.value)  # not fixed yet
    s.knobs.set(eviction="lru")
    s.poll()
    assert s.error == ""


def test_ep_view_shows_what_a_dispatch_dropped(embedded, demo_inputs, tmp_path):
    """A run with Token Drop: the EP view adds the dropped assignments per rank (hatched) and
    says what share the dispatch dropped."""
    from workbench.ui.views import ep_view_figure

    img, prompt, _ = next(d for d in demo_inputs if d[0] is not None)
    res = workbench.Runtime(embedded, max_new_tokens=2).run(
        prompt, images=[img], store=tmp_path / "d.zarr", dispatch="capacity-drop",
        capacity_factor=0.5)
    ds = workbench.open_run(res.store)
    fig = ep_view_figure(ds, 8, "contiguous")
    bars = {t.name: np.asarray(t.y, float) for t in fig.data if t.type == "bar"}
    assert "dropped by dispatch" in bars and bars["dropped by dispatch"].sum() > 0
    share = res.dispatch_dropped / res.dispatch_assigned
    assert f"{share:.0%} of assignments dropped" in fig.layout.title.text


def test_ep_view_compares_with_the_pinned_baseline(embedded, demo_inputs, tmp_path):
    """A/B in the EP view: the pinned run's per-rank load as diamonds, its imbalance in the
    title (issue 14 §5)."""
    from workbench.ui.views import EPView

    img, prompt, _ = next(d for d in demo_inputs if d[0] is not None)
    rt = workbench.Runtime(embedded, max_new_tokens=2)
    ws = tmp_path / "ws"
    rt.run(prompt, images=[img], store=ws / "a.zarr")
    rt.run(prompt, images=[img], store=ws / "b.zarr", dispatch="capacity-drop",
           capacity_factor=1.0)
    s = DataStore(workspace=ws)
    s.open("a.zarr")
    s.pin_baseline()
    s.open("b.zarr")
    view = EPView(s)
    s.knobs.group("ep").ep_ranks = 4
    fig = view.pane.object
    diamonds = [t for t in fig.data if t.type == "scatter" and t.name.startswith("baseline")]
    assert len(diamonds) == 1 and "a.zarr" in diamonds[0].name
    a = workbench.open_run(ws / "a.zarr").moe.ep_load(4, "contiguous")
    groups = int((a.sum("rank") > 0).sum())
    np.testing.assert_allclose(np.asarray(diamonds[0].y, float),
                               a.sum(("step", "layer")).values / groups)
    assert "(baseline " in fig.layout.title.text
    n = view.redraws
    s.clear_baseline()
    assert view.redraws == n + 1
    assert not [t for t in view.pane.object.data if t.type == "scatter" and
                t.name.startswith("baseline")]


def test_realb_view_and_precision_per_rank(embedded, vismmoe_run, tmp_path):
    """Issue 15 §5: the ReaLB view draws M_d per rank as the run's live controller recorded it
    (a run without one: under the card's balance, modeled over its routing, or a hint), and
    the EP view writes each rank's low-precision share over its bar when ranks and placement
    are the run's own."""
    from workbench.ui.views import ReaLBView, ep_view_figure, realb_view_figure

    path, _ = vismmoe_run
    s = DataStore(workspace=path.parent)
    s.open(path.name)
    view = ReaLBView(s)
    assert "no ReaLB controller" in view.pane.object.layout.annotations[0].text
    ep = s.knobs.group("ep")
    ep.ep_ranks = 4
    ep.balance = "realb-m1"
    fig = view.pane.object
    lines = [t for t in fig.data if t.name and t.name.startswith("rank ") and t.mode == "lines"]
    assert len(lines) == 4 and "modeled" in fig.layout.title.text
    assert all(np.allclose(np.asarray(t.y, float), 0.0) for t in lines)  # ReaLB-m1: M_d = 0
    ep.balance = "none"
    rt = workbench.Runtime(embedded, max_new_tokens=3)
    res = rt.run(workbench.mixed_batch(3, text_share=0.34, seed=2), store=tmp_path / "m1.zarr",
                 ep_ranks=4, balance="realb-m1")
    ds = workbench.open_run(res.store)
    fig = realb_view_figure(ds, 1, "contiguous", "none")
    assert "recorded live (balance = realb-m1)" in fig.layout.title.text
    marks = [t for t in fig.data if t.name == "rank ran in low precision"]
    first = int(np.nonzero(~ds["pinned"].values)[0][0])  # the first offloaded layer's
    assert f"layer {first}" in fig.layout.title.text
    assert marks and len(marks[0].x) == int(ds["realb_low"].isel(layer=first).sum())
    share = next(t for t in ep_view_figure(ds, 4, "contiguous").data
                 if t.name and t.name.startswith("share of layer calls in nvfp4"))
    decided = ~np.isnan(ds["realb_m"].values[..., 0])
    np.testing.assert_allclose([float(x.split("%")[0]) / 100 for x in share.text],
                               ds["realb_low"].values[decided].mean(0), atol=0.006)
    # other ranks or placement than the run's: its decisions do not apply, no marks
    assert not any((t.name or "").startswith("share of layer calls")
                   for t in ep_view_figure(ds, 8, "contiguous").data)
    assert not any((t.name or "").startswith("share of layer calls")
                   for t in ep_view_figure(ds, 4, "round-robin").data)


def test_ep_views_follow_eplb_and_draw_its_rebalance_lane(embedded, tmp_path):
    """placement = eplb in the Expert parallel card: the EP view's loads are EPLB's plans with
    the card's window / interval / replicas, and the EP timeline shows a step that rebalances,
    its weight movement as the first lane (modeled)."""
    from workbench.ui.views import EPTimelineView, EPView

    rt = workbench.Runtime(embedded, max_new_tokens=8, ignore_eos=True)
    ws = tmp_path / "ws"
    rt.run(workbench.batch(4, seed=2), store=ws / "e.zarr", ep_ranks=4,
           target_model="qwen3-vl-30b-a3b")
    s = DataStore(workspace=ws)
    s.open("e")
    view, tl = EPView(s), EPTimelineView(s)
    ep = s.knobs.group("ep")
    ep.ep_ranks = 4
    ep.param.update(placement="eplb", eplb_window=2, eplb_interval=3, num_redundant_experts=4)
    full = workbench.open_run(ws / "e.zarr")
    ref = full.moe.eplb(redundant=4, window=2, interval=3)
    bars = [t for t in view.pane.object.data if t.type == "bar"]
    groups = int((ref.load.sum(-1) > 0).sum())
    np.testing.assert_allclose(sum(np.asarray(b.y, float) for b in bars),
                               ref.load.sum((0, 1)) / groups)
    assert "EPLB (4 replicas a layer, every 3 steps)" in view.pane.object.layout.title.text
    fig = tl.pane.object
    lane = [t for t in fig.data if t.name.startswith("EPLB rebalance")]
    assert lane and float(lane[0].x[0]) == pytest.approx(ref.rebalance_s[3] * 1e3)
    assert "step 3" in fig.layout.title.text and "EPLB rebalance" in fig.layout.title.text
    ep.num_redundant_experts = 3  # 64 + 3 is not a multiple of 4: said, not drawn
    assert "multiple of" in view.pane.object.layout.annotations[0].text


# -- MoE-Prism surface (issue 16 §5) -------------------------------------------------------------
@pytest.fixture(scope="module")
def prism_runs(embedded, tmp_path_factory):
    """A workspace with a run of the embedded model on sub-experts (a random refactoring,
    k_active = 2 of 4, a mixed batch of 2) and the same request on whole experts."""
    from workbench.prism import refactor as R

    root = tmp_path_factory.mktemp("prism")
    R.save(R.random_refactoring(embedded), root / "prism")
    rt = workbench.Runtime(embedded, max_new_tokens=4, ignore_eos=True)
    reqs = workbench.mixed_batch(2)
    rt.run(reqs, store=root / "ws" / "p.zarr", prism=True, prism_k_active=2,
           prism_refactoring=str(root / "prism"))
    rt.run(reqs, store=root / "ws" / "w.zarr")
    return root / "ws"


def test_elastic_experts_card_draws_the_shown_runs_subexperts(prism_runs):
    """The sub-expert heatmap is the store's counts at the chosen layer (each routed expert's
    column sums to k_active), under the tokens filter; the note gives the compute share; a run
    of whole experts hides the heatmap and says so."""
    from workbench.ui.prism import SubexpertView

    s = DataStore(workspace=prism_runs)
    s.open("p")
    view = SubexpertView(s)
    full = workbench.open_run(prism_runs / "p.zarr")

    def expected(layer: int, modality: str = "all") -> np.ndarray:
        c = full.moe.subexpert_counts(modality).isel(layer=layer).values.astype(float)
        tok = full.moe.expert_counts(modality).isel(layer=layer).values[:, None]
        with np.errstate(invalid="ignore"):
            return (c / np.where(tok > 0, tok, np.nan)).T  # [subexpert, expert]

    first = int(np.nonzero(~full["pinned"].values)[0][0])
    z = np.asarray(view.pane.object.data[0].z, float)
    np.testing.assert_allclose(z, expected(first), equal_nan=True)
    routed = ~np.isnan(z).all(0)
    assert routed.any() and np.allclose(z[:, routed].sum(0), 2)  # k_active of each expert
    L = full.sizes["layer"]
    assert (view.layer.value, view.layer.fixed_start, view.layer.fixed_end) == (first, 0, L - 1)
    assert view.pane.visible and f"layer {first}" in view.pane.object.layout.title.text
    assert "50.0%" in view.note.object and "k_active 2 of N = 4" in view.note.object
    n = view.redraws
    view.layer.value = 3
    assert view.redraws == n + 1 and "layer 3" in view.pane.object.layout.title.text
    np.testing.assert_allclose(np.asarray(view.pane.object.data[0].z, float), expected(3),
                               equal_nan=True)
    s.modality = "image"
    np.testing.assert_allclose(np.asarray(view.pane.object.data[0].z, float),
                               expected(3, "image"), equal_nan=True)
    assert not np.allclose(expected(3, "image"), expected(3), equal_nan=True)
    s.open("w")
    assert not view.pane.visible and view.layer.disabled
    assert "ran whole experts" in view.note.object


def test_the_operating_points_are_the_benchmarks_and_mark_the_next_k_active(
        prism_runs, embedded, tmp_path, monkeypatch):
    """The curve the dashboard ships is what bench_prism_points.py measured on the embedded
    model; the next run's k_active (the card's slider, the knob) is the star on the MoE-Prism
    curve; the shown run's compute share a dotted line; a broken file is refused naming it."""
    import importlib.util

    from workbench.ui.prism import (KActiveSlider, OperatingPointsView, operating_points,
                                    prism_knob_widgets)

    points = operating_points()
    bench_dir = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        spec = importlib.util.spec_from_file_location("bench_prism_points",
                                                      f"{bench_dir}/bench_prism_points.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(bench_dir)
    results = json.loads(Path(bench_dir, "results", "prism_points.json").read_text())
    assert points == json.loads(json.dumps(bench.shipped(results, embedded.model_id,
                                                         embedded.config_hash)))
    N = points["subexperts"]
    prism = {p["k"]: p for p in points["curves"]["prism"]}
    assert sorted(prism) == list(range(1, N + 1))

    s = DataStore(workspace=prism_runs)
    s.open("p")
    view = OperatingPointsView(s)
    slider = prism_knob_widgets(s, N)._wb_widgets["prism_k_active"]

    def star():
        t = [t for t in view.pane.object.data if t.name.startswith("next run")]
        assert len(t) == 1
        return float(t[0].x[0]), float(t[0].y[0]), t[0].name

    assert s.knobs.prism_k_active is None and slider.value == N
    assert star()[:2] == (1.0, prism[N]["accuracy"]) and "prism is off" in star()[2]
    s.knobs.set(prism=True)
    slider.value = 1
    assert s.knobs.prism_k_active == 1
    assert star() == (0.25, prism[1]["accuracy"], f"next run: k_active 1 (1/{N})")
    slider.value = N
    assert s.knobs.prism_k_active is None  # N: every sub-expert
    s.knobs.group("prism").prism_k_active = 3
    assert slider.value == 3 and star()[0] == 0.75
    assert [sh.x0 for sh in view.pane.object.layout.shapes] == [0.5]  # the shown run's share
    title = view.pane.object.layout.title.text
    assert "bench_prism_points.py" in title and f"n = {points['n']}" in title
    s.open("w")  # whole experts: no share line
    assert not view.pane.object.layout.shapes
    small = KActiveSlider(s, 2)  # whole experts shown, N = 2 given: at least the knob's 3
    assert (small.subexperts(), small.widget.fixed_end, small.widget.value) == (3, 3, 3)
    s.open("p")
    s.knobs.group("prism").prism_k_active = None
    assert (small.widget.fixed_end, small.widget.value) == (4, 4)  # the shown run's N

    bad = json.loads(json.dumps(points))
    bad["curves"]["prism"][0]["accuracy"] = 1.5
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(InputError, match=r"bad\.json.*curves\.prism\[0\].*bench_prism_points"):
        operating_points(tmp_path / "bad.json")
    monkeypatch.setattr("workbench.ui.prism._points_path", lambda: tmp_path / "bad.json")
    text = OperatingPointsView(s).pane.object.layout.annotations[0].text
    assert "bad.json" in text and "rerun benchmarks/bench_prism_points.py" in text


def test_scheduler_view_simulates_the_policies_on_a_modeled_cost_table(tmp_path):
    """The scheduler view's curves and table are the scheduler's simulation on the modeled
    cost table of the chosen profile (recomputed here); the rate, the policies and the profile
    redraw it; a batch size the table cannot price is said, not raised."""
    from workbench.prism import scheduler as S
    from workbench.prism.costs import CostTable
    from workbench.ui.prism import DEFAULT_TARGET, SchedulerView, full_batch_s

    s = DataStore(workspace=tmp_path / "ws")
    v = SchedulerView(s)
    table = CostTable.modeled(s.knobs.profile, DEFAULT_TARGET)
    np.testing.assert_array_equal(v.cost.decode_s, table.decode_s)
    k = v.knobs
    s_full = full_batch_s(table, k)
    assert k.rate == pytest.approx(k.batch_size / s_full, rel=0.05)
    assert k.ttft_slo_s == pytest.approx(s_full, rel=0.05)
    fig = v.pane.object
    assert fig.layout.meta["view"] == "scheduler" and "modeled" in fig.layout.title.text
    assert "<i>modeled</i>" in v.table.object
    curves = {t.name: t for t in fig.data}
    i = len(v.study.rates) - 1  # the highest rate: overloaded
    for p in S.available():
        m = S.simulate(table, k.copy(policy=p, rate=v.study.rates[i])).metrics()
        assert curves[f"{p} throughput"].y[i] == pytest.approx(m["throughput_rps"])
        assert curves[f"{p} goodput"].y[i] == pytest.approx(m["goodput_rps"])
        assert all(g <= t + 1e-9 for g, t in zip(curves[f"{p} goodput"].y,
                                                  curves[f"{p} throughput"].y))
        ttft = curves[f"{p} time to first token"]
        assert ttft.x[50] == pytest.approx(v.study.at[p]["ttft_s"]["p50"])
    gains = {p: v.study.sweep[p]["throughput_rps"][i] for p in S.available()}
    assert gains["prism"] > gains["fifo"]  # the dial: more served under overload
    n = v.redraws
    k.rate = 2.5 * k.rate
    assert v.redraws == n + 1 and f"at {k.rate:.3g} req/s" in v.pane.object.layout.annotations[1].text
    v.settings.policies = ["fifo"]
    assert {t.legendgroup for t in v.pane.object.data if t.legendgroup} == {"fifo"}
    v.settings.profile = "h200"
    assert v.cost.meta["profile"] == "h200" and "h200" in v.pane.object.layout.title.text
    k.batch_size = table.max_batch + 1
    assert f"1 … {table.max_batch}" in v.pane.object.layout.annotations[0].text


def test_scheduler_view_prices_with_the_shipped_measured_cost_table(tmp_path, monkeypatch):
    """Cost table "measured": the view re-prices with the package's measured CPU table (the
    embedded model's C(m, b)), says so — measured, the model, the measuring host's CPUs and the
    date — and disables the profile and target model; "modeled" brings the modeled one back. A
    shipped table that is missing is said in the view, not raised."""
    from workbench.prism import scheduler as S
    from workbench.ui import prism as P

    s = DataStore(workspace=tmp_path / "ws")
    v = P.SchedulerView(s)
    k = v.knobs
    modeled = (v.study.s_full, k.rate, v.cost.decode_s.copy())
    assert v.settings.cost_table == "modeled" and not v.choices["profile"].disabled
    assert "wb-scheduler-cost" in v.choices["cost_table"].css_classes
    v.choices["cost_table"].value = "measured"  # the widget drives the setting
    table = P.measured_cost_table()
    assert v.settings.cost_table == "measured" and v.cost is table
    assert v.study.table.clock == "measured"
    assert v.study.s_full == pytest.approx(P.full_batch_s(table, k))
    assert v.study.s_full != pytest.approx(modeled[0]) and k.rate != modeled[1]
    assert k.rate == pytest.approx(k.batch_size / v.study.s_full, rel=0.05)
    assert k.tpot_slo_s == pytest.approx(table.decode_s.max(), rel=0.05)  # B = 16: every cell
    assert v.choices["profile"].disabled and v.choices["target_model"].disabled
    host = table.meta["host"]
    note = v.table.object
    assert "<i>measured</i>" in note and "<i>modeled</i>" not in note
    assert f"{host['cpus']} CPUs" in note and f"{host['torch_threads']} torch thread" in note
    assert table.meta["date"] in note and table.meta["model_id"] in note
    title = v.pane.object.layout.title.text
    assert "cost table measured" in title and f"{host['cpus']} CPUs" in title
    m = S.simulate(table, k.copy(policy="fifo")).metrics()
    assert v.study.at["fifo"]["throughput_rps"] == pytest.approx(m["throughput_rps"])

    v.settings.cost_table = "modeled"
    assert v.study.table.clock == "modeled" and not v.choices["profile"].disabled
    np.testing.assert_array_equal(v.cost.decode_s, modeled[2])
    assert (v.study.s_full, k.rate) == pytest.approx(modeled[:2])
    assert "<i>modeled</i>" in v.table.object

    monkeypatch.setattr(P, "_cost_path", lambda: tmp_path / "gone.json")
    v.settings.cost_table = "measured"
    assert v.cost is None and v.study is None
    assert "gone.json" in v.table.object and "bench_prism_scheduler.py" in v.table.object
    assert "gone.json" in v.pane.object.layout.annotations[0].text
    v.settings.cost_table = "modeled"
    assert v.study.table.clock == "modeled"


def test_the_shipped_measured_cost_table_is_the_benchmarks():
    """``workbench/prism/cost_table_cpu.json`` (package data, what the dashboard reads) is a
    copy of ``benchmarks/results/prism_cost_cpu.json`` (what bench_prism_scheduler.py
    writes and BENCHMARKS.md reports): the two cannot drift apart silently; and an installed
    package carries it (pyproject's package data)."""
    import tomllib

    from workbench.prism.costs import CostTable
    from workbench.ui.prism import _cost_path, measured_cost_table

    repo = Path(__file__).resolve().parents[1]
    data = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "cost_table_cpu.json" in data["package-data"]["workbench.prism"]
    bench = CostTable.load(repo / "benchmarks" / "results" / "prism_cost_cpu.json")
    shipped = measured_cost_table()
    assert _cost_path().name == "cost_table_cpu.json" and shipped.clock == "measured"
    np.testing.assert_array_equal(shipped.decode_s, bench.decode_s)
    np.testing.assert_array_equal(shipped.prefill_s, bench.prefill_s)
    assert (shipped.sizes, shipped.prompt_tokens, shipped.meta) == \
        (bench.sizes, bench.prompt_tokens, bench.meta)


def test_a_batch_shows_every_answer_with_its_expected_one_and_the_baseline(embedded_dir,
                                                                           tmp_path):
    """A batch run's page lists every request's answer (issue 37 §5), not only the first: with
    its expected answer where known (the generated held-out requests and a demo request carry
    one), and — a baseline of the same batch pinned — which answers differ from it."""
    from workbench.ui.views import answer_view

    s = DataStore(workspace=tmp_path / "ws", model=str(embedded_dir))
    view = answer_view(s)
    shown = lambda: view.object() if callable(view.object) else str(view.object)  # noqa: E731
    s.use_demo(next(d for d in demo_inputs() if not d["image"]))  # a text demo: its answer known
    s.param.update(batch_size=3, batch_mix="text")
    first = s.prompt
    s.knobs.set(max_new_tokens=12)
    s.start_run(name="full")
    s.wait()
    assert not s.error, s.error
    rows = s.batch_answers(s.dataset)
    assert [r["prompt"] for r in rows][0] == first and len(rows) == 3
    assert all(r.get("expected") for r in rows)  # the demo's and the two generated ones
    page = shown()
    assert "data-testid='batch'" in page and "3 requests" in page
    assert page.count("data-match=") >= 3 and "differ from the baseline" not in page
    s.pin_baseline()
    s.knobs.set(max_new_tokens=2)  # cut short: the longer answers now differ
    s.start_run(name="short")
    s.wait()
    short = s.batch_answers(s.dataset)
    moved = sum(a["text"] != b["text"] for a, b in zip(short, rows))
    assert moved >= 1
    page = shown()
    assert f"{moved} differ from the baseline full.zarr" in page
    assert page.count("data-differs='true'") == moved
    assert page.count("data-match='false'") >= moved  # cut short: not the expected answer


def test_every_knob_widget_is_made_by_knob_param():
    """ARCHITECTURE.md: knob widgets set their knob only through the knob's check — no module
    of the dashboard builds a bare ``pn.Param`` (whose link sets a knob unchecked) but
    ``knob_param`` itself."""
    import re

    root = Path(__file__).resolve().parents[1]
    found = []
    for f in [*(root / "workbench" / "ui").glob("*.py"), root / "apps" / "dashboard.py"]:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"\bpn\.Param\(", line) and not line.lstrip().startswith(('"', "#")):
                found.append(f"{f.name}:{n}")
    assert found == ["widgets.py:" + str(next(
        n for n, line in enumerate((root / "workbench/ui/widgets.py").read_text().splitlines(), 1)
        if "panel = pn.Param(group, parameters=parameters" in line))], found


def test_dashboard_on_a_busy_port_names_it_and_the_way_out(capsys):
    """Issue 37 §8: ``workbench dashboard`` on a port in use says which, and ``--port 0``."""
    import socket

    from workbench.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["dashboard", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and "--port 0" in err, err


def test_a_file_the_browser_still_sends_refuses_run_until_the_server_has_it(tmp_path):
    """Run pressed right after a drop reaches the server before the upload's first chunk: the
    browser says a file is on its way (app.RUN_JS) and Run refuses — unless the server has had
    that file whole already (the browser's progress display lags the transfer)."""
    from workbench.errors import InputError

    s = DataStore(workspace=tmp_path / "ws")
    s.upload_on_its_way("mine.png")
    with pytest.raises(InputError, match="'mine.png' is still uploading"):
        s._check_start("q")
    s.upload_arriving("mine.png")
    s.upload_arriving(None)  # received whole
    s._check_start("q")
    s.upload_on_its_way("mine.png")
    s._check_start("q")  # the same file, had already: not refused
    s.upload_on_its_way("other.png")
    with pytest.raises(InputError, match="'other.png' is still uploading"):
        s._check_start("q")


def test_the_tick_queue_leaves_the_loop_idle_as_long_as_it_redrew():
    """Issue 37 §1: under load, redraws saturated the event loop and Stop waited 20-50 s. A
    served session's redraws now rest as long as each took before the next, and after a burst
    ``ready()`` stays False as long as the burst took (the poll then skips the store's new
    steps: frames dropped, the newest wins). Bokeh's document is replaced by a recorder of the
    two scheduling calls the queue makes."""
    import time

    from workbench.ui.views import TickQueue

    class Doc:
        def __init__(self):
            self.calls = []

        def add_next_tick_callback(self, fn):
            self.calls.append((0, fn))

        def add_timeout_callback(self, fn, ms):
            self.calls.append((ms, fn))

    q = TickQueue(Doc())
    drawn = []
    q.add(1, lambda: (time.sleep(0.3), drawn.append(1)))
    q.add(2, lambda: drawn.append("old 2"))
    q.add(2, lambda: (time.sleep(0.3), drawn.append(2)))  # asked again: redrawn once, newest
    assert not q.ready() and len(q.doc.calls) == 1
    ms, fn = q.doc.calls.pop(0)
    assert ms == 0
    fn()
    ms, fn = q.doc.calls.pop(0)
    assert ms >= 300  # the loop rests as long as the redraw took
    fn()
    assert drawn == [1, 2] and not q.doc.calls
    assert not q.ready()  # resting: ≥ 0.6 s of redraws in the burst
    # ready once the rest is over (however long the sleeps above took on a busy machine)
    time.sleep(max(0.0, q.rest_until - time.monotonic()) + 0.01)
    assert q.ready()


def test_the_tick_queue_reads_the_page_before_its_next_redraw():
    """Issue 37: a value typed as a run ended was said 1.2-4.6 s later and Run was heard 2.2 s
    after the click (a traced served session): Tornado reads the page's messages a few loop
    steps per frame, and a redraw queued for the next tick ran before every step. Now a
    redraw that is not urgent waits while the page has sent what the server has not handled
    (``page_waiting``), asking again at each loop step, never longer than the bound; a
    redraw that queues its own next slice while it runs is scheduled once, when it ends. ``page_waiting`` is
    asked of a real Tornado lock with a waiter and a real socket with unread bytes, shaped as
    Bokeh's session holds them."""
    import socket
    import time
    import weakref

    from bokeh.document import Document
    from tornado import locks
    from tornado.ioloop import IOLoop
    from tornado.iostream import IOStream

    from workbench.ui.views import TickQueue

    class Doc(Document):
        def __init__(self):
            super().__init__()
            self.calls = []

        def add_next_tick_callback(self, fn):
            self.calls.append((0, fn))

        def add_timeout_callback(self, fn, ms):
            self.calls.append((ms, fn))

    doc = Doc()
    q = TickQueue(doc)
    assert not q.page_waiting()  # outside a server: never
    q.rest_while = lambda: False  # a knob's or a run's end's redraws: no rests
    drawn = []

    def sliced():  # a redraw that queues its next slice while it runs (the replay view)
        drawn.append(len(drawn))
        if len(drawn) < 3:
            q.add(7, sliced)

    q.add(7, sliced)
    ms, fn = doc.calls.pop()
    assert ms == 0 and not doc.calls
    fn()
    assert drawn == [0] and doc.calls == [(0, q._one)]  # scheduled once, when it ended
    doc.calls.clear()

    # the session as Bokeh holds it: its document lock, and a connection's websocket stream
    a, b = socket.socketpair()
    loop = IOLoop(make_current=False)
    try:
        stream = IOStream(a)
        session = type("Session", (), {})()
        session._lock = locks.Lock()
        session._subscribed_connections = {type("Conn", (), {})()}
        conn = next(iter(session._subscribed_connections))
        conn._socket = type("Handler", (), {})()
        conn._socket.ws_connection = type("Ws", (), {"stream": stream})()
        ctx = type("Ctx", (), {"_session": session})()
        doc._session_context = weakref.ref(ctx)  # as Bokeh sets it
        assert doc.session_context._session is session and not q.page_waiting()

        b.send(b"\x81\x02{}")  # a frame from the page, not read yet
        assert q.page_waiting()
        q._one()
        assert drawn == [0]  # it waited for the page
        assert doc.calls == [(0, q._one)]  # asks again at the loop's next step
        doc.calls.clear()
        a.recv(64)  # read: nothing waits any more
        q._one()
        assert drawn == [0, 1] and doc.calls == [(0, q._one)]
        doc.calls.clear()

        session._lock.acquire()  # held (by this redraw) ...
        waiter = session._lock.acquire()  # ... and a message of the page waits for it
        assert q.page_waiting()
        q.PAGE_MAX_WAIT_S = 0.05  # a page that keeps talking still sees its redraws
        q._one()
        assert drawn == [0, 1]  # it waits for the page ...
        time.sleep(2 * q.PAGE_MAX_WAIT_S)
        q._one()
        assert drawn == [0, 1, 2] and not q.pending  # ... but not past the bound

        q.PAGE_MAX_WAIT_S = 3600.0
        q.add(9, lambda: drawn.append("urgent"), urgent=True)  # a first screen's view
        assert q.page_waiting()
        q._one()
        assert drawn[-1] == "urgent"  # what a click or a run waits for does not wait
        del waiter
    finally:
        stream.close()
        b.close()
        loop.close()


# -- the replay kernels' warm-up (workbench.ui.warm) ---------------------------------------------
_WARM_THEN_EVERY_VIEW = """
import gc, json, sys
from numba.core.dispatcher import Dispatcher
from workbench.replay import SCOPES
from workbench.ui.app import build_app
from workbench.ui.datastore import DataStore
from workbench.ui.warm_child import warm

def kernels():
    return [d for d in gc.get_objects() if isinstance(d, Dispatcher)]

def compiled():  # every (kernel, signature) this process has, compiled or loaded from the cache
    return {(f"{d.py_func.__module__}.{d.py_func.__qualname__}", str(sig))
            for d in kernels() for sig in d.overloads}

warm()
before = compiled()
s = DataStore(sys.argv[1])
app = build_app(s, preload=False)  # unserved: every view draws at once
s.open("a")
for v in app._wb_views.values():
    v.redraw()
for scope in SCOPES:
    s.replay_scope = scope
    assert len(s.replay_study().curves), scope
assert app._wb_views["scheduler"].study is not None
uncached = sorted({f"{d.py_func.__module__}.{d.py_func.__qualname__}" for d in kernels()
                   if d.overloads and type(d._cache).__name__ == "NullCache"})
print(json.dumps({"warmed": len(before), "new": sorted(compiled() - before),
                  "uncached": uncached}))
"""


def test_after_the_warm_up_the_dashboard_compiles_nothing(two_runs):
    """After an install numba's cache is empty; the warm-up child (a run of the embedded model,
    replayed as the view replays it, and the QoS scheduler view) fills it, so that every view
    of the dashboard on another model's run, the replay view's studies in every scope among
    them, compiles nothing (a compile on the event loop held the page 16-32 s). In one fresh
    process: after the child's work, drawing every view adds no (kernel, signature) to those
    the work compiled, and each of those kernels is cached on disk (``cache=True``), so a
    server's child fills the server's cache. (This needs no empty cache: a compile and a cache
    load add the same signature; the child's own cold compile is ~30 s of CPU.)"""
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_WARM_KERNELS"}
    check = subprocess.run([sys.executable, "-c", _WARM_THEN_EVERY_VIEW, two_runs.workspace],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert check.returncode == 0, check.stderr[-3000:]
    out = json.loads(check.stdout.strip().splitlines()[-1])
    assert "replay kernels (global)" in check.stdout and "(per-layer)" in check.stdout
    assert "scheduler kernels" in check.stdout
    assert out["warmed"] >= 5, out  # the replay and scheduler kernels, at least
    assert out["new"] == [], out["new"]  # what the views compiled that the child did not
    assert out["uncached"] == [], out["uncached"]  # compiled by the child, lost with it


def test_a_served_replay_view_waits_for_the_warm_up_instead_of_compiling(two_runs, tmp_path,
                                                                         monkeypatch):
    """Served, while the warm-up child runs the replay view draws a placeholder saying so and
    looks again on a timer, replaying nothing; once the child has ended it replays the same
    study as a view outside a server (a notebook), which never waits. The QoS scheduler view
    (its simulation compiles too) waits alike. One child per process."""
    from bokeh.document import Document
    from bokeh.server.callbacks import TimeoutCallback

    from workbench.ui import warm
    from workbench.ui.views import WARMING, TickQueue

    monkeypatch.setenv(warm.ENV, "1")
    release = tmp_path / "release"
    warm._reset()
    try:
        assert warm.start([sys.executable, "-c", "import os, time\n"
                           f"while not os.path.exists({str(release)!r}): time.sleep(0.02)"])
        assert not warm.start()  # once per process
        assert not warm.ready()
        s = DataStore(workspace=two_runs.workspace)
        s.open("a")
        free = ReplayView(s)  # outside a server: replays at once, warm-up or not
        assert free.study is not None and len(free.study.curves)

        s._replay_memo.clear()
        doc = Document()
        v = ReplayView(s)
        v._ticks = ticks = TickQueue(doc)
        v.redraw()
        assert v.study is None and v.message == WARMING
        assert WARMING[:40] in json.dumps(v.pane.object.to_plotly_json()["layout"])
        again = [cb for cb in doc.session_callbacks if isinstance(cb, TimeoutCallback)]
        assert len(again) == 1 and not ticks.pending
        again[0].callback()  # the timer: still warming, so a placeholder and a new timer
        while ticks.pending:
            ticks._one()
        assert v.study is None and v.message == WARMING

        from workbench.ui.prism import SchedulerView

        sched = SchedulerView(s, defer=True)
        sched._ticks = TickQueue(doc)  # as served
        sched.redraw()
        assert sched.study is None and sched.message == WARMING

        release.touch()
        deadline = time.time() + 120  # a hang catcher
        while not warm.ready():
            assert time.time() < deadline, "the warm-up child did not end"
            time.sleep(0.02)
        for cb in [cb for cb in doc.session_callbacks if isinstance(cb, TimeoutCallback)]:
            cb.callback()
        while ticks.pending:
            ticks._one()
        while sched._ticks.pending:
            sched._ticks._one()
        assert v.study is not None and v.study.curves.equals(free.study.curves)
        assert sched.study is not None and sched.message == ""
    finally:
        warm._reset()
