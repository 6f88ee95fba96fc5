"""Run stores: zarr v3 groups that an xarray Dataset reads, written while the run goes on.

The schema (variables, dims, units) is documented in ``docs/telemetry.md`` and declared once in
:data:`SCHEMA`. Three dimensions grow while a run streams: ``step`` (forward passes), ``token``
(routed tokens, all steps back to back) and ``span`` (timeline intervals). The recorder appends a
batch of steps to every array, then records the new lengths in the group attribute ``committed``.
Readers (:func:`open_run`) cut every growing dimension to ``committed``, so a half-written batch
(the writer was killed with SIGKILL mid-flush, or another process reads during a run) is never
seen: every flushed step stays readable.
"""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import zarr

from workbench import jsonio
from workbench._version import __version__
from workbench.errors import WorkbenchError
from workbench.telemetry import zarr_files
from workbench.telemetry.destination import (Destination, check_destination, io_step,
                                             writable_error)
from workbench.telemetry.events import CLOCKS, LANES, MODALITIES, PHASES, Span, StepEvent
from workbench.telemetry.schema import (EP_RANK, GROWING, INITIAL_CAPACITY, PRED_ORDER, SCHEMA,
                                        SUBEXPERT,
                                        SCHEMA_VERSION, STORE_ENTRIES)

#: bytes kept free inside a running store, given back just before its last metadata write, so
#: that a store whose disk filled up can still be marked ``failed``
RESERVE_BYTES = 256 * 1024


def check_store_path(path: str | Path, overwrite: bool) -> Path:
    """Check, before a model loads, that a run store can be written at ``path`` (see
    :func:`workbench.telemetry.destination.check_destination`); returns the path to write."""
    return check_destination(path, overwrite, STORE_ENTRIES)


class Recorder:
    """Streams :class:`StepEvent` batches into a zarr v3 store.

    Use as a context manager; on exit the store's ``status`` attr says ``complete`` or
    ``failed`` (with the error). ``flush_every`` steps or ``flush_interval_s`` seconds, whichever
    comes first, trigger an append. The recorder is the store's only writer (an exclusive lock,
    :class:`~workbench.telemetry.destination.Destination`) and writes files directly
    (:mod:`workbench.telemetry.zarr_files`); everything reads it with zarr/xarray.

    Cache counters: a pinned :class:`~workbench.telemetry.events.LayerEvent` (``pinned``
    True) is booked as ``pinned_accesses`` (its distinct routed experts), never as ``hits`` or
    ``misses``, which count expert-cache lookups of offloaded layers only — so the store's
    ``hits.sum()`` is the run's ``RunResult.hits``.

    ``depth``: size of the router-lookahead dim (``lookahead_depth``, 1 when off);
    ``pred_order``: size of the predictor's order dim (its top-B, 1 when it is off);
    ``ep_ranks``: size of ReaLB's ``ep_rank`` dim (the run's ranks when ``balance`` ≠ none, else
    1; a layer event's ``realb`` decision fills it, NaN where none was made);
    ``subexperts``: size of MoE-Prism's ``subexpert`` dim (the refactoring's N when ``prism``
    is on, else 1: then ``subexpert_tokens`` repeats ``routed_tokens``).

    Durability: a new store appears at ``path`` with its whole layout at once and is then
    appended to in place (readers may follow the run); with ``overwrite`` the new run is written
    aside and exchanged with the old store only when it has finished — a failed run leaves the
    old store as it was. A crash at any instant leaves every committed step readable.

    File I/O runs on one background writer thread, in submission order, so laying out the store
    and intermediate flushes overlap the model's compute; :meth:`flush` and :meth:`close` wait
    for it, and an error on the writer is raised by the next call on the recorder (as a
    :class:`~workbench.errors.StoreError` naming the store when it is an I/O error).
    """

    def __init__(self, path: str | Path, num_layers: int, num_experts: int, top_k: int,
                 attrs: dict[str, Any], pinned: Sequence[bool], overwrite: bool = False,
                 flush_every: int = 16, flush_interval_s: float = 0.5, depth: int = 1,
                 pred_order: int = 1, capacity: dict[str, int] | None = None,
                 ep_ranks: int = 1, subexperts: int = 1) -> None:
        R = pred_order
        self.dest = Destination(path, overwrite, STORE_ENTRIES)  # checks, locks, stages
        self.path = self.dest.path
        self.L, self.E, self.k = num_layers, num_experts, top_k
        self.D = max(int(depth), 1)  # size of the lookahead dim (1 when lookahead is off)
        self.R = max(int(R), 1)  # size of the predictor's pred_order dim (1 when it is off)
        self.P = max(int(ep_ranks), 1)  # size of ReaLB's ep_rank dim (1 when it is off)
        self.S = max(int(subexperts), 1)  # size of MoE-Prism's subexpert dim (1: off)
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self._buf: list[StepEvent] = []
        self._last_flush = time.perf_counter()
        self.committed = {d: 0 for d in GROWING}
        # arrays are allocated ahead of the data (unwritten chunks cost nothing on disk) so that a
        # flush writes chunks only; readers never look past ``committed``
        # (``capacity``: rows allocated up front per growing dim; small values exercise growth)
        self.capacity = {**INITIAL_CAPACITY, **(capacity or {})}
        self.attrs: dict[str, Any] = {
            **attrs,
            "schema_version": SCHEMA_VERSION,
            "workbench_version": __version__,
            "arrays": sorted((*SCHEMA, "pinned")),
            "writer": {"pid": os.getpid(), "host": socket.gethostname()},
            "phase_names": list(PHASES), "lane_names": list(LANES), "clock_names": list(CLOCKS),
            "status": "running", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "committed": dict(self.committed),
        }
        self.arrays: dict[str, zarr_files.AppendArray] = {}
        self._closed = False
        self._write_error: BaseException | None = None  # the first failed writer task
        self._group_meta: dict | None = None  # the root document, once laid out
        self._final_written = False  # the closing document (status, committed) is on disk
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="workbench-recorder")
        self._pending: list[Future] = []
        #: called with each batch's columns once they are written, on the writer thread
        #: (:meth:`on_columns`)
        self._column_hooks: list[Callable[[dict[str, np.ndarray]], None]] = []
        self._submit(self._lay_out, np.asarray(pinned, dtype=bool))

    def on_columns(self, fn: Callable[[dict[str, np.ndarray]], None]) -> None:
        """Call ``fn(columns)`` with every batch of steps written from now on (one array per
        schema variable, the steps in order), on the writer thread once the batch is written
        and published: e.g. :class:`~workbench.replay.ep.EPStream` sums the run's EP load as
        it goes (its work runs beside the model's on a 2-core machine, or at the close for
        the last batch). ``fn`` must not raise (it runs where a failure would fail the store); the
        arrays are the batch's own (the recorder neither keeps nor reuses them)."""
        self._column_hooks.append(fn)

    # -- the writer thread's work ----------------------------------------------------------
    def _lay_out(self, pinned: np.ndarray) -> None:
        files = _layout_files(self.L, self.E, self.k, self.D, self.R, self.capacity,
                              self.P, self.S)
        stage = self.dest.write_dir
        zarr_files.materialize(stage, files, skip={"zarr.json"})
        zarr_files.AppendArray(stage, "pinned", jsonio.loads(files["pinned/zarr.json"])
                               ).write(0, pinned)
        zarr_files.atomic_write(stage / ".reserve", bytes(RESERVE_BYTES), unseen=True)
        self._group_meta = jsonio.loads(files["zarr.json"])
        self._write_attrs()  # the root document last: from now on the layout is complete
        self.dest.publish()  # a fresh store appears at its path, whole
        root = self.dest.write_dir
        self.arrays = {name: zarr_files.AppendArray(root, name,
                                                    jsonio.loads(files[f"{name}/zarr.json"]))
                       for name in SCHEMA}

    def _write_attrs(self) -> None:
        self._group_meta["attributes"] = self.attrs
        zarr_files.atomic_write(self.dest.write_dir / "zarr.json",
                                zarr_files.dump_json(self._group_meta))

    def _write_batch(self, events: list[StepEvent], publish: bool) -> None:
        cols = _columns(events, self.L, self.E, self.k, self.D, self.R, self.P, self.S)
        start = dict(self.committed)
        end = dict(start)
        for dim, var in (("step", "phase"), ("token", "token_id"), ("span", "span_clock")):
            end[dim] += len(cols[var])
        for dim in GROWING:
            if end[dim] > self.capacity[dim]:
                self._grow(dim, end[dim])
        for name, data in cols.items():
            self.arrays[name].write(start[SCHEMA[name].dims[0]], data)
        self.committed = end
        self.attrs["committed"] = dict(end)
        if publish:
            self._write_attrs()
        for fn in self._column_hooks:  # (after the publish: live readers wait for no hook)
            fn(cols)

    def _grow(self, dim: str, needed: int) -> None:
        # arrays of one dim are resized one file at a time; readers take each array's own shape
        # (≥ the committed extent at every instant) and cut it, so the window between is harmless
        cap = self.capacity[dim]
        while cap < needed:
            cap *= 2
        for name, v in SCHEMA.items():
            if v.dims[0] == dim:
                self.arrays[name].resize(cap)
        self.capacity[dim] = cap

    def _finish(self, attrs: dict[str, Any]) -> None:
        if self._group_meta is None:  # the layout never completed: nothing was published
            return
        if attrs.get("status") == "complete":
            for name, a in self.arrays.items():  # trim to the committed lengths
                n = self.committed[SCHEMA[name].dims[0]]
                if a.length != n:
                    a.resize(n)
            self.capacity = dict(self.committed)
        # (a failed store keeps its capacity: one metadata write is all a full disk may allow)
        self.attrs.update(attrs)
        self.attrs.pop("writer", None)
        root = self.dest.write_dir
        io_step("unlink", root / ".reserve")
        (root / ".reserve").unlink(missing_ok=True)  # room for the last document
        self._write_attrs()
        self._final_written = True

    # -- the caller's side -----------------------------------------------------------------
    def _raise(self, e: BaseException) -> None:
        if isinstance(e, OSError) and not isinstance(e, WorkbenchError):
            raise writable_error(e, self.path, "writing failed") from e
        raise e

    def _guarded(self, fn, *args) -> None:
        """Run one writer task. After a failed one, only :meth:`_finish` still runs: a later
        batch would land at the rows of the failed one and shift every step after it."""
        if self._write_error is not None and fn != self._finish:
            return
        try:
            fn(*args)
        except BaseException as e:
            if self._write_error is None:
                self._write_error = e
            raise

    def _submit(self, fn, *args) -> None:
        for f in [f for f in self._pending if f.done()]:
            self._pending.remove(f)
            if f.exception() is not None:  # an earlier write failed: raise it here
                self._raise(f.exception())
        self._pending.append(self._pool.submit(self._guarded, fn, *args))

    def wait(self) -> None:
        """Block until every submitted write is on disk (raises a writer error)."""
        pending, self._pending = self._pending, []
        error = None
        for f in pending:
            if f.exception() is not None and error is None:
                error = f.exception()
        if error is not None:
            self._raise(error)

    def add(self, ev: StepEvent) -> None:
        self._buf.append(ev)
        if (len(self._buf) >= self.flush_every
                or time.perf_counter() - self._last_flush >= self.flush_interval_s):
            self._flush(publish=True)

    def _flush(self, publish: bool) -> None:
        if self._buf:
            batch, self._buf = self._buf, []
            self._submit(self._write_batch, batch, publish)
        self._last_flush = time.perf_counter()

    def flush(self) -> None:
        """Write buffered steps past the committed end of every array, publish the new
        committed lengths (the only metadata write of a flush, unless an array must grow), and
        wait until it is on disk."""
        self._flush(publish=True)
        self.wait()

    def close(self, status: str = "complete", **attrs: Any) -> None:
        """Flush, trim every growing array to its committed length, and set ``status`` (the new
        committed lengths and the status are published in one write, after the trim). Then the
        store is final: a new store stays where it is; an overwrite replaces the old store if
        the run completed, and is dropped (the old store kept) if it failed."""
        if self._closed:
            return
        self._closed = True
        error: BaseException | None = None
        try:
            try:
                self._flush(publish=False)
                self.wait()  # the status depends on whether every write landed
                if self._write_error is not None:  # one already raised at an add(): the
                    self._raise(self._write_error)  # store lacks a batch, it cannot be complete
            except Exception as e:  # a write failed: still try to mark the store failed
                error = e
                cause = e.__cause__ if e.__cause__ is not None else e
                status, attrs = "failed", {**attrs,
                                           "error": f"recorder: {type(cause).__name__}: {cause}"}
            final = {**attrs, "status": status}
            self._pending.append(self._pool.submit(self._guarded, self._finish, final))
            try:
                self.wait()
                if status == "complete":
                    self._pending.append(self._pool.submit(self._guarded, self.dest.commit))
                    self.wait()
                else:
                    self.dest.abandon()
            except Exception as e:
                if error is None:
                    error = e
                if self.dest.published and not self._final_written:
                    try:  # one more try to leave the published store marked failed
                        cause = e.__cause__ if e.__cause__ is not None else e
                        self._finish({**attrs, "status": "failed",
                                      "error": f"recorder: {type(cause).__name__}: {cause}"})
                    except Exception:
                        pass
                self.dest.abandon()
        finally:
            self._pool.shutdown(wait=True)
            self.dest.release()
        if error is not None:
            raise error

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close("complete")
        else:
            try:
                self.close("failed", error=f"{exc_type.__name__}: {exc}")
            except Exception:  # never hide the original error
                pass


def _layout_files(L: int, E: int, k: int, D: int = 1, R: int = 1,
                  capacity: dict[str, int] | None = None, P: int = 1, S: int = 1
                  ) -> dict[str, bytes]:
    """The files of an empty run store for an (L layers, E experts, top-k, lookahead depth D,
    predictor top-B R, ReaLB ranks P, MoE-Prism sub-experts S) layout: every array's metadata at its initial capacity
    plus the constant coordinates."""

    def build(group: zarr.Group) -> None:
        sizes = {"layer": L, "expert": E, "modality": len(MODALITIES), "k": k, "depth": D,
                 PRED_ORDER: R, EP_RANK: P, SUBEXPERT: S}
        specs = {name: dict(shape=(cap[v.dims[0]], *(sizes[d] for d in v.dims[1:])),
                            chunks=(v.chunk, *(sizes[d] for d in v.dims[1:])), dtype=v.dtype,
                            dimension_names=list(v.dims), fill_value=0,
                            # chunk files "c.0.0" sit in the array's folder: no subfolders to
                            # create while streaming (each costs syscalls on every new chunk)
                            chunk_key_encoding={"name": "default", "separator": "."},
                            attributes={"units": v.units, "description": v.doc})
                 for name, v in SCHEMA.items()}
        index = {"layer": np.arange(L, dtype=np.int32), "expert": np.arange(E, dtype=np.int32),
                 "k": np.arange(k, dtype=np.int32),
                 "depth": np.arange(1, D + 1, dtype=np.int32),  # layers ahead
                 PRED_ORDER: np.arange(R, dtype=np.int32),
                 EP_RANK: np.arange(P, dtype=np.int32),
                 SUBEXPERT: np.arange(S, dtype=np.int32),
                 "modality": np.array(MODALITIES)}
        for name, values in index.items():
            specs[name] = dict(shape=values.shape, dtype=values.dtype if name != "modality"
                               else str, dimension_names=[name])
        specs["pinned"] = dict(shape=(L,), dtype="bool", dimension_names=["layer"], fill_value=False,
                               attributes={"description": "layer belongs to the pinned "
                                                          "(always resident) prefix"})
        zarr_files.create_arrays(group, specs)
        for name, values in index.items():
            group[name][:] = values

    cap = {**INITIAL_CAPACITY, **(capacity or {})}
    return zarr_files.layout_template(
        ("run-store", SCHEMA_VERSION, L, E, k, D, R, P, S, tuple(sorted(cap.items()))), build)


def _columns(events: list[StepEvent], L: int, E: int, k: int, D: int = 1, R: int = 1,
             P: int = 1, S: int = 1) -> dict[str, np.ndarray]:
    """Turn a batch of step events into one array per schema variable.

    A pinned layer's event adds its distinct routed experts (``topk_ids`` ≥ 0) to
    ``pinned_accesses`` and nothing to ``hits``/``misses``/``loads``: no cache lookup happened,
    whatever the event's ``hits`` list holds (the runtime fills it with those experts)."""
    n = len(events)
    out: dict[str, np.ndarray] = {}
    out["phase"] = np.array([e.phase for e in events], np.int8)
    out["step_tokens"] = np.array([len(e.token_ids) for e in events], np.int32)
    for name in ("step_start_s", "latency_measured_s", "latency_modeled_s", "stall_measured_s",
                 "stall_modeled_s"):
        out[name] = np.array([getattr(e, name) for e in events], np.float64)
    out["transfer_bytes"] = np.array([e.transfer_bytes for e in events], np.int64)
    out["transfer_bytes_modeled"] = np.array([e.transfer_bytes_modeled for e in events], np.int64)
    out["generated_token"] = np.array([e.generated_token for e in events], np.int64)
    hits, misses, pinned_acc, loads, evictions, pre_ev, pf, host = (np.zeros((n, L), np.int32)
                                                                    for _ in range(8))
    topk_used = np.zeros((n, L), np.int16)
    p_ids = np.full((n, L, R), -1, np.int16)
    p_scores = np.zeros((n, L, R), np.float32)
    stall_layer = np.zeros((n, L), np.float64)
    M = len(MODALITIES)
    routed = np.zeros((n, L, E, M), np.int32)
    dropped = np.zeros((n, L, E, M), np.int32)
    rerouted = np.zeros((n, L, E, M), np.int32)
    weighted: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = []
    chosen: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = []  # MoE-Prism
    resident = np.zeros((n, L, E), bool)
    low = np.zeros((n, L, E), bool)
    rb = {name: np.full((n, L, P), np.nan, np.float32) for name in ("m", "ib", "vision")}
    rb_low = np.zeros((n, L, P), bool)
    rb_gated = np.zeros((n, L), bool)
    tok_ids, tok_step, tok_mod, topk_ids, topk_w, preds, kept = [], [], [], [], [], [], []
    tok_req, sub_ran = [], []
    for i, e in enumerate(events):
        T = len(e.token_ids)
        ids = np.full((T, L, k), -1, np.int16)
        ran = np.zeros((T, L, k, S), bool)  # MoE-Prism: the sub-experts each slot ran
        w = np.zeros((T, L, k), np.float32)
        pred = np.full((T, L, D, k), -1, np.int16)
        for le in e.layers:
            l = le.layer
            if le.pinned:  # served by the resident prefix: no lookup, no hit
                layer_ids = np.asarray(le.topk_ids)
                # MoE-Prism: the runtime lists the layer's keys (sub-experts when it caches
                # them) in ``hits``; else the distinct routed experts
                pinned_acc[i, l] += (len(le.hits) if le.sub_chosen is not None
                                     else np.unique(layer_ids[layer_ids >= 0]).size)
            else:
                hits[i, l] += len(le.hits)
                misses[i, l] += len(le.misses)
                loads[i, l] += len(le.misses) - len(le.host)
                host[i, l] += len(le.host)
            stall_layer[i, l] += le.stall_s
            for key in le.evicted:
                evictions[i, key[0]] += 1
            for key in le.pre_evicted:
                evictions[i, key[0]] += 1
                pre_ev[i, key[0]] += 1
            pf[i, l] += len(le.prefetched)
            for key in le.prefetched:
                loads[i, key[0]] += 1
            kk = le.topk_ids.shape[1]
            topk_used[i, l] = kk
            for src, into in ((le.dropped_ids, dropped), (le.rerouted_ids, rerouted)):
                if src is not None:  # one count per (token, expert it was taken from)
                    d_ids = np.asarray(src, np.int64)
                    tok, slot = np.nonzero(d_ids >= 0)
                    # (a bincount over this layer's [E, modality] cells: np.add.at's counts;
                    # an expert or modality outside them raises, as np.add.at did)
                    cell = np.ravel_multi_index(
                        (d_ids[tok, slot], np.asarray(e.modality, np.int64)[tok]), (E, M))
                    into[i, l] += np.bincount(cell, minlength=E * M).reshape(E, M)
            ids[:, l, :kk] = le.topk_ids
            if le.low_precision:
                low[i, l, le.low_precision] = True
            if le.realb is not None:  # ReaLB's decision at this layer call, per rank
                d = le.realb
                rb_low[i, l, :len(d.low)] = d.low
                rb["m"][i, l, :len(d.m)] = d.m
                rb["ib"][i, l, :len(d.ib)] = d.ib
                rb["vision"][i, l, :len(d.vision)] = d.vision
                rb_gated[i, l] = d.gated
            if le.sub_chosen is not None:  # MoE-Prism: the sub-experts each slot ran
                ch = np.asarray(le.sub_chosen)
                chosen.append((i, l, np.asarray(le.topk_ids), ch,
                               np.asarray(e.modality, np.int64)))
                tok, slot, j = np.nonzero((ch >= 0) & (np.asarray(le.topk_ids)[..., None] >= 0))
                ran[tok, l, slot, ch[tok, slot, j]] = True
            elif S == 1:  # no sub-experts: the expert is its one sub-expert
                ran[:, l, :kk, 0] = np.asarray(le.topk_ids) >= 0
            if le.token_weights is not None:  # MACS: weights of this layer's tokens
                weighted.append((i, l, np.asarray(le.topk_ids), np.asarray(le.token_weights),
                                 np.asarray(e.modality, np.int64)))
            w[:, l, :kk] = le.topk_weights
            if le.pred_ids is not None:
                _, dd, pk = le.pred_ids.shape
                pred[:, l, :min(dd, D), :min(pk, k)] = le.pred_ids[:, :D, :k]
        if e.residency is not None:
            resident[i] = e.residency
        if e.predicted_ids is not None:
            pi = np.asarray(e.predicted_ids, np.int16)[:, :R]
            p_ids[i, :, :pi.shape[1]] = pi
            if e.predicted_scores is not None:
                p_scores[i, :, :pi.shape[1]] = np.asarray(e.predicted_scores, np.float32)[:, :R]
        tok_ids.append(np.asarray(e.token_ids, np.int64))
        tok_step.append(np.full(T, e.step, np.int32))
        tok_mod.append(np.asarray(e.modality, np.int8))
        tok_req.append(np.zeros(T, np.int16) if e.request is None
                       else np.asarray(e.request, np.int16))
        kept.append(np.ones(T, bool) if e.kept is None else np.asarray(e.kept, bool))
        topk_ids.append(ids)
        topk_w.append(w)
        sub_ran.append(ran)
        preds.append(pred)
    # routed_tokens[step, layer, expert, modality]: one count per (token, expert), by bincount
    all_ids = np.concatenate(topk_ids).astype(np.int64)  # [tokens, L, k], -1 = not routed
    n_tok = all_ids.shape[0]
    step_of = np.repeat(np.arange(n), [len(e.token_ids) for e in events])
    mod_of = np.concatenate(tok_mod).astype(np.int64)
    flat = (((step_of[:, None, None] * L + np.arange(L)[None, :, None]) * E + all_ids) * M
            + mod_of[:, None, None])
    valid = all_ids >= 0
    if n_tok:
        routed = np.bincount(flat[valid], minlength=n * L * E * M).astype(np.int32).reshape(
            n, L, E, M)
    effective = routed.astype(np.float32)
    for i, l, lids, tw, mod in weighted:  # replace a weighted layer's counts by its weights
        effective[i, l] = 0
        tok, slot = np.nonzero(lids >= 0)
        np.add.at(effective, (i, l, lids[tok, slot].astype(np.int64), mod[tok]), tw[tok])
    # subexpert_tokens[step, layer, expert, subexpert, modality]: off, every routed token ran
    # the one sub-expert; on, each (token, expert) slot counts once per sub-expert it ran
    sub = np.zeros((n, L, E, S, M), np.int32)
    if S == 1 and not chosen:
        sub[:, :, :, 0] = routed
    if chosen:  # one bincount of every (step, layer, expert, sub-expert, modality) cell
        cells = []  # (np.add.at per layer call was ≈ ½ of this function caching sub-experts)
        for i, l, lids, ch, mod in chosen:
            tok, slot, j = np.nonzero((ch >= 0) & (lids[:, :, None] >= 0))
            at = np.full(tok.shape, i, np.int64), np.full(tok.shape, l, np.int64)
            # (ravel_multi_index refuses an id outside the arrays, as indexing them would)
            cells.append(np.ravel_multi_index(
                (*at, lids[tok, slot].astype(np.int64), ch[tok, slot, j].astype(np.int64),
                 mod[tok]), sub.shape))
        sub += np.bincount(np.concatenate(cells), minlength=sub.size).reshape(
            sub.shape).astype(np.int32)
    out.update(effective_load=effective, low_precision=low, realb_low=rb_low,
               realb_m=rb["m"], realb_ib=rb["ib"], realb_vision=rb["vision"],
               realb_gated=rb_gated, subexpert_tokens=sub)
    out.update(hits=hits, misses=misses, pinned_accesses=pinned_acc, loads=loads,
               evictions=evictions, stall_layer_measured_s=stall_layer, routed_tokens=routed,
               dispatch_dropped=dropped, dispatch_rerouted=rerouted,
               resident=resident, pre_evictions=pre_ev, prefetches=pf, host_runs=host,
               topk_used=topk_used, predicted_ids=p_ids, predicted_scores=p_scores)
    out["token_id"] = np.concatenate(tok_ids)
    out["token_step"] = np.concatenate(tok_step)
    out["token_modality"] = np.concatenate(tok_mod)
    out["token_request"] = np.concatenate(tok_req) if tok_req else np.zeros(0, np.int16)
    out["kept"] = np.concatenate(kept) if kept else np.zeros(0, bool)
    out["topk_ids"] = all_ids.astype(np.int16)
    out["topk_weights"] = np.concatenate(topk_w)
    out["subexpert_ran"] = np.concatenate(sub_ran)
    out["pred_ids"] = np.concatenate(preds)
    # the spans' columns (Span is a named tuple: one transpose, not a pass per field)
    cols = list(zip(*(s for e in events for s in e.spans))) or [()] * len(Span._fields)
    for (name, dtype), col in zip(_SPAN_COLUMNS, cols):
        out[name] = np.array(col, dtype)
    return out


#: the store's span arrays, in :class:`Span`'s field order
_SPAN_COLUMNS = (("span_clock", np.int8), ("span_lane", np.int8), ("span_step", np.int32),
                 ("span_layer", np.int16), ("span_expert", np.int16),
                 ("span_start_s", np.float64), ("span_end_s", np.float64))


# the read side; ``ds.moe`` is registered by workbench.analysis (telemetry never imports it):
# ``workbench.open_run`` / ``workbench.analysis.open_run`` is this function with the accessor
from workbench.telemetry.reader import open_run  # noqa: E402,F401
