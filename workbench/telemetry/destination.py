"""Where a run store is written: one writer per path, checked before any model loads, replaced
atomically.

A run store path goes through three states, and a crash (SIGKILL, power loss of the process,
a full disk) at any instant leaves it in one of them:

1. **absent** (or an empty folder, which holds nothing to lose);
2. **published**: a complete store layout whose root ``zarr.json`` says ``running``, ``complete``
   or ``failed``; readers cut every growing array to the ``committed`` extent;
3. for ``overwrite``: the **old store, untouched**, until the new run has finished; then the two
   are exchanged in one ``renameat2(RENAME_EXCHANGE)`` (or two renames where the file system has
   no exchange; a crash between them leaves the old store in a hidden ``.<name>.old-*`` sibling,
   which the next writer of the path puts back).

The writer holds an exclusive ``flock`` on ``<parent>/.<name>.lock`` from its checks until the store
is final, so a second writer of the same path fails at once with :class:`StoreBusyError` instead
of interleaving its steps with the first one's. New stores are laid out in a hidden staging sibling
``.<name>.staging-*`` and renamed into place, so a folder at the path is never half laid out.
Leftovers of a killed writer (staging folders, an ``.old-*`` sibling, temp files) are cleaned by
the next writer of the same path, under the lock.

``--overwrite`` deletes only what is provably a workbench run store: a folder whose entries are
exactly the store's own (see :func:`foreign_entries`) and whose root document, if any, carries the
workbench markers. Anything else is refused, naming what is in the way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from workbench import jsonio
from workbench.errors import (InputError, StoreBusyError, StoreError, StoreExistsError,
                              WorkbenchError)
from workbench.fileio import read_bytes_bounded, shorten
from workbench.ownedfolder import drop_lock, siblings, take_lock
from workbench.ownedfolder import exchange as _exchange

#: test hook: called as ``FAULT_HOOK(op, path)`` before every file-system step of a store's
#: writer (see :func:`io_step`). Raising from it injects an I/O error at that step; copying the
#: folder inside it captures exactly what a crash at that instant would leave on disk.
FAULT_HOOK: Callable[[str, Path], None] | None = None


def io_step(op: str, path: Path) -> None:
    """Mark one file-system step of the writer (a no-op unless a test set :data:`FAULT_HOOK`)."""
    if FAULT_HOOK is not None:
        FAULT_HOOK(op, path)


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def _is_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and not path.is_symlink() and not any(path.iterdir())
    except OSError:
        return False


#: largest root zarr.json read to tell a store from other folders (as the store reader's)
MAX_ROOT_DOC_BYTES = 64 * 1024 * 1024


def foreign_entries(path: Path, known: Iterable[str]) -> list[str]:
    """Entries of ``path`` that a workbench run store never holds (empty: provably a store).

    A store holds its array folders (names in ``known``), its root ``zarr.json``, the writer's
    hidden temp and reserve files, and inside each array folder only ``zarr.json``, chunk files
    ``c.*`` (or a ``c`` folder of nested chunk keys, schema 1) and temp files. The root document,
    when present, must be a zarr group carrying ``schema_version`` and ``workbench_version``.
    """
    known = set(known)
    out: list[str] = []
    try:
        entries = list(path.iterdir())
    except OSError as e:
        return [f"(unreadable: {e.strerror})"]
    for p in entries:
        name = p.name
        if name.startswith(".") and (name.endswith(".tmp") or name == ".reserve"):
            continue
        if name == "zarr.json" and p.is_file() and not p.is_symlink():
            try:
                doc = jsonio.loads(read_bytes_bounded(p, MAX_ROOT_DOC_BYTES, "zarr.json",
                                                      StoreError, follow_symlinks=False))
                attrs = doc.get("attributes", {}) if isinstance(doc, dict) else None
                ok = (isinstance(attrs, dict) and doc.get("node_type") == "group"
                      and "schema_version" in attrs and "workbench_version" in attrs)
            except (OSError, ValueError, RecursionError, StoreError):
                ok = False
            if not ok:
                out.append("zarr.json (not a workbench run store's)")
            continue
        if name not in known or not p.is_dir() or p.is_symlink():
            out.append(name)
            continue
        try:
            inner = list(p.iterdir())
        except OSError:
            out.append(f"{name}/ (unreadable)")
            continue
        for q in inner:
            n = q.name
            if q.is_symlink():
                out.append(f"{name}/{n}")
            elif n == "zarr.json" or (n.startswith(".") and n.endswith(".tmp")):
                continue
            elif n.startswith("c.") and q.is_file():
                continue
            elif n == "c" and q.is_dir():
                continue
            else:
                out.append(f"{name}/{n}")
    return sorted(out)


def new_run_name(workspace: Path) -> str:
    """A fresh run store name in ``workspace``: ``run-<date>-<time>-<pid>-<n>.zarr`` — the
    writer's pid keeps two processes starting in the same second apart (each then checks only
    its own names), the time keeps names in start order."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        name = f"run-{stamp}-{os.getpid()}-{i:03d}.zarr"
        if not os.path.lexists(workspace / name):
            return name
    raise StoreError(f"workspace {str(workspace)!r} has no free run name for {stamp}")


def workspace_dir(ws: Any) -> Path:
    """The workspace folder (created if missing), or :class:`StoreError` saying why it cannot
    hold runs."""
    ws = store_path_arg(ws, "workspace")
    try:
        ws.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"workspace {str(ws)!r} (the `workspace` option, or "
                         f"$WORKBENCH_WORKSPACE for the dashboard) cannot hold runs: "
                         f"{e.strerror or e}; it must be a folder, or a path where one can be "
                         f"created") from None
    if not ws.is_dir():
        raise StoreError(f"workspace {str(ws)!r} is not a folder")
    return ws


def store_path_arg(path: Any, what: str, example: str = "runs/demo.zarr") -> Path:
    """``path`` as a :class:`Path`, or :class:`StoreError`: not a str/PathLike, empty, or with a
    NUL byte (which no file system accepts)."""
    if not isinstance(path, (str, os.PathLike)):
        raise StoreError(f"{what} path must be a str or os.PathLike, not "
                         f"{type(path).__name__} ({str(path)[:60]!r})")
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.strip() == "":
        raise StoreError(f"{what} path is empty ({text!r}); give a folder name such as "
                         f"{example}")
    if "\0" in text:
        raise StoreError(f"{what} path {text[:80]!r} contains a NUL byte")
    return Path(text)


def check_destination(path: str | Path, overwrite: bool, known: Iterable[str]) -> Path:
    """Check, before anything is loaded or written, that a run store can be written at
    ``path``; returns the path to write (a symlink resolved to its target).

    Raises :class:`StoreExistsError` (exists, no ``overwrite``), :class:`StoreError` (empty
    path, a parent that is a file, not writable, not a workbench store to overwrite) with a
    message naming the path. Creates nothing but a probe file it removes at once.
    """
    path = store_path_arg(path, "store")
    p = follow_link(Path(path).expanduser(), "store", StoreError)
    p = Path(os.path.abspath(p))
    for up in p.parents:  # a store nested in a store would block --overwrite of the outer one
        if (up / "zarr.json").is_file():
            raise StoreError(f"store {str(p)!r} would be inside the store {str(up)!r}; a run "
                             f"store cannot hold another — choose a path outside it")
    if p.exists():
        if not p.is_dir():
            raise StoreError(f"store {str(p)!r} exists and is not a folder; refusing to replace "
                             f"a file — choose another path")
        if not _is_empty_dir(p):
            if not overwrite:
                raise StoreExistsError(
                    f"store {str(p)!r} already exists; pass --overwrite (overwrite=True) to "
                    f"replace it, or choose another path")
            foreign = foreign_entries(p, known)
            if foreign:
                shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more"
                                                  if len(foreign) > 5 else "")
                raise StoreError(
                    f"{str(p)!r} is not a workbench run store (it holds {shown}); --overwrite "
                    f"only replaces run stores — refusing to delete it")
    check_creatable(p, "store")
    return p


def check_creatable(p: Path, what: str, error: type[WorkbenchError] = StoreError) -> None:
    """The nearest existing folder above ``p`` is a folder this process can create files in
    (tried with a probe file, since permission bits say nothing to root, to an immutable folder
    or a read-only mount); otherwise ``error`` (:class:`StoreError`) naming ``p``."""
    anc = p.parent
    while not anc.exists():
        if anc.is_symlink():  # a dangling link in the way
            raise error(f"{what} {str(p)!r}: {str(anc)!r} is a broken symlink")
        anc = anc.parent
    if not anc.is_dir():
        raise error(f"{what} {str(p)!r}: {str(anc)!r} is a file, not a folder; choose a "
                    f"path under a folder")
    probe = anc / f".workbench-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise error(f"{what} {str(p)!r}: cannot create files in {str(anc)!r} "
                    f"({e.strerror or e}); choose a writable location") from None


def lock_writer(path: Path, what: str) -> int:
    """Take the one-writer lock of ``path`` (``<parent>/.<name>.lock``, ownedfolder's flock; its
    folder must exist) and return its fd; :class:`StoreBusyError` naming ``what`` at once when
    another writer holds it (one writer per path: run stores, output folders)."""
    fd, who = take_lock(_lock_path(path))
    if fd is None:
        raise StoreBusyError(
            f"{what} {str(path)!r} is being written by another process "
            f"({who or 'pid unknown'}); a {what} has exactly one writer — wait for that "
            f"one to finish or choose another path")
    return fd


def unlock_writer(path: Path, fd: int) -> None:
    """Release :func:`lock_writer`'s lock."""
    drop_lock(_lock_path(path), fd)


#: locks this process holds through :func:`writer_lock`: (path, thread) → [fd, depth]
_HELD: dict[tuple[str, int], list[int]] = {}


@contextlib.contextmanager
def writer_lock(path: str | Path, what: str) -> Iterator[Path]:
    """Hold the one-writer lock of output folder ``path`` (:func:`take_lock`; its parent is
    created) for the block. Re-entrant in the same thread, so that a command can hold it from
    its checks to its last write while the shared writer (``tensorfiles.save_folder``) takes it
    again; another thread or process gets :class:`StoreBusyError` at once."""
    p = Path(os.path.abspath(path))
    key = (str(p), threading.get_ident())
    held = _HELD.get(key)
    if held is not None:
        held[1] += 1
    else:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = lock_writer(p, what)
        except OSError as e:
            raise StoreError(f"{what} {str(p)!r} cannot be created: "
                             f"{e.strerror or e}") from None
        held = _HELD[key] = [fd, 1]
    try:
        yield p
    finally:
        held[1] -= 1
        if held[1] == 0:
            del _HELD[key]
            unlock_writer(p, held[0])


def follow_link(p: Path, what: str, error: type[WorkbenchError] = InputError) -> Path:
    """``p``, or the target of the symlink ``p`` (outputs are written through a link, as run
    stores are); ``error`` (:class:`InputError`) naming ``what`` for a link that leads nowhere
    (dangling, or a loop), which would otherwise fail only at the first write, after the
    work."""
    if not p.is_symlink():
        return p
    target = Path(os.path.realpath(p))
    try:
        os.stat(p)
    except OSError as e:
        why = ("is a symlink loop" if e.errno == errno.ELOOP else
               f"is a symlink to {str(target)!r}, which does not exist")
        raise error(f"{what} {str(p)!r} {why}; remove the link or point it at a folder"
                    ) from None
    return target


def check_output_folder(path: Any, what: str, *, config: str | None = None,
                        overwrite: bool = True, holds: str = "",
                        files: Iterable[str] = ()) -> Path:
    """Check, before any work, that output folder ``path`` can be written; returns the folder to
    write (a symlink followed to its target). Refused with a :class:`WorkbenchError` naming
    ``what`` and the path: not a str/PathLike, blank or with a NUL byte; a symlink that leads
    nowhere (dangling, or a loop); a file in the way; ``config`` already there (it holds
    ``holds``) without ``overwrite``; no folder above it where this process can create files.
    With ``files`` (the names that kind of output holds), an existing folder holding anything
    else (the user's files, a model folder, a run store) is refused whatever ``overwrite``:
    the output would be written in among them. The one output-path check of every command
    that writes a folder (refactor, calibrate-macs, calibrate, export)."""
    p = follow_link(store_path_arg(path, what, "out/folder").expanduser(), what)
    try:
        if p.exists() and not p.is_dir():
            raise InputError(f"{what} {str(p)!r} is a file, not a folder; choose another path")
        there = config is not None and (p / config).exists()
    except OSError as e:  # e.g. a loop further up, or a parent that is not searchable
        raise InputError(f"{what} {str(p)!r} cannot be used: {e.strerror or e}") from None
    if there and not overwrite:
        raise InputError(f"{str(p)!r} already holds a {holds or what}; pass --overwrite "
                         f"(overwrite=True) to replace it")
    own = {n for f in files for n in (f, f + ".tmp")}
    if own and p.is_dir():
        try:
            foreign = sorted(e.name + ("/" if e.is_dir() and not e.is_symlink() else "")
                             for e in p.iterdir()
                             if e.name not in own or e.is_symlink() or not e.is_file())
        except OSError as e:
            raise InputError(f"{what} {str(p)!r} cannot be read ({e.strerror or e})") from None
        if foreign:
            shown = ", ".join(shorten(n, 60) for n in foreign[:5]) + (
                f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            kind = holds or what
            raise InputError(f"{what} {str(p)!r} is not a {kind} folder (it holds {shown}); "
                             f"the {kind} is written only into a new or empty folder or one "
                             f"that holds a {kind} (even with --overwrite): choose another "
                             f"path")
    check_creatable(p, what, InputError)
    return p


class Destination:
    """The claim of one writer on one store path (see the module doc).

    ``write_dir`` is where the writer puts files: the staging folder until :meth:`publish`
    (fresh stores) or until :meth:`commit` (overwrite), the store path afterwards. Call
    :meth:`commit` when the run finished (overwrite: the exchange), :meth:`abandon` when it failed
    (overwrite: the staged run is dropped and the old store kept), then :meth:`release`.
    """

    def __init__(self, path: str | Path, overwrite: bool, known: Iterable[str]) -> None:
        self.known = tuple(known)
        self.path = check_destination(path, overwrite, self.known)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = self._lock()
        except OSError as e:
            raise writable_error(e, self.path, "cannot be created") from e
        try:
            self._recover()
            # checked again under the lock: another writer may have finished in between
            self.path = check_destination(self.path, overwrite, self.known)
            self.replace = self.path.exists() and not _is_empty_dir(self.path)
            self.stage = self.path.with_name(
                f".{self.path.name}.staging-{os.getpid()}-{secrets.token_hex(4)}")
            io_step("mkdir", self.stage)
            self.stage.mkdir()
        except BaseException as e:
            self.release()
            if isinstance(e, OSError) and not isinstance(e, WorkbenchError):
                raise writable_error(e, self.path, "cannot be created") from e
            raise
        self.write_dir = self.stage
        self.published = False

    # -- the lock ------------------------------------------------------------------------------
    def _lock(self) -> int:
        return lock_writer(self.path, "store")

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            unlock_writer(self.path, fd)

    # -- crash leftovers -----------------------------------------------------------------------
    def _recover(self) -> None:
        """Undo what a killed writer of this path left (we hold the lock, so it is dead)."""
        olds = sorted(siblings(self.path, "old"), key=lambda p: p.stat().st_mtime)
        if olds and (not self.path.exists() or _is_empty_dir(self.path)):
            # killed between the two renames of a non-atomic replace: the old store comes back
            if _is_empty_dir(self.path):
                self.path.rmdir()
            os.rename(olds.pop(), self.path)
        for p in [*olds, *siblings(self.path, "staging")]:
            shutil.rmtree(p, ignore_errors=True)
        if self.path.is_dir() and not self.path.is_symlink():
            _remove_temp_files(self.path)

    # -- the writer's milestones ---------------------------------------------------------------
    def publish(self) -> None:
        """A fresh store's layout is complete in the staging folder: rename it into place (from
        now on readers see it). For an overwrite nothing happens until :meth:`commit`."""
        if self.replace or self.published:
            return
        io_step("publish", self.path)
        os.rename(self.stage, self.path)  # onto nothing, or onto an empty folder
        self.write_dir = self.path
        self.published = True

    def commit(self) -> None:
        """The run is final: an overwrite exchanges the staged store with the old one."""
        if not self.replace:
            self.publish()
            return
        io_step("exchange", self.path)
        if _exchange(self.stage, self.path):
            old = self.stage
        else:
            old = self.path.with_name(
                f".{self.path.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(self.path, old)
            io_step("exchange-2", self.path)
            os.rename(self.stage, self.path)
        self.write_dir = self.path
        self.published = True
        try:  # the new store is in place: failing to delete the old copy fails nothing (the
            # next writer of this path removes a leftover)
            io_step("drop-old", old)
        except OSError:
            pass
        shutil.rmtree(old, ignore_errors=True)

    def abandon(self) -> None:
        """The run failed. Overwrite: the staged store is dropped, the old one stays. A fresh
        store that was already published stays (marked failed by the writer); one that was not
        is dropped."""
        if not self.published:
            shutil.rmtree(self.stage, ignore_errors=True)
        elif self.write_dir.is_dir():
            _remove_temp_files(self.write_dir)
            (self.write_dir / ".reserve").unlink(missing_ok=True)


def _remove_temp_files(root: Path) -> None:
    for p in [root, *(q for q in root.iterdir() if q.is_dir() and not q.is_symlink())]:
        try:
            for f in p.iterdir():
                if f.name.startswith(".") and f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)
        except OSError:
            pass


def writable_error(e: OSError, path: Path, what: str) -> StoreError:
    """A :class:`StoreError` for an I/O failure while writing store ``path``."""
    reason = e.strerror or str(e)
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return StoreError(f"run store {str(path)!r}: {what}: {reason}{where}")
