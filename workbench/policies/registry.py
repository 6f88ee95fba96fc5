"""A tiny name → class registry, one per policy family.

A policy registered with ``@REGISTRY.register("name")`` shows up in ``available()``, hence in the
knob ``Selector`` menus, the dashboard and ``--set`` validation, without touching any UI code.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from workbench.errors import KnobError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named classes of one policy family (eviction, prefetch, …)."""

    def __init__(self, family: str, knob: str):
        self.family = family
        self.knob = knob  # the knob that selects from this registry, for error messages
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: register ``cls`` under ``name`` (names are unique per family)."""

        def deco(cls: type[T]) -> type[T]:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.family} policy {name!r} is already registered")
            self._classes[name] = cls
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

    def create(self, name: str, *args, **kwargs) -> T:
        return self.get(name)(*args, **kwargs)

    def __contains__(self, name: object) -> bool:
        return name in self._classes
