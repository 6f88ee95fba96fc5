"""Exporting a run store as a trace file (issue 37 §6): ``write_jsonl``/``write_npy`` beside
``write_plain``, ``export_trace`` / ``ds.moe.export_trace`` / ``workbench export-trace``, the
shipped sample trace and the README's replay commands run as written.

Everything runs on one real recording: the sample's own command (``workbench run --batch 4``),
a batch of three image requests and a text-only one served together by the embedded model."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import workbench
from workbench.errors import InputError, StoreExistsError
from workbench.traces import (EXPORT_FORMATS, Trace, export_trace, from_store, load_trace,
                              read_jsonl, read_npy, write_jsonl)

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "traces" / "embedded-batch4.jsonl"


@pytest.fixture(scope="module")
def batch_store(tmp_path_factory):
    """The sample's recording, made again by the command data/traces/README.md names."""
    store = tmp_path_factory.mktemp("rec") / "batch4.zarr"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "--batch", "4",
                           "--store", str(store), "--json"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return store


def _carried_equal(a: Trace, b: Trace, names=("topk_ids", "token_step", "phase",
                                             "step_request")) -> None:
    assert a.num_experts == b.num_experts
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def _weights_equal_where_routed(a: Trace, b: Trace) -> None:
    routed = a.topk_ids >= 0
    assert np.array_equal(a.topk_weights[routed].view(np.uint32),
                          b.topk_weights[routed].view(np.uint32))   # bit for bit
    assert np.isnan(b.topk_weights[~routed]).all()


# -- round trips: store → file → load_trace equals from_store on what the format carries ------
def test_jsonl_round_trip_of_a_real_batch(batch_store, tmp_path):
    tr = from_store(batch_store)
    # the batch: one prefill, then decode steps of several tokens (one per live request)
    assert tr.phase[0] == 0 and (np.bincount(tr.token_step)[1:] > 1).any()
    res = export_trace(batch_store, tmp_path / "b.jsonl")
    assert res["format"] == "jsonl" and res["bytes"] == (tmp_path / "b.jsonl").stat().st_size
    assert (res["tokens"], res["layers"], res["top_k"], res["steps"]) == (
        tr.num_tokens, 12, 4, tr.num_steps)
    assert {"token_modality", "pinned", "attrs"} <= set(res["dropped"])
    assert "topk_weights" not in res["dropped"] and "token_step" not in res["dropped"]
    back = load_trace(tmp_path / "b.jsonl", **res["read_with"])
    _carried_equal(tr, back)
    _weights_equal_where_routed(tr, back)
    assert back.attrs["position_key"] == "token_pos" and back.attrs["missing_records"] == 0
    # the same routing replays the same: the accesses a cache serves are equal
    g, h = tr.groups(), back.groups()
    for f in ("step", "layer", "ptr", "expert", "expert_tokens", "step_tokens"):
        assert np.array_equal(getattr(g, f), getattr(h, f)), f


def test_npy_and_wbtrace_round_trips_of_a_real_batch(batch_store, tmp_path):
    tr = from_store(batch_store)
    res = export_trace(batch_store, tmp_path / "b.npy")
    # decode steps of 4 tokens are no npy step structure: said, and no prefill_tokens offered
    assert {"token_step", "topk_weights", "token_modality"} <= set(res["dropped"])
    assert res["read_with"] == {"num_experts": 64}
    back = read_npy(tmp_path / "b.npy", num_experts=64)
    assert back.topk_ids.dtype == np.int16 and np.array_equal(back.topk_ids, tr.topk_ids)
    with open(tmp_path / "b.npy", "rb") as f:   # a plain array: numpy reads it without pickle
        assert np.array_equal(np.load(f, allow_pickle=False), tr.topk_ids)
    res = export_trace(workbench.open_run(batch_store), tmp_path / "b.wbtrace")
    assert res["dropped"] == ["pred_ids"] and res["format"] == "wbtrace"
    back = load_trace(tmp_path / "b.wbtrace")
    _carried_equal(tr, back, ("topk_ids", "token_step", "phase", "step_request",
                              "token_modality", "pinned"))
    assert np.array_equal(back.topk_weights.view(np.uint32), tr.topk_weights.view(np.uint32))
    assert back.attrs["model_id"] == tr.attrs["model_id"]


def test_decode_only_and_multi_request_traces_round_trip(batch_store, tmp_path):
    """The other step structures a format carries, on the same real routing: every decode
    token its own step (jsonl token_idx; npy with prefill_tokens), and two requests back to
    back (jsonl problem_id)."""
    tr = from_store(batch_store)
    P = int(np.bincount(tr.token_step)[0])
    T = tr.num_tokens
    # one prefill of P tokens, then one token per decode step: npy carries it with prefill_tokens
    solo = Trace(topk_ids=tr.topk_ids, num_experts=64, topk_weights=tr.topk_weights,
                 token_step=np.r_[np.zeros(P), np.arange(1, T - P + 1)].astype(np.int32),
                 phase=np.r_[0, np.ones(T - P)].astype(np.int8))
    res = export_trace(solo, tmp_path / "s.npy")
    assert res["read_with"] == {"num_experts": 64, "prefill_tokens": P}
    assert "token_step" not in res["dropped"]
    _carried_equal(solo, load_trace(tmp_path / "s.npy", **res["read_with"]))
    # decode only: written with token_idx, each index one decode step
    dec = Trace(topk_ids=tr.topk_ids[P:], token_step=np.arange(T - P), num_experts=64,
                topk_weights=tr.topk_weights[P:])
    back = read_jsonl(write_jsonl(dec, tmp_path / "d.jsonl"), num_experts=64)
    assert back.attrs["position_key"] == "token_idx"
    _carried_equal(dec, back)
    _weights_equal_where_routed(dec, back)
    # two requests: the second's first step is its prefill
    S = tr.num_steps
    two = Trace(topk_ids=tr.topk_ids, token_step=tr.token_step, num_experts=64,
                phase=np.r_[0, 1, 1, 0, np.ones(S - 4)].astype(np.int8),
                step_request=np.r_[0, 0, 0, np.ones(S - 3)].astype(np.int32))
    back = read_jsonl(write_jsonl(two, tmp_path / "two.jsonl"), num_experts=64)
    _carried_equal(two, back)
    assert [r["problem_id"] for r in back.attrs["requests"]] == [0, 1]


def test_what_a_format_cannot_carry_is_refused_naming_it(batch_store, tmp_path):
    tr = from_store(batch_store)
    ids = tr.topk_ids.copy()
    ids[5, 3, 2] = -1   # a token routed to 3 of its top-4 experts
    part = Trace(topk_ids=ids, token_step=tr.token_step, num_experts=64, phase=tr.phase)
    with pytest.raises(InputError, match=r"token 5 \(step 0\), layer 3 is routed to 3 of "
                                         r"top-4 .*write \.wbtrace instead"):
        write_jsonl(part, tmp_path / "p.jsonl")
    S = tr.num_steps
    back_and_forth = Trace(topk_ids=tr.topk_ids, token_step=tr.token_step, num_experts=64,
                           step_request=np.r_[0, 1, 0, np.zeros(S - 3)].astype(np.int32),
                           phase=np.r_[0, 0, 0, np.ones(S - 3)].astype(np.int8))
    with pytest.raises(InputError, match=r"requests \[0, 1, 0, .*in order 0, 1"):
        write_jsonl(back_and_forth, tmp_path / "p.jsonl")
    two_prefills = Trace(topk_ids=tr.topk_ids, token_step=tr.token_step, num_experts=64,
                         phase=np.r_[0, 0, np.ones(S - 2)].astype(np.int8))
    with pytest.raises(InputError, match=r"step 1 is prefill; .*first step of each request"):
        write_jsonl(two_prefills, tmp_path / "p.jsonl")
    w = tr.topk_weights.copy()
    w[0, 0, 1] = np.nan
    with pytest.raises(InputError, match=r"token 0, layer 0 has weights .*some NaN, some not"):
        write_jsonl(Trace(topk_ids=tr.topk_ids, token_step=tr.token_step, num_experts=64,
                          topk_weights=w, phase=tr.phase), tmp_path / "p.jsonl")
    assert not list(tmp_path.iterdir())   # nothing written, no temporary file left


def test_export_refuses_bad_paths_and_formats_and_keeps_existing_files(batch_store, tmp_path):
    out = tmp_path / "t.jsonl"
    out.write_text("mine\n")
    with pytest.raises(StoreExistsError, match=r"t\.jsonl' already exists; pass overwrite"):
        export_trace(batch_store, out)
    assert out.read_text() == "mine\n"
    with pytest.raises(InputError, match=r"format 'npy' does not match trace file .*t\.jsonl'"
                                         r", whose suffix '\.jsonl' means 'jsonl'"):
        export_trace(batch_store, out, format="npy", overwrite=True)
    with pytest.raises(InputError, match=r"format 'csv' is unknown; allowed: jsonl, npy, "
                                         r"wbtrace"):
        export_trace(batch_store, tmp_path / "t.csv", format="csv")
    with pytest.raises(InputError, match=r"cannot tell the format of trace file .*'\.txt'"):
        export_trace(batch_store, tmp_path / "t.txt")
    with pytest.raises(InputError, match=r"is a folder; give a file path"):
        export_trace(batch_store, tmp_path, format="npy")
    assert out.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
    # an unknown suffix with a format named is no mismatch; overwrite replaces the file whole
    res = export_trace(batch_store, tmp_path / "t.txt", format="jsonl")
    assert load_trace(res["path"], format="jsonl").num_tokens == res["tokens"]
    export_trace(batch_store, out, overwrite=True)
    assert load_trace(out).num_tokens == res["tokens"] and sorted(EXPORT_FORMATS) == [
        "jsonl", "npy", "wbtrace"]
    # the accessor is the same function
    ds = workbench.open_run(batch_store)
    r2 = ds.moe.export_trace(tmp_path / "acc.jsonl")
    assert (tmp_path / "acc.jsonl").read_bytes() == out.read_bytes() and r2["format"] == "jsonl"


def test_the_export_trace_command(batch_store, tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "c.wbtrace"
    assert main(["export-trace", str(batch_store), "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.startswith(f"wrote {out}: wbtrace trace of 270 tokens "
                                                     f"× 12 layers × top-4 (7 steps, 1 request)")
    assert f"{out.stat().st_size:,} bytes" in line and "--num-experts 64" in line
    assert main(["export-trace", str(batch_store), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and "Traceback" not in err
    assert main(["export-trace", str(batch_store), "--out", str(tmp_path / "c.npy"),
                 "--format", "jsonl"]) == 2
    assert "does not match" in capsys.readouterr().err and not (tmp_path / "c.npy").exists()
    assert main(["export-trace", str(out), "--out", str(tmp_path / "c.npy"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)   # a trace file converts too
    assert res["format"] == "npy" and res["tokens"] == 270
    assert main(["export-trace", str(tmp_path / "nope.zarr"), "--out",
                 str(tmp_path / "n.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


SHARED = Path(os.environ.get("WORKBENCH_SHARED") or REPO.parent / "shared")
MIXTRAL = SHARED / "data" / "traces" / "mixtral-8x7b-vllm"


@pytest.mark.skipif(not (MIXTRAL / "routing_raw.jsonl").exists(),
                    reason=f"shared Mixtral routing data not found under {MIXTRAL}")
@pytest.mark.parametrize("name, key", [("humaneval_2_routing", "token_idx"),
                                       ("routing_raw", "token_pos")])
def test_vllm_json_lines_convert_back_to_what_they_were(name, key, tmp_path):
    """Real routing recorded elsewhere (Mixtral-8x7B under vLLM, records missing): JSON lines
    → JSON lines reads back equal, with its requests' dataset and problem ids."""
    a = load_trace(MIXTRAL / f"{name}.jsonl")
    res = export_trace(MIXTRAL / f"{name}.jsonl", tmp_path / "m.jsonl")
    assert res["dropped"] == []
    b = load_trace(tmp_path / "m.jsonl", num_experts=8)
    _carried_equal(a, b)
    assert np.array_equal(np.isnan(a.topk_weights), np.isnan(b.topk_weights))
    _weights_equal_where_routed(a, b)
    assert b.attrs["position_key"] == key and b.attrs["requests"] == a.attrs["requests"]
    assert b.attrs["missing_records"] == a.attrs["missing_records"] > 0


# -- the shipped sample and the README's replay commands ----------------------------------------
def test_the_sample_trace_is_this_models_routing_of_its_command(batch_store):
    assert SAMPLE.stat().st_size < 500_000
    sample = load_trace(SAMPLE)
    fresh = from_store(batch_store)
    assert (sample.num_tokens, sample.num_steps, sample.num_experts) == (270, 7, 64), \
        "the sample is not what data/traces/README.md describes"
    # a retrained embedded model routes differently: rerun data/traces/README.md's commands
    _carried_equal(fresh, sample)


def _readme_commands() -> list[list[str]]:
    """Every ``workbench …`` line of README.md's bash blocks, continuations joined, comments
    cut, split as a shell would."""
    text = (REPO / "README.md").read_text()
    out, block = [], False
    for raw in text.replace("\\\n", " ").splitlines():
        if raw.startswith("```"):
            block = raw.strip() == "```bash"
            continue
        if block and raw.startswith("workbench "):
            out.append(shlex.split(raw, comments=True))
    return out


def test_every_replay_command_of_the_readme_runs_as_written(tmp_path, monkeypatch, capsys):
    """Run where a new user would (the repository's data/, an empty runs/): the README's
    `workbench run … --store runs/demo.zarr` first, then its export-trace and each of its
    replay lines verbatim."""
    from workbench.cli import main

    cmds = _readme_commands()
    replays = [c for c in cmds if c[1] == "replay"]
    assert len(replays) >= 3
    for c in replays:   # a trace the README names is shipped, or recorded by the README itself
        assert c[2].startswith("data/traces/") or c[2] == "runs/demo.zarr", c
    (tmp_path / "data").symlink_to(REPO / "data")
    monkeypatch.chdir(tmp_path)
    record = next(c for c in cmds if c[1] == "run" and "runs/demo.zarr" in c)
    assert main(record[1:]) == 0
    capsys.readouterr()
    for c in [c for c in cmds if c[1] == "export-trace"] + replays:
        assert main(c[1:]) == 0, c
        out = capsys.readouterr().out
        if "--json" in c:
            res = json.loads(out)
            assert res["metrics"]["accesses"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "demo.jsonl", "runs"]
