"""Process-wide options (as opposed to per-run knobs), like ``xarray.set_options``.

>>> import workbench
>>> with workbench.set_options(flush_every=4):
...     pass
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_OPTIONS: dict[str, Any] = {
    # where runs without an explicit store path go: $WORKBENCH_WORKSPACE, else runs/ (the CLI,
    # the Python API and the dashboard agree)
    "workspace": Path(os.environ.get("WORKBENCH_WORKSPACE") or "runs"),
    "flush_every": 32,  # steps buffered before an append to the store
    "flush_interval_s": 0.5,  # … or seconds since the last append, whichever first
    # intra-op threads of a run on the CPU (None: $WORKBENCH_THREADS, else automatic; see
    # workbench.runtime.threads)
    "threads": None,
    # bytes of MoE-Prism sub-expert layouts kept between runs on the host (None: the larger
    # of 256 MiB and half the host memory available, workbench.prism.execute.layout_budget;
    # 0: convert every run)
    "prism_layout_cache_bytes": None,
    # freeze the Python heap a run starts with for the garbage collector during the run, so
    # that its full collections walk what the run allocates (None: $WORKBENCH_GC_FREEZE,
    # else on; workbench.runtime.heap)
    "gc_freeze": None,
}

_VALIDATORS = {
    "workspace": lambda v: isinstance(v, (str, Path)),
    "flush_every": lambda v: isinstance(v, int) and v >= 1,
    "flush_interval_s": lambda v: isinstance(v, (int, float)) and v >= 0,
    "threads": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)
                                       and 1 <= v <= 4096),
    "prism_layout_cache_bytes": lambda v: v is None or (
        isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "gc_freeze": lambda v: v is None or isinstance(v, bool),
}

#: what each option takes, for the error that refuses another value
_ALLOWED = {
    "workspace": "a folder path (str or Path)",
    "flush_every": "a whole number ≥ 1",
    "flush_interval_s": "a number of seconds ≥ 0",
    "threads": "None or a whole number from 1 to 4096",
    "prism_layout_cache_bytes": "None or a whole number of bytes ≥ 0",
    "gc_freeze": "None ($WORKBENCH_GC_FREEZE, else on), True or False",
}



def get_options() -> dict[str, Any]:
    return dict(_OPTIONS)


class set_options:
    """Set options for the process, or for a ``with`` block only."""

    def __init__(self, **kwargs: Any) -> None:
        self._old: dict[str, Any] = {}
        for k, v in kwargs.items():
            if k not in _OPTIONS:
                raise ValueError(f"option {k!r} is unknown; options: {', '.join(_OPTIONS)}")
            if not _VALIDATORS[k](v):
                raise ValueError(f"option {k}={v!r} is not valid; it takes {_ALLOWED[k]}")
        for k, v in kwargs.items():
            self._old[k] = _OPTIONS[k]
            _OPTIONS[k] = Path(v) if k == "workspace" else v

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        _OPTIONS.update(self._old)
