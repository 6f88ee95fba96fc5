"""The v2 embedded model's parts: config, tokenizer, image processor and batch encoding.

Shared by training (:mod:`.train`) and evaluation (:mod:`.evaluate`), so that the prompts a
model is trained on and the prompts it is evaluated with are built by the same code. Sizes are
parameters (:class:`ModelSize`): the ``full`` preset is the model that ships, ``smoke`` a tiny one
that trains in seconds for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessorPil,
    Qwen3VLMoeConfig,
)

from ..tokenizer import (
    EOS_TOKEN_ID,
    IMAGE_PAD,
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    build_tokenizer,
)
from .tasks import SCENE_SIZE, VOCAB_WORDS, check_scale

PATCH_SIZE = 8  # vision patch side, pixels
MERGE_SIZE = 2  # spatial merge factor (2x2 patches -> one LLM token)
TEMPORAL_PATCH_SIZE = 2
IMAGE_PIXELS = SCENE_SIZE * SCENE_SIZE  # min_pixels == max_pixels: every image is resized to ~128x128
TOKENS_PER_IMAGE = (SCENE_SIZE // PATCH_SIZE // MERGE_SIZE) ** 2  # 64 merged visual tokens
MAX_ANSWER_TOKENS = 20  # a three-object description; eos comes after


def image_pixels(scale: int = 1) -> int:
    """The processor's pixel budget (min = max) for scenes drawn ``scale`` times larger
    (``tasks.make_split(..., scale=scale)``): ``IMAGE_PIXELS * scale**2``, so such an image keeps
    its size and yields ``TOKENS_PER_IMAGE * scale**2`` merged visual tokens."""
    return IMAGE_PIXELS * check_scale(scale) ** 2


def scale_image_processor(image_processor, scale: int = 1) -> None:
    """Set a loaded Qwen-VL image processor's pixel budget to :func:`image_pixels` of ``scale``
    (in place; ``scale = 1`` is the shipped budget)."""
    pixels = image_pixels(scale)
    image_processor.size = {"shortest_edge": pixels, "longest_edge": pixels}


@dataclass(frozen=True)
class ModelSize:
    """The sizes that differ between presets (everything else is fixed by :func:`build_config`)."""

    layers: int = 12  # decoder layers, every one MoE
    experts: int = 64  # routed experts per layer
    top_k: int = 4  # experts per token
    hidden: int = 64  # text hidden size (also each expert's width)
    vision_depth: int = 4  # vision blocks; deepstack features from blocks 1..depth-1
    vision_hidden: int = 96  # the vision tower is wider than the text tower and projects to it


FULL_SIZE = ModelSize()
"""The shipped size: 12 layers x 64 experts, top-4 (top-k / experts = 1/16, as
Qwen3-VL-30B-A3B's 8 / 128)."""
SMOKE_SIZE = ModelSize(layers=2, experts=8, top_k=2, hidden=32, vision_depth=2, vision_hidden=32)
"""A model that trains in seconds (tests); same classes and code paths as the full one."""


def build_v2_tokenizer() -> PreTrainedTokenizerFast:
    """The v2 tokenizer: the v2 tasks' words, every digit its own token."""
    return build_tokenizer(VOCAB_WORDS, split_digits=True)


def build_config(vocab_size: int, router_aux_loss_coef: float, size: ModelSize = FULL_SIZE) -> Qwen3VLMoeConfig:
    """Return the v2 embedded Qwen3-VL-MoE config; token ids match :mod:`..tokenizer`.

    Text tower (full size): 12 layers, hidden 64, 4 query / 2 KV heads of dim 16, every layer a
    64-expert top-4 MoE with expert width 64. M-RoPE sections (T, H, W) = (4, 2, 2)
    frequencies, summing to head_dim / 2 = 8, interleaved as in Qwen3-VL. Vision tower: 4
    blocks, hidden 96, 8x8 patches, 2x2 merge -> 64 tokens / image, deepstack features from
    blocks 1-3.
    """
    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": size.hidden,
        "intermediate_size": 2 * size.hidden,  # dense-MLP width; unused because every layer is MoE
        "num_hidden_layers": size.layers,
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
        "num_experts": size.experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.hidden,
        "router_aux_loss_coef": router_aux_loss_coef,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    }
    vision_config = {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden,
        "intermediate_size": 2 * size.vision_hidden,
        "num_heads": size.vision_hidden // 16,
        "in_channels": 3,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "out_hidden_size": size.hidden,
        "num_position_embeddings": (SCENE_SIZE // PATCH_SIZE) ** 2,  # 16x16 learned grid
        "deepstack_visual_indexes": list(range(1, size.vision_depth)),
        # The default 0.02 makes a narrow ViT learn shapes far more slowly (measured with a
        # shape-classification probe on generated scenes for the first embedded model).
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


def build_image_processor(scale: int = 1, max_scale: int | None = None) -> Qwen2VLImageProcessorPil:
    """PIL Qwen2-VL image processor: every image becomes 16x16 patches (64 merged tokens), or
    ``16·scale`` x ``16·scale`` patches (``64·scale²`` tokens) with a ``scale``. With a
    ``max_scale`` the budget is a range: an image of ``scale``..``max_scale`` times the scene
    size keeps its size (mixed-resolution training), smaller ones are enlarged, larger shrunk."""
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        min_pixels=image_pixels(scale),
        max_pixels=image_pixels(scale if max_scale is None else max_scale),
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def build_generation_config() -> GenerationConfig:
    """Greedy decoding that stops at ``<|im_end|>`` (the longest answer is 20 tokens + eos)."""
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=MAX_ANSWER_TOKENS + 1,
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
    """Token ids and labels of a chat (the image, if any, sits in the first user turn).

    The ids equal the chat template applied to the whole conversation, with the
    ``<|image_pad|>`` expanded to ``n_image_tokens`` copies (0 = a text-only chat). Labels
    are -100 except on each answer's tokens and its ``<|im_end|>``. Without ``with_answers``
    only the first user turn plus the assistant header is returned (the generation prompt).
    """
    ids: list[int] = []
    labels: list[int] = []
    newline = tokenizer.convert_tokens_to_ids("\n")
    for i, (question, answer) in enumerate(turns if with_answers else turns[:1]):
        prompt = tokenizer.apply_chat_template(
            [user_message(question, with_image=i == 0 and n_image_tokens > 0)], tokenize=False,
            add_generation_prompt=True,
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
    """Turn ``(image | None, [(question, answer), ...])`` items into left-padded model inputs.

    The single ``<|image_pad|>`` of the template is expanded to one token per merged
    visual patch, exactly as ``Qwen3VLProcessor`` does, and ``mm_token_type_ids`` is 1
    on image tokens, 0 elsewhere; text-only items have no image tokens (a batch without
    any image has no ``pixel_values``). With ``with_answers`` the batch also has ``labels``
    (see :func:`conversation_ids`); otherwise it is a generation prompt for the first
    question of each item.
    """
    images = [item[0] for item in items if item[0] is not None]
    vision = image_processor(images, return_tensors="pt") if images else {}
    grids = iter(vision.get("image_grid_thw", []))
    encoded = [
        conversation_ids(tokenizer, turns, 0 if image is None else int(next(grids).prod()) // MERGE_SIZE**2,
                         with_answers)
        for image, turns in items
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
        **{k: vision[k] for k in ("pixel_values", "image_grid_thw") if k in vision},
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


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]

