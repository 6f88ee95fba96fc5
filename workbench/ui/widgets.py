"""Widgets generated from the knob classes, the view filters and the request inputs.

Knob widgets are never written by hand: :func:`knob_panels` makes one ``pn.Param`` per group of
``Knobs().groups`` (the knob classes refresh their policy ``Selector`` menus from the registries
on instantiation, so a policy registered later shows up in its menu with no UI change). Numeric
knobs with soft bounds become editable sliders (the slider spans the soft bounds, the text box
takes any number); numeric knobs that may be ``None`` ("no limit") become number boxes, which
can be left empty; every widget's tooltip is the knob's ``doc``. Every knob widget sets its knob
through the knob's own check (:func:`knob_param`): a value the knob refuses is said under the
widget, in the CLI's words, and no run starts while one is held.

The knobs of :data:`VISMMOE_KNOBS` (compression, β, λ, pinned layers) sit in a prominent
"VisMMOE" card at the top of the knob sidebar (:func:`vismmoe_panel`): each is a ``pn.Param``
over the group that declares it, so it drives the same param object, and :func:`knob_cards`
leaves it out of its group's card — every knob has exactly one widget.

The replay view's knobs (prefetch, pricing, hybrid, …: :func:`replay_knob_panels`) are built
the same way, over a second :class:`~workbench.knobs.Knobs` (``DataStore.replay_knobs``, the
shown run's own knobs), so they edit what is replayed, never the next run.
"""

from __future__ import annotations

import html
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import panel as pn
import param

from workbench.errors import InputError, KnobError, WorkbenchError
from workbench.knobs import Knobs, check_value
from workbench.ui.datastore import (MAX_UPLOAD_BYTES, DataStore, demo_inputs, hold_refusal,
                                    resolve_run_path, upload_limit_text)

__all__ = ["knob_panels", "knob_cards", "vismmoe_panel", "filter_widgets", "input_widgets",
           "runs_widgets", "replay_widgets", "replay_knob_panels", "card", "make", "names",
           "ImageDropper", "knob_param",
           "VISMMOE_KNOBS", "MAIN_GROUPS"]

log = logging.getLogger(__name__)

CARD_TITLE_STYLE = (".wb-card-title { font-weight: 600; font-size: 15px; color: #1f2937; "
                    "text-align: left; padding: 2px 0; }")
LABEL_STYLE = ".wb-label { color: #374151; font-size: 12px; font-weight: 600; }"
#: groups whose card starts open
OPEN_GROUPS = ("cache", "generation")
#: knobs first in the prominent VisMMOE card, in this order (the policy, β and λ are the knobs a
#: user reaches for first), with the label each gets there; the rest of their group (α) follows
#: in the same card. VisMMOE's other knob, the pinned prefix, is a cache knob: Expert cache card.
VISMMOE_KNOBS: dict[str, str] = {
    "compression": "Policy",
    "beta": "β — keep ratio of visual tokens",
    "lam": "λ — saliency vs expert affinity",
}
#: the knob group the VisMMOE card shows whole (no other card repeats it)
VISMMOE_GROUP = "compression"
#: knob groups whose widgets sit in a card of the main column beside the views they drive, not
#: in the sidebar: Elastic experts (``workbench.ui.prism.prism_knob_widgets``)
MAIN_GROUPS = ("prism",)
VISMMOE_TITLE = "VisMMOE token compression"


def names(cls: type, label: str | None = None, color: str | None = None,
          variant: str | None = None) -> dict[str, Any]:
    """Keyword arguments with Panel ≥ 1.9 names (``label``, ``color``, ``variant``), or the
    older ``name``, ``button_type``, ``button_style`` where a Panel release lacks them."""
    kw: dict[str, Any] = {}
    for new, old, value in (("label", "name", label), ("color", "button_type", color),
                            ("variant", "button_style", variant)):
        if value is not None:
            kw[new if new in cls.param else old] = value
    return kw


def make(cls: type, label: str | None = None, color: str | None = None,
         variant: str | None = None, **kw: Any) -> Any:
    """``cls(**kw)`` with :func:`names` for the label and colours."""
    return cls(**names(cls, label, color, variant), **kw)


def knob_widget_specs(group: param.Parameterized) -> dict[str, Any]:
    specs: dict[str, Any] = {}
    for name in group.param:
        if name == "name":
            continue
        p = group.param[name]
        spec: dict[str, Any] = {"css_classes": [f"wb-knob-{name}"],
                                "sizing_mode": "stretch_width"}
        soft = getattr(p, "softbounds", None)
        if isinstance(p, param.Integer) and p.allow_None:
            spec["type"] = pn.widgets.IntInput  # a slider cannot hold None ("no limit")
            spec["placeholder"] = "none"
        elif isinstance(p, param.Number) and p.allow_None:
            spec["type"] = pn.widgets.FloatInput
            spec["placeholder"] = "none"
        elif isinstance(p, param.Integer) and soft is not None:
            spec["type"] = pn.widgets.EditableIntSlider
        elif isinstance(p, param.Number) and soft is not None:
            spec["type"] = pn.widgets.EditableFloatSlider
        if "type" in spec and "description" in spec["type"].param:
            spec["description"] = p.doc  # pn.Param sets it on the widgets it picks itself
        specs[name] = spec
    return specs


#: style of the message under a knob widget that holds a refused value
REFUSED_STYLE = [".alert { overflow-wrap: anywhere; font-size: 12px; padding: 4px 8px; "
                 "margin: 0; }"]

#: widgets one types a value into: they can hold a value their knob refuses
TYPED_WIDGETS = (pn.widgets.IntInput, pn.widgets.FloatInput, pn.widgets.TextInput,
                 pn.widgets.EditableIntSlider, pn.widgets.EditableFloatSlider,
                 pn.widgets.EditableRangeSlider)


def knob_param(group: param.Parameterized, parameters: list[str],
               widgets: dict[str, Any] | None = None, **kw: Any) -> pn.Param:
    """``pn.Param(group, parameters, widgets=…)`` (default: :func:`knob_widget_specs`) whose
    widgets set a knob only through the knob's own check (:func:`workbench.knobs.check_value`,
    the CLI's messages). A value the knob refuses stays in the widget, as typed, with the
    knob's message right under it (CSS class ``wb-refused-<name>``), and is held
    (:func:`~workbench.ui.datastore.hold_refusal`: a run refuses to start while any is held);
    the knob keeps its last good value. Correcting the widget clears both.

    Why not Panel's own link: it sets the parameter unchecked, so a refused value raised a
    ``ValueError`` traceback into the server log, the knob silently kept its old value and the
    next run used it while the box showed the refused one. The widgets' own hard bounds go
    too (the knob's check is the one rule, and speaks): with them the widget refused the
    value itself, again without a word."""
    specs = knob_widget_specs(group) if widgets is None else widgets
    panel = pn.Param(group, parameters=parameters, widgets={n: specs[n] for n in parameters
                                                            if n in specs},
                     show_name=False, **{"sizing_mode": "stretch_width", **kw})
    for name in parameters:
        widget = panel._widgets.get(name)
        if widget is not None and "value" in widget.param:
            _check_widget(panel, group, name, widget)
    return panel


def _check_widget(panel: pn.Param, group: param.Parameterized, name: str, widget: Any) -> None:
    for w in [w for w in panel._internal_callbacks if getattr(w, "inst", None) is widget
              and tuple(w.parameter_names) == ("value",)
              and getattr(w.fn, "__name__", "") == "link_widget"]:
        widget.param.unwatch(w)  # the unchecked widget → knob link (see knob_param)
        panel._internal_callbacks.remove(w)
    for bound in ("fixed_start", "fixed_end"):  # editable sliders: the text box's hard bounds
        if bound in widget.param and getattr(widget, bound) is not None:
            setattr(widget, bound, None)
    if isinstance(widget, (pn.widgets.IntInput, pn.widgets.FloatInput)):
        widget.param.update(start=None, end=None)
    shown: list[pn.pane.Alert] = []

    def make() -> None:
        shown.append(pn.pane.Alert("", alert_type="danger", margin=(0, 10, 6, 10),
                                   sizing_mode="stretch_width", stylesheets=REFUSED_STYLE,
                                   css_classes=[f"wb-refused-{name}", "wb-refused"],
                                   visible=False))
        box = panel._widget_box
        at = box.objects.index(widget) + 1 if widget in box.objects else len(box)
        box.insert(at, shown[0])

    # A box one types into gets its alert now, hidden, so that a refusal is one property
    # change: made at the first refusal, the pane (a new model in the page's layout) cost
    # 0.3 s on the server and 0.25 s of the page's layout, half of the time a first refusal
    # took to be said (issue 37, a traced session). Other widgets (menus, switches) hold
    # values their options allow and make theirs when first needed: every pane is page weight.
    if isinstance(widget, TYPED_WIDGETS):
        make()

    def say(text: str | None) -> None:
        if not shown and text is None:
            return
        if not shown:
            make()
        if text is None:
            shown[0].visible = False
        else:
            shown[0].param.update(object=html.escape(text), visible=True)

    def on_value(event: Any) -> None:
        try:
            value = check_value(group.param[name], name, event.new)
        except KnobError as e:
            hold_refusal(group, name, str(e))
            say(f"refused: {e}")
            return
        hold_refusal(group, name, None)
        say(None)
        if getattr(group, name) != value or type(getattr(group, name)) is not type(value):
            group.param.update(**{name: value})

    widget.param.watch(on_value, "value")


def card(*objects: Any, title: str, **kw: Any) -> pn.Card:
    """A card whose title is left-aligned whether or not it collapses."""
    head = pn.pane.HTML(f"<div class='wb-card-title'>{title}</div>", margin=(0, 4),
                        stylesheets=[CARD_TITLE_STYLE], sizing_mode="stretch_width")
    return pn.Card(*objects, header=head, title=title, **{"sizing_mode": "stretch_width",
                                                          "margin": (4, 0), **kw})


def replay_only_choices(group: param.Parameterized, name: str) -> list[str]:
    """The choices of registry-backed knob ``name`` whose policy needs the future (Belady, the
    oracle prefetcher): trace replay can run them, a live run cannot."""
    registry = getattr(type(group), "_registries", {}).get(name)
    if not hasattr(registry, "available"):  # no registry, or a plain list of names
        return []
    return [n for n in registry.available() if "future" in getattr(registry.get(n), "needs", ())]


def knob_panels(knobs: Knobs, exclude: Iterable[str] = (), live: bool = False,
                groups: Iterable[str] | None = None) -> dict[str, pn.Param]:
    """One ``pn.Param`` per knob group, keyed like ``knobs.groups`` (editing a widget sets the
    knob on ``knobs``; param validates it). Knobs named in ``exclude`` get no widget here; a
    group left with none is omitted. ``live``: the knobs of a live run, whose menus show the
    replay-only choices (:func:`replay_only_choices`) disabled, so they cannot be picked and
    refused only after Run. ``groups``: only these group keys (default: every group)."""
    skip = set(exclude)
    only = None if groups is None else set(groups)
    panels = {}
    for key, group in knobs.groups.items():
        if only is not None and key not in only:
            continue
        shown = [n for n in group.knob_names() if n not in skip]
        if shown:
            panel = knob_param(group, shown, name=getattr(group, "title", key) or key)
            for name in shown if live else ():
                off = replay_only_choices(group, name)
                widget = panel._widgets.get(name)
                if off and widget is not None and "disabled_options" in widget.param:
                    widget.disabled_options = off
            panels[key] = panel
    return panels


def vismmoe_panel(knobs: Knobs, labels: dict[str, str] | None = None) -> pn.Column:
    """The prominent knobs (default :data:`VISMMOE_KNOBS`, name → label), one widget each in
    that order: a ``pn.Param`` of just that knob over the group that declares it, so the widget
    and every other view of the knob share one param object. Selector knobs with at most six
    choices become button groups (one click, all choices visible), numeric ones the sliders of
    :func:`knob_panels`. ``panel._wb_widgets`` maps knob name → widget. An unknown knob name
    raises :class:`~workbench.errors.KnobError` listing the known ones."""
    labels = dict(VISMMOE_KNOBS if labels is None else labels)
    owners = {n: g for g in knobs.groups.values() for n in g.knob_names()}
    unknown = [n for n in labels if n not in owners]
    if unknown:
        raise KnobError(f"unknown knob(s) {', '.join(map(repr, unknown))} for the VisMMOE "
                        f"card; known knobs: {', '.join(sorted(owners))}")
    rows: list[Any] = []
    widgets: dict[str, Any] = {}
    for name, label in labels.items():
        group = owners[name]
        spec = dict(knob_widget_specs(group)[name])
        p = group.param[name]
        buttons = isinstance(p, param.Selector) and len(p.objects) <= 6
        if buttons:
            spec.update(type=pn.widgets.RadioButtonGroup, **names(
                pn.widgets.RadioButtonGroup, color="primary", variant="outline"))
            if "description" in pn.widgets.RadioButtonGroup.param:
                spec["description"] = p.doc
            rows.append(pn.pane.HTML(f"<div class='wb-label'>{html.escape(label)}</div>",
                                     margin=(4, 10, 0, 10), height=18,
                                     stylesheets=[LABEL_STYLE]))
        else:
            spec["name"] = label
        panel = knob_param(group, [name], widgets={name: spec}, margin=0)
        widgets[name] = panel._widgets[name]
        rows.append(panel)
    col = pn.Column(*rows, sizing_mode="stretch_width", css_classes=["wb-vismmoe"])
    col._wb_widgets = widgets
    return col


def knob_cards(knobs: Knobs, skip: Iterable[str] = MAIN_GROUPS) -> list[pn.Card]:
    """One card per knob group, each knob in exactly one card: the VisMMOE card first (open:
    :func:`vismmoe_panel`, then the rest of :data:`VISMMOE_GROUP`), then :func:`knob_panels` of
    the other groups in collapsible cards titled by the group's ``title`` (open:
    :data:`OPEN_GROUPS`). The groups of ``skip`` (default :data:`MAIN_GROUPS`) get no card
    here: the main column shows them."""
    shown = {k for k, g in knobs.groups.items()
             if set(g.knob_names()) - set(VISMMOE_KNOBS) and k not in skip}
    panels = knob_panels(knobs, exclude=VISMMOE_KNOBS, live=True,
                         groups={VISMMOE_GROUP, *OPEN_GROUPS})
    rest = panels.pop(VISMMOE_GROUP, None)
    top = card(vismmoe_panel(knobs), *([rest] if rest is not None else []),
               title=VISMMOE_TITLE, collapsible=False, css_classes=["wb-vismmoe-card"])
    cards = [top]
    for key, group in knobs.groups.items():
        if key == VISMMOE_GROUP or key not in shown:
            continue
        title = getattr(group, "title", key) or key
        if key in panels:
            cards.append(card(panels[key], title=title))
        else:
            cards.append(_lazy_card(knobs, key, title))
    return cards


def _lazy_card(knobs: Knobs, key: str, title: str) -> pn.Card:
    """A collapsed card whose knob widgets are built when it is first opened: every widget is
    a set of Bokeh models the page must build and send, and the closed cards held ~40 % of
    them (``benchmarks/bench_dashboard.py``, page load)."""
    c = card(title=title, collapsed=True)

    def fill(*events: Any) -> None:
        if not c.collapsed and not c.objects:
            c.objects = [knob_panels(knobs, exclude=VISMMOE_KNOBS, live=True, groups=[key])[key]]

    c.param.watch(fill, "collapsed")
    return c


class _RangeLink:
    """Keeps an IntRangeSlider and ``store.<attr>`` in step: the slider spans :meth:`bounds`;
    a full-span slider means ``None`` (the whole span, which may grow with a live run)."""

    attr = ""
    watch: tuple[str, ...] = ()

    def __init__(self, store: DataStore, slider: pn.widgets.IntRangeSlider) -> None:
        self.store, self.slider = store, slider
        self._busy = False
        slider.param.watch(self._from_slider, "value_throttled")
        store.param.watch(self._from_store, [*self.watch, self.attr])
        self._from_store()

    def bounds(self) -> tuple[int, int] | None:
        """(first, last) value the slider may take; None disables it."""
        raise NotImplementedError

    def _skip(self, events: tuple) -> bool:
        return False

    def _from_slider(self, event: Any) -> None:
        if self._busy or event.new is None:
            return
        lo, hi = int(event.new[0]), int(event.new[1])
        full = (lo, hi) == (self.slider.start, self.slider.end)
        setattr(self.store, self.attr, None if full else (lo, hi))

    def _from_store(self, *events: Any) -> None:
        if self._skip(events):
            return
        b = self.bounds()
        self._busy = True
        try:
            if b is None:
                self.slider.param.update(disabled=True)
                return
            lo, hi = b
            end = max(hi, lo + 1)
            value = getattr(self.store, self.attr) or (lo, end)
            value = (min(max(value[0], lo), end), min(max(value[1], lo), end))
            self.slider.param.update(start=lo, end=end, value=value, disabled=hi <= lo)
        finally:
            self._busy = False


class _StepsLink(_RangeLink):
    """``store.step_range`` over the shown run's steps."""

    attr, watch = "step_range", ("dataset",)

    def bounds(self) -> tuple[int, int]:
        ds = self.store.dataset
        return 0, (int(ds.sizes["step"]) if ds is not None else 0) - 1


def filter_widgets(store: DataStore) -> dict[str, pn.widgets.Widget]:
    """View filters bound to the store: modality, phase, clock (button groups) and step range
    (slider; applied when released)."""
    rbg = pn.widgets.RadioButtonGroup
    w = {
        "modality": rbg.from_param(store.param.modality, css_classes=["wb-filter-modality"],
                                   width=200, **names(rbg, "tokens", "primary", "outline")),
        "phase": rbg.from_param(store.param.phase, css_classes=["wb-filter-phase"], width=230,
                                **names(rbg, "phase", "primary", "outline")),
        "clock": rbg.from_param(store.param.clock, css_classes=["wb-filter-clock"], width=190,
                                **names(rbg, "timeline clock", "primary", "outline")),
        "steps": make(pn.widgets.IntRangeSlider, "steps", css_classes=["wb-filter-steps"],
                      start=0, end=1, value=(0, 1), step=1, disabled=True, min_width=200,
                      sizing_mode="stretch_width"),
    }
    w["steps"]._wb_link = _StepsLink(store, w["steps"])  # keep the link alive with the widget
    return w


#: unreadable stores named in the Runs card at most (the rest are counted)
MAX_PROBLEMS_SHOWN = 8


def _message(kind: str = "danger") -> pn.pane.Alert:
    return pn.pane.Alert("", alert_type=kind, visible=False, sizing_mode="stretch_width",
                         margin=(4, 0))


class ImageDropper(pn.widgets.FileDropper):
    """The image upload: Panel's ``FileDropper`` (FilePond) with a size limit.

    The limit is checked **in the browser before anything is sent** (FilePond's
    ``max_file_size``: the file is refused with "File is too large · Maximum file size is
    5 MB"), and files travel in chunks well below Bokeh's websocket message limit, so a large
    file can never drop the session (a plain ``FileInput`` sends the whole file in one message:
    50 MB closed the websocket with no word). A client that sends more anyway is cut off on the
    server as soon as its chunks pass the limit: ``on_refused(name, size)`` is called and the
    chunks are dropped. ``on_file(name, data)`` is called for each file received whole."""

    #: bytes per websocket message of an upload (Bokeh's default limit is 20 MB)
    CHUNK_BYTES = 1_000_000

    def __init__(self, on_file: Callable[[str, Any], None],
                 on_refused: Callable[[str, int], None], max_bytes: int = MAX_UPLOAD_BYTES,
                 on_arriving: Callable[[str | None], None] | None = None,
                 **params: Any) -> None:
        params.setdefault("max_file_size", f"{max_bytes // 1000}KB")  # FilePond: 1 KB = 1000 B
        params.setdefault("chunk_size", min(self.CHUNK_BYTES, max(max_bytes, 1)))
        super().__init__(**params)
        self._wb_max, self._wb_on_file, self._wb_on_refused = max_bytes, on_file, on_refused
        #: told of every chunk admitted (its file's name) and of the end (None)
        self._wb_on_arriving = on_arriving or (lambda name: None)
        self._wb_sizes: dict[str, int] = {}
        self._wb_seen: dict[str, int] = {}
        self.param.watch(self._wb_changed, "value")

    def _process_event(self, event: Any) -> None:
        try:
            if not self._wb_admit(event):
                return
            super()._process_event(event)
        except Exception:  # a malformed event from a client: dropped, never into Panel
            log.exception("upload event dropped")
            self._wb_on_arriving(None)

    def _wb_admit(self, event: Any) -> bool:
        """Count an upload chunk against the limit; False drops it (and its file)."""
        data = getattr(event, "data", None)
        if getattr(event, "event_name", None) != "upload_event":
            return True
        if not isinstance(data, dict) or not isinstance(data.get("data"), (bytes, str)):
            return False
        name = str(data.get("name", ""))
        size = len(data["data"])
        if data.get("chunk") == 1:
            self._wb_sizes[name] = 0
        elif name not in self._wb_sizes:
            return False  # the rest of a refused file, or chunks out of order
        got = self._wb_sizes[name] + size
        too_many = sum(self._wb_sizes.values()) + size > 2 * self._wb_max  # many at once
        if got > self._wb_max or too_many:
            for n in list(self._wb_sizes) if too_many else [name]:
                del self._wb_sizes[n]
                getattr(self, "_file_buffer", {}).pop(n, None)
            self._wb_on_arriving(None)
            self._wb_on_refused(name, got)
            return False
        self._wb_sizes[name] = got
        self._wb_on_arriving(name)
        if data.get("chunk") == data.get("total_chunks"):
            del self._wb_sizes[name]
        return True

    def _wb_changed(self, event: Any) -> None:
        value = event.new or {}
        new = [(n, d) for n, d in value.items() if self._wb_seen.get(n) != id(d)]
        self._wb_seen = {n: id(d) for n, d in value.items()}
        if new:
            self._wb_on_arriving(None)
        for name, data in new[-1:]:  # one image is the input: the last one received
            self._wb_on_file(name, data)
        if new:  # accepted files live in the workspace: hold no bytes here
            value.clear()
            self.mime_type.clear()
            self._wb_seen.clear()


EMBEDDED_LABEL = "embedded default model"
#: value of the demo menu's entry for the uploaded image (demos are 0…, text only −1)
UPLOADED = -2


def model_widgets(store: DataStore) -> dict[str, Any]:
    """Which model the next run loads: a menu of the embedded default and the checkpoint
    folders the workspace knows (:func:`~workbench.ui.datastore.known_models`, re-listed as runs
    come and go), and a box for any other local folder (checked: it must hold a config.json;
    the full check happens when the run loads it). Writes ``store.model`` (None: the embedded
    default)."""
    from workbench.ui.datastore import known_models

    menu = make(pn.widgets.Select, "Model", options={EMBEDDED_LABEL: ""}, value="",
                sizing_mode="stretch_width", css_classes=["wb-model"])
    other = make(pn.widgets.TextInput, "Other model folder (press Enter)",
                 placeholder="/path/to/checkpoint", sizing_mode="stretch_width")
    msg = _message()

    def options(extra: str | None = None) -> dict[str, str]:
        paths = [p for p in [extra, store.model, *known_models(store.workspace_path, store.runs)] if p]
        opts = {EMBEDDED_LABEL: ""}
        for p in dict.fromkeys(paths):
            opts[f"{Path(p).name} — {p}"[:120]] = p
        return opts

    def sync(*events: Any) -> None:
        menu.options = options()
        menu.value = store.model or ""

    def say(text: str, kind: str) -> None:
        msg.param.update(object=text, alert_type=kind, visible=bool(text))

    def on_menu(event: Any) -> None:
        store.model = event.new or None

    def on_other(event: Any) -> None:
        path = (event.new or "").strip()
        if not path:
            return
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            say(f"{html.escape(path)} is not a checkpoint folder (it has no config.json)", "danger")
            return
        menu.options = options(str(folder))
        menu.value = str(folder)  # → on_menu sets store.model
        say(f"the next run loads {html.escape(str(folder))}", "info")

    menu.param.watch(on_menu, "value")
    other.param.watch(on_other, "value")
    store.param.watch(sync, ["runs"])
    sync()
    return {"model": menu, "other": other, "message": msg}


def demo_of_run(ds: Any, demos: list[dict[str, Any]]) -> int | None:
    """Index in ``demos`` of the request the run ``ds`` served (same prompt, same image file or
    both text-only); None when it served none of them (or ``ds`` is None)."""
    if ds is None:
        return None
    from workbench.telemetry.metadata import RunMetadata

    try:
        meta = RunMetadata.from_attrs(ds.attrs, strict=False)
        prompt, images = meta.prompt, [Path(p).resolve() for p in meta.images or []]
    except Exception:  # an odd store: no match, nothing breaks
        return None
    for i, d in enumerate(demos):
        image = [Path(d["image"]).resolve()] if d.get("image") else []
        if d.get("prompt") == prompt and image == images:
            return i
    return None


def input_widgets(store: DataStore, demo_folder: Any = None) -> dict[str, Any]:
    """Request inputs: demo selector, image upload (checked: PNG/JPEG, ≤ 5 MB, refused in the
    browser when larger), image preview, prompt box, optional run name; all write to the
    store."""
    from workbench.models.loading import takes_images

    every = demo_inputs(demo_folder)
    demos: list[dict] = []  # the menu's demos: the ones the chosen model takes (fit_model)
    demo = make(pn.widgets.Select, "Demo input", options={"(text only, no image)": -1},
                value=-1, sizing_mode="stretch_width")
    upload_msg = _message()
    upload_msg.css_classes = ["wb-upload-message"]

    def on_file(name: str, data: Any) -> None:
        try:
            uploaded["path"] = str(store.accept_upload(data, name))
            shown_upload(name)
        except WorkbenchError as e:
            refuse(str(e))
            return
        except Exception as e:  # never into Panel: say what happened
            log.exception("upload %r", name)
            refuse(f"the upload could not be used: {type(e).__name__}: {str(e)[:200]}")
            return
        upload_msg.visible = False

    def on_refused(name: str, size: int) -> None:
        refuse(f"{name[:80]!r} is larger than {upload_limit_text()}; images up to "
               f"{upload_limit_text()} are accepted")

    def refuse(message: str | None) -> None:
        """Say why an upload was refused (``None``: a new one is arriving, say nothing). FilePond
        marks a file "Upload complete" (green) once its bytes arrived, whatever the server then
        made of them: a refused file's entry is hidden (CSS class ``wb-upload-refused``), so
        the red refusal is the only word on it."""
        classes = [c for c in upload.css_classes if c != "wb-upload-refused"]
        upload.css_classes = classes + (["wb-upload-refused"] if message else [])
        if message:
            upload_msg.param.update(object=html.escape(message), visible=True)

    def on_arriving(name: str | None) -> None:
        if name is not None and "wb-upload-refused" in upload.css_classes:
            refuse(None)
        store.upload_arriving(name)

    upload = ImageDropper(on_file, on_refused, on_arriving=on_arriving,
                          accepted_filetypes=[".png", ".jpg", ".jpeg", "image/png",
                                              "image/jpeg"],
                          multiple=False, previews=[], layout="compact",
                          sizing_mode="stretch_width", css_classes=["wb-upload"],
                          stylesheets=[":host(.wb-upload-refused) .filepond--item "
                                       "{ display: none; }"])
    hint = pn.pane.HTML("", margin=(0, 10))
    preview = pn.pane.Image(None, height=140, sizing_mode="fixed", width=140,
                            visible=False, margin=(4, 10))
    prompt = pn.widgets.TextAreaInput.from_param(
        store.param.prompt, **names(pn.widgets.TextAreaInput, "Prompt"),
        placeholder="Ask about the image …", rows=2, auto_grow=True, max_rows=6,
        sizing_mode="stretch_width")
    run_name = make(pn.widgets.TextInput, "Run name (optional)", placeholder="run-<time>",
                    sizing_mode="stretch_width")
    batch_size = pn.widgets.IntInput.from_param(
        store.param.batch_size, **names(pn.widgets.IntInput, "Batch (requests together)"),
        # the box takes the row less the mix menu: at a fixed 150 px its label ran into the
        # mix menu's label
        sizing_mode="stretch_width", min_width=150, description=store.param.batch_size.doc,
        css_classes=["wb-batch-size"])
    batch_mix = pn.widgets.Select.from_param(
        store.param.batch_mix, **names(pn.widgets.Select, "Batch mix"), width=110,
        description=store.param.batch_mix.doc, css_classes=["wb-batch-mix"])

    uploaded: dict[str, str | None] = {"path": None}  # the last image uploaded, as stored

    def shown_upload(name: str) -> None:
        """The menu names the uploaded image as the input (it named the demo before)."""
        label = f"(uploaded) {str(name)[:60]}"
        opts = {k: v for k, v in demo.options.items() if v != UPLOADED}
        demo.options = {**opts, label: UPLOADED}
        demo.value = UPLOADED

    def on_demo(event: Any) -> None:
        i = event.new
        if i == UPLOADED:  # the uploaded image (again)
            if uploaded["path"] and store.image != uploaded["path"]:
                store.param.update(image=uploaded["path"])
            return
        if i is None or i < 0:
            store.param.update(image=None)
        else:
            store.use_demo(demos[i])

    def on_image(*events: Any) -> None:
        preview.param.update(object=store.image, visible=bool(store.image))

    forced = {"text": False}  # batch_mix set to text for a text-only model (not by the user)

    def fit_model(*_: Any) -> None:
        """The inputs the chosen model takes: a text-only one gets the text-only demos, text
        batches and no image upload; a vision-language one all of them (on every change of
        the model, before the next run)."""
        vision = takes_images(store.model)
        shown = demos[demo.value] if demos and demo.value is not None and demo.value >= 0 \
            else None
        if not vision and demo.value == UPLOADED:
            demo.value = -1
        demos[:] = every if vision else [d for d in every if not d.get("image")]
        demo.options = {"(text only, no image)": -1,
                        **{d["label"]: i for i, d in enumerate(demos)},
                        **{k: v for k, v in demo.options.items() if v == UPLOADED and vision}}
        upload.visible = vision
        hint.object = (f"<small class='wb-muted'>or upload a PNG/JPEG (≤ "
                       f"{upload_limit_text()})</small>" if vision else
                       "<small class='wb-muted'>a text-only model: text requests only</small>")
        if not vision:
            if store.batch_mix != "text":
                forced["text"] = True
                store.batch_mix = "text"
            if store.image is not None:  # the shown request has an image: a text one instead
                store.param.update(image=None)
                if demos:  # (index 0 may already be the value: the menu changed under it)
                    demo.value = 0
                    store.use_demo(demos[0])
        elif forced["text"]:
            forced["text"] = False
            store.batch_mix = store.param.batch_mix.default
        if shown is not None and shown in demos:
            demo.value = demos.index(shown)
        elif demo.value not in demo.options.values():
            demo.value = 0 if demos else -1

    fit_model()  # the first menu, before on_demo watches it (shown, not yet applied)
    demo.value = 0 if demos else -1
    demo.param.watch(on_demo, "value")
    store.param.watch(on_image, "image")
    store.param.watch(fit_model, "model")
    # the first screen: the request of the shown run when it is a demo's (its expected answer
    # then checks the shown answer), else the first demo
    shown = demo_of_run(store.dataset, demos)
    if shown is not None:
        demo.value = shown  # on_demo takes it
    elif demos and not store.prompt:
        store.use_demo(demos[0])
    on_image()
    return {"demo": demo, "upload": upload, "upload_message": upload_msg,
            "upload_hint": hint,
            "preview": preview, "prompt": prompt, "run_name": run_name,
            "batch_size": batch_size, "batch_mix": batch_mix}


def export_zip(store: DataStore) -> Any:
    """A zip (``BytesIO``) of ``ds.moe.export`` of the shown run: its tables (CSV, JSON) and
    figures (self-contained HTML), derived from its store; an empty zip holding only
    ``README.txt`` when no run is shown (the button must never raise into Panel)."""
    import io
    import tempfile
    import zipfile

    from workbench.analysis import open_run  # ds.moe registered

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        try:
            if not store.run_name:
                raise InputError("no run is shown; open or run one first")
            path = resolve_run_path(store.workspace_path, store.run_name)
            with tempfile.TemporaryDirectory(prefix="wb-export-") as tmp:
                for f in open_run(path).moe.export(tmp):
                    z.write(f, arcname=f"{path.stem}/{f.name}")
        except Exception as e:  # said in the zip and the log, never raised into the page
            log.warning("export of %s failed: %s", store.run_name, e)
            z.writestr("README.txt", f"nothing exported: {type(e).__name__}: {e}\n")
    buf.seek(0)
    return buf


def runs_widgets(store: DataStore) -> dict[str, Any]:
    """Past runs of the workspace (newest first) with Open, and the A/B baseline buttons."""
    select = make(pn.widgets.Select, "Runs in the workspace", options={},
                  sizing_mode="stretch_width")
    btn = pn.widgets.Button
    open_b = make(btn, "Open", "default", width=80, css_classes=["wb-open"])
    refresh = make(btn, "↻", "light", width=40, description="Re-list the workspace")
    pin = make(btn, "Pin as baseline", "primary", css_classes=["wb-pin"],
               sizing_mode="stretch_width")
    clear = make(btn, "Clear baseline", "light", width=120, css_classes=["wb-clear"])
    adopt = make(btn, "Use its knobs", "default", width=110, css_classes=["wb-adopt"],
                 description="Set the knobs to those of the shown run")
    export = pn.widgets.FileDownload(callback=lambda: export_zip(store), filename="run-export.zip",
                                     **names(pn.widgets.FileDownload, "Export the shown run (CSV + HTML)",
                                             "light"),
                                     sizing_mode="stretch_width", css_classes=["wb-export"])
    msg = _message()
    baseline = pn.pane.HTML("", margin=(0, 10), sizing_mode="stretch_width")
    problems = pn.pane.Alert("", alert_type="warning", visible=False,
                             sizing_mode="stretch_width", margin=(4, 0),
                             css_classes=["wb-unreadable"])

    listed: set[str] = set()

    def sync_problems() -> None:
        bad = [r for r in store.runs if not r.readable]
        if not bad:
            problems.visible = False
            return
        items = "".join(f"<li><b>{html.escape(r.name)}</b>: {html.escape(r.problem)}</li>"
                        for r in bad[:MAX_PROBLEMS_SHOWN])
        more = (f"<li>… and {len(bad) - MAX_PROBLEMS_SHOWN} more</li>"
                if len(bad) > MAX_PROBLEMS_SHOWN else "")
        problems.param.update(object=(
            f"<small>{len(bad)} {'store' if len(bad) == 1 else 'stores'} in the workspace "
            f"cannot be read:<ul style='margin: 2px 0 0 0; padding-left: 18px'>{items}{more}"
            f"</ul></small>"), visible=True)

    def sync_runs(*events: Any) -> None:
        """Options follow the run list. The selection moves to the shown run when that changes
        or first appears in the list (a new run); otherwise it stays where the user put it."""
        opts: dict[str, str] = {}
        for r in store.runs:
            label, i = r.label, 1
            while label in opts:  # labels are keys: never let two runs share one
                i += 1
                label = f"{r.label} ({i})"
            opts[label] = r.name
        now = set(opts.values())
        shown = store.run_name if store.run_name in now else None
        moved = any(e.name == "run_name" for e in events) or (shown and shown not in listed)
        keep = select.value if select.value in now else None
        select.param.update(options=opts, value=(shown or keep) if moved else (keep or shown))
        listed.clear()
        listed.update(now)
        sync_problems()

    def sync_baseline(*events: Any) -> None:
        baseline.object = (f"<small>baseline: <b>{store.baseline_name}</b></small>"
                           if store.baseline_name else "<small class='wb-muted'>no baseline"
                                                       "</small>")
        clear.disabled = store.baseline is None

    def guarded(fn):
        def run(event: Any) -> None:
            try:
                fn()
                msg.visible = False
            except WorkbenchError as e:
                msg.param.update(object=html.escape(str(e)), visible=True)
            except Exception as e:  # never into Panel: say what happened
                log.exception("runs action failed")
                msg.param.update(object=html.escape(
                    f"{type(e).__name__}: {str(e)[:300]}"), visible=True)
        return run

    open_b.on_click(guarded(lambda: select.value and store.open(select.value)))
    refresh.on_click(guarded(store.refresh))
    pin.on_click(guarded(store.pin_baseline))
    clear.on_click(guarded(store.clear_baseline))
    adopt.on_click(guarded(store.adopt_knobs))
    store.param.watch(sync_runs, ["runs", "run_name"])
    store.param.watch(sync_baseline, ["baseline", "baseline_name"])
    sync_runs()
    sync_baseline()
    return {"select": select, "open": open_b, "refresh": refresh, "pin": pin, "clear": clear, "export": export,
            "adopt": adopt, "message": msg, "baseline": baseline, "problems": problems}


class _SlotsLink(_RangeLink):
    """``store.replay_slots`` over the shown run's useful cache sizes
    (``DataStore.replay_bounds``, which depend on the scope)."""

    attr, watch = "replay_slots", ("dataset", "running", "replay_scope")

    def bounds(self) -> tuple[int, int] | None:
        return self.store.replay_bounds()

    def _skip(self, events: tuple) -> bool:
        # bounds are known once the run is complete
        return bool(events) and all(e.name in ("dataset", "running") for e in events) \
            and self.store.live


def replay_knob_panels(knobs: Knobs, names: Iterable[str] | None = None,
                       css_prefix: str = "wb-replay-") -> dict[str, pn.Param]:
    """One ``pn.Param`` per knob of ``names`` (default: the replay knobs,
    :func:`workbench.ui.replay.replay_knob_names`), over the group of ``knobs`` that declares
    it, with the widget :func:`knob_panels` gives it (so a replay knob looks and validates as
    it does in the knob cards; menus from the registries). Each widget also carries the CSS
    class ``<css_prefix><name>``. ``panel._wb_widget`` is the widget."""
    from workbench.ui.replay import replay_knob_names

    owners = {n: g for g in knobs.groups.values() for n in g.knob_names()}
    out: dict[str, pn.Param] = {}
    for name in (replay_knob_names() if names is None else names):
        group = owners[name]
        spec = dict(knob_widget_specs(group)[name])
        spec["css_classes"] = [*spec["css_classes"], f"{css_prefix}{name.replace('_', '-')}"]
        panel = knob_param(group, [name], widgets={name: spec}, margin=0)
        panel._wb_widget = panel._widgets[name]
        out[name] = panel
    return out


def replay_widgets(store: DataStore) -> dict[str, Any]:
    """Settings of the replay view: the eviction policies drawn (toggle buttons bound to
    ``store.replay_evictions``, from the registry), the scope, the cache-size range (slider over
    the run's useful sizes; applied when released) and the size of the metrics table — the
    replay's own settings — and, under ``"knobs"``, one widget per replay knob
    (:func:`replay_knob_panels` over ``store.replay_knobs``: prefetch and its lead and budget,
    the hardware profile and target model the replay is priced with, hybrid mode, the hotness
    policy's knobs), which start as the shown run's own."""
    cbg, rbg = pn.widgets.CheckButtonGroup, pn.widgets.RadioButtonGroup
    w = {
        "evictions": cbg.from_param(store.param.replay_evictions,
                                    css_classes=["wb-replay-evictions"],
                                    **names(cbg, "", "primary", "outline")),
        "scope": rbg.from_param(store.param.replay_scope, css_classes=["wb-replay-scope"],
                                **names(rbg, "", "primary", "outline")),
        "slots": make(pn.widgets.IntRangeSlider, "slots",
                      css_classes=["wb-replay-slots"], start=1, end=2, value=(1, 2), step=1,
                      disabled=True, min_width=220, sizing_mode="stretch_width"),
        "at": pn.widgets.IntInput.from_param(store.param.replay_at,
                                             css_classes=["wb-replay-at"], width=110,
                                             placeholder="run's own",
                                             **names(pn.widgets.IntInput, "")),
        "knobs": replay_knob_panels(store.replay_knobs),
    }
    if "description" in w["scope"].param:
        w["scope"].description = store.param.replay_scope.doc
    w["slots"]._wb_link = _SlotsLink(store, w["slots"])  # keep the link alive with the widget
    return w
