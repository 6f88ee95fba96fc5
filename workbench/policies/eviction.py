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

    def begin_group(self, group: int, step: int) -> None:
        """A layer's accesses of ``step`` are about to be looked up (``group`` counts the
        (step, layer) groups served so far). Policies that keep time in steps use it."""

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


@EVICTION.register("belady")
class Belady(EvictionPolicy):
    """Belady's MIN: evict the candidate whose next use is farthest in the future.

    The hit-rate ceiling of any eviction policy on a trace (with one key per access; with a
    whole layer's experts needed at once it is the classic heuristic form of MIN). It needs the
    future, so only trace replay can run it: replay calls :meth:`prepare` with the trace's
    access groups and :meth:`begin_group` before each group. Ties (e.g. never used again) go to
    the least recently used, then the smallest (layer, expert).
    """

    needs_future = True

    def reset(self) -> None:
        self.last_use: dict[Key, int] = {}
        self._occ: dict[Key, list[int]] = {}
        self._ptr: dict[Key, int] = {}
        self._group = 0

    def prepare(self, groups) -> None:
        """Index every key's access groups (``groups``: :class:`workbench.traces.trace.Groups`)."""
        import numpy as np

        g_of = np.repeat(np.arange(groups.num_groups), np.diff(groups.ptr))
        layer_of = np.repeat(groups.layer, np.diff(groups.ptr))
        occ: dict[Key, list[int]] = {}
        for g, l, e in zip(g_of.tolist(), layer_of.tolist(), groups.expert.tolist()):
            occ.setdefault((l, e), []).append(g)
        self._occ, self._ptr = occ, {k: 0 for k in occ}

    def begin_group(self, group: int, step: int) -> None:
        self._group = group

    def next_use(self, key: Key) -> float:
        """Index of the first group after the current one that uses ``key`` (inf: never)."""
        occ = self._occ.get(key)
        if not occ:
            return float("inf")
        i = self._ptr[key]
        while i < len(occ) and occ[i] <= self._group:
            i += 1
        self._ptr[key] = i
        return occ[i] if i < len(occ) else float("inf")

    def on_hit(self, key: Key, t: int) -> None:
        self.last_use[key] = t

    on_insert = on_hit

    def on_evict(self, key: Key) -> None:
        self.last_use.pop(key, None)

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        if not self._occ:
            raise RuntimeError("belady needs the future: run it with trace replay "
                               "(workbench replay / workbench.replay)")
        return min(candidates, key=lambda k: (-self.next_use(k), self.last_use.get(k, -1), k))


@EVICTION.register("hotness")
class Hotness(EvictionPolicy):
    """Decayed hotness (ActiveEvict's history term): evict the candidate with the lowest
    u(e) = Σ γ^(now − s) over the steps s < now + 1 in the last ``window`` steps that used it.

    γ = knob ``hotness_decay`` ∈ (0, 1], T = knob ``hotness_window`` in steps (one decode step =
    one token). Ties go to the least recently used. The step comes from :meth:`begin_group`
    (the runtime and replay call it before each layer's accesses).
    """

    def __init__(self, hotness_decay: float = 0.8, hotness_window: int = 16,
                 **kw: object) -> None:
        if not 0.0 < hotness_decay <= 1.0:
            raise ValueError(f"hotness_decay must be in (0, 1], not {hotness_decay}")
        if hotness_window < 1:
            raise ValueError(f"hotness_window must be at least 1 step, not {hotness_window}")
        self.decay, self.window = float(hotness_decay), int(hotness_window)
        super().__init__(**kw)

    def reset(self) -> None:
        self.last_use: dict[Key, int] = {}
        self.uses: dict[Key, list[int]] = {}  # steps that used the key, newest last, ≤ window
        self.step = 0

    def begin_group(self, group: int, step: int) -> None:
        self.step = step

    def on_hit(self, key: Key, t: int) -> None:
        self.last_use[key] = t
        u = self.uses.setdefault(key, [])
        if not u or u[-1] != self.step:
            u.append(self.step)
            if len(u) > self.window:
                del u[0]

    on_insert = on_hit

    def score(self, key: Key) -> float:
        return sum(self.decay ** (self.step - s) for s in self.uses.get(key, ())
                   if self.step - s < self.window)

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        return min(candidates, key=lambda k: (self.score(k), self.last_use.get(k, -1)))
