"""User-facing errors.

Every error a user can cause by bad input derives from :class:`WorkbenchError`; the CLI turns
these into a one-line message and exit status 2. Messages name the thing at fault, the bad value
and what is allowed.
"""

from __future__ import annotations


def one_line(e: object, limit: int = 300) -> str:
    """An exception's (or any value's) message on one line, cut to ``limit`` characters: what
    an error message quotes of a cause it did not write."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


class WorkbenchError(Exception):
    """Base class of errors caused by the user's input (CLI exit status 2)."""


class KnobError(WorkbenchError, ValueError):
    """A knob name or value is not allowed."""


class ModelLoadError(WorkbenchError):
    """A model directory is missing, incomplete or unreadable."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model has no MoE blocks the adapter can find."""


class InputError(WorkbenchError, ValueError):
    """A request input (image, prompt, trace …) is not usable."""


class StoreExistsError(WorkbenchError, FileExistsError):
    """A run store already exists and overwriting was not asked for."""


class StoreError(WorkbenchError):
    """A run store is unreadable, tampered with, or not a workbench store; or it cannot be
    written (busy with another writer, not writable, disk full). The message names the store."""


class StoreBusyError(StoreError):
    """Another process is writing the store (a store has exactly one writer)."""


class PlanError(WorkbenchError):
    """A memory plan does not fit the device budget."""
