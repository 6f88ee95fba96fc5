"""Knobs: every user-settable value of a run, declared once.

Each group is a ``param.Parameterized`` class whose parameters carry bounds, soft bounds (slider
ranges) and docs. The same objects validate values, generate notebook/dashboard widgets
(``pn.Param(knobs.group("cache"))``), map to CLI ``--set NAME=VALUE`` flags and serialise into the
attrs of every stored run. Knob names are unique across groups, so a flat ``NAME=VALUE`` is never
ambiguous.

Later capabilities add a group with :func:`register_group`; it then shows up everywhere.
Checks that need the model (``cache_slots`` ≥ top-k, ``pinned_layers`` ≤ MoE layers) live in
:meth:`Knobs.check_against`.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

import param

from workbench.errors import KnobError
from workbench.policies.eviction import EVICTION
from workbench.policies.prefetch import PREFETCH
from workbench.policies.registry import Registry
from workbench.runtime.profiles import available_profiles, available_target_models


class KnobGroup(param.Parameterized):
    """Base of knob groups. A knob that may be None ("no limit", "auto") has no softbounds, so
    that ``pn.Param(group)`` renders it as a number box (a slider cannot hold None). ``_registries`` maps Selector knobs to the policy registry behind them,
    so each new instance offers every policy registered so far."""

    _registries: dict[str, Registry] = {}
    title: str = ""

    def __init__(self, **params: Any) -> None:
        super().__init__()
        for knob, registry in self._registries.items():
            self.param[knob].objects = registry.available()
        self.param.update(**params)

    @classmethod
    def knob_names(cls) -> list[str]:
        return [n for n in cls.param if n != "name"]


class CacheKnobs(KnobGroup):
    """Expert cache and memory layout (seed VisMMOE §3.4): pinned prefix + slab cache of slots."""

    title = "Expert cache"
    _registries = {"eviction": EVICTION}

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
            "⌊(M_avail − C_safe)/S_layer⌋ (seed VisMMOE eq. 10): the fewest MoE layers whose "
            "routing the run needs. The paper finds it empirically; None (auto) = 1 when "
            "compression is 'affinity' with λ > 0 (its expert affinity reads the prefix "
            "routing), else 0 (no lower bound).")
    cache_reserve_slots = param.Integer(
        default=None, allow_None=True, bounds=(0, None),
        doc="C_safe in expert slots: the least the dynamic expert cache keeps beside the pinned "
            "prefix, which caps it at ⌊(M_avail − C_safe)/S_layer⌋ layers. None (auto) = the "
            "model's top-k (the cache must hold one layer's routing of a token).")
    eviction = param.Selector(
        default="lru", objects=EVICTION.available(),
        doc="Which cached expert leaves when a slot is needed ('belady' needs the future: "
            "trace replay only).")
    hotness_decay = param.Number(
        default=0.8, bounds=(0.0, 1.0), inclusive_bounds=(False, True), softbounds=(0.5, 1.0),
        doc="γ of the 'hotness' eviction policy: a use s steps ago weighs γ^s.")
    hotness_window = param.Integer(
        default=16, bounds=(1, 64), softbounds=(1, 64),
        doc="T of the 'hotness' eviction policy: uses older than T steps are forgotten.")
    hybrid = param.Boolean(
        default=False,
        doc="GPU–CPU hybrid mode (seed VisMMOE §3.4): a miss runs on the host copy of the "
            "expert instead of being loaded when that ends sooner on the modeled hardware "
            "(host compute + activations over the link < transfer + device compute; decode "
            "misses usually qualify, big prefill groups do not). Host runs have their own "
            "timeline lane.")


class PrefetchKnobs(KnobGroup):
    """Prefetch: copy experts before a layer asks for them (SPEC §2 baselines and bounds)."""

    title = "Prefetch"
    _registries = {"prefetch": PREFETCH}

    prefetch = param.Selector(
        default="none", objects=PREFETCH.available(),
        doc="Which experts to fetch ahead: 'speculative'/'apex' use the recorded router "
            "lookahead, 'oracle' knows the future (trace replay only).")
    prefetch_lead = param.Integer(
        default=1, bounds=(1, None), softbounds=(1, 8),
        doc="How many layers ahead a prefetch may target.")
    prefetch_budget = param.Integer(
        default=None, allow_None=True, bounds=(1, None),
        doc="Most experts prefetched per layer step (None: no limit).")


class CostKnobs(KnobGroup):
    """How the *modeled* clock prices transfers and compute."""

    title = "Cost model (modeled)"

    profile = param.Selector(
        default="a100-40gb", objects=available_profiles(),
        doc="Hardware profile of the modeled timeline (see docs/hardware-profiles.md).")
    target_model = param.Selector(
        default="none", objects=["none", *available_target_models()],
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
        default=16, bounds=(1, 4096), softbounds=(1, 128), doc="Tokens to generate at most.")
    sampling = param.Boolean(default=False, doc="Sample instead of greedy decoding.")
    temperature = param.Number(
        default=1.0, bounds=(0.0, None), inclusive_bounds=(False, True), softbounds=(0.1, 2.0),
        doc="Softmax temperature when sampling.")
    top_p = param.Number(
        default=1.0, bounds=(0.0, 1.0), inclusive_bounds=(False, True),
        doc="Nucleus sampling mass when sampling.")
    seed = param.Integer(default=0, bounds=(0, None), doc="Random seed for sampling.")
    ignore_eos = param.Boolean(
        default=False, doc="Generate exactly max_new_tokens, past the end-of-sequence token "
                           "(for benchmarks, like vLLM's ignore_eos).")


_GROUPS: dict[str, type[KnobGroup]] = {}


def register_group(key: str, cls: type[KnobGroup]) -> type[KnobGroup]:
    """Add a knob group; its knob names must not clash with any registered knob."""
    known = {n for g in _GROUPS.values() for n in g.knob_names()}
    clash = known & set(cls.knob_names())
    if clash and _GROUPS.get(key) is not cls:
        raise ValueError(f"knob names {sorted(clash)} of {cls.__name__} are already used")
    _GROUPS[key] = cls
    return cls


for _key, _cls in (("cache", CacheKnobs), ("prefetch", PrefetchKnobs), ("cost", CostKnobs),
                   ("exec", ExecKnobs), ("generation", GenerationKnobs)):
    register_group(_key, _cls)


def _parse(p: param.Parameter, name: str, text: str) -> Any:
    """Turn a CLI string into the knob's type (validation proper is param's job)."""
    t = text.strip()
    if p.allow_None and t.lower() in ("none", "null", ""):
        return None
    try:
        if isinstance(p, param.Boolean):
            low = t.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(p, param.Integer):
            return int(t)
        if isinstance(p, param.Number):
            return float(t)
    except ValueError:
        kind = type(p).__name__.lower()
        raise KnobError(f"{name} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not {text!r}") from None
    return t


class Knobs:
    """All knob groups of one run, addressed by flat, unique knob names.

    >>> k = Knobs(cache_slots=32, eviction="lfu")
    >>> k.cache_slots
    32
    """

    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_groups", {key: cls() for key, cls in _GROUPS.items()})
        # knob name → its group (names are unique across groups): O(1) flat access
        object.__setattr__(self, "_by_name", {n: g for g in self._groups.values()
                                              for n in g.knob_names()})
        self.set(**values)

    # -- access ---------------------------------------------------------------------------
    def group(self, key: str) -> KnobGroup:
        return self._groups[key]

    @property
    def groups(self) -> dict[str, KnobGroup]:
        return dict(self._groups)

    def names(self) -> list[str]:
        return [n for g in self._groups.values() for n in g.knob_names()]

    def _owner(self, name: str) -> KnobGroup:
        g = self._by_name.get(name)
        if g is not None:
            return g
        raise KnobError(f"unknown knob {name!r}; known knobs: {', '.join(sorted(self.names()))}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
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
        """Set knobs by name; a bad name or value raises :class:`KnobError` and changes nothing."""
        owners = {name: self._owner(name) for name in values}
        for name, value in values.items():
            p = owners[name].param[name]
            try:
                p._validate(value)
            except ValueError as e:
                raise KnobError(_reword(str(e), name)) from None
        for name, value in values.items():
            setattr(owners[name], name, value)
        return self

    def set_from_strings(self, assignments: Iterable[str]) -> "Knobs":
        """Apply CLI-style ``NAME=VALUE`` strings."""
        parsed: dict[str, Any] = {}
        for a in assignments:
            if "=" not in a:
                raise KnobError(f"--set expects NAME=VALUE, not {a!r}")
            name, text = a.split("=", 1)
            name = name.strip()
            parsed[name] = _parse(self._owner(name).param[name], name, text)
        return self.set(**parsed)

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Flat ``{knob: value}`` of every knob (JSON-serialisable)."""
        return {n: getattr(self, n) for n in self.names()}

    def to_attrs(self) -> dict[str, str]:
        """Store attrs: ``knob.<name>`` → JSON text (so ``None`` and types survive zarr attrs)."""
        return {f"knob.{k}": json.dumps(v) for k, v in self.to_dict().items()}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> "Knobs":
        """Rebuild from a store's attrs; knobs unknown to this version are ignored."""
        k = cls()
        known = set(k.names())
        vals = {key[5:]: json.loads(v) for key, v in attrs.items()
                if key.startswith("knob.") and key[5:] in known}
        # a policy that is no longer registered cannot be re-selected: keep the default
        return k.set(**{n: v for n, v in vals.items() if _accepts(k, n, v)})

    def copy(self, **changes: Any) -> "Knobs":
        return Knobs(**{**self.to_dict(), **changes})

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"Knobs({body})"

    # -- checks that need the model -------------------------------------------------------
    def check_against(self, num_layers: int, top_k: int, expert_bytes: int) -> None:
        """Raise :class:`KnobError` if a knob is out of range for this model's MoE layout or
        cannot run live (policies that need the future are trace-replay only)."""
        live_ev = [n for n in EVICTION.available()
                   if not getattr(EVICTION.get(n), "needs_future", False)]
        if getattr(EVICTION.get(self.eviction), "needs_future", False):
            raise KnobError(
                f"eviction {self.eviction!r} needs the future, so only trace replay can run it "
                f"(workbench replay); live runs take one of {', '.join(live_ev)}")
        needs = PREFETCH.get(self.prefetch).needs
        if "future" in needs:
            live_pf = [n for n in PREFETCH.available() if "future" not in PREFETCH.get(n).needs]
            raise KnobError(
                f"prefetch {self.prefetch!r} needs the future, so only trace replay can run it "
                f"(workbench replay); live runs take one of {', '.join(live_pf)}")
        if "pred_ids" in needs and getattr(self, "lookahead_depth", 0) < 1:
            raise KnobError(
                f"prefetch {self.prefetch!r} uses router lookahead: lookahead_depth must be at "
                f"least 1, not {getattr(self, 'lookahead_depth', 0)}")
        if self.pinned_layers > num_layers:
            raise KnobError(
                f"pinned_layers must be between 0 and {num_layers} (the model's MoE layers), "
                f"not {self.pinned_layers}")
        if self.pinned_layers < num_layers:
            slots = self.effective_slots(expert_bytes)
            if slots < top_k:
                if self.cache_bytes is not None:
                    raise KnobError(
                        f"cache_bytes must hold at least {top_k} experts (top-k) = "
                        f"{top_k * expert_bytes} bytes, not {self.cache_bytes}")
                raise KnobError(
                    f"cache_slots must be at least {top_k} (top-k), not {self.cache_slots}")

    def semantic_floor(self) -> int:
        """L_semantic: ``semantic_layers`` when set, else 1 for 'affinity' compression with
        λ > 0 (it reads the prefix routing) and 0 otherwise."""
        if self.semantic_layers is not None:
            return int(self.semantic_layers)
        comp = getattr(self, "compression", "none")
        return 1 if comp == "affinity" and getattr(self, "lam", 0.0) > 0 else 0

    def reserve_slots(self, top_k: int) -> int:
        """C_safe in slots: ``cache_reserve_slots`` when set, else the model's top-k."""
        return int(top_k if self.cache_reserve_slots is None else self.cache_reserve_slots)

    def effective_slots(self, expert_bytes: int) -> int:
        """Slots the cache gets: from ``cache_bytes`` when set, else ``cache_slots``."""
        if self.cache_bytes is not None:
            return int(self.cache_bytes // max(expert_bytes, 1))
        return int(self.cache_slots)


def _accepts(k: Knobs, name: str, value: Any) -> bool:
    try:
        k._owner(name).param[name]._validate(value)
        return True
    except ValueError:
        return False


def _reword(msg: str, name: str) -> str:
    """param says "Integer parameter 'CacheKnobs.cache_slots' must be …": keep it, name the knob."""
    import re

    return re.sub(r"^\w+ parameter '\w+\.(\w+)'", r"\1", msg)


import workbench.policies.active_evict  # noqa: E402,F401  (registers the "active_evict" knob group)
import workbench.compression.policies  # noqa: E402,F401  (registers the "compression" knob group)
import workbench.predictor.policy  # noqa: E402,F401  (registers the "predictor" knob group and prefetch "vismmoe")
