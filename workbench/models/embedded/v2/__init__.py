"""The embedded default model (v2, ``data/qwen3-vl-moe-small``): its task generator
(:mod:`.tasks`: multi-token answers, digit strips, text-only puzzles), its trainer with presets,
checkpoints and bit-exact ``--resume`` (:mod:`.train`), its evaluator (:mod:`.evaluate`), model
card (:mod:`.card`) and re-run checks (:mod:`.rerun`). It replaced the first embedded model
(``qwen3-vl-moe-tiny``, one-word answers), which is in the repository's history. Importing this
package is cheap (no torch).
"""

from pathlib import Path

_DATA = Path(__file__).resolve().parents[4] / "data"
V2_MODEL_DIR: Path = _DATA / "qwen3-vl-moe-small"
"""Where ``python -m workbench.models.embedded.v2.train --preset full`` writes the model by default
(the embedded default, ``workbench.models.embedded.EMBEDDED_MODEL_DIR``); it also holds
``workbench/macs``, which the trainer does not write, so writing over it needs ``--overwrite``."""
V2_DEMO_DIR: Path = _DATA / "demo"
"""Where it writes the demo requests (``prompts.json`` + images) by default: the dashboard's menu."""

__all__ = ["V2_DEMO_DIR", "V2_MODEL_DIR"]
