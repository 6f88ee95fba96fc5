"""Recipe study for the v2 embedded model: train candidate recipes side by side and record
held-out exact match per task kind against optimizer steps (and training seconds).

    python benchmarks/recipe_study.py run --out DIR --recipes staged,lean --device cuda \
        --seconds 480 [--ckpt-root /tmp/rs] [--experts-implementation batched_mm]
    python benchmarks/recipe_study.py table DIR [--cpu-rates vision=0.65,chat=3.8]
    python benchmarks/recipe_study.py time [--recipe staged]     # seconds per step here, per stage kind

``run`` starts one ``python -m workbench.models.embedded.v2.train --preset full`` process per
recipe (``--eval-every``/``--eval-n`` held-out evaluations; checkpoints under ``--ckpt-root``,
resumed when present, so a study can span several time-boxed calls) and stops each after
``--seconds``; their logs go to ``DIR/<recipe>.log``. ``table`` reads the ``EVAL`` lines of those
logs and prints, per recipe and evaluation, the exact match per kind and the CPU minutes those
steps would take at the given seconds per step (``--cpu-rates``: *projected* from timings
measured on the 2-core CPU machine; the accuracies are *measured*, on whatever device trained).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TRAIN = [sys.executable, "-m", "workbench.models.embedded.v2.train", "--preset", "full"]


def run(ns) -> None:
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    procs = {}
    for recipe in ns.recipes.split(","):
        ckpt = Path(ns.ckpt_root) / recipe
        argv = [*TRAIN, "--recipe", recipe, "--device", ns.device, "--eval-every", str(ns.eval_every),
                "--eval-n", str(ns.eval_n), "--checkpoint-every", str(ns.checkpoint_every),
                "--out", str(Path(ns.ckpt_root) / f"{recipe}-model"),
                "--demo-dir", str(Path(ns.ckpt_root) / f"{recipe}-demo")]
        if ns.experts_implementation:
            argv += ["--experts-implementation", ns.experts_implementation]
        argv += ["--resume", str(ckpt)] if ckpt.is_dir() and any(ckpt.glob("step-*")) else ["--checkpoint-dir", str(ckpt)]
        log = open(out / f"{recipe}.log", "a")
        procs[recipe] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"}), log)
    deadline = time.monotonic() + ns.seconds
    while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs.values()):
        time.sleep(5)
    for recipe, (proc, log) in procs.items():
        if proc.poll() is None:
            proc.terminate()  # the last checkpoint stays; the next call resumes from it
            proc.wait(30)
        log.close()
        print(recipe, "exit", proc.returncode, flush=True)


def evals(log: Path) -> list[dict]:
    return [json.loads(line[5:]) for line in log.read_text().splitlines() if line.startswith("EVAL ")]


def table(ns) -> None:
    rates = dict((k, float(v)) for k, v in (p.split("=") for p in ns.cpu_rates.split(",")))
    for log in sorted(Path(ns.dir).glob("*.log")):
        rows = evals(log)
        if not rows:
            continue
        print(f"\n## {log.stem}\n")
        kinds = [k for k in rows[-1] if k.startswith("em_")]
        print("| step | stage | CPU min (projected) | exact | " + " | ".join(k[3:] for k in kinds) + " |")
        print("|---" * (4 + len(kinds)) + "|")
        seen = set()
        for r in rows:
            if r["global_step"] in seen:
                continue  # a resumed run re-evaluates nothing, but a log may repeat a line
            seen.add(r["global_step"])
            vision_steps = min(r["global_step"], ns.vision_steps.get(log.stem, 0))
            minutes = (vision_steps * rates["vision"] + (r["global_step"] - vision_steps) * rates["chat"]) / 60
            print(f"| {r['global_step']} | {r['stage']} | {minutes:.0f} | {r['exact_match']:.3f} | "
                  + " | ".join(f"{r.get(k, float('nan')):.2f}" for k in kinds) + " |")


def time_steps(ns) -> None:
    """Seconds per optimizer step of each stage kind of the full model on this machine (a short
    run of every stage; the first steps of a stage are left out as warm-up)."""
    from dataclasses import replace

    from workbench.models.embedded.v2.train import FINISH_EXISTS, fit, initial_model, make_args

    args = make_args("full", ns.recipe, vision_steps=15, steps=16, warmup=2, log_every=5,
                     finish=(replace(FINISH_EXISTS, steps=6),))
    trainer = fit(*initial_model(args), args)
    v, c = trainer.vision_curve, trainer.chat_curve
    mixed = [e for e in c if e["stage"] == "mixed"]
    exists = [e for e in c if e["stage"] == "exists"]
    print(f"vision s/step {(v[-1]['elapsed_s'] - v[0]['elapsed_s']) / 10:.2f}")
    print(f"mixed  s/step {(mixed[-1]['elapsed_s'] - mixed[0]['elapsed_s']) / 11:.2f}")
    print(f"exists s/step {(exists[-1]['elapsed_s'] - mixed[-1]['elapsed_s']) / 6:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--recipes", default="staged,lean")
    r.add_argument("--device", default="cpu")
    r.add_argument("--seconds", type=float, default=1200)
    r.add_argument("--ckpt-root", default="/tmp/recipe-study")
    r.add_argument("--eval-every", type=int, default=100)
    r.add_argument("--eval-n", type=int, default=400)
    r.add_argument("--checkpoint-every", type=int, default=100)
    r.add_argument("--experts-implementation")
    t = sub.add_parser("table")
    t.add_argument("dir")
    t.add_argument("--cpu-rates", default="vision=0.65,chat=3.8")
    tm = sub.add_parser("time")
    tm.add_argument("--recipe", default="staged")
    ns = parser.parse_args()
    if ns.cmd == "run":
        run(ns)
    elif ns.cmd == "time":
        time_steps(ns)
    else:
        from workbench.models.embedded.v2.train import make_args
        ns.vision_steps = {}
        for log in Path(ns.dir).glob("*.log"):
            try:
                ns.vision_steps[log.stem] = make_args("full", log.stem).vision_steps
            except ValueError:
                pass
        table(ns)


if __name__ == "__main__":
    main()
