"""Policy families, each behind a :class:`~workbench.policies.registry.Registry`."""

from workbench.policies.registry import Registry
from workbench.policies import eviction

__all__ = ["Registry", "eviction"]
