"""Hostile inputs to the v2 trainer (issue 36, sections 1 and 2): it never writes over a folder it
did not write, never lets two runs share a folder, refuses every out-of-range argument before it
builds anything, refuses a tampered checkpoint whole (one error naming it and the first bad
entry), and reports a failed write in one line with nothing half written left. Every training
here uses the ``smoke`` preset (about a second)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workbench import ownedfolder
from workbench.models.embedded.v2 import V2_DEMO_DIR, V2_MODEL_DIR, checkpoint
from workbench.models.embedded.v2.evaluate import routing_stats
from workbench.models.embedded.v2.tasks import make_split
from workbench.models.embedded.v2.train import (
    HELDOUT_SEED,
    TRAIN_MODULE,
    Interrupted,
    Trainer,
    TrainingError,
    fit,
    initial_model,
    main,
    make_args,
    parse_args,
)

REPO = Path(__file__).resolve().parents[1]


def _refused(capsys, argv, *fragments, call=parse_args) -> str:
    with pytest.raises(SystemExit) as exc:
        call(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


def _tree(path: Path) -> dict:
    """Every file under ``path`` with its bytes' digest (what must stay as it was)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _smoke(tmp_path: Path, *extra: str) -> list[str]:
    return ["--preset", "smoke", *extra]


# --------------------------------------------------------------------------- 1. data loss


def test_out_is_replaced_only_when_the_trainer_wrote_it_or_with_overwrite(tmp_path, capsys, torch_settings):
    shipped = _tree(V2_DEMO_DIR), _tree(V2_MODEL_DIR)
    # a Hugging Face folder with the user's notes: refused up front, untouched
    hf = tmp_path / "hf"
    (hf / "workbench").mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "notes.txt").write_text("mine")
    before = _tree(hf)
    _refused(capsys, _smoke(tmp_path, "--out", str(hf)), f"--out {str(hf)!r} is a non-empty folder this command did "
             "not write", "pass --overwrite")
    assert _tree(hf) == before

    # a fresh --out, no --demo-dir: the demo requests go beside it, never into the shipped data/demo
    out = tmp_path / "m"
    main(_smoke(tmp_path, "--out", str(out)))
    assert (out / "model.safetensors").is_file() and (tmp_path / "m-demo" / "prompts.json").is_file()
    assert ownedfolder.foreign_entries(out, TRAIN_MODULE) == []  # provably the trainer's
    assert ownedfolder.foreign_entries(tmp_path / "m-demo", TRAIN_MODULE) == []
    # ... so a second run replaces it without --overwrite; once the user adds a file, it is refused
    main(_smoke(tmp_path, "--out", str(out), "--seed", "1"))
    assert json.loads((out / "training_log.json").read_text())["args"]["seed"] == 1
    (out / "notes.txt").write_text("mine")
    _refused(capsys, _smoke(tmp_path, "--out", str(out)), "it holds notes.txt", "pass --overwrite")

    # --overwrite replaces a foreign folder whole (atomically: staged, then swapped in)
    main(_smoke(tmp_path, "--out", str(hf), "--overwrite"))
    assert not (hf / "notes.txt").exists() and (hf / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging, old copy, lock
    assert (_tree(V2_DEMO_DIR), _tree(V2_MODEL_DIR)) == shipped


def test_the_shipped_folders_need_overwrite_and_demo_files_go_beside_out(tmp_path, capsys):
    # the shipped model holds workbench/macs, which the trainer does not write: the default --out
    # (and its default demo folder, the shipped data/demo) are replaced only with --overwrite
    _refused(capsys, ["--preset", "smoke"], f"--out {str(V2_MODEL_DIR)!r} is a non-empty folder", "--overwrite")
    args = parse_args(["--preset", "smoke", "--overwrite"])
    assert (args.out, args.demo_dir) == (V2_MODEL_DIR, V2_DEMO_DIR)
    args = parse_args(["--preset", "smoke", "--out", str(tmp_path / "x" / "m")])
    assert args.demo_dir == tmp_path / "x" / "m-demo"
    _refused(capsys, ["--preset", "smoke", "--out", str(REPO), "--overwrite"], "holds the repository")


@pytest.mark.parametrize("argv, fragment", [
    (["--out", ""], "argument --out: '' is not a folder path"),
    (["--out", "   "], "argument --out: '   ' is not a folder path"),
    (["--demo-dir", "", "--out", "m"], "argument --demo-dir: '' is not a folder path"),
    (["--checkpoint-dir", " ", "--out", "m"], "argument --checkpoint-dir: ' ' is not a folder path"),
    (["--out", "."], "is the current folder or holds it"),
    (["--out", "../m", "--demo-dir", "."], "--demo-dir"),
    (["--out", "../m", "--demo-dir", "sub/.."], "is the current folder or holds it"),
    (["--out", "../m", "--checkpoint-dir", "."], "--checkpoint-dir '"),
])
def test_the_current_folder_or_a_blank_path_is_never_replaced(tmp_path, capsys, monkeypatch, argv, fragment):
    # a blank --out was the current folder, replaced whole under --overwrite (the user's files gone)
    here = tmp_path / "here"
    (here / "sub").mkdir(parents=True)
    (here / "precious.txt").write_text("p")
    monkeypatch.chdir(here)
    before = _tree(here)
    _refused(capsys, ["--preset", "smoke", *argv, "--overwrite"], fragment)
    _refused(capsys, ["--preset", "smoke", "--out", str(here.parent), "--overwrite"], "the current folder or holds it")
    assert _tree(here) == before and sorted(p.name for p in here.iterdir()) == ["precious.txt", "sub"]
    with pytest.raises(ownedfolder.FolderError, match="is the current folder"):  # Python callers too
        from workbench.models.embedded.v2.train import check_paths
        check_paths(make_args("smoke", out=Path(""), overwrite=True))


def test_unusable_output_paths_are_one_line(tmp_path, capsys):
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    long = str(tmp_path / ("a" * 5000))
    m = str(tmp_path / "m")
    _refused(capsys, ["--preset", "smoke", "--out", str(tmp_path / "loop1")], "--out", "symlink loop")
    _refused(capsys, ["--preset", "smoke", "--out", str(tmp_path / "loop1" / "m")], "--out", "symlink loop")
    err = _refused(capsys, ["--preset", "smoke", "--out", long], "--out", "File name too long")
    assert len(err.splitlines()[-1]) < 400
    for flag in ("--out", "--checkpoint-dir", "--demo-dir"):
        argv = ["--out", m, flag, str(tmp_path / "dangling")] if flag != "--out" else ["--out", str(tmp_path / "dangling")]
        _refused(capsys, ["--preset", "smoke", *argv], f"{flag} {str(tmp_path / 'dangling')!r} is a symlink to",
                 "which does not exist")
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "m").exists()


def test_a_foreign_checkpoint_dir_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("mine")
    m = str(tmp_path / "m")
    _refused(capsys, ["--preset", "smoke", "--out", m, "--checkpoint-dir", str(ckpt), "--overwrite"],
             f"--checkpoint-dir {str(ckpt)!r} holds what this trainer did not write ('notes.txt')")
    (ckpt / "notes.txt").unlink()
    (ckpt / "step-0000003").mkdir()
    (ckpt / ".step-0000004.partial").mkdir()
    assert parse_args(["--preset", "smoke", "--out", m, "--checkpoint-dir", str(ckpt)]).checkpoint_dir == ckpt


def test_overlapping_output_and_checkpoint_folders_are_refused(tmp_path, capsys):
    d = str(tmp_path / "d")
    cases = [
        (["--out", d, "--demo-dir", d], "--out and --demo-dir are the same folder"),
        (["--out", d, "--demo-dir", str(tmp_path / "x"), "--checkpoint-dir", d],
         "--out and --checkpoint-dir are the same folder"),
        (["--out", d, "--demo-dir", d + "/demo"], f"--demo-dir {d + '/demo'!r} is inside --out {d!r}"),
        (["--out", d + "/m", "--demo-dir", str(tmp_path / "x"), "--checkpoint-dir", d],
         f"--out {d + '/m'!r} is inside --checkpoint-dir {d!r}"),
    ]
    for argv, message in cases:
        _refused(capsys, ["--preset", "smoke", *argv], message, "must be apart")
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_folder_has_one_writer(tmp_path, capsys, torch_settings):
    """A second trainer on the same --checkpoint-dir (or --out) fails at once, naming the holder;
    the first one's checkpoints stay."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "m"
    with pytest.raises(Interrupted):
        model, tokenizer, image_processor = initial_model(make_args("smoke"))
        fit(model, tokenizer, image_processor, make_args("smoke", checkpoint_dir=ckpt, stop_after=2))
    kept = _tree(ckpt)
    # another process holds the lock (a real one: flock is per open file, so a child's lock counts)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from workbench import ownedfolder;"
         "[ownedfolder.lock(Path(p), 'x') for p in sys.argv[1:]]; print('held', flush=True); sys.stdin.read()",
         str(ckpt), str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        _refused(capsys, _smoke(tmp_path, "--out", str(tmp_path / "m2"), "--resume", str(ckpt)),
                 f"--checkpoint-dir {str(ckpt)!r} is being written by another process (pid {holder.pid}",
                 call=main)
        _refused(capsys, _smoke(tmp_path, "--out", str(out)), f"--out {str(out)!r} is being written by another "
                 f"process", call=main)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert _tree(ckpt) == kept and not out.exists()


# --------------------------------------------------------------------------- 2. arguments


@pytest.mark.parametrize("argv, fragment", [
    (["--lr", "1e308"], "lr = 1e+308 is not allowed: a number in (0, 1]"),
    (["--lr", "nan"], "lr = nan is not allowed"),
    (["--seed", "18446744073709551616"], "seed = 18446744073709551616 is not allowed: an integer in 0..4294967295"),
    (["--experts-implementation", "bogus"], "experts_implementation = 'bogus' is not allowed: one of"),
    (["--heldout-n", "1000000000"], "heldout_n = 1000000000 is not allowed: an integer in 1..10000"),
    (["--batch-size", "1000000000"], "batch_size = 1000000000 is not allowed: an integer in 1..512"),
    (["--eval-n", "0"], "eval_n = 0 is not allowed"),
    (["--stop-after", "0"], "stop_after = 0 is not allowed"),
    (["--device", "cudaX"], "device = 'cudaX' is not allowed"),
    (["--device", "cuda:99"], "device = 'cuda:99' is not available here"),
])
def test_out_of_range_arguments_are_refused_before_anything_is_built(tmp_path, capsys, argv, fragment):
    _refused(capsys, ["--preset", "smoke", "--out", str(tmp_path / "m"), *argv], fragment)
    assert not any(tmp_path.iterdir())


def test_checkpoint_dir_that_is_a_file_is_refused_up_front(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    for ckpt in (tmp_path / "f", tmp_path / "f" / "sub"):
        _refused(capsys, ["--preset", "smoke", "--out", str(tmp_path / "m"), "--checkpoint-dir", str(ckpt)],
                 f"--checkpoint-dir {str(ckpt)!r}", "is a file, not a folder")
    assert (tmp_path / "f").read_text() == "x"


def test_help_states_every_numeric_bound(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split()).split("options:", 1)[1]  # past the usage line
    for flag, bound in (("--heldout-n", "1..10000"), ("--batch-size", "1..512"), ("--lr", "(0, 1]"),
                        ("--seed", "0..4294967295"), ("--stop-after", "1..10000000"), ("--eval-every", "0..1000000")):
        assert bound in text.split(flag + " ", 1)[1].split(" --", 1)[0], flag


def test_a_diverging_run_stops_with_one_clear_error(torch_settings):
    args = make_args("smoke")
    model, tokenizer, image_processor = initial_model(args)
    with torch.no_grad():
        model.model.visual.patch_embed.proj.weight[0].fill_(float("nan"))  # what an LR far too high does
    with pytest.raises(TrainingError, match=r"training loss became nan at step 1 of stage 'vision'.*lower --lr"):
        fit(model, tokenizer, image_processor, args)


# --------------------------------------------------------------------------- 2. checkpoints


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A real checkpoint of a smoke run stopped at global step 5 (mixed stage, step 2), with the
    routing statistics at init that ``main`` stores in it."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    ckpt = tmp_path_factory.mktemp("ckpt")
    args = make_args("smoke", checkpoint_dir=ckpt, stop_after=5)
    model, tokenizer, image_processor = initial_model(args)
    extra = {"routing_at_init": routing_stats(model, tokenizer, image_processor,  # as main stores it
                                              make_split(HELDOUT_SEED, args.routing_n), args.eval_batch)}
    with pytest.raises(Interrupted):
        fit(model, tokenizer, image_processor, args, extra=extra)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    return ckpt / "step-0000005"


def _state(folder: Path, change) -> None:
    state = json.loads((folder / "state.json").read_text())
    change(state)
    (folder / "state.json").write_text(json.dumps(state))


def _tensors(folder: Path, name: str, change) -> None:
    tensors = load_file(folder / name)
    change(tensors)
    save_file(tensors, folder / name)


def _first_weight(t: dict) -> str:
    return sorted(k for k in t if not k.startswith("probe."))[0]


TAMPERING = {
    "optimizer keys malformed": (lambda f: _tensors(f, "optimizer.safetensors", lambda t: t.update(
        {"x.exp_avg": t.pop("0.exp_avg")})), "optimizer.safetensors entry 'x.exp_avg' is not"),
    "a tensor of the wrong shape": (lambda f: _tensors(f, "weights.safetensors", lambda t: t.update(
        {_first_weight(t): t[_first_weight(t)].flatten()})), "weights.safetensors entry"),
    "an int32 weight": (lambda f: _tensors(f, "weights.safetensors", lambda t: t.update(
        {_first_weight(t): t[_first_weight(t)].to(torch.int32)})), "is torch.int32"),
    "all-NaN weights": (lambda f: _tensors(f, "weights.safetensors", lambda t: t.update(
        {k: torch.full_like(v, float("nan")) for k, v in t.items()})), "holds NaN or infinite values"),
    "an RNG state of the wrong dtype": (lambda f: _tensors(f, "rng.safetensors", lambda t: t.update(
        {"torch_cpu": t["torch_cpu"].float()})), "rng.safetensors entry 'torch_cpu' is torch.float32"),
    "an RNG state missing": (lambda f: save_file({"other": torch.zeros(1)}, f / "rng.safetensors"),
                             "rng.safetensors entry 'torch_cpu' is missing"),
    "a Python RNG state broken": (lambda f: _state(f, lambda s: s["rng"].update(python=[3, [1, 2], None])),
                                  "'rng.python' is not a Python random state"),
    "a 100 000-deep state.json": (lambda f: (f / "state.json").write_text("[" * 100_000 + "]" * 100_000),
                                  "state.json is not JSON (nested deeper than 64 levels"),
    "state.json without optimizer": (lambda f: _state(f, lambda s: s.pop("optimizer")),
                                     "state.json entry 'optimizer' is missing"),
    "rng not a mapping": (lambda f: _state(f, lambda s: s.update(rng=[1, 2])), "state.json entry 'rng' is [1, 2]"),
    "an empty optimizer state": (lambda f: save_file({}, f / "optimizer.safetensors"),
                                 "optimizer.safetensors is empty after step 2 of stage 'mixed'"),
    "a 100 000-character stage name": (lambda f: _state(f, lambda s: s.update(stage_name="x" * 100_000)),
                                       "'stage_name' = 'xxxx"),
    "stage 99": (lambda f: _state(f, lambda s: s.update(stage=99)), "'stage' = 99 is not a stage of this recipe"),
    "step -5": (lambda f: _state(f, lambda s: s.update(step=-5)), "'step' = -5 is not a step of stage 'mixed'"),
    "a global step off": (lambda f: _state(f, lambda s: s.update(global_step=4)), "'global_step' = 4 is not the 5"),
    "optimizer groups changed": (lambda f: _state(f, lambda s: s["optimizer"]["param_groups"][0].update(eps=1.0)),
                                 "'optimizer.param_groups[0].eps' = 1.0 is not this stage's 1e-08"),
    "a window of another kind": (lambda f: _state(f, lambda s: s.update(window={"vision": 0.0, "align": 0.0,
                                                                                  "n": 0})),
                                 "'window' is not a chat stage's logging window"),
    "a curve entry without its loss": (lambda f: _state(f, lambda s: s["chat_curve"][0].pop("loss")),
                                       "'chat_curve[0]' is not an entry this trainer logs"),
    "routing at init cut short": (lambda f: _state(f, lambda s: s["extra"]["routing_at_init"]["per_layer"].pop()),
                                  "'extra.routing_at_init' does not hold one entry per layer (2)"),
}


def test_every_tampering_of_a_checkpoint_is_refused_naming_the_entry(saved_checkpoint, tmp_path, torch_settings):
    args = make_args("smoke", checkpoint_dir=saved_checkpoint.parent)
    model, tokenizer, image_processor = initial_model(args)
    trainer = Trainer(model, tokenizer, image_processor, args)
    intact = tmp_path / "intact" / saved_checkpoint.name
    shutil.copytree(saved_checkpoint, intact)
    assert trainer.load(intact)["global_step"] == 5  # the control: an untouched copy resumes
    for name, (tamper, fragment) in TAMPERING.items():
        folder = tmp_path / name.replace(" ", "-") / saved_checkpoint.name
        shutil.copytree(saved_checkpoint, folder)
        tamper(folder)
        with pytest.raises(checkpoint.CheckpointError) as exc:
            Trainer(model, tokenizer, image_processor, args).load(folder)
        message = str(exc.value)
        assert message.startswith(f"checkpoint {str(folder)!r}"), (name, message)
        assert fragment in message, (name, message)
        assert len(message) < 1000, (name, len(message))  # values read from the file are shortened


def test_resume_with_stop_after_at_or_below_its_step_is_refused(saved_checkpoint, tmp_path, capsys):
    for stop in ("5", "3"):
        _refused(capsys, ["--preset", "smoke", "--out", str(tmp_path / "m"), "--resume", str(saved_checkpoint.parent),
                          "--stop-after", stop], f"--stop-after {stop} is at or below", "(5)")
    assert parse_args(["--preset", "smoke", "--out", str(tmp_path / "m"), "--resume", str(saved_checkpoint.parent),
                       "--stop-after", "6"]).stop_after == 6


def test_resuming_a_tampered_checkpoint_from_the_cli_is_one_line(saved_checkpoint, tmp_path, capsys, torch_settings):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, ckpt / saved_checkpoint.name)
    _state(ckpt / saved_checkpoint.name, lambda s: s.update(stage=99))
    err = _refused(capsys, _smoke(tmp_path, "--out", str(tmp_path / "m"), "--resume", str(ckpt)),
                   "'stage' = 99 is not a stage", call=main)
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m").exists() and not (tmp_path / "m-demo").exists()


# --------------------------------------------------------------------------- 2. failed writes


def _limited(limit: int, *argvs: list[str]) -> list[tuple[int, str]]:
    """The trainer's CLI entry point run on each of ``argvs`` in one child (one torch import)
    whose files may not grow past ``limit`` bytes (SIGXFSZ ignored, so a write fails with EFBIG
    as on a full disk); per run its exit status and what it wrote to stderr."""
    code = ("import json, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            f"from {TRAIN_MODULE} import main\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    try:\n        main(argv); code = 0\n"
            "    except SystemExit as e:\n        code = e.code\n"
            "    print(f'@@exit {code}', file=sys.stderr, flush=True)\n")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"})
    assert run.returncode == 0, run.stderr
    parts = run.stderr.split("@@exit ")  # run i's stderr, then "@@exit <its code>"
    texts = [parts[0], *(p.split("\n", 1)[1] for p in parts[1:-1])]
    return [(int(p.split("\n", 1)[0]), text.strip()) for p, text in zip(parts[1:], texts)]


def test_a_failed_write_is_one_line_and_leaves_nothing_half_written(saved_checkpoint, tmp_path):
    """A checkpoint that does not fit (the previous one stays, no partial folder), then a model
    that does not fit (--out, the trainer's own, and --demo-dir as they were, no staging left)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, ckpt / saved_checkpoint.name)
    out, demo = tmp_path / "out" / "m", tmp_path / "out" / "m-demo"
    for folder in (out, demo):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        ownedfolder.write_manifest(folder, TRAIN_MODULE)
    kept, before = _tree(ckpt), _tree(tmp_path / "out")
    (code1, err1), (code2, err2) = _limited(
        100_000, ["--preset", "smoke", "--out", str(tmp_path / "m"), "--resume", str(ckpt)],
        ["--preset", "smoke", "--out", str(out)])

    assert code1 == 2 and "Traceback" not in err1, err1
    line = err1.splitlines()[-1]
    assert line.startswith("error: checkpoint ") and "File too large" in line, err1
    assert f"the previous checkpoint {str(ckpt / saved_checkpoint.name)!r} is intact" in line
    assert _tree(ckpt) == kept and sorted(p.name for p in ckpt.iterdir()) == [saved_checkpoint.name]

    assert code2 == 2 and "Traceback" not in err2, err2
    line = err2.splitlines()[-1]
    assert line.startswith(f"error: --out {str(out)!r}: the model could not be written"), err2
    assert "File too large" in line and "--out and --demo-dir are as they were" in line
    assert _tree(tmp_path / "out") == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m", "m-demo"]
