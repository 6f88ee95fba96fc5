"""Device tensors of the expert cache, and a way to run a model's experts code over any of them.

:class:`SlotPool` holds ``[num_slots, ...]`` tensors, one per fused expert parameter; which
expert occupies which slot is decided by :class:`workbench.sim.cache.ExpertCache` (torch-free).

:class:`ExpertsView` calls an experts module's *own* forward over a given set of expert
weights (a few slots gathered into a compact ``[n, ...]`` tensor, or one expert's host copy)
without changing the model's module: it runs on a shallow copy whose parameters are the given
tensors and whose ``num_experts`` is ``n``. transformers' experts implementations (eager and
grouped_mm) skip expert ids ≥ ``num_experts`` when ``_is_expert_parallel`` is set — the
mechanism its expert parallelism uses for experts on other ranks — so tokens routed to
experts outside the view contribute nothing. The cost of a call follows ``n`` (the experts of
the call), not the pool: a forward over the whole pool made every slot a (mostly empty) group.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn


class SlotPool:
    """``tensors[name]``: ``[num_slots, *shape]`` device tensors (zero-filled at start)."""

    def __init__(self, num_slots: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots = num_slots
        self.tensors = {n: torch.zeros((num_slots, *s), dtype=dtype, device=device)
                        for n, s in shapes.items()}
        #: each slot's views, made at its first copy (a transfer per miss asks again)
        self._views: list[dict[str, torch.Tensor] | None] = [None] * num_slots

    def view(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's tensors (views, no copy): a transfer's destination. The same dict for
        the slot every time: read it, never change it."""
        v = self._views[slot]
        if v is None:
            v = self._views[slot] = {n: t[slot] for n, t in self.tensors.items()}
        return v

    def gather(self, slots: Sequence[int]) -> dict[str, torch.Tensor]:
        """``[len(slots), ...]`` copies of the given slots, in order."""
        idx = torch.as_tensor(list(slots), dtype=torch.long)
        return {n: t.index_select(0, idx.to(t.device)) for n, t in self.tensors.items()}


def positions(experts: Sequence[int], num_experts: int, top_k_index: torch.Tensor,
              all_routed: torch.Tensor | None = None) -> torch.Tensor:
    """Each routed slot's position among ``experts`` (model ids, ``num_experts`` the layer's
    E), ``len(experts)`` for a slot routed to none of them (id E, an assignment the dispatch
    dropped, too); ``top_k_index``'s shape and dtype. ``all_routed``: ``experts`` are every
    expert the layer routed to, ascending, as a tensor — then a sorted search (no table)."""
    dev = top_k_index.device
    if all_routed is not None:
        return torch.searchsorted(all_routed.to(dev), top_k_index)
    n = len(experts)
    lut = torch.full((num_experts + 1,), n, dtype=top_k_index.dtype, device=dev)
    lut[torch.as_tensor([int(e) for e in experts], dtype=torch.long, device=dev)] = \
        torch.arange(n, dtype=top_k_index.dtype, device=dev)
    return lut[top_k_index.long()]


class ExpertsView:
    """Runs ``experts``' own forward over other weights (see the module docstring)."""

    def __init__(self, experts: nn.Module, param_names: Sequence[str]) -> None:
        v = copy.copy(experts)  # shares submodules (activation) and config; no tensor copy
        v.__dict__["_parameters"] = {}  # the copy shared the dict: never touch the original's
        v.__dict__.pop("forward", None)  # an instance-level wrapper is not the model's code
        self._module = v
        self._forward = type(experts).forward
        self.names = tuple(param_names)

    def __call__(self, weights: dict[str, torch.Tensor], experts: Sequence[int],
                 num_experts: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, *args, all_routed: torch.Tensor | None = None,
                 **kwargs) -> torch.Tensor:
        """The layer's output share of ``experts`` (model ids, ``weights[name][i]`` is expert
        ``experts[i]``) over ``hidden_states``; ``num_experts`` is the model layer's E.

        ``all_routed``: when ``experts`` are *every* expert the layer routed to, in ascending
        order, as a tensor — then ids map to positions by a sorted search and no token needs
        masking (the common all-hit decode step). ``args``/``kwargs``: whatever else the
        model passed its experts module, passed on unchanged."""
        n = len(experts)
        local = positions(experts, num_experts, top_k_index, all_routed)
        w = top_k_weights if all_routed is not None else top_k_weights.masked_fill(local == n, 0)
        d = self._module.__dict__
        d.update(weights)
        d["num_experts"] = n
        d["_is_expert_parallel"] = True
        try:
            return self._forward(self._module, hidden_states, local, w, *args, **kwargs)
        finally:
            for name in self.names:  # hold no reference to the call's tensors
                d.pop(name, None)
