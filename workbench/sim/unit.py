"""The offload unit (``offload_unit`` knob, issue 39 §2): what an offloaded layer copies in.

- ``expert`` (the default): the per-expert cache of :mod:`workbench.sim.step` — a miss copies
  one expert, experts stay resident across layers and steps until evicted.
- ``layerwise``: Hugging Face accelerate's offload hooks (``cpu_offload`` / a ``device_map``
  with offloaded modules; VisMMOE Table 4's "Base"): when an offloaded MoE layer is reached,
  all its E experts are copied in and the layer waits for every copy before it computes;
  at the layer's end they all leave (nothing is kept across layers).
- ``layerwise-prefetch``: the same unit, and the next layer's E experts are copied while
  this one computes (issued when a layer is reached, pinned layers included, for the next
  layer of the same step when it is offloaded); a layer nobody prefetched (the first
  offloaded one of a step when ``pinned_layers`` = 0) is copied as under ``layerwise``.

Counts (the store's, the run summary's and replay's, all from :meth:`Simulator.step
<workbench.sim.step.Simulator.step>`):

- ``loads`` = experts copied: E per offloaded layer per step;
- a **hit** is a routed expert found resident when its layer looks it up. Under
  ``layerwise`` nothing is ever resident then: hits = 0, every distinct routed expert is a
  miss (a demand copy), and the layer's other E − r experts are copies nobody asked for,
  booked as prefetches of the layer itself that are never used (``redundant``); under
  ``layerwise-prefetch`` a prefetched layer's routed experts are hits on a prefetch
  (``prefetch_hits``), exactly as a prefetched expert is under ``expert``, its E copies
  prefetches and the E − r unrouted ones redundant;
- every one of the layer's E experts is evicted at the layer's end (``evictions``).

Memory: the unit holds one layer's experts (two with prefetch; one when a single layer is
offloaded), so ``cache_slots`` must be at least that (:func:`slots_needed`; the knob check
refuses fewer); more slots stay unused. The eviction policy is never asked for a victim.
Per-expert mechanisms (a prefetch policy, hybrid host runs, ActiveEvict, dynamic top-k,
cache-aware routing, sub-expert offloading) are refused beside a layer-wise unit.
"""

from __future__ import annotations

#: the values of the ``offload_unit`` knob (the first is the default)
OFFLOAD_UNITS = ("expert", "layerwise", "layerwise-prefetch")


def slots_needed(unit: str, num_experts: int, offloaded_layers: int) -> int:
    """Slots a layer-wise unit holds at most (0 for ``expert``: any cache of ≥ top-k)."""
    if unit == "expert" or offloaded_layers <= 0:
        return 0
    return num_experts * (min(2, offloaded_layers) if unit == "layerwise-prefetch" else 1)
