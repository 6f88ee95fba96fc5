"""The write side of a run store: zarr v3 documents and chunks written straight to files.

A run store has exactly one writer, which knows the whole layout up front and always appends. zarr's
general write path pays ~0.6 ms of event-loop and bookkeeping per array per write, which for the
~35 arrays of a run store made recording cost a fixed ~45 ms per run. This module keeps zarr for
what it is good at (producing the metadata documents, once per layout, and every read) and does the
writer's part with plain file I/O:

- :func:`layout_template` builds a store in memory with zarr (metadata documents + the constant
  coordinate chunks) and caches its bytes per layout; :func:`materialize` writes them to disk.
- :class:`AppendArray` writes whole chunks with the array's own codecs (``bytes`` + ``zstd``) and
  keeps the last, partly filled chunk in memory, so an append never reads a chunk back.
- Every file goes through :func:`atomic_write` (temp file + ``os.replace``), as zarr's own
  ``LocalStore`` does, so a concurrent reader sees a chunk or document either whole or not at all.
- Every chunk inside the written extent has a file (schema ≥ 3), so a missing one is corruption.
- Each file-system step calls :func:`workbench.telemetry.destination.io_step`, where tests
  inject faults and capture what a crash at that instant leaves.

Invariant: the documents written are exactly those zarr produced for the layout, changed only in
``shape`` (growth and trim) and the group's ``attributes``; ``zarr``/``xarray`` read them as usual.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import numcodecs
import numpy as np
import zarr
from zarr.storage import MemoryStore

from workbench.telemetry import destination
from workbench.telemetry.destination import io_step

_TEMPLATES: dict[Any, dict[str, bytes]] = {}


def atomic_write(path: Path, data: bytes, *, unseen: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers never see a partial file.

    ``unseen=True``: no reader can look at ``path`` yet (a chunk past every committed row), so
    it is written in place, without the temp file and rename. A failed write (a full disk)
    removes its temp file before the error propagates.
    """
    target = path if unseen else path.with_name(f".{path.name}.{os.getpid()}.tmp")
    io_step("open", target)
    try:
        f = open(target, "wb")
    except FileNotFoundError:  # first file in this folder (cheaper than mkdir every time)
        io_step("mkdir", path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(target, "wb")
    try:
        with f:
            if destination.FAULT_HOOK is not None:  # a crash half way through the bytes
                half = len(data) // 2
                f.write(data[:half])
                f.flush()
                io_step("write", target)
                f.write(data[half:])
            else:
                f.write(data)
        if not unseen:
            io_step("replace", path)
            os.replace(target, path)
    except BaseException:
        if not unseen:
            try:
                os.unlink(target)
            except OSError:
                pass
        raise


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"store attribute value {o!r} of type {type(o).__name__} is not JSON-serialisable")


def _finite(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def dump_json(doc: dict) -> bytes:
    """Standard JSON (RFC 8259), which every reader parses: a non-finite float (which Python
    would write as the non-standard ``NaN``/``Infinity``) is stored as ``null``."""
    # compact: the C encoder (an indent forces the pure-Python one, ~10x slower)
    try:
        text = json.dumps(doc, separators=(",", ":"), default=_json_default, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(json.loads(json.dumps(doc, default=_json_default))),
                          separators=(",", ":"), allow_nan=False)
    return text.encode()


def layout_template(key: Any, build: Callable[[zarr.Group], None]) -> dict[str, bytes]:
    """Bytes of every file of an in-memory zarr v3 store built by ``build(group)``, cached by
    ``key`` (which must identify everything ``build`` depends on)."""
    if key not in _TEMPLATES:
        store = MemoryStore()
        group = zarr.open_group(store, mode="w-", zarr_format=3)
        build(group)

        async def items() -> dict[str, bytes]:
            return {k: (await store.get(k, prototype=zarr.core.buffer.default_buffer_prototype())
                        ).to_bytes() async for k in store.list()}

        _TEMPLATES[key] = zarr.core.sync.sync(items())
    return _TEMPLATES[key]


def create_arrays(group: zarr.Group, specs: dict[str, dict]) -> None:
    """Create many arrays in ``group`` at once (their metadata writes overlap on zarr's loop)."""

    async def go() -> None:
        await asyncio.gather(*(group._async_group.create_array(name, **kw)
                               for name, kw in specs.items()))

    zarr.core.sync.sync(go())


def materialize(root: Path, files: dict[str, bytes], skip: set[str] = frozenset()) -> None:
    """Write a template's files under ``root`` (the root ``zarr.json`` last, so that the store
    only looks like a store once everything else is there)."""
    for key, data in files.items():
        if key != "zarr.json" and key not in skip:
            atomic_write(root / key, data)
    if "zarr.json" in files and "zarr.json" not in skip:
        atomic_write(root / "zarr.json", files["zarr.json"])


class AppendArray:
    """Appends along the first axis of one zarr v3 array whose chunks span all other axes.

    Only the ``bytes`` (little endian) + optional ``zstd`` codec chain is supported — the chain
    :func:`layout_template` stores get by default; anything else is refused at construction.
    """

    def __init__(self, root: Path, name: str, meta: dict) -> None:
        self.dir = root / name
        self.meta = meta
        chunk_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
        if list(chunk_shape[1:]) != list(meta["shape"][1:]):
            raise ValueError(f"array {name!r}: chunks must span every axis but the first")
        self.chunk_len = int(chunk_shape[0])
        self.tail = tuple(int(s) for s in meta["shape"][1:])
        self.dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        self.fill = meta["fill_value"]
        self.sep = meta["chunk_key_encoding"]["configuration"]["separator"]
        if meta["chunk_key_encoding"]["name"] != "default":
            raise ValueError(f"array {name!r}: unsupported chunk key encoding")
        codecs = meta["codecs"]
        if codecs[0]["name"] != "bytes" or codecs[0].get("configuration", {}).get(
                "endian", "little") != "little":
            raise ValueError(f"array {name!r}: unsupported serializer {codecs[0]}")
        self._compress: Callable[[bytes], bytes] = lambda b: b
        for c in codecs[1:]:
            if c["name"] != "zstd":
                raise ValueError(f"array {name!r}: unsupported codec {c['name']!r}")
            cfg = c.get("configuration", {})
            z = numcodecs.Zstd(level=cfg.get("level", 0), checksum=cfg.get("checksum", False))
            self._compress = z.encode
        self._open_index = -1  # chunk index held in memory (the last one written)
        self._open: np.ndarray | None = None
        self._on_disk: set[int] = set()  # chunk indices that have a file

    @property
    def length(self) -> int:
        return int(self.meta["shape"][0])

    def _key(self, index: int) -> str:
        return self.sep.join(["c", str(index), *("0" * len(self.tail))])

    def write(self, start: int, data: np.ndarray) -> None:
        """Write ``data`` at rows ``start : start + len(data)`` (which must lie in the shape).

        Rows before ``start`` may be being read by another process (the recorder appends at its
        committed end): every chunk holding one of them is replaced atomically."""
        n = len(data)
        if n == 0:
            return
        end = start + n
        if end > self.length:
            raise ValueError(f"write past the end of {self.dir.name!r}: {end} > {self.length}")
        L = self.chunk_len
        for c in range(start // L, (end - 1) // L + 1):
            if c == self._open_index:
                buf = self._open
            else:
                buf = np.full((L, *self.tail), self.fill, self.dtype)
            lo, hi = max(start, c * L), min(end, (c + 1) * L)
            buf[lo - c * L:hi - c * L] = data[lo - start:hi - start]
            # every chunk gets a file, even one still all fill value: a reader can then tell a
            # deleted chunk (corruption) from an empty one. Readers may read rows before
            # ``start`` (they are committed), so a chunk that holds any of them is replaced
            # atomically; a chunk past them is written in place
            atomic_write(self.dir / self._key(c), bytes(self._compress(buf.tobytes())),
                         unseen=c * L >= start and c not in self._on_disk)
            self._on_disk.add(c)
            self._open_index, self._open = c, buf

    def resize(self, length: int) -> None:
        """Set the first axis length (rewrite of ``zarr.json`` only; chunks wholly past a smaller
        end are left on disk, unread, as zarr's ``delete_outside_chunks=False`` does)."""
        self.meta["shape"][0] = int(length)
        atomic_write(self.dir / "zarr.json", dump_json(self.meta))
