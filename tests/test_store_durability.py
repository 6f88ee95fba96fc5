"""What a run store guarantees under crashes, full disks, concurrent writers and tampering.

Crashes are injected, not timed: :data:`workbench.telemetry.destination.FAULT_HOOK` is called
before every file-system step of the writer (and half way through every file's bytes). Inside the
hook the writer thread is paused, so what is on disk at that moment is exactly what a SIGKILL
there would leave; the tests check it then and there (and copy a sample of the instants to check
that the next writer recovers from them). A few real SIGKILLs at chosen steps and a real full
tmpfs confirm that the injected model of a crash is the real one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import workbench
from workbench.cli import main
from workbench.errors import StoreBusyError, StoreError, StoreExistsError
from workbench.telemetry import destination
from workbench.telemetry.events import IMAGE, TEXT, LayerEvent, Span, StepEvent
from workbench.telemetry.store import Recorder

L, E, K = 3, 6, 2
SMALL = {"step": 4, "token": 8, "span": 8}  # tiny capacities: every run grows every dim
PER_STEP = ("phase", "step_tokens", "latency_measured_s", "generated_token")
PER_STEP_LAYER = ("hits", "misses", "pinned_accesses", "loads", "evictions")


def _events(n: int, seed: int) -> list[StepEvent]:
    """``n`` deterministic steps (the seed makes two runs' data differ everywhere)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(n):
        T = 5 if step == 0 else 1
        mod = np.array([IMAGE] * 3 + [TEXT] * 2 if step == 0 else [TEXT], np.int8)
        layers = []
        for l in range(L):
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int16)
            uniq = sorted(set(ids.ravel().tolist()))
            cut = int(rng.integers(0, len(uniq) + 1))
            layers.append(LayerEvent(layer=l, pinned=l == 0, topk_ids=ids,
                                     topk_weights=rng.random(ids.shape).astype(np.float32),
                                     hits=uniq[:cut], misses=uniq[cut:]))
        spans = [Span(1, lane, step, lane, -1, step + 0.1 * lane, step + 0.1 * lane + 0.05)
                 for lane in range(3)]
        out.append(StepEvent(step=step, phase=0 if step == 0 else 1,
                             token_ids=rng.integers(0, 100, T), modality=mod, layers=layers,
                             spans=spans, latency_measured_s=float(rng.random()),
                             generated_token=int(rng.integers(0, 100))))
    return out


def _record(path: Path, events: list[StepEvent], overwrite: bool = False,
            flush_every: int = 3, status: str = "complete") -> None:
    rec = Recorder(path, L, E, K, attrs={"top_k": K, "label": "x"}, pinned=[True, False, False],
                   overwrite=overwrite, flush_every=flush_every, flush_interval_s=1e9,
                   capacity=SMALL)
    try:
        for ev in events:
            rec.add(ev)
    except BaseException:
        rec.close("failed", error="test")
        raise
    rec.close(status)


def _assert_prefix_of(ds, ref) -> None:
    """Every committed step of ``ds`` equals the same step of the finished ``ref``."""
    n = ds.sizes["step"]
    assert n <= ref.sizes["step"]
    got, want = ds.variables, ref.variables  # (each array read once, without a DataArray)
    for v in (*PER_STEP, *PER_STEP_LAYER):
        np.testing.assert_array_equal(got[v].values, want[v].values[:n], err_msg=v)
    t = int(got["step_tokens"].values.sum()) if n else 0
    assert ds.sizes["token"] == t
    np.testing.assert_array_equal(got["topk_ids"].values, want["topk_ids"].values[:t])
    np.testing.assert_array_equal(got["token_id"].values, want["token_id"].values[:t])
    s = ds.sizes["span"]
    assert s == 3 * n
    np.testing.assert_array_equal(got["span_start_s"].values, want["span_start_s"].values[:s])


#: the writer's temp file of ``NAME`` (zarr_files.atomic_write): ``.NAME.<pid>.tmp``
WRITER_TEMP = re.compile(r"\..+\.\d+\.tmp")


def _file_kind(store: Path, path: Path) -> str:
    """What the writer's step at ``path`` (or at its temp file) writes: the store's root
    document, an array's document, a chunk, or something else (a folder)."""
    name = path.name[1:].rsplit(".", 2)[0] if WRITER_TEMP.fullmatch(path.name) else path.name
    if name == "zarr.json":
        return "root document" if path.parent == store else "array document"
    return "chunk" if name.startswith("c.") else "other"


def _seen_by_a_reader(store: Path, temp_files: bool = True, bodies: bool = True
                      ) -> tuple | None:
    """All that :func:`workbench.open_run` of ``store`` can read: every entry under it, with its
    path, type and permissions, a link's target and a regular file's bytes (None: nothing at
    ``store``). The reader's outcome is a function of this alone (it reads no times, and the
    writer's pid, the one thing outside the tree it asks about, is this live process), so two
    crash instants with the same value leave a reader the same store: one full open checks both.
    ``temp_files=False``: without the writer's temp files (:data:`WRITER_TEMP`);
    ``bodies=False``: a file's inode, size and modification time instead of its bytes (no file
    is opened: a cheap check that no file was written or replaced)."""
    if not os.path.lexists(store):
        return None
    seen = []
    for folder, dirs, files in os.walk(store):  # (links to folders are listed, not followed)
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(folder, name)
            st = os.lstat(p)
            if not temp_files and stat.S_ISREG(st.st_mode) and WRITER_TEMP.fullmatch(name):
                continue
            if stat.S_ISREG(st.st_mode) and not bodies:
                body = (st.st_ino, st.st_size, st.st_mtime_ns)
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    body = f.read()
            else:
                body = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            seen.append((os.path.relpath(p, store), st.st_mode, body))
    return tuple(seen)


@pytest.fixture(scope="module")
def ref_stores(tmp_path_factory):
    """The paths of the finished stores of the two runs the crash tests record (A: 9 steps,
    seed 1; then B: 7 steps, seed 2, over it). Read-only: a test that writes over A copies it
    (a byte-for-byte copy is the store ``_record`` would write again, without its ~40 file
    steps per copy)."""
    d = tmp_path_factory.mktemp("refs")
    _record(d / "a.zarr", _events(9, seed=1))
    _record(d / "b.zarr", _events(7, seed=2))
    return d / "a.zarr", d / "b.zarr"


@pytest.fixture(scope="module")
def refs(ref_stores):
    """The finished stores of the two runs the crash tests record (A, then B over it), loaded."""
    return tuple(workbench.open_run(p).load() for p in ref_stores)


@pytest.fixture
def hook():
    """Install a fault hook for one test; always removed."""
    def install(fn):
        destination.FAULT_HOOK = fn
    yield install
    destination.FAULT_HOOK = None


def _leftovers(folder: Path) -> list[str]:
    """Temp files, staging or old folders, or lock files a finished writer should not leave."""
    bad = []
    for p in folder.rglob("*"):
        n = p.name
        if (n.startswith(".") and n.endswith(".tmp")) or ".staging-" in n or ".old-" in n \
                or n.endswith(".lock") or n == ".reserve":
            bad.append(str(p.relative_to(folder)))
    return bad


@contextlib.contextmanager
def _tmpfs(mnt: Path, options: str):
    """A real tmpfs at ``mnt`` (small, or read-only) for the test's duration; skips the test
    where mounting is not permitted."""
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here (needs root and mount permission)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# -- a crash at every file-system step -----------------------------------------------------------
def test_a_crash_at_any_step_of_a_new_store_leaves_committed_steps_readable(tmp_path, refs,
                                                                          hook):
    ref_a, _ = refs
    store = tmp_path / "run.zarr"
    seen, problems, ops = [], [], []
    # Every file the writer replaces goes through a temp file (zarr_files.atomic_write): at its
    # "write" and "replace" steps the store is the one its "open" step saw (fully opened there)
    # plus that temp file, which a reader skips. Those instants are compared with the last one
    # opened (_seen_by_a_reader without temp files: the same entries, each the same inode, size
    # and modification time) and counted as it was; a full open still runs at the first such
    # instant of each kind of step and file (root document, array document, chunk) and at every
    # 5th, so a reader that tripped over a temp file (empty, half or whole) still fails here.
    last: dict = {"seen": (), "steps": None, "opened": 0, "kinds": set()}

    def at_step(op, path):
        ops.append(op)
        if not store.exists():  # not yet published: nothing may be at the path
            seen.append(None)
            return
        now = _seen_by_a_reader(store, temp_files=False, bodies=False)
        kind = (op, _file_kind(store, path))
        if (now == last["seen"] and last["steps"] is not None and kind in last["kinds"]
                and len(ops) % 5):
            seen.append(last["steps"])
            return
        last["kinds"].add(kind)
        last.update(seen=now, steps=None, opened=last["opened"] + 1)
        try:
            ds = workbench.open_run(store)
            _assert_prefix_of(ds, ref_a)
            seen.append(ds.sizes["step"])
            last["steps"] = seen[-1]
        except Exception as e:  # collected: raising here would be an injected fault
            problems.append(f"{len(ops)} {op} {path.name}: {type(e).__name__}: {e}")

    hook(at_step)
    _record(store, _events(9, seed=1))
    hook(None)
    assert not problems, problems[:5]
    # the run grew every dim twice and trimmed at the end: those steps were all crash points
    assert ops.count("replace") > 50 and "publish" in ops and "unlink" in ops
    assert seen[0] is None and seen[-1] == 9
    assert sorted(set(s for s in seen if s is not None)) == [0, 3, 6, 9]
    # every instant after publishing was checked; about half of them by a full open
    assert len(seen) == len(ops) and 300 < last["opened"] < ops.count("open") + 100
    assert {k for _, k in last["kinds"]} >= {"root document", "array document", "chunk"}
    assert workbench.open_run(store).attrs["status"] == "complete"
    assert _leftovers(tmp_path) == []


def test_a_crash_at_any_step_of_an_overwrite_leaves_the_old_or_the_new_store(tmp_path, refs,
                                                                             hook):
    ref_a, ref_b = refs
    store = tmp_path / "run.zarr"
    _record(store, _events(9, seed=1))
    problems, which, snaps = [], [], []
    # the writer stages the new run beside the old store, which stays as it was until the
    # exchange: a crash instant whose store reads the same as the last one opened (every entry,
    # byte for byte: _seen_by_a_reader) gives the same outcome, so it is counted, not re-opened
    last: dict = {"seen": (), "which": None, "opened": 0}

    def at_step(op, path):
        seen = _seen_by_a_reader(store)
        if seen == last["seen"] and last["which"] is not None:
            which.append(last["which"])
        else:
            last.update(seen=seen, which=None, opened=last["opened"] + 1)
            try:
                ds = workbench.open_run(store)
                if ds.attrs["status"] == "complete" and ds.sizes["step"] == 9:
                    _assert_prefix_of(ds, ref_a)
                    which.append("old")
                else:
                    assert ds.attrs["status"] == "complete" and ds.sizes["step"] == 7
                    _assert_prefix_of(ds, ref_b)
                    which.append("new")
                last["which"] = which[-1]
            except Exception as e:
                problems.append(f"{len(which)} {op} {path.name}: {type(e).__name__}: {e}")
        if len(which) % 17 == 0 or op in ("exchange", "drop-old"):
            dst = tmp_path / "snaps" / f"{len(snaps):03d}"
            shutil.copytree(tmp_path, dst, ignore=shutil.ignore_patterns("snaps"))
            snaps.append(dst)

    hook(at_step)
    _record(store, _events(7, seed=2), overwrite=True)
    hook(None)
    assert not problems, problems[:5]
    # readers saw the old store until the exchange, then the new one, never anything else
    assert which[0] == "old" and which[-1] == "new"
    assert which == sorted(which, key=lambda w: w == "new")
    assert len(which) > 500 and last["opened"] >= 2  # every instant checked; both stores opened
    assert _leftovers(tmp_path / "snaps") != []  # the snapshots did catch a writer mid-way
    # the next writer of a crashed path cleans up after it and writes normally
    for snap in snaps:
        _record(snap / "run.zarr", _events(2, seed=3), overwrite=True)
        assert workbench.open_run(snap / "run.zarr").sizes["step"] == 2
        assert _leftovers(snap) == [], snap


def test_recovery_puts_back_an_old_store_left_between_two_renames(tmp_path, refs):
    """Where the file system cannot exchange two folders, a replace is two renames; a crash
    between them leaves the old store in a hidden sibling, which the next writer restores."""
    ref_a, _ = refs
    store = tmp_path / "run.zarr"
    _record(store, _events(9, seed=1))
    os.rename(store, tmp_path / ".run.zarr.old-1-abcd")
    (tmp_path / ".run.zarr.staging-1-abcd").mkdir()  # the new run, never published
    with pytest.raises(StoreExistsError):  # the old store is back, so this is not a new path
        _record(store, _events(2, seed=3))
    _assert_prefix_of(workbench.open_run(store), ref_a)
    assert workbench.open_run(store).sizes["step"] == 9
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["publish", "grow", "trim", "exchange"])
def test_a_real_sigkill_at_a_chosen_step(tmp_path, where):
    """A real SIGKILL of the writer process at a chosen step (the injected model above assumes
    that what is on disk then is all a crash leaves; this checks it with the real signal)."""
    store = tmp_path / "run.zarr"
    if where == "exchange":
        _record(store, _events(9, seed=1))
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from workbench.telemetry import destination
        import test_store_durability as t
        # 'phase/zarr.json' is replaced at the layout, at each growth (4 -> 8 -> 16 rows)
        # and at the trim: kill at the 2nd (a growth) or the 4th (the trim)
        state = {{"n": 0}}
        def kill(op, path):
            if path.name == "zarr.json" and path.parent.name == "phase" and op == "replace":
                state["n"] += 1
                if ({where!r}, state["n"]) in (("grow", 2), ("trim", 4)):
                    os.kill(os.getpid(), signal.SIGKILL)
            if op == {where!r}:
                os.kill(os.getpid(), signal.SIGKILL)
        destination.FAULT_HOOK = kill
        t._record(t.Path(sys.argv[1]), t._events(9 if {where!r} != "exchange" else 7, seed=2),
                  overwrite={where == "exchange"})
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(store)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    if where == "publish":
        assert not store.exists()  # killed before the store appeared: nothing half laid out
    else:
        ds = workbench.open_run(store)
        assert ds.attrs["status"] in ("interrupted", "complete")
        if where == "exchange":
            assert ds.sizes["step"] == 9 and ds.attrs["status"] == "complete"  # the old store
        else:
            assert ds.attrs["status"] == "interrupted" and ds.sizes["step"] in (3, 6, 9)
    _record(store, _events(2, seed=3), overwrite=True)  # the next writer recovers
    assert workbench.open_run(store).sizes["step"] == 2
    assert _leftovers(tmp_path) == []


def test_a_reader_in_another_process_never_fails_while_the_store_grows(tmp_path):
    """The probe's 1 failure in 402 ``open_run`` calls came from reading while arrays grew; a
    reader process now polls a writer that grows every dim many times, and no read fails."""
    store = tmp_path / "run.zarr"
    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time, json, workbench
        from pathlib import Path
        store, stop = Path(sys.argv[1]), Path(sys.argv[2])
        reads, errors, sizes = 0, [], set()
        while not stop.exists():
            if (store / "zarr.json").exists():
                try:
                    ds = workbench.open_run(store).load()
                    assert int(ds.step_tokens.sum()) == ds.sizes["token"]
                    assert ds.sizes["span"] == 3 * ds.sizes["step"]
                    reads += 1
                    sizes.add(ds.sizes["step"])
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
        print(json.dumps({"reads": reads, "errors": errors[:3], "sizes": len(sizes)}))
    """), str(store), str(tmp_path / "stop")], stdout=subprocess.PIPE, text=True)
    import time

    time.sleep(1.0)  # let the reader import
    rec = Recorder(store, L, E, K, attrs={}, pinned=[True, False, False], flush_every=1,
                   flush_interval_s=0, capacity={"step": 1, "token": 1, "span": 1})
    for ev in _events(120, seed=5):
        rec.add(ev)
        time.sleep(0.005)
    rec.close()
    (tmp_path / "stop").touch()
    out = json.loads(reader.communicate(timeout=60)[0])
    assert out["errors"] == [] and out["reads"] >= 20 and out["sizes"] >= 5, out


# -- a full disk -----------------------------------------------------------------------------------
def _count_steps(store: Path, events, overwrite=False) -> int:
    calls = []
    destination.FAULT_HOOK = lambda op, path: calls.append(op)
    try:
        _record(store, events, overwrite=overwrite)
    finally:
        destination.FAULT_HOOK = None
    return len(calls)


@pytest.mark.parametrize("overwrite", [False, True])
def test_disk_full_at_any_step_fails_cleanly(tmp_path, ref_stores, refs, hook, overwrite):
    ref_a, ref_b = refs
    events = _events(7, seed=2)
    probe = tmp_path / "probe"
    probe.mkdir()
    if overwrite:  # the old store: run A as _record writes it
        shutil.copytree(ref_stores[0], probe / "run.zarr")
    n = _count_steps(probe / "run.zarr", events, overwrite=overwrite)
    tried = 0
    for at in sorted(set(np.linspace(1, n, 40).astype(int))):
        d = tmp_path / f"at{at}"
        d.mkdir()
        store = d / "run.zarr"
        if overwrite:
            shutil.copytree(ref_stores[0], store)
        count = {"n": 0}

        def full(op, path, at=at):
            count["n"] += 1
            if count["n"] == at:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))

        hook(full)
        try:
            _record(store, events, overwrite=overwrite)
            raised = None
        except StoreError as e:
            raised = str(e)
        hook(None)
        tried += 1
        assert _leftovers(d) == [], (at, _leftovers(d))
        if raised is None:  # only a failure to delete the replaced copy is not the run's
            ds = workbench.open_run(store)
            assert overwrite and ds.attrs["status"] == "complete" and ds.sizes["step"] == 7
            continue
        assert re.search(r"run\.zarr'.*No space left on device", raised), raised
        if overwrite:  # the old store is untouched
            ds = workbench.open_run(store)
            assert ds.attrs["status"] == "complete" and ds.sizes["step"] == 9
            _assert_prefix_of(ds, ref_a)
        elif store.exists():  # published before the disk filled: failed, committed readable
            ds = workbench.open_run(store)
            assert ds.attrs["status"] == "failed" and "No space left" in ds.attrs["error"]
            _assert_prefix_of(ds, ref_b)
    assert tried >= 30


def test_a_real_full_disk_on_the_cli(tmp_path):
    """A real tmpfs that fills up mid-run: exit 2, one line, status failed, steps readable."""
    # 960 KiB: the layout fits and a few batches commit before the disk is full
    with _tmpfs(tmp_path / "small", "size=960k") as mnt:
        store = mnt / "run.zarr"
        proc = subprocess.run(
            [sys.executable, "-m", "workbench.cli", "run",  # the embedded model
             "--prompt", "fill the disk", "--store", str(store), "--max-new-tokens", "240",
             "--set", "ignore_eos=true", "--set", "device=cpu"],
            capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        err = proc.stderr.strip().splitlines()[-1]
        assert err.startswith("workbench: error:") and "No space left on device" in err
        assert str(store) in err
        ds = workbench.open_run(store)
        assert ds.attrs["status"] == "failed" and 0 < ds.sizes["step"] < 240
        assert int(ds.step_tokens.sum()) == ds.sizes["token"]  # committed steps are whole
        assert (ds.hits + ds.misses).isel(layer=slice(1, None)).sum().item() > 0
        assert _leftovers(mnt) == []


# -- one writer ----------------------------------------------------------------------------------
def test_a_second_writer_of_the_same_store_is_refused(tmp_path, refs):
    ref_a, _ = refs
    store = tmp_path / "run.zarr"
    first = Recorder(store, L, E, K, attrs={}, pinned=[True, False, False], flush_every=1,
                     capacity=SMALL)
    try:
        for overwrite in (False, True):
            with pytest.raises(StoreBusyError, match=rf"pid {os.getpid()}.*exactly one writer"):
                Recorder(store, L, E, K, attrs={}, pinned=[True, False, False],
                         overwrite=overwrite)
        for ev in _events(9, seed=1):
            first.add(ev)
    finally:
        first.close()
    ds = workbench.open_run(store)
    assert ds.attrs["status"] == "complete"
    _assert_prefix_of(ds, ref_a)
    assert ds.sizes["step"] == 9
    assert _leftovers(tmp_path) == []


HOLD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[3])
    import test_store_durability as t
    rec = t.Recorder(t.Path(sys.argv[1]), t.L, t.E, t.K, attrs={}, pinned=[True, False, False],
                     overwrite=True, flush_every=1, capacity=t.SMALL)
    for ev in t._events(9, seed=1):
        rec.add(ev)
    rec.flush()
    open(sys.argv[2], "w").close()  # tell the test the lock is held
    # held until the test has tried its writer (it says so by creating argv[4]); the deadline
    # only ends a holder whose test died
    deadline = time.time() + 120
    while not os.path.exists(sys.argv[4]) and time.time() < deadline:
        time.sleep(0.02)
    rec.close()
""")


def test_two_cli_writers_with_overwrite_never_mix(tmp_path, tiny_ckpt, refs, capsys):
    ref_a, _ = refs
    store = tmp_path / "run.zarr"
    _record(store, _events(7, seed=2))
    ready, release = tmp_path / "ready", tmp_path / "release"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(store), str(ready),
                               str(Path(__file__).parent), str(release)])
    try:
        for _ in range(300):
            if ready.exists():
                break
            assert holder.poll() is None
            import time

            time.sleep(0.05)
        rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--store", str(store),
                   "--overwrite", "--set", "device=cpu"])
        err = capsys.readouterr().err
        assert rc == 2 and f"pid {holder.pid}" in err and "one writer" in err
    finally:
        release.touch()  # the holder closes its run only now: it held the lock throughout
        holder.wait(timeout=60)
    ds = workbench.open_run(store)  # the holder's run, whole and alone
    assert ds.attrs["status"] == "complete" and ds.sizes["step"] == 9
    _assert_prefix_of(ds, ref_a)


# -- what --overwrite may delete ---------------------------------------------------------------
@pytest.mark.parametrize("extra", ["notes.txt", "subdir/", "hits/notes.txt", "zarr.json:foreign",
                                   "link"])
def test_overwrite_only_replaces_a_provable_run_store(tmp_path, extra):
    store = tmp_path / "run.zarr"
    _record(store, _events(3, seed=1))
    if extra == "notes.txt":
        (store / "notes.txt").write_text("keep me")
    elif extra == "subdir/":
        (store / "mine").mkdir()
    elif extra == "hits/notes.txt":
        (store / "hits" / "notes.txt").write_text("keep me")
    elif extra == "zarr.json:foreign":
        (store / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group",
                                                     "attributes": {"owner": "someone"}}))
    else:
        (store / "other").symlink_to(tmp_path)
    before = sorted(str(p) for p in store.rglob("*"))
    with pytest.raises(StoreError, match="not a workbench run store.*refusing to delete"):
        _record(store, _events(2, seed=2), overwrite=True)
    assert sorted(str(p) for p in store.rglob("*")) == before  # nothing touched


def test_overwrite_of_a_failed_run_keeps_the_old_store(tmp_path, tiny_ckpt, refs):
    """A run that fails after its store was claimed leaves the old store exactly as it was."""
    store = tmp_path / "run.zarr"
    rt = workbench.Runtime(tiny_ckpt(), cache_slots=4, pinned_layers=1, max_new_tokens=6,
                           device="cpu")
    old = rt.run("the old one", store=store)
    before = workbench.open_run(store).load()

    def boom(tok, text):
        if len(text) > 0:
            raise RuntimeError("the run failed mid-way")

    with pytest.raises(RuntimeError, match="mid-way"):
        rt.run("the new one", store=store, overwrite=True, on_token=boom)
    after = workbench.open_run(store).load()
    assert after.attrs["prompt"] == "the old one" and after.attrs["status"] == "complete"
    assert list(after.generated_token.values) == old.token_ids
    import xarray as xr

    xr.testing.assert_identical(before, after)
    assert _leftovers(tmp_path) == []


def test_an_empty_or_half_laid_out_folder_does_not_block_a_run(tmp_path, tiny_ckpt):
    """A folder left empty (or holding only store arrays, no root document) by an old crash:
    an empty one is simply used; a half-laid-out store may be overwritten."""
    rt = workbench.Runtime(tiny_ckpt(), cache_slots=4, pinned_layers=1, max_new_tokens=2,
                           device="cpu")
    empty = tmp_path / "empty.zarr"
    empty.mkdir()
    rt.run("x", store=empty)
    assert workbench.open_run(empty).attrs["status"] == "complete"
    half = tmp_path / "half.zarr"
    (half / "hits").mkdir(parents=True)
    (half / "hits" / "zarr.json").write_text("{}")
    with pytest.raises(StoreExistsError):
        rt.run("x", store=half)
    rt.run("x", store=half, overwrite=True)
    assert workbench.open_run(half).attrs["status"] == "complete"


# -- store paths, checked before the model loads ------------------------------------------------
def _run_cli(capsys, store: str, *extra: str, model: str = "/nonexistent/model") -> str:
    """The store is checked first: with a model path that does not exist, a store error proves
    the check ran before the model load."""
    rc = main(["run", "--model", model, "--prompt", "x", "--store", store, *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


def test_store_paths_that_cannot_be_written_are_refused_first(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "store path is empty" in _run_cli(capsys, "")
    assert "is a file, not a folder" in _run_cli(capsys, str(afile / "run.zarr"))
    assert "exists and is not a folder" in _run_cli(capsys, str(afile), "--overwrite")
    assert "cannot create files in '/proc'" in _run_cli(capsys, "/proc/run.zarr")
    dangling = tmp_path / "dangling.zarr"
    dangling.symlink_to(tmp_path / "nowhere")
    assert "symlink to" in _run_cli(capsys, str(dangling))
    assert not (tmp_path / "nowhere").exists()


def test_a_read_only_location_is_refused_before_the_model_loads(tmp_path, capsys):
    with _tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        err = _run_cli(capsys, str(ro / "run.zarr"))
        assert "cannot create files in" in err and "Read-only file system" in err


def test_a_symlinked_store_is_replaced_through_its_link(tmp_path):
    real = tmp_path / "real.zarr"
    _record(real, _events(3, seed=1))
    link = tmp_path / "link.zarr"
    link.symlink_to(real)
    _record(link, _events(5, seed=2), overwrite=True)
    assert link.is_symlink() and workbench.open_run(link).sizes["step"] == 5
    assert workbench.open_run(real).sizes["step"] == 5
    assert _leftovers(tmp_path) == []


# -- tampered stores: a message naming the store, never wrong numbers -------------------------
def _set(store: Path, rel: str, fn) -> None:
    p = store / rel
    doc = json.loads(p.read_text())
    fn(doc)
    p.write_text(json.dumps(doc))


def _attr(name, value):
    def fn(doc):
        if value is _DEL:
            doc["attributes"].pop(name, None)
        else:
            doc["attributes"][name] = value
    return fn


_DEL = object()
TAMPER = {
    "root zarr.json deleted": lambda s: (s / "zarr.json").unlink(),
    "root zarr.json garbage": lambda s: (s / "zarr.json").write_bytes(b"\x00\xffgarbage"),
    "root zarr.json truncated": lambda s: (s / "zarr.json").write_bytes(
        (s / "zarr.json").read_bytes()[:40]),
    "root zarr.json a list": lambda s: (s / "zarr.json").write_text("[1, 2]"),
    "root zarr.json deeply nested": lambda s: (s / "zarr.json").write_text("[" * 100000),
    "root zarr.json not UTF-8": lambda s: (s / "zarr.json").write_bytes(b'{"a": "\xff\xfe"}'),
    "committed missing": lambda s: _set(s, "zarr.json", _attr("committed", _DEL)),
    "committed negative": lambda s: _set(s, "zarr.json", _attr("committed",
                                                               {"step": -1, "token": 0,
                                                                "span": 0})),
    "committed garbage text": lambda s: _set(s, "zarr.json", _attr("committed", "{oops")),
    "committed a list": lambda s: _set(s, "zarr.json", _attr("committed", [1, 2, 3])),
    "committed a float": lambda s: _set(s, "zarr.json", _attr("committed",
                                                              {"step": 1.5, "token": 0,
                                                               "span": 0})),
    "committed past the arrays": lambda s: _set(s, "zarr.json", _attr(
        "committed", {"step": 10**12, "token": 5, "span": 3})),
    "schema_version missing": lambda s: _set(s, "zarr.json", _attr("schema_version", _DEL)),
    "schema_version from the future": lambda s: _set(s, "zarr.json", _attr("schema_version",
                                                                           99)),
    "arrays list missing": lambda s: _set(s, "zarr.json", _attr("arrays", _DEL)),
    "array folder deleted": lambda s: shutil.rmtree(s / "hits"),
    "array zarr.json garbage": lambda s: (s / "misses" / "zarr.json").write_text("{{{"),
    "array zarr.json truncated": lambda s: (s / "loads" / "zarr.json").write_bytes(
        (s / "loads" / "zarr.json").read_bytes()[:30]),
    "array wrong dtype": lambda s: _set(s, "hits/zarr.json",
                                        lambda d: d.update(data_type="float64")),
    "array wrong dimension names": lambda s: _set(s, "hits/zarr.json",
                                                  lambda d: d.update(dimension_names=["a", "b"])),
    "array wrong layer count": lambda s: _set(s, "hits/zarr.json",
                                              lambda d: d["shape"].__setitem__(1, 99)),
    "array shorter than committed": lambda s: _set(s, "topk_ids/zarr.json",
                                                   lambda d: d["shape"].__setitem__(0, 2)),
    "array negative shape": lambda s: _set(s, "phase/zarr.json",
                                           lambda d: d["shape"].__setitem__(0, -5)),
    "array huge chunks": lambda s: _set(s, "routed_tokens/zarr.json", lambda d: d[
        "chunk_grid"]["configuration"].__setitem__("chunk_shape", [10**9, L, E, 3])),
    "array zero chunks": lambda s: _set(s, "hits/zarr.json", lambda d: d[
        "chunk_grid"]["configuration"].__setitem__("chunk_shape", [0, L])),
    "chunk deleted": lambda s: (s / "topk_ids" / "c.0.0.0").unlink(),
    "chunk of an all-zero array deleted": lambda s: (s / "host_runs" / "c.0.0").unlink(),
    "coordinate garbage": lambda s: (s / "layer" / "zarr.json").write_text("nope"),
    # found by the hostile probe: tampering that used to read as zeros or fill memory
    "chunk keys with '/'": lambda s: _set(s, "topk_ids/zarr.json", lambda d: d[
        "chunk_key_encoding"].update(configuration={"separator": "/"})),
    "chunk keys of zarr v2": lambda s: _set(s, "hits/zarr.json",
                                            lambda d: d.update(chunk_key_encoding={"name": "v2"})),
    "chunk renamed c.00.0": lambda s: os.rename(s / "hits" / "c.0.0", s / "hits" / "c.00.0"),
    "a transpose codec": lambda s: _set(s, "topk_ids/zarr.json", lambda d: d["codecs"].insert(
        0, {"name": "transpose", "configuration": {"order": [2, 1, 0]}})),
    "a big-endian codec": lambda s: _set(s, "hits/zarr.json", lambda d: d["codecs"][0].update(
        configuration={"endian": "big"})),
    "fill value changed": lambda s: _set(s, "hits/zarr.json", lambda d: d.update(fill_value=7)),
    "zarr.json a 20 GB sparse file": lambda s: os.truncate(s / "hits" / "zarr.json", 20 * 2**30),
    "zarr.json a link to /dev/zero": lambda s: (
        (s / "zarr.json").unlink(), (s / "zarr.json").symlink_to("/dev/zero")),
    "zarr.json a FIFO": lambda s: ((s / "hits" / "zarr.json").unlink(),
                                   os.mkfifo(s / "hits" / "zarr.json")),
    "array folder a symlink": lambda s: (shutil.move(s / "hits", s.parent / "elsewhere"),
                                         (s / "hits").symlink_to(s.parent / "elsewhere")),
    "pinned of 2**40 layers": lambda s: _set(s, "pinned/zarr.json",
                                             lambda d: d["shape"].__setitem__(0, 2**40)),
    "committed a 400-digit number": lambda s: _set(s, "zarr.json", _attr(
        "committed", {"step": 10**400, "token": 5, "span": 3})),
}
#: tampering that opens but fails when the data is read (lazily): still a StoreError
TAMPER_ON_READ = {
    "chunk garbage": lambda s: (s / "hits" / "c.0.0").write_bytes(b"\x00garbage" * 10),
    "chunk truncated": lambda s: (s / "topk_ids" / "c.0.0.0").write_bytes(
        (s / "topk_ids" / "c.0.0.0").read_bytes()[:7]),
    "chunk empty": lambda s: (s / "span_start_s" / "c.0").write_bytes(b""),
    "chunk a directory": lambda s: ((s / "topk_ids" / "c.0.0.0").unlink(),
                                    (s / "topk_ids" / "c.0.0.0").mkdir()),
    "chunk a link to /dev/zero": lambda s: ((s / "hits" / "c.0.0").unlink(),
                                            (s / "hits" / "c.0.0").symlink_to("/dev/zero")),
    "chunk a FIFO": lambda s: ((s / "hits" / "c.0.0").unlink(), os.mkfifo(s / "hits" / "c.0.0")),
    "chunk a 20 GB sparse file": lambda s: os.truncate(s / "hits" / "c.0.0", 20 * 2**30),
    "chunk a zstd bomb": lambda s: (s / "hits" / "c.0.0").write_bytes(
        __import__("numcodecs").Zstd(level=19).encode(bytes(2**28))),
    "chunk a valid but short frame": lambda s: (s / "hits" / "c.0.0").write_bytes(
        __import__("numcodecs").Zstd().encode(bytes(40))),
    "chunk a short frame of a realb array": lambda s: (s / "realb_m" / "c.0.0.0").write_bytes(
        __import__("numcodecs").Zstd().encode(np.zeros(10, np.float32).tobytes())),
    "chunk with a second frame": lambda s: (s / "hits" / "c.0.0").write_bytes(
        (s / "hits" / "c.0.0").read_bytes() + __import__("numcodecs").Zstd().encode(b"x" * 8)),
}


@pytest.fixture(scope="module")
def good_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "run.zarr"
    _record(path, _events(5, seed=4))
    return path


@pytest.mark.parametrize("case", list(TAMPER))
def test_a_tampered_store_is_refused_naming_it(tmp_path, good_store, case):
    store = tmp_path / "run.zarr"
    shutil.copytree(good_store, store)
    TAMPER[case](store)
    with pytest.raises(StoreError, match=rf"run store '{store}'") as e:
        workbench.open_run(store).load()
    assert len(str(e.value)) < 600


@pytest.mark.parametrize("case", list(TAMPER_ON_READ))
def test_a_corrupt_chunk_is_an_error_on_read_naming_the_array(tmp_path, good_store, case):
    store = tmp_path / "run.zarr"
    shutil.copytree(good_store, store)
    TAMPER_ON_READ[case](store)
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # per-step counts are read at open (their invariants are checked there), the rest on load
    with pytest.raises(StoreError, match=rf"run store '{store}': .*array '\w+' chunk"):
        workbench.open_run(store).load()
    # no allocation beyond a chunk: the bomb and the sparse file stay on disk
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024


@pytest.mark.parametrize("case", ["chunk deleted", "committed negative", "array folder deleted",
                                  "root zarr.json garbage"])
def test_replay_of_a_tampered_store_exits_2_naming_it(tmp_path, good_store, capsys, case):
    """The bug this guards: a deleted chunk read as zeros and replay returned wrong numbers."""
    store = tmp_path / "run.zarr"
    shutil.copytree(good_store, store)
    TAMPER[case](store)
    rc = main(["replay", str(store), "--set", "cache_slots=4"])
    err = capsys.readouterr().err
    assert rc == 2 and str(store) in err and "Traceback" not in err


def test_old_schema_stores_still_open(tmp_path):
    """A schema-2 store (no 'arrays' list, all-zero chunks may be absent) still reads, in the
    current names (made from the schema-3 fixture, whose layout schema 2 shares)."""
    store = tmp_path / "old.zarr"
    shutil.copytree(Path(__file__).parent / "data" / "store_v3.zarr", store)
    _set(store, "zarr.json", _attr("schema_version", 2))
    _set(store, "zarr.json", _attr("arrays", _DEL))
    (store / "host_runs" / "c.0.0").unlink()  # schema 2 wrote no file for an all-zero chunk
    ds = workbench.open_run(store)
    assert int(ds.host_runs.sum()) == 0 and ds.sizes["step"] == 6
    assert ds.attrs["schema_version"] == 2 and ds.predicted_ids.dims[-1] == "pred_order"
    summary = json.loads(ds.attrs["summary"])  # the RunResult of the recording run
    assert int(ds.hits.sum()) == summary["hits"] and int(ds.pinned_accesses.sum()) > 0


def test_store_documents_are_standard_json(tmp_path):
    """Python writes non-finite floats as NaN/Infinity, which other JSON readers reject; a
    store's documents hold null there."""
    store = tmp_path / "run.zarr"
    rec = Recorder(store, L, E, K, attrs={"x": float("inf"), "y": [1.0, float("nan")]},
                   pinned=[True, False, False])
    rec.close()
    text = (store / "zarr.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    ds = workbench.open_run(store)
    assert ds.attrs["x"] is None and ds.attrs["y"] == [1.0, None]


def test_a_store_that_lost_a_batch_is_never_closed_complete(tmp_path, hook):
    """A write error raised at an ``add`` and ignored by the caller: closing 'complete' still
    marks the store failed (it lacks that batch), and no later batch lands on its rows."""
    store = tmp_path / "run.zarr"
    rec = Recorder(store, L, E, K, attrs={}, pinned=[True, False, False], flush_every=1,
                   capacity=SMALL)
    events = _events(6, seed=1)
    rec.add(events[0])
    rec.flush()

    def full(op, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    hook(full)
    rec.add(events[1])  # fails on the writer thread
    with pytest.raises(StoreError):
        rec.flush()
    hook(None)
    for ev in events[2:]:  # the caller goes on regardless
        try:
            rec.add(ev)
        except StoreError:
            pass
    with pytest.raises(StoreError, match="No space left"):
        rec.close("complete")
    ds = workbench.open_run(store)
    assert ds.attrs["status"] == "failed" and ds.sizes["step"] == 1
    assert list(ds.phase.values) == [0]  # step 0 only: no later step moved into its place


@pytest.mark.parametrize("bad", [None, 123, b"/tmp/x.zarr", "a\0b", "", "   "])
def test_store_paths_of_the_wrong_kind_are_store_errors(bad):
    from workbench.telemetry.store import check_store_path

    with pytest.raises(StoreError, match="path"):
        workbench.open_run(bad)
    with pytest.raises(StoreError, match="path"):
        check_store_path(bad, overwrite=False)


# -- found by the second hostile probe ----------------------------------------------------------
@pytest.mark.parametrize("spec", ['{"expert_bytes": -1}', "[[[", '{"source": "x", '
                                  '"expert_bytes": NaN, "expert_flops_per_token": 1, '
                                  '"dense_bytes_per_layer": 1, '
                                  '"dense_flops_per_token_per_layer": 1}'])
def test_replay_of_a_store_with_a_bad_cost_spec_exits_2(tmp_path, good_store, capsys, spec):
    store = tmp_path / "run.zarr"
    shutil.copytree(good_store, store)
    _set(store, "zarr.json", _attr("cost_spec", spec))
    rc = main(["replay", str(store), "--set", "cache_slots=4"])
    err = capsys.readouterr().err
    assert rc == 2 and "attribute 'cost_spec' is unusable" in err and "target_model" in err


def test_the_workspace_must_be_a_folder_and_auto_names_are_per_process(tmp_path):
    from workbench.telemetry.destination import new_run_name, workspace_dir

    afile = tmp_path / "runs"
    afile.write_text("x")
    with pytest.raises(StoreError, match=r"workspace .*runs' .*cannot hold runs"):
        workspace_dir(afile)
    ws = workspace_dir(tmp_path / "ws")
    name = new_run_name(ws)
    assert name.startswith("run-") and f"-{os.getpid()}-000.zarr" in name
    (ws / name).mkdir()
    assert new_run_name(ws) != name


def test_a_store_inside_a_store_is_refused_up_front(tiny_ckpt, tmp_path, capsys):
    """--store good.zarr/inner.zarr was accepted and then blocked --overwrite good.zarr
    (issue 26): refused before anything loads, naming the outer store."""
    from workbench.cli import main

    good = tmp_path / "good.zarr"
    assert main(["run", "--model", str(tiny_ckpt()), "--prompt", "hi", "--store", str(good),
                 "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(["run", "--model", "/nonexistent", "--prompt", "hi", "--store",
                 str(good / "inner.zarr")]) == 2
    err = capsys.readouterr().err
    assert "would be inside the store" in err and str(good) in err, err
    assert not (good / "inner.zarr").exists()
    assert main(["run", "--model", str(tiny_ckpt()), "--prompt", "hi", "--store", str(good),
                 "--overwrite", "--max-new-tokens", "2"]) == 0


SEMANTIC = {  # array, index, value, what the error says
    "negative hits": ("hits", (0, 0), -3, "array 'hits' holds -3 at step 0, layer 0; expected a "
                                          "count ≥ 0"),
    "huge misses": ("misses", (1, 0), 2**31 - 1, "expected hits + misses at most the layer's"),
    "negative routed": ("routed_tokens", (0, 0, 0, 0), -1, "array 'routed_tokens' holds -1"),
    "huge step_tokens": ("step_tokens", (2,), 10**9, "array 'step_tokens' holds 1000000000"),
    "nan latency": ("latency_measured_s", (0,), float("nan"), "a finite number of seconds"),
    "inf stall": ("stall_modeled_s", (1,), float("inf"), "a finite number of seconds"),
    "negative token": ("generated_token", (0,), -7, "a token id ≥ 0, or -1 (none)"),
}


@pytest.mark.parametrize("case", list(SEMANTIC))
def test_semantic_tampering_is_refused_at_open_naming_the_array(tmp_path, good_store, capsys,
                                                              case):
    """Negative counts, impossible lookups, NaN/inf times and negative token ids replayed with
    exit 0 (a hit rate of 1.0015, issue 26): open_run checks these invariants and names the
    first one broken; replay exits 2 with it."""
    import zarr

    store = tmp_path / "run.zarr"
    shutil.copytree(good_store, store)
    name, idx, value, fragment = SEMANTIC[case]
    arr = zarr.open_array(store / name, mode="r+")
    arr[idx] = value
    with pytest.raises(StoreError, match=rf"run store '{store}'") as e:
        workbench.open_run(store)
    assert fragment in str(e.value), str(e.value)
    assert main(["replay", str(store), "--set", "cache_slots=4"]) == 2
    assert fragment in capsys.readouterr().err
