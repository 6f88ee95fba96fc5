"""Host store: the home of every offloaded routed expert.

For each offloaded MoE layer and each fused expert parameter (e.g. ``gate_up_proj``,
``down_proj``) the store keeps one host tensor ``[E, ...]``; expert ``e`` is the slice ``[e]``.
On a CUDA machine the tensors are page-locked (pinned) so copies to the device run asynchronously.
"""

from __future__ import annotations

import torch


class HostExpertStore:
    """Host copies of routed experts, addressed by ``(layer, expert)``."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._layers: dict[int, dict[str, torch.Tensor]] = {}
        #: each expert's views, made at its first copy (every miss of it asks again)
        self._experts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def add_layer(self, layer: int, params: dict[str, torch.Tensor]) -> None:
        """Take host copies of one layer's fused expert tensors (each ``[E, ...]``)."""
        host = {}
        for name, t in params.items():
            # a CPU tensor is kept as is (no second copy): the offloader hands the experts module
            # the slot pool instead and gives this tensor back unchanged when it is done
            h = t.detach().to("cpu")
            if self.pin_memory:
                h = h.pin_memory()
            host[name] = h
        self._layers[layer] = host
        self._experts = {k: v for k, v in self._experts.items() if k[0] != layer}

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        return self._layers[layer]

    def expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Views of one expert's weights (no copy); the same dict for the expert every time
        (until its layer is added again): read it, never change it."""
        v = self._experts.get((layer, expert))
        if v is None:
            v = self._experts[(layer, expert)] = {n: t[expert]
                                                  for n, t in self._layers[layer].items()}
        return v
