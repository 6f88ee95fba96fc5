"""Elastic execution of sub-experts (issue 16 §2, first part): the model's own experts forward
over sub-expert slices of the (permuted) fused tensors.

:class:`PrismView` wraps the offloader's :class:`~workbench.runtime.slots.ExpertsView`: a call
for experts ``[e, …]`` becomes a call for their sub-experts ``[e·N + s, …]`` — each one expert
of its own to the model's experts forward, with ``gate_up_proj`` rows (its gate and up halves)
and ``down_proj`` columns of the neurons the refactoring put in sub-expert s
(``perm[e][s·I/N : (s+1)·I/N]``) — and every routed slot (token, e, w) becomes N slots
(token, e·N + s, w), the inactive ones masked (the forward's sentinel: no compute). Every path
of the offloader (cache hits, misses, the host, the pinned prefix, ReaLB's low precision)
calls the view, so all of them run sub-experts the same way. With every sub-expert active the
layer computes Σ_s A[:, S_s]·down[:, S_s] = the expert's output (a sum in another order:
equal up to float rounding; tested).

Which sub-experts a (token, expert) runs (``k_active`` of N): the proxy gate — each
sub-expert's score is the mean |activation| of its r gate neurons on the token, computed from
the expert's own weights (2·r·N rows of ``gate_up_proj``); the k_active best run. The router's
expert choice is kept as is (seed §4.3.1: "the model's top-level router can then use these
lightweight scores to select which sub-experts to execute"); what a run computes is the
routed experts' chosen sub-experts, each weighted by its expert's routing weight.
"""

from __future__ import annotations

from typing import Any

import torch


class PrismView:
    """An :class:`ExpertsView` over sub-experts (module docstring). ``perm`` [L, E, I] and
    ``gates`` [L, E, N, r] (a :class:`~workbench.prism.refactor.Refactoring`'s), ``layer``
    the MoE layer, ``k_active`` sub-experts per (token, expert)."""

    def __init__(self, inner, perm: torch.Tensor, gates: torch.Tensor, layer: int,
                 subexperts: int, k_active: int, act_fn) -> None:
        self.inner, self.layer = inner, layer
        self.perm = perm[layer]  # [E, I]
        self.gates = gates[layer]  # [E, N, r]
        self.N, self.k_active, self.act_fn = subexperts, k_active, act_fn
        #: (token, expert) sub-expert runs this view was asked for / ran (counters)
        self.asked = 0
        self.ran = 0

    def _sub_weights(self, weights: dict[str, torch.Tensor], experts: list[int]
                     ) -> dict[str, torch.Tensor]:
        gu, down = weights["gate_up_proj"], weights["down_proj"]  # [n, 2I, H], [n, H, I]
        n, two_i, H = gu.shape
        I, N = two_i // 2, self.N
        p = self.perm[torch.as_tensor(experts, dtype=torch.long)].to(gu.device)  # [n, I]
        gate = torch.gather(gu[:, :I], 1, p[:, :, None].expand(n, I, H))
        up = torch.gather(gu[:, I:], 1, p[:, :, None].expand(n, I, H))
        sub_gu = torch.cat([gate.reshape(n, N, I // N, H), up.reshape(n, N, I // N, H)], 2)
        sub_down = torch.gather(down, 2, p[:, None, :].expand(n, down.shape[1], I))
        sub_down = sub_down.reshape(n, down.shape[1], N, I // N).permute(0, 2, 1, 3)
        return {"gate_up_proj": sub_gu.reshape(n * N, 2 * (I // N), H),
                "down_proj": sub_down.reshape(n * N, down.shape[1], I // N)}

    def _active(self, weights: dict[str, torch.Tensor], experts: list[int],
                hidden_states: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """bool [T, k, N]: the sub-experts each routed slot runs (all when k_active = N)."""
        T, k = local.shape
        N = self.N
        if self.k_active >= N:
            return torch.ones((T, k, N), dtype=torch.bool, device=local.device)
        gu = weights["gate_up_proj"]
        I = gu.shape[1] // 2
        act = torch.zeros((T, k, N), dtype=hidden_states.dtype, device=hidden_states.device)
        for i, e in enumerate(experts):
            rows = self.gates[e].reshape(-1).to(gu.device)  # [N·r] neuron ids
            g = torch.nn.functional.linear(hidden_states, gu[i][rows])  # [T, N·r]
            u = torch.nn.functional.linear(hidden_states, gu[i][rows + I])
            score = (self.act_fn(g) * u).abs().reshape(T, N, -1).mean(-1)  # [T, N]
            mine = local == i  # [T, k]
            act = torch.where(mine[..., None], score[:, None, :], act)
        top = act.topk(self.k_active, dim=-1).indices
        return torch.zeros((T, k, N), dtype=torch.bool, device=local.device).scatter_(
            -1, top, True)

    def __call__(self, weights: dict[str, torch.Tensor], experts, num_experts: int,
                 hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, *args: Any, all_routed=None, **kwargs: Any
                 ) -> torch.Tensor:
        experts = [int(e) for e in experts]
        N, n = self.N, len(experts)
        dev = top_k_index.device
        lut = torch.full((num_experts + 1,), n, dtype=torch.long, device=dev)
        lut[torch.as_tensor(experts, dtype=torch.long, device=dev)] = torch.arange(
            n, dtype=torch.long, device=dev)
        local = lut[top_k_index.long()]  # [T, k]: position in ``experts`` or n (not here)
        with torch.no_grad():
            active = self._active(weights, experts, hidden_states, local)
        here = (local < n)[..., None] & active  # [T, k, N]
        self.asked += int((local < n).sum()) * N
        self.ran += int(here.sum())
        sub_ids = top_k_index.long()[..., None] * N + torch.arange(N, device=dev)
        sub_ids = sub_ids.masked_fill(~here, num_experts * N)  # the sentinel: no compute
        w = top_k_weights[..., None].expand(-1, -1, N).masked_fill(~here, 0)
        T = top_k_index.shape[0]
        subs = [e * N + s for e in experts for s in range(N)]
        return self.inner(self._sub_weights(weights, experts), subs, num_experts * N,
                          hidden_states, sub_ids.reshape(T, -1).to(top_k_index.dtype),
                          w.reshape(T, -1), *args, **kwargs)


__all__ = ["PrismView"]
