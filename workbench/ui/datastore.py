"""``DataStore``: the dashboard's state, testable without a browser.

Holds the workspace (a folder of run stores), the list of runs in it, the run being shown
(an in-memory ``xarray.Dataset`` read with :func:`workbench.open_run`), an optional pinned
baseline run, the view filters and the progress of a run in flight. Views (``views.py``) watch
its parameters; the app (``app.py``) only wires widgets to it.

Invariants
----------
- **Parameters change on the caller's thread only.** A run works in a background thread that
  writes plain Python fields of a :class:`_Job`; :meth:`DataStore.poll` (a periodic callback on
  the Bokeh event loop when served, or called by hand in tests and notebooks) copies them into
  parameters and re-opens the store when its ``committed`` lengths or ``status`` changed.
  The event loop is never blocked by a model run.
- **The store is the only channel from the runtime**: a run streams into its zarr store and the
  plots read the store, so a run of this dashboard and a store written by another process are
  shown the same way (live tail).
- **Names never escape the workspace**: run names are single path components of letters,
  digits, ``.``, ``_``, ``-`` (no ``..``, separators or absolute paths) and the resolved path,
  symlinks followed, must lie directly in the workspace folder.
- **A bad file never takes the page down**: :func:`list_runs` lists every ``*.zarr`` entry of
  the workspace, one that cannot be read (garbage, truncated or tampered ``zarr.json``,
  attributes of the wrong type, a file, a link loop, an odd name) as ``unreadable`` with the
  reason; :meth:`DataStore.open` raises :class:`~workbench.errors.StoreError` with the reason
  (missing or corrupt arrays included, found by :func:`load_run`) and keeps the shown run;
  :meth:`DataStore.poll` never raises. Views draw a placeholder saying why instead of raising.
- **No pickle**: uploaded images are decoded by PIL (PNG/JPEG only, size-limited) and re-encoded
  as PNG into ``<workspace>/uploads``; everything else on disk is zarr/JSON.

- **Replay never runs the model**: the ``replay_*`` parameters and :attr:`DataStore.replay_knobs`
  re-serve the shown run's recorded routing through other cache/prefetch policies
  (:meth:`DataStore.replay_study`, milliseconds; replays already made on a run are reused), and
  only once the run is complete. Every replay is ``workbench.replay_trace`` (as the CLI and the
  notebooks replay), and ``replay_knobs`` start as the shown run's own knobs, read by
  :class:`~workbench.telemetry.metadata.RunMetadata` exactly as ``replay_trace`` reads them: the
  replay of a run at its own policy and size is ``replay_trace(store)``.
- **Only UI state lives here**: loaded models belong to the runtime's
  :class:`~workbench.runtime.pool.ModelPool` (``default_pool()``, shared by every session of the
  process; it also serialises runs of one model), store attributes are read through
  :class:`~workbench.telemetry.metadata.RunMetadata`, and replays through
  :mod:`workbench.replay`.

Units: ``step_range`` is an inclusive pair of step numbers (``None`` = every step); progress
counts generated tokens; times are seconds; ``replay_slots`` is an inclusive pair of cache sizes
in slots (``None`` = every useful size).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generator, Mapping, Sequence

import numpy as np
import param
import xarray as xr

from workbench import jsonio
from workbench.errors import InputError, StoreError, WorkbenchError
from workbench.fileio import file_identity, read_bytes_bounded
from workbench.knobs import Knobs
from workbench.options import get_options
from workbench.policies.eviction import EVICTION
from workbench.replay import SCOPES
from workbench.runtime.pool import ModelPool, default_pool
from workbench.telemetry.metadata import RunMetadata
from workbench.ui.replay import Progress, ReplayStudy, advance, study_steps

log = logging.getLogger(__name__)

#: knob group → {knob: why} for values typed into a knob widget that the knob refused (the
#: widget keeps what was typed and says why beside it; the knob keeps its last good value).
#: A run refuses to start while any knob of its Knobs has an entry (:func:`held_refusals`).
_WIDGET_REFUSALS: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()


def hold_refusal(group: Any, name: str, why: str | None) -> None:
    """Record (``why``: the knob's message) or clear (``None``) the refused value a widget of
    knob ``name`` of ``group`` holds."""
    held = _WIDGET_REFUSALS.setdefault(group, {})
    if why is None:
        held.pop(name, None)
    else:
        held[name] = why


def held_refusals(knobs: Knobs) -> dict[str, str]:
    """``{knob: why}`` for every knob of ``knobs`` whose widget holds a refused value."""
    return {n: w for g in knobs.groups.values() for n, w in _WIDGET_REFUSALS.get(g, {}).items()}

__all__ = ["DataStore", "RunInfo", "ab_deltas", "check_image_upload", "default_workspace",
           "ab_context", "demo_inputs", "known_models", "list_runs", "load_run", "resolve_run_path", "safe_run_name",
           "selected_steps", "upload_limit_text", "MAX_UPLOAD_BYTES", "MAX_UPLOAD_PIXELS",
           "UNREADABLE"]

#: largest accepted upload, in bytes (5 MB: decimal, as the upload widget counts and says it)
MAX_UPLOAD_BYTES = 5_000_000
#: largest accepted upload, in pixels (width × height), against decompression bombs
MAX_UPLOAD_PIXELS = 4096 * 4096
#: seconds without a chunk after which an upload in progress no longer blocks Run
UPLOAD_STALL_S = 30.0
#: image formats accepted from uploads (PIL format names)
UPLOAD_FORMATS = ("PNG", "JPEG")

#: the shown store's zarr.json is re-read at least this often (s), even if its stat looks the same
TAIL_REREAD_S = 1.0
#: failed re-reads of a store being written before it is reported unreadable
TAIL_RETRIES = 10
#: idle time after a progress update of a run in flight, in units of the update's own duration
PROGRESS_REST = 1.0
#: longest answer shown (characters)
MAX_ANSWER_CHARS = 20_000

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MODALITY_CHOICES = ("all", "text", "image")
PHASE_CHOICES = ("all", "prefill", "decode")
CLOCK_CHOICES = ("modeled", "measured")


# -- workspace and names ------------------------------------------------------------------------
def drawn_at_first() -> list[str]:
    """The eviction policies the replay view draws until the user picks: every registered one
    that does not need the future (the ceiling, Belady, is drawn always)."""
    return [p for p in EVICTION.available() if not EVICTION.get(p).needs_future]


def default_workspace() -> Path:
    """``$WORKBENCH_WORKSPACE`` if set, else the ``workspace`` option (``runs/`` under the working
    directory); returned absolute."""
    env = os.environ.get("WORKBENCH_WORKSPACE")
    return Path(env or get_options()["workspace"]).expanduser().absolute()


def safe_run_name(name: str) -> str:
    """``name`` as a store folder name (``.zarr`` appended if missing), or :class:`InputError`.

    Allowed: one path component of letters, digits, ``.``, ``_`` and ``-`` starting with a letter
    or digit, without ``..`` — so no separators, no absolute paths, no parent references.
    """
    if not isinstance(name, str):
        raise InputError(f"run name must be text, not {type(name).__name__}")
    n = name.strip()
    if not n:
        raise InputError("run name is empty")
    if "/" in n or "\\" in n or os.sep in n or (os.altsep and os.altsep in n):
        raise InputError(f"run name must not contain path separators, not {name!r}")
    if ".." in n:
        raise InputError(f"run name must not contain '..', not {name!r}")
    if Path(n).is_absolute() or Path(n).drive:
        raise InputError(f"run name must not be an absolute path, not {name!r}")
    if not _NAME_RE.fullmatch(n):
        raise InputError(
            f"run name may hold only letters, digits, '.', '_' and '-' (at most 100, starting "
            f"with a letter or digit), not {name!r}")
    return n if n.endswith(".zarr") else n + ".zarr"


def resolve_run_path(workspace: str | Path, name: str) -> Path:
    """The store path of run ``name`` inside ``workspace``; :class:`InputError` if it would lie
    anywhere else (symlinks are followed before the check; a symlink loop is refused too)."""
    ws = Path(workspace).resolve()
    p = ws / safe_run_name(name)
    try:
        real = p.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        raise InputError(f"run {name!r} is a symbolic link that loops or cannot be followed"
                         ) from None
    if p.parent != ws or real.parent != ws:
        raise InputError(f"run {name!r} is outside the workspace {str(ws)!r}")
    return p


#: the largest run metadata document (``zarr.json``) read, in bytes (as the store reader)
MAX_META_BYTES = 64 * 1024 * 1024
#: characters of a run's prompt kept in listings and shown above the answer
MAX_PROMPT_CHARS = 1000
#: characters of a name or reason shown in a run's label
_LABEL_CHARS = 70
#: status of a listed store that cannot be read (:attr:`RunInfo.problem` says why)
UNREADABLE = "unreadable"


def _printable(text: str, limit: int = 120) -> str:
    """``text`` safe to show: undecodable bytes and control characters escaped, cut to
    ``limit`` characters."""
    t = text.encode("utf-8", "backslashreplace").decode("utf-8")
    t = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in t)
    return t if len(t) <= limit else t[:limit - 1] + "…"


@dataclass(frozen=True)
class RunInfo:
    """One store of the workspace, as listed (``steps``: committed steps). A store that cannot
    be read is listed with ``status == "unreadable"`` and the reason in ``problem``; a failed or
    interrupted run says why in ``reason`` (it is *abandoned* when it committed no step: there
    is nothing to show). ``stopped``: a complete run that Stop ended early (listed as stopped,
    never as complete)."""

    name: str
    status: str
    steps: int
    created: str
    prompt: str
    problem: str = ""
    reason: str = ""
    stopped: bool = False

    @property
    def abandoned(self) -> bool:
        return self.readable and self.steps == 0 and self.status in ("failed", "interrupted")

    @property
    def readable(self) -> bool:
        return not self.problem

    @property
    def label(self) -> str:
        short = self.name[:-5] if self.name.endswith(".zarr") else self.name
        if self.problem:
            return f"{_printable(short, 40)} · {UNREADABLE}: " \
                   f"{_printable(self.problem, _LABEL_CHARS)}"
        why = f": {_printable(self.reason, _LABEL_CHARS)}" if self.reason else ""
        if self.abandoned:
            return f"{short} · abandoned ({self.status}{why})"
        status = "stopped" if self.stopped and self.status == "complete" else self.status
        return f"{short} · {status}{why} · {self.steps} steps"


def _read_attrs(path: Path) -> dict[str, Any]:
    """The group attributes of a store, from its ``zarr.json``. :class:`StoreError` (with the
    reason) when the document is missing, not a regular file, too large, unreadable, not JSON,
    not an object or has no attribute object (read by
    :func:`workbench.fileio.read_bytes_bounded`: a FIFO there never blocks the dashboard)."""
    raw = read_bytes_bounded(path / "zarr.json", MAX_META_BYTES, "its zarr.json", StoreError)
    try:
        doc = jsonio.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise StoreError(f"its zarr.json is not valid JSON ({type(e).__name__}: "
                         f"{str(e)[:80]})") from None
    if not isinstance(doc, dict):
        raise StoreError(f"its zarr.json is not a JSON object (it is a {type(doc).__name__})")
    attrs = doc.get("attributes", {})
    if not isinstance(attrs, dict):
        raise StoreError(f"its zarr.json attributes are a {type(attrs).__name__}, not an object")
    return attrs


def _check_attrs(path: Path, attrs: dict[str, Any]) -> tuple[str, dict[str, int]]:
    """``(status, committed)`` of a store's attributes, or :class:`StoreError` saying which
    attribute is wrong (the cheap check of a listing; :func:`load_run` checks the arrays). The
    reader's own checks: a killed writer's store is ``interrupted`` here too."""
    from workbench.telemetry.reader import committed_extent, run_status, schema_version

    try:
        schema_version(path, attrs)
        return run_status(path, attrs), committed_extent(path, attrs)
    except StoreError as e:  # the listing names the run already: no server path in the page
        raise StoreError(str(e).split("': ", 1)[-1]) from None


def _meta_key(path: Path) -> tuple[int, int, int]:
    """Identity of a store's current ``zarr.json`` (the writer replaces it atomically)."""
    return file_identity(path / "zarr.json")


def _os_reason(e: OSError) -> str:
    return f"{e.strerror or type(e).__name__}" + (f" ({type(e).__name__})" if e.strerror else "")


#: stores by path: (key of their zarr.json, repeat_key, measured metrics) for DataStore.repeats
_REPEATS: dict[Path, tuple[Any, Any, dict[str, float]]] = {}
#: finished runs' routing shared by the sessions of the process, oldest first:
#: (path, (committed, status), key of the zarr.json) → (trace, the replays made on it)
_SHARED_TRACES: dict[tuple, tuple[Any, dict]] = {}
#: stores whose routing is kept there
SHARED_TRACES = 4
#: listed stores by path (the workspace resolved): (key of their zarr.json, RunInfo); a store
#: that failed to open keeps its reason here until its zarr.json changes
_LIST_CACHE: dict[Path, tuple[Any, RunInfo]] = {}


def _inspect(real_ws: Path, p: Path) -> RunInfo | None:
    """The listing of entry ``p`` of the workspace: None if it is not meant as a run (hidden,
    not ``*.zarr``), a RunInfo otherwise — unreadable with the reason if it cannot be read.
    Never raises."""
    name = p.name
    if name.startswith(".") or not name.endswith(".zarr"):
        return None  # hidden: a writer's staging/lock siblings, or not a store

    def bad(reason: str) -> RunInfo:
        return RunInfo(name=_printable(name), status=UNREADABLE, steps=0, created="", prompt="",
                       problem=reason)

    if not _NAME_RE.fullmatch(name):
        return bad("its name is not a run name (letters, digits, '.', '_' and '-', at most 100, "
                   "starting with a letter or digit); rename the folder to open it")
    try:
        if p.is_symlink():
            try:
                real = p.resolve(strict=True)
            except (OSError, RuntimeError):
                return bad("it is a symbolic link that loops or points nowhere")
            if real.parent != real_ws:
                return bad("it is a symbolic link to a folder outside the workspace")
        if not p.is_dir():
            return bad("it is a file, not a run store folder")
        try:
            key = _meta_key(p)
        except FileNotFoundError:
            return bad("it has no zarr.json: not a run store (or its writer was killed before "
                       "it published anything)")
        hit = _LIST_CACHE.get(real_ws / name)
        if hit is not None and hit[0] == key:
            return hit[1]
        attrs = _read_attrs(p)
        status, committed = _check_attrs(p, attrs)
        prompt = attrs.get("prompt", "")
        info = RunInfo(name=name, status=status, steps=committed["step"],
                       created=_printable(str(attrs.get("created", "")), 40),
                       prompt=str(prompt)[:MAX_PROMPT_CHARS], reason=_end_reason(status, attrs),
                       stopped=status == "complete" and _was_stopped(attrs))
    except StoreError as e:
        info = bad(str(e))
    except OSError as e:
        return bad(f"it cannot be read: {_os_reason(e)}")
    except Exception as e:  # anything else: listed as unreadable, never raised
        log.warning("listing %s failed: %s", p, traceback.format_exc())
        return bad(f"{type(e).__name__}: {str(e)[:120]}")
    _LIST_CACHE[real_ws / name] = (key, info)
    return info


def _end_reason(status: str, attrs: dict[str, Any]) -> str:
    """Why a run ended without completing ('' for a complete or running one): the error its
    writer recorded, or that the writer is gone."""
    if status == "interrupted":
        return "its writer process ended before the run finished"
    if status == "failed":
        error = attrs.get("error")
        return _printable(error, 200) if isinstance(error, str) and error else "no error recorded"
    return ""


def _was_stopped(attrs: dict[str, Any]) -> bool:
    """Whether a complete run's summary says Stop ended it (read leniently: False when odd)."""
    try:
        summary = RunMetadata.from_attrs(attrs, strict=False).summary or {}
    except Exception:
        return False
    return summary.get("stopped") is True


def _mark_unreadable(path: Path, reason: str) -> None:
    """List the store at ``path`` as unreadable with ``reason`` until its zarr.json changes
    (a store whose arrays fail to open lists fine from its metadata alone)."""
    try:
        key = _meta_key(path)
    except OSError:
        return
    _LIST_CACHE[path] = (key, RunInfo(name=path.name, status=UNREADABLE, steps=0, created="",
                                      prompt="", problem=reason))


def list_runs(workspace: str | Path) -> list[RunInfo]:
    """Run stores directly in ``workspace`` (entries ``*.zarr``), newest first, then the ones
    that cannot be read (``status == "unreadable"``, the reason in ``problem``: a garbage or
    tampered ``zarr.json``, a file or a link loop named ``*.zarr``, a name that is not a run
    name, …). A store being written is listed with ``status == "running"``. Hidden entries are
    skipped. Never raises for a bad entry; :class:`InputError` if the workspace itself is a
    folder that cannot be listed."""
    ws = Path(workspace)
    if not ws.is_dir():
        return []
    try:
        entries = list(ws.iterdir())
        real_ws = ws.resolve()
    except (OSError, RuntimeError) as e:
        raise InputError(f"the workspace {str(ws)!r} cannot be listed: "
                         f"{_os_reason(e) if isinstance(e, OSError) else e}") from None
    out = [info for p in entries if (info := _inspect(real_ws, p)) is not None]
    present = {real_ws / p.name for p in entries}
    for p in [p for p in _LIST_CACHE if p.parent == real_ws and p not in present]:
        _LIST_CACHE.pop(p, None)  # removed since: forget it
    good = sorted((r for r in out if r.readable),
                  key=lambda r: (r.created, _birth(ws / r.name), r.name), reverse=True)
    return good + sorted((r for r in out if not r.readable), key=lambda r: r.name)


def known_models(workspace: str | Path, runs: Sequence[RunInfo] | None = None) -> list[str]:
    """Checkpoint folders the workspace knows: the ``model_path`` of its readable runs, newest
    first, each once, and only folders that still hold a ``config.json`` (the embedded default
    is not listed: it is the menu's first entry). Never raises for a bad store."""
    ws = Path(workspace)
    out: list[str] = []
    for info in (list_runs(ws) if runs is None else runs):
        if not info.readable:
            continue
        try:
            path = _read_attrs(ws / info.name).get("model_path")
        except (OSError, WorkbenchError):
            continue
        if isinstance(path, str) and path not in out and len(path) < 4096 and "\0" not in path:
            try:
                if (Path(path) / "config.json").is_file():
                    out.append(path)
            except (OSError, ValueError):
                continue
    return out


def _birth(path: Path) -> int:
    """Creation order of stores created within the same second: the ``layer`` coordinate's
    metadata is written once, when the store is created."""
    try:
        return (path / "layer" / "zarr.json").stat().st_mtime_ns
    except OSError:
        return 0


def _auto_name(workspace: Path) -> str:
    from workbench.telemetry.destination import new_run_name

    return new_run_name(workspace)


# -- inputs -------------------------------------------------------------------------------------
def demo_inputs(folder: str | Path | None = None) -> list[dict[str, Any]]:
    """The demo menu: :func:`~workbench.models.embedded.demo.read_demo` (the checked entries of
    ``prompts.json``: ``image`` an absolute path or None for a text-only request, ``prompt``,
    the expected ``answer``, ``kind``) with a printable ``label`` each; empty when the folder or
    file is missing or unreadable."""
    from workbench.models.embedded.demo import read_demo

    return [{"label": _printable(f"{Path(it['image']).stem if it['image'] else 'text only'} — {it['prompt']}",
                                 100), **it} for it in read_demo(folder)]


def upload_limit_text(max_bytes: int = MAX_UPLOAD_BYTES) -> str:
    """The upload limit in words (``"5 MB"``; decimal megabytes, as the upload widget says)."""
    return f"{max_bytes / 1e6:g} MB"


def check_image_upload(data: bytes | None, filename: str | None = None,
                       max_bytes: int = MAX_UPLOAD_BYTES):
    """Decode an uploaded image; PNG or JPEG only, at most ``max_bytes`` bytes and
    :data:`MAX_UPLOAD_PIXELS` pixels. Returns an RGB ``PIL.Image``; anything else raises
    :class:`InputError` with a message for the user. The file name is only used in messages:
    the type is decided by decoding, never by the extension."""
    from PIL import Image, UnidentifiedImageError

    label = _printable(repr(filename), 80) if filename else "the upload"
    if not data:
        raise InputError(f"{label} is empty")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InputError(f"{label} is {type(data).__name__}, not the bytes of an image")
    data = bytes(data)
    if len(data) > max_bytes:
        raise InputError(f"{label} is {len(data) / 1e6:.1f} MB; images up to "
                         f"{upload_limit_text(max_bytes)} are accepted")
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format
            if fmt not in UPLOAD_FORMATS:
                raise InputError(f"{label} is {fmt or 'not an image'}; only PNG and JPEG images "
                                 f"are accepted")
            w, h = im.size
            if w * h > MAX_UPLOAD_PIXELS:
                raise InputError(f"{label} is {w}×{h} pixels; at most {MAX_UPLOAD_PIXELS:,} "
                                 f"pixels are accepted")
            im.load()
            return im.convert("RGB")
    except InputError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise InputError(f"{label} is not a readable PNG or JPEG image "
                         f"({type(e).__name__})") from None


# -- selections and A/B -------------------------------------------------------------------------
def selected_steps(ds: xr.Dataset, step_range: tuple[int, int] | None = None,
                   phase: str = "all") -> np.ndarray:
    """Step numbers of ``ds`` inside ``step_range`` (inclusive; ``None`` = all) and ``phase``
    (``"all"``, ``"prefill"`` or ``"decode"``), ascending."""
    steps = np.asarray(ds["step"].values)
    keep = np.ones(steps.shape, bool)
    if step_range is not None:
        lo, hi = step_range
        keep &= (steps >= lo) & (steps <= hi)
    if phase not in (None, "all"):
        names = list(ds.attrs.get("phase_names", ("prefill", "decode")))
        if phase not in names:
            raise InputError(f"phase must be 'all' or one of {', '.join(names)}, not {phase!r}")
        keep &= np.asarray(ds["phase"].values) == names.index(phase)
    return steps[keep]


#: (key of ``ds.moe.summary()``, label, units) of the A/B table, in display order
AB_METRICS: tuple[tuple[str, str, str], ...] = (
    ("hit_rate", "hit rate (offloaded layers)", "fraction"),
    ("hits", "cache hits", "experts"),
    ("misses", "cache misses", "experts"),
    ("loads", "expert loads", "experts"),
    ("evictions", "evictions", "experts"),
    ("host_runs", "misses run on the host (hybrid)", "experts"),
    ("latency_measured_s", "latency, measured", "s"),
    ("latency_modeled_s", "latency, modeled", "s"),
    ("stall_measured_s", "stall, measured", "s"),
    ("stall_modeled_s", "stall, modeled", "s"),
    ("transfer_bytes_measured", "bytes moved, measured", "bytes"),
    ("transfer_bytes_modeled", "bytes moved, modeled", "bytes"),
    ("steps", "steps", "steps"),
)


def ab_deltas(current: xr.Dataset, baseline: xr.Dataset,
              repeats: Mapping[str, Mapping[str, Sequence[float]]] | None = None
              ) -> list[dict[str, Any]]:
    """Whole-run headline numbers of ``current`` vs ``baseline`` (``ds.moe.summary()``).

    One row per :data:`AB_METRICS` entry: ``metric``, ``label``, ``units``, ``current``,
    ``baseline``, ``delta`` = current − baseline and ``relative`` = delta / baseline (``nan``
    when the baseline is 0 or a value is nan).

    ``repeats`` (``{"current": {metric: values}, "baseline": {...}}``, each run's repeats in
    the workspace, itself included; :meth:`DataStore.repeats`): a measured metric
    (:data:`MEASURED_METRICS`) then compares the medians, and its row carries
    ``current_spread`` / ``baseline_spread`` (:func:`spread`) and ``noise``: True when the two
    ranges overlap or either side is a single run (the delta is within what a repeat changes,
    or nobody knows how much that is).
    """
    a, b = current.moe.summary(), baseline.moe.summary()
    rows = []
    for key, label, units in AB_METRICS:
        cur, base = float(a[key]), float(b[key])
        row: dict[str, Any] = {"metric": key, "label": label, "units": units}
        if repeats is not None and key in MEASURED_METRICS:
            sc = spread(repeats.get("current", {}).get(key, [cur]))
            sb = spread(repeats.get("baseline", {}).get(key, [base]))
            if sc["n"] and sb["n"]:
                cur, base = sc["median"], sb["median"]
                row.update(current_spread=sc, baseline_spread=sb,
                           noise=min(sc["n"], sb["n"]) < 2 or
                           (sc["min"] <= sb["max"] and sb["min"] <= sc["max"]))
        delta = cur - base
        rel = delta / base if base and np.isfinite(base) and np.isfinite(cur) else float("nan")
        row.update(current=cur, baseline=base, delta=delta, relative=rel)
        rows.append(row)
    return rows


#: knobs that never change what a run measures (where it is written, how often it flushes)
_AB_IGNORED_KNOBS = frozenset({"store", "flush_every"})
#: A/B metrics measured on this machine (wall clock): they vary from one repeat to the next,
#: so the A/B table gives them as the median and range over the workspace's repeats
MEASURED_METRICS = ("latency_measured_s", "stall_measured_s")


def repeat_key(attrs: Mapping[str, Any]) -> tuple | None:
    """What makes two runs repeats of each other: the same model (config hash), request
    (prompt, images) and every knob (but :data:`_AB_IGNORED_KNOBS`). None when a part is not
    recorded (such a run is nobody's repeat)."""
    from workbench.telemetry.metadata import RunMetadata

    m = RunMetadata.from_attrs(attrs, strict=False)
    if m.config_hash is None or m.knob_values is None or m.prompt is None:
        return None
    knobs = tuple(sorted((k, json.dumps(v, sort_keys=True, default=str))
                         for k, v in m.knob_values.items() if k not in _AB_IGNORED_KNOBS))
    return m.config_hash, m.prompt, tuple(m.images or ()), knobs


def spread(values: Sequence[float]) -> dict[str, float]:
    """``median``, ``min``, ``max`` and ``n`` of the finite ``values`` (nan and n = 0 if none)."""
    v = np.asarray([x for x in values if np.isfinite(x)], float)
    if v.size == 0:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
            "n": int(v.size)}


def ab_context(current: xr.Dataset, baseline: xr.Dataset) -> dict[str, Any]:
    """What an A/B comparison compares: ``differing`` = ``[(knob, current, baseline)]`` for every
    recorded knob whose value differs, and ``warnings`` = sentences for differences that make
    the deltas compare different things (another model, another request, modeled times priced
    as another model or on another hardware profile). Unreadable attrs count as unknown."""
    from workbench.telemetry.metadata import RunMetadata

    a, b = (RunMetadata.from_attrs(d.attrs, strict=False) for d in (current, baseline))
    ka, kb = dict(a.knob_values or {}), dict(b.knob_values or {})
    differing = [(k, ka.get(k), kb.get(k)) for k in sorted(set(ka) | set(kb))
                 if k not in _AB_IGNORED_KNOBS and ka.get(k) != kb.get(k)]
    warnings = []
    if a.config_hash != b.config_hash:
        warnings.append(f"different models ({a.model_id} vs {b.model_id}): every number compares "
                        f"two models, not two settings")
    if ka.get("target_model") != kb.get("target_model"):
        warnings.append(f"modeled times are priced as different models (target_model "
                        f"{ka.get('target_model')} vs {kb.get('target_model')}): compare modeled "
                        f"latency only between runs priced alike")
    if ka.get("profile") != kb.get("profile"):
        warnings.append(f"different hardware profiles ({ka.get('profile')} vs {kb.get('profile')}): "
                        f"modeled times are for different machines")
    if (a.prompt, a.images) != (b.prompt, b.images):
        warnings.append("different requests (prompt or image): loads and latency count different work")
    return {"differing": differing, "warnings": warnings}


def share_difference(current: xr.Dataset, baseline: xr.Dataset, modality: str = "all",
                     step_range: tuple[int, int] | None = None, phase: str = "all"
                     ) -> xr.DataArray:
    """[layer, expert] difference of routed-token shares, current − baseline, in [-1, 1].

    Each run's counts (same modality / step range / phase filters) are normalised per layer
    (rows sum to 1, an empty layer counts 0). Runs of different model layouts raise
    :class:`InputError`.
    """
    if (current.sizes["layer"], current.sizes["expert"]) != (baseline.sizes["layer"],
                                                             baseline.sizes["expert"]):
        raise InputError(
            f"the runs have different layouts ({current.sizes['layer']}×"
            f"{current.sizes['expert']} vs {baseline.sizes['layer']}×"
            f"{baseline.sizes['expert']} layers × experts); the heatmaps cannot be subtracted")

    def share(ds: xr.Dataset) -> np.ndarray:
        steps = [int(s) for s in selected_steps(ds, step_range, phase)]
        c = np.asarray(ds.moe.expert_counts(modality, steps=steps).values, float)
        tot = c.sum(axis=1, keepdims=True)
        return np.divide(c, tot, out=np.zeros_like(c), where=tot > 0)

    d = share(current) - share(baseline)
    return xr.DataArray(d, dims=("layer", "expert"),
                        coords={"layer": current["layer"].values,
                                "expert": current["expert"].values},
                        name="share_difference",
                        attrs={"units": "Δ share (current − baseline)", "modality": modality})


#: per-token variables no view uses: left on disk (``open_run`` has them). ``token_modality``
#: and ``kept`` (one byte a token) are loaded: the visual-token overlay needs them
_NOT_LOADED = ("topk_ids", "topk_weights", "token_id", "token_step", "subexpert_ran")


#: name lists a store's attrs carry, with the names the views look up in them
_NAME_ATTRS = {"phase_names": ("prefill", "decode"), "lane_names": ("compute", "transfer", "stall"),
               "clock_names": ("measured", "modeled")}


def _check_loaded(ds: xr.Dataset) -> None:
    """What the views index with, checked once: the attrs' name lists (a list of distinct texts
    holding the names the views use) and the phase codes (each names a phase)."""
    for key, needed in _NAME_ATTRS.items():
        names = ds.attrs.get(key, list(needed))
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) \
                or len(set(names)) != len(names) or not set(needed) <= set(names):
            raise StoreError(f"its attribute {key!r} is {_printable(repr(names), 60)}; expected "
                             f"a list of names holding {', '.join(needed)}")
    if "phase" in ds:
        codes = np.asarray(ds["phase"].values)
        n = len(ds.attrs.get("phase_names", _NAME_ATTRS["phase_names"]))
        if codes.size and (codes.min() < 0 or codes.max() >= n):
            raise StoreError(f"its phase codes run {int(codes.min())}…{int(codes.max())}; "
                             f"{n} phases are named")


def load_run(path: str | Path) -> xr.Dataset:
    """``open_run(path)`` read into memory, without the per-token routing variables
    (:data:`_NOT_LOADED`), which no view uses and which dominate a long prefill: the views
    compute from it many times, and a live run is re-read at every commit.

    The run's headline numbers are computed once as a check (``ds.moe.summary()``): a store
    the views could not draw raises here. Every failure is a :class:`StoreError` (a
    :class:`WorkbenchError`) saying what is wrong."""
    from workbench.analysis import open_run  # ds.moe registered

    try:
        full = open_run(path)
        try:
            ds = full.drop_vars([v for v in _NOT_LOADED if v in full.variables]).load()
        finally:
            full.close()
        _check_loaded(ds)
        ds.moe.summary()
    except WorkbenchError as e:  # the reader names the store; the dashboard names the run
        msg = str(e)
        for prefix in (f"run store {str(path)!r}: ", f"run store {str(Path(path))!r}: "):
            msg = msg[len(prefix):] if msg.startswith(prefix) else msg
        raise StoreError(msg) from None
    except Exception as e:  # a codec, a shape, a missing variable …: the store is corrupt
        log.info("run store %s is unreadable:\n%s", path, traceback.format_exc())
        raise StoreError(f"{type(e).__name__}: {str(e)[:200]}") from None
    return ds


def _policies_of(meta: RunMetadata) -> str:
    """The cache policies a run was recorded with, in words (from its knobs; ``?`` where they
    cannot be read)."""
    def knob(name: str) -> Any:
        v = meta.knob(name, "?")
        return v if isinstance(v, (str, bool, int, float, type(None))) else "?"

    words = [_printable(str(knob("eviction") or "?"), 40)]
    if knob("prefetch") not in (None, "none", "?"):
        words.append(f"{_printable(str(knob('prefetch')), 40)} prefetch")
    if knob("active_evict") is True:
        words.append("ActiveEvict")
    if knob("dynamic_topk") is True:
        words.append("dynamic top-k")
    return " + ".join(words)


@dataclass
class _Job:
    """What the run thread reports; plain fields written by that thread only, read by poll."""

    path: Path
    max_new_tokens: int
    stop: threading.Event = field(default_factory=threading.Event)
    phase: str = "queued"  # queued | loading | waiting | running | done
    text: str = ""
    tokens: int = 0
    done: bool = False
    error: str = ""
    #: the run's result, set when generation has ended: from then on only the store's final
    #: write (every array flushed, the summary written) is left, until ``done``
    result: Any = None
    thread: threading.Thread | None = None
    #: tokens generated when Stop reached this process (None: not stopped); the run ends
    #: after at most one more token, which the status line shows
    stop_token: int | None = None
    #: the end was shown (buttons, status); the first poll once ``done`` reads the store's
    #: last steps
    reported: bool = False
    #: the status line of the end, without the note that the store is still being written
    end_status: str = ""
    #: the store is written; its last steps are being read (the views all draw them)
    final: bool = False
    #: the run shown when this one started: (path, sig, meta, run name, dataset); shown again
    #: when this one fails before its store exists (a refusal the run found, not _precheck)
    previous: tuple | None = None


class DataStore(param.Parameterized):
    """State of one dashboard session (see the module docstring for the invariants)."""

    workspace = param.String(default="", doc="Folder of run stores (absolute).")
    model = param.String(default=None, allow_None=True,
                         doc="Checkpoint folder; None = the embedded default model.")
    runs = param.List(default=[], item_type=RunInfo, doc="Runs in the workspace, newest first.")
    run_name = param.String(default=None, allow_None=True, doc="Store shown (in the workspace).")
    dataset = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                  doc="The shown run, in memory (cut to its committed steps; "
                                      "per-token routing left on disk, see load_run).")
    baseline = param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True,
                                   doc="The pinned A/B baseline run.")
    baseline_name = param.String(default=None, allow_None=True)

    # view filters: changing them redraws views, never re-runs the model
    modality = param.Selector(default="all", objects=list(MODALITY_CHOICES),
                              doc="Tokens counted in the heatmaps.")
    step_range = param.Range(default=None, allow_None=True,
                             doc="Inclusive (first, last) step shown; None = every step.")
    phase = param.Selector(default="all", objects=list(PHASE_CHOICES),
                           doc="Steps shown: prefill, decode or both.")
    clock = param.Selector(default="modeled", objects=list(CLOCK_CHOICES),
                           doc="Clock of the timeline: measured here, or modeled on the profile.")

    # request
    prompt = param.String(default="", doc="Question or instruction.")
    image = param.String(default=None, allow_None=True, doc="Input image file (None: text only).")
    batch_size = param.Integer(
        default=1, bounds=(1, 64),
        doc="Requests run together: this request and batch_size − 1 generated held-out "
            "requests (expert-parallel load needs a batch; the answer shown is this request's).")
    batch_mix = param.Selector(
        default="mixed", objects=["mixed", "image", "text"],
        doc="The generated requests of a batch: the held-out split's mix of image and "
            "text-only requests, image requests only, or text-only only.")

    # progress of the run in flight (or the tail of a store written elsewhere)
    running = param.Boolean(default=False, doc="A run of this session is in flight.")
    progress = param.Integer(default=0, bounds=(0, None), doc="Tokens generated so far.")
    progress_max = param.Integer(default=1, bounds=(1, None), doc="max_new_tokens of the run.")
    answer = param.String(default="", doc="Generated text so far.")
    expected = param.String(default="", doc="Expected answer of the demo request in the inputs ('' when "
                                            "the request is not a demo's: edited, uploaded or typed).")
    status = param.String(default="", doc="One line on what is shown / happening.")
    error = param.String(default="", doc="Last error for the user ('' = none).")

    # replay of the shown run's recorded routing under other policies: changing these (or a
    # knob of ``replay_knobs``) replays the trace (milliseconds), never re-runs the model.
    # The menu comes from the registry.
    replay_evictions = param.ListSelector(
        default=EVICTION.available(), objects=EVICTION.available(),
        doc="Eviction policies drawn (Belady, the offline optimum, is always drawn: the "
            "ceiling). At first: every policy that does not need the future.")
    replay_scope = param.Selector(default="global", objects=list(SCOPES),
                                  doc="One pool of slots for every offloaded layer, or an "
                                      "equal share per layer.")
    replay_slots = param.Range(default=None, allow_None=True,
                               doc="Inclusive (smallest, largest) cache size drawn, in slots; "
                                   "None = every useful size of the run.")
    replay_at = param.Integer(default=None, allow_None=True, bounds=(1, None),
                              doc="Cache size of the metrics table; None = the run's own "
                                  "(moved into the range drawn).")
    replay_revision = param.Integer(default=0, bounds=(0, None),
                                    doc="Counts changes of ``replay_knobs`` made after the "
                                        "shown run's own were taken (the replay view watches "
                                        "it).")

    def __init__(self, workspace: str | Path | None = None, model: str | Path | None = None,
                 knobs: Knobs | None = None, refresh_s: float = 2.0,
                 pool: ModelPool | None = None, **params: Any) -> None:
        ws = Path(workspace).expanduser().absolute() if workspace is not None \
            else default_workspace()
        replay = {k: params.pop(k) for k in list(params) if k.startswith("replay_")}
        super().__init__(workspace=str(ws), model=None if model is None else str(model),
                         **params)
        # the menu offers every policy registered by now (as the knob classes do); drawn at
        # first: the online ones (the ceiling is always drawn). The other oracles
        # (belady-horizon) are a question one asks, and have no compiled replay.
        self.param["replay_evictions"].objects = EVICTION.available()
        self.param.update(**{"replay_evictions": drawn_at_first(), **replay})
        self.knobs = knobs if knobs is not None else Knobs()
        #: models shared with every session of this process (the runtime's pool)
        self.pool: ModelPool = pool if pool is not None else default_pool()
        #: knobs of the replay view: the shown run's own (``RunMetadata.knobs``, the ones
        #: ``workbench.replay_trace`` recovers), as the replay widgets change them
        self.replay_knobs = Knobs()
        self._replay_for: Path | None = None  # the run whose knobs replay_knobs were set from
        self._replay_problem = ""  # why that run's knobs cannot be read ('' = they can)
        self._syncing_replay = False
        for group in self.replay_knobs.groups.values():
            group.param.watch(self._replay_knob_changed, group.knob_names())
        self.param.watch(self._sync_replay_knobs, "dataset")
        self.refresh_s = refresh_s
        self._job: _Job | None = None
        self._path: Path | None = None  # store being shown
        self._sig: tuple | None = None  # (committed, status) of the loaded dataset
        self._meta: tuple | None = None  # _meta_key of the shown store's zarr.json, last read
        self._last_read = 0.0  # when it was last read (time.monotonic)
        self._tail_fails = 0  # consecutive failed re-reads of a store being written
        self._tail_problem = ""  # message shown for the shown store turning unreadable
        self._failed: tuple | None = None  # _meta_key at which its arrays last failed to load
        self._last_refresh = 0.0
        self._trace: Any = None  # routing of the shown run, for replay
        self._trace_key: tuple | None = None
        self._replay_memo: dict = {}  # replays already made on that trace
        self._uploading: tuple[str, float] | None = None  # (name, last chunk's monotonic time)
        self._upload_ended: tuple[str, float] | None = None  # (name, when it was had whole)
        self._refused = ""  # the message of the last Run refused before it started
        self._refused_prompt: str | None = None  # and the prompt it was given
        self._progress_rest = 0.0  # time.monotonic() before which progress is not updated
        #: called from the run's thread when it has news for :meth:`poll` (its end); must be
        #: thread-safe. The app sets it to schedule a poll on the session's event loop at once
        #: instead of at the next period (None: the periodic poll only)
        self.wake: Any = None
        self.refresh()

    # -- workspace ---------------------------------------------------------------------------
    @property
    def workspace_path(self) -> Path:
        return Path(self.workspace)

    def refresh(self) -> list[RunInfo]:
        """Re-list the workspace's runs (a workspace that cannot be listed sets :attr:`error`
        and lists nothing)."""
        try:
            runs = list_runs(self.workspace_path)
        except WorkbenchError as e:
            runs = []
            if self.error != str(e):
                self.error = str(e)
        if runs != self.runs:
            self.runs = runs
        self._last_refresh = time.monotonic()
        return runs

    def open(self, name: str) -> xr.Dataset | None:
        """Show run ``name`` of the workspace; a store still being written is tailed by
        :meth:`poll`. Returns the dataset (None if nothing is committed yet).

        A name that is not a run of the workspace raises :class:`InputError`; a store that
        cannot be read (tampered metadata, missing or corrupt arrays, …) raises
        :class:`StoreError` with the reason and is listed as unreadable. Either way the run
        shown before stays shown."""
        listed = next((r for r in self.runs if r.name == name and not r.readable), None)
        try:
            path = resolve_run_path(self.workspace_path, name)
        except InputError:
            if listed is not None:
                raise StoreError(f"run {listed.name!r} is unreadable: {listed.problem}") from None
            raise
        if not path.is_dir() or not (path / "zarr.json").is_file():
            if listed is not None:
                raise StoreError(f"run {listed.name!r} is unreadable: {listed.problem}")
            raise InputError(f"run {name!r} is not a store in the workspace "
                             f"{str(self.workspace_path)!r}")
        try:
            key = _meta_key(path)
            attrs = _read_attrs(path)
            status, committed = _check_attrs(path, attrs)
            ds = self._load(path, status) if committed["step"] > 0 else None
            if ds is None and status in ("failed", "interrupted"):  # abandoned: nothing to show
                raise InputError(f"run {path.name!r} was abandoned ({status}: "
                                 f"{_end_reason(status, attrs)}) before it committed a step: "
                                 f"there is nothing to show; the run shown stays")
        except (StoreError, OSError) as e:
            reason = str(e) if isinstance(e, StoreError) else f"it cannot be read: {_os_reason(e)}"
            _mark_unreadable(path, reason)
            self.refresh()
            raise StoreError(f"run {path.name!r} is unreadable: {reason}") from None
        if _LIST_CACHE.get(path, (None, None))[1] is not None and \
                not _LIST_CACHE[path][1].readable:
            _LIST_CACHE.pop(path, None)  # readable again: list it as it is
            self.refresh()
        self._path, self._meta, self._last_read = path, key, time.monotonic()
        self._sig = (tuple(sorted(committed.items())), status) if ds is not None else None
        self._tail_fails, self._tail_problem, self._failed = 0, "", None
        self._replay_for = None  # opening a run shows its replay as recorded
        upd: dict[str, Any] = {"run_name": path.name, "step_range": None, "error": "",
                               "dataset": ds}
        if self._job is None:  # the progress bar belongs to a run in flight, if any
            if ds is not None:
                upd.update(self._progress_of(path, ds, status), answer=self._answer_of(ds))
            else:
                meta = RunMetadata.from_attrs(attrs, strict=False)
                upd.update(progress=0, progress_max=meta.max_new_tokens or 1, answer="",
                           status=f"{path.name}: {status}, no step committed yet")
        self.param.update(**upd)
        return ds

    @staticmethod
    def _load(path: Path, status: str) -> xr.Dataset:
        """:func:`load_run`, tried again shortly for a store being written (a writer between
        two files of one update)."""
        tries = 3 if status == "running" else 1
        for i in range(tries):
            try:
                return load_run(path)
            except StoreError:
                if i == tries - 1:
                    raise
                time.sleep(0.1)
        raise AssertionError("unreachable")

    @staticmethod
    def _progress_of(path: Path, ds: xr.Dataset, status: str) -> dict[str, Any]:
        """Progress parameters of a stored run: ``max_new_tokens`` of its knobs, rescaled to
        its step count when it has more steps (or no usable knob)."""
        n = int(ds.sizes.get("step", 0))
        m = max(RunMetadata.from_attrs(ds.attrs, strict=False).max_new_tokens or 1, n, 1)
        st = ds.attrs.get("status", status)
        st = st if isinstance(st, str) else status
        running = st == "running"
        return {"progress_max": m, "progress": min(n, m) if running else m,
                "status": f"{path.name}: live tail, {n} steps committed" if running
                else f"{path.name}: {_printable(st, 40)}, {n} steps"}

    @staticmethod
    def _answer_of(ds: xr.Dataset) -> str:
        """Decoded answer of a stored run (from its summary, else blank)."""
        # (a batch's other answers: batch_answers)
        text = RunMetadata.from_attrs(ds.attrs, strict=False).text or ""
        return text[:MAX_ANSWER_CHARS]

    @staticmethod
    def batch_answers(ds: xr.Dataset | None) -> list[dict[str, Any]]:
        """A stored batch run's requests and answers, in batch order (``prompt``, ``images``,
        ``text``, ``expected`` where known); [] for a run of one request, one not complete, or
        an odd store (read leniently: the page never fails on it)."""
        if ds is None:
            return []
        try:
            summary = RunMetadata.from_attrs(ds.attrs, strict=False).summary or {}
        except Exception:
            return []
        rows = summary.get("batch")
        if not isinstance(rows, list):
            return []
        return [r for r in rows if isinstance(r, dict) and isinstance(r.get("text"), str)
                and isinstance(r.get("prompt"), str)]

    def adopt_knobs(self) -> None:
        """Set the knobs to those the shown run was made with (:attr:`RunMetadata.knobs`:
        knobs it does not record, or unknown to this version, and policies no longer registered
        take their defaults). A malformed ``knob.*`` attribute raises :class:`StoreError`
        naming it, and no knob changes."""
        if self.dataset is None:
            raise InputError("no run is shown; open one to take its knobs")
        try:
            knobs = RunMetadata.from_attrs(self.dataset.attrs, strict=False).knobs
        except StoreError as e:
            raise StoreError(f"the knobs of {self.run_name} cannot be read: {e}") from None
        self.knobs.set(**knobs.to_dict())

    # -- inputs ------------------------------------------------------------------------------
    def use_demo(self, item: dict[str, Any]) -> None:
        """Take a demo request (from :func:`demo_inputs`) as the input, with its expected answer
        (kept while the prompt and image stay the demo's: see :meth:`_forget_expected`)."""
        self._demo = (item["prompt"], item["image"])
        self.param.update(image=item["image"], prompt=item["prompt"], expected=item.get("answer", ""), error="")

    @param.depends("prompt", "image", watch=True)
    def _forget_expected(self) -> None:
        """An edited prompt or another image is no longer the demo request: no expected answer."""
        if self.expected and (self.prompt, self.image) != getattr(self, "_demo", None):
            self.expected = ""

    def upload_arriving(self, name: str | None) -> None:
        """An image upload is arriving (``name``: a chunk of it came in) or ended (``None``:
        received whole, or refused). While one arrives — and for :data:`UPLOAD_STALL_S` after
        its last chunk, a client that stops sending must not block Run for ever — a Run is
        refused: it would run the image shown before the upload."""
        if name is None and self._uploading is not None:
            self._upload_ended = (self._uploading[0], time.monotonic())
        self._uploading = None if name is None else (str(name)[:80], time.monotonic())

    def upload_on_its_way(self, name: str) -> None:
        """The browser holds an image upload ``name`` it has not finished sending (a Run pressed
        right after the drop reaches the server before the upload's first chunk): Run refuses
        as for :meth:`upload_arriving` — unless the server has had a file of that name whole
        within :data:`UPLOAD_STALL_S` (the browser's progress display lags the transfer)."""
        name = str(name)[:80]
        ended = self._upload_ended
        if ended is not None and ended[0] == name and \
                time.monotonic() - ended[1] < UPLOAD_STALL_S:
            return
        if self._uploading is None:
            self._uploading = (name, time.monotonic())

    def accept_upload(self, data: bytes | None, filename: str | None = None) -> Path:
        """Check an uploaded image (:func:`check_image_upload`), store it re-encoded as PNG in
        ``<workspace>/uploads/`` under its content hash, and make it the input image."""
        img = check_image_upload(data, filename)
        data = bytes(data)
        up = self.workspace_path / "uploads"
        path = up / f"upload-{hashlib.sha256(data).hexdigest()[:16]}.png"
        try:
            up.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                img.save(tmp, format="PNG")
                tmp.replace(path)
        except OSError as e:
            raise InputError(f"the upload cannot be stored in {str(up)!r}: "
                             f"{_os_reason(e)}") from None
        self.param.update(image=str(path), error="")
        return path

    # -- runs --------------------------------------------------------------------------------
    def preload(self, then: Any = None) -> None:
        """Load the model for the current ``dtype``/``device`` knobs in a background thread
        (shared by every session), so the first Run does not wait for it. Errors are left for
        the Run to report. ``then``: called in that thread once the model is loaded (or failed
        to load)."""
        key = (self.model, self.knobs.dtype, self.knobs.device)

        def go() -> None:
            try:
                self.pool.get(*key)
            except Exception as e:  # reported by start_run when it tries again
                log.info("preload of the model failed: %s", e)
            if then is not None:
                then()

        threading.Thread(target=go, name="workbench-preload", daemon=True).start()

    def start_run(self, name: str | None = None, prompt: str | None = None,
                  images: Sequence[str | Path] | None = None) -> Path:
        """Start a run of the current knobs in a background thread; returns its store path.

        ``prompt``/``images`` default to :attr:`prompt` / :attr:`image`; ``name`` to a fresh
        ``run-<time>-NNN``. Bad input raises :class:`InputError` before any thread starts.
        """
        job = self._job
        if job is not None and not job.done and job.result is None:
            raise InputError("a run is already in progress; stop it or wait for it to finish")
        # (a run whose generation has ended may still be writing its store: the new run has
        # a store of its own, and the model pool starts it once that write is done)
        self._refused_prompt = prompt  # None: the prompt box's, whatever it then holds
        prompt = self.prompt if prompt is None else prompt
        try:
            knobs = self._check_start(prompt)
        except WorkbenchError as e:  # the alert goes once what it names is fixed (poll)
            self._refused = str(e)
            raise
        if images is None:
            images = [self.image] if self.image else []
        ws = self.workspace_path
        try:
            ws.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"the workspace {str(ws)!r} cannot be created: "
                             f"{_os_reason(e)}") from None
        path = resolve_run_path(ws, name if name else _auto_name(ws))
        if path.exists():
            raise InputError(f"run {path.name!r} already exists in the workspace; choose "
                             f"another name")
        job = _Job(path=path, max_new_tokens=int(knobs["max_new_tokens"]),
                   previous=(self._path, self._sig, self._meta, self.run_name, self.dataset))
        extra = []
        if self.batch_size > 1:
            from workbench.models.batches import batch

            extra = batch(self.batch_size - 1, mix=self.batch_mix)
        job.thread = threading.Thread(target=self._work, name=f"workbench-run-{path.name}",
                                      args=(job, knobs, prompt, [str(i) for i in images], extra,
                                            self.expected or None),
                                      daemon=True)
        self._job = job
        self._path, self._sig, self._meta = path, None, None
        self._tail_fails, self._tail_problem, self._failed = 0, "", None
        self.param.update(running=True, progress=0, progress_max=job.max_new_tokens, answer="",
                          error="", run_name=path.name, dataset=None, step_range=None,
                          status="starting …")
        job.thread.start()
        return path

    def _check_start(self, prompt: str) -> dict[str, Any]:
        """The checks of :meth:`start_run` that create nothing, in its order: the prompt, the
        values knob widgets hold refused (:func:`held_refusals`), the knobs
        (:meth:`_precheck`). Returns the knobs the run would use."""
        if not prompt or not prompt.strip():
            raise InputError("prompt is empty; give a question or instruction")
        up = self._uploading
        if up is not None and time.monotonic() - up[1] < UPLOAD_STALL_S:
            raise InputError(f"the image {up[0]!r} is still uploading; press Run once it has "
                             f"arrived (the run would use the image shown before it)")
        held = held_refusals(self.knobs)
        if held:  # what the page shows is not what would run: say so, run nothing
            name, why = next(iter(held.items()))
            raise InputError(f"the {name} box holds a value the knob refuses ({why}); correct "
                             f"it before Run" + (f" (and {len(held) - 1} more)"
                                                 if len(held) > 1 else ""))
        knobs = self.knobs.to_dict()
        self._precheck(knobs)  # a refusal leaves the shown run, the baseline and the A/B as they were
        return knobs

    def _track_refusal(self, message: str) -> None:
        """Let :meth:`poll` take down the alert of a refusal the run thread found once its cause
        is fixed, if the checks of :meth:`start_run` see it now (the model is loaded); else
        the alert stays until the next Run (nothing here could tell it fixed)."""
        try:
            self._check_start(self.prompt if self._refused_prompt is None
                              else self._refused_prompt)
        except WorkbenchError as e:
            if str(e) == message:
                self._refused = message
        except Exception:
            pass

    def _clear_fixed_refusal(self) -> None:
        """Take down the alert of a refused Run once what it named is fixed (the knob, the
        widget, the prompt): it must not outlive its cause (see :meth:`poll`)."""
        if not self._refused or self.running:
            return
        if self.error != self._refused:  # replaced by another message meanwhile
            self._refused = ""
            return
        try:
            self._check_start(self.prompt if self._refused_prompt is None
                              else self._refused_prompt)
        except WorkbenchError as e:
            if str(e) != self._refused:  # still refused, for another reason: say that one
                self._refused = self.error = str(e)
            return
        except Exception:
            return
        self._refused = self.error = ""

    def _precheck(self, knobs: dict[str, Any]) -> None:
        """The live run's knob checks, before anything starts: against the model's sizes when it
        is loaded already, else those that hold for any model (:meth:`ModelShape.unknown`);
        with the model at hand, a vismmoe predictor must exist too. Raises the run's own
        :class:`KnobError` / :class:`InputError`."""
        from workbench.knobs import ModelShape

        lm = self.pool.peek(self.model, knobs["dtype"], knobs["device"])
        k = Knobs(**knobs)
        k.check(ModelShape.of(lm.layout) if lm is not None else ModelShape.unknown(), live=True)
        if lm is not None:
            from workbench.predictor.knobs import PredictorKnobs

            if PredictorKnobs.in_use(k):
                from workbench.runtime.runtime import Runtime

                Runtime(lm, knobs=k).predictor(k)  # loaded once per path; names what is missing

    def _work(self, job: _Job, knobs: dict[str, Any], prompt: str, images: list[str],
              extra: Sequence[Any] = (), expected: str | None = None) -> None:
        """The run thread: load (or reuse) the model, then run into the store (``extra``: the
        other requests of a batch, after this one). Touches only ``job``; never parameters
        (see the module docstring)."""
        try:
            job.phase = "loading"
            lm = self.pool.get(self.model, knobs["dtype"], knobs["device"])
            from workbench.runtime.runtime import Runtime

            job.phase = "waiting"
            with self.pool.exclusive(lm):  # one run at a time on a model (see the pool)
                if job.stop.is_set():
                    job.phase = "done"
                    return
                rt = Runtime(lm, knobs=Knobs(**knobs))
                job.phase = "running"

                def on_result(result: Any) -> None:  # generation ended; the store's last
                    job.text, job.result = result.text, result  # write follows: show the end
                    self._wake_poll()

                def on_token(token: int, text: str) -> None:
                    job.tokens += 1
                    job.text = text

                if extra:
                    from workbench.models.inputs import Request

                    job.result = rt.run([Request(prompt, images, expected=expected), *extra],
                                        store=job.path, on_token=on_token, stop=job.stop,
                                        on_result=on_result)
                else:
                    job.result = rt.run(prompt, images=images, store=job.path,
                                        on_token=on_token, stop=job.stop, on_result=on_result)
            job.text = job.result.text
        except WorkbenchError as e:
            job.error = str(e)
        except Exception as e:  # shown to the user; the traceback goes to the server log
            log.error("run %s failed:\n%s", job.path.name, traceback.format_exc())
            job.error = f"{type(e).__name__}: {e}"
        finally:
            job.phase = "done"
            job.done = True
            if job.error and job.result is not None:  # the end was shown; its store failed
                log.error("run %s: its store's final write failed: %s", job.path.name, job.error)
            self._wake_poll()

    def _wake_poll(self) -> None:
        """Ask for a :meth:`poll` soon (:attr:`wake`; the run's thread calls this). Never
        raises: a closed session's loop is not the run's problem."""
        wake = self.wake
        if wake is not None:
            try:
                wake()
            except Exception:
                log.debug("wake failed", exc_info=True)

    def stop(self) -> None:
        """Ask the run in flight to stop after the current token (its store stays valid)."""
        job = self._job
        if job is not None:
            if job.stop_token is None:
                job.stop_token = job.tokens
            job.stop.set()
            self.status = "stopping …"

    def wait(self, timeout: float | None = 120.0) -> None:
        """Block until the run in flight ends, then :meth:`poll` (tests, notebooks)."""
        job = self._job
        if job is not None and job.thread is not None:
            job.thread.join(timeout)
            if job.thread.is_alive():
                raise TimeoutError(f"run {job.path.name} still going after {timeout} s")
        self.poll()
        if job is not None and self._job is job:  # the end shown; now its last steps
            self.poll()

    @property
    def streaming(self) -> bool:
        """The shown store is this session's run in flight, from :meth:`start_run` until its
        last steps are read once it is written: views below the first screen wait for them
        (``PlotView.live``)."""
        job = self._job
        return job is not None and not job.final and self._path == job.path

    @property
    def live(self) -> bool:
        """The shown store is still being written (by this session or anyone else)."""
        return self.running or (self.dataset is not None
                                and self.dataset.attrs.get("status") == "running")

    # -- the periodic callback ---------------------------------------------------------------
    def poll(self, tail: bool = True) -> None:
        """Bring parameters up to date: the run thread's progress, the shown store's new steps
        (unless ``tail`` is False: the page is still drawing the last ones, see
        ``views.TickQueue``; a run's first steps are read all the same), the run list (every
        ``refresh_s``). Cheap when nothing changed (one ``stat``). Never raises: it runs on the
        event loop, where an exception would only be logged over and over; an unexpected one
        is logged once and shown in :attr:`error`."""
        try:
            job = self._job
            if job is not None:
                self._apply(job)
            # a run's first steps are read even while the page rests: they replace the
            # placeholders the user is waiting on (Run → first plot), and nothing is dropped
            if tail or (self.dataset is None and self.streaming):
                self._tail()
            self._clear_fixed_refusal()
            if time.monotonic() - self._last_refresh >= self.refresh_s:
                self.refresh()
        except Exception as e:
            msg = f"the dashboard could not update: {type(e).__name__}: {str(e)[:200]}"
            if self.error != msg:
                log.error("poll failed:\n%s", traceback.format_exc())
                self.error = msg

    def _apply(self, job: _Job) -> None:
        """Copy the run thread's fields into parameters. Its end is shown (buttons, status) as
        soon as generation has ended (``job.result``), in a callback of its own, before the
        store's final write is done; once it is done, the next call reads the store's last
        steps (views redraw) and lets the job go."""
        n, m = job.tokens, job.max_new_tokens
        if job.reported:  # the end is shown
            if not job.done:
                return  # the store's final write is under way
            job.final = True  # the views below the first screen draw these last steps
            if job.error:  # shown as ended; then its store failed
                if self.error != job.error:
                    self.param.update(error=job.error, status=f"failed: {job.path.name}")
            elif job.end_status and self.status != job.end_status:
                self.status = job.end_status  # the store is written now
            self._tail(force=True)
            self._job = None
            self.refresh()
            return
        upd: dict[str, Any] = {"progress": min(n, m), "answer": job.text}
        if job.done or job.result is not None:
            upd["running"] = False
            res = job.result
            if job.error:  # (with a result: generation ended, then the store failed)
                upd["error"] = job.error
                upd["status"] = f"failed: {job.path.name}"
            elif res is not None:
                how = "complete"
                if res.stopped:
                    how = "stopped" + ("" if job.stop_token is None else
                                       f" (Stop arrived at token {job.stop_token})")
                job.end_status = (f"{how}: {job.path.name} · {len(res.token_ids)} tokens, "
                                  f"{res.steps} steps · {res.latency_measured_s:.2f} s measured, "
                                  f"{res.latency_modeled_s * 1e3:.1f} ms modeled")
                upd["status"] = job.end_status + ("" if job.done else
                                                  " · writing the store …")
                upd["progress"] = m if not res.stopped else min(n, m)
            else:
                upd["status"] = f"stopped before start: {job.path.name}"
            if job.done and job.path == self._path and not (job.path / "zarr.json").is_file():
                # failed before its store was created (e.g. a refusal only the loaded model
                # could find): the run shown before comes back, as after a _precheck refusal
                path, sig, meta, name, ds = job.previous or (None, None, None, None, None)
                self._path, self._sig, self._meta = path, sig, meta
                upd["run_name"], upd["dataset"] = name, ds
                # nothing was stored: say so, and show the previous run's answer over its plots
                upd["answer"] = self._answer_of(ds) if ds is not None else ""
                upd["progress"] = 0
                upd["status"] = ("refused before its first step: nothing stored"
                                 + (f" · showing {name} again" if name else ""))
                self._track_refusal(job.error)
            # the buttons and the status now, in a callback of their own (Bokeh sends a
            # callback's changes when it returns: what the user waits for after Stop); the
            # store's last steps once it is written (the job still set, so the tail keeps this
            # status)
            self.param.update(**upd)
            job.reported = True
            return
        now = time.monotonic()
        if now < self._progress_rest:
            return  # the last update's rest (see below): this frame is dropped
        upd["status"] = {
            "queued": "starting …",
            "loading": "loading the model …",
            "waiting": "waiting for another run to finish …",
            "running": f"running {job.path.name}: {n}/{m} tokens · "
                       f"{self.dataset.sizes['step'] if self.dataset is not None else 0} "
                       f"steps stored",
        }.get(job.phase, job.phase)
        self.param.update(**upd)
        # the progress (bar, answer, status line) rests as long as its update took: idle it
        # takes milliseconds and every poll shows a token; under load one took 0.1-0.35 s,
        # every poll, which kept the event loop (and, by the GIL, the run) busy (issue 37)
        self._progress_rest = time.monotonic() + (time.monotonic() - now) * PROGRESS_REST

    def _tail(self, force: bool = False) -> None:
        """Re-open the shown store if its ``committed`` lengths or ``status`` changed (its
        ``zarr.json`` is read when the file changed, and at least every
        :data:`TAIL_REREAD_S`). A store that turns unreadable keeps its last readable state
        shown and says why in :attr:`error`; one being written is tried again first."""
        path = self._path
        if path is None:
            return
        try:
            key = _meta_key(path)
        except OSError:
            return  # not created yet (a run starting), or removed: nothing new to show
        now = time.monotonic()
        if not force and key == self._meta and now - self._last_read < TAIL_REREAD_S:
            return
        self._last_read = now
        try:
            attrs = _read_attrs(path)
            status, committed = _check_attrs(path, attrs)
        except (OSError, WorkbenchError) as e:
            self._meta = key
            self._tail_failed(path, e)
            return
        sig = (tuple(sorted(committed.items())), status)
        if (sig == self._sig and not force) or committed["step"] == 0:
            self._meta = key
            if sig == self._sig and self._tail_problem:  # readable again, as shown
                self._clear_tail_problem({})
            return  # nothing new, or nothing readable yet
        if key == self._failed and not force:
            return  # its arrays failed at this very metadata: wait for the next commit
        try:
            ds = load_run(path)
        except StoreError as e:
            self._tail_fails += 1
            if status == "running" and self._tail_fails < TAIL_RETRIES:
                log.debug("re-open of %s deferred: %s", path, e)  # a writer mid-update
                return
            self._meta = self._failed = key
            self._tail_failed(path, e)
            return
        self._meta, self._sig, self._tail_fails = key, sig, 0
        upd: dict[str, Any] = {"dataset": ds}
        if self._job is None:  # a stored run, or one another process is writing
            upd.update(self._progress_of(path, ds, status))
        self._clear_tail_problem(upd)

    def _clear_tail_problem(self, upd: dict[str, Any]) -> None:
        """Apply ``upd``; the shown store reads again: its unreadable message goes away."""
        if self._tail_problem:
            if self.error == self._tail_problem:
                upd["error"] = ""
            if self._job is None and "status" not in upd and self.dataset is not None:
                upd.update(self._progress_of(self._path, self.dataset,
                                             str(self.dataset.attrs.get("status", ""))))
            self._tail_problem = ""
            _LIST_CACHE.pop(self._path, None)
        if upd:
            self.param.update(**upd)

    def _tail_failed(self, path: Path, e: Exception) -> None:
        """The shown store cannot be read (any more): say so once, keep what is shown."""
        reason = str(e) if isinstance(e, WorkbenchError) else f"it cannot be read: " \
                                                                f"{_os_reason(e)}"
        msg = f"run {path.name!r} is unreadable: {reason}"
        if msg == self._tail_problem:
            return
        self._tail_problem = msg
        if isinstance(e, StoreError):
            _mark_unreadable(path, reason)
        upd: dict[str, Any] = {"error": msg}
        if self._job is None:
            upd["status"] = f"{path.name}: unreadable" + (
                " (its last readable state is shown)" if self.dataset is not None else "")
        self.param.update(**upd)

    # -- A/B ---------------------------------------------------------------------------------
    def repeats(self, ds: xr.Dataset, name: str | None = None) -> dict[str, list[float]]:
        """The measured metrics (:data:`MEASURED_METRICS`) of run ``ds`` (store ``name`` of the
        workspace) and of every complete run of the workspace that repeats it
        (:func:`repeat_key`): each metric → values, ``ds``'s first. Reads each listed store's
        ``zarr.json`` once per change (cached); an unreadable one is skipped."""
        key = repeat_key(ds.attrs)
        summary = ds.moe.summary()
        out = {m: [float(summary[m])] for m in MEASURED_METRICS}
        if key is None:
            return out
        for info in self.runs:
            if info.status != "complete" or not info.readable or info.name == name:
                continue
            path = self.workspace_path / info.name
            try:
                meta = _meta_key(path)
                hit = _REPEATS.get(path)
                if hit is None or hit[0] != meta:
                    attrs = _read_attrs(path)
                    summary = attrs.get("summary")
                    summary = jsonio.loads(summary) if isinstance(summary, str) else summary
                    values = {m: float(summary[m]) for m in MEASURED_METRICS} \
                        if isinstance(summary, dict) else {}
                    hit = _REPEATS[path] = (meta, repeat_key(attrs), values)
            except (OSError, WorkbenchError, ValueError, TypeError, KeyError):
                continue
            if hit[1] == key and hit[2]:
                for m in MEASURED_METRICS:
                    out[m].append(hit[2][m])
        return out

    def pin_baseline(self) -> None:
        """Pin the shown run as the A/B baseline (a snapshot: a live run keeps its pinned
        steps)."""
        if self.dataset is None:
            raise InputError("no run is shown; open or run one before pinning it as baseline")
        self.param.update(baseline=self.dataset, baseline_name=self.run_name)

    def clear_baseline(self) -> None:
        self.param.update(baseline=None, baseline_name=None)

    def deltas(self) -> list[dict[str, Any]]:
        """:func:`ab_deltas` of the shown run vs the baseline ([] without both)."""
        if self.dataset is None or self.baseline is None:
            return []
        return ab_deltas(self.dataset, self.baseline)

    # -- replay (what-if) ----------------------------------------------------------------------
    def replay_trace(self):
        """The routing of the shown run as a :class:`~workbench.traces.Trace`, read from its
        store once per committed state, and shared with the other sessions of the process that
        show the same store (:data:`_SHARED_TRACES`, with the replays made on it: a new page
        showing the newest run replayed it all again, seconds under load).
        :class:`InputError` without a finished run shown."""
        if self._path is None or self.dataset is None:
            raise InputError("no run is shown; open or run one to replay it")
        if self.live:
            raise InputError(f"{self.run_name} is still being written; its replay is drawn "
                             f"once it is complete")
        key = (str(self._path), self._sig)
        if key != self._trace_key:
            from workbench.traces import from_store

            shared_key = (*key, self._meta)  # the same store file, not just the same lengths
            shared = _SHARED_TRACES.get(shared_key)
            if shared is not None:
                self._trace, self._trace_key = shared[0], key
                self._replay_memo = shared[1]
                return self._trace
            try:
                trace = from_store(self._path)
            except WorkbenchError:
                raise
            except Exception as e:  # a store whose routing arrays are damaged
                log.info("routing of %s:\n%s", self._path, traceback.format_exc())
                raise StoreError(f"the routing of {self.run_name} cannot be read: "
                                 f"{type(e).__name__}: {str(e)[:200]}") from None
            self._trace, self._trace_key, self._replay_memo = trace, key, {}
            if len(_SHARED_TRACES) >= SHARED_TRACES:
                _SHARED_TRACES.pop(next(iter(_SHARED_TRACES)))
            _SHARED_TRACES[shared_key] = (trace, self._replay_memo)
        return self._trace

    def replay_bounds(self) -> tuple[int, int] | None:
        """Useful cache sizes (smallest, largest) of the shown run under ``replay_scope``;
        None when there is nothing to replay."""
        from workbench.ui.replay import slot_bounds

        try:
            return slot_bounds(self.replay_trace(), self.replay_scope)
        except WorkbenchError:
            return None
        except Exception:  # a store whose routing cannot be read: nothing to replay
            log.info("replay bounds of %s:\n%s", self._path, traceback.format_exc())
            return None

    def _sync_replay_knobs(self, event: Any) -> None:
        """A run newly shown: set :attr:`replay_knobs` to its own knobs (``RunMetadata``, as
        ``workbench.replay_trace`` recovers them), without counting a change. Runs before the
        views' watchers (it is registered first), so they replay with the new knobs."""
        ds = event.new
        if ds is None or self._path is None or self._path == self._replay_for:
            return  # nothing shown, or the same run (a live tail growing)
        self._replay_for = self._path
        try:
            values = RunMetadata.from_attrs(ds.attrs, strict=False).knobs.to_dict()
            self._replay_problem = ""
        except StoreError as e:
            values, self._replay_problem = Knobs().to_dict(), f"this run's knobs cannot be " \
                                                               f"read: {e}"
        self._syncing_replay = True
        try:
            self.replay_knobs.set(**values)
        finally:
            self._syncing_replay = False

    def _replay_knob_changed(self, *events: Any) -> None:
        if not self._syncing_replay:
            self.replay_revision += 1

    def replay_study(self, points: int = 12) -> ReplayStudy:
        """:meth:`replay_study_steps` run to its end."""
        return advance(self.replay_study_steps(points))

    def replay_study_steps(self, points: int = 12) -> Generator[Progress, None, ReplayStudy]:
        """Replay the shown run (see :func:`workbench.ui.replay.study`): hit-rate curves of the
        ``replay_evictions`` policies and Belady over the ``replay_slots`` range under
        ``replay_scope``, the metrics table at ``replay_at``, and the run's own point; every
        other knob from :attr:`replay_knobs` (the run's own, as the replay widgets change
        them) — each point is ``workbench.replay_trace`` of the run's store. Replays already
        made on this run are reused. Raises :class:`WorkbenchError` with a message for the
        user (no run, a live run, knobs that cannot be read, a prefetch policy the run cannot
        serve, …), raised when the generator is advanced
        (:func:`workbench.ui.replay.study_steps`; :func:`~workbench.ui.replay.advance`)."""
        trace = self.replay_trace()
        if self._replay_problem:
            raise StoreError(self._replay_problem)
        ds = self.dataset
        meta = RunMetadata.from_attrs(ds.attrs, strict=False)
        own = None
        if meta.cache_slots is not None:
            own = (meta.cache_slots, float(ds.moe.hit_rate()),
                   f"this run, as recorded ({_policies_of(meta)})")
        ep = self.knobs.group("ep")  # the Expert parallel card's ranks, as the EP view's
        return (yield from study_steps(
            trace, self.replay_evictions, slot_range=self.replay_slots, at_slots=self.replay_at,
            points=points, own=own, knobs=self.replay_knobs, scope=self.replay_scope,
            memo=self._replay_memo, ep=(int(ep.ep_ranks), ep.placement)))
