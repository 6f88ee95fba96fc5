"""The read side of a run store: :func:`open_run`, which checks a store before trusting it.

A store is read by many processes while one writer appends to it, and may have been killed,
filled its disk, or been tampered with. The reader therefore

- takes the ``committed`` extent from the root document and cuts every growing array to it,
  using each array's *own* shape (which the writer keeps ≥ the committed extent at every
  instant, including while it grows or trims arrays one file at a time) — so a live reader or a
  crashed writer never yields "conflicting sizes";
- checks every array's metadata against :data:`~workbench.telemetry.schema.SCHEMA` (dims, dtype,
  the layout's sizes, chunking) before anything is allocated;
- for schema ≥ 3 stores (every chunk of the committed extent has a file), refuses a missing chunk
  instead of reading it as zeros;
- wraps every lazy read so that a garbage or truncated chunk raises
  :class:`~workbench.errors.StoreError` naming the store, the array and the rows, not a codec's
  traceback;
- presents every older schema in the current names and meaning (:func:`_upgrade`): schema ≤ 3
  named the predictor's order dim ``rank`` (now ``pred_order``) and booked a pinned layer's
  accesses as ``hits`` (now ``pinned_accesses``; ``hits`` are cache lookups only). The Dataset's
  attr ``schema_version`` stays the version of the files.

Every refusal is a :class:`~workbench.errors.StoreError` (a WorkbenchError: the CLI prints one
line and exits 2) whose message names the store and what is wrong.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import socket
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import xarray as xr
from xarray.backends import BackendArray
from xarray.core import indexing

from workbench import jsonio
from workbench.errors import StoreError
from workbench.fileio import read_bytes_bounded, shorten
from workbench.telemetry.destination import store_path_arg
from workbench.telemetry.events import MODALITIES
from workbench.telemetry.schema import (EP_RANK, GROWING, INDEX_DIMS, LEGACY_PRED_ORDER,
                                        PRED_ORDER, SCHEMA, SCHEMA_VERSION, SUBEXPERT, Var,
                                        disk_dim, disk_schema)

#: variables of the first schema: every workbench store has them
CORE = ("phase", "step_tokens", "step_start_s", "latency_measured_s", "latency_modeled_s",
        "stall_measured_s", "stall_modeled_s", "transfer_bytes", "transfer_bytes_modeled",
        "generated_token", "hits", "misses", "loads", "evictions", "stall_layer_measured_s",
        "routed_tokens", "resident", "token_id", "token_step", "token_modality", "topk_ids",
        "topk_weights", "span_clock", "span_lane", "span_step", "span_layer", "span_expert",
        "span_start_s", "span_end_s")
#: the one array that does not grow: which layers are in the pinned prefix
PINNED = Var(("layer",), "bool", 0, "flag", "layer belongs to the pinned prefix")
#: one chunk may hold at most this many bytes (a tampered chunk shape cannot allocate more)
MAX_CHUNK_BYTES = 256 * 1024 * 1024
MAX_DIM = 1 << 20  # a layout dimension (layers, experts, k, …) larger than this is not a run
MAX_DOC_BYTES = 64 * 1024 * 1024  # a metadata document (zarr.json) at most
MAX_ROWS = 1 << 48  # a committed extent larger than this is not a run
MAX_SUBEXPERT_IDS = (1 << 15) - 1  # experts × sub-experts: what an int16 id holds


def _fail(path: Path, what: str) -> StoreError:
    return StoreError(f"run store {str(path)!r}: {what}")


def _read_file(path: Path, f: Path, what: str, limit: int) -> bytes:
    """The bytes of ``f``, a regular file (not a link, FIFO or device) of at most ``limit``
    bytes (:func:`workbench.fileio.read_bytes_bounded`, links not followed: a run store holds
    plain files only): a tampered store cannot make a reader hang or fill memory."""
    return read_bytes_bounded(f, limit, what, lambda msg: _fail(path, msg), empty_ok=True,
                              follow_symlinks=False)


#: errors of a stat that mean "not there" (``Path.exists``' own list): any other, e.g. EACCES,
#: is raised, not read as absent
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP})


def _exists(f: str) -> bool:
    """Whether ``f`` exists, by a stat without pathlib's parsing (a store open asks it of
    every array folder: ≈ 60 Path objects a store): absent for the errors ``Path.exists``
    took as absent up to Python 3.13 (ENOENT, ENOTDIR, EBADF, ELOOP) and an embedded NUL;
    any other error (EACCES, EIO) is raised, not read as a missing array."""
    try:
        os.stat(f)
    except OSError as e:
        if e.errno in _ABSENT:
            return False
        raise
    except ValueError:  # an embedded NUL byte, as Path.exists
        return False
    return True


def _read_doc(path: Path, rel: str) -> dict:
    raw = _read_file(path, path / rel, rel, MAX_DOC_BYTES)
    try:
        doc = jsonio.loads(raw)
    except (ValueError, RecursionError) as e:
        raise _fail(path, f"{rel} is not valid JSON ({type(e).__name__}: {str(e)[:120]})"
                    ) from None
    if not isinstance(doc, dict):
        raise _fail(path, f"{rel} is not a JSON object (got {type(doc).__name__})")
    return doc


def schema_version(path: Path, attrs: dict) -> int:
    """The store's schema version, checked: a workbench store this reader can read."""
    version = attrs.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _fail(path, f"schema_version is {_short(version)}; not a workbench run store")
    if version > SCHEMA_VERSION:
        raise _fail(path, f"schema_version {version} is newer than this workbench reads "
                          f"(≤ {SCHEMA_VERSION}); upgrade workbench")
    return version


def committed_extent(path: Path, attrs: dict) -> dict[str, int]:
    """The ``committed`` row counts of the growing dims, checked (whole numbers ≥ 0)."""
    c = attrs.get("committed")
    if isinstance(c, str):  # stores written by early versions kept it as JSON text
        try:
            c = jsonio.loads(c)
        except (ValueError, RecursionError):
            c = None
    if not isinstance(c, dict):
        raise _fail(path, f"attribute 'committed' is {_short(attrs.get('committed'))}; expected "
                          f"an object with a row count for each of {', '.join(GROWING)}")
    out = {}
    for d in GROWING:
        v = c.get(d)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_ROWS:
            raise _fail(path, f"committed extent of {d!r} is {_short(v)}; expected a whole "
                              f"number in [0, 2**48]")
        out[d] = v
    return out


def run_status(path: Path, attrs: dict) -> str:
    """``running`` / ``complete`` / ``failed``, or ``interrupted`` for a ``running`` store whose
    writer process on this host is gone."""
    status = attrs.get("status")
    if not isinstance(status, str) or not status or len(status) > 40:
        raise _fail(path, f"attribute 'status' is {_short(status)}; expected a short text")
    if status == "running" and _writer_gone(attrs):
        return "interrupted"
    return status


def _writer_gone(attrs: dict) -> bool:
    """A ``running`` store whose writer process on this host no longer exists."""
    w = attrs.get("writer")
    if not isinstance(w, dict) or w.get("host") != socket.gethostname():
        return False
    pid = w.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _short(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**30:
        return f"a {len(str(abs(v))) if v.bit_length() < 14_000 else 'many'}-digit number"
    return shorten(v, 60)


def _zstd_content_size(raw: bytes) -> int | None:
    """The decompressed size a zstd frame's header declares (RFC 8878 §3.1.1.1), None when it
    declares none or ``raw`` is not a zstd frame."""
    if len(raw) < 6 or raw[:4] != b"\x28\xb5\x2f\xfd":
        return None
    fhd = raw[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(raw) < pos + size:
        return None
    value = int.from_bytes(raw[pos:pos + size], "little")
    return value + 256 if size == 2 else value


class _StoreArray(BackendArray):
    """One stored array cut to ``n`` rows along its first axis.

    Chunks are read and decoded here, with the codec chain the writer uses (``bytes``, little
    endian, then optionally ``zstd``; :func:`_check_codecs` refused anything else): each chunk
    file must be a regular file no larger than its decoded size allows, and decodes into a
    buffer of exactly one chunk, so a tampered chunk (a link, a FIFO, a zstd bomb, a short or
    long payload) is a :class:`StoreError` naming the store and the array, never a hang, an
    allocation beyond one chunk, or zeros. Schema ≥ 3: a missing chunk is an error too; older
    stores read it as the fill value, as zarr does.
    """

    def __init__(self, path: Path, name: str, meta: dict, n: int, version: int) -> None:
        self.path, self.name, self.version = path, name, version
        self.shape = (n, *meta["shape"][1:])
        self.dtype = np.dtype(meta["data_type"])
        self.chunk_len = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        self.sep = meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
        self.zstd = len(meta["codecs"]) > 1
        self.fill = meta.get("fill_value", 0)
        self.chunk_items = self.chunk_len * math.prod(self.shape[1:])

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.BASIC,
                                                  self._read)

    def _chunk(self, c: int) -> np.ndarray:
        nbytes = self.chunk_items * self.dtype.itemsize
        f = self.path / self.name
        for part in self.sep.join(["c", str(c), *("0" * (len(self.shape) - 1))]).split("/"):
            f = f / part
        what = f"array {self.name!r} chunk {f.name!r}"
        if self.version < 3 and not os.path.lexists(f):
            return np.full((self.chunk_len, *self.shape[1:]), self.fill, self.dtype)
        raw = _read_file(self.path, f, what, nbytes + 1024 + nbytes // 64)
        out = np.empty(nbytes, np.uint8)
        try:
            if self.zstd:
                # numcodecs fills ``out`` and returns all of it whatever the frame held: the
                # frame's own declared size must be the chunk's (a short frame would leave
                # uninitialised bytes in the chunk)
                declared = _zstd_content_size(raw)
                if declared != nbytes:
                    raise ValueError(f"its frame declares {declared} bytes, not {nbytes}")
                got = numcodecs.Zstd().decode(raw, out=out)
                got = np.frombuffer(got, np.uint8) if not isinstance(got, np.ndarray) else got
                if got.nbytes != nbytes:
                    raise ValueError(f"decodes to {got.nbytes} bytes, not {nbytes}")
            else:
                if len(raw) != nbytes:
                    raise ValueError(f"holds {len(raw)} bytes, not {nbytes}")
                out[:] = np.frombuffer(raw, np.uint8)
        except Exception as e:
            raise _fail(self.path, f"{what} cannot be decoded ({str(e)[:160]}); the store is "
                                   f"corrupt") from None
        return out.view(self.dtype.newbyteorder("<")).astype(self.dtype, copy=False).reshape(
            self.chunk_len, *self.shape[1:])

    def _read(self, key: tuple) -> np.ndarray:
        first, rest = key[0], key[1:]
        n, L = self.shape[0], self.chunk_len
        if isinstance(first, slice):
            lo, hi, step = first.indices(n)
            if step < 0:  # (BASIC indexing hands positive steps; be safe)
                return self._read((slice(None),) + rest)[first]
            hi = max(hi, lo)
            pick: Any = slice(0, hi - lo, step)
        else:
            lo, hi, pick = int(first), int(first) + 1, 0
        if hi <= lo:
            rows = np.empty((0, *self.shape[1:]), self.dtype)
        else:
            parts = []
            for c in range(lo // L, (hi - 1) // L + 1):
                a, b = max(lo, c * L) - c * L, min(hi, (c + 1) * L) - c * L
                parts.append(self._chunk(c)[a:b])
            rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return np.asarray(rows[(pick, *rest)])


def _check_codecs(path: Path, name: str, meta: dict, version: int) -> None:
    """Exactly what the writer produces: chunk keys ``c.<i>.0…`` (``c/<i>/0…`` in schema 1),
    the codec chain ``bytes`` (little endian) + optional ``zstd``, fill value 0, no storage
    transformers. Anything else could make a chunk read as something other than it was
    written (zeros from keys nobody wrote, transposed or byte-swapped values)."""
    enc = meta.get("chunk_key_encoding")
    # ('pinned', written once, keeps zarr's default "/" keys)
    sep = "/" if version < 2 or name not in SCHEMA else "."
    if not (isinstance(enc, dict) and enc.get("name") == "default"
            and isinstance(enc.get("configuration", {}), dict)
            and enc.get("configuration", {}).get("separator", "/") == sep):
        raise _fail(path, f"array {name!r} has chunk key encoding {_short(enc)}; run stores of "
                          f"schema {version} use the default encoding with separator {sep!r}")
    codecs = meta.get("codecs")
    ok = isinstance(codecs, list) and 1 <= len(codecs) <= 2 and all(isinstance(c, dict)
                                                                     for c in codecs)
    if ok:
        first = codecs[0]
        cfg = first.get("configuration", {})
        ok = (first.get("name") == "bytes" and isinstance(cfg, dict)
              and cfg.get("endian", "little") == "little"
              and (len(codecs) == 1 or codecs[1].get("name") == "zstd"))
    if not ok:
        raise _fail(path, f"array {name!r} has codecs {_short(codecs)}; run stores use "
                          f"bytes (little endian) + zstd")
    if meta.get("storage_transformers") not in (None, []):
        raise _fail(path, f"array {name!r} has storage transformers; run stores have none")
    if meta.get("fill_value") not in (0, False):
        raise _fail(path, f"array {name!r} has fill value {_short(meta.get('fill_value'))}; "
                          f"run stores use 0")


def _check_array(path: Path, name: str, meta: dict, sizes: dict[str, int],
                 committed: dict[str, int], version: int) -> None:
    """The array's metadata agrees with the schema of the store's version and its layout."""
    v = disk_schema(version).get(name) or PINNED
    dims = meta.get("dimension_names")
    shape = meta.get("shape")
    if meta.get("node_type") != "array" or not isinstance(shape, list) \
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_ROWS
                       for s in shape):
        raise _fail(path, f"array {name!r} has unusable metadata (shape {_short(shape)})")
    _check_codecs(path, name, meta, version)
    if dims != list(v.dims):
        raise _fail(path, f"array {name!r} has dimensions {dims!r}; the schema says "
                          f"{list(v.dims)!r}")
    dt = meta.get("data_type")
    if dt != v.dtype:
        raise _fail(path, f"array {name!r} has data type {dt!r}; the schema says {v.dtype!r}")
    for d, s in zip(v.dims[1:], shape[1:]):
        if sizes.setdefault(d, s) != s:
            raise _fail(path, f"array {name!r} has {s} along {d!r}, other arrays "
                              f"{sizes[d]}; the store is inconsistent")
        if s > MAX_DIM:
            raise _fail(path, f"array {name!r} has {s} along {d!r}; at most {MAX_DIM} allowed")
    if v is PINNED:
        if shape[0] != sizes.setdefault("layer", shape[0]):
            raise _fail(path, f"array 'pinned' has {shape[0]} layers, other arrays "
                              f"{sizes['layer']}; the store is inconsistent")
    elif shape[0] < committed[v.dims[0]]:
        raise _fail(path, f"array {name!r} has {shape[0]} rows but {committed[v.dims[0]]} "
                          f"{v.dims[0]} rows are committed; the store is truncated")
    try:
        chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
        ok = (isinstance(chunk, list) and len(chunk) == len(shape) and
              all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in chunk))
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise _fail(path, f"array {name!r} has an unusable chunk grid")
    # the reader reads whole rows of a chunk: a chunk narrower than a row would slip a row of
    # any size past the per-chunk bound below
    if v is not PINNED and chunk[1:] != shape[1:]:
        raise _fail(path, f"array {name!r} declares chunks of {chunk}; a run store's chunks "
                          f"span the whole of {list(v.dims[1:])} {shape[1:]}")
    if math.prod(chunk) * np.dtype(v.dtype).itemsize > MAX_CHUNK_BYTES:
        raise _fail(path, f"array {name!r} declares chunks of {chunk}; at most "
                          f"{MAX_CHUNK_BYTES // 2**20} MiB per chunk allowed")


def _check_chunks(path: Path, name: str, meta: dict, n: int) -> None:
    """Schema ≥ 3: every chunk holding a committed row has a file."""
    L = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
    need = -(-n // L)
    if need == 0:
        return
    tail = ".0" * (len(meta["shape"]) - 1)
    try:
        names = os.listdir(path / name)
    except OSError as e:
        raise _fail(path, f"array {name!r} cannot be listed ({e.strerror})") from None
    have = set()
    for f in names:
        if f.startswith("c.") and f.endswith(tail):
            idx = f[2:len(f) - len(tail)]
            if idx.isdigit() and str(int(idx)) == idx:  # canonical: "c.00.0" is not chunk 0
                have.add(int(idx))
    missing = [i for i in range(min(need, len(have) + 1)) if i not in have]
    if missing or len(have) < need:
        first = missing[0] if missing else len(have)
        raise _fail(path, f"array {name!r} is missing chunk c.{first}{tail} (rows "
                          f"{first * L}–{min(n, (first + 1) * L) - 1} of its {n} committed "
                          f"rows); the store is corrupt — re-record the run")


def open_run(path: str | Path, variables: Any = None) -> xr.Dataset:
    """Open a run store (finished, failed or still being written) as an xarray Dataset.

    Growing dimensions are cut to the lengths the writer last committed, so a concurrent writer
    or a killed one never exposes half-written steps. Knob values are in ``ds.attrs`` as
    ``knob.<name>`` (JSON text); ``workbench.Knobs.from_attrs(ds.attrs)`` rebuilds them. A store
    left ``running`` by a writer that no longer exists reads with ``status`` ``interrupted``.
    Anything unreadable or inconsistent raises :class:`~workbench.errors.StoreError`.

    ``variables``: names of the run schema's arrays to open, the others left out (as
    xarray's ``drop_variables``, named the other way round): only those are read and checked,
    so a reader of a few arrays of a large store does not pay for all of them. The store's
    structure, attributes and coordinates are checked as always, and so is what a check of
    an asked-for array reads (``hits`` with ``misses``, ``step_tokens`` with ``token_step``)
    and the step array the steps come from (``phase``): opened, checked, left out. A store of
    an older schema opens whole (its upgrade builds arrays from others). None: every array.
    """
    path = store_path_arg(path, "run store")
    keep = _variables_arg(variables)
    if not path.is_dir() or not (path / "zarr.json").exists():
        raise StoreError(f"run store {str(path)!r} does not exist or is not a zarr store")
    root = _read_doc(path, "zarr.json")
    attrs = root.get("attributes")
    if root.get("node_type") != "group" or not isinstance(attrs, dict):
        raise _fail(path, "zarr.json is not a zarr group with attributes")
    version = schema_version(path, attrs)
    committed = committed_extent(path, attrs)
    status = run_status(path, attrs)
    schema = disk_schema(version)
    listed = attrs.get("arrays")
    if version >= 3:
        if not isinstance(listed, list) or not all(isinstance(a, str) for a in listed):
            raise _fail(path, f"attribute 'arrays' is {listed!r}; expected the list of arrays")
        required = [a for a in listed if a in schema or a == "pinned"]
    else:
        required = [*CORE, "pinned"]
    try:  # (scandir: each entry's kind from the listing, not a stat or two per entry)
        with os.scandir(path) as it:
            entries = list(it)
    except OSError as e:
        raise _fail(path, f"cannot be listed ({e.strerror or e})") from None
    links = sorted(p.name for p in entries if p.is_symlink())
    if links:
        raise _fail(path, f"{links[0]!r} is a symlink; a run store holds plain folders and files")
    present = {p.name for p in entries
               if p.is_dir() and _exists(os.path.join(p.path, "zarr.json"))}
    missing = [a for a in required if a not in present]
    if missing:
        raise _fail(path, f"array {missing[0]!r} is missing"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    names = [n for n in (*schema, "pinned") if n in present]
    extra: list[str] = []  # opened to check the asked-for arrays, then left out
    if keep is not None and version == SCHEMA_VERSION:
        checked = set(keep).union(*(_CHECKED_WITH.get(n, ()) for n in keep), (_STEPS_FROM,))
        extra = [n for n in names if n in checked and n not in keep]
        names = [n for n in names if n in checked]
    metas = {n: _read_doc(path, f"{n}/zarr.json") for n in names}
    sizes: dict[str, int] = {}
    for n in names:
        _check_array(path, n, metas[n], sizes, committed, version)
    _check_subexpert_ids(path, sizes.get("expert", 1), sizes.get(SUBEXPERT, 1))
    coords: dict[str, Any] = {}
    for d in (disk_dim(i, version) for i in INDEX_DIMS):
        if d in present:
            meta = _read_doc(path, f"{d}/zarr.json")
            shape = meta.get("shape")
            if (meta.get("dimension_names") != [d] or not isinstance(shape, list)
                    or len(shape) != 1 or (d in sizes and shape[0] != sizes[d])
                    or (d == "modality" and shape[0] != len(MODALITIES))
                    # a dimension no array read here has (a subset of the arrays): bounded
                    # as an array's (its range is allocated)
                    or isinstance(shape[0], bool) or not isinstance(shape[0], int)
                    or not 0 <= shape[0] <= MAX_DIM):
                raise _fail(path, f"coordinate {d!r} has shape {_short(shape)}, the arrays "
                                  f"{sizes[d]!r}" if d in sizes else
                                  f"coordinate {d!r} has shape {_short(shape)}; expected one "
                                  f"length of at most {MAX_DIM}")
            n = int(shape[0])
            coords[d] = (np.array(MODALITIES, dtype=np.dtypes.StringDType()) if d == "modality"
                         else np.arange(1 if d == "depth" else 0, n + (d == "depth"),
                                        dtype=np.int32))
    if keep is not None:  # the arrays opened may hold neither dimension: their coordinates'
        _check_subexpert_ids(path, *(sizes.get(d, len(coords[d]) if d in coords else 1)
                                     for d in ("expert", SUBEXPERT)))
    pinned_meta = metas.get("pinned")
    if pinned_meta is not None and pinned_meta.get("dimension_names") != ["layer"]:
        raise _fail(path, "array 'pinned' is not indexed by layer")
    data_vars, arrays = {}, {}
    for n in names:
        meta = metas[n]
        grow = schema[n].dims[0] if n in schema else None
        rows = committed[grow] if grow else meta["shape"][0]
        if grow and version >= 3:
            _check_chunks(path, n, meta, rows)
        dims = tuple(meta["dimension_names"])
        arrays[n] = _StoreArray(path, n, meta, rows, version)
        var_attrs = meta.get("attributes") if isinstance(meta.get("attributes"), dict) else {}
        data_vars[n] = xr.Variable(dims, indexing.LazilyIndexedArray(arrays[n]),
                                   attrs=var_attrs)
    if version < 4:
        _upgrade(data_vars, arrays, coords)
    if version < 5 and "routed_tokens" in data_vars:  # no dispatch before schema 5: nothing
        v = SCHEMA["dispatch_dropped"]                 # dropped (a zero view, no memory)
        data_vars["dispatch_dropped"] = xr.Variable(
            v.dims, np.broadcast_to(np.int32(0), data_vars["routed_tokens"].shape),
            attrs={"units": v.units, "description": v.doc})
    if version < 6 and "routed_tokens" in data_vars:  # no rerouting before schema 6
        v = SCHEMA["dispatch_rerouted"]
        data_vars["dispatch_rerouted"] = xr.Variable(
            v.dims, np.broadcast_to(np.int32(0), data_vars["routed_tokens"].shape),
            attrs={"units": v.units, "description": v.doc})
    if version < 6 and "routed_tokens" in data_vars:  # every token weighed 1 before
        v = SCHEMA["effective_load"]
        data_vars["effective_load"] = xr.Variable(
            v.dims, data_vars["routed_tokens"]._data,
            attrs={"units": v.units, "description": v.doc})
    if version < 6 and "resident" in data_vars:  # every expert native before schema 6
        v = SCHEMA["low_precision"]
        data_vars["low_precision"] = xr.Variable(
            v.dims, np.broadcast_to(np.False_, data_vars["resident"].shape),
            attrs={"units": v.units, "description": v.doc})
    if version < 7 and "hits" in data_vars:  # no ReaLB controller before schema 7
        coords[EP_RANK] = np.arange(1, dtype=np.int32)
        shape = (*data_vars["hits"].shape, 1)
        for name, fill in (("realb_low", np.False_), ("realb_m", np.float32(np.nan)),
                           ("realb_ib", np.float32(np.nan)), ("realb_vision", np.float32(np.nan)),
                           ("realb_gated", np.False_)):
            v = SCHEMA[name]
            data_vars[name] = xr.Variable(
                v.dims, np.broadcast_to(fill, shape if len(v.dims) == 3 else shape[:2]),
                attrs={"units": v.units, "description": v.doc})
    if version < 8:  # each expert one sub-expert, run by every routed token, before 8
        coords[SUBEXPERT] = np.arange(1, dtype=np.int32)
        for name, src, fn in (("subexpert_tokens", "routed_tokens", None),
                              ("subexpert_ran", "topk_ids", lambda a: a >= 0)):
            if src in arrays:
                v = SCHEMA[name]
                data_vars[name] = xr.Variable(v.dims, indexing.LazilyIndexedArray(
                    _OneMore(arrays[src], v.dims.index(SUBEXPERT), fn)),
                    attrs={"units": v.units, "description": v.doc})
    if version < 6 and "token_id" in data_vars:  # one request per run before schema 6
        v = SCHEMA["token_request"]
        data_vars["token_request"] = xr.Variable(
            v.dims, np.broadcast_to(np.int16(0), data_vars["token_id"].shape),
            attrs={"units": v.units, "description": v.doc})
    # every run has a ``step`` coordinate (0 long where no array is indexed by step), given to
    # the constructor: ``assign_coords`` afterwards would build the Dataset twice
    steps = next((v.shape[v.dims.index("step")] for v in data_vars.values() if "step" in v.dims),
                 0)
    ds = xr.Dataset(data_vars, coords={**coords, "step": np.arange(steps)},
                    attrs={**attrs, "status": status})
    ds.encoding["source"] = str(path)  # as xarray's own openers record it
    # below schema 4 the upgrade presents ``hits`` anew; from 4 on every stored array is its
    # Variable's data as it is (the later upgrades only add arrays the store lacks)
    _check_semantics(path, ds, arrays if version >= 4 else None)
    return ds.drop_vars(extra) if extra else ds


#: a subset of the arrays (``open_run``'s ``variables``) opens these beside an array too: what
#: its checks read (hits + misses at most the experts; a step's tokens at most the tokens)
_CHECKED_WITH = {"hits": ("misses",), "misses": ("hits",), "step_tokens": ("token_step",)}
#: and this one always: the steps come from a checked array indexed by step (the committed
#: extent alone is an attribute; its array's chunks are what is checked against it)
_STEPS_FROM = "phase"


def _check_subexpert_ids(path: Path, E: int, N: int) -> None:
    if E * N > MAX_SUBEXPERT_IDS:  # sub-expert ids e·N + s are int16 in traces and replay
        raise _fail(path, f"{E} experts × {N} sub-experts is over {MAX_SUBEXPERT_IDS} "
                          f"sub-expert ids; not a run")


def _variables_arg(variables: Any) -> frozenset[str] | None:
    """:func:`open_run`'s ``variables`` as a set of names, or :class:`StoreError` naming the
    first that is no array of the run schema."""
    if variables is None:
        return None
    if isinstance(variables, str):
        variables = (variables,)
    known = {*SCHEMA, "pinned"}
    try:  # at most a few times the schema's names: an endless iterable is refused, not read
        names = list(itertools.islice(variables, 4 * len(known) + 1))
    except TypeError:
        raise StoreError(f"variables must be names of the run schema's arrays, not "
                         f"{type(variables).__name__} {shorten(variables, 60)}") from None
    if len(names) > 4 * len(known):
        raise StoreError(f"variables: more than {4 * len(known)} names; the run schema has "
                         f"{len(known)} arrays")
    for n in names:
        if not isinstance(n, str) or n not in known:
            raise StoreError(f"variables: {shorten(n, 60)} is no array of the run schema; "
                             f"allowed: {', '.join(sorted(known))}")
    return frozenset(names)


#: per-step and per-(step, layer) arrays that count something (≥ 0)
_COUNTS = ("step_tokens", "hits", "misses", "loads", "evictions", "pinned_accesses",
           "dispatch_dropped", "dispatch_rerouted",
           "pre_evictions", "prefetches", "host_runs", "topk_used", "routed_tokens")
#: per-step and per-(step, layer) times (finite, ≥ 0)
_TIMES = ("step_start_s", "latency_measured_s", "latency_modeled_s", "stall_measured_s",
          "stall_modeled_s", "stall_layer_measured_s")


def _check_semantics(path: Path, ds: xr.Dataset,
                     arrays: dict[str, "_StoreArray"] | None = None) -> None:
    """The invariants a reader can check cheaply (per-step and per-(step, layer) arrays, not the
    per-token ones), naming the first one broken — a tampered store replayed with exit 0 and
    gave a hit rate of 1.0015 (issue 26): counts ≥ 0; one layer's lookups in one step (hits +
    misses) at most its experts; times finite and ≥ 0; a step's tokens at most the tokens
    recorded; generated tokens ≥ -1 (-1: none)."""
    # each array read once: straight from its chunks when ``arrays`` holds it (the stored
    # arrays, each exactly what its Variable reads: the committed rows), else through the
    # Variable; ``ds[name]`` would build a DataArray with its coordinates for every read
    variables, read, arrays = ds.variables, {}, arrays or {}

    def values(name: str) -> np.ndarray:
        if name not in read:
            a = arrays.get(name)
            read[name] = (a._read((slice(None),) * len(a.shape)) if a is not None
                          else np.asarray(variables[name].values))
        return read[name]

    def first_bad(name: str, bad: np.ndarray, values: np.ndarray, expected: str) -> None:
        if bad.any():
            at = tuple(int(x) for x in np.argwhere(bad)[0])
            dims = variables[name].dims
            where = ", ".join(f"{d} {i}" for d, i in zip(dims, at))
            raise _fail(path, f"array {name!r} holds {values[at].item()!r} at {where}; expected "
                              f"{expected}")

    for name in _COUNTS:
        if name in ds.data_vars:
            v = values(name)
            first_bad(name, v < 0, v, "a count ≥ 0")
    for name in _TIMES:
        if name in ds.data_vars:
            v = np.asarray(values(name), np.float64)
            first_bad(name, ~np.isfinite(v) | (v < 0), v, "a finite number of seconds ≥ 0")
    if "hits" in ds.data_vars and "misses" in ds.data_vars and "expert" in ds.sizes:
        e = int(ds.sizes["expert"])
        n = int(ds.sizes.get(SUBEXPERT, 1))  # sub-expert offloading looks up sub-experts
        look = np.asarray(values("hits"), np.int64) + np.asarray(values("misses"), np.int64)
        first_bad("misses", look > e * n, look,
                  f"hits + misses at most the layer's {e} experts" + (f" × {n} sub-experts"
                                                                      if n > 1 else "")
                  + " (distinct lookups of one layer in one step)")
    if "step_tokens" in ds.data_vars and "token" in ds.sizes:
        t = int(ds.sizes["token"])
        v = values("step_tokens")
        first_bad("step_tokens", v > max(t, 1), v, f"at most the {t} tokens the store holds")
    if "generated_token" in ds.data_vars:
        v = values("generated_token")
        first_bad("generated_token", v < -1, v, "a token id ≥ 0, or -1 (none)")


class _LayerCounts(BackendArray):
    """A ``[step, layer]`` count array read through ``base``, with the layers where ``keep``
    is False read as 0 (lazy like every array of a store; BASIC indexing)."""

    def __init__(self, base: _StoreArray, keep: np.ndarray) -> None:
        self.base, self.keep = base, np.asarray(keep, bool)
        self.shape, self.dtype = base.shape, base.dtype

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.BASIC,
                                                  self._read)

    def _read(self, key: tuple) -> np.ndarray:
        key = (*key, *(slice(None),) * (2 - len(key)))
        # the layer axis is the last one left, or gone when key[1] is an int: both broadcast
        return np.where(self.keep[key[1]], self.base._read(key), 0).astype(self.dtype)


class _OneMore(BackendArray):
    """``base`` (lazy) with one more axis of size 1 at ``axis``, its values through ``fn``
    (None: as they are): an older store's array presented in a newer schema's dims, read
    chunk by chunk like the rest (BASIC indexing)."""

    def __init__(self, base: _StoreArray, axis: int, fn=None) -> None:
        self.base, self.axis, self.fn = base, axis, fn
        self.shape = (*base.shape[:axis], 1, *base.shape[axis:])
        self.dtype = np.dtype(bool) if fn is not None else base.dtype

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.BASIC,
                                                  self._read)

    def _read(self, key: tuple) -> np.ndarray:
        key = (*key, *(slice(None),) * (len(self.shape) - len(key)))
        inner = key[:self.axis] + key[self.axis + 1:]
        a = self.base._read(inner)
        a = np.asarray(self.fn(a) if self.fn is not None else a, self.dtype)
        # where the new axis sits among the dims the inner key kept (ints drop theirs)
        at = sum(not isinstance(k, (int, np.integer)) for k in key[:self.axis])
        return np.expand_dims(a, at)[(slice(None),) * at + (key[self.axis],)]


def _upgrade(data_vars: dict[str, xr.Variable], arrays: dict[str, _StoreArray],
             coords: dict[str, Any]) -> None:
    """Present a schema ≤ 3 store as schema 4 (in place), reading only its ``pinned`` array.

    - The dim ``rank`` of ``predicted_ids``/``predicted_scores`` and its coordinate become
      ``pred_order``.
    - Schema ≤ 3 booked every routed expert of a pinned layer as a hit. Here ``hits`` keeps
      the offloaded layers (the expert-cache lookups; pinned layers read 0) and the new
      ``pinned_accesses`` the pinned layers (offloaded layers read 0): ``hits +
      pinned_accesses`` is the stored ``hits``. The pinned layers are those of the store's
      ``pinned`` array (none without one). ``misses`` stays: schema ≤ 3 booked no miss on a
      pinned layer.
    """
    for n, var in data_vars.items():
        if LEGACY_PRED_ORDER in var.dims:
            data_vars[n] = xr.Variable(
                tuple(PRED_ORDER if d == LEGACY_PRED_ORDER else d for d in var.dims),
                indexing.LazilyIndexedArray(arrays[n]), attrs=var.attrs)
    if LEGACY_PRED_ORDER in coords:
        coords[PRED_ORDER] = coords.pop(LEGACY_PRED_ORDER)
    if "hits" not in arrays:
        return
    hits = arrays["hits"]
    pinned = np.zeros(hits.shape[1], bool)
    if "pinned" in arrays:
        pinned = np.asarray(arrays["pinned"][indexing.BasicIndexer((slice(None),))], bool)
    for name, keep in (("hits", ~pinned), ("pinned_accesses", pinned)):
        v = SCHEMA[name]
        data_vars[name] = xr.Variable(v.dims, indexing.LazilyIndexedArray(
            _LayerCounts(hits, keep)), attrs={"units": v.units, "description": v.doc})
