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

    def _chosen(self, weights: dict[str, torch.Tensor], experts: list[int],
                hidden_states: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """long [T, k, k_active]: the sub-experts each routed slot runs (all, in order, when
        k_active = N); only (token, expert) pairs routed here are scored."""
        T, k = local.shape
        N, ka, dev = self.N, self.k_active, local.device
        if ka >= N:
            return torch.arange(N, device=dev).expand(T, k, N)
        gu = weights["gate_up_proj"]
        I = gu.shape[1] // 2
        score = torch.zeros((T, k, N), dtype=hidden_states.dtype, device=hidden_states.device)
        tok, slot = torch.nonzero(local < len(experts), as_tuple=True)
        if len(tok):
            pos = local[tok, slot]  # each routed pair's expert position
            rows = self.gates[torch.as_tensor(experts)].to(gu.device).reshape(len(experts), -1)
            x = hidden_states[tok]  # [P, H]
            g_w = gu[pos[:, None], rows[pos]]  # [P, N·r, H]: the pair's gate-neuron rows
            u_w = gu[pos[:, None], rows[pos] + I]
            g = torch.einsum("ph,pgh->pg", x, g_w)
            u = torch.einsum("ph,pgh->pg", x, u_w)
            score[tok, slot] = (self.act_fn(g) * u).abs().reshape(len(tok), N, -1).mean(-1)
        return score.topk(ka, dim=-1).indices

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
            chosen = self._chosen(weights, experts, hidden_states, local)  # [T, k, ka]
        ka = chosen.shape[-1]
        here = (local < n)[..., None].expand(-1, -1, ka)  # [T, k, ka]
        self.asked += int((local < n).sum()) * N
        self.ran += int(here.sum())
        # only the chosen sub-experts are handed on: k·k_active slots a token, not k·N
        sub_ids = (top_k_index.long()[..., None] * N + chosen).masked_fill(
            ~here, num_experts * N)  # the sentinel: a slot routed to no expert of this call
        w = top_k_weights[..., None].expand(-1, -1, ka).masked_fill(~here, 0)
        T = top_k_index.shape[0]
        subs = [e * N + s for e in experts for s in range(N)]
        return self.inner(self._sub_weights(weights, experts), subs, num_experts * N,
                          hidden_states, sub_ids.reshape(T, -1).to(top_k_index.dtype),
                          w.reshape(T, -1), *args, **kwargs)


__all__ = ["PrismView"]
