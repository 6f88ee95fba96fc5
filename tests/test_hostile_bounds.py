"""Issue 36 §4–6: bounds that bound memory, outputs checked before the work, one writer per
output folder, options that do nothing refused, compiled kernels cached once.

Real files, real subprocesses, the repo's embedded model; no mocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _py(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                          timeout=300)


# -- §6: the annealer is compiled once and its cache reused by later processes -----------------

def test_annealer_cache_is_reused_by_the_next_process(tmp_path):
    code = ("import numpy as np, json\n"
            "from workbench.prism import partition as P, anneal\n"
            "P.anneal(np.random.rand(6, 8), P.greedy(np.random.rand(6, 8), 4), 4, "
            "iterations=5)\n"
            "s = anneal.anneal_one.stats\n"
            "print(json.dumps([sum(s.cache_hits.values()), sum(s.cache_misses.values())]))\n")
    cache = tmp_path / "numba"
    first = _py(code, NUMBA_CACHE_DIR=str(cache))
    assert first.returncode == 0, first.stderr
    files = {p: p.stat().st_size for p in cache.rglob("*") if p.is_file()}
    assert files, "nothing was cached"
    second = _py(code, NUMBA_CACHE_DIR=str(cache))
    assert second.returncode == 0, second.stderr
    hits, misses = json.loads(second.stdout.splitlines()[-1])
    assert hits >= 1 and misses == 0, second.stdout
    # no new cache entries: the files (and the index) are as the first process left them
    assert {p: p.stat().st_size for p in cache.rglob("*") if p.is_file()} == files


# -- §5: outputs are checked before the work; blank paths refused -------------------------------

STORE = REPO / "tests" / "data" / "store_v3.zarr"


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from workbench.cli import main

    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.fixture
def bad_outs(tmp_path):
    """Output paths that cannot be written, each with what its message must say."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "file").write_text("keep me")
    return {str(tmp_path / "loop"): "symlink loop",
            str(tmp_path / "dangling"): "which does not exist",
            str(tmp_path / "file"): "is a file",
            "  ": "path is empty", "": "path is empty"}


@pytest.mark.parametrize("command", [
    ["refactor", "--iterations", "0", "--requests", "1"],
    ["calibrate-macs", "--requests", "2"],
    ["calibrate", "--steps", "1"],
])
def test_output_folders_are_checked_before_any_work(capsys, bad_outs, tmp_path, monkeypatch,
                                                    command):
    """A link loop, a dangling link, a file in the way or a blank name is refused by name before
    the model loads (``--model`` points nowhere: a refusal after the load would say so)."""
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for out, want in bad_outs.items():
        rc, err = _cli(capsys, *command, "--model", str(tmp_path / "no-model"), "--out", out)
        assert rc == 2 and want in err and "no-model" not in err, (out, err)
        assert err.count("\n") == 1 and "Traceback" not in err
    assert (tmp_path / "file").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == before  # nothing made, here or through a link


def test_sweep_out_link_loop_is_refused_before_any_point(capsys, tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    rc, err = _cli(capsys, "sweep", "--out", str(tmp_path / "loop"), "--grid", "cache_slots=1")
    assert rc == 2 and "symlink loop" in err, err


def test_export_refuses_blank_and_unusable_folders(bad_outs, tmp_path, monkeypatch):
    """``ds.moe.export('')`` wrote into the current folder; '  ' made an odd folder."""
    import workbench
    from workbench.errors import WorkbenchError

    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    ds = workbench.open_run(STORE)
    for out, want in bad_outs.items():
        with pytest.raises(WorkbenchError, match=want):
            ds.moe.export(out)
    assert sorted(os.listdir(tmp_path)) == before


# -- §6: one writer per output folder ----------------------------------------------------------

def _hold_lock(folder: Path, what: str) -> subprocess.Popen:
    """Another process holding the one-writer lock of ``folder`` (as a running refactor or
    calibrate-macs does) until its stdin closes."""
    code = ("import sys\n"
            "from workbench.telemetry.destination import writer_lock\n"
            f"with writer_lock({str(folder)!r}, {what!r}):\n"
            "    print('held', flush=True)\n"
            "    sys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.parametrize("command", [
    ["refactor", "--iterations", "0", "--requests", "1"],
    ["calibrate-macs", "--requests", "2"],
    ["calibrate", "--steps", "1", "--requests", "2"],
])
def test_a_second_writer_of_an_output_folder_is_refused(capsys, tmp_path, command):
    """Refused at once, before the model loads (``--model`` points nowhere: a refusal after
    the load would say so), and nothing of the first writer's is touched."""
    out = tmp_path / "out"
    other = _hold_lock(out, "folder")
    try:
        rc, err = _cli(capsys, *command, "--out", str(out), "--overwrite", "--model",
                       str(tmp_path / "no-model"))
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    assert rc == 2 and "being written by another process" in err and "exactly one writer" in err
    assert "no-model" not in err and not out.exists()


def test_save_folder_takes_the_lock_and_is_reentrant(tmp_path):
    """The shared writer refuses while another process holds the folder; the same thread that
    holds it (a command from its checks on) writes through it."""
    from workbench.errors import StoreBusyError
    from workbench.telemetry.destination import writer_lock
    from workbench.tensorfiles import save_folder

    out = tmp_path / "cal"
    args = (out, "w.safetensors", "c.json", {"x": np.zeros(3)}, {"format": "f"}, "f",
            "test folder")
    other = _hold_lock(out, "test folder")
    try:
        with pytest.raises(StoreBusyError, match="being written by another process"):
            save_folder(*args)
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    with writer_lock(out, "test folder"):
        save_folder(*args)
        save_folder(*args, overwrite=True)
    assert json.loads((out / "c.json").read_text()) == {"format": "f"}
    assert sorted(os.listdir(tmp_path)) == ["cal"]  # the lock file went with the lock


# -- §5: options that do nothing are refused, naming what they need ----------------------------

@pytest.mark.parametrize("argv, flag, needs", [
    (["run", "--prompt", "hi", "--batch-mix", "text"], "--batch-mix", "--batch"),
    (["run", "--prompt", "hi", "--batch-seed", "3"], "--batch-seed", "--batch"),
    (["run", "--input", "hi", "--batch-source", "demo"], "--batch-source", "--batch"),
    (["run", "--input", "hi", "--batch-mix", "image"], "--batch-mix", "--batch"),
    (["sweep", "--out", "S", "--batch-mix", "text"], "--batch-mix", "--batch"),
    (["sweep", "--out", "S", "--batch", "1", "--batch-mix", "text"], "--batch-mix", "--batch"),
    (["sweep", "--out", "S", "--workers", "1", "--scheduler", "tcp://127.0.0.1:9"],
     "--workers", "--scheduler"),
    (["refactor", "--input", "hi", "--requests", "3"], "--requests", "--input"),
    (["refactor", "--input", "hi", "--seed", "3"], "--seed", "--input"),
    (["calibrate", "--out", "P", "--prompt", "hi"], "--prompt", "--inputs"),
    (["calibrate", "--out", "P", "--inputs", "a.png", "--requests", "5"], "--requests",
     "--inputs"),
])
def test_options_that_do_nothing_are_refused(capsys, tmp_path, monkeypatch, argv, flag, needs):
    monkeypatch.chdir(tmp_path)
    rc, err = _cli(capsys, *argv, "--model", str(tmp_path / "no-model"))
    assert rc == 2 and f"{flag} " in err and needs in err and "no-model" not in err, err
    assert os.listdir(tmp_path) == []


# -- §5: compare_runs names a bad entry --------------------------------------------------------

@pytest.mark.parametrize("bad, fragment", [
    ("empty", "runs[1] is a Dataset that is not a run store's (it lacks dimension 'step'"),
    ("no-hits", "runs[1] is a Dataset that is not a run store's (it lacks 'hits'"),
    (5, "runs[1] is a int"),
    (None, "runs[1] is a NoneType"),
])
def test_compare_runs_names_a_bad_entry(bad, fragment):
    import xarray as xr

    import workbench
    from workbench.errors import InputError

    ds = workbench.open_run(STORE)
    entry = {"empty": xr.Dataset(), "no-hits": ds.drop_vars("hits")}.get(bad, bad)
    with pytest.raises(InputError) as e:
        workbench.compare_runs([STORE, entry])
    assert fragment in str(e.value), str(e.value)
    workbench.compare_runs([STORE, ds])  # a store and an opened store compare


# -- §5: a sweep whose points must all fail is refused before any point starts ------------------

@pytest.fixture(scope="module")
def tiny_refactoring(tiny_ckpt, tmp_path_factory):
    from workbench.models.loading import load
    from workbench.prism import refactor as R

    ckpt = tiny_ckpt("mixtral")
    lm = load(ckpt, device="cpu")
    out = tmp_path_factory.mktemp("prism") / "ref"
    from workbench.models.inputs import Request

    R.save(R.refactor(lm, [Request("a b c d", []), Request("e f g h", [])], iterations=10), out)
    return ckpt, lm, out


def test_model_dependent_prism_knobs_are_checked_when_the_runtime_is_made(tiny_refactoring):
    """prism_k beyond top-k × N, or prism without a refactoring, is refused by the Runtime's
    knob check (``workbench run`` and every sweep point before it starts), not at the first
    run's set-up."""
    from workbench.errors import InputError
    from workbench.knobs import Knobs
    from workbench.runtime.runtime import Runtime

    _, lm, ref = tiny_refactoring
    top_k = lm.layout.top_k
    with pytest.raises(InputError, match=rf"prism_k must be in 1 … {top_k * 4} .*not 99"):
        Runtime(lm, knobs=Knobs(prism=True, prism_refactoring=str(ref), prism_k=99))
    with pytest.raises(InputError, match="needs a MoE-Prism refactoring"):
        Runtime(lm, knobs=Knobs(prism=True, prism_refactoring=str(ref.parent / "none")))
    Runtime(lm, knobs=Knobs(prism=True, prism_refactoring=str(ref), prism_k=top_k * 4))


def test_a_sweep_of_points_that_must_fail_is_refused_before_it_starts(tiny_refactoring, capsys,
                                                                      tmp_path):
    ckpt, _, ref = tiny_refactoring
    rc, err = _cli(capsys, "sweep", "--model", str(ckpt), "--input", "hi", "--out",
                   str(tmp_path / "S"), "--grid", "prism_k=97,98,99", "--set", "prism=true",
                   "--set", f"prism_refactoring={ref}")
    assert rc == 2 and "every sweep point is refused before it runs" in err, err
    assert "prism_k must be in 1 …" in err and err.count("\n") == 1
    assert not (tmp_path / "S").exists()  # no point was started or recorded


def test_macs_dispatch_without_a_calibration_is_refused_up_front(embedded, tmp_path):
    from workbench.errors import InputError
    from workbench.knobs import Knobs
    from workbench.runtime.runtime import Runtime

    with pytest.raises(InputError, match="none"):
        Runtime(embedded, knobs=Knobs(dispatch="macs",
                                      macs_calibration=str(tmp_path / "none")))
    Runtime(embedded, knobs=Knobs(dispatch="macs", macs_dynamic_capacity=False,
                                  macs_reroute=False, macs_calibration=str(tmp_path / "none")))


# -- §5: a NaN in a refactoring file is named before any arithmetic warns ----------------------

@pytest.mark.parametrize("name, fragment", [
    ("perm", "perm must hold whole numbers (an integer dtype), not float64"),
    ("gates", "gates must hold whole numbers (an integer dtype), not float32"),
    ("tokens", "tokens must hold whole numbers"),
    ("objective_annealed", "objective_annealed must hold finite numbers"),
])
def test_nan_in_a_refactoring_is_refused_without_a_warning(tiny_refactoring, tmp_path, name,
                                                           fragment):
    import shutil
    import warnings

    from safetensors.numpy import load_file, save_file

    from workbench.errors import InputError
    from workbench.prism import refactor as R

    _, lm, ref = tiny_refactoring
    bad = tmp_path / "bad"
    shutil.copytree(ref, bad)
    t = load_file(str(bad / R.WEIGHTS))
    a = t[name].astype(np.float32 if name == "gates" else np.float64)
    a.reshape(-1)[0] = np.nan
    t[name] = a
    save_file(t, str(bad / R.WEIGHTS), metadata={"format": R.FORMAT})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's RuntimeWarning came before the error
        with pytest.raises(InputError) as e:
            R.load(bad, lm)
    assert fragment in str(e.value) and str(bad) in str(e.value)


# -- §4: the replay's memory estimate follows what is allocated ---------------------------------

def _routing_npy(path: Path, tokens: int, layers: int, experts: int, k: int) -> Path:
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((tokens, layers, experts)), -1)[..., :k].astype(np.int16)
    np.save(path, ids)
    return path


@pytest.mark.parametrize("lead", ["100", "256"])
def test_a_small_trace_with_a_long_prefetch_lead_replays_within_the_budget(capsys, tmp_path,
                                                                           lead):
    """40 tokens × 4 layers with prefetch_lead 100 was refused ("state would need 2.42 GiB";
    6.07 GiB at 256) and ran in 192 MB with the budget raised: a plan reaches only the step's
    last layer, and a chunk holds no more accesses than the trace."""
    p = _routing_npy(tmp_path / "small.npy", 40, 4, 16, 2)
    rc, err = _cli(capsys, "replay", str(p), "--set", "prefetch=oracle", "--set",
                   f"prefetch_lead={lead}", "--json")
    assert rc == 0, err


def test_replay_memory_estimate_is_close_to_what_is_allocated(tmp_path):
    import tracemalloc

    from workbench.knobs import Knobs
    from workbench.replay import as_trace, replay_trace
    from workbench.replay.engine import replay_bytes

    for shape, lead in (((40, 4, 16, 2), 256), ((3000, 12, 64, 4), 100)):
        trace = as_trace(_routing_npy(tmp_path / f"{shape[0]}.npy", *shape))
        # the default lane (demand-first) on the fast engine, whose estimate this is: its
        # pending-prefetch list and cancelled counts are allocated too
        knobs = Knobs().set(prefetch="oracle", prefetch_lead=lead, cache_slots=8)
        assert knobs.transfer_order == "demand-first"
        replay_trace(trace, knobs, belady=False)  # compiled before it is measured
        peaks = []
        for _ in range(3):  # tracemalloc counts every thread's allocations: the least of three
            tracemalloc.start()  # drops another thread's (a suite's worker has some)
            try:
                replay_trace(trace, knobs, belady=False)
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
        peak = min(peaks)
        est = replay_bytes(trace.compact_experts(), "fast", "lru", False, lead)
        assert peak / 2 <= est <= 4 * peak, (shape, lead, est, peak)


# -- §4: what a batch's images cost is bounded before any is decoded ---------------------------

def _png_claiming(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims ``width`` × ``height`` and that holds no pixel data: any
    attempt to decode it fails, so a refusal that names the pixel total came first."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    path.write_bytes(b"\x89PNG\r\n\x1a\n"
                     + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IEND", b""))
    return path


def test_a_batch_of_large_images_is_refused_before_decoding(embedded, tmp_path):
    from workbench.errors import InputError
    from workbench.models.inputs import (MAX_BATCH_PIXELS, MAX_IMAGE_PIXELS, Request,
                                         build_batch_inputs)

    big = _png_claiming(tmp_path / "big.png", 4096, 4096)  # every per-image bound is met
    n = MAX_BATCH_PIXELS // MAX_IMAGE_PIXELS + 1
    with pytest.raises(InputError) as e:
        build_batch_inputs(embedded, [Request("what shape?", [big]) for _ in range(n)])
    msg = str(e.value)
    assert f"{n * MAX_IMAGE_PIXELS:,} pixels in all" in msg and f"{MAX_BATCH_PIXELS:,}" in msg
    with pytest.raises(InputError, match="pixels in all"):  # one request, many images
        build_batch_inputs(embedded, [Request("what shape?", [big] * n)])


def test_cli_run_refuses_a_batch_of_large_images_before_the_model_loads(capsys, tmp_path):
    big = _png_claiming(tmp_path / "big.png", 4096, 4096)
    rc, err = _cli(capsys, "run", "--model", str(tmp_path / "no-model"), "--no-record",
                   *[a for _ in range(64) for a in ("--input", f"{big}|what shape?")])
    assert rc == 2 and "pixels in all" in err and "no-model" not in err, err


def test_out_of_memory_while_decoding_is_not_a_damaged_file(tmp_path):
    """A real MemoryError (the address space capped below what decoding a 4096² image needs)
    is reported as out of memory, not as "damaged or truncated PNG file"."""
    from PIL import Image

    p = tmp_path / "big.png"
    Image.new("RGB", (4096, 4096), (200, 10, 10)).save(p)
    code = ("import resource, sys\n"
            "from workbench.models.inputs import open_image\n"
            "from workbench.errors import InputError\n"
            "vm = [int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
            "if l.startswith('VmSize')][0]\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), vm + (24 << 20)))\n"
            "try:\n"
            f"    open_image({str(p)!r})\n"
            "except MemoryError:\n"
            "    print('MemoryError')\n"
            "except InputError as e:\n"
            "    print('InputError', e)\n")
    r = _py(code)
    assert r.stdout.strip() == "MemoryError", (r.stdout, r.stderr[-2000:])


def test_run_store_link_loop_is_named_as_a_loop(capsys, tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    rc, err = _cli(capsys, "run", "--prompt", "hi", "--model", str(tmp_path / "no-model"),
                   "--store", str(tmp_path / "loop"))
    assert rc == 2 and "store" in err and "is a symlink loop" in err, err


def test_cost_table_save_refuses_blank_paths_and_broken_links(tmp_path, monkeypatch):
    from workbench.errors import WorkbenchError
    from workbench.prism.costs import CostTable

    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    table = CostTable([[2.0, 3.0]], [[1.0, 1.0]], (2, 4), 1, "measured")
    for bad, want in (("", "path is empty"), ("  ", "path is empty"),
                      ("loop", "symlink loop"), ("dangling", "which does not exist"),
                      (".", "is a folder")):
        with pytest.raises(WorkbenchError, match=want):
            table.save(bad, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["dangling", "loop"]
    assert table.save("costs.json").is_file()


def test_a_sweep_of_replay_only_knobs_is_refused_before_any_model_loads(capsys, tmp_path,
                                                                        tiny_ckpt):
    """Knobs `workbench run` refuses before loading (a replay-only prefetcher) are refused for
    every sweep point before the model loads (the checkpoint's weights are cut short: loading
    it would fail with another error)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_ckpt(), model)
    for w in model.glob("*.safetensors"):
        data = w.read_bytes()
        w.write_bytes(data[:len(data) // 2])
    rc, err = _cli(capsys, "sweep", "--model", str(model), "--input", "hi",
                   "--out", str(tmp_path / "S"), "--grid", "prefetch=oracle")
    assert rc == 2 and "only trace replay can run it" in err, err
    assert not (tmp_path / "S").exists()


# -- re-probe: export-trace never replaces what is not a regular file -----------------------------

TRACE = REPO / "data" / "traces" / "embedded-batch4.jsonl"


def test_export_trace_never_replaces_a_device_fifo_or_its_source(capsys, tmp_path):
    fifo = tmp_path / "fifo.npy"
    os.mkfifo(fifo)
    dangling = tmp_path / "dangling.npy"
    dangling.symlink_to(tmp_path / "nowhere.npy")
    src = tmp_path / "src.jsonl"
    src.write_bytes(TRACE.read_bytes())
    cases = []
    null = tmp_path / "null"  # a device node of our own: a failing run must not replace /dev/null
    try:
        os.mknod(null, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        cases.append(((str(TRACE), "--out", str(null), "--format", "npy", "--overwrite"),
                      f"trace file {str(null)!r} is a device, not a regular file"))
    except (PermissionError, OSError):  # no CAP_MKNOD: the FIFO case stands for it
        pass
    cases += [
        ((str(TRACE), "--out", str(fifo), "--overwrite"), f"trace file {str(fifo)!r} is a FIFO"),
        ((str(TRACE), "--out", "", "--format", "npy"), "trace file path is blank ('')"),
        ((str(TRACE), "--out", "  ", "--format", "npy", "--overwrite"), "trace file path is blank ('  ')"),
        (("", "--out", str(tmp_path / "a.npy")), "trace path is blank ('')"),
        ((str(TRACE), "--out", str(dangling)), f"trace file {str(dangling)!r} is a symlink to"),
        ((str(src), "--out", str(src), "--overwrite"), "is the source"),
    ]
    for argv, fragment in cases:
        rc, err = _cli(capsys, "export-trace", *argv)
        assert rc == 2 and fragment in err and "Traceback" not in err, (argv, err)
    assert not null.exists() or null.is_char_device()
    assert fifo.is_fifo() and not (tmp_path / "nowhere.npy").exists() and not (tmp_path / "a.npy").exists()
    assert src.read_bytes() == TRACE.read_bytes()


@pytest.mark.parametrize("command", [["info"], ["run", "--prompt", "hi"], ["refactor", "--out", "x"],
                                     ["calibrate", "--out", "x"], ["calibrate-macs", "--out", "x"]])
def test_an_empty_model_is_refused_not_the_default(capsys, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    rc, err = _cli(capsys, *command, "--model", "")
    assert rc == 2 and "--model '' is blank" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, kind", [(["refactor"], "MoE-Prism refactoring"),
                                           (["calibrate-macs"], "MACS calibration")])
def test_refactor_and_macs_never_write_into_a_foreign_folder(capsys, tmp_path, command, kind):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    model = REPO / "data" / "qwen3-vl-moe-small"
    for out in (mine, model, STORE):
        before = sorted(p.name for p in out.iterdir())
        for extra in ([], ["--overwrite"]):
            rc, err = _cli(capsys, *command, "--out", str(out), *extra)
            assert rc == 2 and f"is not a {kind} folder (it holds" in err, (out, extra, err)
        assert sorted(p.name for p in out.iterdir()) == before
    rc, err = _cli(capsys, *command, "--out", str(mine))
    assert "(it holds 'notes.txt')" in err


def test_calibrate_inputs_are_checked_from_headers_not_all_decoded_up_front(tmp_path):
    # 60 × 3000² images were decoded and held at once (2.6 GB); now only their headers are
    # read, each is decoded when its request is served. A header-only PNG cannot be decoded,
    # so a parse that decoded would fail here.
    from workbench.predictor.calibrate import parse_inputs

    img = _png_claiming(tmp_path / "a.png", 3000, 3000)
    (tmp_path / "list.json").write_text(json.dumps([{"image": "a.png", "prompt": "p"}] * 30))
    got = parse_inputs([str(img)] * 30 + [str(tmp_path / "list.json")], "what?")
    assert len(got) == 60 and all(Path(i) == img for i, _ in got)


@pytest.mark.parametrize("value, ok", [('"x"', False), ("[1, \"2\"]", False), ("[]", False),
                                       ("-1", False), ("128", False), ("true", False),
                                       ("2", True), ("[2, 3]", True), ("null", True)])
def test_generation_config_token_ids_are_checked_with_the_folder(tiny_ckpt, tmp_path, value, ok):
    import shutil

    from workbench.errors import ModelLoadError
    from workbench.models.loading import check_model_dir

    folder = tmp_path / "m"
    shutil.copytree(tiny_ckpt(), folder)
    (folder / "generation_config.json").write_text(f'{{"eos_token_id": {value}}}')
    if ok:
        check_model_dir(folder)
        return
    with pytest.raises(ModelLoadError, match=r"generation_config.json: eos_token_id = .* is not a "
                                             r"token id: a whole number in 0 … 127"):
        check_model_dir(folder)


def test_a_tokenizer_that_cannot_encode_is_named_not_an_internal_error(tiny_ckpt, tmp_path, capsys):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_ckpt(), folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"]["vocab"].pop(tok["model"]["unk_token"])  # a WordLevel vocab without its [UNK]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    rc, err = _cli(capsys, "run", "--model", str(folder), "--prompt", "hi é", "--no-record",
                   "--set", "max_new_tokens=1")
    assert rc == 2 and "the tokenizer of model" in err and "cannot encode the prompt" in err, err
    assert str(folder) in err and "internal error" not in err


def test_a_model_calibration_that_is_not_a_regular_file_is_named_not_skipped(tmp_path):
    from workbench.errors import InputError
    from workbench.macs.calibration import default_path, load

    macs = tmp_path / "model" / "workbench" / "macs"
    macs.mkdir(parents=True)
    os.mkfifo(macs / "macs.json")
    path = default_path(tmp_path / "model", "no-such-config-hash-0123456789")
    assert path == macs
    with pytest.raises(InputError, match=r"macs\.json.* not a regular file"):
        load(path)
