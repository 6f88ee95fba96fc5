"""Load a local Hugging Face checkpoint directory, offline.

Nothing here touches the network: every ``from_pretrained`` call gets ``local_files_only=True``
and ``HF_HUB_OFFLINE`` is set for the process. A missing or broken directory raises
:class:`~workbench.errors.ModelLoadError` naming the path and what is missing.

What :func:`load` checks, so that a broken checkpoint never runs with made-up weights:

- the directory (:func:`check_model_dir`): ``config.json`` a JSON object with a ``model_type``;
  weights in safetensors only — ``model.safetensors`` or every shard that
  ``model.safetensors.index.json`` names (``pytorch_model.bin`` & co. are pickles, which can run
  code when loaded: they are never opened); tokenizer files;
- each safetensors header (:func:`read_safetensors_header`, before transformers opens the file):
  its length, JSON, every tensor's dtype, shape and byte range inside the file;
- that ``config.json`` does not describe a model far bigger than the weights (built on the
  ``meta`` device, nothing allocated), so a bad config cannot make transformers allocate and
  randomly initialise tensors of absurd size;
- after loading, transformers' own loading report: a **missing** tensor (which transformers
  would initialise randomly) or a tensor of the **wrong shape** is an error naming it; an
  **unexpected** tensor (one the architecture has no place for: multi-token-prediction heads and
  the like, which real checkpoints ship) is ignored with a note in ``LoadedModel.notes`` — it
  cannot change the answer, and a renamed tensor shows up as missing anyway;
- every stored weight is a floating-point dtype (an ``int8``/``bool`` tensor cast to float is
  garbage; quantized checkpoints, with a ``quantization_config``, are left to transformers) and
  every weight is finite (:func:`check_weights`: NaN or inf weights are an error naming the
  tensor);
- the chat template renders a plain request;
- while running, the logits of every forward pass are finite (:func:`check_logits`, installed as
  a forward hook by :func:`load`): NaN logits say the weights or the dtype are broken.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.errors import ModelLoadError
from workbench.fileio import (check_regular_file, open_regular, parse_json, read_bytes_bounded,
                              read_json, read_text, shorten)
from workbench.errors import one_line as _one_line  # the shared one, under its old name here
from workbench.models.adapter import MoELayout, find_moe_blocks
from workbench.models.chat_template import TemplateRenderError, render_chat
from workbench.models.hooks import keep_forward_hook
from workbench.models.inputs import quiet_transformers as _quiet_transformers

#: largest config.json read (a real one is a few kB)
MAX_CONFIG_BYTES = 16 * 1024 * 1024
#: largest model.safetensors.index.json read (a real one is well under a MiB)
MAX_INDEX_BYTES = 64 * 1024 * 1024
#: largest safetensors header (the safetensors library's own limit)
MAX_HEADER_BYTES = 100_000_000
#: safetensors dtypes → bytes per element (F4 packs two per byte: counted as 1, see
#: :func:`read_safetensors_header`)
ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
             "F8_E8M0": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
             "U8": 1, "BOOL": 1}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"})
#: pickle-based weight files: never opened (unpickling can run arbitrary code)
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
#: how many tensor names a message lists before "… and N more"
_LIST = 5

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_dir() -> Path:
    """The embedded Qwen3-VL-MoE checkpoint shipped in ``data/``."""
    from workbench.models.embedded import EMBEDDED_MODEL_DIR

    return Path(EMBEDDED_MODEL_DIR)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        from workbench.errors import KnobError

        raise KnobError("device must be one of auto, cpu (no CUDA device here), not 'cuda'")
    return torch.device(device)


@dataclass
class LoadedModel:
    """A model ready for the runtime, with everything needed to build its inputs."""

    model: Any
    tokenizer: Any
    processor: Any | None  # AutoProcessor when it loads
    image_processor: Any | None  # fallback for VL models whose AutoProcessor does not load
    path: Path
    model_id: str
    config_hash: str
    layout: MoELayout
    dtype: str
    device: torch.device
    image_token_id: int | None = None
    video_token_id: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def is_vision(self) -> bool:
        return self.image_token_id is not None

    @property
    def context_length(self) -> int:
        cfg = self.model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        return int(getattr(cfg, "max_position_embeddings", 0) or 0)


def _names(items, limit: int = _LIST) -> str:
    items = sorted(map(str, items))
    head = ", ".join(repr(i) for i in items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _is_file(p: Path) -> bool:
    try:
        return stat.S_ISREG(p.stat().st_mode)
    except (OSError, ValueError):
        return False


def check_model_dir(path: str | Path) -> list[Path]:
    """Check a checkpoint directory without loading anything big; returns its safetensors
    weight files (in load order). Raises :class:`ModelLoadError` naming what is missing or
    broken."""
    path = Path(path)
    where = f"model directory {str(path)!r}"
    try:
        if not path.exists():
            raise ModelLoadError(f"{where} does not exist")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{where} cannot be read: {_one_line(e)}") from None
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    cfg = path / "config.json"
    if not _is_file(cfg) and (cfg.is_symlink() or os.path.lexists(cfg)) and cfg.exists():
        raise ModelLoadError(f"config.json in {str(path)!r} is not a regular file")
    if not _is_file(cfg):
        raise ModelLoadError(
            f"{where} has no config.json (a Hugging Face checkpoint "
            f"directory needs config.json, *.safetensors weights and tokenizer files)")
    cfg, _ = read_config(path)
    files = weight_files(path)
    if not any(os.path.lexists(path / f) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelLoadError(f"{where} has no tokenizer "
                             f"(tokenizer.json / tokenizer_config.json)")
    check_model_files(path, cfg)
    check_config_ranges(cfg, path)
    return files


#: files of a model folder that transformers opens itself (tokenizer, chat template,
#: processors, generation config) → (what a message calls them, largest size read, kind:
#: "json", "text" (UTF-8) or "bytes"). Each that is there is read by :func:`check_model_files`
#: before transformers is called: transformers skips a file that is not a regular file (a
#: FIFO, a dangling link) as if it were absent and loads on, with other answers.
MODEL_FILES = {
    "tokenizer.json": ("tokenizer", 64 << 20, "json"),
    "tokenizer_config.json": ("tokenizer", 16 << 20, "json"),
    "special_tokens_map.json": ("tokenizer", 1 << 20, "json"),
    "added_tokens.json": ("tokenizer", 16 << 20, "json"),
    "vocab.json": ("tokenizer", 64 << 20, "json"),
    "vocab.txt": ("tokenizer", 64 << 20, "text"),
    "merges.txt": ("tokenizer", 64 << 20, "text"),
    "tokenizer.model": ("tokenizer", 64 << 20, "bytes"),
    "chat_template.jinja": ("chat template", 1 << 20, "text"),
    "chat_template.json": ("chat template", 1 << 20, "json"),
    "preprocessor_config.json": ("image processor", 1 << 20, "json"),
    "processor_config.json": ("image processor", 1 << 20, "json"),
    "video_preprocessor_config.json": ("image processor", 1 << 20, "json"),
    "generation_config.json": ("generation config", 1 << 20, "json"),
}
#: the folder of a model's extra chat templates (``NAME.jinja``), read by transformers
_TEMPLATE_DIR = "additional_chat_templates"
#: the files that hold a tokenizer's vocabulary (one of them, or another ``*.model``, is needed)
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _glob(folder: Path, pattern: str) -> list[Path]:
    try:
        return sorted(folder.glob(pattern)) if folder.is_dir() else []
    except OSError:
        return []


def check_model_files(path: str | Path, cfg: dict[str, Any]) -> None:
    """Every file of :data:`MODEL_FILES` in the folder ``path`` is a regular file within its
    size limit, readable, valid JSON (an object) or UTF-8 where it should be; and the folder has
    what its config needs: ``tokenizer_config.json`` and a vocabulary file (a tokenizer without
    its config loads with other special tokens), and for a vision-language config (a
    ``vision_config``) ``preprocessor_config.json`` and a chat template (which places the image
    tokens). :class:`ModelLoadError` naming the file otherwise."""
    path = Path(path)
    docs: dict[str, Any] = {}
    # and what transformers globs: any *.model (a sentencepiece vocabulary) and the extra
    # templates in additional_chat_templates/
    found = {**MODEL_FILES,
             **{f.name: MODEL_FILES["tokenizer.model"] for f in _glob(path, "*.model")},
             **{f"{_TEMPLATE_DIR}/{f.name}": MODEL_FILES["chat_template.jinja"]
                for f in _glob(path / _TEMPLATE_DIR, "*.jinja")}}
    for name, (kind, limit, fmt) in found.items():
        f = path / name
        if not os.path.lexists(f):
            continue
        what = f"{kind} in {str(path)!r}: {name}"
        if fmt == "json":
            docs[name] = read_json(f, limit, what, ModelLoadError)
        elif fmt == "text":
            read_text(f, limit, what, ModelLoadError)
        else:
            read_bytes_bounded(f, limit, what, ModelLoadError)
    if "generation_config.json" in docs:
        check_generation_tokens(docs["generation_config.json"], cfg, path)
    tokenizer = f"tokenizer in {str(path)!r}"
    if "tokenizer_config.json" not in docs:
        raise ModelLoadError(f"{tokenizer} is incomplete: it has no tokenizer_config.json "
                             f"(its special tokens and settings)")
    if not any(os.path.lexists(path / f) for f in _VOCAB_FILES) and not _glob(path, "*.model"):
        raise ModelLoadError(f"{tokenizer} is incomplete: it has none of "
                             f"{', '.join(_VOCAB_FILES)} (its vocabulary)")
    if cfg.get("vision_config") is not None:
        if "preprocessor_config.json" not in docs:
            raise ModelLoadError(f"image processor in {str(path)!r} is missing: config.json "
                                 f"has a vision_config, which needs preprocessor_config.json")
        if not (os.path.lexists(path / "chat_template.jinja") or "chat_template.json" in docs
                or docs["tokenizer_config.json"].get("chat_template")
                or docs.get("processor_config.json", {}).get("chat_template")):
            raise ModelLoadError(f"chat template in {str(path)!r} is missing: config.json has "
                                 f"a vision_config, whose requests need a chat template "
                                 f"(chat_template.jinja) to place the image tokens")


#: token-id fields of generation_config.json that generation turns into tensors
_GENERATION_TOKEN_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")


def check_generation_tokens(gen: Any, cfg: dict[str, Any], path: str | Path) -> None:
    """Refuse a generation_config.json whose token ids are not token ids: each of
    :data:`_GENERATION_TOKEN_KEYS` is absent, null, a whole number in 0 … vocab − 1 or a
    non-empty list of them (``"eos_token_id": "x"`` failed inside generate with a TypeError).
    :class:`ModelLoadError` naming the field, its value and what is allowed."""
    where = f"generation config in {str(path)!r}: generation_config.json"
    if not isinstance(gen, dict):
        return  # read_json already insists on an object
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    vocab = text.get("vocab_size")
    top = vocab - 1 if _whole(vocab) and vocab > 0 else None

    def ok(i: Any) -> bool:
        return _whole(i) and i >= 0 and (top is None or i <= top)

    for key in _GENERATION_TOKEN_KEYS:
        v = gen.get(key)
        if v is None:
            continue
        if ok(v) or (isinstance(v, list) and v and len(v) <= 1024 and all(ok(i) for i in v)):
            continue
        ids = f"0 … {top} (the vocabulary has {vocab} tokens)" if top is not None else "≥ 0"
        raise ModelLoadError(f"{where}: {key} = {shorten(v)} is not a token id: a whole "
                             f"number in {ids}, a non-empty list of them, or null")


def takes_images(path: str | Path | None) -> bool:
    """Whether the checkpoint at ``path`` (None: the embedded model) is a vision-language
    model, from its config.json alone (no load); True when that cannot be read — a load then
    names what is wrong. For defaults that must not offer a text-only model images."""
    if path is None:
        return True
    try:
        cfg, _ = read_config(path)
    except ModelLoadError:
        return True
    return cfg.get("vision_config") is not None


def read_config(path: str | Path) -> tuple[dict[str, Any], bytes]:
    """``(config.json as a dict, its bytes)``; :class:`ModelLoadError` unless it is a JSON
    object of at most :data:`MAX_CONFIG_BYTES` bytes with a ``model_type``."""
    path = Path(path)
    where = f"config.json in {str(path)!r}"
    raw = read_bytes_bounded(path / "config.json", MAX_CONFIG_BYTES, where, ModelLoadError)
    cfg = parse_json(raw, where, ModelLoadError)
    if not isinstance(cfg.get("model_type"), str) or not cfg["model_type"]:
        raise ModelLoadError(f"{where} is not readable: it has no \"model_type\" (the "
                             f"architecture, e.g. \"qwen3_vl_moe\")")
    return cfg, raw


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files transformers would load from ``path``: ``model.safetensors``, else
    the shards of ``model.safetensors.index.json``. Pickle weights are refused, never read."""
    path = Path(path)
    where = f"model directory {str(path)!r}"
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.exists() and not _is_file(single):
        raise ModelLoadError(f"{where}: model.safetensors is not a regular file")
    if _is_file(single):
        return [single]
    if os.path.lexists(index):
        idx = read_json(index, MAX_INDEX_BYTES, f"{where}: model.safetensors.index.json",
                        ModelLoadError, obj=False)
        wmap = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wmap, dict) or not wmap or not all(
                isinstance(v, str) for v in wmap.values()):
            raise ModelLoadError(f"{where}: model.safetensors.index.json is not a valid shard "
                                 f"index: its weight_map must map tensor names to shard file "
                                 f"names, not {shorten(wmap)}")
        shards = []
        for name in dict.fromkeys(wmap.values()):
            f = path / name
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise ModelLoadError(f"{where}: model.safetensors.index.json names shard "
                                     f"{shorten(name)}; shards must be *.safetensors files in "
                                     f"the directory itself")
            if os.path.lexists(f):  # there, but perhaps a FIFO or a directory
                check_regular_file(f, f"{where}: shard {shorten(name)}", ModelLoadError,
                                   empty_ok=True)
            if not _is_file(f):
                raise ModelLoadError(f"{where} lacks shard {shorten(name)}, which "
                                     f"model.safetensors.index.json lists for "
                                     f"{sum(v == name for v in wmap.values())} tensors")
            shards.append(f)
        return shards
    others = sorted(f.name for f in path.glob("*.safetensors") if _is_file(f))
    if others:
        raise ModelLoadError(f"{where} has {_names(others)} but neither model.safetensors nor "
                             f"model.safetensors.index.json naming them")
    pickles = sorted({f.name for pat in PICKLE_PATTERNS for f in path.glob(pat)})
    if pickles:
        raise ModelLoadError(
            f"{where} has no *.safetensors weights, only {_names(pickles)}: pickle files can "
            f"run code when loaded, so they are never opened; convert them to safetensors "
            f"(e.g. transformers' save_pretrained(..., safe_serialization=True)) first")
    raise ModelLoadError(f"{where} has no *.safetensors weights")


def read_safetensors_header(f: str | Path) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors file, ``{name: {"dtype", "shape", "data_offsets"}}``, with
    the header checked against the file: length, JSON, known dtypes, shapes, and byte ranges
    that match the shapes and lie inside the file. Raises :class:`ModelLoadError` naming the
    file (and tensor)."""
    f = Path(f)
    where = f"weights in {str(f.parent)!r} could not be loaded: {f.name}"
    # a FIFO would block the open, /dev/zero never ends: refused before it is opened
    with open_regular(f, where, ModelLoadError, empty_ok=True) as fh:
        return safetensors_header(fh, where)


def _num(v: int) -> str:
    """A whole number for a message: ``1,234`` (a giant from a file: :func:`shorten`)."""
    return f"{v:,}" if abs(v) < 10**18 else shorten(v)


def safetensors_budget(tensors: dict[str, dict[str, Any]]) -> int:
    """The most bytes a safetensors file with the checked header ``tensors`` (of
    :func:`read_safetensors_header`) can have: its data, the 8-byte length and the largest
    header. A bound to read such a file whole by :func:`workbench.fileio.read_bytes_bounded`."""
    data = sum(math.prod(t["shape"]) * ST_DTYPES[t["dtype"]] for t in tensors.values())
    return data + 8 + MAX_HEADER_BYTES


def safetensors_header(fh, where: str) -> dict[str, dict[str, Any]]:
    """:func:`read_safetensors_header` of the open binary file (or ``io.BytesIO``) ``fh`` of a
    regular file; ``where`` names it in errors."""
    try:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(0)
        head = fh.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{where} is {'empty' if not size else f'{size} bytes'}: "
                                 f"too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise ModelLoadError(
                f"{where} is not a safetensors file: its header claims {n:,} bytes "
                f"(the file has {size:,}; headers are at most {MAX_HEADER_BYTES:,})")
        raw = fh.read(n)
    except OSError as e:
        raise ModelLoadError(f"{where} is not readable: {_one_line(e)}") from None
    header = parse_json(raw, f"{where} is not a safetensors file: its header", ModelLoadError)
    data = size - 8 - n
    tensors: dict[str, dict[str, Any]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        bad = f"{where}: tensor {shorten(name)} has a broken header entry"
        if not isinstance(info, dict):
            raise ModelLoadError(f"{bad} ({_one_line(info, 80)})")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in ST_DTYPES:
            raise ModelLoadError(f"{bad}: dtype {dtype!r} is not one of "
                                 f"{', '.join(ST_DTYPES)}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ModelLoadError(f"{bad}: shape {_one_line(shape, 80)} is not a list of "
                                 f"sizes ≥ 0")
        if not (isinstance(offs, list) and len(offs) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise ModelLoadError(f"{bad}: data_offsets {_one_line(offs, 80)} are not "
                                 f"[begin, end] with 0 ≤ begin ≤ end")
        nbytes = math.prod(shape) * ST_DTYPES[dtype]
        if offs[1] - offs[0] != nbytes:
            raise ModelLoadError(f"{bad}: shape {shorten(shape)} of {dtype} needs "
                                 f"{_num(nbytes)} bytes, its data_offsets span "
                                 f"{_num(offs[1] - offs[0])}")
        if offs[1] > data:
            raise ModelLoadError(
                f"{where} is truncated: tensor {shorten(name)} ends at byte {_num(offs[1])} of the "
                f"data, which holds {data:,} bytes")
        end = max(end, offs[1])
        tensors[name] = {"dtype": dtype, "shape": tuple(shape), "data_offsets": tuple(offs)}
    if end != data:
        raise ModelLoadError(f"{where} is not a valid safetensors file: its tensors cover "
                             f"{end:,} of its {data:,} data bytes")
    return tensors




def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: config keys that hold token ids the vision path looks for in the prompt
_VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id",
                      "vision_end_token_id")


def check_config_ranges(cfg: dict[str, Any], path: str | Path) -> None:
    """Refuse a config.json whose index and count fields point outside the model's own shape
    (transformers accepts them and computes something else: ``deepstack_visual_indexes:
    [100]`` of a 4-block vision tower silently drops the deepstack features). Checked in the
    config and its ``text_config``/``vision_config``: ``deepstack_visual_indexes`` within the
    vision ``depth``, distinct (and no more of them than text layers); ``mrope_section``
    summing to half the head width; ``mlp_only_layers`` within
    ``num_hidden_layers``; ``decoder_sparse_step`` in 1 … layers; ``first_k_dense_replace`` in
    0 … layers; ``num_experts_per_tok`` in 1 … the experts; ``n_group`` dividing the experts
    and ``topk_group`` in 1 … ``n_group`` (these crashed a run); the vision token ids within
    the vocabulary. :class:`ModelLoadError` naming the field, its value and the allowed range."""
    where = f"config.json in {str(path)!r}"
    parts = [("", cfg)] + [(f"{k}.", cfg[k]) for k in ("text_config", "vision_config")
                           if isinstance(cfg.get(k), dict)]
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    text_layers = text.get("num_hidden_layers")

    def refuse(key: str, v: Any, allowed: str) -> None:
        raise ModelLoadError(f"{where}: {key} = {shorten(v)} is outside the model: {allowed}")

    def indexes(key: str, v: Any, n: Any, of: str) -> None:
        if v is None or not _whole(n):
            return
        if not isinstance(v, list) or not all(_whole(i) and 0 <= i < n for i in v):
            refuse(key, v, f"a list of indexes in 0 … {n - 1} (the model has {n} {of})")

    def within(key: str, v: Any, lo: int, hi: Any, allowed: str) -> None:
        if v is None or not _whole(hi):
            return
        if not _whole(v) or not lo <= v <= hi:
            refuse(key, v, allowed)

    for pre, d in parts:
        layers = d.get("num_hidden_layers")
        indexes(pre + "mlp_only_layers", d.get("mlp_only_layers"), layers, "layers")
        within(pre + "decoder_sparse_step", d.get("decoder_sparse_step"), 1, layers,
               f"a whole number in 1 … {layers} (the model has {layers} layers)")
        within(pre + "first_k_dense_replace", d.get("first_k_dense_replace"), 0, layers,
               f"a whole number in 0 … {layers} (the model has {layers} layers)")
        experts = next((d[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if _whole(d.get(k))), None)
        k = d.get("num_experts_per_tok")
        within(pre + "num_experts_per_tok", k, 1, experts,
               f"top-{shorten(k)} of {experts} experts; it must be between 1 and the "
               f"number of experts")
        groups = d.get("n_group")  # group-limited routing (DeepSeek): groups of experts
        if groups is not None and _whole(experts) and not (
                _whole(groups) and 1 <= groups <= experts and experts % groups == 0):
            refuse(pre + "n_group", groups, f"a whole number ≥ 1 that divides the {experts} "
                                            f"experts")
        within(pre + "topk_group", d.get("topk_group"), 1, groups if _whole(experts) else None,
               f"a whole number in 1 … n_group = {groups}")
        ds = d.get("deepstack_visual_indexes")
        indexes(pre + "deepstack_visual_indexes", ds, d.get("depth"), "vision blocks")
        if isinstance(ds, list) and len(set(ds)) != len(ds):  # a repeat drops a merger
            refuse(pre + "deepstack_visual_indexes", ds, "distinct indexes (each feeds its "
                                                         "own merger)")
        for rope_key in ("rope_parameters", "rope_scaling"):
            rope = d.get(rope_key)
            sections = rope.get("mrope_section") if isinstance(rope, dict) else None
            head = d.get("head_dim")
            if not _whole(head) and _whole(d.get("hidden_size")) and \
                    _whole(d.get("num_attention_heads")) and d["num_attention_heads"] > 0:
                head = d["hidden_size"] // d["num_attention_heads"]
            if sections is not None and _whole(head) and not (
                    isinstance(sections, list) and all(_whole(x) and x >= 0 for x in sections)
                    and sum(sections) == head // 2):
                refuse(f"{pre}{rope_key}.mrope_section", sections,
                       f"sizes ≥ 0 that sum to head_dim / 2 = {head // 2} (the rotary "
                       f"frequencies of a {head}-wide head)")
        if isinstance(ds, list) and _whole(text_layers) and len(ds) > text_layers:
            refuse(pre + "deepstack_visual_indexes", ds,
                   f"at most {text_layers} indexes (each feeds one of the {text_layers} text "
                   f"layers)")
    vocab = text.get("vocab_size")
    if _whole(vocab):
        for pre, d in parts[:2]:
            for key in _VISION_TOKEN_KEYS:
                within(pre + key, d.get(key), 0, vocab - 1,
                       f"a token id in 0 … {vocab - 1} (the vocabulary has {vocab} tokens)")


#: config keys that declare a depth, and the tensor-name segment that numbers those layers
_DEPTH_KEYS = {"num_hidden_layers": "layers", "num_layers": "layers", "depth": "blocks"}


def _check_declared_depth(cfg: dict[str, Any], tensors: dict[str, dict[str, Any]],
                          path: Path) -> None:
    """Refuse a config.json that declares far more layers than the weights number, before
    anything is built: ``num_hidden_layers=100000`` took 76 s and 4 GB to build on the meta
    device before the size check could refuse it. Layers present = the largest index after
    ``.layers.`` (``.blocks.`` for a vision tower's ``depth``) + 1; refused only past 4 × that
    + 16 (a gross mismatch, never a real checkpoint)."""
    import re

    have = {}
    for seg in set(_DEPTH_KEYS.values()):
        idx = [int(m.group(1)) for name in tensors
               for m in [re.search(rf"(?:^|\.){seg}\.(\d+)\.", name)] if m]
        have[seg] = max(idx) + 1 if idx else 0
    todo = [("", cfg)]
    while todo:
        where, d = todo.pop()
        for k, v in d.items():
            if isinstance(v, dict) and where.count(".") < 3:
                todo.append((f"{where}{k}.", v))
            elif k in _DEPTH_KEYS and isinstance(v, int) and not isinstance(v, bool):
                n = have[_DEPTH_KEYS[k]]
                if v > 4 * n + 16:
                    raise ModelLoadError(
                        f"config.json in {str(path)!r} declares {where}{k} = "
                        f"{_num(v)}, but the "
                        f"weights number {n:,} {_DEPTH_KEYS[k]}: the config and the weights "
                        f"do not belong together")


def _check_config_size(auto, config, tensors: dict[str, dict[str, Any]], path: Path) -> None:
    """Refuse a config.json that describes a model far bigger than its weights, before
    transformers allocates (and randomly initialises) it: built on the meta device."""
    stored = sum(math.prod(t["shape"]) for t in tensors.values())
    try:
        with _quiet_transformers(), torch.device("meta"):
            skeleton = auto.from_config(config)
    except Exception as e:
        raise ModelLoadError(f"config.json in {str(path)!r} does not describe a buildable "
                             f"model: {_one_line(e)}") from None
    wanted = sum(p.numel() for p in skeleton.parameters())
    del skeleton
    if wanted > 2 * stored + 1_000_000:
        raise ModelLoadError(
            f"config.json in {str(path)!r} describes a model of {wanted:,} parameters, but "
            f"the weights hold {stored:,} values: the config and the weights do not belong "
            f"together (or most tensors are missing)")


def check_weights(model: Any, where: str, chunk: int = 1 << 24) -> None:
    """Raise :class:`ModelLoadError` if a floating-point parameter or buffer of ``model`` holds
    NaN or inf (scanned in chunks of ``chunk`` elements, so no big temporary)."""
    bad = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point() or t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        n = 0
        for i in range(0, flat.numel(), chunk):
            n += int((~torch.isfinite(flat[i:i + chunk])).sum())
        if n:
            bad.append((name, n, t.numel()))
    if bad:
        first = ", ".join(f"{n!r} ({k:,} of {m:,} values)" for n, k, m in bad[:_LIST])
        more = f" and {len(bad) - _LIST} more tensors" if len(bad) > _LIST else ""
        raise ModelLoadError(f"weights in {where} are broken: NaN or inf in {first}{more}; "
                             f"the checkpoint is corrupt (re-download or re-export it)")


def check_logits(logits: torch.Tensor, model_dir: str | Path, dtype: str | None = None) -> None:
    """Raise :class:`ModelLoadError` if ``logits`` hold NaN or inf: the weights are broken (or
    the compute dtype overflows). Cheap: call it on the last position of each step."""
    if logits.is_floating_point() and not bool(torch.isfinite(logits).all()):
        hint = (f"; or dtype {dtype} overflows: try dtype=float32" if dtype in ("float16",
                                                                                "bfloat16")
                else "")
        raise ModelLoadError(
            f"the model in {str(model_dir)!r} produced NaN/inf logits: its weights are broken "
            f"(a corrupt or wrongly converted checkpoint){hint}")


def _logits_guard(lm: "LoadedModel"):
    """A forward hook that runs :func:`check_logits` on the last position of every forward."""

    def hook(module, args, output):
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)) and output \
                and isinstance(output[0], torch.Tensor):
            logits = output[0]
        if isinstance(logits, torch.Tensor) and logits.dim() >= 2 and logits.shape[-2] > 0:
            check_logits(logits[..., -1, :], lm.path, lm.dtype)

    return hook


def load(path: str | Path | None = None, *, dtype: str = "float32",
         device: str = "auto", check: bool = True) -> LoadedModel:
    """Load the checkpoint at ``path`` (the embedded default model when ``None``). ``check``
    (default): scan every weight for NaN/inf and guard every forward pass's logits (see the
    module docstring); the structural checks always run."""
    import transformers as tf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tf.utils.logging.disable_progress_bar()
    path = Path(path) if path is not None else default_model_dir()
    files = check_model_dir(path)
    if dtype not in _DTYPES:
        from workbench.errors import KnobError

        raise KnobError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    dev = resolve_device(device)
    cfg_dict, raw = read_config(path)
    tensors: dict[str, dict[str, Any]] = {}
    for f in files:
        tensors.update(read_safetensors_header(f))
    _check_declared_depth(cfg_dict, tensors, path)
    try:
        with _quiet_transformers():
            config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"config.json in {str(path)!r} is not readable: "
                             f"{_one_line(e)}") from None
    is_vl = getattr(config, "vision_config", None) is not None
    auto = tf.AutoModelForImageTextToText if is_vl else tf.AutoModelForCausalLM
    quantized = "quantization_config" in cfg_dict
    if not quantized:
        _check_config_size(auto, config, tensors, path)
    try:
        with _quiet_transformers():
            model, info = auto.from_pretrained(
                path, local_files_only=True, dtype=_DTYPES[dtype], use_safetensors=True,
                output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as e:
        raise ModelLoadError(f"weights in {str(path)!r} could not be loaded: "
                             f"{_one_line(e)}") from None
    notes: list[str] = []
    _check_loading_info(info, path, notes)
    if not quantized:
        _check_dtypes(model, tensors, info, path)
    if check:
        check_weights(model, repr(str(path)))
    model = model.to(dev).eval()
    try:
        with _quiet_transformers():
            tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"tokenizer in {str(path)!r} could not be loaded: "
                             f"{_one_line(e)}") from None
    _check_chat_template(tokenizer, path, is_vl)
    processor = image_processor = None
    if is_vl:
        processor, image_processor, vnotes = _vision_processors(tf, path)
        notes += vnotes
        _check_normalisation(image_processor if image_processor is not None else
                             getattr(processor, "image_processor", None), path)
    image_id = getattr(config, "image_token_id", None) if is_vl else None
    video_id = getattr(config, "video_token_id", None) if is_vl else None
    layout = find_moe_blocks(model)
    for b in layout.blocks:
        if not 1 <= b.top_k <= b.num_experts:
            raise ModelLoadError(
                f"config.json in {str(path)!r}: MoE block {b.name} routes to top-{b.top_k} of "
                f"{b.num_experts} experts; top-k (num_experts_per_tok) must be between 1 and "
                f"the number of experts")
    lm = LoadedModel(
        model=model, tokenizer=tokenizer, processor=processor, image_processor=image_processor,
        path=path, model_id=path.name, config_hash=hashlib.sha256(raw).hexdigest()[:16],
        layout=layout, dtype=dtype, device=dev,
        image_token_id=image_id, video_token_id=video_id, notes=notes)
    if check:
        keep_forward_hook(model, _logits_guard(lm))
    return lm


def _check_loading_info(info: dict[str, Any], path: Path, notes: list[str]) -> None:
    """transformers' loading report → errors (missing, mismatched, failed) and a note
    (unexpected tensors, which are ignored)."""
    where = f"weights in {str(path)!r}"
    errors = list(info.get("error_msgs") or [])
    conv = info.get("conversion_errors") or {}
    if errors or conv:
        what = errors[0] if errors else next(iter(conv.values()))
        raise ModelLoadError(f"{where} could not be loaded: {_one_line(what)}")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ModelLoadError(
            f"{where} lack {len(missing)} tensor{'s' * (len(missing) != 1)} the model needs: "
            f"{_names(missing)} (transformers would fill them with random values); the "
            f"checkpoint is incomplete or belongs to another architecture")
    mism = sorted(info.get("mismatched_keys") or [], key=lambda m: m[0])
    if mism:
        shown = ", ".join(f"{k!r} is {tuple(a)} in the checkpoint, {tuple(b)} in the model"
                          for k, a, b in mism[:_LIST])
        more = f" and {len(mism) - _LIST} more" if len(mism) > _LIST else ""
        raise ModelLoadError(f"{where} do not fit config.json: {shown}{more}")
    extra = sorted(info.get("unexpected_keys") or [])
    if extra:
        notes.append(f"ignored {len(extra)} tensor{'s' * (len(extra) != 1)} of the checkpoint "
                     f"that the architecture does not use: {_names(extra)}")


def _check_dtypes(model: Any, tensors: dict[str, dict[str, Any]], info: dict[str, Any],
                  path: Path) -> None:
    """Every stored tensor the model loads must be floating point unless the model's own
    tensor of that name is an integer buffer (int8/bool weights cast to float are garbage)."""
    state = model.state_dict()
    unexpected = set(info.get("unexpected_keys") or [])
    bad = []
    for name, t in tensors.items():
        if t["dtype"] in FLOAT_DTYPES or name in unexpected:
            continue
        mine = state.get(name)
        if mine is not None and not mine.is_floating_point():
            continue  # an integer buffer stored as such (position ids, counters)
        bad.append(f"{shorten(name)} ({t['dtype']})")
    if bad:
        raise ModelLoadError(
            f"weights in {str(path)!r} store {', '.join(bad[:_LIST])}"
            f"{f' and {len(bad) - _LIST} more' if len(bad) > _LIST else ''} as "
            f"integers/booleans where the model needs floating-point weights "
            f"({', '.join(sorted(FLOAT_DTYPES))}); quantized checkpoints need a "
            f"quantization_config in config.json")


def _check_chat_template(tokenizer: Any, path: Path, is_vl: bool) -> None:
    """The chat template (when there is one) must render the kind of request build_inputs
    sends; a broken template is a broken checkpoint, found at load rather than at run."""
    if not getattr(tokenizer, "chat_template", None):
        return
    content: list[dict[str, Any]] = ([{"type": "image"}] if is_vl else [])
    content.append({"type": "text", "text": "hello"})
    try:
        with _quiet_transformers():
            render_chat(tokenizer, [{"role": "user", "content": content}])
    except TemplateRenderError as e:
        raise ModelLoadError(f"chat template in {str(path)!r} (chat_template.jinja or "
                             f"tokenizer_config.json) is broken: {_one_line(e)}") from None


def _check_normalisation(ip: Any, path: Path) -> None:
    """The image processor divides pixels by ``image_std``: a 0 (or a value that is not a finite
    number) turns every image into inf/NaN, which the logits guard then blamed on the weights
    (issue 26). Refused at load, naming the file and the value."""
    if ip is None:
        return
    for name in ("image_mean", "image_std"):
        v = getattr(ip, name, None)
        if v is None:
            continue
        vals = list(v) if isinstance(v, (list, tuple)) else [v]
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                 for x in vals)
        if not ok or (name == "image_std" and any(x <= 0 for x in vals)):
            raise ModelLoadError(
                f"image processor in {str(path)!r} ({_processor_files(path)}): {name} is "
                f"{vals!r}; it must hold finite numbers" + (", each > 0 (pixels are divided "
                                                           "by it)" if name == "image_std" else ""))


def _processor_files(path: Path) -> str:
    """The processor files of ``path`` that transformers reads an image processor from (a
    broken processor_config.json was blamed on preprocessor_config.json)."""
    names = [n for n in ("preprocessor_config.json", "processor_config.json")
             if os.path.lexists(path / n)]
    return " and ".join(names) or "preprocessor_config.json"


def _vision_processors(tf, path: Path) -> tuple[Any, Any, list[str]]:
    """AutoProcessor when it loads; else the PIL image processor (torchvision-free)."""
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        try:
            return tf.AutoProcessor.from_pretrained(path, local_files_only=True), None, []
        except ImportError as e:  # the usual case: its video processor needs torchvision, which
            # this torch has no build of; images work the same through the PIL processor, so
            # this is not worth a note on every command (videos are not supported either way)
            logging.getLogger(__name__).debug("AutoProcessor did not load (%s); using the PIL image "
                                              "processor", e)
            note = None
        except Exception as e:
            note = f"AutoProcessor did not load ({type(e).__name__}); using the PIL image processor"
        try:
            ip = tf.AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
        except Exception as e:
            raise ModelLoadError(
                f"image processor in {str(path)!r} could not be loaded "
                f"({_processor_files(path)}): {_one_line(e)}") from None
        return None, ip, [note] if note else []
    finally:
        quiet.setLevel(level)
