"""The CLI contract: JSON keys, exit status 2 on bad input, existing stores untouched."""

import json
import subprocess
import sys

import pytest

from workbench.cli import main

KEYS = {"text", "token_ids", "hit_rate", "hits", "misses", "loads", "latency_measured_s",
        "latency_modeled_s", "store"}


def test_run_json_has_the_contract_keys(tiny_ckpt, tmp_path, capsys):
    store = tmp_path / "r.zarr"
    rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "hello there", "--json",
               "--max-new-tokens", "4", "--set", "cache_slots=3", "--set", "eviction=lfu",
               "--store", str(store)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and KEYS <= set(out)
    assert len(out["token_ids"]) == 4 and out["store"] == str(store)
    assert out["knobs"]["cache_slots"] == 3 and out["knobs"]["eviction"] == "lfu"
    assert out["hits"] + out["misses"] > 0
    assert out["hit_rate"] == pytest.approx(out["hits"] / (out["hits"] + out["misses"]))
    assert out["loads_per_access"] == pytest.approx(out["loads"] / (out["hits"] + out["misses"]))


def test_run_prints_answer_and_summary(tiny_ckpt, capsys):
    rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "abc", "--max-new-tokens", "3",
               "--no-record"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("answer: ")
    assert "hit rate" in out and "measured:" in out and "modeled (" in out


def test_a_generated_batch_on_a_text_only_model_is_text(tiny_ckpt, capsys):
    """--batch on a text-only --model draws text-only requests unless --batch-mix asks for
    images (then refused, exit 2, naming the model as text-only)."""
    base = ["run", "--model", str(tiny_ckpt()), "--batch", "3", "--max-new-tokens", "2",
            "--no-record", "--json"]
    assert main(base) == 0
    assert len(json.loads(capsys.readouterr().out)["batch"]) == 3
    assert main([*base, "--batch-mix", "mixed"]) == 2
    assert "is text-only" in capsys.readouterr().err


def test_the_visual_calibrations_refuse_a_text_only_model(tiny_ckpt, tmp_path, capsys):
    """MACS and the VisMMOE predictor calibrate on visual tokens: a text-only model is refused
    (exit 2, one line naming it), and nothing is written."""
    ck = str(tiny_ckpt())
    assert main(["calibrate-macs", "--model", ck, "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "MACS calibration" in err and "is text-only" in err and "Traceback" not in err
    assert main(["calibrate", "--model", ck, "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "lookahead predictor" in err and "is text-only" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists() and not (tmp_path / "p").exists()


@pytest.mark.parametrize("extra, fragment", [
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt", "x", "--image", "/nonexistent/cat.png"], "image '/nonexistent/cat.png' does not exist"),
    (["--prompt", "x", "--set", "cache_slots=1"], "cache_slots must be at least 2 (top-k), not 1"),
    (["--prompt", "x", "--set", "pinned_layers=9"], "pinned_layers must be between 0 and 3"),
    (["--prompt", "x", "--set", "colour=red"], "unknown knob 'colour'"),
    (["--prompt", "x", "--set", "cache_slot=8"], "unknown knob 'cache_slot'; did you mean 'cache_slots'?"),
    (["--prompt", "x", "--set", "cache_slots=lots"], "cache_slots must be an integer"),
    (["--prompt", "x" * 300], "exceeds the model's context of 256 tokens"),
])
def test_bad_input_exits_2_with_a_clear_message(tiny_ckpt, capsys, extra, fragment):
    rc = main(["run", "--model", str(tiny_ckpt()), "--no-record", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and err.startswith("workbench: error:")


def test_unreadable_image_and_text_model_with_image(tiny_ckpt, tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--image", str(bad)]) == 2
    assert "is not a readable image" in capsys.readouterr().err
    from PIL import Image

    good = tmp_path / "good.png"
    Image.new("RGB", (8, 8)).save(good)
    assert main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--image", str(good),
                 "--no-record"]) == 2
    assert "is text-only" in capsys.readouterr().err


def test_missing_model_dir(capsys, tmp_path):
    assert main(["run", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_existing_store_is_kept_without_overwrite(tiny_ckpt, tmp_path, capsys):
    import workbench

    store = tmp_path / "keep.zarr"
    args = ["run", "--model", str(tiny_ckpt()), "--prompt", "first", "--max-new-tokens", "2",
            "--store", str(store), "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    assert main([*args[:4], "second", *args[5:]]) == 2
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before
    ds = workbench.open_run(store)
    assert ds.attrs["prompt"] == "first" and ds.sizes["step"] == len(first["token_ids"])
    assert main([*args[:4], "second", *args[5:], "--overwrite"]) == 0
    capsys.readouterr()
    assert workbench.open_run(store).attrs["prompt"] == "second"


def test_non_store_directory_is_never_overwritten(tiny_ckpt, tmp_path, capsys):
    d = tmp_path / "precious"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--store", str(d),
               "--overwrite"])
    assert rc == 2 and "not a workbench run store (it holds notes.txt)" in capsys.readouterr().err
    assert (d / "notes.txt").read_text() == "keep me"


def test_info_says_why_a_plan_has_no_cache(tiny_ckpt, capsys):
    assert main(["info", "--model", str(tiny_ckpt()), "--set", "pinned_layers=3"]) == 0  # 3 of 3 layers
    out = capsys.readouterr().out
    assert "every MoE layer is pinned: nothing is offloaded" in out and "AutoProcessor" not in out
    assert main(["info", "--model", str(tiny_ckpt()), "--set", "pinned_layers=1"]) == 0
    assert "2 offloaded layers stay in host memory" in capsys.readouterr().out


def test_a_missing_predictor_is_calibrated_into_the_workspace_not_the_model(tiny_ckpt, tmp_path, capsys):
    """prefetch=vismmoe without a calibrated predictor: the error names where `workbench calibrate
    --out` should put it, the user's workspace (never the model's folder or the package)."""
    import workbench
    from workbench.models.loading import default_model_dir

    model = default_model_dir()  # the embedded (vision) model: a text-only one is refused
    with workbench.set_options(workspace=tmp_path / "ws"):
        rc = main(["run", "--model", str(model), "--prompt", "x", "--no-record", "--set", "prefetch=vismmoe"])
    err = capsys.readouterr().err
    want = tmp_path / "ws" / "predictors"
    assert rc == 2 and f"workbench calibrate --out {want}" in err and str(model) not in err
    # a text-only model: what calibrates on visual tokens is refused with the knobs to change
    for sets, says in ((["prefetch=vismmoe"], "set predictor=none"),
                       (["dispatch=macs"], "set macs_dynamic_capacity=false")):
        rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--no-record",
                   *[a for s in sets for a in ("--set", s)]])
        err = capsys.readouterr().err
        assert rc == 2 and "is text-only" in err and says in err


def test_with_json_an_error_is_json_too(tiny_ckpt, tmp_path, capsys):
    """A script reading --json output gets its errors as one JSON object on stdout (the human
    line still goes to stderr); exit 2 as without --json."""
    for argv in (["run", "--model", str(tiny_ckpt()), "--no-record", "--prompt", "x", "--set", "cache_slot=8",
                  "--json"],
                 ["replay", str(tmp_path / "absent.jsonl"), "--json"]):
        rc = main(argv)
        out, err = capsys.readouterr()
        doc = json.loads(out)
        assert rc == 2 and doc["error"]["exit_code"] == 2 and err.startswith("workbench: error:")
        assert doc["error"]["message"] in err and doc["error"]["type"].endswith("Error")


def test_a_sweep_with_failed_points_exits_1_naming_them(tiny_ckpt, tmp_path, capsys, dask_scheduler):
    """Some points refused (Belady needs the future, a live run cannot have it), others run:
    the refused ones are named with their reason and the exit code says the sweep has holes."""
    rc = main(["sweep", "--model", str(tiny_ckpt()), "--grid", "eviction=belady,lru", "--input", "hello",
               "--out", str(tmp_path / "s"), "--scheduler", dask_scheduler, "--set", "max_new_tokens=2",
               "--set", "device=cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and "1 of 2 sweep points did not complete" in err
    assert "belady" in err and "needs the future" in err


def test_info_json_and_plan_refusal(tiny_ckpt, capsys):
    assert main(["info", "--model", str(tiny_ckpt()), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    lay = info["layout"]
    assert (lay["moe_layers"], lay["experts_per_layer"], lay["top_k"]) == (3, 8, 2)
    assert lay["shared_expert_modules"] == ["shared_expert", "shared_expert_gate"]
    plan = info["live_plan"]
    assert plan["device_bytes"] == plan["backbone_bytes"] + plan["pinned_bytes"] + plan["cache_bytes"]
    # Qwen3-VL-30B costs, every layer pinned on a 24 GB card: refused with what to change
    rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--no-record",
               "--set", "target_model=qwen3-vl-30b-a3b", "--set", "profile=rtx-3090",
               "--set", "cache_slots=1200"])
    err = capsys.readouterr().err
    assert rc == 2 and "rtx-3090" in err and "cache_slots ≤" in err


def test_console_script_and_argparse_errors_exit_2():
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "run"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--prompt" in r.stderr
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "knobs"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "cache_slots" in r.stdout


# -- found by the hostile probe (issue 10) ------------------------------------------------------
def test_a_failed_run_prints_no_answer_label(tiny_ckpt, tmp_path, capsys):
    """An error is one line on stderr; stdout does not get a dangling 'answer: '."""
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 10)
    rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--image", str(bad),
               "--no-record"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and str(bad) in err


def test_store_with_no_record_is_a_contradiction(capsys):
    rc = main(["run", "--prompt", "x", "--no-record", "--store", "runs/x.zarr"])
    assert rc == 2 and "--no-record writes no store" in capsys.readouterr().err


def test_a_closed_pipe_is_not_an_error(tiny_ckpt):
    proc = subprocess.run(
        f"{sys.executable} -m workbench.cli run --model {tiny_ckpt()} --prompt hi --no-record "
        f"--json | head -c 5", shell=True, capture_output=True, text=True)
    assert proc.stdout == '{"tex' and proc.stderr == "", proc.stderr


BAD_CALIBRATE_FLAGS = {
    "bad-steps": (["--steps", "0"], "--steps must be from 1 to 100,000, not 0"),
    "bad-seed": (["--seed", "-1"], "--seed must be from 0 to 2**32 − 1, not -1"),
    "huge-window": (["--window", "1000000000"], "--window must be from 1 to 1,048,576"),
    "huge-requests": (["--requests", "1000000000", "--steps", "1"],
                      "--requests must be from 2 to 10,000, not 1000000000"),
    "huge-tokens": (["--max-new-tokens", "100000"], "--max-new-tokens must be from 1 to 256"),
}


@pytest.mark.parametrize("case", ["dangling-link", "bad-decay", "foreign-folder",
                                  *BAD_CALIBRATE_FLAGS])
def test_calibrate_out_is_checked_before_anything_loads(tmp_path, capsys, case):
    """Every flag of calibrate is checked against the bounds a run takes the predictor with,
    before anything loads (issue 26: --seed -1 was a ValueError, --window 10⁹ wrote a
    predictor that run refused, --requests 10⁹ grew memory silently)."""
    out = tmp_path / "pred"
    extra = []
    if case == "dangling-link":
        out.symlink_to(tmp_path / "nowhere")
        want = "is a symlink to"
    elif case in BAD_CALIBRATE_FLAGS:
        extra, want = BAD_CALIBRATE_FLAGS[case]
    elif case == "bad-decay":
        extra, want = ["--decay", "nan"], "--decay must be in (0, 1], not nan"
    else:
        out.mkdir()
        (out / "thesis.tex").write_text("keep me")
        extra, want = ["--overwrite"], "not a calibrated predictor folder (it holds thesis.tex)"
    rc = main(["calibrate", "--model", "/nonexistent", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and want in err, err
    assert not (tmp_path / "nowhere").exists()
    if case == "foreign-folder":
        assert (out / "thesis.tex").read_text() == "keep me"


@pytest.mark.parametrize("text,want", [('{"a": 1}', "holds a JSON dict"),
                                       ('[{"prompt": 5}]', "entry 0"),
                                       ('[' * 100000, "not valid JSON"),
                                       ('["x"]', "entry 0")])
def test_calibrate_input_lists_are_checked(tmp_path, text, want):
    from workbench.errors import InputError
    from workbench.predictor.calibrate import parse_inputs

    f = tmp_path / "inputs.json"
    f.write_text(text)
    with pytest.raises(InputError, match=want):
        parse_inputs([str(f)], "x")


def test_live_refusals_come_before_the_model_loads(tmp_path, capsys):
    """A knob a live run refuses is reported before anything loads: even with a model folder
    that does not exist, the knob is what the error names."""
    rc = main(["run", "--model", str(tmp_path / "no-model"), "--prompt", "x", "--no-record",
               "--set", "eviction=belady"])
    err = capsys.readouterr().err
    assert rc == 2 and "eviction 'belady' needs the future" in err and "no-model" not in err


def test_a_hybrid_run_says_why_its_numbers_look_as_they_do(tiny_ckpt, capsys):
    """Hybrid on the model priced as itself runs no miss on the host, and says why; priced as
    Qwen3-VL-30B every decode miss runs there, moving nothing, and the stall is explained."""
    base = ["run", "--model", str(tiny_ckpt()), "--prompt", "hello there", "--no-record", "--set", "hybrid=true",
            "--set", "cache_slots=2", "--max-new-tokens", "3"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "hybrid: no miss ran on the host" in out and "costs of this model" in out
    assert main([*base, "--set", "target_model=qwen3-vl-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "misses ran on the host copy (no expert moved for them" in out


@pytest.mark.parametrize("argv, fragment", [
    (["run", "--bogus"], "workbench: error: unrecognized arguments: --bogus"),
    (["run", "--prompt"], "workbench run: error: argument --prompt: expected one argument"),
    (["nonsense"], "workbench: error: argument command: invalid choice: 'nonsense'"),
    (["replay"], "workbench replay: error: the following arguments are required"),
])
def test_usage_errors_are_one_line_like_every_error(argv, fragment, capsys):
    """argparse's errors printed 3-4 lines of usage (issue 26): now one line, exit 2, and a
    JSON error object with --json."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(fragment) and "--help" in err[0], err
    with pytest.raises(SystemExit):
        main([*argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["error"]["exit_code"] == 2


def test_replay_says_which_knobs_it_cannot_change_and_knobs_are_set_once(tiny_ckpt, tmp_path,
                                                                         capsys):
    """replay --set compression=… / dynamic_topk / device / max_new_tokens were silently
    ignored, and a repeated --set silently took the last (issue 26): both refused, naming it."""
    store = tmp_path / "r.zarr"
    assert main(["run", "--model", str(tiny_ckpt()), "--prompt", "hi", "--store", str(store),
                 "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    for kv in ("compression=affinity", "dynamic_topk=true", "device=cpu", "max_new_tokens=5"):
        assert main(["replay", str(store), "--set", kv]) == 2
        err = capsys.readouterr().err
        assert f"a replay cannot change {kv.split('=')[0]}" in err, err
    assert main(["replay", str(store), "--set", "eviction=lfu", "--set", "window=3"]) == 0
    capsys.readouterr()
    assert main(["replay", str(store), "--set", "cache_slots=8", "--set", "cache_slots=9"]) == 2
    assert "knob 'cache_slots' is set twice" in capsys.readouterr().err
    assert main(["info", "--set", "alpha=0.2", "--set", "alpha=0.3"]) == 2
    assert main(["run", "--prompt", "x", "--max-new-tokens", "3", "--set",
                 "max_new_tokens=4"]) == 2
    assert "max_new_tokens is given twice" in capsys.readouterr().err


def test_knobs_json_bounds_are_the_ones_enforced(capsys):
    """knobs --json "bounds" disagreed with "allowed" (missing ceilings, exclusive ends shown as
    inclusive; issue 26): each end of every range is now tried against the knobs' validation."""
    from workbench.errors import KnobError
    from workbench.knobs import Knobs

    assert main(["knobs", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    tried = 0
    for r in rows:
        if not r["bounds"]:
            continue
        for end, inclusive in zip(r["bounds"], r["inclusive"]):
            if end is None:
                continue
            tried += 1
            try:
                Knobs().set(**{r["name"]: end})
                ok = True
            except KnobError:
                ok = False
            assert ok == inclusive, (r["name"], end, r["allowed"])
    assert tried > 20
    by = {r["name"]: r for r in rows}
    assert by["prefetch_lead"]["bounds"] == [1, 256] and by["beta"]["inclusive"] == [False, True]


def test_calibrate_inputs_that_are_folders_are_named_as_such(tmp_path, capsys):
    """`calibrate --inputs DIR` said "does not exist" (issue 26): it names the real fault."""
    assert main(["calibrate", "--inputs", str(tmp_path), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "is a folder; --inputs takes image files" in err, err


def test_an_over_long_prompt_is_one_line(embedded_dir):
    """transformers printed "Token indices sequence length is longer…" before our error
    (issue 26): the error is the only line."""
    # a subprocess: transformers' log handler writes to the stderr it found at import
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "--model",
                           str(embedded_dir), "--prompt", "red " * 20000, "--no-record"],
                          capture_output=True, text=True)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "exceeds the model's context" in err[0], err


def test_run_with_realb_prints_its_ep_summary(tmp_path, capsys):
    """A ReaLB run over ranks ends with its EP summary, exit 0 (the summary reads the recorded
    routing: the live balance is not replayed) — it used to exit 2 after the run succeeded."""
    store = tmp_path / "r.zarr"
    rc = main(["run", "--prompt", "hi", "--max-new-tokens", "2", "--set", "ep_ranks=4",
               "--set", "balance=realb", "--store", str(store), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    res = json.loads(out.out)
    assert res["ep"]["ranks"] == 4 and res["ep"]["groups"] > 0 and store.exists()
