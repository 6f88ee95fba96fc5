"""Intra-op CPU threads of a run.

Runs on the CPU are many small operations (a decode step of the embedded model is a few
hundred matrix products of a few rows each): a second OpenMP thread's wake-up and barrier cost
more than its share of the work saves. Measured on the 2-core dev machines
(``benchmarks/bench_threads.py``, BENCHMARKS.md "CPU threads"): with two threads and passive
OpenMP waits a batch of 8 ran ≈ 2.4× slower than with one thread, and with two threads and
spinning waits it ran as fast idle but up to ≈ 3× slower whenever another process held a core;
one thread was within a few per cent of the fastest in both cases.

So a run on the CPU uses **one** intra-op thread unless told otherwise: the ``threads`` option
(``workbench.set_options(threads=4)``, else ``$WORKBENCH_THREADS``), or ``$OMP_NUM_THREADS`` set
by the user (then torch's own setting is left alone). Runs on an accelerator leave torch's
setting alone too (the host's work there — hybrid mode's experts — is larger). The setting is
applied around the run and the previous one restored after it: a notebook's own torch code
keeps its threads.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

from workbench.errors import InputError
from workbench.options import get_options


#: environment variable giving the threads when the option is not set
THREADS_ENV = "WORKBENCH_THREADS"


def _env_threads() -> int | None:
    """``$WORKBENCH_THREADS``: a whole number from 1 to 4096 (unset or empty: automatic);
    :class:`InputError` naming it for another value."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        v = int(raw)
    except ValueError:
        v = 0
    if not 1 <= v <= 4096:
        raise InputError(f"{THREADS_ENV}={raw!r} is not a whole number from 1 to 4096 (unset "
                         f"it for the automatic choice)")
    return v


def run_threads(device: torch.device | str) -> int | None:
    """Intra-op threads a run on ``device`` uses (None: torch's setting, untouched)."""
    opt = get_options()["threads"]
    if opt is None:
        opt = _env_threads()
    if opt is not None:
        return int(opt)
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return None  # the user's choice, made before torch started
    return 1 if torch.device(device).type == "cpu" else None


@contextmanager
def threads_for_run(device: torch.device | str) -> Iterator[None]:
    """:func:`run_threads` for the block, torch's previous setting restored after it."""
    n = run_threads(device)
    old = torch.get_num_threads()
    if n is None or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
