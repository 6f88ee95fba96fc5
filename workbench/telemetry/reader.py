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
  traceback.

Every refusal is a :class:`~workbench.errors.StoreError` (a WorkbenchError: the CLI prints one
line and exits 2) whose message names the store and what is wrong.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
import zarr
from xarray.backends import BackendArray
from xarray.core import indexing

from workbench.errors import StoreError
from workbench.telemetry.schema import GROWING, SCHEMA, SCHEMA_VERSION

#: variables of the first schema: every workbench store has them
CORE = ("phase", "step_tokens", "step_start_s", "latency_measured_s", "latency_modeled_s",
        "stall_measured_s", "stall_modeled_s", "transfer_bytes", "transfer_bytes_modeled",
        "generated_token", "hits", "misses", "loads", "evictions", "stall_layer_measured_s",
        "routed_tokens", "resident", "token_id", "token_step", "token_modality", "topk_ids",
        "topk_weights", "span_clock", "span_lane", "span_step", "span_layer", "span_expert",
        "span_start_s", "span_end_s")
#: dimensions with a coordinate array of their own (read eagerly: they are small)
INDEXES = ("layer", "expert", "k", "depth", "rank", "modality")
#: one chunk may hold at most this many bytes (a tampered chunk shape cannot allocate more)
MAX_CHUNK_BYTES = 256 * 1024 * 1024
MAX_DIM = 1 << 20  # a layout dimension (layers, experts, k, …) larger than this is not a run


def _fail(path: Path, what: str) -> StoreError:
    return StoreError(f"run store {str(path)!r}: {what}")


def _read_doc(path: Path, rel: str) -> dict:
    f = path / rel
    try:
        raw = f.read_bytes()
    except FileNotFoundError:
        raise _fail(path, f"{rel} is missing") from None
    except OSError as e:
        raise _fail(path, f"{rel} cannot be read ({e.strerror or e})") from None
    if len(raw) > 64 * 1024 * 1024:
        raise _fail(path, f"{rel} is {len(raw)} bytes; a store document is at most 64 MiB")
    try:
        doc = json.loads(raw)
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
            c = json.loads(c)
        except (ValueError, RecursionError):
            c = None
    if not isinstance(c, dict):
        raise _fail(path, f"attribute 'committed' is {_short(attrs.get('committed'))}; expected "
                          f"an object with a row count for each of {', '.join(GROWING)}")
    out = {}
    for d in GROWING:
        v = c.get(d)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _fail(path, f"committed extent of {d!r} is {_short(v)}; expected a whole "
                              f"number ≥ 0")
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
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "…"


class _StoreArray(BackendArray):
    """One stored array cut to ``n`` rows along its first axis; every read goes to zarr and any
    failure there is reported as a :class:`StoreError` naming the store and the array."""

    def __init__(self, path: Path, name: str, meta: dict, n: int) -> None:
        self.path, self.name = path, name
        self.arr: zarr.Array | None = None  # opened on the first read (most are never read)
        self.shape = (n, *meta["shape"][1:])
        self.dtype = np.dtype(meta["data_type"])

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.BASIC,
                                                  self._read)

    def _read(self, key: tuple) -> np.ndarray:
        # slices are bounded by the cut shape, never the array's larger capacity
        key = tuple(slice(*k.indices(n)) if isinstance(k, slice) else k
                    for k, n in zip(key, self.shape))
        try:
            if self.arr is None:
                self.arr = zarr.open_array(str(self.path / self.name), mode="r")
            return np.asarray(self.arr[key])
        except Exception as e:
            raise _fail(self.path, f"array {self.name!r} cannot be read at {key!r} "
                                   f"({type(e).__name__}: {str(e)[:160]}); the store is "
                                   f"corrupt") from None


def _check_array(path: Path, name: str, meta: dict, sizes: dict[str, int],
                 committed: dict[str, int]) -> None:
    """The array's metadata agrees with the schema and the store's layout."""
    v = SCHEMA.get(name)
    dims = meta.get("dimension_names")
    shape = meta.get("shape")
    if meta.get("node_type") != "array" or not isinstance(shape, list) \
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise _fail(path, f"array {name!r} has unusable metadata (shape {shape!r})")
    if v is None:
        return
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
    if shape[0] < committed[v.dims[0]]:
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
            if idx.isdigit():
                have.add(int(idx))
    missing = [i for i in range(min(need, len(have) + 1)) if i not in have]
    if missing or len(have) < need:
        first = missing[0] if missing else len(have)
        raise _fail(path, f"array {name!r} is missing chunk c.{first}{tail} (rows "
                          f"{first * L}–{min(n, (first + 1) * L) - 1} of its {n} committed "
                          f"rows); the store is corrupt — re-record the run")


def open_run(path: str | Path) -> xr.Dataset:
    """Open a run store (finished, failed or still being written) as an xarray Dataset.

    Growing dimensions are cut to the lengths the writer last committed, so a concurrent writer
    or a killed one never exposes half-written steps. Knob values are in ``ds.attrs`` as
    ``knob.<name>`` (JSON text); ``workbench.Knobs.from_attrs(ds.attrs)`` rebuilds them. A store
    left ``running`` by a writer that no longer exists reads with ``status`` ``interrupted``.
    Anything unreadable or inconsistent raises :class:`~workbench.errors.StoreError`.
    """
    path = Path(path)
    if not path.is_dir() or not (path / "zarr.json").exists():
        raise StoreError(f"run store {str(path)!r} does not exist or is not a zarr store")
    root = _read_doc(path, "zarr.json")
    attrs = root.get("attributes")
    if root.get("node_type") != "group" or not isinstance(attrs, dict):
        raise _fail(path, "zarr.json is not a zarr group with attributes")
    version = schema_version(path, attrs)
    committed = committed_extent(path, attrs)
    status = run_status(path, attrs)
    listed = attrs.get("arrays")
    if version >= 3:
        if not isinstance(listed, list) or not all(isinstance(a, str) for a in listed):
            raise _fail(path, f"attribute 'arrays' is {listed!r}; expected the list of arrays")
        required = [a for a in listed if a in SCHEMA or a == "pinned"]
    else:
        required = [*CORE, "pinned"]
    present = {p.name for p in path.iterdir() if p.is_dir() and (p / "zarr.json").exists()}
    missing = [a for a in required if a not in present]
    if missing:
        raise _fail(path, f"array {missing[0]!r} is missing"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    names = [n for n in (*SCHEMA, "pinned") if n in present]
    metas = {n: _read_doc(path, f"{n}/zarr.json") for n in names}
    sizes: dict[str, int] = {}
    for n in names:
        _check_array(path, n, metas[n], sizes, committed)
    coords: dict[str, Any] = {}
    for d in INDEXES:
        if d in present:
            meta = _read_doc(path, f"{d}/zarr.json")
            shape = meta.get("shape")
            if (meta.get("dimension_names") != [d] or not isinstance(shape, list)
                    or len(shape) != 1 or (d in sizes and shape[0] != sizes[d])):
                raise _fail(path, f"coordinate {d!r} has shape {shape!r}, the arrays "
                                  f"{sizes.get(d)!r}")
            try:
                coords[d] = np.asarray(zarr.open_array(str(path / d), mode="r")[:])
            except Exception as e:
                raise _fail(path, f"coordinate {d!r} cannot be read ({type(e).__name__})"
                            ) from None
    pinned_meta = metas.get("pinned")
    if pinned_meta is not None and pinned_meta.get("dimension_names") != ["layer"]:
        raise _fail(path, "array 'pinned' is not indexed by layer")
    data_vars = {}
    for n in names:
        meta = metas[n]
        grow = SCHEMA[n].dims[0] if n in SCHEMA else None
        rows = committed[grow] if grow else meta["shape"][0]
        if grow and version >= 3:
            _check_chunks(path, n, meta, rows)
        dims = tuple(meta["dimension_names"])
        data = indexing.LazilyIndexedArray(_StoreArray(path, n, meta, rows))
        var_attrs = meta.get("attributes") if isinstance(meta.get("attributes"), dict) else {}
        data_vars[n] = xr.Variable(dims, data, attrs=var_attrs)
    ds = xr.Dataset(data_vars, coords=coords, attrs={**attrs, "status": status})
    ds = ds.assign_coords(step=np.arange(ds.sizes.get("step", 0)))
    ds.encoding["source"] = str(path)  # as xarray's own openers record it
    return ds
