"""The v2 embedded model's trainer: deterministic (the same arguments give the same bytes),
resumable bit for bit, learning, trained on data disjoint from its held-out split, scored by an
evaluator whose numbers are right, and strict about its arguments. The ``smoke`` preset (a tiny
model, a few steps of every stage, same code paths: ``initial_model`` then ``fit``, what ``main``
runs) stands in for the 90-minute run; each training here takes about a second."""

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from workbench.models.embedded.v2 import checkpoint
from workbench.models.embedded.v2.evaluate import score, token_accuracy
from workbench.models.embedded.v2.tasks import CHANCE, make_conversation, make_split, question_kind
from workbench.models.embedded.v2.train import (
    HELDOUT_SEED,
    TEXT_TRAIN_WEIGHTS,
    Interrupted,
    fit,
    initial_model,
    main,
    make_args,
    parse_args,
    stage_stream,
    stages,
    validate,
)

REPO = Path(__file__).resolve().parents[1]
SMOKE = make_args("smoke")
TRAIN_MODULE = "workbench.models.embedded.v2.train"


def _digest(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.to(torch.float16).cpu().numpy().tobytes())  # the stored bytes
    return digest.hexdigest()


def _curves(trainer) -> dict:
    """The trainer's curves without their wall-clock entries (the only part that may differ)."""
    strip = lambda curve: [{k: v for k, v in e.items() if k != "elapsed_s"} for e in curve]  # noqa: E731
    return {"vision": strip(trainer.vision_curve), "chat": strip(trainer.chat_curve), "evals": strip(trainer.evals)}


def _train(args, resume=None):
    model, tokenizer, image_processor = initial_model(args)
    trainer = fit(model, tokenizer, image_processor, args, resume=resume)
    return model, trainer


# --------------------------------------------------------------------------- determinism and resume


def test_training_is_bit_identical_on_rerun_and_follows_the_seed(torch_settings):
    model, trainer = _train(SMOKE)
    first = _digest(model)
    # every stage ran, in order, for its own (shortened) length
    assert [(e["stage"], e["step"]) for e in trainer.vision_curve] == [("vision", s) for s in (1, 2, 3)]
    assert [(e["stage"], e["step"]) for e in trainer.chat_curve] == [
        *(("mixed", s) for s in (1, 2, 3, 4)), ("exists", 1), ("exists", 2), ("color", 1), ("color", 2)]
    assert trainer.global_step == sum(s.steps for s in stages(SMOKE)) == 11
    second = _digest(_train(SMOKE)[0])
    other_seed = _digest(_train(replace(SMOKE, seed=1))[0])
    assert first == second
    assert other_seed != first  # the digest sees the training, not only the layout


def test_an_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path, torch_settings):
    # log_every=3: the interruption at global step 5 (mixed step 2 of 4) falls inside a logging
    # window, so the checkpoint's half-filled window must be restored too; step 3 ends the vision
    # stage (the next stage starts from the restored RNGs with a fresh optimizer)
    args = make_args("smoke", log_every=3)
    model, trainer = _train(args)
    whole, whole_curves = _digest(model), _curves(trainer)

    for stop, kept in ((5, ["step-0000004", "step-0000005"]), (3, ["step-0000002", "step-0000003"])):
        ckpt = tmp_path / f"ckpt-{stop}"
        with pytest.raises(Interrupted):
            _train(replace(args, checkpoint_dir=ckpt, stop_after=stop))
        assert sorted(p.name for p in ckpt.iterdir()) == kept  # every 2 steps and at the stop; the newest two kept
        newest = checkpoint.latest(ckpt)
        assert newest == ckpt / kept[-1]

        model, trainer = _train(replace(args, checkpoint_dir=ckpt), resume=newest)  # a fresh model, as after a crash
        assert trainer.global_step == 11
        assert _digest(model) == whole, stop
        assert _curves(trainer) == whole_curves, stop


def test_an_interrupted_and_resumed_cli_run_writes_the_same_model(tmp_path, torch_settings, capsys):
    def cli(name: str, *extra: str) -> dict:
        return main(["--preset", "smoke", "--out", str(tmp_path / name), "--demo-dir", str(tmp_path / f"{name}-demo"),
                     *extra])

    total = sum(s.steps for s in stages(make_args("smoke")))
    whole = cli("whole")  # stderr is no terminal here: no bar unless asked
    assert "training steps" not in capsys.readouterr().err
    ckpt = str(tmp_path / "ckpt")
    assert cli("resumed", "--checkpoint-dir", ckpt, "--stop-after", "5", "--progress") == {"interrupted": True}
    assert not (tmp_path / "resumed").exists()  # nothing published by an interrupted run
    out, err = capsys.readouterr()
    assert "training steps:" in err and f"| 5/{total} [" in err, err[-400:]  # stopped after 5
    assert "training steps" not in out  # the log stays on stdout, the bar on stderr
    resumed = cli("resumed", "--resume", ckpt, "--progress")
    err = capsys.readouterr().err
    assert "training steps: 100%" in err and f"{total}/{total} [" in err, err[-400:]  # resumed at step 5
    assert resumed["resumed"] and not whole["resumed"]
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("whole", "resumed")]
    assert weights[0] == weights[1]
    assert resumed["heldout"] == whole["heldout"]
    strip = lambda curve: [{k: v for k, v in e.items() if k != "elapsed_s"} for e in curve]  # noqa: E731
    assert strip(resumed["loss_curve"]) == strip(whole["loss_curve"])
    assert strip(resumed["vision_curve"]) == strip(whole["vision_curve"])
    assert resumed["routing_at_init"] == whole["routing_at_init"]  # carried by the checkpoint
    log = json.loads((tmp_path / "resumed" / "training_log.json").read_text())
    assert log["command"].startswith(f"python -m {TRAIN_MODULE} --preset smoke")


def test_the_loss_falls(torch_settings):
    # log_every=6 (even): every window holds three steps with a text-only batch, whose loss adds
    # to the step's, so the windows are comparable. Measured: ~6.2 -> ~5.3 over 30 steps (seeds 0-2).
    args = make_args("smoke", steps=30, finish=(), log_every=6)
    _, trainer = _train(args)
    mixed = [e for e in trainer.chat_curve if e["stage"] == "mixed"]
    assert [e["step"] for e in mixed] == [6, 12, 18, 24, 30]
    assert mixed[-1]["loss"] < mixed[0]["loss"] - 0.5
    assert mixed[-1]["ce"] < mixed[0]["ce"] - 0.5
    assert min(e["loss"] for e in mixed[1:]) < mixed[0]["loss"]


def test_a_frozen_vision_tower_is_left_untouched_by_the_chat_stages_and_thawed_after(torch_settings):
    def visual(model) -> dict:
        # fit rounds every weight to float16 at the end; compare at that precision
        return {n: p.detach().to(torch.float16).clone() for n, p in model.model.visual.named_parameters()}

    for recipe, frozen in (("frozen", True), ("staged", False)):  # staged: the control that it would show
        args = make_args("smoke", recipe, vision_steps=0)  # chat stages only: no stage may move the tower
        model, tokenizer, image_processor = initial_model(args)
        before, text_before = visual(model), model.lm_head.weight.detach().clone()
        fit(model, tokenizer, image_processor, args)
        after = visual(model)
        assert all(torch.equal(after[n], before[n]) for n in before) == frozen, recipe
        assert not torch.equal(model.lm_head.weight, text_before)  # the rest did train
        assert all(p.requires_grad for p in model.model.visual.parameters())  # thawed for whoever trains next



def test_the_hires_recipe_starts_from_a_folder_and_trains_on_both_scales(tmp_path, torch_settings):
    """Issue 39 §8: ``--recipe hires --init-from DIR`` starts from DIR's weights (not the seed's
    init), its processor keeps 1x and 2x scenes at their size, and its chat steps train."""
    from safetensors.torch import save_file

    from workbench.models.embedded.v2.tasks import make_scene

    donor, *_ = initial_model(make_args("smoke", seed=1))
    save_file({k: v.contiguous() for k, v in donor.state_dict().items()}, str(tmp_path / "model.safetensors"))
    full = make_args("full", "hires")
    assert full.scales == (1, 2) and [(s.name, s.kind) for s in stages(full) if s.steps] == [
        ("mixed", "chat"), ("color", "chat")]  # no vision warm-up: the tower is trained
    args = make_args("smoke", "hires", seed=3, init_from=tmp_path, vision_steps=0)  # smoke keeps its lengths
    model, tokenizer, image_processor = initial_model(args)
    assert all(torch.equal(p, donor.state_dict()[n]) for n, p in model.state_dict().items())
    rng = np.random.default_rng(0)
    grids = [image_processor([make_scene(rng, scale=s)[0]], return_tensors="pt")["image_grid_thw"][0].tolist()
             for s in (1, 2)]
    assert grids == [[1, 16, 16], [1, 32, 32]]
    head = model.lm_head.weight.detach().clone()
    fit(model, tokenizer, image_processor, args)
    assert not torch.equal(model.lm_head.weight, head) and torch.isfinite(model.lm_head.weight).all()
    for bad, fragment in (({"scales": (1, 9)}, "scales = (1, 9) is not allowed"),
                          ({"init_from": tmp_path / "nowhere"}, "a model folder holding model.safetensors")):
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            validate(make_args("smoke", "hires", **bad))


# --------------------------------------------------------------------------- data


def _image_key(image, question: str, answer: str) -> tuple:
    return hashlib.sha256(np.asarray(image).tobytes()).hexdigest(), question, answer


def test_heldout_and_training_streams_share_no_example():
    """No held-out request (image, question, answer) is in the first steps of any chat stage's
    training data (the exact draws of ``Trainer._chat_step``), nor any held-out image among them.

    Only image-bearing requests are compared: a text-only puzzle has a small space (e.g. 211
    arithmetic questions, 36 counting ones), so the same puzzle in both is expected and harmless
    (it is the task itself, not a memorised example)."""
    args = make_args("full")
    heldout = {_image_key(*ex) for ex in make_split(HELDOUT_SEED, 300) if ex[0] is not None}
    heldout_images = {key[0] for key in heldout}
    assert len(heldout) > 150
    chat_stages = [s for s in stages(args) if s.kind == "chat"]
    assert [s.name for s in chat_stages] == ["mixed", "exists", "color"]
    for stage in chat_stages:
        stream, weights = stage_stream(args, stage), dict(stage.families)
        seen = []
        for step in range(10):  # as Trainer._chat_step draws them: the image chats, then every other step text
            for _ in range(args.batch_size):
                image, turns = make_conversation(stream, args.image_turns, weights)
                seen += [_image_key(image, q, a) for q, a in turns]
            for _ in range(stage.text_batch_size if step % 2 else 0):
                assert make_conversation(stream, args.text_turns, TEXT_TRAIN_WEIGHTS)[0] is None
        assert len(seen) == 10 * args.batch_size
        assert not heldout & set(seen), stage.name
        assert not heldout_images & {key[0] for key in seen}, stage.name  # not even the same image
    with pytest.raises(ValueError, match="held-out"):
        validate(replace(args, seed=HELDOUT_SEED))  # the held-out seed never trains


# --------------------------------------------------------------------------- evaluator


def test_the_evaluator_scores_hand_made_predictions_right():
    img = Image.new("RGB", (8, 8))
    rows = [  # (request, prediction): exact?, token accuracy
        ((img, "what color is the circle?", "red"), "red"),  # 1, 1
        ((img, "what color is the circle?", "red"), "blue"),  # 0, 0
        ((img, "what color is the circle?", "green"), "green"),  # 1, 1
        ((img, "what color is the square?", "blue"), "blue"),  # 1, 1
        ((img, "describe the scene.", "a red circle on the left"), "a red circle on the right"),  # 0, 5/6
        ((img, "describe the scene.", "a blue square in the middle"), "a blue square in the middle"),  # 1, 1
        ((img, "read the number.", "4 0 7 1"), "4 0 7"),  # 0, 3/4 (a missing token counts)
        ((None, "what is 2 plus 3?", "5"), "5"),  # 1, 1
        ((None, "count from 1 to 4.", "1 2 3 4"), "1 2 3 4 5"),  # 0, 4/5 (an extra token counts)
    ]
    split, predictions = [r for r, _ in rows], [p for _, p in rows]
    result = score(split, predictions)
    approx = lambda x: pytest.approx(x, abs=1e-4)  # noqa: E731  (score rounds to 4 places)

    assert result["n"] == 9
    assert result["exact_match"] == approx(5 / 9)
    assert result["token_accuracy"] == approx((3 + 5 / 6 + 1 + 3 / 4 + 1 + 4 / 5) / 9)
    assert result["mean_answer_tokens"] == pytest.approx((1 + 1 + 1 + 1 + 6 + 6 + 4 + 1 + 4) / 9, abs=1e-3)
    per_kind = result["per_kind"]
    assert list(per_kind) == ["color", "describe", "read", "arith", "sequence"]  # report order, present kinds
    color = per_kind["color"]
    assert color["n"] == 4 and color["exact_match"] == approx(3 / 4) and color["token_accuracy"] == approx(3 / 4)
    assert color["majority_baseline"] == approx(2 / 4)  # "red" twice of four
    # question-only prior: "the circle?" -> red (2 of its 3), "the square?" -> blue (1 of 1)
    assert color["blind_baseline"] == approx(3 / 4)
    assert color["chance_uniform"] == CHANCE["color"] == 1 / 5
    describe = per_kind["describe"]
    assert describe["exact_match"] == approx(1 / 2) and describe["token_accuracy"] == approx((5 / 6 + 1) / 2)
    assert describe["majority_baseline"] == approx(1 / 2) and describe["blind_baseline"] == approx(1 / 2)
    assert per_kind["read"]["token_accuracy"] == approx(3 / 4) and per_kind["read"]["blind_baseline"] == 1.0
    assert per_kind["arith"]["exact_match"] == 1.0 and per_kind["arith"]["blind_baseline"] is None
    assert per_kind["sequence"]["token_accuracy"] == approx(4 / 5) and per_kind["sequence"]["blind_baseline"] is None
    # overall baselines weight each kind by its count; a text-only request counts as blind-right
    assert result["majority_baseline"] == approx((4 * 0.5 + 2 * 0.5 + 1 + 1 + 1) / 9)
    assert result["blind_baseline"] == approx((4 * 0.75 + 2 * 0.5 + 1 + 1 + 1) / 9)
    assert result["chance_uniform"] == approx(sum(CHANCE[question_kind(q)] for _, q, _ in split) / 9)
    assert {s["prediction"] for s in result["samples"]} <= set(predictions)

    assert token_accuracy(["a", "b"], ["a", "c", "d"]) == 1 / 3
    assert score(split, [a for _, _, a in split])["exact_match"] == 1.0
    with pytest.raises(ValueError, match="8 predictions for 9 requests"):
        score(split, predictions[:-1])
    with pytest.raises(ValueError):
        score([], [])


# --------------------------------------------------------------------------- arguments


def _usage_error(capsys, argv, message, call=parse_args) -> None:
    with pytest.raises(SystemExit) as exc:
        call(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_bad_trainer_arguments_are_one_clear_error_each(tmp_path, capsys):
    out = ["--out", str(tmp_path / "m"), "--demo-dir", str(tmp_path / "d")]
    _usage_error(capsys, [*out, "--steps", "-1"], "steps = -1 is not allowed: an integer in 0..1000000")
    _usage_error(capsys, [*out, "--preset", "huge"], "preset 'huge' is not one of ['full', 'smoke']")
    _usage_error(capsys, [*out, "--recipe", "magic"], "recipe 'magic' is not one of")
    _usage_error(capsys, [*out, "--resume", str(tmp_path / "nowhere")], "is not a folder")
    (tmp_path / "empty").mkdir()
    _usage_error(capsys, [*out, "--resume", str(tmp_path / "empty")], "holds no checkpoint")
    _usage_error(capsys, [*out, "--checkpoint-dir", str(REPO / "ckpt")], "is inside the repository")
    _usage_error(capsys, [*out, "--stop-after", "5"], "--stop-after needs --checkpoint-dir")  # else the run is lost
    assert not (REPO / "ckpt").exists() and not (tmp_path / "m").exists()


def test_resuming_a_checkpoint_of_other_arguments_is_refused(tmp_path, capsys, torch_settings):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Interrupted):
        _train(make_args("smoke", checkpoint_dir=ckpt, stop_after=1))
    out = ["--preset", "smoke", "--out", str(tmp_path / "m"), "--demo-dir", str(tmp_path / "d")]
    _usage_error(capsys, [*out, "--resume", str(ckpt), "--lr", "0.01"],
                 "was written by a run with other arguments (lr: 0.002 there, 0.01 here)", call=main)
    broken = tmp_path / "broken"
    (broken / "step-0000001").mkdir(parents=True)  # a checkpoint folder without its files
    _usage_error(capsys, [*out, "--resume", str(broken)], "has no weights.safetensors", call=main)
    assert not (tmp_path / "m").exists() and not (tmp_path / "d").exists()  # refused before writing anything


# --------------------------------------------------------------------------- rerun and output folders


def test_rerun_check_retrains_with_the_logged_command_into_a_fresh_folder(tmp_path):
    from workbench.models.embedded.v2.rerun import main as rerun_main
    from workbench.models.embedded.v2.rerun import rerun_argv

    logged = f"python -m {TRAIN_MODULE} --preset full --out data/m --demo-dir data/demo --steps 1300 --seed 0"
    argv = rerun_argv(logged, tmp_path / "m", tmp_path / "d")
    assert argv == ["--preset", "full", "--steps", "1300", "--seed", "0",
                    "--out", str(tmp_path / "m"), "--demo-dir", str(tmp_path / "d")]
    with pytest.raises(ValueError, match=f"is not 'python -m {TRAIN_MODULE}"):
        rerun_argv("rm -rf data", tmp_path, tmp_path)
    with pytest.raises(ValueError, match="is not 'python -m"):  # the v1 trainer's command is not this one's
        rerun_argv("python -m workbench.models.embedded.train --steps 1", tmp_path, tmp_path)
    with pytest.raises(SystemExit) as exc:
        rerun_main([str(tmp_path)])  # no training_log.json: usage error, nothing written
    assert exc.value.code == 2 and not any(tmp_path.iterdir())


def test_rerun_check_refuses_a_malformed_log_before_training(tmp_path, capsys):
    from workbench.models.embedded.v2.rerun import main as rerun_main

    log = tmp_path / "training_log.json"
    cases = {"{not json": "is not valid JSON", "[1, 2]": "must be a JSON object",
             '{"args": {}}': "lacks the 'command'",
             '{"command": "rm -rf /", "args": {}, "heldout": {}}': "is not 'python -m",
             f'{{"command": "python -m {TRAIN_MODULE} --steps 1", "args": {{}}, "heldout": {{}}}}':
                 "has no model.safetensors"}
    for text, message in cases.items():
        log.write_text(text)
        with pytest.raises(SystemExit) as exc:
            rerun_main([str(tmp_path)])
        assert exc.value.code == 2 and message in capsys.readouterr().err
        assert log.read_text() == text  # nothing rewritten


def test_training_refuses_to_replace_a_folder_it_did_not_write(tmp_path, capsys):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.tex").write_text("x")
    for flag in ("--out", "--demo-dir"):
        other = "--demo-dir" if flag == "--out" else "--out"
        _usage_error(capsys, [flag, str(precious), other, str(tmp_path / "new")], "non-empty folder this command did not write")
    (tmp_path / "file").write_text("x")
    _usage_error(capsys, ["--out", str(tmp_path / "file"), "--demo-dir", str(tmp_path / "d")],
                 "is a file, not a folder")
    assert (precious / "thesis.tex").read_text() == "x"
    args = parse_args(["--out", str(tmp_path / "new"), "--demo-dir", str(tmp_path / "d")])
    assert args.out == tmp_path / "new" and args.demo_dir == tmp_path / "d"


def test_a_finished_checkpoint_replaces_the_old_one_whole(tmp_path):
    from workbench.ownedfolder import stage, swap_in

    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("old")
    (out / "stale.bin").write_text("old")
    staging = stage(out)
    (staging / "config.json").write_text("new")
    swap_in(staging, out)
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging or old copy left


def test_a_prefix_rerun_check_compares_a_saved_training_checkpoint(tmp_path, torch_settings):
    """``rerun --prefix step-N``: the logged command re-run for N steps gives the saved
    checkpoint's bytes; the result is recorded in the log and on the card. A tampered
    checkpoint is reported different (exit 1)."""
    import shutil

    from workbench.models.embedded.v2.rerun import main as rerun_main

    out, ckpt = tmp_path / "m", tmp_path / "ckpt"
    main(["--preset", "smoke", "--out", str(out), "--demo-dir", str(tmp_path / "d"),
          "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"])
    saved = tmp_path / "step-0000006"
    shutil.copytree(ckpt / "step-0000006", saved)
    assert rerun_main([str(out), "--prefix", str(saved)]) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["prefix_check"]["identical"] and log["prefix_check"]["steps"] == 6
    assert "Prefix re-run" in (out / "README.md").read_text()
    state = json.loads((saved / "state.json").read_text())
    state["step"] += 1  # not where the re-run is after 6 steps
    (saved / "state.json").write_text(json.dumps(state))
    assert rerun_main([str(out), "--prefix", str(saved)]) == 1
    assert not json.loads((out / "training_log.json").read_text())["prefix_check"]["identical"]
