"""The small Qwen3-VL-MoE checkpoint that ships inside the repository (the embedded default).

``EMBEDDED_MODEL_DIR`` points at ``data/qwen3-vl-moe-small`` (repo root relative), a
``Qwen3VLMoeForConditionalGeneration`` checkpoint trained by
``python -m workbench.models.embedded.v2.train`` on scenes from
:mod:`workbench.models.embedded.v2.tasks`. Importing this package is cheap: it does
not import torch or transformers (the submodules do).
"""

from pathlib import Path

EMBEDDED_MODEL_DIR: Path = Path(__file__).resolve().parents[3] / "data" / "qwen3-vl-moe-small"
"""Absolute path of the trained checkpoint directory (may not exist before training)."""

__all__ = ["EMBEDDED_MODEL_DIR"]
