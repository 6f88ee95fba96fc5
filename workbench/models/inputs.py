"""Requests → model inputs, with the modality of every token.

A VL request (images + prompt) goes through the model's ``AutoProcessor`` when it loads, else
through transformers' PIL image processor plus the tokenizer (torchvision-free); the prompt is
wrapped by the tokenizer's chat template when it has one. Every token gets a modality code
(``events.MODALITIES``): image/video placeholder ids are the visual tokens, everything else text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from workbench.errors import InputError
from workbench.telemetry.events import IMAGE, TEXT, VIDEO

MAX_IMAGE_BYTES = 20 * 1024 * 1024


@dataclass
class Request:
    """One request: a prompt and zero or more images (paths or PIL images)."""

    prompt: str
    images: Sequence[str | Path | Image.Image] = field(default_factory=list)


@dataclass
class ModelInputs:
    """Tensors for ``model.generate`` plus per-token modality codes (``int8 [T]``)."""

    tensors: dict[str, torch.Tensor]
    modality: np.ndarray
    prompt_text: str

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tensors["input_ids"]


def open_image(img: str | Path | Image.Image) -> Image.Image:
    """An RGB PIL image; a missing or unreadable file raises :class:`InputError`."""
    if isinstance(img, Image.Image):
        return img.convert("RGB")
    p = Path(img)
    if not p.is_file():
        raise InputError(f"image {str(p)!r} does not exist")
    if p.stat().st_size > MAX_IMAGE_BYTES:
        raise InputError(f"image {str(p)!r} is {p.stat().st_size} bytes; at most "
                         f"{MAX_IMAGE_BYTES} bytes are allowed")
    try:
        with Image.open(p) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise InputError(f"image {str(p)!r} is not a readable image (PNG, JPEG, …): {e}") from None


def modality_of(input_ids: torch.Tensor, image_token_id: int | None,
                video_token_id: int | None) -> np.ndarray:
    ids = input_ids.reshape(-1).cpu().numpy()
    mod = np.full(ids.shape, TEXT, np.int8)
    if image_token_id is not None:
        mod[ids == image_token_id] = IMAGE
    if video_token_id is not None:
        mod[ids == video_token_id] = VIDEO
    return mod


def build_inputs(lm, request: Request, max_new_tokens: int = 0) -> ModelInputs:
    """Tokenise ``request`` for the loaded model ``lm`` (a :class:`LoadedModel`)."""
    prompt = request.prompt if request.prompt is not None else ""
    if not prompt.strip():
        raise InputError("prompt is empty; give a question or instruction")
    images = [open_image(i) for i in request.images]
    if images and not lm.is_vision:
        raise InputError(f"model {lm.model_id!r} is text-only ({lm.layout.architecture}); "
                         f"it takes no images, got {len(images)}")
    tok = lm.tokenizer
    if getattr(tok, "chat_template", None):
        content: list[dict[str, Any]] = [{"type": "image"} for _ in images]
        content.append({"type": "text", "text": prompt})
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
    else:
        text = prompt
    if images and lm.processor is not None:
        enc = lm.processor(images=images, text=[text], return_tensors="pt")
        tensors = dict(enc)
    elif images:
        tensors = _encode_with_image_processor(lm, text, images)
    else:
        tensors = dict(tok([text], return_tensors="pt"))
    tensors = {k: v.to(lm.device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    if "pixel_values" in tensors:
        tensors["pixel_values"] = tensors["pixel_values"].to(lm.model.dtype)
    n = tensors["input_ids"].shape[-1]
    ctx = lm.context_length
    if ctx and n + max_new_tokens > ctx:
        raise InputError(
            f"prompt is {n} tokens (images included); with max_new_tokens={max_new_tokens} it "
            f"exceeds the model's context of {ctx} tokens")
    return ModelInputs(tensors=tensors, prompt_text=text,
                       modality=modality_of(tensors["input_ids"], lm.image_token_id,
                                            lm.video_token_id))


def _encode_with_image_processor(lm, text: str, images: list[Image.Image]) -> dict:
    """Image processor + tokenizer: each image placeholder becomes one token per merged patch
    (``grid_t·grid_h·grid_w / merge_size²``), as the model's own processor would do."""
    ip = lm.image_processor
    enc = ip(images=images, return_tensors="pt")
    grid = enc["image_grid_thw"]
    merge = int(getattr(ip, "merge_size", 1) or 1)
    placeholder = lm.tokenizer.convert_ids_to_tokens(lm.image_token_id)
    parts = text.split(placeholder)
    if len(parts) - 1 != len(images):
        raise InputError(f"prompt has {len(parts) - 1} image placeholders for {len(images)} images")
    out = parts[0]
    for i, rest in enumerate(parts[1:]):
        out += placeholder * int(grid[i].prod().item() // (merge * merge)) + rest
    tensors = dict(lm.tokenizer([out], return_tensors="pt"))
    # per-token modality, as transformers processors return it (0 text, 1 image, 2 video):
    # the model needs it for multimodal RoPE
    tensors["mm_token_type_ids"] = torch.from_numpy(
        modality_of(tensors["input_ids"], lm.image_token_id, lm.video_token_id).astype(np.int64)
    ).reshape(tensors["input_ids"].shape)
    tensors["pixel_values"] = enc["pixel_values"]
    tensors["image_grid_thw"] = grid
    return tensors
