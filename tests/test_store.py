"""Run stores while they are written: readable from another process, and a SIGKILL loses only
what was never flushed."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import zarr

import workbench
from workbench.errors import StoreError
from workbench.telemetry.store import SCHEMA

WRITER = textwrap.dedent("""
    import sys, time, workbench
    workbench.set_options(flush_every=1)
    rt = workbench.Runtime(sys.argv[1], cache_slots=3, pinned_layers=1, max_new_tokens=200,
                           device="cpu")
    # slow each decode step down so that the parent sees the run in progress
    rt.run("stream me", store=sys.argv[2], on_token=lambda t, s: time.sleep(0.05))
""")


def _committed(path):
    try:
        return zarr.open_group(str(path), mode="r").attrs["committed"]["step"]
    except Exception:
        return 0


def test_live_read_then_sigkill_keeps_every_flushed_step(tiny_ckpt, tmp_path):
    store = tmp_path / "live.zarr"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tiny_ckpt()), str(store)],
                            stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while _committed(store) < 4:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.time() < deadline, "writer made no progress"
            time.sleep(0.05)
        live = workbench.open_run(store)  # another process reads during the run
        assert live.attrs["status"] == "running" and live.sizes["step"] >= 4
        seen = live.sizes["step"]
        live.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ds = workbench.open_run(store)
    n = ds.sizes["step"]
    # never closed: it was killed, and the reader sees that its writer is gone
    assert n >= seen and ds.attrs["status"] == "interrupted"
    # every committed step is whole: token and routing arrays agree with the step table
    assert int(ds.step_tokens.sum()) == ds.sizes["token"]
    assert (ds.token_step.values[-1] == n - 1)
    assert ((ds.hits + ds.misses).isel(layer=slice(1, None)).sum("layer") > 0).all()
    k = ds.sizes["k"]
    routed = ds.routed_tokens.sum(("expert", "modality"))
    np.testing.assert_array_equal(routed.values, (ds.step_tokens * k).values[:, None]
                                  .repeat(ds.sizes["layer"], 1))


def test_open_run_refuses_non_store(tmp_path):
    with pytest.raises(StoreError, match="does not exist or is not a zarr store"):
        workbench.open_run(tmp_path / "nothing")


def test_store_schema_attrs_and_consistency(tiny_ckpt, tmp_path):
    rt = workbench.Runtime(tiny_ckpt(), cache_slots=4, pinned_layers=1, max_new_tokens=5,
                           device="cpu")
    res = rt.run("consistency", store=tmp_path / "s.zarr")
    ds = workbench.open_run(res.store)
    assert set(SCHEMA) <= set(ds.data_vars)
    assert ds.attrs["status"] == "complete" and ds.attrs["workbench_version"]
    for knob, value in rt.knobs.to_dict().items():
        assert json.loads(ds.attrs[f"knob.{knob}"]) == value
    assert ds.attrs["config_hash"] == rt.lm.config_hash
    assert ds.attrs["hardware_profile"] == "a100-40gb"
    # the store's cache counters are the run result's: lookups of offloaded layers only; the
    # pinned layer's accesses are pinned_accesses (schema 4)
    offl = ~ds.pinned.values
    assert int(ds.hits.sum()) == res.hits and int(ds.misses.sum()) == res.misses
    assert (ds.hits.values[:, ~offl] == 0).all() and (ds.misses.values[:, ~offl] == 0).all()
    assert (ds.pinned_accesses.values[:, offl] == 0).all()
    assert (ds.pinned_accesses.values[:, ~offl] > 0).all()  # every step routes the pinned layer
    assert list(ds.generated_token.values) == res.token_ids
    assert ds.phase.values[0] == 0 and (ds.phase.values[1:] == 1).all()
    # measured spans tile each step: compute + stall == step latency
    meas = ds.span_clock == 0
    lane = ds.span_lane.where(meas, drop=True)
    dur = (ds.span_end_s - ds.span_start_s).where(meas, drop=True)
    step = ds.span_step.where(meas, drop=True)
    for s in range(ds.sizes["step"]):
        on_main = dur.where((step == s) & (lane != 1), drop=True).sum()
        assert float(on_main) == pytest.approx(float(ds.latency_measured_s[s]), rel=1e-6)
    # modeled latency is what the modeled compute lane adds up to
    mod = ds.span_clock == 1
    busy = (ds.span_end_s - ds.span_start_s).where(mod & (ds.span_lane != 1)).sum()
    assert float(busy) == pytest.approx(float(ds.latency_modeled_s.sum()), rel=1e-9)
    # residency: pinned layer always resident; never more cached experts than slots
    assert ds.resident.values[:, 0, :].all()
    assert (ds.resident.values[:, offl, :].sum(axis=(1, 2)) <= 4).all()


def test_a_failed_background_write_still_marks_the_store_failed(tmp_path):
    """The recorder writes on a thread: a write error surfaces at close, and the store is left
    with status 'failed' (never 'running', which readers take for a killed writer)."""
    from workbench.telemetry.events import StepEvent
    from workbench.telemetry.store import Recorder

    rec = Recorder(tmp_path / "r.zarr", 2, 4, 2, {}, [False, False], flush_every=1)

    def broken(events, publish):
        raise OSError("disk full (simulated)")

    rec._write_batch = broken
    ev = StepEvent(step=0, phase=0, token_ids=np.array([1]), modality=np.array([0], np.int8))
    rec.add(ev)  # submitted; fails on the writer thread
    with pytest.raises(StoreError, match="r.zarr': writing failed: disk full"):
        rec.close("complete")
    ds = workbench.open_run(tmp_path / "r.zarr")
    assert ds.attrs["status"] == "failed"
    assert "disk full" in ds.attrs["error"]
    assert ds.sizes["step"] == 0  # nothing unflushed is exposed


def test_an_array_folder_that_cannot_be_checked_is_an_error_not_a_missing_array(tmp_path,
                                                                               monkeypatch):
    """open_run asks every array folder whether its zarr.json is there with a plain stat
    (``reader._exists``): absent for ENOENT, ENOTDIR, EBADF, ELOOP and a NUL byte (as
    ``Path.exists`` up to Python 3.13); any other error (EACCES, EIO) is raised, so a store
    whose folder cannot be read is not taken for one missing that array."""
    import errno
    import os

    from workbench.telemetry import reader

    f = tmp_path / "zarr.json"
    assert not reader._exists(str(f)) and not reader._exists(str(tmp_path / "x\0y"))
    f.write_text("{}")
    assert reader._exists(str(f))
    assert not reader._exists(str(f / "below"))  # ENOTDIR
    stat = os.stat
    for code in (errno.EACCES, errno.EIO):
        def denied(p, *a, _code=code, **k):
            if str(p) == str(f):
                raise OSError(_code, os.strerror(_code), str(p))
            return stat(p, *a, **k)

        monkeypatch.setattr(reader.os, "stat", denied)
        with pytest.raises(OSError) as e:
            reader._exists(str(f))
        assert e.value.errno == code
        monkeypatch.setattr(reader.os, "stat", stat)
