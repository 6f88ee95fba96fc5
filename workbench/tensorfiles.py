"""Folders of one safetensors file + one JSON header (MACS calibrations, MoE-Prism
refactorings): written file by file under a temporary name then renamed, never over an
existing header without ``overwrite``, every write failure one :class:`InputError` naming the
folder. No pickle."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from workbench.errors import InputError
from workbench.fileio import read_bytes_bounded, read_json, shorten


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


#: largest JSON header of a folder read (a real one is a few kB)
MAX_HEADER_JSON = 16 << 20


def load_header(folder: str | Path, config: str, fmt: str, what: str,
                dims: tuple[str, ...]) -> tuple[dict[str, Any], list[int]]:
    """The JSON header ``folder/config`` of a :func:`save_folder` folder, checked: read by
    :func:`workbench.fileio.read_json` (a regular file of at most :data:`MAX_HEADER_JSON`
    bytes, depth-limited), a mapping of format ``fmt`` whose ``dims`` are whole numbers in
    1 … 2²⁰ (the shapes the weights are then checked against; bounded so that a header cannot
    declare an 8 GB tensor). Returns (header, the dims' values); :class:`InputError` naming the
    file and the fault."""
    where = str(Path(folder) / config)
    meta = read_json(Path(folder) / config, MAX_HEADER_JSON, f"{what} header {where!r}")
    if meta.get("format") != fmt:
        raise InputError(f"{where!r} is not a {fmt} header (its format is "
                         f"{shorten(meta.get('format'))})")
    values = []
    for k in dims:
        v = meta.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
            raise InputError(f"{where!r}: {k} must be a whole number in 1 … {1 << 20}, "
                             f"not {shorten(v)}")
        values.append(v)
    return meta, values


def load_weights(folder: str | Path, weights: str, budget: int) -> dict[str, np.ndarray]:
    """The safetensors file ``folder/weights``, read by
    :func:`workbench.fileio.read_bytes_bounded` (a regular file, not empty, of at most
    ``budget`` bytes: what its header's shapes allow, so a file cannot make the reader allocate
    more) with its header checked by
    :func:`workbench.models.loading.safetensors_header`; :class:`InputError` naming the
    file and saying whether it is missing, empty, too large or unreadable."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    from workbench.errors import ModelLoadError
    from workbench.models.loading import safetensors_header

    f = Path(folder) / weights
    raw = read_bytes_bounded(f, budget, repr(str(f)))
    try:  # the header's dtypes, shapes and byte ranges checked before any tensor is built
        safetensors_header(io.BytesIO(raw), repr(str(f)))
        return load(raw)
    except ModelLoadError as e:
        raise InputError(str(e)) from None
    except (SafetensorError, ValueError) as e:
        raise InputError(f"{str(f)!r} cannot be read ({shorten(str(e))})") from None


__all__ = ["load_header", "load_weights", "save_folder"]
