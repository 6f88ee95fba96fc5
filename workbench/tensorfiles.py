"""Folders of one safetensors file + one JSON header (MACS calibrations, MoE-Prism
refactorings): written file by file under a temporary name then renamed, never over an
existing header without ``overwrite``, every write failure one :class:`InputError` naming the
folder. No pickle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from workbench.errors import InputError


def save_folder(out: str | Path, weights: str, config: str, tensors: dict[str, np.ndarray],
                meta: dict[str, Any], fmt: str, what: str, overwrite: bool = False) -> Path:
    """Write ``tensors`` to ``out/weights`` (safetensors, ``format`` metadata ``fmt``) and
    ``meta`` to ``out/config`` (JSON); ``what`` names the content in errors ("MACS
    calibration")."""
    out = Path(out)
    if (out / config).exists() and not overwrite:
        raise InputError(f"{str(out)!r} already holds a {what}; pass --overwrite "
                         f"(overwrite=True) to replace it")
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / (weights + ".tmp")
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp),
                  metadata={"format": fmt})
        tmp.replace(out / weights)
        tmp = out / (config + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(out / config)
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise InputError(f"cannot write the {what} to {str(out)!r}: "
                         f"{type(e).__name__}: {str(e)[:200]}") from None
    return out


__all__ = ["save_folder"]
