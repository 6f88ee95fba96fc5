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
- **No pickle**: uploaded images are decoded by PIL (PNG/JPEG only, size-limited) and re-encoded
  as PNG into ``<workspace>/uploads``; everything else on disk is zarr/JSON.

- **Replay never runs the model**: the ``replay_*`` parameters re-serve the shown run's recorded
  routing through other cache/prefetch policies (:meth:`DataStore.replay_study`, milliseconds;
  replays already made on a run are reused), and only once the run is complete.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import param
import xarray as xr

from workbench.errors import InputError, WorkbenchError
from workbench.knobs import Knobs
from workbench.options import get_options
from workbench.policies.eviction import EVICTION
from workbench.policies.prefetch import PREFETCH
from workbench.ui.replay import AS_RECORDED, SCOPES, ReplayStudy, recorded_slots, study, \
    target_choices

log = logging.getLogger(__name__)

__all__ = ["DataStore", "RunInfo", "ab_deltas", "check_image_upload", "default_workspace",
           "demo_inputs", "list_runs", "resolve_run_path", "safe_run_name", "selected_steps",
           "MAX_UPLOAD_BYTES", "MAX_UPLOAD_PIXELS"]

#: largest accepted upload, in bytes (5 MiB)
MAX_UPLOAD_BYTES = 5 * 1024 * 1024
#: largest accepted upload, in pixels (width × height), against decompression bombs
MAX_UPLOAD_PIXELS = 4096 * 4096
#: image formats accepted from uploads (PIL format names)
UPLOAD_FORMATS = ("PNG", "JPEG")

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MODALITY_CHOICES = ("all", "text", "image")
PHASE_CHOICES = ("all", "prefill", "decode")
CLOCK_CHOICES = ("modeled", "measured")


# -- workspace and names ------------------------------------------------------------------------
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
    anywhere else (symlinks are followed before the check)."""
    ws = Path(workspace).resolve()
    p = ws / safe_run_name(name)
    if p.parent != ws or p.resolve().parent != ws:
        raise InputError(f"run {name!r} is outside the workspace {str(ws)!r}")
    return p


@dataclass(frozen=True)
class RunInfo:
    """One store of the workspace, as listed (``steps``: committed steps)."""

    name: str
    status: str
    steps: int
    created: str
    prompt: str

    @property
    def label(self) -> str:
        return f"{self.name[:-5] if self.name.endswith('.zarr') else self.name} · {self.status}" \
               f" · {self.steps} steps"


def _read_attrs(path: Path) -> dict[str, Any]:
    """The group attributes of a store, from its ``zarr.json`` (raises on a half-written file)."""
    meta = json.loads((path / "zarr.json").read_text())
    attrs = meta.get("attributes", {})
    return attrs if isinstance(attrs, dict) else {}


def _committed(attrs: dict[str, Any]) -> dict[str, int]:
    c = attrs.get("committed", {})
    if isinstance(c, str):
        c = json.loads(c)
    return {k: int(v) for k, v in c.items()} if isinstance(c, dict) else {}


_LIST_CACHE: dict[Path, tuple[int, RunInfo]] = {}


def list_runs(workspace: str | Path) -> list[RunInfo]:
    """Run stores directly in ``workspace`` (folders ``*.zarr`` with a ``zarr.json``), newest
    first. A store being written is listed with ``status == "running"``."""
    ws = Path(workspace)
    if not ws.is_dir():
        return []
    out: list[RunInfo] = []
    for p in ws.iterdir():
        meta = p / "zarr.json"
        if not p.name.endswith(".zarr") or not _NAME_RE.fullmatch(p.name) or not meta.is_file():
            continue
        try:
            mtime = meta.stat().st_mtime_ns
            hit = _LIST_CACHE.get(p)
            if hit is not None and hit[0] == mtime:
                out.append(hit[1])
                continue
            attrs = _read_attrs(p)
        except (OSError, ValueError):
            continue  # half-written metadata: list it on the next refresh
        info = RunInfo(name=p.name, status=str(attrs.get("status", "?")),
                       steps=int(_committed(attrs).get("step", 0)),
                       created=str(attrs.get("created", "")), prompt=str(attrs.get("prompt", "")))
        _LIST_CACHE[p] = (mtime, info)
        out.append(info)
    return sorted(out, key=lambda r: (r.created, _birth(ws / r.name), r.name), reverse=True)


def _birth(path: Path) -> int:
    """Creation order of stores created within the same second: the ``layer`` coordinate's
    metadata is written once, when the store is created."""
    try:
        return (path / "layer" / "zarr.json").stat().st_mtime_ns
    except OSError:
        return 0


def _auto_name(workspace: Path) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        name = f"run-{stamp}-{i:03d}.zarr"
        if not (workspace / name).exists():
            return name
    raise InputError(f"workspace {str(workspace)!r} has no free run name for {stamp}")


# -- inputs -------------------------------------------------------------------------------------
def demo_dir() -> Path:
    """``data/demo`` of the repository (bundled demo inputs; may not exist yet)."""
    from workbench.models.embedded import EMBEDDED_MODEL_DIR

    return Path(EMBEDDED_MODEL_DIR).parent / "demo"


def demo_inputs(folder: str | Path | None = None) -> list[dict[str, str]]:
    """Bundled demo requests ``[{"label", "image", "prompt", "answer"}]`` from ``prompts.json``
    (``image`` an absolute path); empty when the folder or file is missing or unreadable."""
    d = Path(folder) if folder is not None else demo_dir()
    try:
        items = json.loads((d / "prompts.json").read_text())
    except (OSError, ValueError):
        return []
    out = []
    for it in items if isinstance(items, list) else []:
        img = d / str(it.get("image", ""))
        if not it.get("prompt") or not img.is_file() or img.parent != d:
            continue
        out.append({"label": f"{img.stem} — {it['prompt']}", "image": str(img),
                    "prompt": str(it["prompt"]), "answer": str(it.get("answer", ""))})
    return out


def check_image_upload(data: bytes | None, filename: str | None = None,
                       max_bytes: int = MAX_UPLOAD_BYTES):
    """Decode an uploaded image; PNG or JPEG only, at most ``max_bytes`` bytes and
    :data:`MAX_UPLOAD_PIXELS` pixels. Returns an RGB ``PIL.Image``; anything else raises
    :class:`InputError` with a message for the user. The file name is only used in messages:
    the type is decided by decoding, never by the extension."""
    from PIL import Image, UnidentifiedImageError

    label = repr(filename) if filename else "the upload"
    if not data:
        raise InputError(f"{label} is empty")
    if len(data) > max_bytes:
        raise InputError(f"{label} is {len(data) / 2**20:.1f} MB; images up to "
                         f"{max_bytes / 2**20:.0f} MB are accepted")
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


def ab_deltas(current: xr.Dataset, baseline: xr.Dataset) -> list[dict[str, Any]]:
    """Whole-run headline numbers of ``current`` vs ``baseline`` (``ds.moe.summary()``).

    One row per :data:`AB_METRICS` entry: ``metric``, ``label``, ``units``, ``current``,
    ``baseline``, ``delta`` = current − baseline and ``relative`` = delta / baseline (``nan``
    when the baseline is 0 or a value is nan).
    """
    a, b = current.moe.summary(), baseline.moe.summary()
    rows = []
    for key, label, units in AB_METRICS:
        cur, base = float(a[key]), float(b[key])
        delta = cur - base
        rel = delta / base if base and np.isfinite(base) and np.isfinite(cur) else float("nan")
        rows.append({"metric": key, "label": label, "units": units, "current": cur,
                     "baseline": base, "delta": delta, "relative": rel})
    return rows


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
_NOT_LOADED = ("topk_ids", "topk_weights", "token_id", "token_step")


def load_run(path: str | Path) -> xr.Dataset:
    """``open_run(path)`` read into memory, without the per-token routing variables
    (:data:`_NOT_LOADED`), which no view uses and which dominate a long prefill: the views
    compute from it many times, and a live run is re-read at every commit."""
    from workbench.telemetry.store import open_run

    full = open_run(path)
    try:
        ds = full.drop_vars([v for v in _NOT_LOADED if v in full.variables]).load()
    finally:
        full.close()
    return ds


def _policies_of(attrs: dict[str, Any]) -> str:
    """The cache policies a run was recorded with, in words (from its ``knob.*`` attrs)."""
    def knob(name: str, default: Any = None) -> Any:
        try:
            return json.loads(attrs.get(f"knob.{name}", "null"))
        except (TypeError, ValueError):
            return default

    words = [str(knob("eviction") or "?")]
    if knob("prefetch") not in (None, "none"):
        words.append(f"{knob('prefetch')} prefetch")
    if knob("active_evict"):
        words.append("ActiveEvict")
    if knob("dynamic_topk"):
        words.append("dynamic top-k")
    return " + ".join(words)


# -- models shared by the sessions of one process -----------------------------------------------
_MODELS: dict[tuple[str, str, str], Any] = {}
_MODEL_LOCK = threading.Lock()  # loading
_RUN_LOCK = threading.Lock()  # one run at a time: the offloader rearranges the model's weights


def get_model(model: str | Path | None, dtype: str, device: str):
    """A ``LoadedModel`` shared by every session of this process (at most two kept)."""
    from workbench.models.loading import default_model_dir, load

    path = str(Path(model) if model is not None else default_model_dir())
    key = (path, dtype, device)
    with _MODEL_LOCK:
        if key not in _MODELS:
            lm = load(path, dtype=dtype, device=device)
            while len(_MODELS) >= 2:
                _MODELS.pop(next(iter(_MODELS)))
            _MODELS[key] = lm
        return _MODELS[key]


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
    result: Any = None
    thread: threading.Thread | None = None


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

    # progress of the run in flight (or the tail of a store written elsewhere)
    running = param.Boolean(default=False, doc="A run of this session is in flight.")
    progress = param.Integer(default=0, bounds=(0, None), doc="Tokens generated so far.")
    progress_max = param.Integer(default=1, bounds=(1, None), doc="max_new_tokens of the run.")
    answer = param.String(default="", doc="Generated text so far.")
    status = param.String(default="", doc="One line on what is shown / happening.")
    error = param.String(default="", doc="Last error for the user ('' = none).")

    # replay of the shown run's recorded routing under other policies: changing these replays
    # the trace (milliseconds), never re-runs the model. Menus come from the registries.
    replay_evictions = param.ListSelector(
        default=EVICTION.available(), objects=EVICTION.available(),
        doc="Eviction policies drawn (Belady, the offline optimum, is always drawn: the "
            "ceiling).")
    replay_prefetch = param.Selector(default="none", objects=PREFETCH.available(),
                                     doc="Prefetch policy of the replay.")
    replay_lead = param.Integer(default=1, bounds=(1, None), softbounds=(1, 8),
                                doc="How many layers ahead a prefetch may target.")
    replay_scope = param.Selector(default="global", objects=list(SCOPES),
                                  doc="One pool of slots for every offloaded layer, or an "
                                      "equal share per layer.")
    replay_slots = param.Range(default=None, allow_None=True,
                               doc="Inclusive (smallest, largest) cache size drawn, in slots; "
                                   "None = every useful size of the run.")
    replay_at = param.Integer(default=None, allow_None=True, bounds=(1, None),
                              doc="Cache size of the metrics table; None = the run's own "
                                  "(moved into the range drawn).")
    replay_target = param.Selector(default=AS_RECORDED, objects=target_choices(),
                                   doc="Sizes the replay is priced with (modeled clock): the "
                                       "run's own, or a real model's.")

    def __init__(self, workspace: str | Path | None = None, model: str | Path | None = None,
                 knobs: Knobs | None = None, refresh_s: float = 2.0, **params: Any) -> None:
        ws = Path(workspace).expanduser().absolute() if workspace is not None \
            else default_workspace()
        replay = {k: params.pop(k) for k in list(params) if k.startswith("replay_")}
        super().__init__(workspace=str(ws), model=None if model is None else str(model),
                         **params)
        # menus offer every policy registered by now (as the knob classes do)
        self.param["replay_evictions"].objects = EVICTION.available()
        self.param["replay_prefetch"].objects = PREFETCH.available()
        self.param["replay_target"].objects = target_choices()
        self.param.update(**{"replay_evictions": EVICTION.available(), **replay})
        self.knobs = knobs if knobs is not None else Knobs()
        self.refresh_s = refresh_s
        self._job: _Job | None = None
        self._path: Path | None = None  # store being shown
        self._sig: tuple | None = None  # (committed, status) of the loaded dataset
        self._last_refresh = 0.0
        self._trace: Any = None  # routing of the shown run, for replay
        self._trace_key: tuple | None = None
        self._replay_memo: dict = {}  # replays already made on that trace
        self.refresh()

    # -- workspace ---------------------------------------------------------------------------
    @property
    def workspace_path(self) -> Path:
        return Path(self.workspace)

    def refresh(self) -> list[RunInfo]:
        """Re-list the workspace's runs."""
        runs = list_runs(self.workspace_path)
        if runs != self.runs:
            self.runs = runs
        self._last_refresh = time.monotonic()
        return runs

    def open(self, name: str) -> xr.Dataset | None:
        """Show run ``name`` of the workspace; a store still being written is tailed by
        :meth:`poll`. Returns the dataset (None if nothing is committed yet)."""
        path = resolve_run_path(self.workspace_path, name)
        if not (path / "zarr.json").is_file():
            raise InputError(f"run {name!r} is not a store in the workspace "
                             f"{str(self.workspace_path)!r}")
        self._path, self._sig = path, None
        self.param.update(run_name=path.name, step_range=None, error="")
        self._tail(force=True)
        if self.dataset is not None and self._job is None:
            self.answer = self._answer_of(self.dataset)
        return self.dataset

    def _answer_of(self, ds: xr.Dataset) -> str:
        """Decoded answer of a stored run (from its summary, else blank)."""
        try:
            return str(json.loads(ds.attrs.get("summary", "{}")).get("text", ""))
        except ValueError:
            return ""

    def adopt_knobs(self) -> None:
        """Set the knobs to those the shown run was made with (``Knobs.from_attrs``; knobs
        unknown to this version, or policies no longer registered, keep their values)."""
        if self.dataset is None:
            raise InputError("no run is shown; open one to take its knobs")
        self.knobs.set(**Knobs.from_attrs(self.dataset.attrs).to_dict())

    # -- inputs ------------------------------------------------------------------------------
    def use_demo(self, item: dict[str, str]) -> None:
        """Take a demo request (from :func:`demo_inputs`) as the input."""
        self.param.update(image=item["image"], prompt=item["prompt"], error="")

    def accept_upload(self, data: bytes | None, filename: str | None = None) -> Path:
        """Check an uploaded image (:func:`check_image_upload`), store it re-encoded as PNG in
        ``<workspace>/uploads/`` under its content hash, and make it the input image."""
        img = check_image_upload(data, filename)
        up = self.workspace_path / "uploads"
        up.mkdir(parents=True, exist_ok=True)
        path = up / f"upload-{hashlib.sha256(data).hexdigest()[:16]}.png"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            img.save(tmp, format="PNG")
            tmp.replace(path)
        self.param.update(image=str(path), error="")
        return path

    # -- runs --------------------------------------------------------------------------------
    def preload(self) -> None:
        """Load the model for the current ``dtype``/``device`` knobs in a background thread
        (shared by every session), so the first Run does not wait for it. Errors are left for
        the Run to report."""
        key = (self.model, self.knobs.dtype, self.knobs.device)

        def go() -> None:
            try:
                get_model(*key)
            except Exception as e:  # reported by start_run when it tries again
                log.info("preload of the model failed: %s", e)

        threading.Thread(target=go, name="workbench-preload", daemon=True).start()

    def start_run(self, name: str | None = None, prompt: str | None = None,
                  images: Sequence[str | Path] | None = None) -> Path:
        """Start a run of the current knobs in a background thread; returns its store path.

        ``prompt``/``images`` default to :attr:`prompt` / :attr:`image`; ``name`` to a fresh
        ``run-<time>-NNN``. Bad input raises :class:`InputError` before any thread starts.
        """
        if self._job is not None and not self._job.done:
            raise InputError("a run is already in progress; stop it or wait for it to finish")
        prompt = self.prompt if prompt is None else prompt
        if not prompt or not prompt.strip():
            raise InputError("prompt is empty; give a question or instruction")
        if images is None:
            images = [self.image] if self.image else []
        ws = self.workspace_path
        ws.mkdir(parents=True, exist_ok=True)
        path = resolve_run_path(ws, name if name else _auto_name(ws))
        if path.exists():
            raise InputError(f"run {path.name!r} already exists in the workspace; choose "
                             f"another name")
        knobs = self.knobs.to_dict()
        job = _Job(path=path, max_new_tokens=int(knobs["max_new_tokens"]))
        job.thread = threading.Thread(target=self._work, name=f"workbench-run-{path.name}",
                                      args=(job, knobs, prompt, [str(i) for i in images]),
                                      daemon=True)
        self._job = job
        self._path, self._sig = path, None
        self.param.update(running=True, progress=0, progress_max=job.max_new_tokens, answer="",
                          error="", run_name=path.name, dataset=None, step_range=None,
                          status="starting …")
        job.thread.start()
        return path

    def _work(self, job: _Job, knobs: dict[str, Any], prompt: str, images: list[str]) -> None:
        """The run thread: load (or reuse) the model, then run into the store. Touches only
        ``job``; never parameters (see the module docstring)."""
        try:
            job.phase = "loading"
            lm = get_model(self.model, knobs["dtype"], knobs["device"])
            from workbench.runtime.runtime import Runtime

            job.phase = "waiting"
            with _RUN_LOCK:
                if job.stop.is_set():
                    job.phase = "done"
                    return
                rt = Runtime(lm, knobs=Knobs(**knobs))
                job.phase = "running"

                def on_token(token: int, text: str) -> None:
                    job.tokens += 1
                    job.text = text

                job.result = rt.run(prompt, images=images, store=job.path, on_token=on_token,
                                    stop=job.stop)
            job.text = job.result.text
        except WorkbenchError as e:
            job.error = str(e)
        except Exception as e:  # shown to the user; the traceback goes to the server log
            log.error("run %s failed:\n%s", job.path.name, traceback.format_exc())
            job.error = f"{type(e).__name__}: {e}"
        finally:
            job.phase = "done"
            job.done = True

    def stop(self) -> None:
        """Ask the run in flight to stop after the current token (its store stays valid)."""
        if self._job is not None:
            self._job.stop.set()
            self.status = "stopping …"

    def wait(self, timeout: float | None = 120.0) -> None:
        """Block until the run in flight ends, then :meth:`poll` (tests, notebooks)."""
        job = self._job
        if job is not None and job.thread is not None:
            job.thread.join(timeout)
            if job.thread.is_alive():
                raise TimeoutError(f"run {job.path.name} still going after {timeout} s")
        self.poll()

    @property
    def live(self) -> bool:
        """The shown store is still being written (by this session or anyone else)."""
        return self.running or (self.dataset is not None
                                and self.dataset.attrs.get("status") == "running")

    # -- the periodic callback ---------------------------------------------------------------
    def poll(self) -> None:
        """Bring parameters up to date: the run thread's progress, the shown store's new steps,
        the run list (every ``refresh_s``). Cheap when nothing changed (one small JSON read)."""
        job = self._job
        if job is not None:
            self._apply(job)
        self._tail()
        if time.monotonic() - self._last_refresh >= self.refresh_s:
            self.refresh()

    def _apply(self, job: _Job) -> None:
        n, m = job.tokens, job.max_new_tokens
        upd: dict[str, Any] = {"progress": min(n, m), "answer": job.text}
        if job.done:
            self._tail(force=True)
            upd["running"] = False
            res = job.result
            if job.error:
                upd["error"] = job.error
                upd["status"] = f"failed: {job.path.name}"
            elif res is not None:
                how = "stopped" if res.stopped else "complete"
                upd["status"] = (f"{how}: {job.path.name} · {len(res.token_ids)} tokens, "
                                 f"{res.steps} steps · {res.latency_measured_s:.2f} s measured, "
                                 f"{res.latency_modeled_s * 1e3:.1f} ms modeled")
                upd["progress"] = m if not res.stopped else min(n, m)
            else:
                upd["status"] = f"stopped before start: {job.path.name}"
            if job.path == self._path and not (job.path / "zarr.json").is_file():
                self._path, self._sig = None, None  # failed before its store was created
                upd["run_name"] = None
            self._job = None
            self.param.update(**upd)
            self.refresh()
            return
        upd["status"] = {
            "queued": "starting …",
            "loading": "loading the model …",
            "waiting": "waiting for another run to finish …",
            "running": f"running {job.path.name}: {n}/{m} tokens · "
                       f"{self.dataset.sizes['step'] if self.dataset is not None else 0} "
                       f"steps stored",
        }.get(job.phase, job.phase)
        self.param.update(**upd)

    def _tail(self, force: bool = False) -> None:
        """Re-open the shown store if its ``committed`` lengths or ``status`` changed."""
        path = self._path
        if path is None:
            return
        try:
            attrs = _read_attrs(path)
        except (OSError, ValueError):
            return  # not created yet, or metadata mid-write: next tick
        sig = (tuple(sorted(_committed(attrs).items())), attrs.get("status"))
        if sig == self._sig and not force:
            return
        if _committed(attrs).get("step", 0) == 0:
            return  # nothing readable yet
        try:
            ds = load_run(path)
        except Exception as e:  # a concurrent writer mid-resize: try again on the next tick
            log.debug("re-open of %s deferred: %s", path, e)
            return
        self._sig = sig
        upd: dict[str, Any] = {"dataset": ds}
        if self._job is None:  # a stored run, or one another process is writing
            st, n = ds.attrs.get("status"), int(ds.sizes["step"])
            try:
                m = max(1, int(json.loads(ds.attrs.get("knob.max_new_tokens", "1"))))
            except (TypeError, ValueError):
                m = 1
            upd.update(progress_max=m, progress=min(n, m) if st == "running" else m,
                       status=f"{path.name}: live tail, {n} steps committed"
                       if st == "running" else f"{path.name}: {st}, {n} steps")
        self.param.update(**upd)

    # -- A/B ---------------------------------------------------------------------------------
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
        store once per committed state. :class:`InputError` without a finished run shown."""
        if self._path is None or self.dataset is None:
            raise InputError("no run is shown; open or run one to replay it")
        if self.live:
            raise InputError(f"{self.run_name} is still being written; its replay is drawn "
                             f"once it is complete")
        key = (str(self._path), self._sig)
        if key != self._trace_key:
            from workbench.traces import from_store

            self._trace, self._trace_key, self._replay_memo = from_store(self._path), key, {}
        return self._trace

    def replay_bounds(self) -> tuple[int, int] | None:
        """Useful cache sizes (smallest, largest) of the shown run under ``replay_scope``;
        None when there is nothing to replay."""
        from workbench.ui.replay import slot_bounds

        try:
            return slot_bounds(self.replay_trace(), self.replay_scope)
        except WorkbenchError:
            return None

    def replay_study(self, points: int = 12) -> ReplayStudy:
        """Replay the shown run under the ``replay_*`` settings (see
        :func:`workbench.ui.replay.study`): hit-rate curves of the chosen eviction policies and
        Belady over the cache-size range, the metrics table, and the run's own point. Replays
        already made on this run are reused. Raises :class:`WorkbenchError` with a message for
        the user (no run, a live run, a prefetch policy the run cannot serve, …)."""
        trace = self.replay_trace()
        ds = self.dataset
        slots = recorded_slots(ds.attrs)
        own = None
        if slots is not None:
            own = (slots, float(ds.moe.hit_rate()), f"this run, as recorded "
                                                     f"({_policies_of(ds.attrs)})")
        return study(trace, self.replay_evictions, slot_range=self.replay_slots,
                     at_slots=self.replay_at, points=points, own=own,
                     prefetch=self.replay_prefetch, prefetch_lead=self.replay_lead,
                     scope=self.replay_scope, target_model=self.replay_target,
                     memo=self._replay_memo)
