"""Folders a tool writes whole: one writer at a time, replaced only when provably that tool's
output (or when the user asked to overwrite), swapped in atomically.

Invariants (the trainer's model and demo folders use them; run stores have their own, richer
:mod:`workbench.telemetry.destination`):

- **one writer**: a writer holds an exclusive ``flock`` on the sibling ``.<name>.lock`` from its
  checks to its swap (:func:`lock`), so a second writer of the same folder fails at once with
  :class:`FolderBusyError` naming the holder, instead of deleting the first one's files.
- **nothing foreign is lost**: a non-empty folder is replaced only when it is provably the tool's
  own, i.e. it holds :data:`MANIFEST` naming that tool and nothing the manifest does not list
  (:func:`foreign_entries`); anything else only when the user passed ``overwrite``.
- **atomic**: new content is staged in a sibling ``.<name>.partial-<pid>-<hex>`` and
  :func:`swap_in` exchanges it with the old folder in one ``renameat2(RENAME_EXCHANGE)`` (two
  renames where the file system has none; a crash between them leaves the old folder in a
  ``.<name>.old-*`` sibling, which the next writer puts back, :func:`recover`). A crash at any
  instant leaves the old folder or the new one whole, never a mix.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

from workbench import jsonio
from workbench.errors import WorkbenchError

MANIFEST = "workbench_written.json"
"""The file a tool writes last into a folder it owns: ``{"written_by": tool, "files": [...]}``."""
MAX_MANIFEST_BYTES = 1 << 20


class FolderError(WorkbenchError, ValueError):
    """An output folder that may not be written (foreign content, a file, overlapping another),
    or that could not be written (disk full, file too large); the message names it."""


class FolderBusyError(FolderError):
    """Another process holds the folder's lock (a folder has exactly one writer)."""


def _sibling(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def siblings(path: Path, kind: str) -> list[Path]:
    """The hidden siblings ``.<name>.<kind>-*`` of ``path`` (a writer's staging, old or partial
    copies; [] when its folder cannot be listed)."""
    prefix = f".{path.name}.{kind}-"
    try:
        return [p for p in path.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []


# --------------------------------------------------------------------------- the lock


def take_lock(lockfile: Path) -> tuple[int | None, str]:
    """Take an exclusive ``flock`` on ``lockfile`` (created if absent): ``(fd, "")``, or
    ``(None, who)`` when another process holds it (``who``: what the holder wrote in it, its pid
    and host). ``OSError`` when the file cannot be created. The one lock of every workbench
    writer (run stores, the trainer's folders)."""
    for _ in range(100):
        fd = os.open(lockfile, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return None, os.pread(fd, 200, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
        try:  # the file we locked may have been unlinked by a releasing writer: retry on a fresh one
            if os.fstat(fd).st_ino == os.stat(lockfile).st_ino:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                              f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}".encode(), 0)
                return fd, ""
        except FileNotFoundError:
            pass
        os.close(fd)
    return None, ""


def drop_lock(lockfile: Path, fd: int) -> None:
    """Release :func:`take_lock`'s lock. The file is removed while still held, so a writer
    waiting on the old file notices and retries on a fresh one."""
    try:
        os.unlink(lockfile)
    except OSError:
        pass
    os.close(fd)


def lock(path: Path, what: str) -> int:
    """Take the exclusive lock of folder ``path``, the sibling ``.<name>.lock`` (its parent is
    created); returns the fd for :func:`unlock`. :class:`FolderBusyError` when another process
    holds it, :class:`FolderError` when it cannot be created."""
    lockfile = path.with_name(f".{path.name}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, who = take_lock(lockfile)
    except OSError as e:
        raise FolderError(f"{what} {str(path)!r}: cannot create its lock {str(lockfile)!r} "
                          f"({e.strerror or e}); choose a writable location") from None
    if fd is None:
        raise FolderBusyError(f"{what} {str(path)!r} is being written by another process ({who or 'pid unknown'}); "
                              f"a folder has one writer: wait for that run to finish or choose another folder")
    return fd


def unlock(path: Path, fd: int) -> None:
    """Drop the lock taken by :func:`lock`."""
    drop_lock(path.with_name(f".{path.name}.lock"), fd)


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


# --------------------------------------------------------------------------- ownership


def foreign_entries(path: Path, writer: str) -> list[str] | None:
    """Entries of folder ``path`` that ``writer`` did not write: ``None`` when it holds no valid
    manifest of ``writer`` (nothing in it is provably that writer's), ``[]`` when it is provably
    the writer's own (every entry a regular file the manifest lists)."""
    marker = path / MANIFEST
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        doc = jsonio.loads(marker.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("written_by") != writer or not isinstance(doc.get("files"), list):
        return None
    listed = {f for f in doc["files"] if isinstance(f, str)}
    out = []
    for p in sorted(path.iterdir()):
        if p.name == MANIFEST:
            continue
        if p.name not in listed or p.is_symlink() or not p.is_file():
            out.append(p.name + ("/" if p.is_dir() and not p.is_symlink() else ""))
    return out


def check_place(path: Path, what: str) -> None:
    """:class:`FolderError` unless folder ``path`` could be created or is one: not a broken
    link, not a file, not below a file."""
    if path.is_symlink() and not path.exists():
        raise FolderError(f"{what} {str(path)!r} is a broken symbolic link; remove it or give a folder")
    if path.exists() and not path.is_dir():
        raise FolderError(f"{what} {str(path)!r} is a file, not a folder; give a new or empty folder")
    up = path.parent
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise FolderError(f"{what} {str(path)!r}: {str(up)!r} is a file, not a folder; give a path under a folder")


def check(path: Path, what: str, writer: str, overwrite: bool) -> None:
    """:class:`FolderError` unless ``path`` may be (re)written whole by ``writer``: absent, an
    empty folder, provably the writer's (:func:`foreign_entries`), or any folder with
    ``overwrite``. Never a file, and never a folder holding anything the writer did not write
    without ``overwrite``."""
    check_place(path, what)
    if not path.exists():
        return
    try:
        empty = not any(path.iterdir())
    except OSError as e:
        raise FolderError(f"{what} {str(path)!r} cannot be read ({e.strerror or e})") from None
    if empty or overwrite:
        return
    foreign = foreign_entries(path, writer)
    if foreign == []:
        return
    if foreign is None:
        held = f"it has no {MANIFEST} of {writer}"
    else:
        held = "it holds " + ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise FolderError(f"{what} {str(path)!r} is a non-empty folder this command did not write ({held}); it would "
                      f"be replaced whole: pass --overwrite to replace it, or give a new or empty folder")


def write_manifest(folder: Path, writer: str) -> None:
    """Record the regular files of ``folder`` as ``writer``'s (written last: a folder is never
    claimed before its content is whole)."""
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink() and p.name != MANIFEST)
    (folder / MANIFEST).write_text(json.dumps({"written_by": writer, "files": files}, indent=1) + "\n")


# --------------------------------------------------------------------------- staging and the swap


def recover(path: Path) -> None:
    """Undo what a killed writer of ``path`` left (call under the lock: that writer is dead): an
    old folder moved aside by an unfinished two-rename swap comes back; staging folders go."""
    olds = sorted(siblings(path, "old"), key=lambda p: p.stat().st_mtime)
    if olds and not path.exists():
        os.rename(olds.pop(), path)
    for p in [*olds, *siblings(path, "partial")]:
        shutil.rmtree(p, ignore_errors=True)


def stage(path: Path) -> Path:
    """A fresh, empty staging sibling of ``path`` to write the new content into."""
    staging = _sibling(path, "partial")
    staging.mkdir()
    return staging


def swap_in(staging: Path, path: Path) -> None:
    """Put the finished ``staging`` folder at ``path``; the old folder (if any) is deleted only
    once the new one is in place."""
    if not path.exists():
        os.rename(staging, path)
        return
    if exchange(staging, path):
        shutil.rmtree(staging, ignore_errors=True)  # now the old content
        return
    old = _sibling(path, "old")
    os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def io_reason(e: BaseException) -> str:
    """A failed write's reason in one line (safetensors wraps the OS error in its own message)."""
    if isinstance(e, OSError):
        return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def overlapping(paths: dict[str, Path]) -> str | None:
    """The first two of ``paths`` (flag -> resolved folder) that are the same folder or one
    inside the other, as a message; ``None`` when all are apart."""
    items = list(paths.items())
    for i, (a, pa) in enumerate(items):
        for b, pb in items[i + 1:]:
            if pa == pb:
                return f"{a} and {b} are the same folder {str(pa)!r}"
            if pa in pb.parents or pb in pa.parents:
                inner, outer = ((a, pa), (b, pb)) if pb in pa.parents else ((b, pb), (a, pa))
                return f"{inner[0]} {str(inner[1])!r} is inside {outer[0]} {str(outer[1])!r}"
    return None
