"""A tiny name → class registry, one per policy family, and the policies' declared needs.

A policy registered with ``@REGISTRY.register("name")`` shows up in ``available()``, hence in the
knob ``Selector`` menus, the dashboard and ``--set`` validation, without touching any UI code.

**Declared dependencies.** A policy class declares

- the knobs it takes, as the keyword parameters of its ``__init__`` (named like the knobs,
  defaulting to the knob's default): :meth:`Registry.create` passes it those and nothing else,
  so ``EVICTION.create(k.eviction, **knobs.to_dict())`` gives the ``hotness`` policy
  ``hotness_decay`` and ``hotness_window`` only. A class whose ``__init__`` takes ``**kwargs``
  gets every value it is given (the old convention; still accepted for outside policies);
- how a run builds it, ``from_knobs(knobs)`` (a classmethod of the family's base): a built-in
  that takes knobs reads its own knob group's fields, typed; the base falls back to the knobs its
  ``__init__`` declares (:func:`declared_kwargs`), so an outside policy needs no more than them;
- what it needs from its caller in one field, ``needs`` (a frozenset of words: ``"future"`` —
  the true future, trace replay only; ``"predictor"`` — the live lookahead predictor;
  ``"pred_ids"`` / ``"predicted_ids"`` — a trace's recorded router lookahead / predictor
  outputs; ``"saliency"`` / ``"prefix_routing"`` — a compression policy's inputs). The old flags
  (``needs_future``, ``needs_predictor``, ``needs_saliency``, ``needs_prefix_routing``) read that
  field (:class:`NeedsFlag`), on the class and on instances alike.

This module imports nothing of the workbench but its errors, so :mod:`workbench.knobs` and every
feature package can import it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Generic, Mapping, TypeVar

from workbench.errors import KnobError

T = TypeVar("T")


class NeedsFlag:
    """A read-only boolean attribute that is ``word in cls.needs`` — on the class and on its
    instances (so ``getattr(EVICTION.get(name), "needs_future", False)`` keeps working)."""

    def __init__(self, word: str) -> None:
        self.word = word

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = name

    def __get__(self, obj: Any, owner: type | None = None) -> bool:
        cls = owner if owner is not None else type(obj)
        return self.word in getattr(cls, "needs", frozenset())


def declared_params(cls: type) -> frozenset[str] | None:
    """The keyword parameters ``cls(...)`` accepts; None when it takes ``**kwargs`` (any)."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature: give it everything
        return None
    names = set()
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(p.name)
    return frozenset(names)


def declared_kwargs(cls: type, knobs: Any) -> dict[str, Any]:
    """The knobs of ``knobs`` (a :class:`~workbench.knobs.Knobs`) that ``cls``'s ``__init__``
    declares, by name (every one for ``**kwargs``): the fallback of a policy's ``from_knobs``
    for a class that does not read its knob group itself (an outside policy)."""
    params = declared_params(cls)
    if params is not None and not params:
        return {}
    values = knobs.to_dict()
    return values if params is None else {k: v for k, v in values.items() if k in params}


class Registry(Generic[T]):
    """Named classes of one policy family (eviction, prefetch, …)."""

    def __init__(self, family: str, knob: str):
        self.family = family
        self.knob = knob  # the knob that selects from this registry, for error messages
        self._classes: dict[str, type[T]] = {}
        self._params: dict[type, frozenset[str] | None] = {}  # class → declared knobs

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: register ``cls`` under ``name`` (names are unique per family).
        The keyword parameters of its ``__init__`` are read once, here."""

        def deco(cls: type[T]) -> type[T]:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.family} policy {name!r} is already registered")
            self._classes[name] = cls
            self._params[cls] = declared_params(cls)
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def available(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._classes)

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``; unknown names list the available ones."""
        try:
            return self._classes[name]
        except KeyError:
            raise KnobError(
                f"{self.knob} must be one of {', '.join(self.available())}, not {name!r}"
            ) from None

    def params(self, name: str) -> frozenset[str] | None:
        """The knobs policy ``name`` declares (its ``__init__``'s keyword parameters); None
        when it takes ``**kwargs``."""
        cls = self.get(name)
        if cls not in self._params:  # put into _classes by hand
            self._params[cls] = declared_params(cls)
        return self._params[cls]

    def kwargs_for(self, name: str, values: Mapping[str, Any]) -> dict[str, Any]:
        """The part of ``values`` (e.g. every knob) that policy ``name`` declares."""
        accepted = self.params(name)
        if accepted is None:
            return dict(values)
        return {k: v for k, v in values.items() if k in accepted}

    def create(self, name: str, *args: Any, **kwargs: Any) -> T:
        """An instance of policy ``name``, given only the keyword arguments it declares."""
        return self.get(name)(*args, **self.kwargs_for(name, kwargs))

    def __contains__(self, name: object) -> bool:
        return name in self._classes
