"""Sweeps on a real Dask LocalCluster (two worker processes) over a tiny checkpoint."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import workbench
from workbench.analysis.sweep import SweepInput, open_summary, parse_grid, sweep
from workbench.errors import InputError, KnobError

INPUTS = [SweepInput.parse("hello sweep"), SweepInput.parse("another prompt")]


@pytest.fixture(scope="module")
def swept(tiny_ckpt, tmp_path_factory, dask_scheduler):
    out = tmp_path_factory.mktemp("sweep")
    grid = {"cache_slots": [2, 6], "pinned_layers": [0, 1, 9]}  # 9 > 3 layers: those fail
    ds = sweep(grid, INPUTS, out=out, model=tiny_ckpt(), scheduler=dask_scheduler, progress=False,
               knobs=workbench.Knobs(max_new_tokens=3, device="cpu"))
    return out, grid, ds


def test_summary_has_grid_dims_and_matches_each_point_store(swept):
    out, grid, ds = swept
    assert ds.hit_rate.dims == ("cache_slots", "pinned_layers", "input")
    assert ds.hit_rate.shape == (2, 3, 2)
    ok = ds.status.sel(pinned_layers=[0, 1])
    assert (ok == "complete").all()
    for slots in (2, 6):
        for pinned in (0, 1):
            for inp in ds.input.values:
                pt = ds.sel(cache_slots=slots, pinned_layers=pinned, input=inp)
                run = workbench.open_run(out / str(pt.store.values))
                assert json.loads(run.attrs["knob.cache_slots"]) == slots
                assert run.moe.hit_rate() == pytest.approx(float(pt.hit_rate))
    # more slots → at least as many hits for LRU on the same requests (stack property)
    h = ds.hits.sel(pinned_layers=0)
    assert (h.sel(cache_slots=6) >= h.sel(cache_slots=2)).all()
    assert open_summary(out).hit_rate.shape == (2, 3, 2)


def test_failed_points_are_recorded_and_do_not_stop_the_sweep(swept):
    _, _, ds = swept
    bad = ds.sel(pinned_layers=9)
    assert (bad.status == "failed").all()
    assert all("pinned_layers must be between 0 and 3" in e for e in bad.error.values.ravel())
    assert np.isnan(bad.hit_rate).all()


def test_rerun_skips_finished_points(swept, tiny_ckpt, dask_scheduler):
    out, grid, _ = swept
    metas = {p: p.stat().st_mtime_ns for p in (out / "points").glob("*.json")}
    complete = [p for p in metas if json.loads(p.read_text())["status"] == "complete"]
    ds = sweep(grid, INPUTS, out=out, model=tiny_ckpt(), scheduler=dask_scheduler, progress=False,
               knobs=workbench.Knobs(max_new_tokens=3, device="cpu"))
    for p in complete:  # untouched
        assert p.stat().st_mtime_ns == metas[p]
    assert int((ds.status == "complete").sum()) == len(complete)


def test_grid_parsing_validates_values():
    assert parse_grid(["cache_slots=4,8", "eviction=lru,lfu"]) == {
        "cache_slots": [4, 8], "eviction": ["lru", "lfu"]}
    with pytest.raises(KnobError, match="cache_slots must be at least 1, not 0"):
        parse_grid(["cache_slots=0,4"])
    with pytest.raises(KnobError, match="unknown knob"):
        parse_grid(["slots=4"])
    with pytest.raises(KnobError, match="at least one --grid"):
        parse_grid([])
    with pytest.raises(InputError, match="empty prompt"):
        SweepInput.parse("img.png|  ")


def test_ctrl_c_keeps_finished_points(tiny_ckpt, tmp_path):
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "workbench.cli", "sweep", "--model", str(tiny_ckpt()),
           "--grid", "cache_slots=" + ",".join(str(c) for c in range(2, 26)), "--grid", "eviction=lru,lfu,hotness",
           "--input", "interrupt me", "--out", str(out),
           "--workers", "1", "--set", "max_new_tokens=40", "--set", "device=cpu"]
    # SIGINT at its default in the child: a test run started in the background (nohup, `&`)
    # inherits an ignored SIGINT, and the sweep then never sees the Ctrl-C
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300  # catches a hang; the first point took > 120 s at load 16
    while not list((out / "points").glob("*.json")):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    finished = [json.loads(p.read_text()) for p in (out / "points").glob("*.json")]
    # 72 points: after the first one (model load included) a point takes a fraction of a second;
    # the SIGINT lands long before the last
    assert finished and len(finished) < 72
    for f in finished:
        assert f["status"] == "complete"
        assert workbench.open_run(out / "points" / f"{f['id']}.zarr").attrs["status"] == "complete"


def test_summary_is_a_tidy_table(swept):
    """A sweep summary as a tidy table: one row per point × input, the grid knobs and the input
    as columns beside the metrics (xarray's ``to_dataframe``), ready for pandas/seaborn."""
    out, grid, ds = swept
    df = open_summary(out).to_dataframe().reset_index()
    assert len(df) == 2 * 3 * 2
    assert {"cache_slots", "pinned_layers", "input", "hit_rate", "status"} <= set(df.columns)
    row = df[(df.cache_slots == 6) & (df.pinned_layers == 0)].iloc[0]
    assert row.hit_rate == pytest.approx(float(ds.hit_rate.sel(cache_slots=6, pinned_layers=0,
                                                               input=row.input)))


def test_default_inputs_decode_real_answers():
    """A sweep without inputs takes an image and a text-only demo request with multi-word
    answers (one-word answers leave a cache nothing to do: every point read 0)."""
    from workbench.analysis.sweep import demo_inputs
    from workbench.models.embedded.demo import read_demo

    answers = {(d["prompt"], d["image"]): d["answer"] for d in read_demo()}
    first, second = demo_inputs()
    assert first.images and not second.images
    for inp in (first, second):
        answer = answers[(inp.prompt, inp.images[0] if inp.images else None)]
        assert len(answer.split()) >= 3, (inp, answer)
    assert len(demo_inputs(5)) == 5 and len({i.name for i in demo_inputs(5)}) == 5


def test_a_text_only_model_sweeps_the_text_only_demos(tiny_ckpt, tmp_path, dask_scheduler):
    """Without inputs, a sweep of a text-only model takes text-only demo requests (the image
    demos would fail every point), and every point completes."""
    from workbench.analysis.sweep import demo_inputs

    assert all(not i.images for i in demo_inputs(2, text_only=True))
    ds = sweep({"cache_slots": [4]}, None, out=tmp_path / "s", model=tiny_ckpt(), scheduler=dask_scheduler,
               progress=False, knobs=workbench.Knobs(max_new_tokens=2, device="cpu"))
    assert ds.sizes["input"] == 2 and (ds.status == "complete").all()
