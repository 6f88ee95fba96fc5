"""The embedded checkpoint's model card (``README.md``), rendered from its ``training_log.json``.

Every number on the card comes from the log that :mod:`.train` writes, so the card never
states a figure that was not measured. Re-render after editing this template::

    python -m workbench.models.embedded.v2.card data/qwen3-vl-moe-small
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .tasks import (
    CHANCE,
    COLORS,
    FAMILY_WEIGHTS,
    OBJECT_MAX_SIZE,
    OBJECT_MIN_SIZE,
    QUESTION_KINDS,
    READ_DIGITS,
    REVERSE_ITEMS,
    SHAPES,
)

NAME = "qwen3-vl-moe-small"
#: the largest training_log.json read (a full run's is ≈ 70 kB)
MAX_LOG_BYTES = 16 << 20

_EXAMPLES = {
    "color": ("what color is the circle?", "red", True),
    "shape": ("what shape is blue?", "square", True),
    "count": ("how many shapes?", "three", True),
    "exists": ("is there a triangle?", "yes / no", True),
    "describe": ("describe the scene.", "a red circle on the left , a blue square in the middle and "
                 "a green cross on the right", True),
    "read": ("read the number.", "4 0 7 1 9", True),
    "arith": ("what is 7 times 8?", "5 6", False),
    "reverse": ("reverse red 4 circle blue.", "blue circle 4 red", False),
    "sequence": ("count from 3 to 9.", "3 4 5 6 7 8 9", False),
}

_USAGE = """\
```python
from PIL import Image
import torch
from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLMoeForConditionalGeneration

path = "data/qwen3-vl-moe-small"
model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
    path, local_files_only=True, dtype=torch.float32).eval()  # stored float16, computed in float32
tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)  # Qwen2VLImageProcessorPil

def ask(question, image=None):
    content = ([{"type": "image"}] if image is not None else []) + [{"type": "text", "text": question}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                           add_generation_prompt=True)
    vision = {}
    if image is not None:
        vision = image_processor(images=[image], return_tensors="pt")  # image_grid_thw [[1, 16, 16]]
        n_image_tokens = int(vision["image_grid_thw"][0].prod()) // image_processor.merge_size**2  # 64
        prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * n_image_tokens, 1)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    mm_token_type_ids = (inputs["input_ids"] == model.config.image_token_id).int()  # required for M-RoPE
    out = model.generate(**inputs, **vision, mm_token_type_ids=mm_token_type_ids)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

print(ask("describe the scene.", Image.open("data/demo/scene_9.png").convert("RGB")))
print(ask("count from 3 to 9."))
```"""


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _routing_table(stats: dict) -> str:
    header = ["layer", "H text", "H image", "used text", "used image", "90% text", "90% image",
              "text-only", "image-only", "JS(img,text)"]
    rows = [
        [r["layer"], r["entropy_bits_text"], r["entropy_bits_image"], r["experts_used_text"],
         r["experts_used_image"], r["experts_for_90pct_text"], r["experts_for_90pct_image"],
         r["experts_text_only"], r["experts_image_only"], r["js_divergence_bits"]]
        for r in stats["per_layer"]
    ]
    return _table(header, rows)


def _pct(x: float) -> str:
    return f"{x:.3f}" if x >= 1e-3 else f"{x:.1e}"


def _accuracy_table(ev: dict) -> str:
    # chance is a property of the generator (CHANCE), recomputed here rather than read from the log
    def blind(value) -> str:
        return "—" if value is None else f"{value:.3f}"

    rows = [[kind, r["n"], f"{r['exact_match']:.3f}", f"{r['token_accuracy']:.3f}", _pct(CHANCE[kind]),
             f"{r['majority_baseline']:.3f}", blind(r.get("blind_baseline"))] for kind, r in ev["per_kind"].items()]
    chance = sum(CHANCE[kind] * r["n"] for kind, r in ev["per_kind"].items()) / ev["n"]
    rows.append(["**all**", ev["n"], f"**{ev['exact_match']:.3f}**", f"**{ev['token_accuracy']:.3f}**",
                 _pct(chance), f"{ev['majority_baseline']:.3f}", blind(ev.get("blind_baseline"))])
    return _table(["kind", "n", "exact match", "token accuracy", "chance", "majority", "blind (question only)"],
                  rows)


def _tasks_table(lengths: dict[str, float]) -> str:
    rows = []
    for kind in QUESTION_KINDS:
        question, answer, image = _EXAMPLES[kind]
        rows.append([f"`{kind}`", "image" if image else "text only", f"`{question}`", f"`{answer}`",
                     f"{lengths.get(kind, float('nan')):.1f}"])
    return _table(["kind", "input", "question", "answer", "mean answer tokens (held-out)"], rows)


def _family_line(weights: dict) -> str:
    """``{("color", "shape"): 0.2, ...}`` or ``{"color/shape": 0.2, ...}`` -> "color/shape 20%, ..."."""
    return ", ".join(f"{family if isinstance(family, str) else '/'.join(family)} {w:.0%}"
                     for family, w in weights.items())


def _answer_tokens_by_kind(seed: int, n: int) -> dict[str, float]:
    """Mean reference-answer length per kind of the held-out split (a property of the data)."""
    from .tasks import make_split, question_kind

    lengths: dict[str, list[int]] = {}
    for _, question, answer in make_split(seed, n):
        lengths.setdefault(question_kind(question), []).append(len(answer.split()))
    return {kind: sum(v) / len(v) for kind, v in lengths.items()}


def _vision_line(log: dict) -> str:
    curve = log.get("vision_curve") or []
    if not curve:
        return "No vision-only warm-up."
    first, last = curve[0], curve[-1]
    return (f"Vision warm-up ({last['step']} steps, {last['elapsed_s']:.0f} s): probe loss {first['vision']:.3f} "
            f"-> {last['vision']:.3f}, alignment loss {first['align']:.3f} -> {last['align']:.3f} "
            f"(means over the first and the last {log['args']['log_every']} steps)."
            + ("" if log["args"].get("chat_trains_vision", True) else
               " The tower is frozen after it: the chat stages train everything else (the vision losses"
               " below apply to the warm-up only)."))


def _rerun_line(log: dict) -> str:
    lines = []
    prefix = log.get("prefix_check")
    if prefix:
        lines.append(f"Prefix re-run, checked on {prefix['date']}: {prefix['result']}")
    check = log.get("rerun_check")
    lines.append(f"Full-length re-run, checked once on {check['date']}: {check['result']}" if check
                 else "Full-length re-run: not yet checked for this checkpoint.")
    return "\n\n".join(lines)


def _finish_line(a: dict) -> str:
    """The finishing stages (``args.finish`` of the log) as one bullet's text."""
    stages = a.get("finish") or []
    if not stages:
        return "No finishing stages: the mixed stage is the last."
    parts = []
    for st in stages:
        mix = ", ".join(f"{'/'.join(fam)} {w:.0%}" for fam, w in st["families"])
        text = f" + {st['text_batch_size']} text chats every other step" if st["text_batch_size"] else ""
        parts.append(f"`{st['name']}`: {st['steps']} steps of {a['batch_size']} image chats{text} ({mix}), "
                     f"peak lr {st['lr']}, {st['warmup']} warm-up steps then cosine")
    return ("Then finishing stages, in order, each with fresh AdamW state and no vision-tower losses: "
            + "; ".join(parts) + ". Why: trained on the mixed stage alone (the previous recipe, measured), "
            "`exists` stayed at its blind baseline and `color` named another object's colour, whatever their "
            "share of a mixed batch; a batch of nothing but `exists` questions taught it (`FINISH_EXISTS`, "
            "`FINISH_COLOR` in `train.py`).")


def render_model_card(log: dict) -> str:
    """Render ``README.md`` for the checkpoint from the training log (all numbers measured)."""
    m, t, v, a = log["model"], log["model"]["text_config"], log["model"]["vision_config"], log["args"]
    ev, final = log["heldout"], log["final_loss"]
    trained, init = log["routing_trained"], log["routing_at_init"]

    def mean(stats: dict, key: str) -> float:
        return sum(r[key] for r in stats["per_layer"]) / len(stats["per_layer"])

    summary_rows = [
        [name, f"{mean(s, 'entropy_bits_text'):.2f}", f"{mean(s, 'entropy_bits_image'):.2f}",
         f"{mean(s, 'experts_for_90pct_text'):.1f}", f"{mean(s, 'experts_for_90pct_image'):.1f}",
         f"{mean(s, 'experts_image_only'):.1f}", f"{mean(s, 'experts_text_only'):.1f}",
         f"{mean(s, 'js_divergence_bits'):.3f}"]
        for name, s in (("random init", init), ("trained", trained))
    ]
    train_weights = log["train_family_weights"]
    demo_ok = sum(d["model_answer"] == d["answer"] for d in log["demo"])
    tf_final = ", ".join(f"{k[3:]} {v:.2f}" for k, v in final.items() if k.startswith("tf_"))
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: image-text-to-text
tags: [qwen3_vl_moe, mixture-of-experts, synthetic-data, small, test-fixture]
---

# {NAME}

A {m['parameters'] / 1e6:.2f}M-parameter `{m['class']}` (transformers `Qwen3VLMoeConfig`) trained **from scratch
in this repository** on generated scenes, digit strips and text puzzles. It is the workbench's embedded default
model: MoE tooling (expert offloading, routing telemetry, demos, studies) runs on a real Qwen3-VL-MoE graph on a
laptop CPU, with routing that has learned structure, answers of one to twenty tokens, text-only requests
beside image requests, and an accuracy high enough that a knob which costs accuracy can show it. It is not a
general-purpose VLM: it only understands the closed vocabulary of its generator. It replaces
`qwen3-vl-moe-tiny` (8 layers x 32 experts, one-word answers; retired, in the repository's history).

## Architecture

| part | setting |
|---|---|
| text decoder | {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, {t['num_attention_heads']} query / \
{t['num_key_value_heads']} KV heads, head_dim {t['head_dim']}, vocab {t['vocab_size']}, \
max positions {t['max_position_embeddings']} |
| MoE | **every** layer sparse (`decoder_sparse_step=1`, `mlp_only_layers=[]`): {t['num_experts']} experts, \
top-{t['num_experts_per_tok']} (top-k / experts = 1/{t['num_experts'] // t['num_experts_per_tok']}, as \
Qwen3-VL-30B-A3B's 8 / 128), expert width {t['moe_intermediate_size']}, router aux-loss coef \
{a['router_aux_loss_coef']} |
| RoPE | interleaved M-RoPE, `mrope_section=[4, 2, 2]` (sums to head_dim/2), theta 10000 |
| vision tower | depth {v['depth']}, hidden {v['hidden_size']}, {v['num_heads']} heads, patch {v['patch_size']}, \
temporal patch {v['temporal_patch_size']}, spatial merge {v['spatial_merge_size']}, \
deepstack layers {v['deepstack_visual_indexes']} |
| image tokens | 128x128 px -> 16x16 patches -> **{m['tokens_per_image']} merged visual tokens** per image |
| weights | float16 safetensors (rounded from the float32 training weights; every figure below is measured on \
the rounded weights computed in float32), untied `lm_head` |

Special tokens (ids): `<|endoftext|>` 0 (pad), `<|im_start|>` 1, `<|im_end|>` 2 (eos), `<|vision_start|>` 3,
`<|vision_end|>` 4, `<|image_pad|>` 5, `<|video_pad|>` 6; `[UNK]` 7. Numbers are spelled one digit per token
("56" -> `5`, `6`); decoding joins tokens with single spaces, so answers read `5 6`.

## Tasks

{_tasks_table(_answer_tokens_by_kind(log['seeds']['heldout'], ev['n']))}

Shape scenes: a muted, uninformative background (noise or gradient) with 1-3 objects ({OBJECT_MIN_SIZE}-{OBJECT_MAX_SIZE} px), at most
one per column (left / middle / right); shapes ({', '.join(SHAPES)}) and colours ({', '.join(COLORS)}) are
distinct within a scene, `describe` lists the objects left to right. Digit strips: {READ_DIGITS[0]}-{READ_DIGITS[1]} digits of a 5x7
bitmap font drawn 2x wide and 3x tall (10 x 21 px). `reverse` takes {REVERSE_ITEMS[0]}-{REVERSE_ITEMS[1]} colours, shapes or digits;
`arith` is single-digit plus / minus (non-negative) / times.

## How to build inputs

Prompt format (Qwen chat template, `tokenizer.apply_chat_template(..., add_generation_prompt=True)`):

```
<|im_start|>user
<|vision_start|><|image_pad|><|vision_end|>describe the scene.<|im_end|>
<|im_start|>assistant
```

A text-only request has no vision block. The single `<|image_pad|>` must be expanded to one token per merged
patch (64 for 128x128 images), and `mm_token_type_ids` (1 on image tokens, 0 elsewhere) must be passed:
transformers 5 refuses to build M-RoPE positions from `image_grid_thw` without it. Images go through
`Qwen2VLImageProcessorPil` (`preprocessor_config.json`; `AutoImageProcessor` resolves to it without torchvision),
with `min_pixels = max_pixels = 128*128`, so any image is resized to ~128x128 and yields 64 tokens. The answer
ends with `<|im_end|>`.

{_USAGE}

`processor_config.json` describes a `Qwen3VLProcessor` (image processor + tokenizer + chat template). Note
that `Qwen3VLProcessor` / `AutoProcessor` in transformers 5 also instantiates `Qwen3VLVideoProcessor`,
which requires **torchvision**; without torchvision use the tokenizer + image processor as above.

## Training data

`workbench/models/embedded/v2/tasks.py` (numpy + PIL, deterministic from a seed). A split draws a request family,
then a kind uniformly inside it. Evaluation mix (`FAMILY_WEIGHTS`): {_family_line(FAMILY_WEIGHTS)}. Training mix
of each step's image batch (`TRAIN_FAMILY_WEIGHTS` in `train.py`): {_family_line(train_weights)}; a short-question
chat asks up to {a.get('image_turns', a.get('max_turns'))} question(s) about one image (at most one per kind), a description is
asked alone, as the held-out split asks every question. Before the first chat, {a.get('vision_steps', 0)} vision-only steps train the vision tower, the word
embeddings and the probe on {a.get('vision_batch_size', 0)} generated images each (the two label losses below only). Every other step also has a batch of {a.get('text_batch_size', 0)} text-only chats of up to {a.get('text_turns', 3)} puzzles,
padded to their own length. Training chats are drawn fresh every step from
`numpy.random.default_rng({log['seeds']['train_stream']})` (finishing stage *i*, from 0: `default_rng(({log['seeds']['train_stream']}, 2 + i))`); the held-out split is
`make_split({log['seeds']['heldout']}, {ev['n']})`; the demo requests in `data/demo/` are
`make_demo({log['seeds']['demo']}, {log.get('demo_per_kind', 2)})`.

## Training

* Mixed stage: {a['steps']} AdamW steps of {a['batch_size']} image chats (+ {a.get('text_batch_size', 0)} text chats every other step) \
({a['steps'] * a['batch_size']:,} image chats in all), peak lr \
{a['lr']}, {a['warmup']} warm-up steps then cosine to {a['min_lr_ratio']} x peak, weight decay {a['weight_decay']}, \
grad-clip {a['grad_clip']}.
* Loss: cross-entropy on the answer tokens only (every answer and its `<|im_end|>`), plus \
{a['router_aux_loss_coef']} x the model's load-balancing loss (`output_router_logits=True`), plus \
{a.get('vision_aux_coef', 0)} x a per-patch label loss on the vision tower: a linear head (`VisionProbe` in `train.py`, \
training only, not saved) reads the last vision block's state of every 8 px patch and predicts the shape, colour \
and digit the generator drew there (background patches weigh 0.1), plus {a.get('align_coef', 0)} x an alignment \
loss: each merged visual token, scored against the word embeddings, should point to the word of what it shows \
(shape, colour, digit). Both give the vision tower a dense signal from the first step; the saved model is the \
plain transformers class and its forward pass never sees the head.
* {_vision_line(log)}
* {_finish_line(a)}
* Experts ran with transformers' `{a['experts_implementation']}` implementation while training (the same
  maths as the per-expert loop, faster on CPU); the saved config uses the default.
* Final window (last {a['log_every']} steps of the last stage, per step; a step's loss is its image batch's plus, every other step,
  its text batch's, so the window mean is about image + half of text): model loss {final['loss']:.4f}, of which
  answer CE {final['ce']:.4f}; load-balancing {final['aux']:.3f} per batch (top-k = {t['num_experts_per_tok']} is
  perfectly balanced); teacher-forced exact match of every answer: {tf_final}.
* Wall-clock: {log['train_seconds']:.0f} s of training, {log['total_seconds']:.0f} s for the whole script \
(2 CPU threads, torch {log['torch']}; the CPU was shared with other work, so this is an upper bound).
* The loss curve (every {a['log_every']} steps) is in `training_log.json`.

## Held-out accuracy (greedy `generate`)

{ev['n']} held-out requests of the evaluation mix; mean reference answer length **{ev['mean_answer_tokens']:.2f} tokens**
(eos not counted). **Exact match**: the decoded answer (special tokens skipped, whitespace stripped) equals the
reference. **Token accuracy**: the share of positions where the predicted and reference tokens agree, over the
longer of the two. Baselines (exact match): "chance" = a uniform guess over the kind's valid answers; "majority" =
always giving the kind's most frequent answer; "blind (question only)" = each distinct question answered with its
most frequent answer, an upper bound of any model that does not look at the image (none for text-only kinds, whose
question is the whole input; in "all" they count as right).

{_accuracy_table(ev)}

The {len(log['demo'])} demo requests: {demo_ok} answered exactly (each entry of `data/demo/prompts.json` has the
reference `answer` and this model's `model_answer`).

## Routing statistics

Measured with forward hooks on every MoE router (`model.model.language_model.layers[i].mlp.gate`, whose
forward returns `(router_logits, weights, indices)`) over the prompts of {trained['n_examples']} held-out
requests ({trained['tokens']['image']:,} image tokens, {trained['tokens']['text']:,} text tokens; "text" = every
non-image prompt token, text-only requests included). For each layer the routed top-{t['num_experts_per_tok']}
assignments are histogrammed per modality. H = entropy of that histogram in bits (max {trained['max_entropy_bits']});
used = experts with >= 1 assignment; 90% = fewest experts covering 90% of assignments; text-only / image-only =
experts used by one modality only; JS = Jensen-Shannon divergence between the image and text histograms (bits, 0..1).

Layer means:

{_table(["weights", "H text", "H image", "90% text", "90% image", "image-only", "text-only", "JS"], summary_rows)}

Trained model, per layer:

{_routing_table(trained)}

Random init (same seed, before training), per layer:

{_routing_table(init)}

## Reproduce

```
{log['command']}
```

Over an existing folder the trainer did not write, add `--overwrite` (the shipped `data/qwen3-vl-moe-small` also
holds `workbench/macs`, a calibration the trainer does not write, so regenerating it in place needs it); without it
the trainer refuses before training. A new or empty folder, or one the trainer wrote, needs nothing.

Seeds are fixed, `torch.set_num_threads(2)` and `torch.use_deterministic_algorithms(True)` are set, so the
same command on the same software stack (transformers {log.get('transformers', 'not recorded')}, torch {log['torch']}, CPU)
should reproduce the weights and every number above; other CPUs / library versions may differ in the last float
bits. That the script is deterministic is tested on the smoke preset (run twice, same bytes; stopped and resumed,
same bytes: `tests/test_v2_training.py`, in CI). The full-length re-run is checked by
`python -m workbench.models.embedded.v2.rerun <this folder>` (about as long as the training; it records its
result here).
{_rerun_line(log)}

## Limitations

Closed vocabulary of {t['vocab_size']} tokens; only the task templates above; only 128x128-ish synthetic
images. Unknown words map to `[UNK]`. Video inputs are architecturally supported but were never trained.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Re-render README.md of an embedded checkpoint from "
                                                 "its training_log.json")
    parser.add_argument("checkpoint", type=Path, help="the checkpoint folder (holds training_log.json)")
    ns = parser.parse_args(argv)
    from workbench.fileio import read_json

    where = ns.checkpoint / "training_log.json"
    log = read_json(where, MAX_LOG_BYTES, str(where), SystemExit)
    (ns.checkpoint / "README.md").write_text(render_model_card(log))


if __name__ == "__main__":
    main()
