"""Knobs: every user-settable value of a run, declared once.

Each group is a ``param.Parameterized`` class whose parameters carry bounds, soft bounds (slider
ranges) and docs. The same objects validate values, generate notebook/dashboard widgets
(``pn.Param(knobs.group("cache"))``), map to CLI ``--set NAME=VALUE`` flags and serialise into the
attrs of every stored run. Knob names are unique across groups, so a flat ``NAME=VALUE`` is never
ambiguous.

This module is a **leaf**: it imports no feature package (policies, compression, predictor,
runtime, sim, replay), only :mod:`workbench.errors`, ``param`` and ``numpy``. So every feature
module may import it (to subclass :class:`KnobGroup` or read a knob's default) without a cycle.

Registration rule
-----------------
- This module declares the core groups (``cache``, ``prefetch``, ``cost``, ``exec``,
  ``generation``) and the machinery. A feature package declares its own group (a
  :class:`KnobGroup` subclass) and its policies; importing it registers no group.
- :mod:`workbench.features` is the **one** module that imports the feature packages: it calls
  :func:`register_group` for every group, in menu order, and binds each ``Selector`` knob whose
  choices live elsewhere to their source (a policy ``Registry``, or a function listing names,
  e.g. the hardware profiles): ``register_group("cache", CacheKnobs, choices={"eviction":
  EVICTION})``. A group instance offers every choice registered so far.
- This module imports :mod:`workbench.features` lazily, the first time the groups are needed
  (``Knobs()``, a group instance, :func:`register_group`, :func:`knob_groups`). So
  ``from workbench.knobs import Knobs; Knobs()`` has every group, while ``import workbench.knobs``
  alone stays light. A new capability: declare its group in its package, add one line to
  :mod:`workbench.features`.

Naming rule
-----------
- Knob names are lowercase ``snake_case`` and unique across groups.
- Knobs every offloading run has (cache, prefetch, cost model, execution, generation) take plain
  names: ``cache_slots``, ``prefetch_budget``, ``profile``.
- A knob of one paper's mechanism starts with the mechanism's prefix, then the paper's symbol
  spelled out or a word: ``ae_`` ActiveEvict (``ae_alpha``, ``ae_tau``, ``ae_window``), ``vis_``
  VisMMOE, ``macs_`` MACS, ``realb_`` ReaLB, ``prism_`` MoE-Prism (e.g. ``macs_alpha``,
  ``realb_delta``, ``prism_rho``, ``prism_tau``, ``prism_m``). The switch that turns a mechanism
  on may be the mechanism's name (``active_evict``, ``compression``, ``predictor``). A knob read
  by one registered policy only starts with the policy's name (``hotness_decay``).
- Knobs older than this rule keep their names until they are renamed through an alias: VisMMOE's
  ``alpha``, ``beta``, ``lam`` (compression) and ``window``, ``decay`` (predictor), and
  ActiveEvict's ``lookahead_depth``, ``dynamic_topk``, ``k_max``. To rename (``alpha`` →
  ``vis_alpha``): rename the parameter (and its :data:`CEILINGS` entry, the policies'
  ``__init__`` parameters) and list the old name in the group's ``aliases = {"alpha":
  "vis_alpha"}``. ``Knobs(alpha=…)``, :meth:`Knobs.set`, ``--set alpha=…``
  (:meth:`Knobs.set_from_strings`), reading ``knobs.alpha`` and stores written with
  ``knob.alpha`` (:meth:`Knobs.from_attrs`) keep working; :meth:`Knobs.to_dict` /
  :meth:`Knobs.to_attrs` write the new name only.

Checks
------
Every value goes through :func:`check_value` (``Knobs(...)``, ``set``, ``set_from_strings``,
``from_attrs``; :meth:`Knobs.validate` re-checks values a widget set on a group directly): on top
of param's bounds, a number must be finite (no knob gives ``nan`` or ``inf`` a meaning; ``-0``
becomes ``0``), an integer must be a real ``int`` (not a bool or a float) no larger than its
ceiling (:data:`INT_CEILING`, or :data:`CEILINGS` for knobs whose value sizes an allocation or a
loop), a choice must be text, and text must not hold NUL characters. A bad value raises
:class:`KnobError` naming the knob, the value and what is allowed.

Rules that involve several knobs, or a knob and the model, belong to the group that owns the
knobs: :meth:`KnobGroup.check` ``(knobs, shape, live=...)``, with ``shape`` a torch-free
:class:`ModelShape` (MoE layers, experts per layer, top-k, bytes per expert) and ``live`` False
for trace replay. :meth:`Knobs.check` runs every group's check (:meth:`Knobs.check_against` is
the older spelling).
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Union

import numpy as np
import param

from workbench.errors import KnobError

@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the knob checks need to know of a model (or a trace), without torch:
    ``num_layers`` MoE layers, ``num_experts`` routed experts per layer, ``top_k`` experts per
    token, ``expert_bytes`` bytes per expert. None: unknown (a rule that needs it is skipped)."""

    num_layers: int
    top_k: int
    num_experts: int | None = None
    expert_bytes: int | None = None

    @classmethod
    def of(cls, layout: Any, expert_bytes: int | None = None) -> "ModelShape":
        """The shape of anything with ``num_layers``, ``top_k`` and optionally
        ``num_experts`` / ``expert_bytes`` attributes (a model's MoE layout, a trace)."""
        eb = expert_bytes if expert_bytes is not None else getattr(layout, "expert_bytes", None)
        ne = getattr(layout, "num_experts", None)
        # a layer routes at most E distinct experts: a trace wider than E per token (Expanded
        # Drop adds a rank's experts to the top-k) needs no more than E slots at a time
        k = int(layout.top_k) if ne is None else min(int(layout.top_k), int(ne))
        return cls(num_layers=int(layout.num_layers), top_k=k,
                   num_experts=None if ne is None else int(ne),
                   expert_bytes=None if eb is None else int(eb))

    @classmethod
    def unknown(cls) -> "ModelShape":
        """A model not loaded yet: every rule that needs its sizes passes (as many layers as
        any knob asks for, top-1), so a check against it finds what is wrong whatever the
        model, e.g. a policy that needs the future, before anything loads."""
        return cls(num_layers=2**31 - 1, top_k=1)


#: Where a Selector knob's choices come from: a policy registry (anything with ``available()``;
#: with ``get(name)`` the group can also hand out the selected class) or a function of no
#: arguments returning the names.
ChoiceSource = Union[Any, Callable[[], Iterable[str]]]


def _choices(source: ChoiceSource) -> list[str]:
    available = getattr(source, "available", None)
    return list(available() if callable(available) else source())


class KnobGroup(param.Parameterized):
    """Base of knob groups. A knob that may be None ("no limit", "auto") has no softbounds, so
    that ``pn.Param(group)`` renders it as a number box (a slider cannot hold None).

    ``_registries`` maps Selector knobs to the source of their choices (bound by
    :func:`register_group`), so each new instance offers every policy registered so far. The
    choices live on the class's Parameter, brought up to date at each new instance (not
    copied for it: ≈ 35 µs each): an older instance offers them too, until it copies the
    Parameter itself (the first :meth:`Knobs.set` of that knob, a widget), which keeps the
    choices of that moment.
    ``aliases`` maps old knob names to the group's current ones (see the naming rule)."""

    _registries: ClassVar[dict[str, ChoiceSource]] = {}
    aliases: ClassVar[dict[str, str]] = {}
    title: ClassVar[str] = ""

    def __init__(self, **params: Any) -> None:
        _load_features()
        super().__init__()
        cls = type(self)
        for knob, source in cls._registries.items():
            # the class's Parameter, brought up to the registry when a policy registered
            # since: ``self.param[knob]`` would copy it for this instance (≈ 35 µs each, ⅔ of
            # a Knobs() with its 9 registries). So an instance offers the choices of the
            # latest instance made, until it copies the Parameter itself (the first set() of
            # that knob, a widget): from then on its own
            shared = cls.param[knob]
            choices = _choices(source)
            if list(shared.objects) != choices:
                shared.objects = choices
        if params:  # (an empty update still reads every parameter's value: ≈ ⅓ of a Knobs())
            self.param.update(**params)

    @classmethod
    def knob_names(cls) -> list[str]:
        return [n for n in cls.param if n != "name"]

    def selected(self, knob: str) -> Any:
        """The class behind Selector ``knob``'s current value (its registry's entry); None
        when the knob's choices are not a registry."""
        get = getattr(type(self)._registries.get(knob), "get", None)
        return get(getattr(self, knob)) if callable(get) else None

    def check(self, knobs: "Knobs", shape: ModelShape, *, live: bool = True) -> None:
        """Raise :class:`KnobError` when this group's knobs do not fit together, with the other
        groups' (``knobs``) or with the model (``shape``); ``live`` False: for trace replay.
        Called by :meth:`Knobs.check` after every value was validated. The base checks
        nothing."""


class CacheKnobs(KnobGroup):
    """Expert cache and memory layout (VisMMOE §3.4): pinned prefix + slab cache of slots."""

    title = "Expert cache"

    cache_slots = param.Integer(
        default=64, bounds=(1, None), softbounds=(4, 256),
        doc="Device slots in the expert cache, one routed expert each (≥ top-k). "
            "Ignored when cache_bytes is set.")
    cache_bytes = param.Integer(
        default=None, allow_None=True, bounds=(1, None),
        doc="Expert-cache budget in bytes; when set, slots = cache_bytes // bytes per expert.")
    pinned_layers = param.Integer(
        default=1, bounds=(0, None), softbounds=(0, 48),
        doc="The first N MoE layers keep all their experts resident (the pinned prefix).")
    semantic_layers = param.Integer(
        default=None, allow_None=True, bounds=(0, None),
        doc="L_semantic, the lower end of the valid pinned prefix L_semantic ≤ pinned_layers ≤ "
            "⌊(M_avail − C_safe)/S_layer⌋ (VisMMOE eq. 10): the fewest MoE layers whose "
            "routing the run needs. The paper finds it empirically; None (auto) = 1 when "
            "compression is 'affinity' with λ > 0 (its expert affinity reads the prefix "
            "routing), else 0 (no lower bound).")
    cache_reserve_slots = param.Integer(
        default=None, allow_None=True, bounds=(0, None),
        doc="C_safe in expert slots: the least the dynamic expert cache keeps beside the pinned "
            "prefix, which caps it at ⌊(M_avail − C_safe)/S_layer⌋ layers. None (auto) = the "
            "model's top-k (the cache must hold one layer's routing of a token).")
    eviction = param.Selector(
        default="lru", objects=["lru"],  # every registered policy: bound by workbench.features
        doc="Which cached expert leaves when a slot is needed ('belady' needs the future: "
            "trace replay only).")
    hotness_decay = param.Number(
        default=0.8, bounds=(0.0, 1.0), inclusive_bounds=(False, True), softbounds=(0.5, 1.0),
        doc="γ of the 'hotness' eviction policy: a use s steps ago weighs γ^s.")
    hotness_window = param.Integer(
        default=16, bounds=(1, 64), softbounds=(1, 64),  # 64: the compiled replay's ring
        doc="T of the 'hotness' eviction policy: uses older than T steps are forgotten.")
    belady_horizon = param.Integer(
        default=32, bounds=(0, None), softbounds=(0, 256),
        doc="How far the 'belady-horizon' oracle sees, in layer turns ((step, layer) groups: "
            "one token of a model with L MoE layers is L turns): a key used again within the "
            "horizon is ranked by that use, as Belady does; one not seen in it is evicted "
            "first, least recently used first. 0 is LRU; a horizon past the trace is Belady. "
            "It measures how much foresight reaching Belady takes (trace replay only).")
    hybrid = param.Boolean(
        default=False,
        doc="GPU–CPU hybrid mode (VisMMOE §3.4): a miss runs on the host copy of the "
            "expert instead of being loaded when that ends sooner on the modeled hardware "
            "(host compute + activations over the link < transfer + device compute; decode "
            "misses usually qualify, big prefill groups do not). Host runs have their own "
            "timeline lane.")

    offload_unit = param.Selector(
        default="expert", objects=["expert", "layerwise", "layerwise-prefetch"],
        doc="What an offloaded layer copies in (issue 39 §2, the papers' bases). 'expert': "
            "the per-expert cache (a miss copies one expert; experts stay across layers). "
            "'layerwise' (Hugging Face accelerate's offload hooks, VisMMOE Table 4's base): "
            "before an offloaded MoE layer runs all its E experts are copied in and the "
            "layer waits for every copy; nothing is kept across layers. "
            "'layerwise-prefetch': the next layer's E experts are copied while this one "
            "computes. Needs cache_slots ≥ E (2E with prefetch); the eviction policy is "
            "not consulted; no prefetch policy, hybrid, active_evict, dynamic_topk, "
            "cache_routing or prism_offload with it.")

    def check(self, knobs: "Knobs", shape: ModelShape, *, live: bool = True) -> None:
        """Live runs take no eviction policy that needs the future; ``pinned_layers`` ≤ the
        MoE layers; with any layer offloaded the cache holds at least top-k experts; a
        layer-wise ``offload_unit`` holds a whole layer (:meth:`_check_unit`)."""
        if live:
            registry = type(self)._registries.get("eviction")
            ev = self.selected("eviction")
            if "future" in getattr(ev, "needs", ()):
                live_ev = [n for n in registry.available()
                           if "future" not in getattr(registry.get(n), "needs", ())]
                raise KnobError(
                    f"eviction {self.eviction!r} needs the future, so only trace replay can run "
                    f"it (workbench replay); live runs take one of {', '.join(live_ev)}")
        L, top_k = shape.num_layers, shape.top_k
        if self.pinned_layers > L:
            what = "the model's MoE layers" if live else "the trace's layers"
            raise KnobError(
                f"pinned_layers must be between 0 and {L} ({what}), not {self.pinned_layers}")
        if self.pinned_layers < L:
            if self.cache_bytes is None:
                if self.cache_slots < top_k:
                    raise KnobError(
                        f"cache_slots must be at least {top_k} (top-k), not {self.cache_slots}")
            elif shape.expert_bytes is not None \
                    and knobs.effective_slots(shape.expert_bytes) < top_k:
                raise KnobError(
                    f"cache_bytes must hold at least {top_k} experts (top-k) = "
                    f"{top_k * shape.expert_bytes} bytes, not {self.cache_bytes}")
        if self.offload_unit != "expert":
            self._check_unit(knobs, shape)

    def _check_unit(self, knobs: "Knobs", shape: ModelShape) -> None:
        """A layer-wise unit: no per-expert mechanism beside it, and slots for one layer's
        experts (two layers' with prefetch; one when one layer is offloaded)."""
        unit = self.offload_unit
        for name, off in (("prefetch", "none"), ("hybrid", False), ("active_evict", False),
                          ("dynamic_topk", False), ("cache_routing", False),
                          ("prism_offload", False)):
            value = getattr(knobs, name, off)
            if value != off:
                raise KnobError(
                    f"offload_unit={unit!r} copies whole layers: {name} must be "
                    f"{off!r}, not {value!r} (per-expert mechanisms "
                    f"need offload_unit='expert')")
        E, L = shape.num_experts, shape.num_layers
        n_off = L - self.pinned_layers
        if E is None or n_off <= 0:
            return
        need = E * (min(2, n_off) if unit == "layerwise-prefetch" else 1)
        if self.cache_bytes is not None and shape.expert_bytes is None:
            return
        slots = knobs.effective_slots(shape.expert_bytes or 1)
        if slots < need:
            what = "one layer's" if need == E else "two layers'"
            given = (f"cache_slots={self.cache_slots}" if self.cache_bytes is None
                     else f"cache_bytes={self.cache_bytes} ({slots} experts)")
            raise KnobError(
                f"offload_unit={unit!r} holds {what} experts at a time: it needs at least "
                f"{need} slots, not {given}")


class PrefetchKnobs(KnobGroup):
    """Prefetch: copy experts before a layer asks for them (the caching baselines and bounds)."""

    title = "Prefetch"

    prefetch = param.Selector(
        default="none", objects=["none"],  # every registered policy: bound by workbench.features
        doc="Which experts to fetch ahead: 'speculative'/'apex' use the recorded router "
            "lookahead, 'oracle' knows the future (trace replay only).")
    prefetch_lead = param.Integer(
        default=1, bounds=(1, None), softbounds=(1, 8),
        doc="How many layers ahead a prefetch may target.")
    prefetch_budget = param.Integer(
        default=None, allow_None=True, bounds=(1, None),
        doc="Most experts prefetched per layer step (None: no limit); with prism_offload, "
            "sub-experts (1/N of an expert each).")
    transfer_order = param.Selector(
        default="demand-first", objects=["fifo", "demand-first"],  # sim.lane.TRANSFER_ORDERS
        doc="Order of the modeled transfer lane. 'fifo': a demand miss waits behind every "
            "queued prefetch. 'demand-first' (VisMMOE §3.4's orchestrator, MoE-Infinity, "
            "KTransformers): a demand load goes before every queued prefetch not yet "
            "started (copies in flight finish); a prefetch not started when its layer has "
            "run is cancelled, its slot freed. Without prefetch both are the same.")

    def check(self, knobs: "Knobs", shape: ModelShape, *, live: bool = True) -> None:
        """Live runs take no prefetch policy that needs the future, and one that reads the
        router lookahead needs ``lookahead_depth`` ≥ 1."""
        if not live:
            return
        registry = type(self)._registries.get("prefetch")
        needs = getattr(self.selected("prefetch"), "needs", frozenset())
        if "future" in needs:
            live_pf = [n for n in registry.available()
                       if "future" not in getattr(registry.get(n), "needs", ())]
            raise KnobError(
                f"prefetch {self.prefetch!r} needs the future, so only trace replay can run it "
                f"(workbench replay); live runs take one of {', '.join(live_pf)}")
        depth = getattr(knobs, "lookahead_depth", 0)
        if "pred_ids" in needs and depth < 1:
            raise KnobError(
                f"prefetch {self.prefetch!r} uses router lookahead: lookahead_depth must be at "
                f"least 1, not {depth}")


class CostKnobs(KnobGroup):
    """How the *modeled* clock prices transfers and compute."""

    title = "Cost model (modeled)"

    profile = param.Selector(
        default="a100-40gb", objects=["a100-40gb"],  # the hardware profiles: workbench.features
        doc="Hardware profile of the modeled timeline (see docs/hardware-profiles.md).")
    target_model = param.Selector(
        default="none", objects=["none"],  # "none" + the target models: workbench.features
        doc="Cost the trace with this real model's expert size and FLOPs; 'none' uses the "
            "loaded model's own sizes.")


class ExecKnobs(KnobGroup):
    """Where and in which precision the model runs (measured clock)."""

    title = "Execution"

    device = param.Selector(
        default="auto", objects=["auto", "cpu", "cuda"],
        doc="Device for resident weights and the cache: 'auto' picks cuda when present.")
    dtype = param.Selector(
        default="float32", objects=["float32", "bfloat16", "float16"],
        doc="Compute dtype of the model's weights.")


class GenerationKnobs(KnobGroup):
    """Decoding of one request."""

    title = "Generation"

    max_new_tokens = param.Integer(
        default=32, bounds=(1, 4096), softbounds=(1, 128),
        doc="Tokens to generate at most (the embedded model's longest answer is 20 tokens and "
            "its end-of-sequence token).")
    sampling = param.Boolean(default=False, doc="Sample instead of greedy decoding.")
    temperature = param.Number(
        default=1.0, bounds=(1e-6, None), softbounds=(0.1, 2.0),
        doc="Softmax temperature when sampling (at least 1e-6: smaller values overflow the "
            "scaled logits to inf; anything below ~0.01 is greedy in effect).")
    top_p = param.Number(
        default=1.0, bounds=(0.0, 1.0), inclusive_bounds=(False, True),
        doc="Nucleus sampling mass when sampling.")
    seed = param.Integer(default=0, bounds=(0, None), doc="Random seed for sampling.")
    ignore_eos = param.Boolean(
        default=False, doc="Generate exactly max_new_tokens, past the end-of-sequence token "
                           "(for benchmarks, like vLLM's ignore_eos).")


_GROUPS: dict[str, type[KnobGroup]] = {}
_ALIASES: dict[str, str] = {}  # old knob name → current name, over every group


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'cache_slots'?"`` for the closest of ``choices`` to a mistyped ``name``
    (difflib ratio ≥ 0.75), ``""`` when none is close."""
    import difflib

    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.75)
    return f"; did you mean {_ALIASES.get(close[0], close[0])!r}?" if close else ""
_features_state = "unloaded"  # → "loading" → "loaded"


def _load_features() -> None:
    """Import :mod:`workbench.features` (which registers every group) once, on first use."""
    global _features_state
    if _features_state != "unloaded":  # loaded, or being loaded (its register_group calls)
        return
    _features_state = "loading"
    try:
        import workbench.features  # noqa: F401  (its register_group calls fill _GROUPS)
    except BaseException:
        _features_state = "unloaded"
        raise
    _features_state = "loaded"


def register_group(key: str, cls: type[KnobGroup], *,
                   choices: Mapping[str, ChoiceSource] | None = None) -> type[KnobGroup]:
    """Add a knob group under ``key``; its knob names (and aliases) must not clash with any
    registered knob or alias. ``choices`` binds Selector knobs of ``cls`` to the source of
    their choices (a policy registry, or a function returning names); the class's menus are
    updated now and each instance's when it is made. Registering the same class again
    (re)binds its choices."""
    _load_features()
    names = set(cls.knob_names())
    if key in _GROUPS and _GROUPS[key] is not cls:
        raise ValueError(f"knob group {key!r} is already registered ({_GROUPS[key].__name__})")
    others = [g for k, g in _GROUPS.items() if k != key]
    known = {n for g in others for n in g.knob_names()}
    known_aliases = {a for g in others for a in g.aliases}
    clash = (names | set(cls.aliases)) & (known | known_aliases)
    if clash:
        raise ValueError(f"knob names {sorted(clash)} of {cls.__name__} are already used")
    for old, new in cls.aliases.items():
        if new not in names or old in names:
            raise ValueError(f"alias {old!r} → {new!r} of {cls.__name__}: {new!r} must be one "
                             f"of its knobs and {old!r} none of them")
    regs = dict(cls._registries)
    regs.update(choices or {})
    for knob, source in regs.items():
        p = cls.param[knob]
        if not isinstance(p, param.Selector):
            raise ValueError(f"{cls.__name__}.{knob} is not a Selector; it takes no choices")
        objects = _choices(source)
        if p.default not in objects:
            raise ValueError(f"{cls.__name__}.{knob}: its default {p.default!r} is not one of "
                             f"the choices {objects}")
        p.objects = objects
    cls._registries = regs
    _GROUPS[key] = cls
    _ALIASES.update(cls.aliases)
    return cls


def unregister_group(key: str) -> None:
    """Remove group ``key`` (tests that register a group of their own)."""
    cls = _GROUPS.pop(key, None)
    if cls is not None:
        for old in cls.aliases:
            _ALIASES.pop(old, None)


def knob_groups() -> dict[str, type[KnobGroup]]:
    """Every registered group class by key, in menu order."""
    _load_features()
    return dict(_GROUPS)


def aliases() -> dict[str, str]:
    """Old knob names → current names."""
    _load_features()
    return dict(_ALIASES)


#: The largest value of an integer knob whose declaration gives no upper bound: 2**53 − 1, the
#: largest integer every JSON reader of the store attrs holds exactly (and far beyond any slot,
#: byte or seed count that means something).
INT_CEILING = 2**53 - 1

#: Tighter ceilings for knobs whose value sizes an allocation or a loop of the run (a bigger value
#: would not mean more, only cost memory or time): layers ahead (no model has more MoE layers)
#: and ActiveEvict's hotness window (a buffer of num_layers × ae_window × experts floats).
CEILINGS: dict[str, int] = {"lookahead_depth": 256, "prefetch_lead": 256, "window": 256,
                            "ae_window": 4096}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def show_value(value: Any, limit: int = 60) -> str:
    """``repr`` of a bad value for a message, cut to ``limit`` characters."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 1] + "…"


def _fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _int_range(p: param.Parameter, name: str) -> tuple[int | None, int]:
    lo, hi = p.bounds if p.bounds is not None else (None, None)
    ceiling = CEILINGS.get(name, INT_CEILING)
    hi = ceiling if hi is None else min(int(hi), ceiling)
    return (None if lo is None else int(lo)), hi


def effective_bounds(p: param.Parameter, name: str) -> dict[str, Any] | None:
    """The range knob ``name`` accepts as data, the same one :func:`allowed` says in words:
    ``{"bounds": [lo, hi], "inclusive": [bool, bool]}`` with an integer knob's ceiling
    (:data:`CEILINGS`) as its upper bound (``None`` = unbounded); None for a knob without a
    range (choices, booleans, text)."""
    if isinstance(p, param.Integer):
        lo, hi = _int_range(p, name)
        return {"bounds": [lo, None if hi == INT_CEILING else hi], "inclusive": [True, True]}
    if isinstance(p, param.Number):
        lo, hi = p.bounds if p.bounds is not None else (None, None)
        inc = list(getattr(p, "inclusive_bounds", (True, True)))
        return {"bounds": [lo, hi], "inclusive": inc}
    return None


def allowed(p: param.Parameter, name: str) -> str:
    """What knob ``name`` (parameter ``p``) accepts, in words: "an integer in [1, 256]",
    "a finite number in (0, 1]", "one of lru, lfu", "true or false", … (+ " or none")."""
    if isinstance(p, param.Selector):
        text = "one of " + ", ".join(map(str, p.objects or []))
    elif isinstance(p, param.Boolean):
        text = "true or false"
    elif isinstance(p, param.Integer):
        lo, hi = _int_range(p, name)
        if hi == INT_CEILING:  # no real upper bound: not worth a 16-digit number in every message
            text = f"an integer ≥ {lo}" if lo is not None else "an integer"
        else:
            text = f"an integer in [{lo}, {hi}]" if lo is not None else f"an integer ≤ {hi}"
    elif isinstance(p, param.Number):
        lo, hi = p.bounds if p.bounds is not None else (None, None)
        inc_lo, inc_hi = getattr(p, "inclusive_bounds", (True, True))
        if lo is not None and hi is not None:
            text = (f"a finite number in {'[' if inc_lo else '('}{_fmt(lo)}, {_fmt(hi)}"
                    f"{']' if inc_hi else ')'}")
        elif lo is not None:
            text = f"a finite number {'≥' if inc_lo else '>'} {_fmt(lo)}"
        elif hi is not None:
            text = f"a finite number {'≤' if inc_hi else '<'} {_fmt(hi)}"
        else:
            text = "a finite number"
    elif isinstance(p, param.String):
        text = "text (no NUL characters)"
    else:
        text = type(p).__name__.lower()
    return text + (" or none" if getattr(p, "allow_None", False) else "")


def check_value(p: param.Parameter, name: str, value: Any) -> Any:
    """``value`` checked and normalised for knob ``name`` (numpy scalars → Python, ``-0.0`` →
    ``0.0``); raises :class:`KnobError` naming the knob, the value and what is allowed."""
    def how() -> str:  # only for a message: most values are fine
        return f" (allowed: {allowed(p, name)})"

    if value is None:
        if p.allow_None:
            return None
        raise KnobError(f"{name} must not be none{how()}")
    if isinstance(p, param.Boolean):
        if isinstance(value, np.bool_):
            value = bool(value)
        if not isinstance(value, bool):
            raise KnobError(f"{name} must be a boolean, not {show_value(value)}{how()}")
    elif isinstance(p, param.Integer):
        if isinstance(value, (bool, np.bool_)):
            raise KnobError(f"{name} must be an integer, not {value!r} (a boolean){how()}")
        if not isinstance(value, numbers.Integral):
            kind = "a number with a fraction" if isinstance(value, numbers.Real) else \
                type(value).__name__
            raise KnobError(f"{name} must be an integer, not {show_value(value)} ({kind}){how()}")
        value = int(value)
        lo, hi = _int_range(p, name)
        if value > hi:
            top = f"{hi} (2**53 − 1)" if hi == INT_CEILING else f"{hi}"
            raise KnobError(f"{name} must be at most {top}, not {show_value(value)}{how()}")
    elif isinstance(p, param.Number):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise KnobError(f"{name} must be a number, not {show_value(value)}{how()}")
        try:
            value = float(value)
        except (OverflowError, ValueError):  # a huge int or Fraction
            raise KnobError(f"{name} must be a finite number, not {show_value(value)}"
                            f"{how()}") from None
        if not math.isfinite(value):
            raise KnobError(f"{name} must be a finite number, not {value}{how()}")
        if value == 0.0:
            value = 0.0  # -0.0 → 0.0
    elif isinstance(p, param.Selector):
        if not isinstance(value, str):
            raise KnobError(f"{name} must be one of {', '.join(map(str, p.objects or []))}, "
                            f"not {show_value(value)}")
        choices = [str(o) for o in (p.objects or [])]
        if value not in choices:  # param's own message echoes the whole value (a 10 MB line)
            raise KnobError(f"{name} does not accept {show_value(value)}"
                            f"{_near_choice(value, choices)}{how()}")
    elif isinstance(p, param.String):
        if not isinstance(value, str):
            raise KnobError(f"{name} must be text, not {show_value(value)}{how()}")
        if "\x00" in value:
            raise KnobError(f"{name} must not contain NUL characters, not "
                            f"{show_value(value)}{how()}")
    try:
        p._validate(value)
    except (ValueError, TypeError) as e:
        msg = _reword(str(e), name).rstrip(".")
        raise KnobError(msg if isinstance(p, param.Selector) else msg + how()) from None
    return value


def _near_choice(value: str, choices: list[str]) -> str:
    """``"; did you mean 'fifo'?"`` for a choice ``value`` misspells by case, spacing, ``_``
    for ``-`` or a typo (difflib ratio ≥ 0.75); ``""`` when none is close."""
    import difflib

    if len(value) > 200:  # a huge value is no typo (and difflib is quadratic)
        return ""
    key = value.strip().lower().replace("_", "-").replace(" ", "-")
    same = [c for c in choices if c.lower().replace("_", "-") == key]
    close = same or difflib.get_close_matches(key, choices, n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def parse_text(p: param.Parameter, name: str, text: str) -> Any:
    """Turn a CLI string into the knob's type (validation proper is :func:`check_value`)."""
    t = text.strip()
    if p.allow_None and t.lower() in ("none", "null", ""):
        return None
    how = f" (allowed: {allowed(p, name)})"
    kind = type(p).__name__.lower()
    bad = KnobError(f"{name} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, "
                    f"not {show_value(text)}{how}")
    if isinstance(p, param.Boolean):
        low = t.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise KnobError(f"{name} must be a boolean, not {show_value(text)} (allowed: true/false, "
                        f"yes/no, on/off, 1/0)")
    if isinstance(p, param.Integer):
        try:
            return int(t)
        except ValueError:  # also more than 4300 digits
            raise bad from None
    if isinstance(p, param.Number):
        try:
            v = float(t)
        except ValueError:
            raise bad from None
        if not math.isfinite(v):
            literal = any(w in t.lower() for w in ("inf", "nan"))
            raise KnobError(f"{name} must be a finite number, not {show_value(text)}"
                            f"{'' if literal else ' (it overflows to inf)'}{how}")
        return v
    return t


_MISSING = object()

#: knobs whose default is not what a store written before the knob existed ran with: that
#: store (no ``knob.<name>`` attribute) reads back with this value, so its replay stays exact
PREDATING: dict[str, Any] = {"transfer_order": "fifo", "low_precision_down_input": "native",
                             "offload_unit": "expert", "capacity_scope": "all",
                             "prism_kernel": "fused"}


class Knobs:
    """All knob groups of one run, addressed by flat, unique knob names.

    >>> k = Knobs(cache_slots=32, eviction="lfu")
    >>> k.cache_slots
    32
    """

    def __init__(self, **values: Any) -> None:
        _load_features()
        object.__setattr__(self, "_groups", {key: cls() for key, cls in _GROUPS.items()})
        # knob name → its group (names are unique across groups): O(1) flat access
        object.__setattr__(self, "_by_name", {n: g for g in self._groups.values()
                                              for n in g.knob_names()})
        # knob → the value last checked (declared defaults are valid: test_knobs holds them
        # to check_value); validate() re-checks only what changed past set(), e.g. a widget
        object.__setattr__(self, "_checked", {n: getattr(g, n)
                                              for n, g in self._by_name.items()})
        self.set(**values)

    # -- access ---------------------------------------------------------------------------
    def group(self, key: str) -> KnobGroup:
        return self._groups[key]

    @property
    def groups(self) -> dict[str, KnobGroup]:
        return dict(self._groups)

    def names(self) -> list[str]:
        return [n for g in self._groups.values() for n in g.knob_names()]

    @staticmethod
    def canonical(name: str) -> str:
        """The current name of knob ``name`` (itself, unless it is an old name: an alias)."""
        return _ALIASES.get(name, name)

    def _owner(self, name: str) -> KnobGroup:
        g = self._by_name.get(name)
        if g is not None:
            return g
        raise KnobError(f"unknown knob {name!r}{did_you_mean(name, [*self.names(), *_ALIASES])}; "
                        f"known knobs: {', '.join(sorted(self.names()))}")

    def _canonical_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` with old names (aliases) replaced by current ones; a knob given under
        both names raises :class:`KnobError`."""
        out: dict[str, Any] = {}
        given: dict[str, str] = {}
        for name, value in values.items():
            new = _ALIASES.get(name, name)
            if new in out:
                raise KnobError(f"{given[new]!r} and {name!r} name the same knob ({new}); "
                                f"give it once")
            out[new], given[new] = value, name
        return out

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        name = _ALIASES.get(name, name)
        try:
            return getattr(self._owner(name), name)
        except KnobError as e:
            raise AttributeError(str(e)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self.set(**{name: value})

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    # -- setting --------------------------------------------------------------------------
    def set(self, **values: Any) -> "Knobs":
        """Set knobs by name (or old name, see the naming rule); a bad name or value raises
        :class:`KnobError` and changes nothing."""
        values = self._canonical_values(values)
        owners = {name: self._owner(name) for name in values}
        clean = {name: check_value(owners[name].param[name], name, value)
                 for name, value in values.items()}
        for name, value in clean.items():
            setattr(owners[name], name, value)
        self._checked.update(clean)
        return self

    def validate(self) -> "Knobs":
        """Re-check every value changed past :meth:`set` (a widget sets a group's knob
        directly); raises :class:`KnobError` for the first bad one."""
        checked = self._checked
        for name, g in self._by_name.items():
            value = getattr(g, name)
            old = checked.get(name, _MISSING)
            if type(old) is type(value) and old == value:  # NaN != NaN: re-checked
                continue
            check_value(g.param[name], name, value)
            checked[name] = value
        return self

    def allowed(self, name: str) -> str:
        """What knob ``name`` accepts, in words (for listings and messages)."""
        name = _ALIASES.get(name, name)
        return allowed(self._owner(name).param[name], name)

    def set_from_strings(self, assignments: Iterable[str]) -> "Knobs":
        """Apply CLI-style ``NAME=VALUE`` strings (NAME may be an old name)."""
        parsed: dict[str, Any] = {}
        for a in assignments:
            if "=" not in a:
                raise KnobError(f"--set expects NAME=VALUE, not {a!r}")
            name, text = a.split("=", 1)
            name = name.strip()
            new = _ALIASES.get(name, name)
            value = parse_text(self._owner(new).param[new], new, text)
            twice = [n for n in parsed if _ALIASES.get(n, n) == new]
            if twice:  # which one should win is a guess: refuse, naming both
                raise KnobError(f"knob {new!r} is set twice (--set {twice[0]}=… and --set "
                                f"{name}={text.strip()[:40]}); give it once")
            parsed[name] = value
        return self.set(**parsed)

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Flat ``{knob: value}`` of every knob (JSON-serialisable)."""
        return {n: getattr(self, n) for n in self.names()}

    def to_attrs(self) -> dict[str, str]:
        """Store attrs: ``knob.<name>`` → JSON text (so ``None`` and types survive zarr attrs);
        standard JSON only (values are finite, see :func:`check_value`)."""
        self.validate()
        return {f"knob.{k}": json.dumps(v, allow_nan=False) for k, v in self.to_dict().items()}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> "Knobs":
        """Rebuild from a store's attrs; knobs unknown to this version are ignored, and so is a
        policy that is no longer registered (the knob keeps its default). An attribute under a
        knob's old name (``knob.<alias>``) sets the knob unless the current name is there too.
        A ``knob.*`` attribute that is not JSON, or whose value the knob does not accept, raises
        :class:`KnobError` naming the attribute; so does a choice a knob with fixed choices
        (not bound to a registry: ``offload_unit``, ``transfer_order``, ``capacity_scope``,
        ``low_precision_down_input``, ``dtype``, …) does not offer."""
        from collections.abc import Mapping

        if not isinstance(attrs, Mapping):
            raise KnobError(f"store attributes must be a mapping of 'knob.NAME' to JSON text, "
                            f"not {type(attrs).__name__} ({show_value(attrs)})")
        from workbench import jsonio  # depth-limited JSON (here: knobs stays a leaf at import)

        k = cls()
        known = set(k.names())
        fresh = k._checked  # a new Knobs' checked values: the defaults
        attrs = dict(attrs)
        vals: dict[str, Any] = {}
        for key, text in attrs.items():
            if not (isinstance(key, str) and key.startswith("knob.")):
                continue
            name = _ALIASES.get(key[5:], key[5:])
            if name not in known or (name != key[5:] and f"knob.{name}" in attrs):
                continue  # unknown to this version, or an old name beside the current one
            if isinstance(text, str):
                try:
                    value = jsonio.loads(text, parse_constant=_no_constant)
                except ValueError as e:  # JSONDecodeError, or NaN/Infinity
                    raise KnobError(f"store attribute {key!r} is not valid JSON ({e}): "
                                    f"{show_value(text)}; expected {k.allowed(name)} as JSON "
                                    f"text") from None
            else:  # an attribute written as a JSON value rather than text
                value = text
            d = fresh.get(name, _MISSING)
            if type(d) is type(value) and d == value:  # its default, valid (test_knobs
                vals[name] = value  # holds every default to check_value): nothing to check
                continue
            owner = k._owner(name)
            # the class's Parameter (a new Knobs: its registries' choices are the current
            # ones, kept on the class); ``owner.param[name]`` would copy it for the instance
            p = type(owner).param[name]
            if isinstance(p, param.Selector) and isinstance(value, str) \
                    and value not in (p.objects or []) and name in type(owner)._registries:
                continue  # a policy that is no longer registered: keep the default
            # a Selector whose choices are fixed (offload_unit, transfer_order, dtype, …): a
            # value it does not know is garbage, not a retired policy; taken silently it would
            # replay another configuration than the one recorded (PREDATING's, below)
            try:
                vals[name] = check_value(p, name, value)
            except KnobError as e:
                raise KnobError(f"store attribute {key!r}: {e}") from None
        for name, value in PREDATING.items():  # a store older than the knob ran this
            vals.setdefault(name, value)
        # each value was checked above; set only those that differ from the defaults (setting
        # a param runs its watchers: most of a store's ~100 knobs keep their default)
        return k.set(**{n: v for n, v in vals.items()
                        if not (type(fresh.get(n, _MISSING)) is type(v) and fresh[n] == v)})

    def copy(self, **changes: Any) -> "Knobs":
        """A new Knobs with these values, ``changes`` applied (checked as :meth:`set` does)."""
        out = Knobs()
        fresh = out._checked  # a new Knobs' checked values: the defaults
        changes = self._canonical_values(changes)
        values = {n: getattr(g, n) for n, g in self._by_name.items()}
        values.update(changes)
        # only what differs from the defaults is set: setting a param costs its watchers' time
        return out.set(**{k: v for k, v in values.items() if k in changes or not (
            type(fresh.get(k, _MISSING)) is type(v) and fresh[k] == v)})

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"Knobs({body})"

    # -- checks that need the model -------------------------------------------------------
    def check(self, shape: ModelShape, *, live: bool = True) -> "Knobs":
        """Raise :class:`KnobError` if the knobs do not fit together or this model (``shape``),
        or cannot run live (``live`` True; policies that need the future are trace-replay only)
        or in trace replay (``live`` False). Every value is re-checked first
        (:meth:`validate`), then every group runs its :meth:`KnobGroup.check`, in menu order."""
        self.validate()
        for g in self._groups.values():
            g.check(self, shape, live=live)
        return self

    def check_against(self, num_layers: int, top_k: int, expert_bytes: int | None = None,
                      num_experts: int | None = None) -> None:
        """:meth:`check` of a live run on a model of ``num_layers`` MoE layers, ``top_k``,
        ``expert_bytes`` per expert (and ``num_experts`` per layer, when given)."""
        self.check(ModelShape(num_layers=num_layers, top_k=top_k, num_experts=num_experts,
                              expert_bytes=expert_bytes), live=True)

    def semantic_floor(self) -> int:
        """L_semantic: ``semantic_layers`` when set, else what the compression policy reads of
        the pinned prefix's routing (:meth:`CompressionPolicy.semantic_floor
        <workbench.compression.policies.CompressionPolicy.semantic_floor>`: 1 for 'affinity'
        with λ > 0, 0 otherwise)."""
        if self.semantic_layers is not None:
            return int(self.semantic_layers)
        group = self._groups.get("compression")
        return int(group.selected("compression").semantic_floor(group)) if group else 0

    def reserve_slots(self, top_k: int) -> int:
        """C_safe in slots: ``cache_reserve_slots`` when set, else the model's top-k."""
        return int(top_k if self.cache_reserve_slots is None else self.cache_reserve_slots)

    def effective_slots(self, expert_bytes: int) -> int:
        """Slots the cache gets: from ``cache_bytes`` when set, else ``cache_slots``."""
        if self.cache_bytes is not None:
            return int(self.cache_bytes // max(expert_bytes, 1))
        return int(self.cache_slots)


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not standard JSON")


def _reword(msg: str, name: str) -> str:
    """param says "Integer parameter 'CacheKnobs.cache_slots' must be …": keep it, name the knob."""
    import re

    return re.sub(r"^\w+ parameter '\w+\.(\w+)'", r"\1", msg)
