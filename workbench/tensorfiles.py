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
    calibration"). The folder is checked first (:func:`check_output_folder`: blank paths,
    dangling or looping links and files in the way are refused) and written under its
    one-writer lock (:func:`writer_lock`; a caller may already hold it from its own checks
    on): a second writer of the same folder is refused with :class:`StoreBusyError`, never
    interleaved."""
    from workbench.telemetry.destination import check_output_folder, writer_lock

    out = check_output_folder(out, f"{what} folder", config=config, overwrite=overwrite,
                              holds=what)
    with writer_lock(out, f"{what} folder"):
        # checked again under the lock: another writer may have finished in between
        out = check_output_folder(out, f"{what} folder", config=config, overwrite=overwrite,
                                  holds=what)
        _write_folder(out, weights, config, tensors, meta, fmt, what)
    return out


def _write_folder(out: Path, weights: str, config: str, tensors: dict[str, np.ndarray],
                  meta: dict[str, Any], fmt: str, what: str) -> None:
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


def load_header(folder: str | Path, config: str, fmt: str, what: str,
                dims: tuple[str, ...]) -> tuple[dict[str, Any], list[int]]:
    """The JSON header ``folder/config`` of a :func:`save_folder` folder, checked: a mapping
    of format ``fmt`` whose ``dims`` are whole numbers in 1 … 2²⁰ (the shapes the weights are
    then checked against; bounded so that a header cannot declare an 8 GB tensor). Returns
    (header, the dims' values); :class:`InputError` naming the file and the fault."""
    where = str(Path(folder) / config)
    try:
        meta = json.loads((Path(folder) / config).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{where!r} is not a readable {what} "
                         f"({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise InputError(f"{where!r} is not a {fmt} header")
    values = []
    for k in dims:
        v = meta.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
            raise InputError(f"{where!r}: {k} must be a whole number in 1 … {1 << 20}, "
                             f"not {v!r}")
        values.append(v)
    return meta, values


def load_weights(folder: str | Path, weights: str, budget: int) -> dict[str, np.ndarray]:
    """The safetensors file ``folder/weights``, read only when it exists and holds at most
    ``budget`` bytes (what its header's shapes allow: a file cannot make the reader allocate
    more); :class:`InputError` naming the file otherwise or when it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    f = Path(folder) / weights
    size = f.stat().st_size if f.is_file() else -1
    if not 0 < size <= budget:
        raise InputError(f"{str(f)!r} is missing or larger than the {budget} bytes its "
                         f"header's shapes allow")
    try:
        return load_file(str(f))
    except (OSError, SafetensorError, ValueError) as e:
        raise InputError(f"{str(f)!r} cannot be read ({str(e)[:120]})") from None


__all__ = ["load_header", "load_weights", "save_folder"]
