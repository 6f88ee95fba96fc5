"""Check that an embedded checkpoint is what its committed training command makes.

``python -m workbench.models.embedded.v2.rerun data/qwen3-vl-moe-small`` re-runs the command in the
checkpoint's ``training_log.json`` into a temporary folder (as long as the training itself, about
90 minutes on 2 CPU cores), compares the weight files byte for byte and the held-out scores, and
records the outcome as ``rerun_check`` in the log (the model card says it). The checkpoint's
weights are never touched; only its log and card are rewritten, each atomically.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from .card import MAX_LOG_BYTES, render_model_card

TRAIN_MODULE = "workbench.models.embedded.v2.train"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def rerun_argv(command: str, out: Path, demo_dir: Path) -> list[str]:
    """The logged ``python -m ...train`` command's arguments, writing to ``out`` / ``demo_dir``."""
    words = shlex.split(command)
    if words[:3] != ["python", "-m", TRAIN_MODULE]:
        raise ValueError(f"training_log.json command {command!r} is not 'python -m {TRAIN_MODULE} ...'")
    argv, rest = [], iter(words[3:])
    for word in rest:
        if word in ("--out", "--demo-dir"):
            next(rest, None)
            continue
        argv.append(word)
    return [*argv, "--out", str(out), "--demo-dir", str(demo_dir)]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_log(checkpoint: Path) -> dict:
    """The checkpoint's training log, checked for what a re-run needs (``ValueError`` names the
    problem): before, not after, 90 minutes of training."""
    from workbench.fileio import read_json

    log_path = checkpoint / "training_log.json"
    # the one bounded reader: a FIFO, a device or a huge file is refused, not read
    log = read_json(log_path, MAX_LOG_BYTES, str(log_path), ValueError)
    if not isinstance(log, dict) or not isinstance(log.get("command"), str) \
            or not isinstance(log.get("heldout"), dict) or not isinstance(log.get("args"), dict):
        raise ValueError(f"{log_path} lacks the 'command', 'args' and 'heldout' entries a training run writes")
    rerun_argv(log["command"], checkpoint, checkpoint)  # raises if it is not the training command
    if not (checkpoint / "model.safetensors").is_file():
        raise ValueError(f"{checkpoint} has no model.safetensors to compare with")
    return log


def _args_differ(logged: dict, now: dict) -> list[str]:
    """Training arguments that are not on the command line and whose default changed since."""
    return [f"{k}: {logged.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(logged) | set(now))
            if k not in ("out", "demo_dir") and logged.get(k) != now.get(k)]


def check(checkpoint: Path, log: dict) -> dict:
    """Re-train into a temporary folder and compare; returns the ``rerun_check`` entry."""
    from .train import main as train_main  # torch import only when a check really runs

    with tempfile.TemporaryDirectory(prefix="wb-rerun-") as tmp:
        out, demo = Path(tmp) / "model", Path(tmp) / "demo"
        new_log = train_main(rerun_argv(log["command"], out, demo))
        same_weights = sha256(out / "model.safetensors") == sha256(checkpoint / "model.safetensors")
        same_scores = new_log["heldout"] == log["heldout"]
    changed = _args_differ(log["args"], new_log["args"])
    return {
        "date": _dt.date.today().isoformat(),
        "command": log["command"],
        "identical_weights": same_weights,
        "identical_heldout_scores": same_scores,
        "changed_defaults": changed,
        "result": (
            f"`{log['command']}` re-run into a fresh folder gave "
            + ("bit-identical weights" if same_weights else "DIFFERENT weights")
            + " and "
            + ("the same held-out scores." if same_scores else "DIFFERENT held-out scores.")
            + (f" Defaults changed since: {'; '.join(changed)}." if changed else "")
        ),
    }


def check_prefix(log: dict, saved: Path) -> dict:
    """Re-run the logged command up to the step of ``saved`` (a ``step-NNNNNNN`` checkpoint the
    original run wrote, e.g. kept aside from its ``--checkpoint-dir``) and compare that
    checkpoint's bytes: weights, optimizer state and RNG states, and its state (curves and
    position) but for wall times. Returns the ``prefix_check`` entry."""
    import tempfile

    from .checkpoint import STEP_FOLDER
    from .train import main as train_main

    m = STEP_FOLDER.match(saved.name)
    if not m or not saved.is_dir():
        raise ValueError(f"{saved} is not a step-NNNNNNN checkpoint folder")
    steps = int(m.group(1))
    with tempfile.TemporaryDirectory(prefix="wb-prefix-") as tmp:
        root = Path(tmp) / "ckpt"
        argv = rerun_argv(log["command"], Path(tmp) / "model", Path(tmp) / "demo")
        train_main([*argv, "--checkpoint-dir", str(root), "--stop-after", str(steps)])
        mine = root / saved.name
        same = {name: sha256(mine / name) == sha256(saved / name)
                for name in ("weights.safetensors", "optimizer.safetensors", "rng.safetensors")}

        def timeless(path: Path):
            def strip(x):
                if isinstance(x, dict):
                    return {k: strip(v) for k, v in x.items() if k not in ("elapsed_s",)}
                if isinstance(x, list):
                    return [strip(v) for v in x]
                return x
            return strip(json.loads((path / "state.json").read_text()))

        same["state.json (but wall times)"] = timeless(mine) == timeless(saved)
    ok = all(same.values())
    return {
        "date": _dt.date.today().isoformat(), "steps": steps, "identical": ok, "compared": same,
        "result": (f"the first {steps} optimizer steps of `{log['command']}` re-run into a fresh folder gave "
                   + ("a bit-identical checkpoint (weights, AdamW state, RNG states, curves)." if ok else
                      "a DIFFERENT checkpoint: " + ", ".join(k for k, v in same.items() if not v) + " differ.")),
    }


def record(checkpoint: Path, log: dict, entry: dict, key: str = "rerun_check") -> None:
    """Store ``entry`` as the log's ``key`` and re-render the card (each file atomically)."""
    log[key] = entry
    _write_atomic(checkpoint / "training_log.json", json.dumps(log, indent=2) + "\n")
    _write_atomic(checkpoint / "README.md", render_model_card(log))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="checkpoint folder holding training_log.json")
    parser.add_argument("--prefix", type=Path, metavar="STEP_DIR",
                        help="only re-run up to this saved training checkpoint (step-NNNNNNN) and compare it")
    ns = parser.parse_args(argv)
    if not (ns.checkpoint / "training_log.json").is_file():
        parser.error(f"checkpoint {str(ns.checkpoint)!r} has no training_log.json; expected a folder written by "
                     f"python -m {TRAIN_MODULE}")
    try:
        log = read_log(ns.checkpoint)
    except ValueError as e:
        parser.error(str(e))
    if ns.prefix is not None:
        if not ns.prefix.is_dir():
            parser.error(f"--prefix {str(ns.prefix)!r} is not a folder; give a step-NNNNNNN training checkpoint")
        try:
            entry = check_prefix(log, ns.prefix)
        except ValueError as e:
            parser.error(str(e))
        print(entry["result"], flush=True)
        record(ns.checkpoint, log, entry, key="prefix_check")
        return 0 if entry["identical"] else 1
    entry = check(ns.checkpoint, log)
    print(entry["result"], flush=True)  # before writing: a read-only folder must not lose it
    record(ns.checkpoint, log, entry)
    return 0 if entry["identical_weights"] else 1


if __name__ == "__main__":
    sys.exit(main())
