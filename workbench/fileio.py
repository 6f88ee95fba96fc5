"""One bounded way to read a file, and one way to echo a file's value in a message.

Every file the workbench reads that a user can hand it or replace (model folders, calibrations,
refactorings, routers, predictors, cost tables, operating points, store metadata, traces, sweep
outcomes, demo requests, request files) goes through
:func:`read_bytes_bounded` / :func:`read_json`, or through :func:`check_regular_file` before a
library (transformers, safetensors) opens it. Invariants, whatever the path names:

- only a **regular file** is opened: a FIFO blocks ``open`` forever, ``/dev/zero`` never ends,
  a directory is no file. It is checked with ``stat`` before opening, and the file is opened
  non-blocking and checked again with ``fstat`` (a FIFO swapped in between cannot block);
- at most ``limit`` bytes are read: the size is checked before reading (a sparse 1.5 GB file is
  refused without reading it) and the read stops at ``limit + 1`` (a file that grows after the
  ``stat`` is refused too);
- JSON (:func:`read_json`) is depth-limited (:mod:`workbench.jsonio`: never
  ``RecursionError``) and refuses the non-standard ``NaN``/``Infinity`` constants;
- every failure is one line of the caller's exception type (``error``, a
  :class:`~workbench.errors.WorkbenchError`) that starts with the caller's ``what`` (which names
  the file) and says precisely what is wrong: does not exist, is a directory, is not a regular
  file, is empty, is too large, cannot be read, is not valid JSON/UTF-8.

:func:`shorten` is the one helper that cuts a value read from a file before a message echoes
it: a 5 MB ``model_id`` made a 5 MB error line.
"""

from __future__ import annotations

import os
import reprlib
import stat
from pathlib import Path
from typing import Any

from workbench import jsonio
from workbench.errors import InputError

__all__ = ["MAX_ECHO", "check_regular_file", "open_regular", "parse_json",
           "read_bytes_bounded", "read_json", "read_text", "shorten"]

#: most characters of a value a message echoes (:func:`shorten`)
MAX_ECHO = 120

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = MAX_ECHO
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8
_repr.maxlevel = 3


def shorten(value: Any, limit: int = MAX_ECHO) -> str:
    """``repr(value)`` on one line and at most ``limit`` characters (cut with "…"), computed
    without building the whole repr of a huge or deeply nested value."""
    if isinstance(value, int) and value.bit_length() > 14_000:
        # repr of an int over 4300 digits raises ValueError
        return f"a {int(value.bit_length() * 0.30103) + 1}-digit number"
    if isinstance(value, (str, bytes, int)):  # its head, not reprlib's head...tail
        text = repr(value[:limit + 1] if isinstance(value, (str, bytes)) else value)
    else:
        try:
            text = _repr.repr(value)
        except ValueError:  # an int of over 4300 digits inside
            text = f"<a {type(value).__name__} too large to show>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def file_identity(path: str | Path) -> tuple[int, int, int]:
    """``(mtime ns, size, inode)`` of the file at ``path`` (links followed): it changes when
    the file is rewritten or atomically replaced, so a reader can keep what it parsed until
    then. :class:`OSError` when there is none."""
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def check_regular_file(path: str | Path, what: str, error: type[Exception] = InputError,
                       limit: int | None = None, *, empty_ok: bool = False,
                       follow_symlinks: bool = True) -> int:
    """The size of ``path`` if it is a regular file of at most ``limit`` bytes (and not empty
    unless ``empty_ok``; a symlink to one only with ``follow_symlinks``); otherwise ``error``
    saying which of those it is not. Opens nothing: for files a library then opens itself.
    ``error`` is an exception type, or any callable that makes one from the message."""
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        raise error(f"{what} does not exist") from None
    except (OSError, ValueError) as e:
        reason = _reason(e) if isinstance(e, OSError) else shorten(str(e))
        raise error(f"{what} cannot be read: {reason}") from None
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{what} is a symlink; only plain files are read here")
    _check_stat(st, what, error, limit, empty_ok)
    return st.st_size


def _check_stat(st: os.stat_result, what: str, error: type[Exception], limit: int | None,
                empty_ok: bool) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{what} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO blocks the open, /dev/zero never ends
        raise error(f"{what} is not a regular file (a FIFO, device or socket)")
    if st.st_size == 0 and not empty_ok:
        raise error(f"{what} is empty (0 bytes)")
    if limit is not None and st.st_size > limit:
        raise error(f"{what} is too large: {st.st_size:,} bytes; at most {limit:,} are read")


def open_regular(path: str | Path, what: str, error: type[Exception] = InputError,
                 limit: int | None = None, *, empty_ok: bool = False,
                 follow_symlinks: bool = True):
    """``path`` opened for binary reading after :func:`check_regular_file`; opened
    non-blocking and re-checked on the open descriptor, so that a FIFO or device put there
    after the check can neither block nor be read."""
    check_regular_file(path, what, error, limit, empty_ok=empty_ok,
                       follow_symlinks=follow_symlinks)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{what} does not exist") from None
    except OSError as e:
        raise error(f"{what} cannot be read: {_reason(e)}") from None
    try:
        _check_stat(os.fstat(fd), what, error, limit, empty_ok)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes_bounded(path: str | Path, limit: int, what: str,
                       error: type[Exception] = InputError, *, empty_ok: bool = False,
                       follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (module docstring);
    ``error`` naming ``what`` and the fault otherwise."""
    with open_regular(path, what, error, limit, empty_ok=empty_ok,
                      follow_symlinks=follow_symlinks) as fh:
        try:
            raw = fh.read(limit + 1)  # bounded even if it grows after the stat
        except OSError as e:
            raise error(f"{what} cannot be read: {_reason(e)}") from None
    if len(raw) > limit:
        raise error(f"{what} is too large: it grew past {limit:,} bytes while read")
    if not raw and not empty_ok:
        raise error(f"{what} is empty (0 bytes)")
    return raw


def read_text(path: str | Path, limit: int, what: str, error: type[Exception] = InputError,
              *, empty_ok: bool = False) -> str:
    """:func:`read_bytes_bounded` decoded as UTF-8 (a leading BOM dropped)."""
    raw = read_bytes_bounded(path, limit, what, error, empty_ok=empty_ok)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not UTF-8 text (byte {e.start:,} is not)") from None


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not standard JSON")


def _json_kind(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def parse_json(raw: bytes | str, what: str, error: type[Exception] = InputError, *,
               obj: bool = True) -> Any:
    """``raw`` parsed as JSON nested at most :data:`workbench.jsonio.MAX_DEPTH` deep, without
    ``NaN``/``Infinity``; with ``obj`` (default) it must be a JSON object. ``error`` naming
    ``what`` and the fault otherwise."""
    try:
        doc = jsonio.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        text = " ".join(str(e).split())
        raise error(f"{what} is not valid JSON ({text[:MAX_ECHO]})") from None
    if obj and not isinstance(doc, dict):
        raise error(f"{what} must be a JSON object, not a JSON {_json_kind(doc)}")
    return doc


def read_json(path: str | Path, limit: int, what: str, error: type[Exception] = InputError,
              *, obj: bool = True) -> Any:
    """The JSON document in ``path``: :func:`read_bytes_bounded` then :func:`parse_json`."""
    return parse_json(read_bytes_bounded(path, limit, what, error), what, error, obj=obj)
