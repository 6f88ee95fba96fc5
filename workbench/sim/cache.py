"""The expert cache's bookkeeping: which (layer, expert) occupies which of a fixed number of
slots, one routed expert each. The slots' tensors, when there are any, belong to the live
runtime (:class:`workbench.runtime.slots.SlotPool`); this module never imports torch.

Invariants (checked by tests):
- ``slot_of[key] == s``  ⇔  ``key_in[s] == key``; at most ``num_slots`` experts are resident.
- An expert the current layer still needs (``protected``) is never evicted.
- Counters live here, per MoE layer: ``hits``, ``misses``, ``loads`` (admissions),
  ``evictions``, ``cancelled`` (admitted prefetches whose copy never started: demand-first
  transfer order, :mod:`workbench.sim.lane`) (cumulative since the run started; lists of
  ints, :meth:`ExpertCache.counters` gives them as arrays); telemetry reads them, it does not
  count on its own.

The cache knows nothing about models or transfers: it maps keys to slots and asks its eviction
policy for victims, so trace replay can drive the very same object.
"""

from __future__ import annotations

from itertools import chain
from typing import Hashable, Iterable

import numpy as np

from workbench.policies.eviction import EvictionPolicy

Key = tuple[int, int]  # (layer, expert)


class ExpertCache:
    """Slot bookkeeping of one pool of ``num_slots`` slots under one eviction policy."""

    def __init__(self, num_slots: int, policy: EvictionPolicy, num_layers: int,
                 num_experts: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, not {num_slots}")
        self.num_slots = num_slots
        self.policy = policy
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.slot_of: dict[Key, int] = {}
        self.key_in: list[Key | None] = [None] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.t = 0  # logical access clock handed to the policy
        policy.bind_cache(num_slots, num_layers, num_experts)
        # per-layer counters as lists: a numpy element's += is ≈ 4× a list's, and an admission
        # makes two (counters() hands out arrays)
        z = lambda: [0] * num_layers  # noqa: E731
        self.hits, self.misses, self.loads, self.evictions = z(), z(), z(), z()
        self.cancelled = z()

    # -- queries ---------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def residency(self) -> np.ndarray:
        """``bool[num_layers, num_experts]``: which experts occupy a slot now."""
        r = np.zeros((self.num_layers, self.num_experts), dtype=bool)
        # the keys' two ints in one flat read, then one fancy assignment (≈ 5× a loop over
        # thousands of sub-expert keys, once per step)
        flat = np.fromiter(chain.from_iterable(self.slot_of), np.int64,
                           count=2 * len(self.slot_of))
        r[flat[0::2], flat[1::2]] = True
        return r

    def slot(self, key: Key) -> int | None:
        """The slot ``key`` occupies, or None when it is not resident."""
        return self.slot_of.get(key)

    def free_slots(self) -> int:
        """Slots that hold no expert."""
        return self.num_slots - len(self.slot_of)

    def resident(self) -> list[Key]:
        """The resident keys (any order)."""
        return list(self.slot_of)

    # -- accesses ----------------------------------------------------------------------------
    def lookup(self, layer: int, experts: Iterable[int]) -> tuple[list[int], list[int]]:
        """Count one access per expert of ``layer``; returns (hit experts, missed experts)."""
        hits, misses = [], []
        slot_of, on_hit, t = self.slot_of, self.policy.on_hit, self.t
        for e in experts:
            key = (layer, e)
            t += 1
            if key in slot_of:
                hits.append(e)
                on_hit(key, t)
            else:
                misses.append(e)
        self.t = t
        self.hits[layer] += len(hits)
        self.misses[layer] += len(misses)
        return hits, misses

    def admit(self, key: Key, protected: set[Hashable] = frozenset()) -> tuple[int, Key | None] | None:
        """Give ``key`` a slot, evicting a non-protected resident if needed.

        Returns ``(slot, evicted key or None)``, or ``None`` when every slot is protected (the
        caller must finish work on some protected expert first). Counts a load.
        """
        slot_of, policy = self.slot_of, self.policy  # (one admission per miss: locals)
        if key in slot_of:
            raise ValueError(f"expert {key} is already resident")
        evicted = None
        if self._free:
            policy.before_admit(key, self.t)
            slot = self._free.pop()
        else:
            if len(slot_of) <= len(protected) and \
                    len(slot_of) <= sum(k in slot_of for k in protected):
                return None  # every resident key is protected
            policy.before_admit(key, self.t)
            evicted = policy.victim(slot_of, protected, self.t)
            slot = slot_of.pop(evicted)
            policy.on_evict(evicted)
            self.evictions[evicted[0]] += 1
        slot_of[key] = slot
        self.key_in[slot] = key
        self.t = t = self.t + 1
        policy.on_insert(key, t)
        self.loads[key[0]] += 1
        return slot, evicted

    def evict(self, key: Key) -> int:
        """Free ``key``'s slot now (a pre-eviction, e.g. ActiveEvict's): the policy is told and
        the layer's ``evictions`` counter grows, as for an eviction inside :meth:`admit`.
        Returns the freed slot."""
        slot = self.slot_of.pop(key)
        self.key_in[slot] = None
        self._free.append(slot)
        self.policy.on_evict(key)
        self.evictions[key[0]] += 1
        return slot

    def cancel(self, key: Key) -> int:
        """Free the slot of ``key``, a prefetch whose copy never started (demand-first
        transfer order): the policy is told as for an eviction, the layer's ``cancelled``
        counter grows (not ``evictions``). Returns the freed slot."""
        slot = self.slot_of.pop(key)
        self.key_in[slot] = None
        self._free.append(slot)
        self.policy.on_evict(key)
        self.cancelled[key[0]] += 1
        return slot

    def fill(self, layer: int, experts: Iterable[int], misses: Iterable[int]) -> "LayerFill":
        """Start admitting ``misses`` of ``layer`` (see :class:`LayerFill`)."""
        return LayerFill(self, layer, experts, misses)

    def counters(self) -> dict[str, np.ndarray]:
        """Copies of the cumulative per-layer counters."""
        return {"hits": np.array(self.hits, np.int64), "misses": np.array(self.misses, np.int64),
                "loads": np.array(self.loads, np.int64),
                "evictions": np.array(self.evictions, np.int64),
                "cancelled": np.array(self.cancelled, np.int64)}


class LayerFill:
    """Admits one layer's missed experts into the cache, in order, as slots allow.

    Every routed expert of the layer starts *protected* (it must stay until the layer has
    computed it). :meth:`issue` admits pending misses while a slot is free or holds an
    unprotected expert and returns ``(expert, slot, evicted key or None)`` per admission;
    :meth:`done` unprotects experts the layer has finished with. The live offloader and trace
    replay both drive this object in the same order (issue → done(hits) → issue → per admitted
    miss: done → issue), which is what makes their evictions identical.
    """

    def __init__(self, cache: ExpertCache, layer: int, experts: Iterable[int],
                 misses: Iterable[int]) -> None:
        self.cache = cache
        self.layer = layer
        self.pending = list(misses)
        self.protected = {(layer, e) for e in experts}

    def issue(self) -> list[tuple[int, int, Key | None]]:
        out = []
        while self.pending:
            got = self.cache.admit((self.layer, self.pending[0]), self.protected)
            if got is None:
                break  # every slot holds an expert this layer still needs
            out.append((self.pending.pop(0), *got))
        return out

    def done(self, experts: Iterable[int]) -> None:
        self.protected.difference_update((self.layer, e) for e in experts)
