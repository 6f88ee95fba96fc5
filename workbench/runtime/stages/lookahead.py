"""Looking ahead on the live runtime: router lookahead, prefetching, ActiveEvict, dynamic top-k.

Per MoE layer l (ActiveEvict, :mod:`workbench.policies.active_evict`; the prefetch policies,
:mod:`workbench.policies.prefetch`, the VisMMOE predictor's among them):

- **router lookahead** (``lookahead_depth`` D ≥ 1): the routers of layers l+1 … l+D are applied
  to layer l's MoE input (the tensor layer l's router saw) and their top-k ids go into
  :attr:`LayerEvent.pred_ids`. The routers' ``forward`` is called directly (no module hooks), on
  the same input, with no state: the model's outputs do not change. With visual-token
  compression (``pruning``), a pinned layer's predictions for layers behind the pinned prefix
  are restricted to the tokens that will reach them: a pruned token's are -1 (and ActiveEvict's
  p̂ averages the kept tokens only), as soon as the selection is known.
- **prefetch**: the policy is asked once per layer, for ``prefetch_lead`` layers ahead, at
  most ``prefetch_budget`` keys; the core runs its picks when every miss of the layer has a
  slot (the same context, order and filters as trace replay's ``plan_prefetch``).
- **ActiveEvict** (``active_evict``): layer l's routing feeds the hotness windows; once all of
  layer l's misses have a slot, experts are pre-evicted so that layer l+1 finds Δ free slots
  (never one of layer l's routed experts, nor one predicted for l+1). Loads stay on demand.
- **dynamic top-k** (``dynamic_topk``, decode steps, offloaded layers): before the lookup, the
  layer's k is narrowed (or widened up to ``k_max``) to the largest k whose misses fit the free
  slots, and the experts receive the model's own router output for that k.
"""

from __future__ import annotations

import numpy as np
import torch

from workbench.knobs import CacheKnobs, Knobs, PrefetchKnobs
from workbench.models.adapter import MoEBlock
from workbench.policies.active_evict import ActiveEvict, ActiveEvictKnobs, budget_topk
from workbench.policies.prefetch import PrefetchContext, ranked_ids, select
from workbench.runtime.stages.base import LayerCall, RunContext, Stage, StageSetup
from workbench.sim.step import Access


class DynamicTopK(Stage):
    """Budget-aware dynamic top-k (ActiveEvict eq. 18–21) of offloaded layers in decode
    steps, on the router's raw output."""

    before_mask = True

    def __init__(self, k_max: int | None) -> None:
        self.k_max = k_max

    @classmethod
    def from_knobs(cls, knobs: Knobs, run: RunContext) -> "DynamicTopK | None":
        ae: ActiveEvictKnobs = knobs.group("active_evict")
        return cls(ae.k_max) if ae.dynamic_topk else None

    @classmethod
    def from_setup(cls, setup: StageSetup) -> "DynamicTopK | None":
        return cls(setup.k_max) if setup.dynamic_topk else None

    def route(self, call: LayerCall) -> None:
        if call.pinned or call.step <= 0:
            return
        b, cache, layer = call.block, call.cache, call.block.index
        kmax = min(self.k_max or b.top_k, b.num_experts)
        with torch.no_grad():
            _, w_max, ids_max = b.route(call.hidden_states, top_k=kmax)
            # rank by the router's weights (monotone in its probabilities for every supported
            # router, including DeepSeek's unsorted top-k)
            order = torch.argsort(w_max.float(), dim=-1, descending=True, stable=True)
            ranked = torch.gather(ids_max, -1, order).cpu().numpy()
        if call.real is not None:  # the real tokens decide
            ranked = ranked[call.real]
        k = budget_topk(ranked, lambda e: (layer, e) in cache, cache.free_slots())
        if k == call.ids.shape[-1]:
            return
        if k == kmax:
            call.ids, call.weights = ids_max, w_max
            return
        with torch.no_grad():
            _, call.weights, call.ids = b.route(call.hidden_states, top_k=k)


class Lookahead(Stage):
    """Router lookahead, the prefetch policy and ActiveEvict (see the module docstring); on
    when any of them is."""

    def __init__(self, setup: StageSetup, prefetch) -> None:
        self.layout = setup.layout
        self.pinned_layers = setup.pinned_layers
        self.depth = int(setup.lookahead_depth)
        self.active_evict = setup.active_evict
        self.pruning = setup.pruning
        self.prefetch = prefetch
        self.prefetch_lead = int(setup.prefetch_lead)
        self.prefetch_budget = setup.prefetch_budget
        self.offloaded = any(b.index >= setup.pinned_layers for b in setup.layout.blocks)
        self._routing: dict = {"step": -1, "prev": {}, "cur": {}}  # ranked keys per layer

    @classmethod
    def from_knobs(cls, knobs: Knobs, run: RunContext) -> "Lookahead | None":
        """Router lookahead and ActiveEvict, the run's prefetch policy (the policy object is
        the session's: the predictor attaches to it)."""
        ae: ActiveEvictKnobs = knobs.group("active_evict")
        pf: PrefetchKnobs = knobs.group("prefetch")
        cache: CacheKnobs = knobs.group("cache")
        lay, pinned = run.layout, cache.pinned_layers
        return cls.from_setup(StageSetup(
            lay, pinned, run.prices, run.device, lookahead_depth=ae.lookahead_depth,
            active_evict=(ActiveEvict.from_knobs(ae, lay.num_layers, lay.num_experts)
                          if ae.active_evict else None),
            prefetch=run.prefetch, prefetch_lead=pf.prefetch_lead,
            prefetch_budget=run.prefetch_budget, pruning=run.pruning))

    @classmethod
    def from_setup(cls, setup: StageSetup) -> "Lookahead | None":
        pf = setup.prefetch
        pf = pf if pf is not None and getattr(pf, "fetches", True) else None
        if setup.lookahead_depth <= 0 and setup.active_evict is None and pf is None:
            return None
        return cls(setup, pf)

    def observe(self, call: LayerCall) -> None:
        """The next routers' predictions (``call.pred`` of the real tokens, ``call.p_next``),
        recorded when asked; ActiveEvict's hotness."""
        pred, call.p_next = self.predict(call.block, call.hidden_states, call.mask)
        if self.depth > 0:
            call.event.pred_ids = pred
        # what the next routers say of the real tokens only (padding must not prefetch)
        call.pred = pred if call.real is None or pred is None else pred[call.real]
        if not call.pinned and self.active_evict is not None:
            self.active_evict.observe(call.block.index, call.real_ids)

    def access(self, call: LayerCall, access: Access) -> None:
        self._note_routing(call.step, call.block.index, call.key_ids)
        access.prefetch = self._prefetch_candidates(call)
        access.pre_evict = self._pre_evict_hook(call)

    def predict(self, b: MoEBlock, hidden_states: torch.Tensor, mask: torch.Tensor | None
                ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Routers of the next layers on this layer's MoE input.

        Returns ``(pred [T, D', k] int16 or None, p̂ of layer l+1 [E] or None)``: D' = the
        recorded depth (``lookahead_depth``; one layer when only ActiveEvict needs it), -1
        past the last layer; p̂ only when ActiveEvict is on and layer l+1 exists.
        """
        blocks = self.layout.blocks
        ae = self.active_evict
        depth = max(self.depth, 1 if ae is not None else 0)
        if depth <= 0:
            return None, None
        k = self.layout.top_k
        T = hidden_states.shape[0]
        avail = min(depth, len(blocks) - 1 - b.index)
        if avail <= 0:
            return np.full((T, depth, k), -1, np.int16), None
        keep, first_pruned = self._kept(b, T)
        preds = []
        p_next = None
        with torch.no_grad():
            for d in range(1, avail + 1):
                logits, _, idx = blocks[b.index + d].route(hidden_states)
                if idx.shape[-1] < k:
                    idx = torch.nn.functional.pad(idx, (0, k - idx.shape[-1]), value=-1)
                preds.append(idx)
                if d == 1 and ae is not None:
                    prob = torch.softmax(logits.float(), dim=-1)
                    if keep is not None and b.index + 1 >= first_pruned:
                        prob = prob[torch.as_tensor(keep, device=prob.device)]
                    if mask is not None:  # real tokens only
                        prob = prob[mask]
                    p_next = prob.mean(0)
            pred = torch.stack(preds, 1).to(device="cpu", dtype=torch.int16).numpy()
        if keep is not None:
            d0 = max(first_pruned - b.index, 1)  # first lookahead distance behind the prefix
            if d0 <= avail:
                pred[~keep, d0 - 1:] = -1
        if avail < depth:
            pred = np.concatenate([pred, np.full((T, depth - avail, k), -1, np.int16)], 1)
        return pred, (p_next.cpu().double().numpy() if p_next is not None else None)

    def _kept(self, b: MoEBlock, T: int) -> tuple[np.ndarray | None, int]:
        """Token compression: which of the ``T`` tokens reach the layers behind the pinned
        prefix (None: all), and the first of those layers."""
        if self.pruning is None or b.index >= self.pinned_layers:
            return None, len(self.layout.blocks)
        keep = self.pruning.prefill_keep_mask(b.index)
        if keep is None or len(keep) != T:
            return None, len(self.layout.blocks)
        return keep, self.pruning.pinned

    def _note_routing(self, step: int, layer: int, key_ids: np.ndarray) -> None:
        r = self._routing
        if r["step"] != step:
            r["step"], r["prev"], r["cur"] = step, r["cur"], {}
        if self.prefetch is not None:
            r["cur"][layer] = ranked_ids(key_ids)

    def _prefetch_candidates(self, call: LayerCall) -> list:
        """The prefetch policy's picks after the layer's router ran, as ``(layer, key)``; the
        core admits them when every miss of the layer has a slot."""
        if self.prefetch is None or not self.offloaded:
            return []
        lay, pred, part = self.layout, call.pred, call.part

        def pred_at(d: int) -> list[int]:
            # the routers' lookahead names experts: none for sub-expert keys (as in replay,
            # whose sub-expert trace drops it)
            if pred is None or d - 1 >= pred.shape[1] or part > 1:
                return []
            return ranked_ids(pred[:, d - 1])

        def no_future(d: int) -> list[int]:
            raise RuntimeError("the live runtime cannot see the future (oracle is replay-only)")

        prev = self._routing["prev"]
        ctx = PrefetchContext(step=call.step, layer=call.block.index,
                              num_layers=lay.num_layers, lead=self.prefetch_lead, pred=pred_at,
                              previous=lambda l: prev.get(l, []), future=no_future)
        pinned = [blk.index < self.pinned_layers for blk in lay.blocks]
        E = lay.num_experts * part  # the cache's keys: experts or sub-experts
        return [divmod(k, E) for k in select(self.prefetch.candidates(ctx), pinned,
                                             lay.num_layers, E, self.prefetch_budget)]

    def _pre_evict_hook(self, call: LayerCall):
        """ActiveEvict before layer l+1, for the core to call once layer l's misses have
        slots (None when it does not apply: off, no lookahead, or l+1 not offloaded)."""
        nxt = call.block.index + 1
        ae, pred, p_next = self.active_evict, call.pred, call.p_next
        if ae is None or pred is None or p_next is None \
                or nxt < self.pinned_layers or nxt >= self.layout.num_layers:
            return None
        demand = {int(e) for e in np.unique(pred[:, 0, :]) if e >= 0}

        def hook(cache, protected: set) -> list:
            return ae.pre_evict(cache, nxt, demand, p_next, protected)

        return hook
