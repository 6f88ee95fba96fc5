"""Memory plan: where every byte of the model lives (seed VisMMOE §3.4).

Device = backbone (non-expert weights + shared experts, always resident) + pinned prefix (every
routed expert of the first ``pinned_layers`` MoE layers) + expert cache (``slots`` × bytes per
expert). Host = the routed experts of the other layers.

Two plans are made: the *live* plan of the loaded model on this machine (bytes measured from its
tensors), and the *modeled* plan of the cost model (the target model if one is set) on the
hardware profile. A plan that does not fit its device is refused with a :class:`PlanError` that
says what to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from workbench.errors import PlanError

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

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(pinned_bytes=self.pinned_bytes, cache_bytes=self.cache_bytes,
                 host_bytes=self.host_bytes, device_bytes=self.device_bytes, fits=self.fits)
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


def device_budget(device: torch.device) -> float:
    """Free memory of a CUDA device plus what the model already holds there; 0 on CPU."""
    if device.type != "cuda":
        return 0.0
    free, _total = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_allocated(device))
