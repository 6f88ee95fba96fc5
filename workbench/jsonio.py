"""JSON read from disk, with a depth limit.

``json.loads`` recurses once per nesting level: a 200 KB document of 100 000 nested brackets (a
store attribute, a ``config.json``) raised ``RecursionError`` in its C scanner or later in code
that walks the value, and the CLI died with "internal error". :func:`loads` raises
``json.JSONDecodeError`` instead (a ``ValueError``, which every reader already turns into its
own clear message naming the file), for a document nested deeper than :data:`MAX_DEPTH`.
No file this project reads nests deeper than 6 levels.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "TooDeep", "loads"]

#: deepest nesting of arrays and objects a JSON document read from disk may have
MAX_DEPTH = 64


class TooDeep(json.JSONDecodeError):
    """A JSON document nested deeper than :data:`MAX_DEPTH` (a ``ValueError``)."""


def _depth_error(raw: Any) -> TooDeep:
    doc = raw if isinstance(raw, str) else bytes(raw[:200]).decode("utf-8", "replace")
    return TooDeep(f"nested deeper than {MAX_DEPTH} levels", doc, 0)


def loads(raw: str | bytes | bytearray, **kwargs: Any) -> Any:
    """``json.loads(raw, **kwargs)`` that refuses documents nested deeper than
    :data:`MAX_DEPTH` with :class:`TooDeep` (never ``RecursionError``)."""
    try:
        doc = json.loads(raw, **kwargs)
    except RecursionError:
        raise _depth_error(raw) from None
    # a value nests at most as deep as the document has opening brackets (those inside strings
    # only add to the count): with no more than MAX_DEPTH of them it cannot be too deep, and
    # the walk below (most of a small document's cost: every store open reads dozens) is skipped
    if isinstance(raw, str):
        openers = raw.count("[") + raw.count("{")
    else:
        openers = raw.count(b"[") + raw.count(b"{")
    if openers <= MAX_DEPTH:
        return doc
    # iterative walk: the value itself may be too deep for recursive code that reads it
    stack = [(doc, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > MAX_DEPTH:
                raise _depth_error(raw)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return doc
