"""Cache-aware routing on the live runtime (Cache-Prior, arXiv 2412.00099; issue 40 §2).

At each offloaded layer of a decode step, the real tokens' router logits ``z`` get
``λ · Δ_avg`` added on the experts resident in the cache at the layer's gate, the top-k is
taken again, and the combine weights are the router's own probabilities of the chosen experts
(renormalised over them when the model's router renormalises its top-k) — see
:mod:`workbench.policies.cache_routing` for the rule, where it was taken from and what is this
workbench's choice. A token whose chosen set does not change keeps the router's ids and weights
exactly (so λ = 0 is the model's routing, bit for bit).

The stage runs after dynamic top-k (it keeps the call's k) and before the dispatch stage: a
capacity-aware dispatch then sees (and drops or reroutes) the routing the tokens actually ask
for. The layer event, hence the store, holds the routing after the rewrite.
"""

from __future__ import annotations

import torch

from typing import TYPE_CHECKING

from workbench.policies.cache_routing import CacheRoutingKnobs
from workbench.runtime.stages.base import LayerCall, RunContext, Stage, StageSetup

if TYPE_CHECKING:
    from workbench.knobs import Knobs


class CacheRouting(Stage):
    """Cache-Prior's re-ranking (``strength`` λ ∈ [0, 1]) and what it did over the run:
    ``cache_rerouted`` — (token, expert) assignments moved to a resident expert."""

    COUNTS = ("cache_rerouted",)

    def __init__(self, strength: float) -> None:
        self.strength = float(strength)
        self.cache_rerouted = 0
        self._range_sum: dict[int, float] = {}  # per layer: Σ of the tokens' logit ranges
        self._range_n: dict[int, int] = {}

    @classmethod
    def from_knobs(cls, knobs: "Knobs", run: RunContext) -> "CacheRouting | None":
        ck: CacheRoutingKnobs = knobs.group("cache_routing")
        return cls(ck.cache_routing_strength) if ck.cache_routing else None

    @classmethod
    def from_setup(cls, setup: StageSetup) -> "CacheRouting | None":
        return None if setup.cache_routing is None else cls(setup.cache_routing)

    def delta(self, layer: int) -> float:
        """Δ_avg of ``layer``: the mean logit range (max − min) of the tokens it routed."""
        n = self._range_n.get(layer, 0)
        return self._range_sum[layer] / n if n else 0.0

    def route(self, call: LayerCall) -> None:
        if call.pinned:
            return
        b = call.block
        rows = None if call.mask is None else call.mask.nonzero().squeeze(1)
        hs = call.hidden_states if rows is None else call.hidden_states[rows]
        if hs.shape[0] == 0:
            return
        with torch.no_grad():
            logits = b.route(hs)[0].float()
        rng = (logits.max(-1).values - logits.min(-1).values).double()
        layer = b.index
        self._range_sum[layer] = self._range_sum.get(layer, 0.0) + float(rng.sum())
        self._range_n[layer] = self._range_n.get(layer, 0) + int(rng.numel())
        if call.step <= 0 or self.strength == 0.0:  # prefill: Δ_avg only
            return
        E = b.num_experts
        cache = call.cache
        resident = [e for e in range(E) if (layer, e) in cache]
        if not resident or len(resident) == E:
            return
        ids = call.ids if rows is None else call.ids[rows]
        w = call.weights if rows is None else call.weights[rows]
        k = ids.shape[1]
        m = torch.zeros(E, dtype=logits.dtype, device=logits.device)
        m[resident] = 1.0
        with torch.no_grad():
            biased = logits + (self.strength * self.delta(layer)) * m
            new_ids = torch.topk(biased, k, dim=-1).indices
            old_sorted = torch.sort(ids.to(new_ids.dtype), -1).values
            changed = (torch.sort(new_ids, -1).values != old_sorted).any(-1)
            if not bool(changed.any()):
                return
            p = torch.softmax(logits, dim=-1)
            p_old = torch.gather(p, -1, ids.long())
            # the model's own weight rule: its weights are the probabilities themselves, or
            # those renormalised over the chosen experts
            renorm = not torch.allclose(w.float(), p_old, rtol=1e-3, atol=1e-6)
            new_w = torch.gather(p, -1, new_ids)
            if renorm:
                new_w = new_w / new_w.sum(-1, keepdim=True)
            moved = (~(new_ids[:, :, None] == ids.to(new_ids.dtype)[:, None, :]).any(-1))
            self.cache_rerouted += int(moved[changed].sum())
            out_ids = torch.where(changed[:, None], new_ids.to(ids.dtype), ids)
            out_w = torch.where(changed[:, None], new_w.to(w.dtype), w)
        if rows is None:
            call.ids, call.weights = out_ids, out_w
        else:
            call.ids = call.ids.index_copy(0, rows, out_ids)
            call.weights = call.weights.index_copy(0, rows, out_w)
