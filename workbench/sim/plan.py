"""Memory plan: where every byte of the model lives (VisMMOE §3.4).

Device = backbone (non-expert weights + shared experts, always resident) + pinned prefix (every
routed expert of the first ``pinned_layers`` MoE layers) + expert cache (``slots`` × bytes per
expert). Host = the routed experts of the other layers.

Two plans are made: the *live* plan of the loaded model on this machine (bytes measured from its
tensors), and the *modeled* plan of the cost model (the target model if one is set) on the
hardware profile. A plan that does not fit its device is refused with a :class:`PlanError` that
says what to change.

Each plan also carries the *valid prefix interval* of VisMMOE eq. (10),

    L_semantic ≤ L_pinned ≤ ⌊(M_avail − C_safe) / S_layer⌋

with M_avail = budget − backbone (the expert VRAM budget), S_layer = one MoE layer's routed
experts and C_safe = ``reserve_slots`` × bytes per expert (the least the dynamic cache must keep).
The upper end is capped at the model's MoE layers; on an unbounded device (budget 0) it is the
number of MoE layers. A ``pinned_layers`` outside it is refused by :meth:`MemoryPlan.check_pinned`
with a :class:`KnobError` that names the value and the interval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from workbench.errors import KnobError, PlanError

_GB = 1e9


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of one memory layout. ``budget_bytes`` is the device memory it must fit in
    (0 = unknown, e.g. CPU RAM shared with everything else)."""

    label: str
    num_layers: int
    num_experts: int
    pinned_layers: int
    slots: int
    expert_bytes: float
    backbone_bytes: float
    budget_bytes: float
    semantic_layers: int = 0  # L_semantic: fewest pinned layers (lower end of the interval)
    reserve_slots: int = 0  # C_safe in expert slots: the least the dynamic cache keeps

    @property
    def pinned_bytes(self) -> float:
        return self.pinned_layers * self.num_experts * self.expert_bytes

    @property
    def cache_bytes(self) -> float:
        return self.slots * self.expert_bytes

    @property
    def host_bytes(self) -> float:
        return (self.num_layers - self.pinned_layers) * self.num_experts * self.expert_bytes

    @property
    def device_bytes(self) -> float:
        return self.backbone_bytes + self.pinned_bytes + self.cache_bytes

    @property
    def fits(self) -> bool:
        return not self.budget_bytes or self.device_bytes <= self.budget_bytes

    def max_pinned_layers(self) -> int:
        """Most pinned layers that fit beside the backbone and the cache."""
        if not self.budget_bytes:
            return self.num_layers
        room = self.budget_bytes - self.backbone_bytes - self.cache_bytes
        layer = self.num_experts * self.expert_bytes
        return max(0, min(self.num_layers, int(room // layer)))

    # -- valid prefix interval (VisMMOE eq. 10) ---------------------------------------
    @property
    def layer_bytes(self) -> float:
        """S_layer: bytes of one MoE layer's routed experts."""
        return self.num_experts * self.expert_bytes

    @property
    def reserve_bytes(self) -> float:
        """C_safe: bytes the dynamic cache keeps at least."""
        return self.reserve_slots * self.expert_bytes

    @property
    def avail_bytes(self) -> float:
        """M_avail: the expert VRAM budget (device budget − backbone); 0 when unbounded."""
        return max(0.0, self.budget_bytes - self.backbone_bytes) if self.budget_bytes else 0.0

    @property
    def valid_interval(self) -> tuple[int, int]:
        """(lo, hi) of the valid pinned prefix: lo = L_semantic, hi = ⌊(M_avail − C_safe) /
        S_layer⌋ capped at the MoE layers (the MoE layers when the budget is unbounded). Empty
        when lo > hi; hi is −1 when not even C_safe fits."""
        lo = min(self.semantic_layers, self.num_layers)
        if not self.budget_bytes:
            return lo, self.num_layers
        room = self.avail_bytes - self.reserve_bytes
        hi = -1 if room < 0 else min(self.num_layers, int(room // self.layer_bytes))
        return lo, hi

    @property
    def pinned_valid(self) -> bool:
        lo, hi = self.valid_interval
        return lo <= self.pinned_layers <= hi

    def interval_rule(self) -> str:
        """The interval's formula with this plan's numbers, for messages and ``workbench info``."""
        lo, hi = self.valid_interval
        if not self.budget_bytes:
            return (f"L_semantic {lo} ≤ L ≤ {self.num_layers} MoE layers; the device budget is "
                    f"unbounded")
        return (f"L_semantic {lo} ≤ L ≤ ⌊(M_avail {self.avail_bytes / _GB:.2f} GB − C_safe "
                f"{self.reserve_bytes / _GB:.2f} GB ({self.reserve_slots} slots)) / S_layer "
                f"{self.layer_bytes / _GB:.2f} GB⌋"
                + (f", capped at {self.num_layers} MoE layers" if hi == self.num_layers else ""))

    def check_pinned(self) -> None:
        """Raise :class:`KnobError` when ``pinned_layers`` is outside :attr:`valid_interval`."""
        if self.pinned_valid:
            return
        lo, hi = self.valid_interval
        if lo > hi:
            raise KnobError(
                f"pinned_layers has no valid value for the {self.label}: the valid interval [{lo}, {hi}] is "
                f"empty ({self.interval_rule()}); lower semantic_layers or cache_reserve_slots, "
                f"or choose a larger profile (not {self.pinned_layers})")
        raise KnobError(
            f"pinned_layers must be within the valid interval [{lo}, {hi}] for the {self.label} "
            f"({self.interval_rule()}), not {self.pinned_layers}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(pinned_bytes=self.pinned_bytes, cache_bytes=self.cache_bytes,
                 host_bytes=self.host_bytes, device_bytes=self.device_bytes, fits=self.fits,
                 layer_bytes=self.layer_bytes, reserve_bytes=self.reserve_bytes,
                 avail_bytes=self.avail_bytes, valid_interval=list(self.valid_interval),
                 pinned_valid=self.pinned_valid)
        return d

    def check(self) -> None:
        """Raise :class:`PlanError` when the plan does not fit, saying what to change."""
        if self.fits:
            return
        over = self.device_bytes - self.budget_bytes
        msg = (f"{self.label}: the device needs {self.device_bytes / _GB:.2f} GB (backbone "
               f"{self.backbone_bytes / _GB:.2f} + pinned prefix {self.pinned_bytes / _GB:.2f} + "
               f"cache {self.cache_bytes / _GB:.2f}) but has {self.budget_bytes / _GB:.2f} GB "
               f"({over / _GB:.2f} GB over)")
        room = self.budget_bytes - self.backbone_bytes
        if room <= 0:
            raise PlanError(msg + "; even the backbone does not fit: choose a larger profile")
        hints = [f"pinned_layers ≤ {self.max_pinned_layers()}"]
        max_slots = int((room - self.pinned_bytes) // self.expert_bytes)
        if max_slots > 0:
            hints.append(f"cache_slots ≤ {max_slots}")
        raise PlanError(msg + "; set " + " or ".join(hints) + ", or choose a larger profile")

