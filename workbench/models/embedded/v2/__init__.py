"""The v2 embedded model, being built (not yet the default): a richer task generator
(:mod:`.tasks`: multi-token answers, digit strips, text-only puzzles), its trainer with presets,
checkpoints and bit-exact ``--resume`` (:mod:`.train`), its evaluator (:mod:`.evaluate`) and
model card (:mod:`.card`). The shipped default stays ``data/qwen3-vl-moe-tiny`` until the v2
weights are trained and committed. Importing this package is cheap (no torch).
"""

from pathlib import Path

_DATA = Path(__file__).resolve().parents[4] / "data"
V2_MODEL_DIR: Path = _DATA / "qwen3-vl-moe-small"
"""Where ``python -m workbench.models.embedded.v2.train --preset full`` writes the model by default."""
V2_DEMO_DIR: Path = _DATA / "demo-small"
"""Where it writes the demo requests (``prompts.json`` + images) by default."""

__all__ = ["V2_DEMO_DIR", "V2_MODEL_DIR"]
