"""Train the embedded tiny Qwen3-VL-MoE checkpoint on generated scenes (CPU, deterministic).

Usage::

    python -m workbench.models.embedded.train [--out DIR] [--steps N] [--seed S]

What it does, in order:

1. builds the word-level tokenizer, the PIL image processor and a small
   ``Qwen3VLMoeConfig`` (every decoder layer is a 32-expert top-4 MoE layer);
2. trains ``Qwen3VLMoeForConditionalGeneration`` from scratch with AdamW on a fresh
   stream of generated (image, question, answer) examples; the cross-entropy is
   taken on the answer tokens (answer word + ``<|im_end|>``) only, plus the model's
   router load-balancing loss (``output_router_logits=True``);
3. evaluates greedy-generation accuracy on a held-out split (different seed);
4. measures per-layer routing statistics for image vs text tokens with forward
   hooks on every MoE router (``layer.mlp.gate``), before and after training;
5. writes the checkpoint (``save_pretrained``), tokenizer, image processor,
   ``training_log.json`` and the model card ``README.md`` to ``--out``, and the
   demo scenes to ``--demo-dir``.

Determinism: fixed seeds, ``torch.set_num_threads(2)`` and
``torch.use_deterministic_algorithms(True)``; the same command on the same
software stack reproduces the same weights and metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessorPil,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from . import EMBEDDED_MODEL_DIR
from .scenes import (
    CHANCE,
    OBJECT_MAX_SIZE,
    OBJECT_MIN_SIZE,
    QUESTION_KINDS,
    SCENE_SIZE,
    make_conversation,
    make_split,
    question_kind,
)
from .tokenizer import (
    EOS_TOKEN_ID,
    IMAGE_PAD,
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    build_tokenizer,
)

HELDOUT_SEED = 20_251_121
"""Seed of the held-out evaluation split (never used for training)."""
DEMO_SEED = 7_777
"""Seed of the demo scenes written to ``data/demo``."""
DEFAULT_DEMO_DIR = EMBEDDED_MODEL_DIR.parent / "demo"

PATCH_SIZE = 8  # vision patch side, pixels
MERGE_SIZE = 2  # spatial merge factor (2x2 patches -> one LLM token)
TEMPORAL_PATCH_SIZE = 2
IMAGE_PIXELS = SCENE_SIZE * SCENE_SIZE  # min_pixels == max_pixels: every image is resized to ~128x128
TOKENS_PER_IMAGE = (SCENE_SIZE // PATCH_SIZE // MERGE_SIZE) ** 2  # 64 merged visual tokens


@dataclass(frozen=True)
class TrainArgs:
    """Training hyper-parameters (lengths in optimizer steps, sizes in examples)."""

    out: Path = EMBEDDED_MODEL_DIR
    demo_dir: Path = DEFAULT_DEMO_DIR
    steps: int = 2000
    seed: int = 0
    batch_size: int = 32  # images (conversations) per step
    questions_per_image: int = 4  # max question/answer turns per training conversation
    lr: float = 3e-3
    min_lr_ratio: float = 0.05  # cosine decays to lr * min_lr_ratio
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 0.01
    log_every: int = 25
    heldout_n: int = 2000
    routing_n: int = 500
    eval_batch: int = 100


# --------------------------------------------------------------------------- model parts


def build_config(vocab_size: int, router_aux_loss_coef: float) -> Qwen3VLMoeConfig:
    """Return the tiny Qwen3-VL-MoE config; token ids match :mod:`.tokenizer`.

    Text tower: 8 layers, hidden 64, 4 query / 2 KV heads of dim 16, every layer a
    32-expert top-4 MoE with expert width 64. M-RoPE sections (T, H, W) = (4, 2, 2)
    frequencies, summing to head_dim / 2 = 8, interleaved as in Qwen3-VL.
    Vision tower: 4 blocks, hidden 64, 8x8 patches, 2x2 merge -> 64 tokens / image.
    """
    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,  # dense-MLP width; unused because every layer is MoE
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 64,
        "router_aux_loss_coef": router_aux_loss_coef,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    }
    vision_config = {
        "depth": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "in_channels": 3,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "out_hidden_size": 64,
        "num_position_embeddings": (SCENE_SIZE // PATCH_SIZE) ** 2,  # 16x16 learned grid
        "deepstack_visual_indexes": [1, 2, 3],
        # The default 0.02 makes this narrow ViT learn shapes far more slowly (measured with a
        # shape-classification probe on generated scenes); 0.06 ~ 1/2 of 1/sqrt(hidden).
        "initializer_range": 0.06,
    }
    return Qwen3VLMoeConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=False,
    )


def build_image_processor() -> Qwen2VLImageProcessorPil:
    """PIL Qwen2-VL image processor: every image becomes 16x16 patches (64 merged tokens)."""
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        min_pixels=IMAGE_PIXELS,
        max_pixels=IMAGE_PIXELS,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def build_generation_config() -> GenerationConfig:
    """Greedy decoding that stops at ``<|im_end|>`` (answers are one word + eos)."""
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=4,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )


# --------------------------------------------------------------------------- batching


def user_message(question: str, with_image: bool) -> dict:
    """A chat message in transformers' format; the image (if any) precedes the question."""
    content = [{"type": "image"}] if with_image else []
    return {"role": "user", "content": [*content, {"type": "text", "text": question}]}


def conversation_ids(
    tokenizer: PreTrainedTokenizerFast, turns: list[tuple[str, str]], n_image_tokens: int, with_answers: bool
) -> tuple[list[int], list[int]]:
    """Token ids and labels of a chat about one image (the image sits in the first user turn).

    The ids equal the chat template applied to the whole conversation, with the
    ``<|image_pad|>`` expanded to ``n_image_tokens`` copies. Labels are -100 except on
    each answer word and its ``<|im_end|>``. Without ``with_answers`` only the first
    user turn plus the assistant header is returned (the generation prompt).
    """
    ids: list[int] = []
    labels: list[int] = []
    newline = tokenizer.convert_tokens_to_ids("\n")
    for i, (question, answer) in enumerate(turns if with_answers else turns[:1]):
        prompt = tokenizer.apply_chat_template(
            [user_message(question, with_image=i == 0)], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(prompt.replace(IMAGE_PAD, IMAGE_PAD * n_image_tokens, 1), add_special_tokens=False)
        ids += ([newline] if i > 0 else []) + prompt_ids["input_ids"]  # template puts "\n" after <|im_end|>
        labels += [-100] * (len(ids) - len(labels))
        if with_answers:
            answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [EOS_TOKEN_ID]
            ids += answer_ids
            labels += answer_ids
    return ids, labels


def encode_conversations(
    items: list[tuple],
    tokenizer: PreTrainedTokenizerFast,
    image_processor: Qwen2VLImageProcessorPil,
    with_answers: bool,
) -> dict[str, torch.Tensor]:
    """Turn ``(image, [(question, answer), ...])`` items into left-padded model inputs.

    The single ``<|image_pad|>`` of the template is expanded to one token per merged
    visual patch, exactly as ``Qwen3VLProcessor`` does, and ``mm_token_type_ids`` is 1
    on image tokens, 0 elsewhere. With ``with_answers`` the batch also has ``labels``
    (see :func:`conversation_ids`); otherwise it is a generation prompt for the first
    question of each item.
    """
    vision = image_processor([item[0] for item in items], return_tensors="pt")
    encoded = [
        conversation_ids(tokenizer, turns, int(thw.prod()) // MERGE_SIZE**2, with_answers)
        for (_, turns), thw in zip(items, vision["image_grid_thw"])
    ]
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(items), width), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for row, (ids, lab) in enumerate(encoded):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
        labels[row, width - len(ids) :] = torch.tensor(lab)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": (input_ids == IMAGE_TOKEN_ID).int(),
        "pixel_values": vision["pixel_values"],
        "image_grid_thw": vision["image_grid_thw"],
    }
    if with_answers:
        batch["labels"] = labels
    return batch


def encode_batch(
    examples: list[tuple],
    tokenizer: PreTrainedTokenizerFast,
    image_processor: Qwen2VLImageProcessorPil,
    with_answers: bool,
) -> dict[str, torch.Tensor]:
    """:func:`encode_conversations` for single-question ``(image, question, answer)`` triples."""
    items = [(image, [(question, answer)]) for image, question, answer in examples]
    return encode_conversations(items, tokenizer, image_processor, with_answers)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# --------------------------------------------------------------------------- training


def set_determinism(seed: int) -> None:
    """Seed every RNG and force deterministic kernels on 2 CPU threads."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)


def lr_at(step: int, args: TrainArgs) -> float:
    """Linear warm-up then cosine decay to ``lr * min_lr_ratio`` (step is 0-based)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, tokenizer, image_processor, args: TrainArgs) -> list[dict]:
    """Run the optimisation loop; return the loss curve (means over each ``log_every`` window)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    coef = model.config.text_config.router_aux_loss_coef
    data_rng = np.random.default_rng(args.seed)
    curve: list[dict] = []
    window = {"loss": 0.0, "ce": 0.0, "aux": 0.0, "answer_acc": 0.0, "n": 0}
    start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        items = [make_conversation(data_rng, args.questions_per_image) for _ in range(args.batch_size)]
        batch = encode_conversations(items, tokenizer, image_processor, with_answers=True)
        out = model(**batch, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        aux = float(out.aux_loss.detach())
        window["loss"] += float(out.loss.detach())
        window["ce"] += float(out.loss.detach()) - coef * aux
        window["aux"] += aux
        window["answer_acc"] += _answer_token_accuracy(out.logits.detach(), batch["labels"])
        window["n"] += 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            n = window.pop("n")
            entry = {"step": step + 1, **{k: round(v / n, 5) for k, v in window.items()}}
            entry["lr"] = round(lr_at(step, args), 7)
            entry["elapsed_s"] = round(time.perf_counter() - start, 1)
            curve.append(entry)
            eta = entry["elapsed_s"] / (step + 1) * (args.steps - step - 1)
            print(
                f"step {step + 1:5d}/{args.steps}  loss {entry['loss']:.4f}  ce {entry['ce']:.4f}  "
                f"aux {entry['aux']:.3f}  ans-acc {entry['answer_acc']:.3f}  lr {entry['lr']:.2e}  {entry['elapsed_s']:.0f}s (eta {eta:.0f}s)",
                flush=True,
            )
            window = {"loss": 0.0, "ce": 0.0, "aux": 0.0, "answer_acc": 0.0, "n": 0}
    model.eval()
    return curve


def _answer_token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Teacher-forced accuracy of the first-turn answer word in a training batch (the eval format)."""
    first = (labels != -100).int().argmax(dim=1)  # position of the answer word in each row
    rows = torch.arange(labels.shape[0])
    predicted = logits[rows, first - 1].argmax(-1)  # logits at t predict the token at t + 1
    return float((predicted == labels[rows, first]).float().mean())


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, tokenizer, image_processor, split: list[tuple], batch_size: int) -> dict:
    """Greedy-generate an answer for every held-out example; return accuracy per question kind.

    A prediction is correct iff the decoded new tokens (special tokens skipped,
    whitespace stripped) equal the reference answer exactly.
    """
    correct: Counter = Counter()
    total: Counter = Counter()
    predicted: Counter = Counter()
    samples = []
    for chunk in _chunks(split, batch_size):
        batch = encode_batch(chunk, tokenizer, image_processor, with_answers=False)
        out = model.generate(**batch, generation_config=model.generation_config)
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        for (_, question, answer), text in zip(chunk, texts):
            kind, pred = question_kind(question), text.strip()
            total[kind] += 1
            correct[kind] += pred == answer
            predicted[pred] += 1
            if len(samples) < 24:
                samples.append({"question": question, "answer": answer, "prediction": pred})
    n = sum(total.values())
    majority = _majority_baseline(split)
    per_kind = {
        kind: {
            "n": total[kind],
            "accuracy": round(correct[kind] / total[kind], 4),
            "chance_uniform": round(CHANCE[kind], 4),
            "majority_baseline": majority[kind],
        }
        for kind in QUESTION_KINDS
    }
    return {
        "n": n,
        "accuracy": round(sum(correct.values()) / n, 4),
        "chance_uniform": round(sum(CHANCE[k] * total[k] for k in QUESTION_KINDS) / n, 4),
        "majority_baseline": round(sum(majority[k] * total[k] for k in QUESTION_KINDS) / n, 4),
        "per_kind": per_kind,
        "prediction_histogram": dict(predicted.most_common()),
        "samples": samples,
    }


def _majority_baseline(split: list[tuple]) -> dict[str, float]:
    """Accuracy of always answering the most frequent answer of each kind (blind baseline)."""
    by_kind: dict[str, Counter] = {k: Counter() for k in QUESTION_KINDS}
    for _, question, answer in split:
        by_kind[question_kind(question)][answer] += 1
    return {
        k: round(c.most_common(1)[0][1] / sum(c.values()), 4) if c else 0.0 for k, c in by_kind.items()
    }


@torch.no_grad()
def routing_stats(model, tokenizer, image_processor, split: list[tuple], batch_size: int) -> dict:
    """Per-layer expert usage of image vs text tokens on prompt sequences.

    Forward hooks on every ``layer.mlp.gate`` (which returns ``(router_logits,
    weights, indices)``) collect the top-k expert indices. For each layer and
    modality we histogram the routed assignments (each token counts ``top_k``
    times; padding excluded) and report: entropy of the normalised histogram
    (bits; max log2(num_experts)), experts with at least one assignment, the
    smallest number of experts covering 90% of assignments, how many experts are
    used only by one modality, and the Jensen-Shannon divergence (bits, in [0, 1])
    between the image and text histograms. "text" = every non-image, non-padding
    token of the prompt (template, vision start/end markers and question words).
    """
    layers = model.model.language_model.layers
    num_experts = model.config.text_config.num_experts
    counts = {m: torch.zeros(len(layers), num_experts, dtype=torch.float64) for m in ("image", "text")}
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_idx: int):
        def hook(_module, _inputs, output):
            captured[layer_idx] = output[2].detach()  # (batch * seq, top_k) expert indices

        return hook

    handles = [layer.mlp.gate.register_forward_hook(hook_for(i)) for i, layer in enumerate(layers)]
    try:
        for chunk in _chunks(split, batch_size):
            batch = encode_batch(chunk, tokenizer, image_processor, with_answers=False)
            captured.clear()
            model(**batch)
            ids = batch["input_ids"].reshape(-1)
            valid = batch["attention_mask"].reshape(-1).bool()
            masks = {"image": valid & (ids == IMAGE_TOKEN_ID), "text": valid & (ids != IMAGE_TOKEN_ID)}
            for layer_idx, indices in captured.items():
                for modality, mask in masks.items():
                    hist = torch.bincount(indices[mask].reshape(-1), minlength=num_experts)
                    counts[modality][layer_idx] += hist.double()
    finally:
        for handle in handles:
            handle.remove()

    per_layer = []
    for layer_idx in range(len(layers)):
        img, txt = counts["image"][layer_idx], counts["text"][layer_idx]
        p_img, p_txt = img / img.sum(), txt / txt.sum()
        per_layer.append(
            {
                "layer": layer_idx,
                "entropy_bits_image": round(_entropy_bits(p_img), 3),
                "entropy_bits_text": round(_entropy_bits(p_txt), 3),
                "experts_used_image": int((img > 0).sum()),
                "experts_used_text": int((txt > 0).sum()),
                "experts_for_90pct_image": _experts_covering(p_img, 0.9),
                "experts_for_90pct_text": _experts_covering(p_txt, 0.9),
                "experts_image_only": int(((img > 0) & (txt == 0)).sum()),
                "experts_text_only": int(((txt > 0) & (img == 0)).sum()),
                "js_divergence_bits": round(_js_bits(p_img, p_txt), 3),
                "top_experts_image": torch.argsort(img, descending=True)[:4].tolist(),
                "top_experts_text": torch.argsort(txt, descending=True)[:4].tolist(),
            }
        )
    token_counts = {m: int(counts[m][0].sum().item()) // model.config.text_config.num_experts_per_tok for m in counts}
    return {
        "n_examples": len(split),
        "tokens": token_counts,
        "max_entropy_bits": round(math.log2(num_experts), 3),
        "per_layer": per_layer,
    }


def _entropy_bits(p: torch.Tensor) -> float:
    nz = p[p > 0]
    return float(-(nz * torch.log2(nz)).sum())


def _js_bits(p: torch.Tensor, q: torch.Tensor) -> float:
    m = 0.5 * (p + q)
    return _entropy_bits(m) - 0.5 * (_entropy_bits(p) + _entropy_bits(q))


def _experts_covering(p: torch.Tensor, mass: float) -> int:
    cumulative = torch.cumsum(torch.sort(p, descending=True).values, 0)
    return int((cumulative < mass - 1e-12).sum()) + 1


# --------------------------------------------------------------------------- artifacts


def write_demo(demo_dir: Path) -> list[dict]:
    """Write 6 demo scenes (seed ``DEMO_SEED``) and ``prompts.json`` into ``demo_dir``."""
    demo_dir.mkdir(parents=True, exist_ok=True)
    prompts = []
    for i, (image, question, answer) in enumerate(make_split(DEMO_SEED, 6)):
        name = f"scene_{i}.png"
        image.save(demo_dir / name)
        prompts.append({"image": name, "prompt": question, "answer": answer})
    (demo_dir / "prompts.json").write_text(json.dumps(prompts, indent=2) + "\n")
    return prompts


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
    """Save weights (safetensors), configs, tokenizer and processor configs into ``out``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    write_processor_config(out, image_processor)


def dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


# --------------------------------------------------------------------------- model card

_USAGE = """\
```python
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLMoeForConditionalGeneration

path = "data/qwen3-vl-moe-tiny"
model = Qwen3VLMoeForConditionalGeneration.from_pretrained(path, local_files_only=True).eval()
tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)  # Qwen2VLImageProcessorPil

image = Image.open("data/demo/scene_0.png").convert("RGB")
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color is the circle?"}]}]
prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
vision = image_processor(images=[image], return_tensors="pt")  # pixel_values (256, 384), image_grid_thw [[1, 16, 16]]
n_image_tokens = int(vision["image_grid_thw"][0].prod()) // image_processor.merge_size**2  # 64
prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * n_image_tokens, 1)
inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
mm_token_type_ids = (inputs["input_ids"] == model.config.image_token_id).int()  # required for M-RoPE
out = model.generate(**inputs, **vision, mm_token_type_ids=mm_token_type_ids)
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
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


def render_model_card(log: dict) -> str:
    """Render ``README.md`` for the checkpoint from the training log (all numbers measured)."""
    m, t, v, a = log["model"], log["model"]["text_config"], log["model"]["vision_config"], log["args"]
    ev, final = log["heldout"], log["final_loss"]
    acc_rows = [
        [kind, r["n"], f"{r['accuracy']:.3f}", f"{r['chance_uniform']:.3f}", f"{r['majority_baseline']:.3f}"]
        for kind, r in ev["per_kind"].items()
    ]
    acc_rows.append(["**all**", ev["n"], f"**{ev['accuracy']:.3f}**", f"{ev['chance_uniform']:.3f}",
                     f"{ev['majority_baseline']:.3f}"])
    trained, init = log["routing_trained"], log["routing_at_init"]

    def mean(stats: dict, key: str) -> float:
        return sum(r[key] for r in stats["per_layer"]) / len(stats["per_layer"])

    summary_rows = [
        [name, f"{mean(s, 'entropy_bits_text'):.2f}", f"{mean(s, 'entropy_bits_image'):.2f}",
         f"{mean(s, 'experts_for_90pct_text'):.1f}", f"{mean(s, 'experts_for_90pct_image'):.1f}",
         f"{mean(s, 'js_divergence_bits'):.3f}"]
        for name, s in (("random init", init), ("trained", trained))
    ]
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: image-text-to-text
tags: [qwen3_vl_moe, mixture-of-experts, synthetic-data, tiny, test-fixture]
---

# qwen3-vl-moe-tiny

A {m['parameters'] / 1e6:.2f}M-parameter `{m['class']}` (transformers `Qwen3VLMoeConfig`) trained **from scratch
in this repository** on generated shape/colour scenes. It exists so that MoE tooling (expert offloading,
routing telemetry, demos) can run on a real Qwen3-VL-MoE graph on a laptop CPU, with routing that has
learned structure rather than random-init routing. It is not a general-purpose VLM: it only understands
the closed vocabulary of its generator.

## Architecture

| part | setting |
|---|---|
| text decoder | {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, {t['num_attention_heads']} query / \
{t['num_key_value_heads']} KV heads, head_dim {t['head_dim']}, vocab {t['vocab_size']}, \
max positions {t['max_position_embeddings']} |
| MoE | **every** layer sparse (`decoder_sparse_step=1`, `mlp_only_layers=[]`): {t['num_experts']} experts, \
top-{t['num_experts_per_tok']}, expert width {t['moe_intermediate_size']}, router aux-loss coef \
{a['router_aux_loss_coef']} |
| RoPE | interleaved M-RoPE, `mrope_section=[4, 2, 2]` (sums to head_dim/2), theta 10000 |
| vision tower | depth {v['depth']}, hidden {v['hidden_size']}, {v['num_heads']} heads, patch {v['patch_size']}, \
temporal patch {v['temporal_patch_size']}, spatial merge {v['spatial_merge_size']}, \
deepstack layers {v['deepstack_visual_indexes']} |
| image tokens | 128x128 px -> 16x16 patches -> **{m['tokens_per_image']} merged visual tokens** per image |
| weights | float32 safetensors, untied `lm_head` |

Special tokens (ids): `<|endoftext|>` 0 (pad), `<|im_start|>` 1, `<|im_end|>` 2 (eos), `<|vision_start|>` 3,
`<|vision_end|>` 4, `<|image_pad|>` 5, `<|video_pad|>` 6; `[UNK]` 7.

## How to build inputs

Prompt format (Qwen chat template, `tokenizer.apply_chat_template(..., add_generation_prompt=True)`):

```
<|im_start|>user
<|vision_start|><|image_pad|><|vision_end|>what color is the circle?<|im_end|>
<|im_start|>assistant
```

The single `<|image_pad|>` must be expanded to one token per merged patch (64 for 128x128 images), and
`mm_token_type_ids` (1 on image tokens, 0 elsewhere) must be passed: transformers 5 refuses to build
M-RoPE positions from `image_grid_thw` without it. Images go through `Qwen2VLImageProcessorPil`
(`preprocessor_config.json`; `AutoImageProcessor` resolves to it without torchvision), with
`min_pixels = max_pixels = 128*128`, so any image is resized to ~128x128 and yields 64 tokens.
The answer is one lowercase word followed by `<|im_end|>`.

{_USAGE}

`processor_config.json` describes a `Qwen3VLProcessor` (image processor + tokenizer + chat template). Note
that `Qwen3VLProcessor` / `AutoProcessor` in transformers 5 also instantiates `Qwen3VLVideoProcessor`,
which requires **torchvision**; without torchvision use the tokenizer + image processor as above.

## Training data

`workbench/models/embedded/scenes.py` (numpy + PIL, fully deterministic from a seed). Each 128x128 scene is
a muted, uninformative background (noise, stripes, checkerboard or gradient) with 1-3 small \\
({OBJECT_MIN_SIZE}-{OBJECT_MAX_SIZE} px) non-overlapping objects; shapes (circle, square, triangle, cross) and colours (red, green, blue, yellow,
white) are distinct within a scene. Four question kinds, drawn uniformly:

* `what color is the <shape>?` -> colour
* `what shape is <color>?` -> shape
* `how many shapes?` -> one / two / three
* `is there a <shape>?` -> yes / no (balanced)

Training examples are drawn fresh every step from `numpy.random.default_rng({log['seeds']['train_stream']})`;
the held-out split is `make_split({log['seeds']['heldout']}, {ev['n']})`, the demo scenes in `data/demo/` are
`make_split({log['seeds']['demo']}, 6)`.

## Training

* {a['steps']} AdamW steps, batch size {a['batch_size']} ({a['steps'] * a['batch_size']:,} examples), peak lr \
{a['lr']}, {a['warmup']} warm-up steps then cosine to {a['min_lr_ratio']} x peak, weight decay {a['weight_decay']}, \
grad-clip {a['grad_clip']}.
* Loss: cross-entropy on the answer tokens only (answer word + `<|im_end|>`), plus \
{a['router_aux_loss_coef']} x the model's load-balancing loss (`output_router_logits=True`).
* Final loss (mean of the last {a['log_every']} steps): total {final['loss']:.4f}, answer CE \
{final['ce']:.4f}, load-balancing {final['aux']:.3f} (top-k = {t['num_experts_per_tok']} is perfectly balanced), \
teacher-forced answer-word accuracy {final['answer_acc']:.3f}.
* Wall-clock: {log['train_seconds']:.0f} s of training, {log['total_seconds']:.0f} s for the whole script \
(2 CPU threads, torch {log['torch']}; the CPU was shared with other jobs, so this is an upper bound).
* The loss curve (every {a['log_every']} steps) is in `training_log.json`.

## Held-out accuracy (greedy `generate`)

Exact match of the decoded answer on {ev['n']} held-out questions. "chance" = uniform guess over the valid
answers of that kind; "majority" = always giving the most frequent answer of that kind (a blind baseline).

{_table(["kind", "n", "accuracy", "chance", "majority"], acc_rows)}

## Routing statistics

Measured with forward hooks on every MoE router (`model.model.language_model.layers[i].mlp.gate`, whose
forward returns `(router_logits, weights, indices)`) over the prompts of {trained['n_examples']} held-out
examples ({trained['tokens']['image']:,} image tokens, {trained['tokens']['text']:,} text tokens; "text" = every
non-image prompt token). For each layer the routed top-{t['num_experts_per_tok']} assignments are histogrammed
per modality. H = entropy of that histogram in bits (max {trained['max_entropy_bits']}); used = experts with
>= 1 assignment; 90% = fewest experts covering 90% of assignments; text-only / image-only = experts used by
one modality only; JS = Jensen-Shannon divergence between the image and text histograms (bits, 0..1).

Layer means:

{_table(["weights", "H text", "H image", "90% text", "90% image", "JS"], summary_rows)}

Trained model, per layer:

{_routing_table(trained)}

Random init (same seed, before training), per layer:

{_routing_table(init)}

## Reproduce

```
{log['command']}
```

Seeds are fixed, `torch.set_num_threads(2)` and `torch.use_deterministic_algorithms(True)` are set, so the
same command on the same software stack (transformers 5.23, torch {log['torch']}, CPU) reproduces the weights
and every number above; other CPUs / library versions may differ in the last float bits.

## Limitations

Closed vocabulary of {t['vocab_size']} tokens; only the four question templates above; only 128x128-ish
synthetic scenes. Unknown words map to `[UNK]`. Video inputs are architecturally supported but were never
trained.
"""


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    defaults = TrainArgs()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=defaults.out, help="checkpoint directory")
    parser.add_argument("--demo-dir", type=Path, default=defaults.demo_dir, help="where demo scenes go")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="init + training-data seed")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="examples per step")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak AdamW learning rate")
    ns = parser.parse_args(argv)
    if ns.seed == HELDOUT_SEED or ns.seed == DEMO_SEED:
        parser.error("--seed must differ from the held-out and demo seeds")
    return TrainArgs(
        out=ns.out.resolve(),
        demo_dir=ns.demo_dir.resolve(),
        steps=ns.steps,
        seed=ns.seed,
        batch_size=ns.batch_size,
        lr=ns.lr,
    )


def _reproduce_command(args: TrainArgs) -> str:
    """The CLI invocation that regenerates this run (paths relative to the repo root when possible)."""
    root = EMBEDDED_MODEL_DIR.parents[1]

    def rel(path: Path) -> str:
        return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)

    parts = ["python -m workbench.models.embedded.train", f"--out {rel(args.out)}", f"--demo-dir {rel(args.demo_dir)}",
             f"--steps {args.steps}", f"--seed {args.seed}"]
    defaults = TrainArgs()
    if args.batch_size != defaults.batch_size:
        parts.append(f"--batch-size {args.batch_size}")
    if args.lr != defaults.lr:
        parts.append(f"--lr {args.lr}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> dict:
    """Train, evaluate, measure routing, save; return the training log dict."""
    args = parse_args(argv)
    wall_start = time.perf_counter()
    set_determinism(args.seed)
    tokenizer = build_tokenizer()
    image_processor = build_image_processor()
    config = build_config(len(tokenizer), args.router_aux_loss_coef)
    model = Qwen3VLMoeForConditionalGeneration(config)
    model.generation_config = build_generation_config()
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters; experts impl {config.text_config._experts_implementation}")

    heldout = make_split(HELDOUT_SEED, args.heldout_n)
    routing_before = routing_stats(model, tokenizer, image_processor, heldout[: args.routing_n], args.eval_batch)

    train_start = time.perf_counter()
    curve = train(model, tokenizer, image_processor, args)
    train_seconds = time.perf_counter() - train_start

    print("evaluating on held-out split ...", flush=True)
    metrics = evaluate(model, tokenizer, image_processor, heldout, args.eval_batch)
    routing_after = routing_stats(model, tokenizer, image_processor, heldout[: args.routing_n], args.eval_batch)
    print(f"held-out accuracy {metrics['accuracy']:.3f} (uniform chance {metrics['chance_uniform']:.3f})")
    for kind, m in metrics["per_kind"].items():
        print(f"  {kind:7s} {m['accuracy']:.3f}  (n={m['n']}, chance {m['chance_uniform']:.3f})")

    save_checkpoint(model, tokenizer, image_processor, args.out)
    demo = write_demo(args.demo_dir)
    log = {
        "command": _reproduce_command(args),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(args).items()},
        "seeds": {"train_stream": args.seed, "heldout": HELDOUT_SEED, "demo": DEMO_SEED},
        "model": {
            "class": type(model).__name__,
            "parameters": n_params,
            "text_config": {
                k: getattr(config.text_config, k)
                for k in (
                    "num_hidden_layers",
                    "hidden_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "num_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "vocab_size",
                    "max_position_embeddings",
                )
            },
            "vision_config": {
                k: getattr(config.vision_config, k)
                for k in ("depth", "hidden_size", "num_heads", "patch_size", "spatial_merge_size",
                          "temporal_patch_size", "deepstack_visual_indexes")
            },
            "tokens_per_image": TOKENS_PER_IMAGE,
        },
        "torch": torch.__version__,
        "train_seconds": round(train_seconds, 1),
        "loss_curve": curve,
        "final_loss": curve[-1],
        "heldout": metrics,
        "routing_at_init": routing_before,
        "routing_trained": routing_after,
        "demo": demo,
    }
    log["total_seconds"] = round(time.perf_counter() - wall_start, 1)
    (args.out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    (args.out / "README.md").write_text(render_model_card(log))
    log["dir_size_mb"] = round(dir_size_mb(args.out), 2)
    print(f"saved to {args.out} ({log['dir_size_mb']:.1f} MB) in {log['total_seconds']:.0f}s total")
    return log




if __name__ == "__main__":
    main()
