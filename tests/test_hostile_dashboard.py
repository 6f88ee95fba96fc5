"""A bad file must not take the dashboard down (issue 10, items 7 and 8).

Every class of hostile workspace entry — a store whose ``zarr.json`` is garbage, truncated or not
an object; attributes of the wrong type (``committed`` garbage or a list, ``status`` a number,
``knob.*`` and ``summary`` not JSON, a huge prompt); a file, a link loop or a folder without
metadata named ``*.zarr``; a name with odd characters; missing or corrupt arrays; a run being
written; a run with more steps than ``max_new_tokens`` — is made from a real recorded run
(copied and tampered), and the dashboard is checked to

- list the good runs and the bad one as *unreadable*, with the reason;
- say why, visibly, when the bad one is opened (the run shown before stays shown);
- build its page and keep polling without an exception reaching Panel/Bokeh.

A real run longer than the 6-step one opens (the progress bar rescales), a garbage
``prompts.json`` leaves the demo menu empty, and an oversize upload is refused with the limit
(in the browser, before it is sent, when Chromium is present: see the two browser tests at the
end).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from workbench.errors import InputError, StoreError, WorkbenchError
from workbench.ui import datastore as D
from workbench.ui.datastore import (MAX_UPLOAD_BYTES, UNREADABLE, DataStore, check_image_upload,
                                    demo_inputs, list_runs)

KNOBS = dict(cache_slots=3, pinned_layers=1, max_new_tokens=6, device="cpu")


# -- a real run, and ways to break copies of it ---------------------------------------------------
@pytest.fixture(scope="module")
def source(tiny_ckpt, tmp_path_factory) -> Path:
    """One finished run of a tiny real model (6 steps): every hostile store is a copy of it."""
    ws = tmp_path_factory.mktemp("source")
    s = DataStore(workspace=ws, model=tiny_ckpt("qwen3_moe"))
    s.knobs.set(**KNOBS)
    s.start_run(name="good", prompt="a good run")
    s.wait()
    assert not s.error, s.error
    return ws / "good.zarr"


def _meta(store: Path) -> dict:
    return json.loads((store / "zarr.json").read_text())


def _set_attrs(store: Path, **changes) -> None:
    doc = _meta(store)
    doc["attributes"].update(changes)
    (store / "zarr.json").write_text(json.dumps(doc))


def _copy(source: Path, ws: Path, name: str = "bad.zarr") -> Path:
    ws.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(source, ws / name))


# Each maker puts one hostile entry called ``name`` (default ``bad.zarr``; the odd-name makers
# use their own) into the workspace ``ws`` and returns its name.
def _write(text: str | bytes):
    def make(source: Path, ws: Path, name: str = "bad.zarr") -> str:
        f = _copy(source, ws, name) / "zarr.json"
        f.write_bytes(text.encode() if isinstance(text, str) else text)
        return name
    return make


def _attrs(**changes):
    def make(source: Path, ws: Path, name: str = "bad.zarr") -> str:
        _set_attrs(_copy(source, ws, name), **changes)
        return name
    return make


def _doc(change):
    def make(source: Path, ws: Path, name: str = "bad.zarr") -> str:
        store = _copy(source, ws, name)
        doc = _meta(store)
        change(doc)
        (store / "zarr.json").write_text(json.dumps(doc))
        return name
    return make


def _truncated(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    f = _copy(source, ws, name) / "zarr.json"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return name


def _a_file(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    ws.mkdir(parents=True, exist_ok=True)
    (ws / name).write_bytes(b"not a folder")
    return name


def _no_metadata(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    (_copy(source, ws, name) / "zarr.json").unlink()
    return name


def _empty_folder(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    (ws / name).mkdir(parents=True)
    return name


def _metadata_a_folder(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    store = _copy(source, ws, name)
    (store / "zarr.json").unlink()
    (store / "zarr.json").mkdir()
    return name


def _link_loop(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    ws.mkdir(parents=True, exist_ok=True)
    (ws / name).symlink_to(name)
    return name


def _dangling_link(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    ws.mkdir(parents=True, exist_ok=True)
    (ws / name).symlink_to(ws / "nowhere.zarr")
    return name


def _link_outside(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    ws.mkdir(parents=True, exist_ok=True)
    (ws / name).symlink_to(source, target_is_directory=True)  # a real store, elsewhere
    return name


def _odd_name(odd: str):
    def make(source: Path, ws: Path, name: str = "") -> str:
        ws.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, ws / odd)  # a lone surrogate: the bytes of a non-UTF-8 name
        return odd
    return make


def _no_array(var: str):
    def make(source: Path, ws: Path, name: str = "bad.zarr") -> str:
        shutil.rmtree(_copy(source, ws, name) / var)
        return name
    return make


def _array_meta(text: str):
    def make(source: Path, ws: Path, name: str = "bad.zarr") -> str:
        (_copy(source, ws, name) / "hits" / "zarr.json").write_text(text)
        return name
    return make


def _chunk(data: bytes | None):
    def make(source: Path, ws: Path, name: str = "bad.zarr") -> str:
        c = _copy(source, ws, name) / "latency_measured_s" / "c.0"
        if data is None:
            c.unlink()
        else:
            c.write_bytes(data)
        return name
    return make


def _truncated_chunk(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    c = _copy(source, ws, name) / "hits" / "c.0.0"
    c.write_bytes(c.read_bytes()[:7])
    return name


def _phase_code(source: Path, ws: Path, name: str = "bad.zarr") -> str:
    import zarr

    zarr.open_array(str(_copy(source, ws, name) / "phase"), mode="r+")[1] = 9  # valid chunk
    return name


def _nested(doc: dict) -> None:
    doc["attributes"]["committed"] = json.loads("[" * 50 + "]" * 50)


#: (id, how to make the bad entry, words its listing reason holds) — the entry is listed as
#: unreadable from its metadata alone
LISTED_BAD = [
    ("garbage-json", _write(b"\x00\xff\xfe garbage {"), "not valid JSON"),
    ("truncated-json", _truncated, "not valid JSON"),
    ("empty-json", _write(""), "is empty (0 bytes)"),
    ("deeply-nested-json", _write("[" * 200_000 + "]" * 200_000), "not valid JSON"),
    ("json-a-list", _write("[1, 2, 3]"), "not a JSON object"),
    ("json-null", _write("null"), "not a JSON object"),
    ("json-a-string", _write('"zarr"'), "not a JSON object"),
    ("attributes-a-list", _doc(lambda d: d.update(attributes=[1, 2])), "attributes are a list"),
    ("committed-garbage-text", _attrs(committed="{not json"), "attribute 'committed' is"),
    ("committed-a-list", _attrs(committed=[6, 6, 6]), "attribute 'committed' is"),
    ("committed-nested", _doc(_nested), "attribute 'committed' is"),
    ("committed-a-number", _attrs(committed=6), "attribute 'committed' is"),
    ("committed-step-text", _attrs(committed={"step": "six", "token": 1, "span": 1}),
     "committed extent of 'step'"),
    ("committed-step-negative", _attrs(committed={"step": -6, "token": 1, "span": 1}),
     "committed extent of 'step'"),
    ("committed-step-float", _attrs(committed={"step": 1e300, "token": 1, "span": 1}),
     "committed extent of 'step'"),
    ("committed-step-bool", _attrs(committed={"step": True, "token": 1, "span": 1}),
     "committed extent of 'step'"),
    ("committed-missing-dim", _attrs(committed={"step": 6}), "committed extent of 'token'"),
    ("status-a-number", _attrs(status=5), "attribute 'status' is 5"),
    ("status-a-dict", _attrs(status={"x": 1}), "attribute 'status' is"),
    ("status-empty", _attrs(status=""), "attribute 'status' is"),
    ("status-huge", _attrs(status="running" * 1000), "attribute 'status' is"),
    ("no-schema-version", _doc(lambda d: d["attributes"].pop("schema_version")),
     "not a workbench run store"),
    ("schema-version-text", _attrs(schema_version="3"), "not a workbench run store"),
    ("a-file", _a_file, "is a file"),
    ("no-zarr-json", _no_metadata, "no zarr.json"),
    ("empty-folder", _empty_folder, "no zarr.json"),
    ("zarr-json-a-folder", _metadata_a_folder, "is a directory"),
    ("symlink-loop", _link_loop, "loops"),
    ("dangling-symlink", _dangling_link, "points nowhere"),
    ("symlink-outside", _link_outside, "outside the workspace"),
    ("name-with-space", _odd_name("odd name.zarr"), "not a run name"),
    ("name-with-html", _odd_name("<b>x&amp;y<.zarr"), "not a run name"),
    ("name-with-newline", _odd_name("a\nb.zarr"), "not a run name"),
    ("name-unicode", _odd_name("ünïcödé.zarr"), "not a run name"),
    ("name-not-utf8", _odd_name("x\udcff\udcfe.zarr"), "not a run name"),
    ("name-too-long", _odd_name("r" * 200 + ".zarr"), "not a run name"),
]

#: the metadata lists fine; the arrays are missing or corrupt: found when the run is opened
OPEN_BAD = [
    ("array-folder-missing", _no_array("hits")),
    ("array-metadata-garbage", _array_meta("{{{ not json")),
    ("array-metadata-not-object", _array_meta("[]")),
    ("chunk-garbage", _chunk(b"\x00garbage" * 3)),
    ("chunk-truncated", _truncated_chunk),
    ("chunk-missing", _chunk(None)),
    ("committed-beyond-the-arrays", _attrs(committed={"step": 10**6, "token": 1, "span": 1})),
    ("phase-code-out-of-range", _phase_code),
    ("phase-names-wrong", _attrs(phase_names=["warmup"])),
    ("lane-names-a-text", _attrs(lane_names="compute")),
    ("clock-names-null", _attrs(clock_names=None)),
]


def _check_dashboard(ws: Path, bad: str, reason: str | None) -> None:
    """The common promise: the good run is listed and shown, the bad one is listed as unreadable
    (with ``reason`` when given), opening it says why and keeps the good run shown, and the
    session keeps polling."""
    from workbench.ui.widgets import runs_widgets

    runs = list_runs(ws)
    by_name = {r.name: r for r in runs}
    assert by_name["good.zarr"].readable and by_name["good.zarr"].status == "complete"
    assert runs[0].name == "good.zarr"  # readable runs first
    s = DataStore(workspace=ws, refresh_s=0.0)
    w = runs_widgets(s)
    s.open("good")
    shown = s.dataset
    assert shown is not None and s.run_name == "good.zarr"

    listed = [r for r in s.runs if not r.readable]
    if reason is not None:
        assert len(listed) == 1, runs
        info = listed[0]
        assert info.status == UNREADABLE and reason in info.problem, info
        assert UNREADABLE in info.label and info.label in w["select"].options
        assert w["problems"].visible and reason.split()[0] in w["problems"].object
    else:  # found on opening
        [info] = [r for r in s.runs if r.name == bad]

    # open it from the Runs card: a visible message with the reason, the good run stays shown
    w["select"].value = info.name
    w["open"].clicks += 1
    assert w["message"].visible, "opening an unreadable store said nothing"
    text = w["message"].object
    assert "is unreadable" in text, text
    if reason is not None:
        assert reason.split()[0] in text
    assert s.run_name == "good.zarr" and s.dataset is shown
    with pytest.raises(WorkbenchError):
        s.open(info.name)
    # … and it is listed as unreadable from now on, with the reason
    [after] = [r for r in s.runs if r.name == info.name]
    assert not after.readable and after.problem
    assert w["problems"].visible and after.problem[:30] in text.replace("&#x27;", "'")
    s.poll()
    assert s.run_name == "good.zarr" and s.dataset is shown


@pytest.mark.parametrize("make, reason", [c[1:] for c in LISTED_BAD],
                         ids=[c[0] for c in LISTED_BAD])
def test_a_store_with_bad_metadata_is_listed_as_unreadable(make, reason, source, tmp_path):
    ws = tmp_path / "ws"
    bad = make(source, ws)
    _copy(source, ws, "good.zarr")
    _check_dashboard(ws, bad, reason)


@pytest.mark.parametrize("make", [c[1] for c in OPEN_BAD], ids=[c[0] for c in OPEN_BAD])
def test_a_store_with_broken_arrays_says_why_when_opened(make, source, tmp_path):
    ws = tmp_path / "ws"
    bad = make(source, ws)
    _copy(source, ws, "good.zarr")
    _check_dashboard(ws, bad, None)


def test_unreadable_workspace_entry_without_read_permission(source, tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    bad = _copy(source, ws, "noperm.zarr")
    _copy(source, ws, "good.zarr")
    if os.geteuid() != 0:
        os.chmod(bad, 0)
    else:  # root reads anything: refuse the open as the kernel would for anyone else
        import workbench.fileio as F

        real = F.os.open

        def os_open(path, *a, **k):
            if "noperm.zarr" in str(path):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *a, **k)

        monkeypatch.setattr(F.os, "open", os_open)
    try:
        _check_dashboard(ws, "noperm.zarr", "Permission denied")
    finally:
        os.chmod(bad, 0o755)


def test_a_huge_metadata_document_is_refused_not_read(source, tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    big = _copy(source, ws)
    _set_attrs(big, prompt="p" * 2_000_000)
    _copy(source, ws, "good.zarr")
    monkeypatch.setattr(D, "MAX_META_BYTES", 1_000_000)
    _check_dashboard(ws, "bad.zarr", "too large")


def test_hidden_entries_are_not_runs(source, tmp_path):
    """A writer's staging and lock siblings (``.<name>.staging-*``, ``.<name>.lock``) and other
    folders are not listed at all."""
    ws = tmp_path / "ws"
    _copy(source, ws, "good.zarr")
    _copy(source, ws, ".good.zarr.staging-1234")
    (ws / ".hidden.zarr").mkdir()
    (ws / ".good.zarr.lock").write_text("")
    (ws / "uploads").mkdir()
    assert [r.name for r in list_runs(ws)] == ["good.zarr"]


# -- every class at once: the page still renders --------------------------------------------------
def test_the_page_renders_with_every_bad_store_in_the_workspace(source, tmp_path):
    """One workspace holding every hostile entry above: a new session lists the good runs first,
    shows the newest readable one, names each bad one with its reason, renders to a Bokeh
    document, and polls without raising."""
    from bokeh.document import Document

    from workbench.ui.app import build_app

    ws = tmp_path / "ws"
    for key, make, _ in LISTED_BAD + [(c[0], c[1], None) for c in OPEN_BAD]:
        make(source, ws, f"bad-{key}.zarr")
    # a newer good run and an older one
    _copy(source, ws, "good.zarr")
    _set_attrs(_copy(source, ws, "newest.zarr"), created="2999-01-01T00:00:00+0000")
    s = DataStore(workspace=ws)
    app = build_app(s, template=False, preload=False, poll_ms=0)
    assert s.run_name == "newest.zarr" and s.dataset is not None
    assert [r.name for r in s.runs[:2]] == ["newest.zarr", "good.zarr"]
    unreadable = [r for r in s.runs if not r.readable]
    assert len(unreadable) == len(LISTED_BAD)  # broken arrays are found on opening
    problems = app._wb_widgets["runs"]["problems"]
    assert problems.visible and f"{len(unreadable)} stores" in problems.object
    assert "<b>x&amp;y<" not in problems.object  # names are escaped
    assert len(app._wb_views["heatmap"].pane.object.data) == 1
    doc = Document()
    app.server_doc(doc)
    json.dumps(doc.to_json(), default=str)  # every name and reason can be sent to the browser
    # opening each bad one says why; none of them changes what is shown
    runs = app._wb_widgets["runs"]
    for info in list(s.runs):
        if info.name in ("newest.zarr", "good.zarr"):
            continue
        runs["select"].value = info.name
        runs["open"].clicks += 1
        assert runs["message"].visible, info
        assert s.run_name == "newest.zarr"
    assert len([r for r in s.runs if not r.readable]) == len(LISTED_BAD) + len(OPEN_BAD)
    s.poll()
    assert not s.error


# -- attributes that list fine but are wrong: the views never raise -------------------------------
BAD_KNOBS = {"knob.max_new_tokens": "{{", "knob.cache_slots": "[", "knob.eviction": "7",
             "knob.prefetch": "{\"a\": 1}", "knob.profile": "[1, 2]",
             "knob.hotness_decay": "\"fast\"", "knob.hotness_window": "NaN",
             "knob.compression": "\"no-such-policy\"", "knob.beta": "Infinity",
             "hardware_profile": 42, "live_plan": "{broken"}


@pytest.mark.parametrize("attrs", [
    BAD_KNOBS,
    {"summary": "{not json"},
    {"summary": "[1, 2]"},
    {"summary": json.dumps({"text": 42})},
    {"prompt": "a huge prompt " * 100_000},
    {"prompt": 12345},
    {"created": {"when": "now"}},
    {"knob.max_new_tokens": "Infinity"},
    {"knob.max_new_tokens": "1e400"},
    {"knob.max_new_tokens": "-5"},
    {"knob.max_new_tokens": "2"},  # fewer than the run's 6 steps
], ids=["knobs-not-json", "summary-not-json", "summary-a-list", "summary-text-a-number",
        "prompt-huge", "prompt-a-number", "created-a-dict", "max-new-tokens-infinite",
        "max-new-tokens-overflow", "max-new-tokens-negative", "more-steps-than-max-new-tokens"])
def test_wrong_attributes_open_and_every_view_draws(attrs, source, tmp_path, caplog):
    """The run opens and every view draws (or says why in its own words): no view falls back to
    "could not draw" with an error in the log."""
    import logging

    from workbench.ui.app import build_app

    caplog.set_level(logging.WARNING, logger="workbench.ui")

    ws = tmp_path / "ws"
    _set_attrs(_copy(source, ws, "odd.zarr"), **attrs)
    s = DataStore(workspace=ws)
    [info] = s.runs
    assert info.readable and len(info.prompt) <= D.MAX_PROMPT_CHARS
    app = build_app(s, template=False, preload=False, poll_ms=0)
    assert s.run_name == "odd.zarr" and s.dataset.sizes["step"] == 6
    assert 0 <= s.progress <= s.progress_max and s.progress_max >= 6
    bar = app._wb_widgets["progress"][0]
    assert bar.max == s.progress_max and bar.value == s.progress
    for name, v in app._wb_views.items():  # every view drew something (or said why)
        assert v.pane.object is not None, name
    for widget in ("adopt", "clear", "pin"):
        app._wb_widgets["runs"][widget].clicks += 1  # each says why, or works; never raises
    s.replay_evictions = ["lru"]
    s.modality, s.phase, s.clock = "text", "decode", "measured"
    assert "whole run" in app._wb_views["deltas"].pane.object  # pinned against itself
    s.poll()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]


def test_the_shown_store_turning_unreadable_is_reported_and_recovers(source, tmp_path):
    ws = tmp_path / "ws"
    store = _copy(source, ws, "good.zarr")
    s = DataStore(workspace=ws)
    s.open("good")
    shown = s.dataset
    good = (store / "zarr.json").read_bytes()
    (store / "zarr.json").write_bytes(b"{garbage")
    s.poll()
    assert "unreadable" in s.error and "not valid JSON" in s.error
    assert s.dataset is shown and "unreadable" in s.status  # the last readable state stays
    (store / "zarr.json").write_bytes(good)
    time.sleep(D.TAIL_REREAD_S)
    s.poll()
    assert s.error == "" and s.dataset is not None and "complete" in s.status


def test_the_shown_store_losing_an_array_is_reported_once(source, tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    store = _copy(source, ws, "good.zarr")
    s = DataStore(workspace=ws)
    s.open("good")
    shown = s.dataset
    shutil.rmtree(store / "hits")
    _set_attrs(store, status="failed")  # a new state of the store: it is read again
    s.poll()
    assert "unreadable" in s.error and "'hits'" in s.error and s.dataset is shown
    [info] = s.refresh()
    assert not info.readable and "'hits'" in info.problem  # the listing says so too
    loads = []
    monkeypatch.setattr(D, "load_run", lambda p: loads.append(p))
    time.sleep(D.TAIL_REREAD_S)
    s.poll()
    assert loads == []  # not re-read at every tick while nothing changes


def test_a_run_being_written_opens_and_tails(source, tmp_path):
    """A store another process is writing: nothing committed yet (shown as waiting), then
    steps (a live tail); neither is an error."""
    ws = tmp_path / "ws"
    store = _copy(source, ws, "live.zarr")
    _set_attrs(store, status="running", committed={"step": 0, "token": 0, "span": 0})
    s = DataStore(workspace=ws)
    assert s.runs[0].status == "running"
    assert s.open("live") is None and s.run_name == "live.zarr" and not s.error
    assert "no step committed" in s.status
    done = _meta(source)["attributes"]["committed"]
    _set_attrs(store, committed={**done, "step": 3})
    time.sleep(D.TAIL_REREAD_S)
    s.poll()
    assert s.dataset is not None and s.dataset.sizes["step"] == 3 and s.live
    assert "live tail" in s.status and s.progress == 3 and s.progress_max == 6
    _set_attrs(store, status="complete", committed=done)
    time.sleep(D.TAIL_REREAD_S)
    s.poll()
    assert s.dataset.sizes["step"] == 6 and not s.live and s.progress == s.progress_max


def test_a_running_store_with_broken_arrays_is_reported_after_retries(source, tmp_path):
    ws = tmp_path / "ws"
    store = _copy(source, ws, "live.zarr")
    _set_attrs(store, status="running")
    shutil.rmtree(store / "hits")
    s = DataStore(workspace=ws)
    with pytest.raises(StoreError, match="unreadable"):
        s.open("live")


# -- a long run: the progress bar rescales --------------------------------------------------------
LONG_STEPS = 24  # more steps than the short run's 6 is all the test needs (was 400: 19 s set-up)


@pytest.fixture(scope="module")
def long_run(embedded, tmp_path_factory) -> Path:
    """A real LONG_STEPS-step run of the embedded model (text only, ignore_eos; about a second)."""
    from workbench.knobs import Knobs
    from workbench.runtime.runtime import Runtime

    ws = tmp_path_factory.mktemp("long")
    rt = Runtime(embedded, knobs=Knobs(cache_slots=16, max_new_tokens=LONG_STEPS, ignore_eos=True,
                                       device="cpu"))
    res = rt.run("count", store=ws / "long.zarr")
    assert res.steps == LONG_STEPS
    return ws / "long.zarr"


def test_a_long_run_opens_after_a_short_one_and_back(long_run, source, tmp_path):
    from workbench.ui.views import progress_view

    ws = long_run.parent
    if not (ws / "short.zarr").exists():
        shutil.copytree(source, ws / "short.zarr")
    s = DataStore(workspace=ws)
    bar = progress_view(s)[0]
    s.open("short")
    assert (bar.value, bar.max) == (6, 6)
    s.open("long")  # was: "Progress.value must be at most 6, not 400"
    n = LONG_STEPS
    assert s.dataset.sizes["step"] == n and not s.error
    assert (s.progress, s.progress_max) == (n, n) and (bar.value, bar.max) == (n, n)
    s.open("short")  # and back: the maximum shrinks below the old value
    assert (bar.value, bar.max) == (6, 6)
    s.progress_max, s.progress = 3, 7  # inconsistent values are clamped, never refused
    assert (bar.value, bar.max) == (3, 3)


# -- demo inputs (prompts.json) -------------------------------------------------------------------
def _png(size=(16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("content", [
    b"\x00\xff garbage", b"", b"[" * 100_000, b"{\"a\": 1}", b"42", b"[1, \"x\", null, []]",
    json.dumps([{"image": "scene.png", "prompt": 5}, {"image": 7, "prompt": "x"},
                {"image": "/etc/passwd", "prompt": "abs"}, {"image": "a\u0000b", "prompt": "n"},
                {"image": "../scene.png", "prompt": "up"}, {"prompt": "   "},
                {"image": "scene.png", "prompt": "ok " * 10_000}]).encode(),
], ids=["garbage", "empty", "nested", "object", "number", "mixed-list", "bad-items"])
def test_a_garbage_prompts_json_leaves_the_demo_menu_usable(content, tmp_path):
    from workbench.ui.widgets import input_widgets

    (tmp_path / "scene.png").write_bytes(_png())
    (tmp_path / "prompts.json").write_bytes(content)
    items = demo_inputs(tmp_path)
    assert all(len(i["prompt"]) <= D.MAX_PROMPT_CHARS for i in items)
    assert all(i["image"] is None or Path(i["image"]).parent == tmp_path for i in items)
    s = DataStore(workspace=tmp_path / "ws")
    w = input_widgets(s, tmp_path)
    assert "(text only, no image)" in w["demo"].options


# -- uploads --------------------------------------------------------------------------------------
def test_upload_widget_refuses_large_files_before_they_are_sent(tmp_path):
    """The upload is a FileDropper with the limit set in the browser (FilePond refuses a larger
    file with "Maximum file size is 5 MB" and sends nothing) and chunks far below Bokeh's
    websocket message limit; a client that sends more anyway is cut off on the server with the
    limit in the message."""
    from workbench.ui.widgets import ImageDropper, input_widgets

    s = DataStore(workspace=tmp_path / "ws")
    w = input_widgets(s, tmp_path / "no-demos")
    up = w["upload"]
    assert isinstance(up, ImageDropper)
    assert up.max_file_size == f"{MAX_UPLOAD_BYTES // 1000}KB" == "5000KB"  # FilePond: 5 MB
    assert up.chunk_size <= 1_000_000 < 20 * 2**20  # Bokeh's default websocket_max_message_size
    assert "5 MB" in w["upload_hint"].object

    def send(name: str, data: bytes, chunk: int = 1_000_000) -> None:
        parts = [data[i:i + chunk] for i in range(0, len(data), chunk)] or [b""]
        for i, part in enumerate(parts, 1):
            up._process_event(SimpleNamespace(event_name="upload_event", data={
                "name": name, "chunk": i, "total_chunks": len(parts), "data": part,
                "type": "image/png"}))

    send("huge.png", b"\x89PNG" + b"\0" * (50 * 10**6))  # 50 MB, past the browser's check
    assert w["upload_message"].visible and "5 MB" in w["upload_message"].object
    assert s.image is None and up.value == {} and not getattr(up, "_file_buffer", {})
    send("scene.png", _png())  # a good one afterwards: the session is fine
    assert s.image and Path(s.image).parent == tmp_path / "ws" / "uploads"
    assert not w["upload_message"].visible and up.value == {}  # no bytes kept in the widget
    send("note.txt", b"plain text")  # decoded as text by Panel: refused, not raised
    assert w["upload_message"].visible and "not a readable" in w["upload_message"].object
    # many files begun at once, none finished: cut off once they hold twice the limit
    w["upload_message"].visible = False
    for i in range(3):
        up._process_event(SimpleNamespace(event_name="upload_event", data={
            "name": f"part{i}.png", "chunk": 1, "total_chunks": 9, "data": b"\0" * 4_000_000,
            "type": "image/png"}))
    assert w["upload_message"].visible and not up._wb_sizes
    assert not getattr(up, "_file_buffer", {})
    # chunks without a first chunk (a misbehaving client): dropped
    up._process_event(SimpleNamespace(event_name="upload_event", data={
        "name": "x.png", "chunk": 2, "total_chunks": 3, "data": b"xx", "type": "image/png"}))
    with pytest.raises(InputError, match="5 MB"):
        check_image_upload(b"\x89PNG" + b"\0" * MAX_UPLOAD_BYTES, "big.png")
    with pytest.raises(InputError, match="not the bytes"):
        check_image_upload("a text", "t.png")


def test_run_during_an_upload_is_refused_and_the_menu_names_the_upload(tmp_path):
    """Run pressed while an image is still arriving ran the demo image shown before it, and
    the Demo menu kept naming that demo (issue 37 §3): now Run is refused until the upload has
    arrived, then the menu names the uploaded image, which the run uses; a client that stops
    sending blocks Run only for UPLOAD_STALL_S."""
    import time

    from workbench.ui import datastore
    from workbench.ui.widgets import UPLOADED, input_widgets

    s = DataStore(workspace=tmp_path / "ws")
    w = input_widgets(s)  # the shipped demos: the first one shown
    demo_image = s.image
    assert demo_image and s.prompt
    up, data = w["upload"], _png()
    half = len(data) // 2

    def chunk(i: int, part: bytes) -> None:
        up._process_event(SimpleNamespace(event_name="upload_event", data={
            "name": "mine.png", "chunk": i, "total_chunks": 2, "data": part,
            "type": "image/png"}))

    chunk(1, data[:half])
    with pytest.raises(InputError, match="'mine.png' is still uploading"):
        s.start_run()
    assert not s.running and s.image == demo_image
    chunk(2, data[half:])
    assert s.image != demo_image and Path(s.image).parent == tmp_path / "ws" / "uploads"
    assert w["demo"].value == UPLOADED
    assert [k for k, v in w["demo"].options.items() if v == UPLOADED] == ["(uploaded) mine.png"]
    s._check_start(s.prompt)  # no longer refused
    mine = s.image
    w["demo"].value = 1  # another demo, then the upload again: its image again
    assert s.image != mine
    w["demo"].value = UPLOADED
    assert s.image == mine
    # a client that stops half way blocks Run only until it is seen stalled
    up._process_event(SimpleNamespace(event_name="upload_event", data={
        "name": "stalled.png", "chunk": 1, "total_chunks": 3, "data": data[:10],
        "type": "image/png"}))
    with pytest.raises(InputError, match="still uploading"):
        s._check_start(s.prompt)
    s._uploading = ("stalled.png", time.monotonic() - datastore.UPLOAD_STALL_S - 1)
    s._check_start(s.prompt)


# -- in a real browser ----------------------------------------------------------------------------
@pytest.mark.slow
def test_browser_corrupt_store_and_oversize_upload(source, tmp_path, embedded_dir):
    """``panel serve`` on a workspace with a good run and a store whose ``committed`` attribute
    is garbage (the issue's blank page): the page renders the good run and names the bad one;
    opening it shows the reason; a 50 MB upload is refused in the page with the limit, nothing
    is sent, and the session still works afterwards."""
    from test_dashboard_browser import (CHROMIUM, CHROMIUM_ARGS, PAGE_TIMEOUT_MS, _free_port,
                                        app_tracebacks, plots, start_server, stop_server,
                                        wait_for)

    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium); the browser test needs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    ws = tmp_path / "ws"
    _copy(source, ws, "good.zarr")
    _set_attrs(_copy(source, ws, "tampered.zarr"), committed="{garbage",
               created="2999-01-01T00:00:00+0000")  # newest: the one a session would show
    _link_loop(source, ws, "loop.zarr")
    huge = tmp_path / "huge.png"
    with open(huge, "wb") as f:
        f.write(_png())
        f.truncate(50 * 10**6)
    port = _free_port()
    server = start_server(ws, port)
    log = ""
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1300})
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            closed: list[str] = []
            page.on("websocket", lambda ws_: ws_.on("close", lambda *_: closed.append("closed")))
            page.goto(f"http://127.0.0.1:{port}/dashboard", wait_until="domcontentloaded")

            def good_run_drawn():
                h = plots(page).get("heatmap")
                return h if h and h["data"] and h["run"] == "good.zarr" else None

            wait_for(good_run_drawn, 40, "the good run's heatmap (a corrupt store is present)")
            note = page.get_by_text("stores in the workspace cannot be read").first
            wait_for(lambda: note.is_visible(), 10, "the unreadable stores to be named")
            for name, reason in (("tampered.zarr", "attribute 'committed' is '{garbage'"),
                                 ("loop.zarr", "symbolic link that loops")):
                item = page.locator("li", has_text=name).first
                assert item.is_visible() and reason in item.inner_text(), item.inner_text()

            # open the tampered store: the reason is shown, the good run stays drawn
            select = page.locator("select").filter(has_text="tampered").first
            label = next(o for o in select.locator("option").all_inner_texts()
                         if o.startswith("tampered"))
            select.select_option(label=label)
            page.locator(".wb-open button").first.click()
            alert = page.get_by_text("is unreadable", exact=False).first
            wait_for(lambda: alert.is_visible(), 10, "the reason the store cannot be opened")
            assert good_run_drawn()

            # a 50 MB upload: refused by the page with the limit, before it is sent
            page.locator(".wb-upload input[type=file]").first.set_input_files(str(huge))
            big = page.get_by_text("File is too large", exact=False).first
            wait_for(lambda: big.is_visible(), 15, "the upload to be refused")
            limit = page.get_by_text("Maximum file size is 5 MB", exact=False).first
            wait_for(lambda: limit.is_visible(), 15, "the refusal to state the limit")
            # nothing reached the server (it would cut the chunks off and say so itself)
            assert page.get_by_text("is larger than 5 MB", exact=False).count() == 0
            # the session is alive: a filter still redraws the heatmap from the server
            before = plots(page)["heatmap"]["title"]
            page.locator(".wb-filter-modality button", has_text="text").first.click()
            wait_for(lambda: plots(page)["heatmap"]["title"] != before, 15,
                     "the heatmap to follow the filter after the refused upload")
            assert not closed, "the websocket closed"
            out = Path(__file__).resolve().parents[1] / "test-artifacts"
            out.mkdir(exist_ok=True)
            page.screenshot(path=str(out / "dashboard-hostile.png"), full_page=True)
            browser.close()
            assert not errors, f"page errors: {errors}"
    finally:
        log = stop_server(server)
    assert "Traceback" not in app_tracebacks(log), log[-3000:]
    assert not (ws / "uploads").exists() or not any((ws / "uploads").iterdir())
