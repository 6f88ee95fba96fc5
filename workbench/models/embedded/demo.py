"""The bundled demo requests (``data/demo/prompts.json`` and its images), read once, here.

Every consumer (the dashboard's demo menu, sweeps' default inputs, the benchmarks, the tests)
goes through :func:`read_demo`, which checks each entry and never raises: a missing or
malformed file gives an empty list, a malformed entry is skipped (logged). No torch import.
"""

from __future__ import annotations

import os

from workbench import jsonio
from workbench.fileio import read_bytes_bounded
import logging
from pathlib import Path
from typing import Any

from . import EMBEDDED_MODEL_DIR

log = logging.getLogger(__name__)

MAX_DEMO_FILE_BYTES = 64 * 1024 * 1024
"""``prompts.json`` larger than this is refused unread (it is a few KB)."""
MAX_DEMO_TEXT_CHARS = 1000
"""Characters of a prompt or answer kept."""


def demo_dir() -> Path:
    """``data/demo`` of the repository (bundled demo inputs; may not exist yet)."""
    return Path(EMBEDDED_MODEL_DIR).parent / "demo"


def read_demo(folder: str | Path | None = None, *, required: bool = False) -> list[dict[str, Any]]:
    """Demo requests ``[{"image", "prompt", "answer", "kind"}]`` from ``folder/prompts.json``
    (default :func:`demo_dir`), in file order: ``image`` an absolute path inside ``folder``
    (an existing file) or None for a text-only request (``"image": null``); ``answer`` and
    ``kind`` are ``""`` when the entry has none. Entries with no prompt, a non-string image or an
    image that is missing or outside the folder are skipped. ``required``: raise
    ``FileNotFoundError`` (naming the folder) instead of returning an empty list."""
    d = Path(folder) if folder is not None else demo_dir()
    items = _read_entries(d)
    if required and not items:
        raise FileNotFoundError(f"no usable demo requests in {d / 'prompts.json'}; they are written by "
                                f"the embedded model's training script (--demo-dir)")
    return items


def _read_entries(d: Path) -> list[dict[str, Any]]:
    try:
        f = d / "prompts.json"
        if not os.path.lexists(f):
            return []
        items = jsonio.loads(read_bytes_bounded(f, MAX_DEMO_FILE_BYTES, str(f)))
    except (OSError, ValueError, RecursionError) as e:  # InputError is a ValueError
        if not isinstance(e, FileNotFoundError):
            log.warning("demo inputs in %s are unreadable: %s", d, e)
        return []
    out = []
    for it in items if isinstance(items, list) else []:
        try:
            if not isinstance(it, dict) or not isinstance(it.get("prompt"), str) \
                    or not it["prompt"].strip() or not isinstance(it.get("image", ""), (str, type(None))):
                continue
            img = None if it.get("image", "") is None else d / it.get("image", "")
            if img is not None and (not img.is_file() or img.parent != d):
                continue
            out.append({"image": None if img is None else str(img),
                        "prompt": it["prompt"][:MAX_DEMO_TEXT_CHARS],
                        "answer": str(it.get("answer", ""))[:MAX_DEMO_TEXT_CHARS],
                        "kind": str(it.get("kind", ""))[:40]})
        except (OSError, ValueError):  # a name the file system refuses (NUL, too long, …)
            continue
    return out
