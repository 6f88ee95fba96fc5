"""Eviction policies for the expert cache.

One policy object serves the live runtime and trace replay alike: the cache calls
``on_hit`` / ``on_insert`` / ``on_evict`` as accesses happen and asks ``choose_victim`` for a slot
to free. Keys are ``(layer, expert)`` pairs; ``t`` is a logical access clock that only grows.

Register a new policy with ``@EVICTION.register("name")``: it then appears in the ``eviction``
knob's menu, the dashboard and ``--set eviction=name``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Iterable

from workbench.policies.registry import Registry

Key = Hashable


class EvictionPolicy(ABC):
    """Decides which resident expert to evict.

    Invariant: ``choose_victim`` returns one of ``candidates`` (the resident experts that may be
    evicted right now; the cache never passes experts the current layer still needs).
    """

    name: str = "abstract"

    def __init__(self, **_: object) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget all history (a new run)."""

    @abstractmethod
    def on_hit(self, key: Key, t: int) -> None:
        """``key`` was used while resident."""

    @abstractmethod
    def on_insert(self, key: Key, t: int) -> None:
        """``key`` was loaded into the cache (and is about to be used)."""

    def on_evict(self, key: Key) -> None:
        """``key`` left the cache."""

    @abstractmethod
    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        """The candidate to evict."""


EVICTION: Registry[EvictionPolicy] = Registry("eviction", knob="eviction")


@EVICTION.register("lru")
class LRU(EvictionPolicy):
    """Least recently used: evict the candidate whose last use is oldest."""

    def reset(self) -> None:
        self.last_use: dict[Key, int] = {}

    def on_hit(self, key: Key, t: int) -> None:
        self.last_use[key] = t

    on_insert = on_hit

    def on_evict(self, key: Key) -> None:
        self.last_use.pop(key, None)

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        return min(candidates, key=lambda k: self.last_use.get(k, -1))


@EVICTION.register("lfu")
class LFU(EvictionPolicy):
    """Least frequently used, counting every use since the run started ("perfect" LFU).

    Counts survive eviction, because an expert's popularity is a property of the model and the
    input, not of its stay in the cache. Ties go to the least recently used.
    """

    def reset(self) -> None:
        self.count: dict[Key, int] = {}
        self.last_use: dict[Key, int] = {}

    def on_hit(self, key: Key, t: int) -> None:
        self.count[key] = self.count.get(key, 0) + 1
        self.last_use[key] = t

    on_insert = on_hit

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        return min(candidates, key=lambda k: (self.count.get(k, 0), self.last_use.get(k, -1)))
