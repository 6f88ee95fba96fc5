"""Requests → model inputs, with the modality of every token.

A VL request (images + prompt) goes through the model's ``AutoProcessor`` when it loads, else
through transformers' PIL image processor plus the tokenizer (torchvision-free); the prompt is
wrapped by the tokenizer's chat template when it has one. Every token gets a modality code
(``events.MODALITIES``): image/video placeholder ids are the visual tokens, everything else text.

Images are checked before anything decodes them (:func:`probe_image` reads the header only):
a regular file of at most :data:`MAX_IMAGE_BYTES` bytes, in one of :data:`IMAGE_FORMATS`, with
at most :data:`MAX_IMAGE_PIXELS` pixels (4096 × 4096: Qwen3-VL's own processor caps an image at
that many pixels, and the dashboard's upload limit is the same) and an aspect ratio of at most
:data:`MAX_ASPECT_RATIO`:1 (Qwen2-VL's ``smart_resize``, which the Qwen-VL family's image
processors share, refuses more); the images of one batch (or request) together have at most
:data:`MAX_BATCH_PIXELS` pixels, from their headers before any is decoded. Decoding then
turns any mode into RGB the way transformers' ``convert_to_rgb`` does (alpha composited onto
white; 16-bit and float images scaled to 8 bits rather than clipped); an animated image gives
its first frame. Anything else raises
:class:`~workbench.errors.InputError` naming the image, what is wrong and what is allowed; running
out of memory while decoding is a :class:`MemoryError`, never reported as a damaged file.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from workbench.errors import InputError, ModelLoadError, one_line
from workbench.models.chat_template import TemplateRenderError, render_chats
from workbench.telemetry.events import IMAGE, TEXT, VIDEO

#: largest image file read (bytes)
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: most pixels an image may have, checked from its header before decoding: 4096 × 4096, the
#: ``max_pixels`` of Qwen3-VL's image processor (bigger images are only shrunk to it) and the
#: dashboard's upload limit; decoded as RGB it is 48 MiB
MAX_IMAGE_PIXELS = 4096 * 4096
#: largest width:height (or height:width) ratio; Qwen2-VL's ``smart_resize`` (shared by the
#: Qwen-VL image processors) refuses images beyond 200:1
MAX_ASPECT_RATIO = 200
#: image formats decoded (Pillow names; JPEG includes the MPO variant of many cameras). Formats
#: that run external programs (EPS) or are rarely pictures (PDF, PSD, …) are not opened at all.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "PPM")


@dataclass
class Request:
    """One request: a prompt and zero or more images (paths or PIL images); ``expected``: its
    known answer, where there is one (generated held-out and demo requests), shown beside the
    answer the run gives — never given to the model."""

    prompt: str
    images: Sequence[str | Path | Image.Image] = field(default_factory=list)
    expected: str | None = None


@dataclass
class ModelInputs:
    """Tensors for ``model.generate`` plus per-token modality codes (``int8 [T]``)."""

    tensors: dict[str, torch.Tensor]
    modality: np.ndarray
    prompt_text: str
    #: per flattened position (``input_ids`` is ``[B, T]``, positions row-major): the request
    #: it belongs to (int16) and whether it is a real token (False: left padding of a batch)
    request: np.ndarray | None = None
    valid: np.ndarray | None = None
    #: each request's rendered prompt text (chat template applied)
    prompts: list[str] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def prompt_tokens(self) -> list[int]:
        """Real (unpadded) prompt tokens of each request."""
        T = int(self.input_ids.shape[-1])
        valid = self.valid if self.valid is not None else np.ones(self.batch_size * T, bool)
        return [int(v) for v in valid.reshape(self.batch_size, T).sum(1)]

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tensors["input_ids"]


def _label(img: Any, i: int | None = None) -> str:
    if isinstance(img, Image.Image):
        return "in-memory image" + (f" #{i + 1}" if i is not None else "")
    return f"image {str(img)!r}"


@contextlib.contextmanager
def quiet_transformers():
    """transformers' logger at ERROR (its load report and warnings become our own errors and
    notes; a long prompt's "Token indices sequence length…" line, printed before our own
    one-line error, too) and Python warnings ignored."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def check_image_size(width: int, height: int, label: str) -> None:
    """Raise :class:`InputError` unless a ``width`` × ``height`` image is within
    :data:`MAX_IMAGE_PIXELS` and :data:`MAX_ASPECT_RATIO` (``label`` names it)."""
    if width < 1 or height < 1:
        raise InputError(f"{label} is {width}×{height} pixels: an image needs at least 1×1")
    if width * height > MAX_IMAGE_PIXELS:
        raise InputError(
            f"{label} is {width}×{height} = {width * height:,} pixels; at most "
            f"{MAX_IMAGE_PIXELS:,} pixels (4096×4096) are accepted: scale it down first")
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise InputError(
            f"{label} is {width}×{height} pixels, an aspect ratio of {ratio:.0f}:1; the "
            f"image processors of Qwen-VL models accept at most {MAX_ASPECT_RATIO}:1: crop or "
            f"pad it")


def _check_file(p: Path) -> int:
    """Size in bytes of the regular, readable file ``p``; else :class:`InputError`."""
    label = _label(p)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise InputError(f"{label} does not exist") from None
    except PermissionError:
        raise InputError(f"{label} cannot be read: permission denied") from None
    except (OSError, ValueError) as e:  # a link loop, a name too long, a NUL in the path, …
        raise InputError(f"{label} cannot be read: {one_line(e)}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{label} is a directory, not an image file")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{label} is not a regular file (a device, pipe or socket); give an "
                         f"image file")
    if st.st_size == 0:
        raise InputError(f"{label} is empty (0 bytes)")
    if st.st_size > MAX_IMAGE_BYTES:
        raise InputError(f"{label} is {st.st_size:,} bytes; at most {MAX_IMAGE_BYTES:,} bytes "
                         f"({MAX_IMAGE_BYTES // 2**20} MiB) are allowed")
    if not os.access(p, os.R_OK):
        raise InputError(f"{label} cannot be read: permission denied")
    return st.st_size


def _open_header(p: Path) -> Image.Image:
    """The lazily opened image (header read, nothing decoded), size-checked."""
    label = _label(p)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(p, formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as e:
        n = re.search(r"\((\d+) pixels\)", str(e))
        size = f"{int(n.group(1)):,} pixels" if n else "more pixels than Pillow allows"
        raise InputError(f"{label} is {size} (a decompression bomb?); at most "
                         f"{MAX_IMAGE_PIXELS:,} pixels (4096×4096) are accepted") from None
    except PermissionError:
        raise InputError(f"{label} cannot be read: permission denied") from None
    except Exception as e:  # UnidentifiedImageError, a broken header (SyntaxError, struct.error…)
        raise InputError(f"{label} is not a readable image in one of the accepted formats "
                         f"({', '.join(IMAGE_FORMATS)}): {one_line(e)}") from None
    try:
        check_image_size(*im.size, label)
    except InputError:
        im.close()
        raise
    return im


def probe_image(img: str | Path) -> tuple[int, int, str]:
    """``(width, height, format)`` of an image file, from its header only (nothing decoded);
    raises :class:`InputError` for anything :func:`open_image` would refuse before decoding."""
    if isinstance(img, Image.Image):
        check_image_size(*img.size, _label(img))
        return img.size[0], img.size[1], str(img.format or "")
    p = _as_path(img)
    _check_file(p)
    with _open_header(p) as im:
        return im.size[0], im.size[1], str(im.format)


def _as_path(img: Any) -> Path:
    if isinstance(img, (str, os.PathLike)):
        if not os.fspath(img).strip():
            raise InputError("image path is empty; give an image file")
        try:
            return Path(img)
        except TypeError:
            pass
    raise InputError(f"an image must be a file path or a PIL image, not "
                     f"{type(img).__name__} ({str(img)[:40]!r})")


def to_rgb(im: Image.Image) -> Image.Image:
    """An RGB copy of ``im`` (its current frame): alpha is composited onto white (as
    transformers' ``convert_to_rgb`` does), 16-bit and 32-bit integer images are scaled to 8
    bits, float images taken as 0…1 when they fit it (else clipped to 0…255)."""
    mode = im.mode
    if mode == "RGB":
        return im.copy()
    if mode.startswith("I") or mode == "F":
        a = np.asarray(im, dtype=np.float64)
        a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
        top = float(a.max()) if a.size else 0.0
        if mode == "F" and top <= 1.0:
            a = a * 255.0
        elif top > 255.0 or mode.startswith("I;16"):
            a = a / 257.0  # 0…65535 → 0…255
        return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def open_image(img: str | Path | Image.Image) -> Image.Image:
    """An RGB PIL image from a file path or a PIL image (the first frame of an animated one).
    Raises :class:`InputError` naming the image for a missing, unreadable, empty, truncated,
    too large (bytes or pixels) or too elongated image, or anything that is not an image."""
    if isinstance(img, Image.Image):
        check_image_size(*img.size, _label(img))
        try:
            return to_rgb(img)
        except MemoryError:  # not the image's fault: said as what it is (the CLI: one line)
            raise
        except Exception as e:
            raise InputError(f"{_label(img)} (mode {img.mode}) cannot be converted to RGB: "
                             f"{one_line(e)}") from None
    p = _as_path(img)
    _check_file(p)
    label = _label(p)
    im = _open_header(p)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im.seek(0)
            im.load()
            return to_rgb(im)
    except MemoryError:  # out of memory is not a damaged file: said as what it is
        raise
    except Exception as e:  # truncated data, broken chunks, zlib errors, oversized text chunks…
        raise InputError(f"{label} is a damaged or truncated {im.format} file: "
                         f"{one_line(e)}") from None
    finally:
        im.close()


def modality_of(input_ids: torch.Tensor, image_token_id: int | None,
                video_token_id: int | None) -> np.ndarray:
    ids = input_ids.reshape(-1).cpu().numpy()
    mod = np.full(ids.shape, TEXT, np.int8)
    if image_token_id is not None:
        mod[ids == image_token_id] = IMAGE
    if video_token_id is not None:
        mod[ids == video_token_id] = VIDEO
    return mod


#: longest prompt accepted, in characters (checked before tokenising; the model's context is
#: checked in tokens after): 4 Mi characters is ≥ 1 M tokens for any tokenizer here
MAX_PROMPT_CHARS = 4 * 1024 * 1024


def check_prompt(prompt: Any) -> str:
    """The prompt as text, or :class:`InputError`: not text, empty, longer than
    :data:`MAX_PROMPT_CHARS`, or not encodable as UTF-8 (a lone surrogate)."""
    if not isinstance(prompt, str):
        raise InputError(f"prompt must be text, not {type(prompt).__name__}")
    if not prompt.strip():
        raise InputError("prompt is empty; give a question or instruction")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InputError(f"prompt is {len(prompt)} characters; at most {MAX_PROMPT_CHARS} are "
                         f"allowed")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"prompt is not valid Unicode text (a lone surrogate at character "
                         f"{e.start}); give UTF-8 text") from None
    return prompt


def build_inputs(lm, request: Request, max_new_tokens: int = 0) -> ModelInputs:
    """Tokenise ``request`` for the loaded model ``lm`` (a :class:`LoadedModel`)."""
    return build_batch_inputs(lm, [request], max_new_tokens)


#: most requests one batch may hold (a run's batch; each request's images are checked too)
MAX_BATCH = 256


#: most pixels the images of one batch (or request) may have together, from their headers before
#: any is decoded: 8 × 4096² (384 MiB as RGB, the decoded images all being held together). Each
#: image's own bound (:data:`MAX_IMAGE_PIXELS`) still holds; :data:`MAX_BATCH` requests of
#: 4096² images each met every other bound and took 5 GB
MAX_BATCH_PIXELS = 8 * MAX_IMAGE_PIXELS


def _images_of(request: Any) -> list[Any]:
    images = getattr(request, "images", None) or []
    if isinstance(images, (str, os.PathLike, Image.Image)):
        return [images]
    return list(images)


def check_batch_pixels(requests: Sequence[Any]) -> int:
    """The pixels of every image of ``requests`` together (each image's header read, nothing
    decoded; each image checked as :func:`probe_image` does, its error naming its request);
    :class:`InputError` with the limit when they exceed :data:`MAX_BATCH_PIXELS`."""
    total = n = 0
    B = len(requests)
    for i, r in enumerate(requests):
        for img in _images_of(r):
            try:
                w, h, _ = probe_image(img)
            except InputError as e:
                raise InputError(f"request {i} of the batch: {e}" if B > 1 else str(e)) from None
            total += w * h
            n += 1
    if total > MAX_BATCH_PIXELS:
        raise InputError(f"the {n} images of the {'batch' if B > 1 else 'request'} have "
                         f"{total:,} pixels in all; at most {MAX_BATCH_PIXELS:,} (8 × "
                         f"4096×4096) are decoded together: give fewer or smaller images, or "
                         f"split the batch")
    return total


def _check_request(lm, request: Request, where: str) -> tuple[Any, list[Image.Image], list[str]]:
    """One request checked: its chat messages (or, when the tokenizer has no chat template,
    the prompt itself: the text), its decoded images and their labels."""
    if not isinstance(request, Request):
        raise InputError(f"{where}must be a workbench Request (prompt + images), not "
                         f"{type(request).__name__}")
    try:
        prompt = check_prompt(request.prompt if request.prompt is not None else "")
    except InputError as e:
        raise InputError(f"{where}{e}") from None
    if isinstance(request.images, (str, os.PathLike, Image.Image)):
        raw_images: list[Any] = [request.images]
    else:
        raw_images = list(request.images)
    if raw_images and not lm.is_vision:
        raise InputError(f"{where}model {lm.model_id!r} is text-only "
                         f"({lm.layout.architecture}); it takes no images, got {len(raw_images)}")
    _check_image_count(lm, len(raw_images))
    images = [open_image(i) for i in raw_images]
    labels = [_label(i, n) for n, i in enumerate(raw_images)]
    if not getattr(lm.tokenizer, "chat_template", None):
        return prompt, images, labels
    content: list[dict[str, Any]] = [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": content}], images, labels


def _render(lm, requests: Sequence[Request], wheres: Sequence[str]
            ) -> list[tuple[str, list[Image.Image], list[str]]]:
    """Each request's prompt text (chat template applied) and decoded images, checked; the
    templates of all of them rendered by one bounded child process
    (:func:`~workbench.models.chat_template.render_chats`)."""
    checked = [_check_request(lm, r, w) for r, w in zip(requests, wheres)]
    chats = [m for m, _, _ in checked if not isinstance(m, str)]
    # bounded in time, memory and size: the template is the checkpoint's code
    # the batch is refused at its first error: stop there (a template that hangs on every
    # prompt must cost one time bound, not one per request)
    texts = iter(render_chats(lm.tokenizer, chats, stop_at_error=True) if chats else [])
    out = []
    for (m, images, labels), where in zip(checked, wheres):
        text = m if isinstance(m, str) else next(texts)
        if isinstance(text, TemplateRenderError):  # it raised (or ran away) on this prompt
            raise InputError(f"{where}the chat template of model {lm.model_id!r} refused the "
                             f"prompt: {text}")
        out.append((text, images, labels))
    return out


def build_batch_inputs(lm, requests: Sequence[Request], max_new_tokens: int = 0) -> ModelInputs:
    """Tokenise a batch of requests for ``lm``, run together: one row per request, padded on
    the left to the longest (the processor's attention mask marks the padding), images of all
    requests in request order. ``ModelInputs.request``/``valid`` give each flattened position
    its request and whether it is a real token. A batch of one is exactly :func:`build_inputs`
    (no padding)."""
    requests = list(requests)
    if not 1 <= len(requests) <= MAX_BATCH:
        raise InputError(f"a batch holds from 1 to {MAX_BATCH} requests, not {len(requests)}")
    B = len(requests)
    check_batch_pixels(requests)  # what the batch costs, before any image is decoded
    rendered = _render(lm, requests, [f"request {i} of the batch: " if B > 1 else ""
                                      for i in range(B)])
    texts = [t for t, _, _ in rendered]
    per_request = [imgs for _, imgs, _ in rendered]
    images = [im for imgs in per_request for im in imgs]
    labels = [lab for _, _, labs in rendered for lab in labs]
    tok = lm.tokenizer
    pad = dict(padding=True, padding_side="left") if B > 1 else {}
    if B > 1 and tok.pad_token_id is None:
        raise InputError(f"model {lm.model_id!r}: its tokenizer has no pad token, so requests "
                         f"cannot be batched; run them one at a time")
    if images:
        try:
            with quiet_transformers():  # the context check below says it in one line
                if lm.processor is not None:
                    tensors = dict(lm.processor(images=images, text=texts,
                                                return_tensors="pt", **pad))
                else:
                    tensors = _encode_with_image_processor(lm, texts, per_request, pad)
        except (InputError, MemoryError):  # out of memory is not a refused image
            raise
        except Exception as e:
            ip = lm.processor if lm.processor is not None else lm.image_processor
            raise InputError(
                f"the image processor of model {lm.model_id!r} ({type(ip).__name__}) refused "
                f"{', '.join(labels)}: {one_line(e)}") from None
    else:
        try:
            with quiet_transformers():
                tensors = dict(tok(texts, return_tensors="pt", **pad))
        except (InputError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 — the tokenizer's own (Rust) errors: a broken file
            raise ModelLoadError(
                f"the tokenizer of model {lm.model_id!r} (in {str(lm.path)!r}: tokenizer.json "
                f"/ tokenizer_config.json) cannot encode the prompt: {one_line(e)}; the model "
                f"folder's tokenizer is broken") from None
    _check_placeholders(lm, tensors, tok)
    tensors = {k: v.to(lm.device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    if "pixel_values" in tensors:
        tensors["pixel_values"] = tensors["pixel_values"].to(lm.model.dtype)
    n = tensors["input_ids"].shape[-1]
    ctx = lm.context_length
    if ctx and n + max_new_tokens > ctx:
        raise InputError(
            f"prompt is {n} tokens (images included{', the longest of the batch' if B > 1 else ''}"
            f"); with max_new_tokens={max_new_tokens} it exceeds the model's context of {ctx} "
            f"tokens")
    ids = tensors["input_ids"]
    mask = tensors.get("attention_mask")
    valid = (np.ones(ids.numel(), bool) if mask is None
             else mask.reshape(-1).cpu().numpy().astype(bool))
    return ModelInputs(tensors=tensors, prompt_text=texts[0] if B == 1 else "\n".join(texts),
                       modality=modality_of(ids, lm.image_token_id, lm.video_token_id),
                       request=np.repeat(np.arange(B, dtype=np.int16), ids.shape[-1]),
                       valid=valid, prompts=texts)


def _check_image_count(lm, n: int) -> None:
    """Refuse, before decoding anything, more images than the context could hold: each costs
    at least ``min_pixels / (patch·merge)²`` tokens with a Qwen-VL style image processor (at
    least one with any other)."""
    ctx = lm.context_length
    if not n or not ctx:
        return
    ip = lm.image_processor
    if ip is None and lm.processor is not None:
        ip = getattr(lm.processor, "image_processor", None)
    per = 1
    try:
        size = getattr(ip, "size", None) or {}
        min_pixels = int(getattr(ip, "min_pixels", None) or size.get("shortest_edge") or 0)
        unit = int(getattr(ip, "patch_size", 0) or 0) * int(getattr(ip, "merge_size", 0) or 0)
        if min_pixels > 0 and unit > 0:
            per = max(1, math.ceil(min_pixels / (unit * unit)))
    except (TypeError, ValueError, AttributeError):
        per = 1
    if n * per > ctx:
        raise InputError(f"{n} images need at least {n * per} tokens ({per} each), more than "
                         f"the model's context of {ctx} tokens; give fewer images")


def _check_placeholders(lm, tensors: dict, tok) -> None:
    """The prompt must not bring image/video placeholder tokens of its own: the model would
    look for pixels that are not there (or mismatch those that are)."""
    ids = tensors["input_ids"]
    has_images = "pixel_values" in tensors
    for token_id, what in ((lm.image_token_id, "image"), (lm.video_token_id, "video")):
        if token_id is None:
            continue
        if what == "image" and has_images and "image_grid_thw" not in tensors:
            continue  # a processor without patch grids: its own count is the reference
        found = int((ids == token_id).sum())
        expected = 0
        if what == "image" and "image_grid_thw" in tensors:
            ip = lm.image_processor
            if ip is None and lm.processor is not None:
                ip = getattr(lm.processor, "image_processor", None)
            merge = int(getattr(ip, "merge_size", 1) or 1)
            expected = int(tensors["image_grid_thw"].prod(-1).sum().item()) // (merge * merge)
        if found != expected:
            try:
                name = tok.convert_ids_to_tokens(int(token_id))
            except Exception:  # an id the tokenizer cannot even look up
                name = None
            if name is None or (has_images and found < expected):
                # the processor put its placeholders, but not under this id: the config's
                # token id and the tokenizer disagree (not the prompt's fault)
                raise InputError(
                    f"model {lm.model_id!r}: its config's {what}_token_id {int(token_id)} "
                    f"({'not a token of its tokenizer' if name is None else repr(name)}) is "
                    f"not the placeholder its processor inserts ({found} found where the images "
                    f"give {expected}); config.json and the tokenizer do not belong together")
            raise InputError(f"the prompt contains the model's {what} placeholder {name!r} "
                             f"itself ({found} {what} tokens where the images give "
                             f"{expected}); remove it: images are passed as images")


def _encode_with_image_processor(lm, texts: list[str], per_request: list[list[Image.Image]],
                                 pad: dict) -> dict:
    """Image processor + tokenizer: each image placeholder becomes one token per merged patch
    (``grid_t·grid_h·grid_w / merge_size²``), as the model's own processor would do; the
    images of every request in one processor call, in request order."""
    ip = lm.image_processor
    images = [im for imgs in per_request for im in imgs]
    enc = ip(images=images, return_tensors="pt")
    grid = enc["image_grid_thw"]
    merge = int(getattr(ip, "merge_size", 1) or 1)
    try:
        placeholder = lm.tokenizer.convert_ids_to_tokens(int(lm.image_token_id))
    except Exception:  # an id the tokenizer cannot even look up
        placeholder = None
    if not isinstance(placeholder, str) or not placeholder:
        raise InputError(
            f"model {lm.model_id!r}: its config's image_token_id {lm.image_token_id} is not a "
            f"token of its tokenizer; config.json and the tokenizer do not belong together")
    expanded, g = [], 0
    for text, imgs in zip(texts, per_request):
        parts = text.split(placeholder)
        if len(parts) - 1 < len(imgs):  # the chat template put another placeholder
            raise InputError(
                f"model {lm.model_id!r}: its config's image_token_id {lm.image_token_id} "
                f"({placeholder!r}) is not the placeholder its chat template inserts "
                f"({len(parts) - 1} found for {len(imgs)} images); config.json and the "
                f"tokenizer do not belong together")
        if len(parts) - 1 != len(imgs):
            raise InputError(f"the prompt contains the model's image placeholder {placeholder!r} "
                             f"itself ({len(parts) - 1} placeholders for {len(imgs)} images); "
                             f"remove it: images are passed as images")
        out = parts[0]
        for rest in parts[1:]:
            out += placeholder * int(grid[g].prod().item() // (merge * merge)) + rest
            g += 1
        expanded.append(out)
    tensors = dict(lm.tokenizer(expanded, return_tensors="pt", **pad))
    # per-token modality, as transformers processors return it (0 text, 1 image, 2 video):
    # the model needs it for multimodal RoPE
    tensors["mm_token_type_ids"] = torch.from_numpy(
        modality_of(tensors["input_ids"], lm.image_token_id, lm.video_token_id).astype(np.int64)
    ).reshape(tensors["input_ids"].shape)
    tensors["pixel_values"] = enc["pixel_values"]
    tensors["image_grid_thw"] = grid
    return tensors


