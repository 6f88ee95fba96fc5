"""Policy families, each behind a :class:`~workbench.policies.registry.Registry`.

Importing the package imports only the registry: a family module (``eviction``, ``prefetch``,
``active_evict``) is imported where it is used, and :mod:`workbench.features` imports them all
to register their knobs. (An eager import here made every ``workbench.policies.*`` import run
the eviction module first, which is how import cycles through this package start.)
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from workbench.policies.registry import Registry

__all__ = ["Registry", "eviction", "prefetch", "active_evict"]


def __getattr__(name: str) -> Any:
    if name in ("eviction", "prefetch", "active_evict"):
        return import_module(f"workbench.policies.{name}")
    raise AttributeError(f"module 'workbench.policies' has no attribute {name!r}")
