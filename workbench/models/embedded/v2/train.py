"""Train a v2 embedded Qwen3-VL-MoE on generated tasks, deterministically, resumably.

Usage::

    python -m workbench.models.embedded.v2.train --preset full --out DIR [--demo-dir DIR] [--overwrite]
        [--recipe NAME] [--checkpoint-dir DIR --checkpoint-every N] [--resume DIR] [--device cpu|cuda]

What it does, in order:

1. builds the word-level tokenizer, the PIL image processor and a ``Qwen3VLMoeConfig`` of the
   preset's size (:mod:`.model`; ``full``: 12 decoder layers, each a 64-expert top-4 MoE);
2. trains ``Qwen3VLMoeForConditionalGeneration`` from scratch through the recipe's
   :class:`Stage` s: a vision-only warm-up (per-patch label and word-alignment losses,
   :class:`VisionProbe`), a mixed chat stage (answer cross-entropy + the model's router
   load-balancing loss + the vision losses), then the recipe's finishing stages;
3. rounds the weights to float16 (the stored dtype) and evaluates greedy generation on a
   held-out split (:mod:`.evaluate`): exact match and token accuracy per task kind, chance and
   blind baselines beside each, per-layer routing statistics of image vs text tokens;
4. writes the checkpoint, tokenizer, image processor, ``training_log.json`` and the model card
   ``README.md`` (:mod:`.card`) to ``--out`` and the demo requests to ``--demo-dir`` (default:
   ``<out>-demo`` beside ``--out``; ``data/demo`` beside the default ``--out``), each staged and
   swapped in whole.

Where it writes (:mod:`workbench.ownedfolder`): ``--out`` and ``--demo-dir`` are replaced whole, so
each must be new, empty, or provably written by this trainer before (it holds the trainer's
``workbench_written.json`` and nothing that file does not list); anything else only with
``--overwrite``. The default ``--out``, the shipped ``data/qwen3-vl-moe-small``, is not provably
the trainer's (it also holds ``workbench/macs``, a MACs calibration the trainer does not write and
retraining makes stale), so regenerating it in place needs ``--overwrite``, as does the shipped
``data/demo``: without it nothing in the repository is written. Output, demo and checkpoint
folders may not be one folder or nested, and each has one writer at a time (a lock). Every
argument is checked against its bounds (``--help``) before anything is built; a failed write
(disk full, file too large) is one line and leaves the old folders and the previous checkpoint as
they were.

Checkpoints (``--checkpoint-dir``, every ``--checkpoint-every`` optimizer steps counted over all
stages) hold the model, the probe, the stage's AdamW state, the position in the LR schedule and
every RNG state (the stage's data stream, numpy's, Python's and torch's), so ``--resume DIR``
continues bit for bit as if never interrupted (tests/test_v2_training.py). A checkpoint is checked
whole before it is resumed (names, shapes, dtypes, finite values, counters in range, the optimizer's
groups, every RNG state); a tampered one is refused naming its first bad entry.

Determinism: fixed seeds, ``torch.set_num_threads(2)`` and
``torch.use_deterministic_algorithms(True)``; the same command on the same software stack and
device reproduces the same weights and metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import SafetensorError
from transformers import Qwen2VLImageProcessorPil, Qwen3VLMoeForConditionalGeneration

from workbench import ownedfolder
from workbench.errors import WorkbenchError
from workbench.fileio import shorten
from workbench.progress import bar, wanted
from workbench.telemetry.destination import follow_link

from . import V2_DEMO_DIR, V2_MODEL_DIR, checkpoint
from .card import render_model_card
from .evaluate import evaluate, routing_stats
from .model import (
    FULL_SIZE,
    IMAGE_PIXELS,
    MERGE_SIZE,
    PATCH_SIZE,
    TEMPORAL_PATCH_SIZE,
    SMOKE_SIZE,
    TOKENS_PER_IMAGE,
    ModelSize,
    build_config,
    build_generation_config,
    build_image_processor,
    build_v2_tokenizer,
    encode_batch,
    encode_conversations,
)
from .tasks import (
    COLORS,
    DIGITS,
    LABEL_HEADS,
    QUESTION_KINDS,
    SHAPES,
    SHORT_KINDS,
    TEXT_KINDS,
    make_conversation,
    make_demo,
    make_digit_strip,
    make_scene,
    make_split,
    question_kind,
    SCALES,
)

HELDOUT_SEED = 20_251_121
"""Seed of the held-out evaluation split (never used for training)."""
DEMO_SEED = 7_777
"""Seed of the demo requests."""

TRAIN_FAMILY_WEIGHTS = {SHORT_KINDS: 0.5, ("describe",): 0.2, ("read",): 0.3}
"""Mixed-stage mix of the image chats. Text-only chats come in a second batch of their own
every other step (``text_batch_size``): padded to their own length, not to an image chat's,
they cost a fraction of an image chat (in a shared batch 80 % of a text row was padding)."""
TEXT_TRAIN_WEIGHTS = {TEXT_KINDS: 1.0}

Families = tuple[tuple[tuple[str, ...], float], ...]


@dataclass(frozen=True)
class Stage:
    """One stage of a recipe: ``steps`` optimizer steps with fresh AdamW state and its own
    schedule and data stream.

    ``kind`` is ``"vision"`` (the vision tower, the word embeddings and the probe alone, on
    generated images: probe + alignment losses, warm-up then a constant LR) or ``"chat"`` (the
    whole model on chats: answer cross-entropy + router loss, plus the vision losses when
    ``vision_losses``; warm-up then cosine decay to ``lr * min_lr_ratio``). ``families`` pairs a
    family of kinds with its share of a chat stage's image chats; ``text_batch_size`` text-only
    chats come every other step (0: none). ``lr``/``warmup``/``batch_size`` ``None`` take
    :class:`TrainArgs`' values."""

    name: str
    steps: int
    kind: str = "chat"
    families: Families = ()
    text_batch_size: int = 0
    vision_losses: bool = False
    lr: float | None = None
    warmup: int | None = None
    batch_size: int | None = None


def _families(weights: dict) -> Families:
    return tuple((tuple(k), float(v)) for k, v in weights.items())


# Measured on the v5 weights of the earlier attempt (mixed stage only): 'exists' stayed at the
# blind baseline and 'color' named another object's colour, whatever their share of a mixed batch
# (up to 70 %); a batch of nothing but 'exists' questions taught it in ~150 steps, then colour
# and existence together, the other kinds kept in the mix so none is forgotten.
FINISH_EXISTS = Stage("exists", 150, families=((("exists",), 1.0),), lr=1e-3, warmup=10)
FINISH_COLOR = Stage("color", 400, families=((("color", "exists"), 0.7), (SHORT_KINDS, 0.1), (("describe",), 0.1),
                                              (("read",), 0.1)), text_batch_size=48, lr=1e-3, warmup=10)


@dataclass(frozen=True)
class TrainArgs:
    """Training hyper-parameters (lengths in optimizer steps, sizes in examples) and run options.

    The recipe's stages come from :func:`stages`: ``vision_steps`` of vision warm-up,
    ``steps`` of mixed chats, then ``finish``."""

    out: Path = V2_MODEL_DIR
    demo_dir: Path | None = None  # None: beside out (default_demo_dir)
    preset: str = "full"
    recipe: str = "staged"
    size: ModelSize = FULL_SIZE
    steps: int = 1000  # mixed chat stage
    seed: int = 0
    batch_size: int = 32  # image chats per step (scenes, digit strips)
    text_batch_size: int = 48  # text-only chats every other step, in a batch of their own
    image_turns: int = 1  # questions per image chat, as evaluated (4 per chat never taught color / exists)
    text_turns: int = 3  # max puzzles per text-only chat
    lr: float = 2e-3
    min_lr_ratio: float = 0.05  # cosine decays to lr * min_lr_ratio
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 0.01
    vision_aux_coef: float = 0.5  # weight of the per-patch label loss on the vision tower (training only)
    align_coef: float = 1.0  # weight of the visual-token / word-embedding alignment loss (training only)
    vision_steps: int = 1600  # vision-only warm-up steps before the first chat
    vision_batch_size: int = 20  # images per vision-only step (half shape scenes, half digit strips)
    chat_trains_vision: bool = True  # False: the vision tower is frozen after its warm-up
    finish: tuple[Stage, ...] = (FINISH_EXISTS, FINISH_COLOR)
    order: str = "finish-last"  # or "focus-first": the finishing stages run before the mixed stage
    log_every: int = 25
    heldout_n: int = 2000
    routing_n: int = 500
    eval_batch: int = 100
    experts_implementation: str = "grouped_mm"  # training only (same maths as eager, ~2x faster on CPU)
    device: str = "cpu"
    # run options: they change where and when state is written, never the result
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 100  # optimizer steps over all stages
    resume: Path | None = None
    stop_after: int | None = None  # stop (after a checkpoint) once this many steps ran in all
    eval_every: int = 0  # held-out evaluation of eval_n requests every N steps (0: only at the end)
    eval_n: int = 400
    overwrite: bool = False  # replace out / demo_dir even when this trainer did not write them
    progress: bool | None = None  # a bar on stderr: None = only when stderr is a terminal (workbench.progress)
    # fine-tuning (recipe "hires"): start from a model folder's weights, draw images at these scales
    init_from: Path | None = None  # a model folder (model.safetensors); None: random init
    scales: tuple[int, ...] = (1,)  # scene scales of the chats' images (tasks.SCALES); (1,): as always


FINE_TUNE_DEFAULTS = {"init_from": None, "scales": (1,)}
"""TrainArgs fields added for fine-tuning (issue 39 §8), with the values that train from scratch."""
RUN_OPTIONS = ("out", "demo_dir", "checkpoint_dir", "checkpoint_every", "resume", "stop_after", "eval_every", "eval_n",
               "overwrite", "progress")
"""TrainArgs fields that do not change the weights (a resumed run may differ in them)."""

RECIPES: dict[str, dict] = {
    # vision warm-up, mixed chats with the vision losses, then 'exists' and 'color' focus stages
    "staged": {},
    # the same with the vision tower frozen after its warm-up (12-20 % cheaper chat steps)
    "frozen": {"chat_trains_vision": False},
    # focus first: the shape-keyed lookup ('exists', then 'color') is taught before the mixed
    # stage, which then keeps it while every other kind is learned
    "focus-first": {"order": "focus-first"},
    # about half of every stage, for a CPU budget of about an hour
    "lean": {"vision_steps": 800, "steps": 600,
             "finish": (replace(FINISH_EXISTS, steps=100), replace(FINISH_COLOR, steps=250))},
    "lean-frozen": {"vision_steps": 800, "steps": 600, "chat_trains_vision": False,
                    "finish": (replace(FINISH_EXISTS, steps=100), replace(FINISH_COLOR, steps=250))},
    "lean-focus-first": {"vision_steps": 800, "steps": 600, "order": "focus-first",
                         "finish": (replace(FINISH_EXISTS, steps=100), replace(FINISH_COLOR, steps=250))},
    # a short mixed-resolution fine-tune of a trained model (--init-from, issue 39 §8): no
    # vision warm-up, mixed chats whose images are drawn at 1x or 2x (128 or 256 px), then the
    # colour focus stage at both scales; the processor keeps every image between 1x and 2x whole.
    # No per-patch probe loss: the probe head is not saved with a model, so a fresh one starts
    # random and would push its gradients into the trained tower (a precaution; BENCHMARKS.md,
    # issue 39 §8). Sized for ~20 min of a shared 2-core CPU
    "hires": {"vision_steps": 0, "steps": 100, "batch_size": 16, "lr": 5e-4, "warmup": 10,
              "vision_aux_coef": 0.0, "scales": (1, 2),
              "finish": (replace(FINISH_COLOR, steps=30, lr=3e-4),)},
}
"""Named recipes: overrides of the :class:`TrainArgs` defaults (the recipe study compares them)."""

PRESETS: dict[str, dict] = {
    "full": {},
    "smoke": {
        "size": SMOKE_SIZE, "steps": 4, "vision_steps": 3, "batch_size": 4, "text_batch_size": 4,
        "vision_batch_size": 4, "warmup": 2, "log_every": 1, "heldout_n": 24, "routing_n": 12, "eval_batch": 12,
        "checkpoint_every": 2, "eval_n": 12,
        "finish": (replace(FINISH_EXISTS, steps=2, warmup=1), replace(FINISH_COLOR, steps=2, warmup=1, text_batch_size=4)),
    },
}
"""``full``: the model that ships; ``smoke``: seconds on a laptop CPU, same code paths (tests)."""


def make_args(preset: str = "full", recipe: str = "staged", **overrides) -> TrainArgs:
    """:class:`TrainArgs` of ``preset`` and ``recipe`` with ``overrides`` (e.g. ``steps=500``);
    ``ValueError`` names an unknown preset, recipe or field."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is not one of {sorted(PRESETS)}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r} is not one of {sorted(RECIPES)}")
    names = {f.name for f in fields(TrainArgs)}
    bad = sorted(set(overrides) - names)
    if bad:
        raise ValueError(f"unknown training argument(s) {bad}")
    # the smoke preset keeps its lengths whatever the recipe; the full preset takes the recipe's
    return TrainArgs(preset=preset, recipe=recipe, **{**RECIPES[recipe], **PRESETS[preset], **overrides})


def stages(args: TrainArgs) -> list[Stage]:
    """The recipe's stages in order (see :class:`TrainArgs`)."""
    vision = Stage("vision", args.vision_steps, kind="vision")
    mixed = Stage("mixed", args.steps, families=_families(TRAIN_FAMILY_WEIGHTS),
                  text_batch_size=args.text_batch_size, vision_losses=True)
    if args.order == "focus-first":
        return [vision, *args.finish, mixed]
    return [vision, mixed, *args.finish]


INT_BOUNDS: dict[str, tuple[int, int]] = {
    "steps": (0, 1_000_000), "vision_steps": (0, 1_000_000), "seed": (0, 2**32 - 1),
    "batch_size": (1, 512), "text_batch_size": (0, 512), "vision_batch_size": (1, 512),
    "image_turns": (1, 16), "text_turns": (1, 16), "warmup": (1, 1_000_000), "log_every": (1, 1_000_000),
    "heldout_n": (1, 10_000), "routing_n": (1, 10_000), "eval_batch": (1, 1024), "eval_n": (1, 10_000),
    "checkpoint_every": (1, 1_000_000), "eval_every": (0, 1_000_000), "stop_after": (1, 10_000_000),
}
"""Inclusive bounds of the integer arguments. Beyond them a run cannot be meaningful on one machine:
a seed >= 2**32 is refused by numpy's global seeding, 10**9 held-out requests fill the memory
(10 000 are ~0.5 GB of images), 10**9 chats per batch crashed the process."""
FLOAT_BOUNDS: dict[str, tuple[float, float]] = {
    "lr": (0.0, 1.0), "min_lr_ratio": (0.0, 1.0), "weight_decay": (0.0, 10.0), "grad_clip": (0.0, 1e6),
    "router_aux_loss_coef": (0.0, 100.0), "vision_aux_coef": (0.0, 100.0), "align_coef": (0.0, 100.0),
}
"""Inclusive bounds of the real-valued arguments (``lr`` must also be > 0): an LR of 1e308 made
every weight NaN, then generation crashed."""
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
"""transformers experts kernels the trainer accepts (all run on CPU and CUDA; same maths)."""


def bounds_text(name: str) -> str:
    """``name``'s allowed range as --help shows it."""
    if name in INT_BOUNDS:
        low, high = INT_BOUNDS[name]
        return f"an integer in {low}..{high}"
    low, high = FLOAT_BOUNDS[name]
    return f"a number in {'(' if name == 'lr' else '['}{low:g}, {high:g}]"


def validate(args: TrainArgs) -> None:
    """``ValueError`` naming the first bad argument, its value and what is allowed: every number
    within its bounds (:data:`INT_BOUNDS`, :data:`FLOAT_BOUNDS`), checked before anything is
    built (a bad value found after an hour of training, or a crash, loses the hour)."""
    def need(ok: bool, name: str, value, allowed: str) -> None:
        if not ok:
            raise ValueError(f"{name} = {value!r} is not allowed: {allowed}")

    for name, (low, high) in INT_BOUNDS.items():
        value = getattr(args, name)
        if name == "stop_after" and value is None:
            continue
        need(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high, name, value,
             bounds_text(name) + (" (or None)" if name == "stop_after" else ""))
    for name, (low, high) in FLOAT_BOUNDS.items():
        value = getattr(args, name)
        need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
             and low <= value <= high and (name != "lr" or value > 0), name, value, bounds_text(name))
    need(args.seed not in (HELDOUT_SEED, DEMO_SEED), "seed", args.seed,
         f"any integer but the held-out and demo seeds ({HELDOUT_SEED}, {DEMO_SEED})")
    need(isinstance(args.device, str) and re.fullmatch(r"cpu|cuda(:\d{1,3})?", args.device) is not None,
         "device", args.device, "'cpu', 'cuda' or 'cuda:N'")
    if args.device != "cpu":
        index = int(args.device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"device = {args.device!r} is not available here: "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    need(args.experts_implementation in EXPERTS_IMPLEMENTATIONS, "experts_implementation",
         args.experts_implementation, f"one of {list(EXPERTS_IMPLEMENTATIONS)}")
    need(args.order in ("finish-last", "focus-first"), "order", args.order, "'finish-last' or 'focus-first'")
    for stage in args.finish:
        need(isinstance(stage.steps, int) and 0 <= stage.steps <= INT_BOUNDS["steps"][1],
             f"finish stage {stage.name!r} steps", stage.steps, bounds_text("steps"))
    need(isinstance(args.scales, tuple) and len(args.scales) >= 1
         and all(isinstance(x, int) and not isinstance(x, bool) and SCALES[0] <= x <= SCALES[1] for x in args.scales),
         "scales", args.scales, f"a non-empty tuple of whole numbers in {SCALES[0]}..{SCALES[1]}")
    if args.init_from is not None and not (Path(args.init_from) / "model.safetensors").is_file():
        raise ValueError(f"init_from = {str(args.init_from)!r} is not allowed: a model folder holding model.safetensors")


# --------------------------------------------------------------------------- training


def set_determinism(seed: int, device: str = "cpu") -> None:
    """Seed every RNG and force deterministic kernels on 2 CPU threads (on CUDA, deterministic
    kernels where torch has them: cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG``, set here)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True, warn_only=device != "cpu")


def lr_at(step: int, stage: Stage, args: TrainArgs) -> float:
    """The LR of ``stage`` at its 0-based ``step``: linear warm-up, then constant (vision
    stages) or cosine decay to ``lr * min_lr_ratio`` (chat stages)."""
    lr = args.lr if stage.lr is None else stage.lr
    warmup = args.warmup if stage.warmup is None else stage.warmup
    if step < warmup:
        return lr * (step + 1) / warmup
    if stage.kind == "vision":
        return lr
    progress = (step - warmup) / max(1, stage.steps - warmup)
    return lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def stage_stream(args: TrainArgs, stage: Stage) -> np.random.Generator:
    """The data stream of ``stage``: the mixed stage's is seeded by ``args.seed`` alone, the
    vision warm-up's by ``(seed, 1)``, the i-th finishing stage's by ``(seed, 2 + i)``, so adding
    or reordering stages never changes another stage's data."""
    if stage.kind == "vision":
        return np.random.default_rng([args.seed, 1])
    if stage.name == "mixed":
        return np.random.default_rng(args.seed)
    index = [s.name for s in args.finish].index(stage.name)
    return np.random.default_rng((args.seed, 2 + index))


class VisionProbe(torch.nn.Module):
    """Training-only auxiliary head: from the last vision block's per-patch states, predict
    what each 8 px patch shows (shape, colour, digit; class 0 = nothing), as
    :func:`.tasks._label_cells` labels it. It gives the vision tower a dense signal from the
    first step, where the answers alone reach it only through the decoder; it is not part of
    the saved model, whose forward pass it never changes."""

    BACKGROUND_WEIGHT = 0.1
    """Weight of "nothing here" patches: most patches are background, and at weight 1 they
    hide the object patches' error (probe loss 0.06 with shape at chance on objects)."""

    def __init__(self, hidden: int, word_ids: list[torch.Tensor] | None = None):
        super().__init__()
        self.sizes = list(LABEL_HEADS.values())
        self.head = torch.nn.Linear(hidden, sum(self.sizes))
        self.states: torch.Tensor | None = None
        self.merged: torch.Tensor | None = None
        self.word_ids = word_ids  # per head: class -> token id of its word (class 0: unused)

    def capture(self, _module, _inputs, output) -> None:
        self.states = output[0] if isinstance(output, tuple) else output

    def capture_merged(self, _module, _inputs, output) -> None:
        self.merged = output[0] if isinstance(output, tuple) else output

    def align_loss(self, labels: list[np.ndarray], embeddings: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of each merged visual token's scores against the word embeddings
        (``merged @ embeddings.T``) for the words of what it shows (shape and colour, or the
        digit); tokens that show nothing are left out. It places a visual token near the
        embeddings of the words that name it, so a question's words can find it by content."""
        targets = []
        for lab in labels:
            h, n = lab.shape[0], lab.shape[1] // MERGE_SIZE
            blocks = lab.reshape(h, n, MERGE_SIZE, n, MERGE_SIZE).transpose(0, 1, 3, 2, 4).reshape(h, n * n, -1)
            per_head = []
            for head, (size, ids) in enumerate(zip(self.sizes, self.word_ids)):
                counts = np.eye(size, dtype=np.int64)[blocks[head]].sum(axis=1)  # (tokens, classes)
                counts[:, 0] = 0
                cls = counts.argmax(axis=1)
                per_head.append(np.where(counts.max(axis=1) > 0, ids.numpy()[cls], -100))
            targets.append(np.stack(per_head))
        target = torch.from_numpy(np.concatenate(targets, axis=1)).to(self.merged.device)  # (heads, tokens)
        logits = self.merged @ embeddings.T
        losses = [torch.nn.functional.cross_entropy(logits, t, ignore_index=-100)
                  for t in target if (t != -100).any()]
        return sum(losses) / max(len(losses), 1)

    def loss(self, labels: list[np.ndarray]) -> torch.Tensor:
        """Mean cross-entropy over the heads; ``labels`` per image (in batch order), each
        ``(heads, rows, cols)`` on the patch grid, reordered here to the vision tower's token
        order (2 x 2 merge windows row-major, the patches of a window row-major inside it)."""
        rows = []
        for lab in labels:
            h, n = lab.shape[0], lab.shape[1] // MERGE_SIZE
            rows.append(lab.reshape(h, n, MERGE_SIZE, n, MERGE_SIZE).transpose(0, 1, 3, 2, 4).reshape(h, -1))
        target = torch.from_numpy(np.concatenate(rows, axis=1)).to(self.states.device)
        logits = self.head(self.states).split(self.sizes, dim=-1)
        loss = 0.0
        for lg, t in zip(logits, target):
            weight = torch.ones(lg.shape[-1], device=lg.device)
            weight[0] = self.BACKGROUND_WEIGHT
            loss = loss + torch.nn.functional.cross_entropy(lg, t, weight=weight)
        return loss / len(self.sizes)


def make_probe(model, tokenizer) -> VisionProbe:
    """The training-only :class:`VisionProbe` of ``model``, with the word ids its alignment
    loss targets (shape, colour and digit words)."""
    words = {"shape": SHAPES, "color": tuple(COLORS), "digit": DIGITS}
    word_ids = [torch.tensor([0] + tokenizer.convert_tokens_to_ids(list(words[h]))) for h in LABEL_HEADS]
    return VisionProbe(model.config.vision_config.hidden_size, word_ids)




class Interrupted(Exception):
    """Raised by :meth:`Trainer.run` when ``stop_after`` steps ran (after its checkpoint)."""


class TrainingError(WorkbenchError, ValueError):
    """A run that cannot go on (its loss became NaN or infinite); the message says where and why."""


def fingerprint(args: TrainArgs) -> dict:
    """What a resumed run must share with the run that wrote the checkpoint: every argument
    but the run options (:data:`RUN_OPTIONS`), as JSON values."""
    values = {k: v for k, v in asdict(args).items() if k not in RUN_OPTIONS}
    for name, default in FINE_TUNE_DEFAULTS.items():  # absent at their defaults: older checkpoints and
        if values.get(name) == default:  # training logs (which predate them) still match
            values.pop(name)
    return json.loads(json.dumps(values, default=str))


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}: {x!r} there, {y!r} here")
    return out


def _new_window(kind: str) -> dict:
    if kind == "vision":
        return {"vision": 0.0, "align": 0.0, "n": 0}
    return {"loss": 0.0, "ce": 0.0, "aux": 0.0, "vision": 0.0, "align": 0.0, "n": 0, "tf": {}, "tf_n": {}}


CURVE_ENTRIES: dict[str, tuple[set[str], str]] = {
    "vision_curve": ({"stage", "step", "global_step", "elapsed_s", "vision", "align"}, "\0"),
    "chat_curve": ({"stage", "step", "global_step", "elapsed_s", "loss", "ce", "aux", "vision", "align", "lr"}, "tf_"),
    "evals": ({"global_step", "stage", "elapsed_s", "exact_match", "token_accuracy"}, "em_"),
}
"""Per curve of a checkpoint: the keys every entry has (:meth:`Trainer._log`, :meth:`Trainer._evaluate`)
and the prefix of its per-kind keys."""

ROUTING_LAYER_KEYS = {"layer", "entropy_bits_image", "entropy_bits_text", "experts_used_image", "experts_used_text",
                      "experts_for_90pct_image", "experts_for_90pct_text", "experts_image_only", "experts_text_only",
                      "js_divergence_bits", "top_experts_image", "top_experts_text"}


def routing_stats_problem(stats, num_layers: int) -> str | None:
    """What is wrong with ``stats`` as :func:`.evaluate.routing_stats` of a ``num_layers``-layer
    model (the model card renders it), or ``None``."""
    def num(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not isinstance(stats, dict) or set(stats) != {"n_examples", "tokens", "max_entropy_bits", "per_layer"}:
        return "is not routing statistics (n_examples, tokens, max_entropy_bits, per_layer)"
    if not num(stats["n_examples"]) or not num(stats["max_entropy_bits"]) or not isinstance(stats["tokens"], dict) \
            or not all(num(v) for v in stats["tokens"].values()):
        return "has counts that are not finite numbers"
    layers = stats["per_layer"]
    if not isinstance(layers, list) or len(layers) != num_layers:
        return f"does not hold one entry per layer ({num_layers})"
    for row in layers:
        if not isinstance(row, dict) or set(row) != ROUTING_LAYER_KEYS or not all(
                num(v) if not k.startswith("top_") else isinstance(v, list) and all(num(x) for x in v)
                for k, v in row.items()):
            return f"has a per-layer entry that is not {sorted(ROUTING_LAYER_KEYS)} of finite numbers"
    return None


CHAT_TO_VISION_COST = 6.0
"""A chat step costs about this many vision steps on 2 CPU cores (0.6 vs 3.8 s, measured for the
earlier attempt): the total ETA's guess for chat stages before one has run."""


class Trainer:
    """Runs a recipe's :func:`stages` on a model; owns the step count, the curves, the periodic
    evaluations and the checkpoints. Invariant: after ``global_step`` optimizer steps the model,
    the probe, the optimizer and every RNG are what they would be had the run never stopped."""

    def __init__(self, model, tokenizer, image_processor, args: TrainArgs):
        self.model, self.tokenizer, self.image_processor, self.args = model, tokenizer, image_processor, args
        self.device = torch.device(args.device)
        self.probe = make_probe(model, tokenizer).to(self.device)
        self.stages = stages(args)
        self.vision_curve: list[dict] = []
        self.chat_curve: list[dict] = []
        self.evals: list[dict] = []
        self.global_step = 0
        self.elapsed = 0.0  # training seconds so far, over every resume
        self.extra: dict = {}  # stored with every checkpoint (e.g. routing at init)
        self.rates: dict[str, float] = {}  # seconds per step, by stage kind, last measured
        self.eval_split = make_split(HELDOUT_SEED, args.eval_n) if args.eval_every else None
        self.total_steps = sum(s.steps for s in self.stages)

    # ---------------------------------------------------------------- state
    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.model.state_dict(), **{f"probe.{k}": v for k, v in self.probe.state_dict().items()}}

    def load(self, folder: Path) -> dict:
        """Restore the run from checkpoint ``folder``; returns its state (the stage's part is
        applied when that stage starts). :class:`checkpoint.CheckpointError` if it does not fit."""
        tensors, optimizer, rng, state = checkpoint.read(folder)
        theirs, ours = state.get("fingerprint"), fingerprint(self.args)
        if not isinstance(theirs, dict):
            raise checkpoint.CheckpointError(f"checkpoint {str(folder)!r}: state.json entry 'fingerprint' is "
                                             f"{'missing' if theirs is None else 'not a mapping'}")
        if theirs != ours:
            diff = "; ".join(_differences(theirs, ours)[:6])
            raise checkpoint.CheckpointError(
                f"checkpoint {str(folder)!r} was written by a run with other arguments ({diff}); "
                f"resume with the arguments it was started with")
        self._check_checkpoint(folder, tensors, optimizer, rng, state)
        probe = {k[len("probe."):]: v for k, v in tensors.items() if k.startswith("probe.")}
        model = {k: v for k, v in tensors.items() if not k.startswith("probe.")}
        self.model.load_state_dict(model, strict=True)  # names, shapes and dtypes checked above
        self.probe.load_state_dict(probe, strict=True)
        self.vision_curve, self.chat_curve, self.evals = state["vision_curve"], state["chat_curve"], state["evals"]
        self.global_step, self.elapsed, self.extra = state["global_step"], state["elapsed_s"], state["extra"]
        state["optimizer_state"], state["torch_rng"] = optimizer, rng
        return state

    def _check_checkpoint(self, folder: Path, tensors: dict, optimizer: dict, rng: dict, state: dict) -> None:
        """:class:`checkpoint.CheckpointError` naming ``folder`` and its first entry that does not
        fit this run, before anything of it is applied: the tensors (the model's and the probe's
        names, shapes and dtypes, all finite), the position (a stage of this recipe, a step inside
        it, the global step they imply), the stage's AdamW state (its groups as this stage builds
        them, per-parameter moments of the parameter's shape, finite, not empty after a step), every
        RNG state (applied to a scratch generator first) and the curves' form. A tampered or
        damaged checkpoint is refused whole; it never trains on silently (NaN weights, AdamW
        restarted, every remaining step skipped)."""
        def bad(entry: str, why: str) -> None:
            raise checkpoint.CheckpointError(f"checkpoint {str(folder)!r}: {entry} {why}; it cannot be resumed from")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        expected = self.tensors()
        for name in sorted(set(expected) | set(tensors)):
            if name not in tensors:
                bad(f"weights.safetensors lacks {name!r}", "(a tensor of this model)")
            if name not in expected:
                bad(f"weights.safetensors entry {name!r}", "is not a tensor of this model")
            t, ref = tensors[name], expected[name]
            if t.shape != ref.shape or t.dtype != ref.dtype:
                bad(f"weights.safetensors entry {name!r}", f"is {t.dtype} {tuple(t.shape)}, not {ref.dtype} "
                    f"{tuple(ref.shape)}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad(f"weights.safetensors entry {name!r}", "holds NaN or infinite values")

        n = len(self.stages)
        index, step, global_step = state.get("stage"), state.get("step"), state.get("global_step")
        if not is_int(index) or not 0 <= index < n:
            bad("state.json 'stage'", f"= {index!r} is not a stage of this recipe (0..{n - 1})")
        stage = self.stages[index]
        if state.get("stage_name") != stage.name:
            bad("state.json 'stage_name'", f"= {shorten(state.get('stage_name'))} is not stage {index}'s name {stage.name!r}")
        if not is_int(step) or not 1 <= step <= stage.steps:
            bad("state.json 'step'", f"= {step!r} is not a step of stage {stage.name!r} (1..{stage.steps})")
        implied = sum(s.steps for s in self.stages[:index]) + step
        if global_step != implied:
            bad("state.json 'global_step'", f"= {global_step!r} is not the {implied} steps its stage and step imply")
        m = checkpoint.STEP_FOLDER.match(folder.name)
        if m and int(m.group(1)) != global_step:
            bad("state.json 'global_step'", f"= {global_step} is not the step its folder name says")
        if not is_num(state.get("elapsed_s")) or state["elapsed_s"] < 0:
            bad("state.json 'elapsed_s'", f"= {state.get('elapsed_s')!r} is not a number of seconds >= 0")
        names = {s.name for s in self.stages}
        for key, (required, prefix) in CURVE_ENTRIES.items():  # what the log and the model card read
            curve = state.get(key)
            if not isinstance(curve, list):
                bad(f"state.json {key!r}", "is not a list")
            for i, e in enumerate(curve):
                if (not isinstance(e, dict) or not required <= set(e)
                        or any(k not in required and not k.startswith(prefix) for k in e)
                        or e["stage"] not in names or not all(is_num(v) for k, v in e.items() if k != "stage")
                        or not is_int(e.get("global_step")) or not 1 <= e["global_step"] <= global_step):
                    bad(f"state.json '{key}[{i}]'", f"is not an entry this trainer logs (keys {sorted(required)} and "
                        f"{prefix}*, finite numbers, a stage of this recipe, a global step <= {global_step})")
        extra = state.get("extra")
        if not isinstance(extra, dict) or not set(extra) <= {"routing_at_init"}:
            bad("state.json 'extra'", "is not a mapping of 'routing_at_init'")
        if "routing_at_init" in extra:
            problem = routing_stats_problem(extra["routing_at_init"], self.model.config.text_config.num_hidden_layers)
            if problem:
                bad("state.json 'extra.routing_at_init'", problem)
        window, fresh = state.get("window"), _new_window(stage.kind)
        if not isinstance(window, dict) or set(window) != set(fresh) or not all(
                isinstance(window[k], dict) if isinstance(fresh[k], dict) else is_num(window[k]) for k in fresh):
            bad("state.json 'window'", f"is not a {stage.kind} stage's logging window (keys {sorted(fresh)})")
        if not is_int(window["n"]) or not 0 <= window["n"] <= step or not all(
                is_num(v) for k in ("tf", "tf_n") if k in window for v in window[k].values()):
            bad("state.json 'window'", "has counts out of range")

        # the stage's AdamW state, against the optimizer this stage builds
        ref_optimizer, _ = self._optimizer(stage)
        params = [p for group in ref_optimizer.param_groups for p in group["params"]]  # state_dict's indexing
        ref_groups = json.loads(json.dumps(ref_optimizer.state_dict()["param_groups"]))
        groups = optimizer["param_groups"]
        if len(groups) != len(ref_groups):
            bad("state.json 'optimizer.param_groups'", f"has {len(groups)} groups, not this stage's {len(ref_groups)}")
        for i, (group, ref) in enumerate(zip(groups, ref_groups)):
            if set(group) != set(ref):
                bad(f"state.json 'optimizer.param_groups[{i}]'", f"has keys {sorted(group)[:12]}, not {sorted(ref)}")
            for key in ref:
                if key == "lr":  # set at every step from the schedule
                    if not is_num(group[key]) or group[key] < 0:
                        bad(f"state.json 'optimizer.param_groups[{i}].lr'", f"= {group[key]!r} is not a number >= 0")
                elif group[key] != ref[key]:
                    bad(f"state.json 'optimizer.param_groups[{i}].{key}'",
                        f"= {str(group[key])[:60]} is not this stage's {str(ref[key])[:60]}")
        if not optimizer["state"]:
            bad("optimizer.safetensors", f"is empty after step {step} of stage {stage.name!r} (AdamW would restart)")
        for pid, moments in sorted(optimizer["state"].items()):
            where = f"optimizer.safetensors entry '{pid}.*'"
            if pid >= len(params):
                bad(where, f"names parameter {pid}; this stage optimizes {len(params)}")
            param = params[pid]
            if set(moments) != {"step", "exp_avg", "exp_avg_sq"}:
                bad(where, f"holds {sorted(moments)}, not AdamW's ['exp_avg', 'exp_avg_sq', 'step']")
            count = moments["step"]
            if count.shape != () or count.dtype != torch.float32 or not 1 <= float(count) <= step:
                bad(f"optimizer.safetensors entry '{pid}.step'", f"is not a float32 count in 1..{step}")
            for key in ("exp_avg", "exp_avg_sq"):
                t = moments[key]
                if t.shape != param.shape or t.dtype != param.dtype:
                    bad(f"optimizer.safetensors entry '{pid}.{key}'", f"is {t.dtype} {tuple(t.shape)}, not "
                        f"{param.dtype} {tuple(param.shape)}")
                if not bool(torch.isfinite(t).all()) or (key == "exp_avg_sq" and bool((t < 0).any())):
                    bad(f"optimizer.safetensors entry '{pid}.{key}'", "holds NaN, infinite or negative values")

        # every RNG state, applied to a scratch generator of its kind
        states = state["rng"]
        for key in ("stream", "python", "numpy"):
            if key not in states:
                bad(f"state.json 'rng.{key}'", "is missing")
        try:
            np.random.default_rng().bit_generator.state = states["stream"]
        except (TypeError, ValueError, KeyError, IndexError, OverflowError, AttributeError):
            bad("state.json 'rng.stream'", "is not a numpy PCG64 state")
        try:
            py = states["python"]
            random.Random().setstate((py[0], tuple(py[1]), py[2]))
        except (TypeError, ValueError, KeyError, IndexError, OverflowError):
            bad("state.json 'rng.python'", "is not a Python random state")
        try:
            kind, keys, pos, has_gauss, gauss = states["numpy"]
            np.random.RandomState().set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        except (TypeError, ValueError, KeyError, IndexError, OverflowError):
            bad("state.json 'rng.numpy'", "is not a numpy MT19937 state")
        ref_rng = torch.get_rng_state()
        cpu = rng.get("torch_cpu")
        if cpu is None or cpu.dtype != ref_rng.dtype or cpu.shape != ref_rng.shape:
            bad("rng.safetensors entry 'torch_cpu'", f"is {'missing' if cpu is None else f'{cpu.dtype} {tuple(cpu.shape)}'},"
                f" not {ref_rng.dtype} {tuple(ref_rng.shape)}")
        try:
            torch.Generator().set_state(cpu)
        except RuntimeError:
            bad("rng.safetensors entry 'torch_cpu'", "is not a torch CPU generator state")
        for key, value in rng.items():
            if key != "torch_cpu" and (not re.fullmatch(r"torch_cuda_\d{1,3}", key) or value.dtype != torch.uint8):
                bad(f"rng.safetensors entry {key!r}", "is not a torch generator state")

    def save(self, stage_index: int, step: int, optimizer, stream: np.random.Generator, window: dict) -> None:
        state = {
            "fingerprint": fingerprint(self.args), "stage": stage_index, "stage_name": self.stages[stage_index].name,
            "step": step, "window": window, "vision_curve": self.vision_curve, "chat_curve": self.chat_curve,
            "evals": self.evals, "elapsed_s": self.elapsed, "extra": self.extra,
            "rng": {"stream": stream.bit_generator.state, "python": random.getstate(),
                    "numpy": [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()]},
        }
        checkpoint.write(self.args.checkpoint_dir, self.global_step, self.tensors(), optimizer, state)

    @staticmethod
    def _restore_rngs(state: dict, stream: np.random.Generator) -> None:
        stream.bit_generator.state = state["rng"]["stream"]
        py = state["rng"]["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        kind, keys, pos, has_gauss, gauss = state["rng"]["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(state["torch_rng"]["torch_cpu"])
        cuda = [state["torch_rng"][k] for k in sorted(state["torch_rng"]) if k.startswith("torch_cuda_")]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)

    # ---------------------------------------------------------------- running
    def run(self, resume: dict | None = None) -> None:
        """Run every stage from the start or from ``resume`` (:meth:`load`'s state). A bar over
        all optimizer steps (rate, ETA) goes to stderr when ``args.progress`` asks for it
        (:func:`workbench.progress.wanted`); the log lines stay on stdout."""
        start = resume["stage"] if resume else 0
        with bar(self.total_steps, "training steps", enabled=wanted(self.args.progress),
                 initial=self.global_step, unit="step") as self.bar:
            for index, stage in enumerate(self.stages):
                if index >= start:
                    self._run_stage(index, stage, resume if resume and index == start else None)
        self.model.eval()

    def _optimizer(self, stage: Stage) -> tuple[torch.optim.Optimizer, list]:
        args = self.args
        if stage.kind == "vision":
            params = [*self.model.model.visual.parameters(),
                      *self.model.model.language_model.embed_tokens.parameters(), *self.probe.parameters()]
            groups = [{"params": params, "weight_decay": args.weight_decay}]
        else:
            named = [*self.model.named_parameters(), *(("probe." + n, p) for n, p in self.probe.named_parameters())]
            params = [p for _, p in named]
            groups = [{"params": [p for n, p in named if p.ndim >= 2 and "embed" not in n],
                       "weight_decay": args.weight_decay},
                      {"params": [p for n, p in named if p.ndim < 2 or "embed" in n], "weight_decay": 0.0}]
        lr = args.lr if stage.lr is None else stage.lr
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8), params

    def _run_stage(self, index: int, stage: Stage, resume: dict | None) -> None:
        args, model, probe = self.args, self.model, self.probe
        optimizer, params = self._optimizer(stage)
        stream = stage_stream(args, stage)
        first, window = 0, _new_window(stage.kind)
        if resume is not None:
            optimizer.load_state_dict(resume["optimizer_state"])
            self._restore_rngs(resume, stream)
            first, window = resume["step"], resume["window"]
        if first >= stage.steps:
            return
        print(f"stage {stage.name!r} ({stage.kind}): steps {first + 1}..{stage.steps}", flush=True)
        visual = model.model.visual
        hooks = [visual.blocks[-1].register_forward_hook(probe.capture),
                 visual.merger.register_forward_hook(probe.capture_merged)]
        frozen = []
        if stage.kind == "chat" and not args.chat_trains_vision:
            frozen = [q for q in visual.parameters() if q.requires_grad]
        for q in frozen:
            q.requires_grad_(False)
        vision_losses = stage.kind == "vision" or (stage.vision_losses and not frozen
                                                   and bool(args.vision_aux_coef or args.align_coef))
        model.train()
        try:
            for step in range(first, stage.steps):
                tick = time.perf_counter()
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step, stage, args)
                if stage.kind == "vision":
                    loss = self._vision_step(stream, window)
                else:
                    loss = self._chat_step(stage, step, stream, window, vision_losses)
                if not math.isfinite(loss):  # the weights would be NaN from here on: stop, say why
                    lr = args.lr if stage.lr is None else stage.lr
                    raise TrainingError(f"the training loss became {loss} at step {step + 1} of stage {stage.name!r} "
                                        f"(global step {self.global_step + 1}): training diverged; lower --lr "
                                        f"(the stage's peak LR is {lr:g})")
                torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                self.global_step += 1
                self.bar.update(1)
                spent = time.perf_counter() - tick
                self.elapsed += spent
                self.rates[stage.kind] = spent if stage.kind not in self.rates else 0.9 * self.rates[stage.kind] + 0.1 * spent
                if (step + 1) % args.log_every == 0 or step + 1 == stage.steps:
                    self._log(index, stage, step, window)
                    window = _new_window(stage.kind)
                if args.eval_every and self.global_step % args.eval_every == 0:
                    self._evaluate(stage)
                stop = args.stop_after is not None and self.global_step >= args.stop_after
                if args.checkpoint_dir is not None and (self.global_step % args.checkpoint_every == 0 or stop):
                    self.save(index, step + 1, optimizer, stream, window)
                if stop:
                    raise Interrupted(f"stopped after {self.global_step} steps (--stop-after)")
        finally:
            for hook in hooks:  # a failed step must not leave capture hooks on a model the caller keeps
                hook.remove()
            for q in frozen:
                q.requires_grad_(True)
            model.eval()

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) for k, v in batch.items()}

    def _vision_step(self, stream: np.random.Generator, window: dict) -> float:
        args, probe = self.args, self.probe
        images, labels = [], []
        for i in range(args.vision_batch_size):
            image, _, lab = (make_digit_strip if i % 2 else make_scene)(stream, with_labels=True)
            images.append(image)
            labels.append(lab)
        inputs = self._to_device(dict(self.image_processor(images, return_tensors="pt")))
        self.model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        vision = probe.loss(labels)
        align = probe.align_loss(labels, self.model.model.language_model.embed_tokens.weight)
        total = args.vision_aux_coef * vision + args.align_coef * align
        total.backward()
        window["vision"] += float(vision.detach())
        window["align"] += float(align.detach())
        window["n"] += 1
        return float(total.detach())

    def _chat_step(self, stage: Stage, step: int, stream: np.random.Generator, window: dict,
                   vision_losses: bool) -> float:
        """One chat step's forward and backward passes; returns the step's total loss."""
        args, model, probe = self.args, self.model, self.probe
        weights = {family: share for family, share in stage.families}
        batch_size = args.batch_size if stage.batch_size is None else stage.batch_size
        chats = [make_conversation(stream, args.image_turns, weights, with_labels=True, scales=args.scales)
                 for _ in range(batch_size)]
        texts = [make_conversation(stream, args.text_turns, TEXT_TRAIN_WEIGHTS)
                 for _ in range(stage.text_batch_size if step % 2 else 0)]
        image_items = [(image, turns) for image, turns, _ in chats]
        coef = model.config.text_config.router_aux_loss_coef
        vision = align = torch.zeros(())
        outs, total = [], 0.0
        for items in (image_items, texts) if texts else (image_items,):
            batch = self._to_device(encode_conversations(items, self.tokenizer, self.image_processor,
                                                         with_answers=True))
            out = model(**batch, output_router_logits=True)
            loss = out.loss
            if items is image_items and vision_losses:
                labels = [lab for _, _, lab in chats]
                vision = probe.loss(labels)
                align = probe.align_loss(labels, model.model.language_model.embed_tokens.weight)
                loss = loss + args.vision_aux_coef * vision + args.align_coef * align
            loss.backward()
            total += float(loss.detach())
            outs.append((items, batch, out))
        for items, batch, out in outs:
            aux = float(out.aux_loss.detach())
            window["loss"] += float(out.loss.detach())
            window["ce"] += float(out.loss.detach()) - coef * aux
            window["aux"] += aux / len(outs)
            for (_, turns), oks in zip(items, _answers_correct(out.logits.detach(), batch["labels"])):
                for (question, _), ok in zip(turns, oks):
                    kind = question_kind(question)
                    window["tf"][kind] = window["tf"].get(kind, 0) + int(ok)
                    window["tf_n"][kind] = window["tf_n"].get(kind, 0) + 1
        window["vision"] += float(vision.detach())
        window["align"] += float(align.detach())
        window["n"] += 1
        return total

    def eta_s(self, index: int, done_in_stage: int) -> float:
        """Seconds left for the whole run at the last measured speed of each stage kind."""
        vision = self.rates.get("vision")
        chat = self.rates.get("chat", (vision or 0.0) * CHAT_TO_VISION_COST)
        left = 0.0
        for i, stage in enumerate(self.stages[index:], start=index):
            remaining = stage.steps - (done_in_stage if i == index else 0)
            left += remaining * (vision if stage.kind == "vision" else chat)
        return left

    def _log(self, index: int, stage: Stage, step: int, window: dict) -> None:
        n = max(window["n"], 1)
        entry = {"stage": stage.name, "step": step + 1, "global_step": self.global_step}
        if stage.kind == "vision":
            entry.update({k: round(window[k] / n, 5) for k in ("vision", "align")})
        else:
            entry.update({k: round(window[k] / n, 5) for k in ("loss", "ce", "aux", "vision", "align")})
            entry.update({f"tf_{k}": round(window["tf"][k] / window["tf_n"][k], 3)
                          for k in QUESTION_KINDS if window["tf_n"].get(k)})
            entry["lr"] = round(lr_at(step, stage, self.args), 7)
        entry["elapsed_s"] = round(self.elapsed, 1)
        (self.vision_curve if stage.kind == "vision" else self.chat_curve).append(entry)
        losses = "  ".join(f"{k} {entry[k]:.4f}" for k in ("loss", "vision", "align") if k in entry)
        tf = " ".join(f"{k[3:]}={v:.2f}" for k, v in entry.items() if k.startswith("tf_"))
        print(f"{stage.name:>8s} {step + 1:5d}/{stage.steps}  [{self.global_step}/{self.total_steps}]  {losses}  "
              f"{self.elapsed:.0f}s (eta {self.eta_s(index, step + 1) / 60:.1f} min)  {tf}", flush=True)

    def _evaluate(self, stage: Stage) -> None:
        """Held-out exact match of the current weights on ``eval_n`` requests (the recipe
        study's curve). Greedy generation draws no random numbers, so the run is unchanged."""
        was_training = self.model.training
        self.model.eval()
        result = evaluate(self.model, self.tokenizer, self.image_processor, self.eval_split, self.args.eval_batch)
        self.model.train(was_training)
        entry = {"global_step": self.global_step, "stage": stage.name, "elapsed_s": round(self.elapsed, 1),
                 "exact_match": result["exact_match"], "token_accuracy": result["token_accuracy"],
                 **{f"em_{k}": v["exact_match"] for k, v in result["per_kind"].items()}}
        self.evals.append(entry)
        print("EVAL " + json.dumps(entry), flush=True)


def _answers_correct(logits: torch.Tensor, labels: torch.Tensor) -> list[list[bool]]:
    """Per row, per answer (each run of labelled positions, its ``<|im_end|>`` included): are all
    its tokens predicted right, teacher-forced? Logits at position t predict the token at t + 1."""
    predicted = logits[:, :-1].argmax(-1).cpu()
    target = labels[:, 1:].cpu()
    result = []
    for row in range(labels.shape[0]):
        positions = (target[row] != -100).nonzero().flatten().tolist()
        runs: list[list[int]] = []
        for p in positions:
            if runs and p == runs[-1][-1] + 1:
                runs[-1].append(p)
            else:
                runs.append([p])
        result.append([bool((predicted[row, run] == target[row, run]).all()) for run in runs])
    return result


# --------------------------------------------------------------------------- artifacts


DEMO_PER_KIND = 2
"""Demo requests per task kind: 12 images (10 shape scenes, 2 digit strips) and 6 text-only."""


@torch.no_grad()
def write_demo(demo_dir: Path, model, tokenizer, image_processor) -> list[dict]:
    """Write the demo requests (seed ``DEMO_SEED``, :data:`DEMO_PER_KIND` of every kind) and
    ``prompts.json`` into ``demo_dir``, a new empty folder (``main`` stages it and swaps it in
    whole); each entry has the reference answer and what this model answers (``model_answer``),
    so a user sees at once which demos it gets wrong."""
    examples = make_demo(DEMO_SEED, DEMO_PER_KIND)
    batch = encode_batch(examples, tokenizer, image_processor, with_answers=False)
    out = model.generate(**batch, generation_config=model.generation_config)
    answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    prompts = []
    scenes = 0
    for (image, question, answer), model_answer in zip(examples, answers):
        name = None
        if image is not None:
            name = f"scene_{scenes}.png"
            image.save(demo_dir / name)
            scenes += 1
        prompts.append({"image": name, "prompt": question, "answer": answer, "kind": question_kind(question),
                        "model_answer": model_answer.strip()})
    (demo_dir / "prompts.json").write_text(json.dumps(prompts, indent=2) + "\n")
    return prompts


STORAGE_DTYPE = torch.float16
"""Dtype of the shipped weights (half the bytes of float32; runs compute in float32)."""


def round_to_storage(model) -> None:
    """Round every parameter to ``STORAGE_DTYPE`` and back, in place, so that evaluation,
    routing statistics and the saved file all describe the weights users load."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(STORAGE_DTYPE).to(param.dtype))


def write_processor_config(out: Path, image_processor: Qwen2VLImageProcessorPil) -> None:
    """Write ``processor_config.json`` for ``Qwen3VLProcessor`` (what its ``save_pretrained`` emits).

    ``Qwen3VLProcessor`` cannot be instantiated without torchvision in transformers 5
    (its video processor is torchvision-only), so the composite config is written
    by hand: the image-processor settings plus a matching video-processor block.
    """
    image_dict = image_processor.to_dict()
    video_dict = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "image_mean": image_dict["image_mean"],
        "image_std": image_dict["image_std"],
        "size": {"shortest_edge": IMAGE_PIXELS, "longest_edge": IMAGE_PIXELS * 16},
        "do_sample_frames": True,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 16,
    }
    config = {"processor_class": "Qwen3VLProcessor", "image_processor": image_dict, "video_processor": video_dict}
    (out / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_checkpoint(model, tokenizer, image_processor, out: Path) -> None:
    """Save weights (safetensors), configs, tokenizer and processor configs into ``out``, a new
    empty folder (``main`` stages it and swaps it in whole, :func:`workbench.ownedfolder.swap_in`)."""
    model.to(STORAGE_DTYPE).save_pretrained(out)  # exact: the weights are already rounded
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    write_processor_config(out, image_processor)


def dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20




# --------------------------------------------------------------------------- entry point


def initial_model(args: TrainArgs):
    """Seed everything (:func:`set_determinism`) and build the untrained model on ``args.device``,
    its tokenizer and image processor; returns ``(model, tokenizer, image_processor)``, the model in
    eval mode."""
    set_determinism(args.seed, args.device)
    tokenizer = build_v2_tokenizer()
    image_processor = build_image_processor(min(args.scales), max(args.scales))
    model = Qwen3VLMoeForConditionalGeneration(build_config(len(tokenizer), args.router_aux_loss_coef, args.size))
    if args.init_from is not None:  # fine-tuning: the folder's weights, every tensor (strict)
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(Path(args.init_from) / "model.safetensors")), strict=True)
    model.generation_config = build_generation_config()
    model.to(args.device)
    model.eval()
    return model, tokenizer, image_processor


def fit(model, tokenizer, image_processor, args: TrainArgs, resume: Path | None = None,
        extra: dict | None = None) -> Trainer:
    """Every stage of the recipe (from checkpoint folder ``resume`` if given), then the weights
    rounded to their float16 storage; returns the :class:`Trainer` (curves, evaluations).
    ``extra`` is stored with every checkpoint (a resumed run gets it back from there). Raises
    :class:`Interrupted` at ``stop_after``. Deterministic: the same ``args`` from
    :func:`initial_model` give bit-identical weights, interrupted and resumed or not
    (tests/test_v2_training.py)."""
    held = None
    if args.checkpoint_dir is not None:  # one writer: another run's clean-up would delete our checkpoints
        held = ownedfolder.lock(args.checkpoint_dir, "--checkpoint-dir")
    try:
        if args.checkpoint_dir is not None:
            try:
                args.checkpoint_dir.mkdir(exist_ok=True)
            except OSError as e:
                raise ownedfolder.FolderError(f"--checkpoint-dir {str(args.checkpoint_dir)!r} cannot be a folder of "
                                              f"checkpoints ({e.strerror or e}); give a new or empty folder") from None
        model.set_experts_implementation(args.experts_implementation)
        trainer = Trainer(model, tokenizer, image_processor, args)
        trainer.extra.update(extra or {})
        state = trainer.load(resume) if resume is not None else None
        try:
            trainer.run(state)
        finally:
            model.set_experts_implementation("eager")  # what a plain from_pretrained gives every user
    finally:
        if held is not None:
            ownedfolder.unlock(args.checkpoint_dir, held)
    round_to_storage(model)
    return trainer


def default_demo_dir(out: Path) -> Path:
    """Where the demo requests go without ``--demo-dir``: beside ``out``, in ``<out>-demo``; for the
    shipped model (``out`` = ``data/qwen3-vl-moe-small``) the dashboard's ``data/demo`` beside it."""
    return V2_DEMO_DIR if out == V2_MODEL_DIR else out.with_name(f"{out.name}-demo")


def check_paths(args: TrainArgs) -> TrainArgs:
    """``args`` with absolute folders (``demo_dir`` defaulted, ``checkpoint_dir`` taken from
    ``resume``), or ``ValueError`` naming the first flag whose folder may not be used: nothing
    is written where it could destroy what the trainer did not write. ``--out`` and
    ``--demo-dir`` are replaced whole at the end, so each must be new, empty, written by this
    trainer before (:mod:`workbench.ownedfolder`), or ``--overwrite``; no two of the output and
    checkpoint folders may be one folder or nested (a swap would delete the other); checkpoints
    stay outside the repository."""
    out = _folder_path("--out", args.out)
    demo = _folder_path("--demo-dir", args.demo_dir) if args.demo_dir is not None else default_demo_dir(out)
    resume = _folder_path("--resume", args.resume) if args.resume is not None else None
    ckpt = _folder_path("--checkpoint-dir", args.checkpoint_dir) if args.checkpoint_dir is not None else resume
    args = replace(args, out=out, demo_dir=demo, resume=resume, checkpoint_dir=ckpt)
    if resume is not None:
        if not resume.is_dir():
            raise ValueError(f"--resume {str(resume)!r} is not a folder; give the --checkpoint-dir of the run to "
                             f"continue")
        newest = checkpoint.latest(resume)
        if newest is None:
            raise ValueError(f"--resume {str(resume)!r} holds no checkpoint (step-NNNNNNN folders)")
        done = int(newest.name[len("step-"):])
        if args.stop_after is not None and args.stop_after <= done:
            raise ownedfolder.FolderError(f"--stop-after {args.stop_after} is at or below the step of the newest checkpoint "
                             f"{str(newest)!r} ({done}): the resumed run would have nothing to do; give a "
                             f"--stop-after above {done}, or leave it out")
    if args.stop_after is not None and ckpt is None:
        raise ValueError("--stop-after needs --checkpoint-dir (or --resume): without a checkpoint the stopped run "
                         "could not be continued")
    root = repo_root()
    if ckpt is not None:
        if ckpt.is_relative_to(root):
            raise ValueError(f"--checkpoint-dir {str(ckpt)!r} is inside the repository; checkpoints (hundreds of MB "
                             f"over a run) go outside it, e.g. /tmp/v2-ckpt")
        ownedfolder.check_place(ckpt, "--checkpoint-dir")  # a file, or below one: found now, not at a checkpoint
        _check_checkpoint_dir(ckpt)
    folders = {"--out": out, "--demo-dir": demo, "--checkpoint-dir": ckpt}
    if resume is not None and resume != ckpt:
        folders["--resume"] = resume
    clash = ownedfolder.overlapping({k: v for k, v in folders.items() if v is not None})
    if clash:
        raise ValueError(f"{clash}; they must be apart, since writing one would delete the other")
    try:
        here = Path.cwd().resolve()
    except OSError:  # the current folder was deleted: nothing to stand in
        here = None
    for flag, path in (("--out", out), ("--demo-dir", demo), ("--checkpoint-dir", ckpt)):
        if path is None:
            continue
        if path == root or path in root.parents:
            raise ValueError(f"{flag} {str(path)!r} holds the repository; give a folder of its own")
        if here is not None and (path == here or path in here.parents):
            raise ownedfolder.FolderError(f"{flag} {str(path)!r} is the current folder or holds it; it would be replaced "
                             f"(even with --overwrite, never): give a folder of its own, e.g. {flag} new-folder")
    for flag, path in (("--out", out), ("--demo-dir", demo)):
        ownedfolder.check(path, flag, TRAIN_MODULE, args.overwrite)  # found now, not after an hour of training
    return args


def _folder_path(flag: str, path: Path) -> Path:
    """``path`` made absolute (a symlink followed), or :class:`ownedfolder.FolderError` naming
    ``flag``: blank, a NUL byte, a symlink that leads nowhere (dangling, a loop), or a path the
    file system refuses (a name too long, a component that is not searchable)."""
    text = str(path) if isinstance(path, Path) else path
    if not isinstance(text, str) or text.strip() == "" or "\0" in text:
        raise ownedfolder.FolderError(f"{flag} {shorten(text) if str(text).strip() else repr(text)} is not a folder path: give a non-blank path "
                                      f"without NUL bytes")
    path = Path(text).expanduser()
    try:
        path = follow_link(path, flag, ownedfolder.FolderError)
        resolved = path.resolve()
        try:
            os.stat(resolved)
        except (FileNotFoundError, NotADirectoryError):
            pass
    except RuntimeError:  # Path.resolve on a symlink loop further up
        raise ownedfolder.FolderError(f"{flag} {shorten(text)} leads through a symlink loop; give another "
                                      f"folder") from None
    except OSError as e:
        raise ownedfolder.FolderError(f"{flag} {shorten(text)} cannot be used ({e.strerror or e}); give "
                                      f"another folder") from None
    return resolved


#: what a checkpoint folder of this trainer holds: checkpoints and the staging folder of one
_CHECKPOINT_ENTRY = re.compile(r"^\.?step-\d{7}(\.partial)?$")


def _check_checkpoint_dir(ckpt: Path) -> None:
    """:class:`ownedfolder.FolderError` unless ``--checkpoint-dir`` is absent, empty or holds only
    this trainer's checkpoints (``step-NNNNNNN`` folders, a ``.step-NNNNNNN.partial`` left by a
    crash): old checkpoints are deleted as new ones are written, so nothing else may be there."""
    if not ckpt.is_dir():
        return
    try:
        foreign = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in ckpt.iterdir()
                         if not (_CHECKPOINT_ENTRY.match(p.name) and p.is_dir() and not p.is_symlink()))
    except OSError as e:
        raise ownedfolder.FolderError(f"--checkpoint-dir {str(ckpt)!r} cannot be read ({e.strerror or e})") from None
    if foreign:
        shown = ", ".join(shorten(n, 60) for n in foreign[:5]) + (f" and {len(foreign) - 5} more"
                                                                   if len(foreign) > 5 else "")
        raise ownedfolder.FolderError(f"--checkpoint-dir {str(ckpt)!r} holds what this trainer did not write "
                                      f"({shown}); give a new or empty folder, or one that holds only this "
                                      f"trainer's checkpoints (step-NNNNNNN)")


def _path_type(text: str) -> Path:
    """argparse type of the folder flags: a blank path would mean the current folder."""
    if text.strip() == "" or "\0" in text:
        raise argparse.ArgumentTypeError(f"{repr(text) if text.strip() == '' else shorten(text)} is not a folder path: give a non-blank path")
    return Path(text)


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    """The command line as :class:`TrainArgs`, checked (:func:`validate`, :func:`check_paths`)
    before anything is built; a bad value exits 2 naming the flag, its value and what is allowed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="full", help=f"one of {sorted(PRESETS)} (default full)")
    parser.add_argument("--recipe", default="staged", help=f"one of {sorted(RECIPES)} (default staged)")
    parser.add_argument("--out", type=_path_type, help=f"model folder, replaced whole at the end (default {V2_MODEL_DIR}): "
                        f"new, empty or written by this trainer, else --overwrite")
    parser.add_argument("--demo-dir", type=_path_type, help=f"where the demo requests go, replaced whole (default: <out>-demo "
                        f"beside --out; {V2_DEMO_DIR} for the default --out)")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="replace --out and --demo-dir even though this trainer did not write them (e.g. the "
                             "shipped model, which also holds workbench/macs)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar with an ETA on stderr (default: only when stderr is a terminal; "
                             "--no-progress never); the log stays on stdout")
    for flag, kind, what in (("--steps", int, "mixed-stage optimizer steps"),
                             ("--vision-steps", int, "vision warm-up steps"),
                             ("--seed", int, "init + training-data seed"),
                             ("--batch-size", int, "image chats per step"),
                             ("--lr", float, "peak AdamW learning rate"),
                             ("--heldout-n", int, "held-out requests evaluated at the end"),
                             ("--checkpoint-every", int, "optimizer steps between checkpoints"),
                             ("--stop-after", int, "stop after this many steps in all (after a checkpoint)"),
                             ("--eval-every", int, "evaluate eval-n held-out requests every N steps (0: never)"),
                             ("--eval-n", int, "held-out requests of the periodic evaluation")):
        parser.add_argument(flag, type=kind, help=f"{what}; {bounds_text(flag[2:].replace('-', '_'))}")
    parser.add_argument("--device", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--experts-implementation", help="transformers experts kernel for training: one of "
                        f"{', '.join(EXPERTS_IMPLEMENTATIONS)} (default grouped_mm)")
    parser.add_argument("--checkpoint-dir", type=_path_type, help="where training checkpoints go (outside the repo; one "
                        "run at a time)")
    parser.add_argument("--resume", type=_path_type, help="checkpoint directory to continue from (its newest checkpoint)")
    parser.add_argument("--init-from", type=_path_type, help="model folder whose weights training starts from (a "
                        "fine-tune, e.g. --recipe hires --init-from data/qwen3-vl-moe-small); default: random init")
    ns = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(ns).items() if v is not None and k not in ("preset", "recipe")}
    try:
        args = make_args(ns.preset, ns.recipe, **overrides)
        validate(args)
        return check_paths(args)
    except ValueError as e:
        parser.error(str(e))


def repo_root() -> Path:
    return V2_MODEL_DIR.parents[1]


def reproduce_command(args: TrainArgs) -> str:
    """The CLI invocation that regenerates this run's weights (paths relative to the repo root
    when inside it; run options that never change the weights are left out)."""
    root = repo_root()

    def rel(path: Path) -> str:
        return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)

    parts = [f"python -m {TRAIN_MODULE}", f"--preset {args.preset}", f"--recipe {args.recipe}",
             f"--out {shlex.quote(rel(args.out))}", f"--demo-dir {shlex.quote(rel(args.demo_dir))}"]
    defaults = make_args(args.preset, args.recipe)
    if args.init_from is not None:
        parts.append(f"--init-from {shlex.quote(rel(Path(args.init_from)))}")
    for name in ("steps", "vision_steps", "seed", "batch_size", "lr", "heldout_n", "device", "experts_implementation"):
        value = getattr(args, name)
        if name == "seed" or value != getattr(defaults, name):
            parts.append(f"--{name.replace('_', '-')} {shlex.quote(str(value))}")
    return " ".join(parts)


TRAIN_MODULE = "workbench.models.embedded.v2.train"


def main(argv: list[str] | None = None) -> dict:
    """Train (or resume), evaluate, measure routing, save; return the training log dict. Holds
    the locks of ``--out`` and ``--demo-dir`` (and, while training, of ``--checkpoint-dir``) from
    its checks to its swap; a user error or a failed write exits 2 with one line."""
    args = parse_args(argv)
    held = []
    try:
        for path, flag in ((args.out, "--out"), (args.demo_dir, "--demo-dir")):
            held.append((path, ownedfolder.lock(path, flag)))
            ownedfolder.recover(path)  # what a killed run of this folder left
            ownedfolder.check(path, flag, TRAIN_MODULE, args.overwrite)  # again: another run may have written it
        return _train_and_save(args)
    except WorkbenchError as e:  # CheckpointError, FolderError, TrainingError
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        for path, fd in reversed(held):
            ownedfolder.unlock(path, fd)


def _train_and_save(args: TrainArgs) -> dict:
    wall_start = time.perf_counter()
    model, tokenizer, image_processor = initial_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters; {len(stages(args))} stages, "
          f"{sum(s.steps for s in stages(args))} steps", flush=True)
    heldout = make_split(HELDOUT_SEED, args.heldout_n)
    resume = checkpoint.latest(args.resume) if args.resume is not None else None
    if resume is None:
        extra = {"routing_at_init": routing_stats(model, tokenizer, image_processor, heldout[: args.routing_n],
                                                  args.eval_batch)}
    else:
        print(f"resuming from {resume}", flush=True)
        extra = None
    try:
        trainer = fit(model, tokenizer, image_processor, args, resume, extra)
    except Interrupted as stop:
        print(f"{stop}; continue with --resume {args.checkpoint_dir}", flush=True)
        return {"interrupted": True}

    print("evaluating on held-out split ...", flush=True)
    metrics = evaluate(model, tokenizer, image_processor, heldout, args.eval_batch)
    routing_after = routing_stats(model, tokenizer, image_processor, heldout[: args.routing_n], args.eval_batch)
    print(f"held-out exact match {metrics['exact_match']:.3f}, token accuracy {metrics['token_accuracy']:.3f} "
          f"(chance {metrics['chance_uniform']:.3f}, majority {metrics['majority_baseline']:.3f}, "
          f"blind {metrics['blind_baseline']:.3f}), mean answer {metrics['mean_answer_tokens']:.1f} tokens")
    for kind, m in metrics["per_kind"].items():
        print(f"  {kind:9s} exact {m['exact_match']:.3f}  tokens {m['token_accuracy']:.3f}  (n={m['n']}, "
              f"majority {m['majority_baseline']:.3f}, blind {m['blind_baseline']})", flush=True)

    model.to("cpu")
    staged: list[Path] = []
    try:
        staged += [ownedfolder.stage(args.out), ownedfolder.stage(args.demo_dir)]
        log = _save(args, staged[0], staged[1], model, tokenizer, image_processor, trainer, metrics, routing_after,
                    n_params, resume, wall_start)
        ownedfolder.swap_in(staged[1], args.demo_dir)
        ownedfolder.swap_in(staged[0], args.out)
    except (OSError, SafetensorError) as e:  # disk full, file too large: nothing half written is left
        raise ownedfolder.FolderError(
            f"--out {str(args.out)!r}: the model could not be written ({ownedfolder.io_reason(e)}); "
            + ("--out and --demo-dir are as they were" if len(staged) < 2 or staged[1].exists() else
               f"--demo-dir {str(args.demo_dir)!r} holds the new demo requests, --out is as it was")) from None
    finally:
        for path in staged:
            shutil.rmtree(path, ignore_errors=True)
    log["dir_size_mb"] = round(dir_size_mb(args.out), 2)
    print(f"saved to {args.out} ({log['dir_size_mb']:.1f} MB) in {log['total_seconds']:.0f}s total")
    return log


def _save(args: TrainArgs, out: Path, demo_dir: Path, model, tokenizer, image_processor, trainer: Trainer,
          metrics: dict, routing_after: dict, n_params: int, resume: Path | None, wall_start: float) -> dict:
    """Write the model, its log and card into the staging folder ``out`` and the demo requests
    into ``demo_dir``, each with its manifest (:mod:`workbench.ownedfolder`); returns the log."""
    config = model.config
    save_checkpoint(model, tokenizer, image_processor, out)
    demo = write_demo(demo_dir, model, tokenizer, image_processor)
    log = {
        "command": reproduce_command(args),
        "args": fingerprint(args),
        "stages": [asdict(s) for s in stages(args)],
        "seeds": {"train_stream": args.seed, "heldout": HELDOUT_SEED, "demo": DEMO_SEED},
        "model": {
            "class": type(model).__name__,
            "parameters": n_params,
            "text_config": {k: getattr(config.text_config, k) for k in (
                "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size",
                "max_position_embeddings")},
            "vision_config": {k: getattr(config.vision_config, k) for k in (
                "depth", "hidden_size", "num_heads", "patch_size", "spatial_merge_size", "temporal_patch_size",
                "deepstack_visual_indexes")},
            "tokens_per_image": TOKENS_PER_IMAGE,
        },
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": args.device,
        "train_family_weights": {"/".join(family): w for family, w in TRAIN_FAMILY_WEIGHTS.items()},
        "text_batch_size": args.text_batch_size,
        "demo_per_kind": DEMO_PER_KIND,
        "train_seconds": round(trainer.elapsed, 1),
        "vision_curve": trainer.vision_curve,
        "loss_curve": trainer.chat_curve,
        "evals": trainer.evals,
        "final_loss": trainer.chat_curve[-1] if trainer.chat_curve else None,
        "heldout": metrics,
        "routing_at_init": trainer.extra.get("routing_at_init"),
        "routing_trained": routing_after,
        "demo": demo,
        "resumed": resume is not None,
    }
    log["total_seconds"] = round(time.perf_counter() - wall_start, 1)
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    (out / "README.md").write_text(render_model_card(log))  # re-render: python -m ...v2.card
    ownedfolder.write_manifest(out, TRAIN_MODULE)
    ownedfolder.write_manifest(demo_dir, TRAIN_MODULE)
    return log


if __name__ == "__main__":
    main()
