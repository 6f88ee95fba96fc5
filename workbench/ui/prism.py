"""The dashboard's MoE-Prism views (issue 16 §5).

- The **Elastic experts** card: the knobs of the group (``prism_k_active`` as a slider,
  :class:`KActiveSlider`), the shown run's sub-expert heatmap at a chosen layer and the
  compute share it did (:class:`SubexpertView`, from its store), and the operating-point curve
  (:class:`OperatingPointsView`): accuracy vs expert compute for MoE-Prism's k_active and for
  dropping whole experts (top-k′), *measured* on the embedded model by
  ``benchmarks/bench_prism_points.py``, which writes them into the package
  (``workbench/prism/operating_points.json``, read by :func:`operating_points`), with the next
  run's k_active marked.
- The **QoS scheduler** view (:class:`SchedulerView`): :mod:`workbench.prism.scheduler`'s
  simulation of the registered policies over a sweep of arrival rates, priced by a cost table
  either *modeled* on a hardware profile (:meth:`~workbench.prism.costs.CostTable.modeled`) or
  *measured* on the embedded model (:meth:`~workbench.prism.costs.CostTable.measure`, by
  ``benchmarks/bench_prism_scheduler.py`` on a 2-core CPU; a copy ships in the package,
  ``workbench/prism/cost_table_cpu.json``, read by :func:`measured_cost_table`): throughput
  and goodput per policy and the latency distributions at the chosen rate.
"""

from __future__ import annotations

import html
import importlib.resources
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import panel as pn
import param
import plotly.graph_objects as go
import xarray as xr

from workbench.errors import InputError, WorkbenchError
from workbench.ui.datastore import DataStore
from workbench.ui.views import (WARMING, PlotView, TickQueue, figure_from_dict, finish_figure,
                               placeholder_figure)
from workbench.ui.widgets import knob_widget_specs, knob_param, make, names
from workbench.viz.prism import CURVES, LATENCIES, operating_points_figure, scheduler_figure

__all__ = ["operating_points", "run_subexperts", "subexpert_view_figure", "compute_share_html",
           "operating_points_view_figure", "SubexpertView", "OperatingPointsView",
           "KActiveSlider", "prism_knob_widgets", "SchedulerSettings", "SchedulerStudy",
           "scheduler_study", "scheduler_table_html", "SchedulerView", "POINTS_FORMAT",
           "measured_cost_table", "COST_TABLES"]

log = logging.getLogger(__name__)

POINTS_FORMAT = "workbench-prism-points/1"
POINTS_SOURCE = "benchmarks/bench_prism_points.py"


# -- the measured operating points ----------------------------------------------------------------
#: largest operating-points file read (the package's is a few kB)
MAX_POINTS_BYTES = 16 * 1024 * 1024


def _points_path() -> Path:
    return Path(str(importlib.resources.files("workbench.prism") / "operating_points.json"))


def operating_points(path: str | Path | None = None) -> dict[str, Any]:
    """The operating points in ``path`` (default: the package's, written by
    ``benchmarks/bench_prism_points.py``), checked: :class:`InputError` naming the file and the
    field when it is not a ``workbench-prism-points/1`` file of finite shares and accuracies in
    0 … 1."""
    from workbench.fileio import read_json

    path = Path(path) if path is not None else _points_path()
    where = repr(str(path))
    try:
        doc = read_json(path, MAX_POINTS_BYTES, f"the operating points {where}", obj=False)
    except InputError as e:
        raise InputError(f"{e}; rerun {POINTS_SOURCE}") from None

    def bad(what: str) -> InputError:
        return InputError(f"the operating points {where}: {what}; rerun {POINTS_SOURCE}")

    if not isinstance(doc, dict) or doc.get("format") != POINTS_FORMAT:
        raise bad(f"not a {POINTS_FORMAT} file")
    N = doc.get("subexperts")
    if isinstance(N, bool) or not isinstance(N, int) or N < 1:
        raise bad(f"subexperts must be a whole number ≥ 1, not {N!r}")
    curves = doc.get("curves")
    if not isinstance(curves, dict) or not set(curves) <= set(CURVES) or "prism" not in curves:
        raise bad(f"curves must map some of {', '.join(CURVES)} (prism among them) to points")
    for name, pts in curves.items():
        for i, p in enumerate(pts if isinstance(pts, list) else [None]):
            ok = isinstance(p, dict) and isinstance(p.get("k"), int) and all(
                isinstance(p.get(f), (int, float)) and np.isfinite(p[f]) and 0 <= p[f] <= 1
                for f in ("compute_share", "accuracy", "se"))
            if not ok:
                raise bad(f"curves.{name}[{i}] must be {{k, compute_share, accuracy, se}} with "
                          f"numbers in 0 … 1, not {str(p)[:80]}")
    return doc


def run_subexperts(ds: xr.Dataset) -> int:
    """N of the run's sub-experts (1: it ran whole experts, or its store predates them)."""
    return int(ds.sizes.get("subexpert", 1))


def _run_k_active(ds: xr.Dataset) -> str:
    from workbench.telemetry.metadata import RunMetadata

    try:
        k = RunMetadata.from_attrs(ds.attrs, strict=False).knobs.prism_k_active
    except Exception:  # unreadable knobs: said as unknown
        return "?"
    return "all" if k is None else str(k)


# -- the Elastic experts card ---------------------------------------------------------------------
SUBEXPERT_TITLE = "tokens per sub-expert"


def subexpert_view_figure(ds: xr.Dataset | None, layer: int | None = None,
                          modality: str = "all", revision: Any = None) -> go.Figure:
    """Expert × sub-expert heatmap of the shown run at MoE ``layer`` (``ds.moe.subexpert_heatmap``:
    each expert's share of its tokens that ran the sub-expert; None: its first offloaded
    layer), tokens of ``modality``; a placeholder for a run without sub-experts."""
    if ds is None:
        return placeholder_figure("subexperts", SUBEXPERT_TITLE, "no run yet")
    if run_subexperts(ds) <= 1:
        return placeholder_figure("subexperts", SUBEXPERT_TITLE,
                                  "the shown run ran whole experts (prism off)")
    fig = ds.moe.subexpert_heatmap(layer, modality)
    fig.update_layout(title=f"{fig.layout.title.text} (share of each expert's tokens; "
                            f"recorded in the store)")
    return finish_figure(fig, "subexperts", revision)


def compute_share_html(ds: xr.Dataset | None, run_name: str | None = None) -> str:
    """One line: the share of the routed experts' compute the shown run did
    (``ds.moe.compute_share``, whole run and its range over layers), or that it ran whole
    experts."""
    if ds is None:
        return "<span class='wb-muted'>no run yet — press Run or open a run</span>"
    name = html.escape((run_name or "").removesuffix(".zarr"))
    N = run_subexperts(ds)
    if N <= 1:
        return (f"<span class='wb-muted' data-testid='prism-share'>the shown run <b>{name}</b> "
                f"ran whole experts (prism off): set prism on above and run to see its "
                f"sub-experts</span>")
    share = float(ds.moe.compute_share())
    per = np.asarray(ds.moe.compute_share(by="layer").values, float)
    per = per[np.isfinite(per)]
    spread = f"; per layer {per.min():.1%} – {per.max():.1%}" if per.size else ""
    return (f"<span data-testid='prism-share'>the shown run <b>{name}</b> did "
            f"<b>{share:.1%}</b> of its routed experts' compute (k_active "
            f"{_run_k_active(ds)} of N = {N} sub-experts{spread}) "
            f"<span class='wb-muted'>— recorded in its store</span></span>")


POINTS_TITLE = "accuracy vs expert compute"


def operating_points_view_figure(points: dict[str, Any], k_active: int | None, prism: bool,
                                 ds: xr.Dataset | None = None,
                                 revision: Any = None) -> go.Figure:
    """The measured operating points (:func:`operating_points`) with the next run's
    ``k_active`` (None: all N) marked on the MoE-Prism curve, and the share of the expert
    compute the shown run ``ds`` did when it ran sub-experts (a dotted line)."""
    N = int(points["subexperts"])
    k = N if k_active is None else int(k_active)
    on_curve = {p["k"]: p for p in points["curves"]["prism"]}
    notes = []
    mark = None
    if k in on_curve:
        label = f"next run: k_active {'all' if k_active is None else k} ({k}/{N})"
        mark = (on_curve[k]["compute_share"], on_curve[k]["accuracy"],
                label if prism else f"{label} — prism is off: it runs whole experts")
    else:
        notes.append(f"k_active {k} is not a measured point (N = {N})")
    run = None
    if ds is not None and run_subexperts(ds) > 1:
        share = float(ds.moe.compute_share())
        run = (share, f"shown run: {share:.0%}")
        if ds.attrs.get("config_hash") not in (None, points.get("config_hash")):
            notes.append(f"the shown run's model ({html.escape(str(ds.attrs.get('model_id')))}) "
                         f"is not the one measured")
    sub = (f"measured on the embedded model ({html.escape(str(points.get('model_id')))}) by "
           f"{POINTS_SOURCE}, n = {points.get('n')} held-out questions, ±2 SE")
    title = (f"{POINTS_TITLE}<br><sub>{sub}"
             + "".join(f" · {n}" for n in notes) + "</sub>")
    fig = operating_points_figure(points["curves"], mark, run, title)
    return finish_figure(fig, "prism_points", revision)


def _set_range(w: Any, lo: int, hi: int, value: int, **kw: Any) -> None:
    """An editable int slider over ``lo`` … ``hi`` (its text box too) at ``value``: the old
    bounds are lifted first, as the value may lie outside them; nothing is sent when all is
    as asked (a live run's every commit comes here)."""
    if (w.start, w.end, w.fixed_start, w.fixed_end, w.value) == (lo, max(hi, lo + 1), lo, hi,
                                                                  value):
        w.param.update(**kw)
        return
    w.param.update(fixed_start=None, fixed_end=None)
    w.param.update(start=lo, end=max(hi, lo + 1), value=value, **kw)
    w.param.update(fixed_start=lo, fixed_end=hi)


class SubexpertView(PlotView):
    """The shown run's sub-expert heatmap at the layer of ``layer`` (a slider over its MoE
    layers; the first offloaded one until moved), under the heatmap-tokens filter, and in
    ``note`` the compute share it did (:func:`compute_share_html`). The heatmap is hidden for
    a run that ran whole experts (the note says so)."""

    view = "subexperts"
    watches = ("dataset", "modality")
    live = False  # below the first screen: drawn when a streaming run ends

    def __init__(self, store: DataStore, height: int = 300) -> None:
        self._layer: int | None = None  # the user's choice; None: the run's first offloaded
        self._busy = False
        self.layer = make(pn.widgets.EditableIntSlider, "heatmap layer", start=0, end=1,
                          value=0, step=1, disabled=True, css_classes=["wb-prism-layer"],
                          sizing_mode="stretch_width")
        self.note = pn.pane.HTML("", sizing_mode="stretch_width", margin=(0, 10))
        super().__init__(store, height)
        self.layer.param.watch(self._on_layer, "value")
        self._sync()

    def _shown_layer(self) -> int | None:
        ds = self.store.dataset
        if ds is None:
            return None
        if self._layer is not None and self._layer < ds.sizes["layer"]:
            return self._layer
        off = np.nonzero(~ds.moe._pinned())[0]
        return int(off[0]) if len(off) else 0

    def figure(self) -> go.Figure:
        s = self.store
        return subexpert_view_figure(s.dataset, self._shown_layer(), s.modality,
                                     f"{self._revision()}-{self._shown_layer()}")

    def redraw(self, *events: Any) -> None:
        super().redraw(*events)
        self._sync()

    def _draw_waiting(self) -> None:
        super()._draw_waiting()
        self._sync()

    def _sync(self) -> None:
        ds = self.store.dataset
        sub = ds is not None and run_subexperts(ds) > 1
        self.pane.visible = sub
        self.note.object = compute_share_html(ds, self.store.run_name)
        self._busy = True
        try:
            if sub:
                L = int(ds.sizes["layer"])
                _set_range(self.layer, 0, L - 1, self._shown_layer(), disabled=L <= 1)
            else:
                self.layer.disabled = True
        finally:
            self._busy = False

    def _on_layer(self, event: Any) -> None:
        if self._busy or event.new is None:
            return
        self._layer = int(event.new)
        self._changed()


class OperatingPointsView(PlotView):
    """The measured operating points (:func:`operating_points_view_figure`), redrawn when the
    next run's ``prism`` / ``prism_k_active`` or the shown run change; a placeholder saying
    why when the package's points cannot be read."""

    view = "prism_points"
    watches = ("dataset",)
    live = False  # below the first screen: drawn when a streaming run ends

    def __init__(self, store: DataStore, height: int = 340,
                 points: dict[str, Any] | None = None) -> None:
        try:
            self.points, self.problem = points or operating_points(), ""
        except InputError as e:
            self.points, self.problem = None, str(e)
        super().__init__(store, height)
        store.knobs.group("prism").param.watch(self._changed, ["prism", "prism_k_active"])

    def figure(self) -> go.Figure:
        if self.points is None:
            return placeholder_figure(self.view, POINTS_TITLE, html.escape(self.problem))
        g = self.store.knobs.group("prism")
        return operating_points_view_figure(self.points, g.prism_k_active, g.prism,
                                            self.store.dataset,
                                            f"{self._revision()}-{g.prism_k_active}-{g.prism}")


class KActiveSlider:
    """The ``prism_k_active`` knob as a slider 1 … N, N meaning every sub-expert (the knob's
    None). N: the shown run's sub-experts when it ran some, else the measured points' (the
    embedded model's refactoring); a run refuses a k_active past its refactoring's N, naming
    the range. Knob and slider follow each other."""

    def __init__(self, store: DataStore, points_n: int | None = None) -> None:
        self.store, self.points_n = store, points_n
        self.group = store.knobs.group("prism")
        self._busy = False
        cls = pn.widgets.EditableIntSlider
        doc = {"description": self.group.param["prism_k_active"].doc} \
            if "description" in cls.param else {}
        self.widget = make(cls, "k_active (N = all)", start=1, end=2, value=1, step=1,
                           css_classes=["wb-knob-prism_k_active"], sizing_mode="stretch_width",
                           **doc)
        self.widget.param.watch(self._to_knob, "value")
        self.group.param.watch(self._from_knob, "prism_k_active")
        store.param.watch(self._from_knob, "dataset")
        self._from_knob()

    def subexperts(self) -> int:
        ds, k = self.store.dataset, self.group.prism_k_active
        n = run_subexperts(ds) if ds is not None else 1
        return max(n if n > 1 else self.points_n or 1, k or 1)

    def _to_knob(self, event: Any) -> None:
        if self._busy or event.new is None:
            return
        v = int(event.new)
        self.group.prism_k_active = None if v >= self.subexperts() else v

    def _from_knob(self, *events: Any) -> None:
        N, k = self.subexperts(), self.group.prism_k_active
        self._busy = True
        try:
            _set_range(self.widget, 1, N, N if k is None else k, disabled=N <= 1)
        finally:
            self._busy = False


def prism_knob_widgets(store: DataStore, points_n: int | None = None) -> pn.Column:
    """The Elastic experts knobs, each with one widget: ``prism_k_active`` a
    :class:`KActiveSlider`, the rest of the group (``prism``, the refactoring folder, …) the
    widgets :func:`~workbench.ui.widgets.knob_panels` gives them. ``col._wb_widgets`` maps
    knob name → widget."""
    group = store.knobs.group("prism")
    rest = [n for n in group.knob_names() if n != "prism_k_active"]
    panel = knob_param(group, rest, margin=0)
    k = KActiveSlider(store, points_n)
    hint = pn.pane.HTML("<small class='wb-muted'>sub-experts each routed expert runs, chosen per "
                        "token by the proxy gate</small>", margin=(0, 10),
                        stylesheets=[".wb-muted { color: #6b7280; }"])
    col = pn.Column(k.widget, hint, panel, sizing_mode="stretch_width",
                    css_classes=["wb-prism-knobs"])
    col._wb_widgets = {"prism_k_active": k.widget, **{n: panel._widgets[n] for n in rest}}
    col._wb_link = k  # keep the link alive with the widgets
    return col


# -- the QoS scheduler view -----------------------------------------------------------------------
#: arrival rates of the view's sweep, as multiples of μ_full = batch_size / S_full (S_full: a full
#: batch at full quality of the longest requests; about what FIFO serves at most)
RATE_FACTORS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)
#: the scheduler knobs the view has widgets for, with their labels (the rest keep
#: SchedulerKnobs' defaults)
SCHEDULER_KNOBS = {"rate": "arrival rate (req/s)", "ttft_slo_s": "TTFT limit (s)",
                   "tpot_slo_s": "TPOT limit (s)", "e2e_slo_s": "end-to-end limit (s)",
                   "batch_size": "batch size B_max", "timeout_s": "prism timeout T_max (s)",
                   "baseline_level": "fifo / fullbatch level"}
#: the modeled cost table's target model while the Cost model card's is "none": the embedded
#: model's architecture (Qwen3-VL-MoE) at full size
DEFAULT_TARGET = "qwen3-vl-30b-a3b"
#: the cost tables the view can price with (:attr:`SchedulerSettings.cost_table`)
COST_TABLES = ("modeled", "measured")
COST_SOURCE = "benchmarks/bench_prism_scheduler.py"
#: measured tables read so far, by path: the file is only read, and a switch back and forth
#: should not parse it again
_MEASURED: dict[str, Any] = {}


def _cost_path() -> Path:
    return Path(str(importlib.resources.files("workbench.prism") / "cost_table_cpu.json"))


def measured_cost_table(path: str | Path | None = None) -> Any:
    """The measured :class:`~workbench.prism.costs.CostTable` in ``path`` (default: the
    package's ``cost_table_cpu.json``, a copy of ``benchmarks/results/prism_cost_cpu.json``,
    which ``benchmarks/bench_prism_scheduler.py`` writes), read once per path.
    :class:`InputError` naming the file when it is missing, not a cost table, or not a
    *measured* one — the view prices nothing rather than something else under that name."""
    from workbench.prism.costs import CostTable

    path = Path(path) if path is not None else _cost_path()
    key = str(path)
    if key not in _MEASURED:
        try:
            table = CostTable.load(path)
        except InputError as e:
            raise InputError(f"no measured cost table: {e}; rerun {COST_SOURCE} and copy its "
                             f"benchmarks/results/prism_cost_cpu.json to "
                             f"workbench/prism/cost_table_cpu.json") from None
        if table.clock != "measured":
            raise InputError(f"no measured cost table: {key!r} is a {table.clock} one; rerun "
                             f"{COST_SOURCE}")
        _MEASURED[key] = table
    return _MEASURED[key]


class SchedulerSettings(param.Parameterized):
    """What the scheduler view compares and prices with, besides the scheduler's own knobs
    (:class:`~workbench.prism.scheduler.SchedulerKnobs`): menus from the registries."""

    policies = param.ListSelector(default=[], objects=[],
                                  doc="Scheduling policies simulated and drawn.")
    cost_table = param.Selector(
        default="modeled", objects=list(COST_TABLES),
        doc="Which C(m, b) prices the batches. modeled: the roofline of the hardware profile "
            "for the target model's sizes (a lower bound; profile and target model apply). "
            "measured: the embedded model's C(m, b) measured through the real runtime on the "
            "CPU of the machine that made the shipped table (workbench/prism/"
            "cost_table_cpu.json, by benchmarks/bench_prism_scheduler.py; batches up to its "
            "largest measured size), whatever machine runs the dashboard; profile and target "
            "model do not apply.")
    profile = param.Selector(default=None, objects=[],
                             doc="Hardware profile whose roofline prices C(m, b) (modeled).")
    target_model = param.Selector(default=None, objects=[],
                                  doc="Model whose sizes the cost table prices (modeled).")

    def __init__(self, **values: Any) -> None:
        from workbench.prism import scheduler as S
        from workbench.sim.profiles import available_profiles, available_target_models

        super().__init__()
        self.param.policies.objects = S.available()
        self.param.profile.objects = available_profiles()
        self.param.target_model.objects = available_target_models()
        self.param.update(policies=S.available(), profile=available_profiles()[0],
                          target_model=DEFAULT_TARGET)
        self.param.update(**values)


def _two(x: float) -> float:
    """``x`` to two significant digits (a default a person can read and type)."""
    return float(f"{x:.2g}")


def _token_max(mean: int, spread: float) -> int:
    """The largest token count the scheduler draws for ``mean`` (``scheduler._draw``)."""
    lo = max(1, round(mean * (1 - spread)))
    return max(lo, round(mean * (1 + spread)))


def full_batch_s(table: Any, knobs: Any) -> float:
    """S_full: one batch of ``knobs.batch_size`` of the longest requests at full quality."""
    B, N = knobs.batch_size, table.subexperts
    return (table.prefill(B, N, _token_max(knobs.prompt_tokens, knobs.token_spread))
            + (_token_max(knobs.out_tokens, knobs.token_spread) - 1) * table(B, N))


@dataclass(frozen=True)
class SchedulerStudy:
    """The scheduler view's numbers: per policy the metrics (``Schedule.metrics``) at every
    rate of ``rates`` (``sweep``) and at ``knobs.rate`` (``at``), and there the 0 … 100th
    percentiles of each latency of :data:`~workbench.viz.prism.LATENCIES` (``quantiles``)."""

    table: Any
    knobs: Any
    rates: list[float]
    sweep: dict[str, dict[str, list[float]]]
    at: dict[str, dict[str, Any]]
    quantiles: dict[str, dict[str, np.ndarray]]
    s_full: float
    elapsed_s: float


#: studies already simulated in this process: (table, knob values, policies) → study; every
#: new page simulated the same defaults again, 0.3 s idle and 2–5 s under load, on the event
#: loop (issue 37: page load)
_STUDIES: dict[tuple, SchedulerStudy] = {}


def _study_key(table: Any, knobs: Any, policies: list[str]) -> tuple:
    """What a study depends on: the table's contents, every knob value, the policies."""
    values = tuple(sorted((k, repr(v)) for k, v in knobs.param.values().items() if k != "name"))
    priced = (table.clock, tuple(table.sizes), int(table.prompt_tokens),
              np.asarray(table.decode_s).tobytes(), np.asarray(table.prefill_s).tobytes())
    return priced, values, tuple(policies)


def scheduler_study(table: Any, knobs: Any, policies: list[str]) -> SchedulerStudy:
    """Simulate each of ``policies`` priced by ``table`` at ``knobs.rate`` and at
    :data:`RATE_FACTORS` × μ_full, ``knobs.requests`` Poisson requests a point, one seed (the
    arrivals of two rates are one draw scaled). Deterministic: a study of the same table,
    knob values and policies is simulated once per process (the study returned then carries
    the caller's ``table`` and ``knobs``)."""
    key = _study_key(table, knobs, policies)
    done = _STUDIES.get(key)
    if done is not None:
        return replace(done, table=table, knobs=knobs)
    study = _simulate_study(table, knobs, policies)
    if len(_STUDIES) > 32:
        _STUDIES.clear()
    _STUDIES[key] = study
    return study


#: the scheduler figures of :data:`_STUDIES`, as dicts (a figure of subplots takes 0.5 s to
#: build under load; rebuilt from its dict, ≈ 20× less)
_STUDY_FIGURES: dict[tuple, dict] = {}


def _scheduler_figure(study: SchedulerStudy, policies: list[str]) -> go.Figure:
    """``scheduler_view_figure(study)``, built once per study (a new figure object each
    call: a pane may hold it)."""
    key = _study_key(study.table, study.knobs, policies)
    done = _STUDY_FIGURES.get(key)
    if done is not None:
        return figure_from_dict(done)
    fig = scheduler_view_figure(study)
    if len(_STUDY_FIGURES) > 32:
        _STUDY_FIGURES.clear()
    _STUDY_FIGURES[key] = fig.to_dict()
    return fig


def _simulate_study(table: Any, knobs: Any, policies: list[str]) -> SchedulerStudy:
    from workbench.prism import scheduler as S

    t0 = time.perf_counter()
    s_full = full_batch_s(table, knobs)
    mu = knobs.batch_size / s_full
    rates = sorted({*(f * mu for f in RATE_FACTORS), float(knobs.rate)})
    sweep, at, quantiles = {}, {}, {}
    for p in policies:
        rows = []
        for r in rates:
            sched = S.simulate(table, knobs.copy(policy=p, rate=r))
            rows.append(sched.metrics())
            if r == float(knobs.rate):
                at[p] = rows[-1]
                lat = {"ttft_s": sched.ttft_s, "tpot_s": sched.tpot_s, "e2e_s": sched.e2e_s}
                quantiles[p] = {k: np.percentile(v[np.isfinite(v)], np.arange(101))
                                if np.isfinite(v).any() else np.full(101, np.nan)
                                for k, v in lat.items()}
        sweep[p] = {k: [m[k] for m in rows] for k in ("throughput_rps", "goodput_rps",
                                                         "slo_attainment")}
    return SchedulerStudy(table, knobs, rates, sweep, at, quantiles, s_full,
                          time.perf_counter() - t0)


def _host(m: dict[str, Any]) -> str:
    """The measuring machine of a measured table's ``meta``, as far as it says."""
    h = m.get("host") if isinstance(m.get("host"), dict) else {}
    parts = [f"{h['cpus']} CPUs" if h.get("cpus") is not None else "CPUs not recorded"]
    if h.get("torch_threads") is not None:
        parts.append(f"{h['torch_threads']} torch thread"
                     f"{'' if h['torch_threads'] == 1 else 's'}")
    if h.get("machine"):
        parts.append(str(h["machine"]))
    return ", ".join(parts)


def _cost_short(table: Any) -> str:
    """The cost table in a few words (a figure title)."""
    m = table.meta
    if table.clock == "measured":
        return (f"measured ({m.get('model_id', 'model not recorded')} on {_host(m)}, "
                f"{str(m.get('date', 'date not recorded'))[:10]})")
    return f"{table.clock} ({m.get('profile', '')}, {m.get('target_model', '')})"


def _cost_label(table: Any) -> str:
    """How the cost table was made, for the note under the view's table: a measured one names
    the model, the measuring machine and the date (it is not this machine's), its statistic
    and how unsteady the machine was."""
    m = table.meta
    if table.clock == "modeled":
        how = ", ".join(f"{k}={m[k]}" for k in ("sub_choice", "kernel") if k in m)
        return (f"<i>modeled</i>: the roofline of {html.escape(str(m.get('profile_label')))} "
                f"for {html.escape(str(m.get('target_model')))}'s sizes (a lower bound"
                f"{'; ' + html.escape(how) if how else ''})")
    if table.clock == "measured":
        e = html.escape
        extra = []
        if isinstance(m.get("max_relative_iqr"), (int, float)):
            extra.append(f"IQR of the decode steps up to {m['max_relative_iqr']:.0%} of "
                         f"the median")
        load = m.get("loadavg_1min")
        if isinstance(load, list) and load and all(isinstance(x, (int, float)) for x in load):
            extra.append("1-min load average " + " → ".join(f"{x:.2g}" for x in load))
        return (f"<i>measured</i>: {e(str(m.get('model_id', 'model not recorded')))} through "
                f"the real runtime on the machine that made the shipped table ({e(_host(m))}; "
                f"{e(str(m.get('date', 'date not recorded')))}), not necessarily this one: "
                f"median of {m.get('repeats', '?')} rounds, batches of {table.sizes[0]} … "
                f"{table.max_batch}, prompts of {table.prompt_tokens} tokens scaled linearly"
                f"{' (' + e('; '.join(extra)) + ')' if extra else ''}")
    return f"<i>{html.escape(table.clock)}</i>"


def scheduler_view_figure(st: SchedulerStudy) -> go.Figure:
    k = st.knobs
    slo = {"ttft_s": k.ttft_slo_s, "tpot_s": k.tpot_slo_s, "e2e_s": k.e2e_slo_s}
    title = (f"QoS batch scheduler, simulated: {k.requests:,} requests a point · cost table "
             f"{_cost_short(st.table)}")
    fig = scheduler_figure(st.rates, st.sweep, st.quantiles, float(k.rate), slo, title)
    return finish_figure(fig, "scheduler", f"{k.rate}-{sorted(st.sweep)}")


_SHORT = {"ttft_s": "TTFT", "tpot_s": "TPOT", "e2e_s": "end-to-end"}


def _seconds(v: float | None) -> str:
    return "n/a" if v is None or not np.isfinite(v) else f"{v:.3g} s"


def scheduler_table_html(st: SchedulerStudy | None, message: str = "") -> str:
    """At the chosen rate, one row per policy: throughput, goodput, SLO attainment, P50/P99 of
    TTFT, TPOT and end-to-end latency, the level served; under it what was simulated and how
    the cost table was made (modeled, measured)."""
    if st is None:
        return f"<p class='wb-muted'>{html.escape(message)}</p>" if message else ""
    k = st.knobs
    head = ("<tr><th>policy</th><th>throughput</th><th>goodput</th><th>within SLO</th>"
            + "".join(f"<th>{_SHORT[key]} P50 / P99</th>" for key, _ in LATENCIES)
            + "<th>mean level</th><th>mean batch</th></tr>")
    best = max(m["goodput_rps"] for m in st.at.values())
    rows = []
    for p, m in st.at.items():
        cls = " class='wb-good'" if m["goodput_rps"] == best and len(st.at) > 1 else ""
        lat = "".join(f"<td>{_seconds(m[key]['p50'])} / {_seconds(m[key]['p99'])}</td>"
                      for key, _ in LATENCIES)
        rows.append(f"<tr><td>{html.escape(p)}</td><td>{m['throughput_rps']:.3g} req/s</td>"
                    f"<td{cls}>{m['goodput_rps']:.3g} req/s</td><td>{m['slo_attainment']:.1%}"
                    f"</td>{lat}<td>{m['mean_level']:.2f} of {st.table.subexperts}</td>"
                    f"<td>{m['mean_batch']:.1f}</td></tr>")
    pm, om = _token_max(k.prompt_tokens, k.token_spread), _token_max(k.out_tokens, k.token_spread)
    note = (f"<div class='wb-muted wb-ab-names' data-testid='scheduler-note'>at <b>"
            f"{k.rate:.3g}</b> req/s · simulated by "
            f"workbench.prism.scheduler: {k.requests:,} Poisson requests a point (seed "
            f"{k.seed}), k_min uniform in 1 … {st.table.subexperts}, prompts up to {pm} and "
            f"outputs up to {om} tokens · cost table C(m, b) {_cost_label(st.table)} · "
            f"S_full = {st.s_full:.3g} s (a full batch at full quality) · simulated in "
            f"{st.elapsed_s * 1e3:.0f} ms (measured)</div>")
    return (f"{note}<div class='wb-fit-box'><table class='wb-ab wb-fit wb-scheduler-table'>"
            f"<thead>{head}</thead><tbody>{''.join(rows)}</tbody></table></div>")


class SchedulerView:
    """The QoS scheduler view: ``settings`` (policies, which cost table — modeled or measured —
    and the modeled one's profile and target model) and ``knobs`` (a
    :class:`~workbench.prism.scheduler.SchedulerKnobs`; ``controls``: one ``pn.Param`` per knob
    of :data:`SCHEDULER_KNOBS`) → :func:`scheduler_study` → ``pane``
    (:func:`~workbench.viz.prism.scheduler_figure`) and ``table``. A new cost table (modeled /
    measured, profile, target model) resets the rate to μ_full and the limits to the
    benchmark's strict SLO: TTFT ≤ S_full, end-to-end ≤ 2·S_full, TPOT ≤ the largest C(b, m),
    b ≤ batch_size (C(batch_size, N) for a modeled table); timeout S_full / 2. While the
    measured table is chosen the profile and target-model widgets are disabled (they do not
    apply); a measured table that cannot be read is said in the view (``cost`` None).
    Independent of the shown run: nothing here runs a model."""

    view = "scheduler"

    def __init__(self, store: DataStore, height: int = 560, defer: bool = False) -> None:
        from workbench.prism.scheduler import SchedulerKnobs

        k = store.knobs
        self.settings = SchedulerSettings(
            profile=k.profile, target_model=DEFAULT_TARGET if k.target_model == "none"
            else k.target_model)
        self.knobs = SchedulerKnobs()
        self.study: SchedulerStudy | None = None
        self.message = ""
        self.redraws = 0
        self._busy = False
        self._ticks = TickQueue.of_session()  # served: waits for the kernels' warm-up
        specs = knob_widget_specs(self.knobs)
        self.controls = {n: knob_param(self.knobs, [n], widgets={n: {**specs[n], "name": label}},
                                       margin=0)
                         for n, label in SCHEDULER_KNOBS.items()}
        cbg = pn.widgets.CheckButtonGroup
        self.choices = {
            "policies": cbg.from_param(self.settings.param.policies,
                                       css_classes=["wb-scheduler-policies"],
                                       **names(cbg, "", "primary", "outline")),
            "cost_table": pn.widgets.Select.from_param(
                self.settings.param.cost_table, css_classes=["wb-scheduler-cost"],
                sizing_mode="stretch_width", **names(pn.widgets.Select, "cost table")),
            "profile": pn.widgets.Select.from_param(
                self.settings.param.profile, css_classes=["wb-scheduler-profile"],
                sizing_mode="stretch_width", **names(pn.widgets.Select, "hardware profile")),
            "target_model": pn.widgets.Select.from_param(
                self.settings.param.target_model, css_classes=["wb-scheduler-target"],
                sizing_mode="stretch_width", **names(pn.widgets.Select, "target model")),
        }
        self.pane = pn.pane.Plotly(placeholder_figure(self.view, "QoS batch scheduler",
                                                      "simulating …"),
                                   height=height, sizing_mode="stretch_width",
                                   config={"displaylogo": False, "responsive": True})
        self.table = pn.pane.HTML("", sizing_mode="stretch_width")
        self._retable()
        self.settings.param.watch(self._retable, ["cost_table", "profile", "target_model"])
        self.settings.param.watch(self.redraw, ["policies"])
        self.knobs.param.watch(self.redraw, list(SCHEDULER_KNOBS))
        if not defer:
            self.redraw()

    def _retable(self, *events: Any) -> None:
        from workbench.prism.costs import CostTable

        s = self.settings
        measured = s.cost_table == "measured"
        for name in ("profile", "target_model"):  # they price the modeled table only
            self.choices[name].disabled = measured
        self.cost_error = ""
        try:
            self.cost = measured_cost_table() if measured else \
                CostTable.modeled(s.profile, s.target_model)
        except WorkbenchError as e:  # a missing or broken shipped table: said, not raised
            self.cost, self.cost_error = None, str(e)
        if self.cost is None:
            if events:
                self.redraw()
            return
        k = self.knobs
        self._busy = True
        try:
            k.batch_size = min(k.batch_size, self.cost.max_batch)
            s_full = full_batch_s(self.cost, k)
            mu = k.batch_size / s_full
            # the largest step of a batch up to batch_size at any level: a measured row is
            # noisy (on the shipped CPU table C(16, N) is the cheapest level), and a limit
            # below some levels' price would judge levels, not the scheduler
            # (bench_prism_scheduler.py's TPOT limit); C(batch_size, N) for a modeled table
            tpot = float(self.cost.grid(k.batch_size)[0][:, 1:].max())
            k.param.update(rate=_two(mu), ttft_slo_s=_two(s_full), e2e_slo_s=_two(2 * s_full),
                           timeout_s=_two(s_full / 2), tpot_slo_s=_two(tpot))
            self.controls["rate"]._widgets["rate"].param.update(start=_two(mu / 20),
                                                                end=_two(3 * mu))
        finally:
            self._busy = False
        if events:
            self.redraw()

    def redraw(self, *events: Any) -> None:
        if self._busy:
            return
        self.study, self.message = None, ""
        if self._ticks is not None and self._ticks.warming(id(self), self.redraw):
            self.message = WARMING  # its first simulation compiles
            self.pane.object = placeholder_figure(self.view, "QoS batch scheduler", WARMING)
            return
        try:
            if self.cost is None:
                raise InputError(self.cost_error)
            self.study = scheduler_study(self.cost, self.knobs, list(self.settings.policies))
            fig = _scheduler_figure(self.study, list(self.settings.policies)) \
                if self.study.at else placeholder_figure(
                    self.view, "QoS batch scheduler", "pick a policy to simulate")
        except WorkbenchError as e:
            self.study, self.message = None, str(e)
            fig = placeholder_figure(self.view, "QoS batch scheduler", html.escape(str(e)))
        except Exception as e:  # never into Panel: say what happened
            log.exception("scheduler view")
            self.study, self.message = None, f"could not simulate: {type(e).__name__}: {e}"
            fig = placeholder_figure(self.view, "QoS batch scheduler",
                                     html.escape(self.message[:200]))
        self.pane.object = fig
        self.table.object = scheduler_table_html(self.study if self.study and self.study.at
                                                 else None, self.message)
        self.redraws += 1

    def __panel__(self) -> pn.pane.Plotly:
        return self.pane
