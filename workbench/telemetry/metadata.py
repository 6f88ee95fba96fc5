"""Typed run metadata: the group attributes of a run store, parsed and checked once.

A store keeps its structured attributes as JSON **text** (``docs/telemetry.md``, *Attributes*):
``knob.<name>``, ``cost_spec``, ``live_plan``, ``modeled_plan``, ``images``,
``image_grid_thw``, ``summary``, ``predictor_cost``. :meth:`RunMetadata.from_attrs` decodes each
of them once and checks its shape, so readers (the dashboard, the accessor, the figures, replay)
never call ``json.loads`` on an attribute themselves:

>>> meta = RunMetadata.from_attrs(workbench.open_run("runs/r1.zarr").attrs)   # doctest: +SKIP
>>> meta.knobs.eviction, meta.cache_slots, meta.cost_spec.expert_bytes       # doctest: +SKIP
>>> meta.text                                  # the answer of a complete run # doctest: +SKIP

- **Older stores**: an attribute that is missing reads as ``None`` (``()`` for the lists);
  knobs it does not record take their defaults (:meth:`Knobs.from_attrs`, which also ignores
  knobs unknown to this version and policies no longer registered); ``recorded_knobs`` says
  which knobs the store does record.
- **Malformed attributes**: text that is not JSON, or JSON of the wrong shape (a plan that is
  not an object, a grid that is not ``[[t, h, w], …]``, a cost spec with a negative size …)
  raises :class:`~workbench.errors.StoreError` naming the attribute and showing the bad value.
  With ``strict=False`` nothing is raised: each bad attribute reads as missing, its message is
  kept in :attr:`RunMetadata.problems`, and :meth:`RunMetadata.check` (or reading
  :attr:`RunMetadata.knobs` when a knob was bad) raises it when a reader needs that attribute —
  so a view that needs only the answer still shows it when a knob is damaged.
- A JSON attribute may also hold the decoded value itself (a list or object rather than text),
  as traces and other zarr writers keep them.

Importing this module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable

from workbench import jsonio
from workbench.errors import KnobError, StoreError

__all__ = ["RunMetadata", "JSON_ATTRS", "attr_json"]

#: attributes a store keeps as JSON text (besides ``knob.<name>``)
JSON_ATTRS = ("cost_spec", "live_plan", "modeled_plan", "images", "image_grid_thw", "requests",
              "summary",
              "predictor_cost")
_SHOW = 80


def _show(value: Any, limit: int = _SHOW) -> str:
    """``value`` for a message: ``repr``, escaped, cut to ``limit`` characters."""
    try:
        text = repr(value)
    except Exception:  # an object whose repr fails
        text = f"<{type(value).__name__}>"
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _bad(name: str, value: Any, expected: str) -> StoreError:
    return StoreError(f"store attribute {name!r} is {_show(value)}; expected {expected}")


def attr_json(attrs: Mapping[str, Any], name: str) -> Any:
    """Attribute ``name`` of ``attrs`` decoded from JSON text (a value that is not text is
    returned as it is); ``None`` when it is missing. Text that is not JSON raises
    :class:`StoreError` naming the attribute and showing the text."""
    raw = attrs.get(name)
    if not isinstance(raw, str):
        return raw
    try:
        return jsonio.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep
        reason = str(e) if not isinstance(e, RecursionError) else "nested too deeply"
        raise StoreError(f"store attribute {name!r} is not valid JSON ({reason[:80]}): "
                         f"{_show(raw)}") from None


# -- checks of one attribute's decoded value (raise StoreError naming it) ------------------------
def _whole(name: str, v: Any, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(name, v, f"a whole number ≥ {lo}")
    return v


def _text(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _bad(name, v, "text")
    return v


def _number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _bad(name, v, "a finite number ≥ 0")
    return float(v)


def _object(name: str, v: Any) -> Mapping[str, Any]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise _bad(name, v, "a JSON object")
    return MappingProxyType(dict(v))


def _names(name: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise _bad(name, v, "a list of texts")
    return tuple(v)


def _images(name: str, v: Any) -> tuple[str, ...]:
    return _names(name, v)


def _requests(name: str, v: Any) -> tuple[Mapping[str, Any], ...]:
    ok = isinstance(v, (list, tuple)) and all(
        isinstance(r, dict) and isinstance(r.get("prompt"), str)
        and isinstance(r.get("images"), list) and all(isinstance(i, str) for i in r["images"])
        and isinstance(r.get("prompt_tokens"), int) and not isinstance(r["prompt_tokens"], bool)
        for r in v)
    if not ok:
        raise _bad(name, v, "a list of {prompt, images, prompt_tokens} objects, one per request")
    return tuple(MappingProxyType(dict(r)) for r in v)


def _grids(name: str, v: Any) -> tuple[tuple[int, int, int], ...]:
    ok = isinstance(v, (list, tuple)) and all(
        isinstance(g, (list, tuple)) and len(g) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in g)
        for g in v)
    if not ok:
        raise _bad(name, v, "a list of [t, h, w] patch grids (whole numbers ≥ 0), one per image")
    return tuple(tuple(g) for g in v)


def _committed(name: str, v: Any) -> Mapping[str, int]:
    if not isinstance(v, dict) or not all(
            isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for k, n in v.items()):
        raise _bad(name, v, "an object of row counts (whole numbers ≥ 0)")
    return MappingProxyType(dict(v))


def _cost_spec(name: str, v: Any) -> Any:
    """A :class:`~workbench.sim.costs.CostSpec`: its fields (the optional ones may be missing),
    ``source`` text, every size and time a finite number ≥ 0."""
    import dataclasses

    from workbench.sim.costs import CostSpec

    spec_fields = {f.name: f for f in dataclasses.fields(CostSpec)}
    required = {n for n, f in spec_fields.items() if f.default is dataclasses.MISSING}
    if not isinstance(v, dict) or not required <= set(v) <= set(spec_fields):
        raise _bad(name, v, f"an object with {', '.join(spec_fields)}")
    if not isinstance(v["source"], str):
        raise _bad(name, v, "'source' as text")
    from workbench.sim.costs import MAX_COST_VALUE

    for k, x in v.items():
        if k != "source" and (isinstance(x, bool) or not isinstance(x, (int, float))
                              or not math.isfinite(x) or not 0 <= x <= MAX_COST_VALUE):
            raise StoreError(f"store attribute {name!r} has {k!r} = {_show(x, 30)}; expected "
                             f"a number from 0 to {MAX_COST_VALUE:.0e}")
    return CostSpec(**v)


#: field → (attribute, is it JSON text, check of the decoded value); the other attributes of a
#: store are JSON-native scalars or lists
_FIELDS: dict[str, tuple[str, bool, Callable[[str, Any], Any]]] = {
    "status": ("status", False, _text),
    "error": ("error", False, _text),
    "created": ("created", False, _text),
    "schema_version": ("schema_version", False, lambda n, v: _whole(n, v, 1)),
    "workbench_version": ("workbench_version", False, _text),
    "committed": ("committed", True, _committed),  # JSON text in early stores
    "phase_names": ("phase_names", False, _names),
    "lane_names": ("lane_names", False, _names),
    "clock_names": ("clock_names", False, _names),
    "model_id": ("model_id", False, _text),
    "model_path": ("model_path", False, _text),
    "config_hash": ("config_hash", False, _text),
    "architecture": ("architecture", False, _text),
    "model_type": ("model_type", False, _text),
    "top_k": ("top_k", False, lambda n, v: _whole(n, v, 1)),
    "bytes_per_expert": ("bytes_per_expert", False, _whole),
    "hardware_profile": ("hardware_profile", False, _text),
    "hardware_profile_label": ("hardware_profile_label", False, _text),
    "cost_source": ("cost_source", False, _text),
    "cost_spec": ("cost_spec", True, _cost_spec),
    "prompt": ("prompt", False, _text),
    "images": ("images", True, _images),
    "prompt_tokens": ("prompt_tokens", False, _whole),
    "batch_size": ("batch_size", False, lambda n, v: _whole(n, v, 1)),
    "requests": ("requests", True, _requests),
    "image_grid_thw": ("image_grid_thw", True, _grids),
    "spatial_merge_size": ("spatial_merge_size", False, lambda n, v: _whole(n, v, 1)),
    "live_plan": ("live_plan", True, _object),
    "modeled_plan": ("modeled_plan", True, _object),
    "device": ("device", False, _text),
    "torch_version": ("torch_version", False, _text),
    "summary": ("summary", True, _object),
    "predictor_cost": ("predictor_cost", True, _object),
    "compression_visual_tokens": ("compression_visual_tokens", False, _whole),
    "compression_kept_visual_tokens": ("compression_kept_visual_tokens", False, _whole),
    "compression_select_s": ("compression_select_s", False, _number),
    "compression_saliency_s": ("compression_saliency_s", False, _number),
    "prism_kernel_run": ("prism_kernel_run", False, _text),
}
#: fields that read as an empty tuple (not None) when their attribute is missing
_EMPTY = ("images", "image_grid_thw", "requests")


@dataclass(frozen=True)
class RunMetadata:
    """The metadata of one run, typed (see the module docstring). Build it with
    :meth:`from_attrs`; every field is read-only (mappings are read-only views).

    ``knob_values``: every knob of the run — the recorded value, else the knob's default —
    or ``None`` when a ``knob.*`` attribute is malformed (``strict=False``); :attr:`knobs`
    builds a :class:`~workbench.knobs.Knobs` of them. ``recorded_knobs``: the knobs the store
    records. ``cost_spec``: a :class:`~workbench.sim.costs.CostSpec`. ``live_plan`` /
    ``modeled_plan`` / ``summary`` / ``predictor_cost``: the decoded objects. ``images``: the
    request's image paths (``"<PIL image>"`` for an in-memory one). ``image_grid_thw``: per
    image its ``(t, h, w)`` patch grid (every request's images, in request order).
    ``batch_size``/``requests``: the run's batch (None/empty in stores before batches: one
    request), each request's prompt, image paths and real prompt tokens; ``prompt``,
    ``images`` and ``prompt_tokens`` are request 0's. ``problems``: attribute → message of each malformed
    attribute read with ``strict=False`` (empty otherwise)."""

    knob_values: Mapping[str, Any] | None
    recorded_knobs: tuple[str, ...] = ()
    status: str | None = None
    error: str | None = None
    created: str | None = None
    schema_version: int | None = None
    workbench_version: str | None = None
    committed: Mapping[str, int] | None = None
    phase_names: tuple[str, ...] | None = None
    lane_names: tuple[str, ...] | None = None
    clock_names: tuple[str, ...] | None = None
    model_id: str | None = None
    model_path: str | None = None
    config_hash: str | None = None
    architecture: str | None = None
    model_type: str | None = None
    top_k: int | None = None
    bytes_per_expert: int | None = None
    hardware_profile: str | None = None
    hardware_profile_label: str | None = None
    cost_source: str | None = None
    cost_spec: Any = None
    prompt: str | None = None
    images: tuple[str, ...] = ()
    prompt_tokens: int | None = None
    batch_size: int | None = None
    requests: tuple[Mapping[str, Any], ...] = ()
    image_grid_thw: tuple[tuple[int, int, int], ...] = ()
    spatial_merge_size: int | None = None
    live_plan: Mapping[str, Any] | None = None
    modeled_plan: Mapping[str, Any] | None = None
    device: str | None = None
    torch_version: str | None = None
    summary: Mapping[str, Any] | None = None
    predictor_cost: Mapping[str, Any] | None = None
    compression_visual_tokens: int | None = None
    compression_kept_visual_tokens: int | None = None
    compression_select_s: float | None = None
    compression_saliency_s: float | None = None
    #: MoE-Prism: how sub-experts ran ("fused", "per-subexpert" or "shortcut"; the knob
    #: ``prism_kernel`` may say "auto"); None without MoE-Prism or before stop 56
    prism_kernel_run: str | None = None
    problems: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    # -- reading -----------------------------------------------------------------------------
    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any], *, strict: bool = True) -> "RunMetadata":
        """Parse a store's group attributes (``ds.attrs``, the ``attributes`` of its
        ``zarr.json``, or a trace's ``attrs``). ``strict``: raise :class:`StoreError` for the
        first malformed attribute; ``False``: keep going (see :attr:`problems`)."""
        if not isinstance(attrs, Mapping):
            raise StoreError(f"store attributes must be a mapping, not {type(attrs).__name__} "
                             f"({_show(attrs)})")
        problems: dict[str, str] = {}
        values: dict[str, Any] = {}
        for fname, (attr, is_json, check) in _FIELDS.items():
            if attrs.get(attr) is None:
                continue
            try:
                raw = attr_json(attrs, attr) if is_json else attrs[attr]
                values[fname] = check(attr, raw)
            except StoreError as e:
                if strict:
                    raise
                problems[attr] = str(e)
        knob_values, recorded = _knobs(attrs, strict, problems)
        return cls(knob_values=knob_values, recorded_knobs=recorded, **values,
                   problems=MappingProxyType(problems))

    @staticmethod
    def field(attrs: Mapping[str, Any], name: str) -> Any:
        """The one field ``name`` of ``attrs`` (None when absent), checked as :meth:`from_attrs`
        checks it, without reading the knobs (a replay prices each point by the recorded cost
        spec: building the knobs for it cost more than the replay). Raises :class:`StoreError`
        when the attribute is malformed."""
        attr, is_json, check = _FIELDS[name]
        if attrs.get(attr) is None:
            return None
        return check(attr, attr_json(attrs, attr) if is_json else attrs[attr])

    def check(self, *attrs: str) -> "RunMetadata":
        """Raise the :class:`StoreError` of the first malformed attribute among ``attrs``
        (every attribute when none is named; ``"knob.*"`` stands for the knobs); returns
        ``self`` when they are fine. Only a ``strict=False`` read can hold problems."""
        names = attrs or tuple(self.problems)
        for a in names:
            for key, msg in self.problems.items():
                if key == a or (a == "knob.*" and key.startswith("knob.")):
                    raise StoreError(msg)
        return self

    # -- derived values ----------------------------------------------------------------------
    @property
    def knobs(self):
        """The run's knobs as a new :class:`~workbench.knobs.Knobs` (the same ones
        ``Knobs.from_attrs`` and ``workbench.replay_trace`` recover). :class:`StoreError` when
        a ``knob.*`` attribute was malformed (a ``strict=False`` read)."""
        from workbench.knobs import Knobs

        if self.knob_values is None:
            self.check("knob.*")
            raise StoreError("the run's knobs cannot be read")  # pragma: no cover
        return Knobs(**self.knob_values)

    def knob(self, name: str, default: Any = None) -> Any:
        """Knob ``name`` of the run (its default when not recorded), or ``default`` when the
        knobs could not be read or the knob is unknown."""
        if self.knob_values is None:
            return default
        return self.knob_values.get(name, default)

    @property
    def text(self) -> str | None:
        """The generated answer of a complete run (``summary["text"]``), else None."""
        t = self.summary.get("text") if self.summary is not None else None
        return t if isinstance(t, str) else None

    @property
    def cache_slots(self) -> int | None:
        """Cache slots the run had: its live plan's ``slots``, else its recorded
        ``cache_slots`` knob; None when neither is known."""
        s = self.live_plan.get("slots") if self.live_plan is not None else None
        if isinstance(s, int) and not isinstance(s, bool) and s >= 1:
            return s
        if "cache_slots" in self.recorded_knobs and self.knob_values is not None:
            return self.knob_values["cache_slots"]
        return None

    @property
    def max_new_tokens(self) -> int | None:
        """The run's ``max_new_tokens`` knob when the store records it (and it reads)."""
        if "max_new_tokens" in self.recorded_knobs and self.knob_values is not None:
            return self.knob_values["max_new_tokens"]
        return None


def _knobs(attrs: Mapping[str, Any], strict: bool, problems: dict[str, str]
           ) -> tuple[Mapping[str, Any] | None, tuple[str, ...]]:
    """(every knob's value, recorded knob names) of ``attrs`` via ``Knobs.from_attrs``; a bad
    ``knob.*`` attribute raises (strict) or gives ``(None, names)`` with its problem noted."""
    from workbench.knobs import Knobs

    known = Knobs().names()
    recorded = tuple(n for n in known if f"knob.{n}" in attrs)
    try:
        k = Knobs.from_attrs(attrs)
    except KnobError as e:
        msg = str(e)
        bad = next((f"knob.{n}" for n in recorded if f"'knob.{n}'" in msg), "knob.*")
        if strict:
            raise StoreError(msg) from None
        problems[bad] = msg
        return None, recorded
    return MappingProxyType(k.to_dict()), recorded

