"""Limits that keep a hostile or broken trace file from taking the process down.

Every importer checks the size a file *declares* (a ``.npy`` header's shape, a ``.wbtrace``
header's layers × top_k times its token lines, the largest ``token_idx`` of a JSON-lines file)
against a **memory budget** before it allocates the trace's arrays, and reads text one bounded
line at a time. The budget, in bytes of the trace's arrays (ids, weights, per-token and per-step
arrays):

- given explicitly — ``max_bytes=`` of :func:`~workbench.traces.load_trace` and the readers, or
  the environment variable ``WORKBENCH_TRACE_MAX_BYTES`` (``2147483648``, ``4GiB``, ``500MB``):
  exactly that;
- by default: the larger of 64 MiB and 256 × the file's size, at most 2 GiB — so a 60-byte
  file cannot ask for gigabytes, and a real trace of any size up to 2 GiB of arrays loads.

:meth:`~workbench.traces.Trace.groups` (what replay builds next) has the same budget (without
the file-size part) for its access groups.
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any

from workbench.errors import InputError

ENV = "WORKBENCH_TRACE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 * 2**30          # 2 GiB of trace arrays
FLOOR_BYTES = 64 * 2**20               # a small file may always ask for this much …
FILE_RATIO = 256                       # … or this many times its size
MAX_JSONL_LINE = 8 * 2**20             # one JSON record (a (token, layer)): 8 MiB
MAX_PLAIN_LINE = 16 * 2**20            # one .wbtrace line (a token, all layers): 16 MiB
MAX_ATTR_TEXT = 16 * 2**20             # all @attr values of a .wbtrace together: 16 MiB
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def fmt_bytes(n: float) -> str:
    """``1.5 GiB``-style text of a byte count."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} bytes"


def _parse_bytes(value: Any, what: str) -> int:
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m and _UNITS.get(m.group(2).lower())
        if not m or unit is None:
            raise InputError(f"{what} {value[:40]!r} is not a byte count; use e.g. 2147483648, "
                             f"500MB or 4GiB")
        n = int(float(m.group(1)) * unit)
    else:
        try:
            n = operator.index(value)
        except TypeError:
            n = -1
        if isinstance(value, bool):
            n = -1
    if n < 1:
        raise InputError(f"{what} must be a positive number of bytes, got {value!r}")
    return n


def budget(max_bytes: Any = None, file_size: int | None = None) -> tuple[int, str]:
    """The memory budget in bytes and the text that says where it comes from (for errors)."""
    if max_bytes is not None:
        n = _parse_bytes(max_bytes, "max_bytes")
        return n, f"the memory budget max_bytes={n} ({fmt_bytes(n)})"
    env = os.environ.get(ENV)
    if env not in (None, ""):
        n = _parse_bytes(env, f"environment variable {ENV}")
        return n, f"the memory budget {ENV}={env} ({fmt_bytes(n)})"
    if file_size is None:
        return DEFAULT_MAX_BYTES, (f"the memory budget of {fmt_bytes(DEFAULT_MAX_BYTES)} "
                                   f"(raise it with {ENV} or max_bytes=)")
    n = min(DEFAULT_MAX_BYTES, max(FLOOR_BYTES, FILE_RATIO * file_size))
    return n, (f"the memory budget of {fmt_bytes(n)} for a file of {fmt_bytes(file_size)} (the "
               f"larger of {fmt_bytes(FLOOR_BYTES)} and {FILE_RATIO} × the file size, at most "
               f"{fmt_bytes(DEFAULT_MAX_BYTES)}; raise it with {ENV} or max_bytes=)")


def trace_bytes(tokens: int, layers: int, top_k: int, steps: int | None = None,
                weights: bool = True) -> int:
    """Bytes of a Trace's arrays: int16 ids (+ float32 weights) per slot; int32 step, int8
    modality and bool kept per token; int8 phase and int32 request per step."""
    steps = tokens if steps is None else steps
    return tokens * layers * top_k * (6 if weights else 2) + tokens * 6 + steps * 5


def check(need: int, limit: tuple[int, str], where: str, what: str) -> None:
    """Raise :class:`InputError` when ``need`` bytes exceed the budget ``limit``."""
    n, says = limit
    if need > n:
        raise InputError(f"{where}: {what} need {fmt_bytes(need)} of memory, more than {says}")


def show(value: Any, n: int = 60) -> str:
    """``repr(value)``, cut to ``n`` characters (error messages stay one short line):
    :func:`workbench.fileio.shorten`."""
    from workbench.fileio import shorten

    return shorten(value, n)


def cut(text: str, n: int = 100) -> str:
    """``text`` on one line, cut to ``n`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
