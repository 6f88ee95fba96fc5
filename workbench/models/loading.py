"""Load a local Hugging Face checkpoint directory, offline.

Nothing here touches the network: every ``from_pretrained`` call gets ``local_files_only=True``
and ``HF_HUB_OFFLINE`` is set for the process. A missing or broken directory raises
:class:`~workbench.errors.ModelLoadError` naming the path and what is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.errors import ModelLoadError
from workbench.models.adapter import MoELayout, find_moe_blocks

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


def _check_dir(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model directory {str(path)!r} has no config.json (a Hugging Face checkpoint "
            f"directory needs config.json, *.safetensors weights and tokenizer files)")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"model directory {str(path)!r} has no *.safetensors weights")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelLoadError(f"model directory {str(path)!r} has no tokenizer "
                             f"(tokenizer.json / tokenizer_config.json)")


def load(path: str | Path | None = None, *, dtype: str = "float32",
         device: str = "auto") -> LoadedModel:
    """Load the checkpoint at ``path`` (the embedded default model when ``None``)."""
    import transformers as tf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tf.utils.logging.disable_progress_bar()
    path = Path(path) if path is not None else default_model_dir()
    _check_dir(path)
    if dtype not in _DTYPES:
        from workbench.errors import KnobError

        raise KnobError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    dev = resolve_device(device)
    raw = (path / "config.json").read_bytes()
    try:
        json.loads(raw)
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"config.json in {str(path)!r} is not readable: {e}") from e
    is_vl = getattr(config, "vision_config", None) is not None
    auto = tf.AutoModelForImageTextToText if is_vl else tf.AutoModelForCausalLM
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = auto.from_pretrained(path, local_files_only=True, dtype=_DTYPES[dtype])
    except Exception as e:
        raise ModelLoadError(f"weights in {str(path)!r} could not be loaded: {e}") from e
    model = model.to(dev).eval()
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"tokenizer in {str(path)!r} could not be loaded: {e}") from e
    processor = image_processor = None
    notes: list[str] = []
    if is_vl:
        processor, image_processor, notes = _vision_processors(tf, path)
    image_id = getattr(config, "image_token_id", None) if is_vl else None
    video_id = getattr(config, "video_token_id", None) if is_vl else None
    return LoadedModel(
        model=model, tokenizer=tokenizer, processor=processor, image_processor=image_processor,
        path=path, model_id=path.name, config_hash=hashlib.sha256(raw).hexdigest()[:16],
        layout=find_moe_blocks(model), dtype=dtype, device=dev,
        image_token_id=image_id, video_token_id=video_id, notes=notes)


def _vision_processors(tf, path: Path) -> tuple[Any, Any, list[str]]:
    """AutoProcessor when it loads; else the PIL image processor (torchvision-free)."""
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        try:
            return tf.AutoProcessor.from_pretrained(path, local_files_only=True), None, []
        except Exception as e:  # e.g. a video processor that needs torchvision
            note = f"AutoProcessor did not load ({type(e).__name__}); using the PIL image processor"
        try:
            ip = tf.AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
        except Exception as e:
            raise ModelLoadError(
                f"image processor in {str(path)!r} could not be loaded "
                f"(preprocessor_config.json): {e}") from e
        return None, ip, [note]
    finally:
        quiet.setLevel(level)
