"""Progress of long commands on stderr: one tqdm bar per phase, with counts, rate and ETA.

A long library call (``prism.refactor``, ``macs.calibrate``, ``predictor.calibrate``) takes a
``progress`` callback ``progress(phase, done, total)``: ``phase`` names what is counted
("profiling requests", "annealing experts", …), ``done`` of ``total`` are finished. It is
called with non-decreasing ``done`` within a phase and says nothing about time; the caller
decides how to show it. :class:`Bars` shows it as the command line does.

When (the convention of git, pip, cargo): a bar is drawn when ``--progress`` is given, never
with ``--no-progress``, and otherwise only when stderr is a terminal — so a log file or a pipe
gets no carriage-return noise unless asked. Bars go to stderr only; stdout (``--json``) stays
one clean document either way.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TextIO

#: ``progress(phase, done, total)``: ``done`` of ``total`` units of ``phase`` are finished
Callback = Callable[[str, int, int], None]


def wanted(flag: bool | None, stream: TextIO | None = None) -> bool:
    """``flag`` when given (``--progress`` True, ``--no-progress`` False), else whether
    ``stream`` (default: stderr) is a terminal."""
    if flag is not None:
        return bool(flag)
    s = sys.stderr if stream is None else stream
    try:
        return bool(s.isatty())
    except (AttributeError, ValueError, OSError):  # closed or replaced by an object without it
        return False


def _size(stream: TextIO) -> tuple[int, int] | None:
    """None: let tqdm follow the terminal's size; a fixed (columns, lines) for a terminal that
    reports 0 × 0 (a fresh pseudo-terminal, some containers), where tqdm would draw nothing
    (no width, and every bar "below" a screen of 0 lines)."""
    import os

    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):   # not a terminal: tqdm decides
        return None
    return None if size.columns > 0 and size.lines > 0 else (100, 24)


def bar(total: int, desc: str, *, enabled: bool = True, file: TextIO | None = None,
        **kw: Any):
    """One plain-text tqdm bar on ``file`` (default stderr) that also draws on a terminal
    reporting a size of 0 × 0; ``enabled=False``: a bar that draws nothing."""
    from tqdm import tqdm  # the plain text bar: a CLI is no notebook

    file = sys.stderr if file is None else file
    size = _size(file) if enabled else None
    return tqdm(total=total, desc=desc, file=file, disable=not enabled, leave=True,
                dynamic_ncols=size is None,
                **({} if size is None else {"ncols": size[0], "nrows": size[1]}), **kw)


class Bars:
    """A :data:`Callback` drawing one tqdm bar per phase on ``file`` (default stderr), each
    left on screen when its phase ends (a new phase, :meth:`close`, or ``done == total``).
    Disabled (``enabled=False``) it does nothing at all. A context manager: leaving it closes
    the open bar, also on an error."""

    def __init__(self, enabled: bool, file: TextIO | None = None, prefix: str = "") -> None:
        self.enabled, self.file, self.prefix = enabled, file, prefix
        self._phase: str | None = None
        self._bar: Any = None

    @property
    def callback(self) -> "Bars | None":
        """This object when enabled, else None: a library call given None skips even the
        bookkeeping progress costs (annealing in chunks, for one)."""
        return self if self.enabled else None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if phase != self._phase:
            self.close()
            self._phase = phase
            self._bar = bar(total, f"{self.prefix}{phase}", file=self.file)
        b = self._bar
        if b is None:   # this phase already ended (done == total was reported)
            return
        if b.total != total:
            b.total = total
        if done > b.n:
            b.update(done - b.n)
        if done >= total:
            self.close(keep_phase=True)

    def close(self, keep_phase: bool = False) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not keep_phase:
            self._phase = None

    def __enter__(self) -> "Bars":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
