"""Busy-looping processes beside a benchmark (``--load N``): the state of a laptop that runs a
model and something else, where interactivity goals must still hold (issue 37).

Each process spins one core in pure Python; with N = the number of cores, every core is busy
and the measured process competes for CPU time with them. Killed when the block ends."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator


@contextlib.contextmanager
def busy(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` busy-looping processes for the duration of the block (0: none)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
