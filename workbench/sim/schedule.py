"""The schedule of one (step, layer) group: the typed actions :meth:`Simulator.step
<workbench.sim.step.Simulator.step>` decides and the live runtime's executor
(:mod:`workbench.runtime.executor`) runs on real tensors, in order.

Slots are those of the instant the action runs: later actions of the same group may reuse
them. An expert is an id of the group's layer (a sub-expert key with sub-expert offloading); a
key is ``(layer, expert)``. The records are named tuples: immutable, and as cheap to build as
the step's other bookkeeping (a frozen dataclass costs about twice as much per record).
"""

from __future__ import annotations

from typing import NamedTuple, Union

from workbench.sim.cache import Key


class Load(NamedTuple):
    """Copy miss ``expert`` into ``slot``, evicting ``victim`` (None: the slot was free)."""

    expert: int
    slot: int
    victim: Key | None


class Prefetch(NamedTuple):
    """Copy ``key`` (any layer's) into ``slot`` ahead of its access, evicting ``victim``."""

    key: Key
    slot: int
    victim: Key | None


class PreEvicted(NamedTuple):
    """``key`` left the cache to make room for the next layer (ActiveEvict)."""

    key: Key


class Hits(NamedTuple):
    """Compute the group's hits over ``slots`` (aligned with the outcome's hits; empty for a
    pinned layer, whose experts are all resident)."""

    slots: list[int]


class HostRun(NamedTuple):
    """Compute miss ``expert`` on the host over the host store's copy (hybrid)."""

    expert: int


class Miss(NamedTuple):
    """Compute miss ``expert`` from the slot its :class:`Load` named, once its copy landed."""

    expert: int


class Cancelled(NamedTuple):
    """``key``'s prefetch never started and its layer has run: its slot is free again
    (demand-first transfer order, :mod:`workbench.sim.lane`)."""

    key: Key


class LayerUnit(NamedTuple):
    """Layer-wise offload unit (``offload_unit`` ≠ expert, :mod:`workbench.sim.unit`): wait
    for every copy of the group's layer (scheduled as :class:`Prefetch` records), then compute
    the routed ``experts`` over their ``slots``, all at once."""

    experts: list[int]
    slots: list[int]


class Freed(NamedTuple):
    """The layer-wise unit let ``key`` go at its layer's end (nothing is kept across layers):
    its slot is free again."""

    key: Key


Action = Union[Load, Prefetch, PreEvicted, Hits, HostRun, Miss, Cancelled, LayerUnit, Freed]
