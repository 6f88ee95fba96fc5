"""Hostile input to the four regime knobs of issue 39: ``transfer_order`` (fifo | demand-first),
``offload_unit`` (expert | layerwise | layerwise-prefetch), ``capacity_scope`` (prefill | all) and
``low_precision_down_input`` (quantised | native).

Through every entry point (the CLI's ``--set`` and ``--grid``, the Python API, replay of a stored
run, the dashboard's DataStore opening one): a bad value, a combination that cannot run, or a
stored ``knob.<name>`` that is garbage gets one line naming the knob, the value and what is
allowed (the CLI exits 2), before any work; never a traceback, never a silent other result.

Found by this probe and fixed (pinned here):

- a stored fixed-choice knob with a value it does not offer (``knob.transfer_order = "nope"``,
  ``"FIFO"``, ``""``, a huge string) was read silently as :data:`~workbench.knobs.PREDATING`'s
  value, so ``workbench replay STORE`` replayed another lane order (fifo) than the knob's
  default, and the dashboard adopted it; it is refused naming the attribute;
- a bad choice's message echoed the whole value (param's wording: a 100 kB error line for a huge
  value); it is cut to 60 characters, and a case / ``_`` / typo near-miss gets "did you mean";
- a capacity-aware dispatch under ``capacity_scope=prefill`` on a trace without a prefill step
  (no recorded phases: an ``.npy``, a ``Trace`` built without ``phase``) replayed the router's
  routing and reported 0 drops as if capacity had applied; it is refused in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import distinct_ids
from workbench.errors import KnobError, StoreError
from workbench.knobs import Knobs

KNOBS = {"transfer_order": ("fifo", "demand-first"),
         "offload_unit": ("expert", "layerwise", "layerwise-prefetch"),
         "capacity_scope": ("prefill", "all"),
         "low_precision_down_input": ("quantised", "native"),
         "prism_kernel": ("auto", "fused", "per-subexpert")}
HUGE = "x" * 100_000
MAX_LINE = 400  # a message names the value cut short, not all of it


def _one_line(text: str) -> str:
    text = text.strip()
    assert "\n" not in text and "Traceback" not in text, text
    assert len(text) < MAX_LINE, f"{len(text)} characters: {text[:200]}…"
    return text


def _cli(argv, capsys) -> tuple[int, str]:
    from workbench.cli import main

    rc = main(argv)
    return rc, _one_line(capsys.readouterr().err) if rc else ""


def _allowed(knob: str) -> str:
    return "one of " + ", ".join(KNOBS[knob])


# -- 1. bad values: CLI and Python API ----------------------------------------------------------
def _cli_cases():
    for knob, values in KNOBS.items():
        for text in ("", "nope", "42", '{"a": 1}', "null", HUGE):
            yield knob, text, None
        good = values[-1]
        yield knob, good.upper(), good  # a case slip
        if "-" in good:
            yield knob, good.replace("-", "_"), good  # '_' for '-'


@pytest.mark.parametrize("knob, text, hint", list(_cli_cases()))
def test_cli_bad_value_is_one_line_exit_2(knob, text, hint, capsys):
    """``--set knob=VALUE`` with a value the knob does not offer: exit 2, one short line naming
    the knob, the value (cut) and the choices; a case or ``_``-for-``-`` slip is named."""
    rc, err = _cli(["run", "--prompt", "x", "--no-record", "--set", f"{knob}={text}"], capsys)
    assert rc == 2 and err.startswith("workbench: error:"), err
    assert knob in err and _allowed(knob) in err, err
    assert repr(text.strip()[:20])[:-1] in err, err
    if hint:
        assert f"did you mean {hint!r}" in err, err


@pytest.mark.parametrize("knob", KNOBS)
@pytest.mark.parametrize("value", [None, 42, 1.5, True, ["fifo"], {"a": 1}, b"native", "",
                                   HUGE, "Fifo "])
def test_api_bad_value_is_one_knob_error(knob, value):
    with pytest.raises(KnobError) as e:
        Knobs(**{knob: value})
    msg = _one_line(str(e.value))
    assert msg.startswith(knob) and ", ".join(KNOBS[knob]) in msg, msg


def test_surrounding_whitespace_on_the_cli_is_accepted_as_for_every_knob():
    k = Knobs().set_from_strings([" offload_unit = layerwise ", "capacity_scope= all",
                                  "transfer_order=fifo\t", "low_precision_down_input=\tnative"])
    assert (k.offload_unit, k.capacity_scope, k.transfer_order, k.low_precision_down_input) \
        == ("layerwise", "all", "fifo", "native")


# -- 2. combinations that cannot run ---------------------------------------------------------
@pytest.mark.parametrize("sets, fragment", [
    (["offload_unit=layerwise", "cache_slots=63"], "needs at least 64 slots"),
    (["offload_unit=layerwise-prefetch", "cache_slots=127"], "needs at least 128 slots"),
    (["offload_unit=layerwise", "cache_bytes=3000000"], "(61 experts)"),
    (["offload_unit=layerwise", "hybrid=true"], "hybrid must be"),
    (["offload_unit=layerwise", "prefetch=speculative", "lookahead_depth=1"],
     "prefetch must be 'none'"),
], ids=["slots<E", "prefetch-slots<2E", "bytes<E", "hybrid", "prefetch"])
def test_live_combination_refused_before_the_run(sets, fragment, embedded_dir, capsys):
    rc, err = _cli(["run", "--prompt", "x", "--no-record", "--set", "device=cpu",
                    *[a for s in sets for a in ("--set", s)]], capsys)
    assert rc == 2 and fragment in err and "offload_unit=" in err, err


# one stored run of the embedded model (2 steps: a prefill and a decode step)
@pytest.fixture(scope="module")
def store(embedded, tmp_path_factory) -> Path:
    import workbench

    path = tmp_path_factory.mktemp("regime") / "good.zarr"
    workbench.Runtime(embedded, max_new_tokens=2).run("what shape is red?", store=path)
    return path


@pytest.mark.parametrize("argv, fragment", [
    (["--scope", "per-layer", "--set", "offload_unit=layerwise"], "scope must be 'global'"),
    (["--engine", "fast", "--set", "offload_unit=layerwise"], "no compiled replay"),
    (["--set", "offload_unit=layerwise-prefetch"], "needs at least 128 slots"),
    (["--set", "offload_unit=layerwise", "--set", "prefetch=oracle"], "prefetch must be"),
], ids=["per-layer", "fast-engine", "prefetch-slots", "prefetch-policy"])
def test_replay_combination_refused(store, argv, fragment, capsys):
    rc, err = _cli(["replay", str(store), "--no-belady", *argv], capsys)
    assert rc == 2 and fragment in err, err


def _phaseless(seed=0, steps=6, per_step=10, E=8, L=3, K=2):
    """Multi-token steps with expert 0 hot (capacity binds), no ``phase``: all decode."""
    from workbench.traces import Trace

    rng = np.random.default_rng(seed)
    ts = np.repeat(np.arange(steps), per_step)
    ids = distinct_ids(rng, (len(ts), L, K), E, none_share=0.0)
    ids[:, :, 0] = 0
    ids[:, :, 1] = np.where(ids[:, :, 1] == 0, 1, ids[:, :, 1])
    return Trace(topk_ids=ids.astype(np.int16), token_step=ts, num_experts=E)


@pytest.mark.parametrize("dispatch", ["capacity-drop", "macs"])
def test_prefill_scope_on_a_trace_without_a_prefill_is_refused_not_a_silent_no_op(dispatch):
    """It dispatched nothing and reported ``dropped 0`` (capacity never applied); now refused
    in one line naming the way out; under ``all`` the same trace drops."""
    from workbench.replay import replay_trace

    tr = _phaseless()
    kw = dict(dispatch=dispatch, capacity_factor=0.5, cache_slots=8, pinned_layers=0,
              belady=False, macs_semantic_load=False, macs_reroute=False)
    with pytest.raises(KnobError) as e:
        replay_trace(tr, capacity_scope="prefill", **kw)
    msg = _one_line(str(e.value))
    assert "capacity_scope='prefill'" in msg and "capacity_scope=all" in msg, msg
    assert replay_trace(tr, capacity_scope="all", **kw).extra["dispatch"]["dropped"] > 0
    assert replay_trace(tr, dispatch="topk", cache_slots=8, pinned_layers=0,
                        belady=False).hits is not None  # no dispatch: the scope is moot


def test_npy_trace_prefill_scope_cli(tmp_path, capsys):
    """An ``.npy`` has no phases unless ``--prefill-tokens`` gives its prefill: refused without
    it (exit 2, one line), dispatched with it."""
    p = tmp_path / "t.npy"
    np.save(p, _phaseless().topk_ids)
    base = ["replay", str(p), "--no-belady", "--json", "--set", "dispatch=capacity-drop",
            "--set", "capacity_factor=0.3", "--set", "cache_slots=8", "--set", "pinned_layers=0"]
    rc, err = _cli(base, capsys)
    assert rc == 2 and "--prefill-tokens" in err, err
    assert _cli([*base, "--prefill-tokens", "30"], capsys)[0] == 0
    d = json.loads(capsys.readouterr().out)["dispatch"]
    assert d["capacity_scope"] == "prefill" and d["dropped"] > 0


def test_a_store_has_its_prefill_so_prefill_scope_replays(store):
    from workbench.replay import replay_trace

    d = replay_trace(store, belady=False, dispatch="capacity-drop", capacity_factor=0.25,
                     capacity_scope="prefill").extra["dispatch"]
    assert d["capacity_scope"] == "prefill" and d["dropped"] > 0


def test_a_dispatched_store_replayed_with_another_scope_names_the_scope(embedded, tmp_path,
                                                                        capsys):
    """A store recorded with a dispatch holds what it left: replaying it under another
    ``capacity_scope`` is refused, and the line names the scope (it named only the dispatch
    and γ0, which the user had not changed: "another dispatch cannot be replayed")."""
    import workbench

    path = tmp_path / "cd.zarr"
    workbench.Runtime(embedded, max_new_tokens=2).run(
        "what shape is red?", store=path, dispatch="capacity-drop", capacity_factor=0.5)
    rc, err = _cli(["replay", str(path), "--no-belady", "--set", "capacity_scope=all"], capsys)
    assert rc == 2 and "capacity_scope=all (recorded prefill)" in err, err
    assert _cli(["replay", str(path), "--no-belady"], capsys)[0] == 0  # as recorded: runs


def test_moot_knobs_run_and_change_nothing(embedded, store):
    """``transfer_order`` without prefetch and ``low_precision_down_input`` without low
    precision are accepted (documented: no queue to order, nothing quantised) and change
    nothing: the same replay, the same tokens."""
    import workbench
    from workbench.replay import replay_trace

    a, b = ({k: v for k, v in replay_trace(store, belady=False, transfer_order=o)
             .metrics().items() if "measured" not in k}  # the replay's own wall time differs
            for o in KNOBS["transfer_order"])
    assert a == b and "latency_s" in a, a
    rt = workbench.Runtime(embedded, max_new_tokens=2)
    t = [rt.run("what shape is red?", record=False, low_precision_down_input=v).token_ids
         for v in KNOBS["low_precision_down_input"]]
    assert t[0] == t[1]


# -- 3. stored runs whose knob.<name> is garbage -----------------------------------------------
GARBAGE = ['"nope"', '"FIFO"', '""', json.dumps(HUGE), "42", "{", "null", '["fifo"]', "true"]


@pytest.mark.parametrize("knob", KNOBS)
@pytest.mark.parametrize("text", GARBAGE, ids=["nope", "upper", "empty", "huge", "number",
                                               "not-json", "null", "list", "bool"])
def test_from_attrs_refuses_a_garbage_stored_knob_naming_it(knob, text):
    """Every garbage value is refused naming the attribute (``"nope"``, ``"FIFO"``, ``""`` and
    a huge string were read silently as the PREDATING value before)."""
    attrs = {**Knobs().to_attrs(), f"knob.{knob}": text}
    with pytest.raises(KnobError) as e:
        Knobs.from_attrs(attrs)
    msg = _one_line(str(e.value))
    assert f"'knob.{knob}'" in msg and ", ".join(KNOBS[knob]) in msg, msg


def test_a_missing_knob_still_reads_as_what_old_stores_ran():
    from workbench.knobs import PREDATING

    attrs = {a: v for a, v in Knobs().to_attrs().items() if a[5:] not in KNOBS}
    k = Knobs.from_attrs(attrs)
    assert {n: getattr(k, n) for n in KNOBS} == {n: PREDATING[n] for n in KNOBS}


def _tampered(store: Path, ws: Path, name: str, **attrs) -> Path:
    out = Path(shutil.copytree(store, ws / name))
    doc = json.loads((out / "zarr.json").read_text())
    doc["attributes"].update(attrs)
    (out / "zarr.json").write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize("knob", KNOBS)
@pytest.mark.parametrize("text", ['"nope"', json.dumps(HUGE), "{"], ids=["nope", "huge", "{"])
def test_replay_of_a_store_with_a_garbage_knob_is_one_line_exit_2(knob, text, store, tmp_path,
                                                                    capsys):
    bad = _tampered(store, tmp_path, "bad.zarr", **{f"knob.{knob}": text})
    rc, err = _cli(["replay", str(bad), "--no-belady"], capsys)
    assert rc == 2 and f"'knob.{knob}'" in err, err


def test_dashboard_opens_a_store_with_garbage_regime_knobs_and_says_why(store, tmp_path,
                                                                        caplog):
    """The run lists and opens, every view draws (or says why), taking its knobs raises one
    StoreError naming the attribute and changes no knob; nothing reaches the log as an
    error."""
    import logging

    from workbench.ui.app import build_app
    from workbench.ui.datastore import DataStore

    caplog.set_level(logging.WARNING, logger="workbench.ui")
    ws = tmp_path / "ws"
    ws.mkdir()
    _tampered(store, ws, "odd.zarr", **{"knob.transfer_order": '"nope"',
                                        "knob.offload_unit": json.dumps(HUGE),
                                        "knob.capacity_scope": '"FIFO"',
                                        "knob.low_precision_down_input": '""'})
    s = DataStore(workspace=ws, refresh_s=0.0)
    [info] = s.runs
    assert info.readable
    app = build_app(s, template=False, preload=False, poll_ms=0)
    assert s.run_name == "odd.zarr" and not s.error
    for name, v in app._wb_views.items():
        assert v.pane.object is not None, name
    before = s.knobs.to_dict()
    with pytest.raises(StoreError) as e:
        s.adopt_knobs()
    msg = _one_line(str(e.value))
    assert "odd.zarr" in msg and "'knob." in msg, msg
    assert s.knobs.to_dict() == before
    app._wb_widgets["runs"]["adopt"].clicks += 1  # the button says why; never raises
    s.poll()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]


# -- 4. sweeps ---------------------------------------------------------------------------------
@pytest.mark.parametrize("grid", [
    "transfer_order=fifo,FIFO", "offload_unit=expert,layer-wise", "capacity_scope=prefill,,x",
    "low_precision_down_input=native,quantised,native", "capacity_scope=",
    f"transfer_order=fifo,{HUGE}",
])
def test_sweep_grid_with_a_bad_value_is_refused_before_it_starts(grid, tmp_path, capsys):
    out = tmp_path / "sweep"
    rc, err = _cli(["sweep", "--out", str(out), "--grid", grid], capsys)
    assert rc == 2 and grid.split("=")[0] in err, err
    assert not out.exists()


def test_sweep_api_grid_with_a_bad_value_is_refused(tmp_path):
    from workbench.analysis.sweep import sweep

    with pytest.raises(KnobError) as e:
        sweep({"offload_unit": ["expert", 42]}, ["x"], out=tmp_path / "s")
    assert "offload_unit" in _one_line(str(e.value))
    assert not (tmp_path / "s").exists()


def test_sweep_point_that_cannot_run_is_refused_and_the_good_kept(embedded_dir):
    """A layer-wise point whose cache holds less than a layer is refused before any cluster
    starts (the sweep records it as failed); the expert point beside it is kept."""
    from workbench.analysis.sweep import check_points

    base = dict(cache_slots=32, max_new_tokens=2, device="cpu")
    points = [{"id": u, "grid": {"offload_unit": u},
               "knobs": Knobs(offload_unit=u, transfer_order="fifo", **base).to_dict()}
              for u in KNOBS["offload_unit"]]
    refused = check_points(None, points)
    assert sorted(refused) == ["layerwise", "layerwise-prefetch"]
    for e in refused.values():
        assert "slots" in _one_line(str(e))
