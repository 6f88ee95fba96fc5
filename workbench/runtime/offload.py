"""Install expert offloading into a live ``transformers`` model, and take it out again.

For each MoE block found by the adapter:

- **pinned** layers (the first ``pinned_layers``) keep their fused expert tensors resident; their
  experts module only gets a recording wrapper.
- **offloaded** layers hand their fused expert tensors to the host store. The experts module's
  tensors are replaced by the cache's slot pool (``[num_slots, ...]``, shared by every offloaded
  layer) and its ``num_experts`` by ``num_slots``; each call remaps expert ids to slot ids and
  runs the model's *own* experts forward on the slots. Ids of experts not in the group being
  computed become the sentinel ``num_slots``, which transformers' experts code skips (it is the
  mechanism expert parallelism uses for experts on other ranks).

Order of work in an offloaded layer (seed VisMMOE §3.4: a miss blocks only on that expert):
look up all routed experts → submit transfers for misses into free/evictable slots → compute the
hits while transfers run → for each miss in submission order wait for it (a *stall*), compute it,
and let its slot be reused. The output is the sum of the group outputs, which equals the plain
model's output up to floating-point summation order.

Optional, per MoE layer l (seed ActiveEvict, :mod:`workbench.policies.active_evict`):

- **router lookahead** (``lookahead_depth`` D ≥ 1): the routers of layers l+1 … l+D are applied
  to layer l's MoE input (the tensor layer l's router saw) and their top-k ids go into
  :attr:`LayerEvent.pred_ids`. The routers' ``forward`` is called directly (no module hooks), on
  the same input, with no state: the model's outputs do not change. With visual-token
  compression (``pruning``), a pinned layer's predictions for layers behind the pinned prefix
  are restricted to the tokens that will reach them: a pruned token's are -1 (and ActiveEvict's
  p̂ averages the kept tokens only), as soon as the selection is known (at the last pinned layer;
  earlier for policies that need no prefix routing).
- **ActiveEvict** (``active_evict``): layer l's routing feeds the hotness windows; once all of
  layer l's misses have a slot, experts are pre-evicted so that layer l+1 finds Δ free slots
  (never one of layer l's routed experts, nor one predicted for l+1). Loads stay on demand.
- **dynamic top-k** (``dynamic_topk``, decode steps, offloaded layers): before the lookup, the
  layer's k is narrowed (or widened up to ``k_max``) to the largest k whose misses fit the free
  slots, and the experts receive the model's own router output for that k.
- **GPU–CPU hybrid** (``hybrid``, seed VisMMOE §3.4): a miss the rule picks (a function of the
  expert's token count, :func:`workbench.runtime.clocks.runs_on_host`) is not loaded: the model's
  own experts forward runs over the host store's copy of that one expert, on the host, after
  the hits were launched (on CUDA the device keeps computing meanwhile); the cache is unchanged.

:class:`Offloader` is a context manager: on exit every wrapper is removed and every expert tensor
is back in place, whatever happened inside.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from workbench.models.adapter import MoEBlock, MoELayout
from workbench.policies.active_evict import ActiveEvict, budget_topk
from workbench.policies.prefetch import PrefetchContext, ranked_ids, select
from workbench.runtime.expert_cache import ExpertCache
from workbench.runtime.expert_store import HostExpertStore
from workbench.runtime.transfer import Transfer, TransferEngine
from workbench.telemetry.events import LANES, LayerEvent, Span

_STALL, _HOST = LANES.index("stall"), LANES.index("host")


class StepProbe:
    """Collects the layer events and measured stall spans of the step in progress."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0  # run start (perf_counter)
        self.step = -1
        self.layers: list[LayerEvent] = []
        self.stalls: list[Span] = []

    def begin(self, step: int) -> None:
        self.step = step
        self.layers = []
        self.stalls = []


class Offloader:
    """Context manager that runs ``model`` with its routed experts offloaded.

    Args:
        layout: the adapter's view of the model.
        num_slots: device slots of the expert cache (≥ top-k when any layer is offloaded).
        pinned_layers: the first N MoE layers stay fully resident.
        policy: eviction policy object.
        device: device of the slots (the model's device).
        probe: receives one :class:`LayerEvent` per MoE layer call.
        lookahead_depth: record the top-k of the routers of the next D layers (0: off).
        active_evict: an :class:`ActiveEvict` state to pre-evict with (None: off).
        dynamic_topk: budget-aware dynamic top-k in decode steps (``probe.step`` > 0).
        k_max: largest k of dynamic top-k (None: each layer's top-k).
        prefetch: a prefetch policy object (None: on demand only); asked once per layer, when
            every miss of the layer has a slot, for ``prefetch_lead`` layers ahead, at most
            ``prefetch_budget`` experts. A prefetched expert a later layer routes to is a hit
            whose compute waits for its copy.
        pruning: the request's :class:`~workbench.compression.placement.PrunedPlacement`
            (None: no token compression); the lookahead asks it which tokens survive the
            pinned prefix.
        hybrid: GPU–CPU hybrid rule, ``tokens -> run this miss on the host?`` (None: off).
    """

    def __init__(self, layout: MoELayout, num_slots: int, pinned_layers: int, policy,
                 device: torch.device, probe: StepProbe, *, lookahead_depth: int = 0,
                 active_evict: ActiveEvict | None = None, dynamic_topk: bool = False,
                 k_max: int | None = None, prefetch=None, prefetch_lead: int = 1,
                 prefetch_budget: int | None = None, pruning=None,
                 hybrid: Callable[[int], bool] | None = None) -> None:
        self.layout = layout
        self.hybrid = hybrid
        self.pruning = pruning
        self.pinned_layers = pinned_layers
        self.probe = probe
        self.lookahead_depth = int(lookahead_depth)
        self.active_evict = active_evict
        self.dynamic_topk = bool(dynamic_topk)
        self.k_max = k_max
        self.prefetch = prefetch if prefetch is not None and prefetch.name != "none" else None
        self.prefetch_lead = int(prefetch_lead)
        self.prefetch_budget = prefetch_budget
        self._pf_inflight: dict[tuple[int, int], Transfer] = {}  # prefetched, not yet computed
        self._routing = {"step": -1, "prev": {}, "cur": {}}  # ranked experts per layer
        self.device = torch.device(device)
        self.offloaded = [b for b in layout.blocks if b.index >= pinned_layers]
        first = layout.blocks[0]
        dtype = getattr(first.experts, first.expert_params[0]).dtype
        n_offloaded = sum(b.num_experts for b in self.offloaded)
        self.num_slots = min(num_slots, n_offloaded) if self.offloaded else 0
        self.store = HostExpertStore(pin_memory=self.device.type == "cuda")
        self.cache = ExpertCache(
            max(self.num_slots, 1), policy, layout.num_layers, layout.num_experts,
            param_shapes=first.expert_shapes if self.offloaded else None, dtype=dtype,
            device=self.device)
        self.engine: TransferEngine | None = None
        self._saved: list[tuple[MoEBlock, dict, dict]] = []

    # -- install / remove -----------------------------------------------------------------
    def __enter__(self) -> "Offloader":
        try:
            if self.offloaded:
                self.engine = TransferEngine(self.device)
            for b in self.layout.blocks:
                self._install(b)
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _install(self, b: MoEBlock) -> None:
        ex = b.experts
        attrs = {"num_experts": getattr(ex, "num_experts", None),
                 "_is_expert_parallel": getattr(ex, "_is_expert_parallel", None)}
        params: dict = {}
        self._saved.append((b, attrs, params))
        original = ex.forward
        if b.index < self.pinned_layers:
            ex.forward = self._pinned_forward(b, original)
            return
        for name in b.expert_params:
            params[name] = ex._parameters[name]
        self.store.add_layer(b.index, {n: p.data for n, p in params.items()})
        for name in b.expert_params:
            del ex._parameters[name]
            setattr(ex, name, self.cache.pool[name])
            # the resident copy is no longer needed on the device: only the host store keeps it
            if params[name].device.type != "cpu":
                params[name].data = torch.empty(0, dtype=params[name].dtype)
        ex.num_experts = self.num_slots
        ex._is_expert_parallel = True  # enables sentinel handling in grouped/batched impls
        ex.forward = self._offloaded_forward(b, original)

    def _remove(self) -> None:
        while self._saved:
            b, attrs, params = self._saved.pop()
            ex = b.experts
            ex.__dict__.pop("forward", None)
            for name, p in params.items():
                if name in ex.__dict__:
                    del ex.__dict__[name]
                if p.numel() == 0:  # bring the device copy back from the host store
                    p.data = self.store.layer(b.index)[name].to(self.device)
                ex._parameters[name] = p
            for k, v in attrs.items():
                if v is None:
                    ex.__dict__.pop(k, None)
                else:
                    setattr(ex, k, v)
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # -- forwards --------------------------------------------------------------------------
    def _layer_event(self, b: MoEBlock, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> tuple[LayerEvent, list[int]]:
        ids = top_k_index.detach().to("cpu")
        experts, counts = torch.unique(ids, return_counts=True)
        ev = LayerEvent(layer=b.index, pinned=b.index < self.pinned_layers,
                        topk_ids=ids.numpy().astype(np.int32),
                        topk_weights=top_k_weights.detach().float().to("cpu").numpy(),
                        expert_tokens=dict(zip(experts.tolist(), counts.tolist())))
        self.probe.layers.append(ev)
        return ev, experts.tolist()

    def _lookahead(self, b: MoEBlock, hidden_states: torch.Tensor
                   ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Routers of the next layers on this layer's MoE input.

        Returns ``(pred [T, D', k] int16 or None, p̂ of layer l+1 [E] or None)``: D' = the
        recorded depth (``lookahead_depth``; one layer when only ActiveEvict needs it), -1
        past the last layer; p̂ only when ActiveEvict is on and layer l+1 exists.
        """
        blocks = self.layout.blocks
        ae = self.active_evict
        depth = max(self.lookahead_depth, 1 if ae is not None else 0)
        if depth <= 0:
            return None, None
        k = self.layout.top_k
        T = hidden_states.shape[0]
        avail = min(depth, len(blocks) - 1 - b.index)
        if avail <= 0:
            return np.full((T, depth, k), -1, np.int16), None
        # token compression: tokens that will not reach the layers behind the pinned prefix
        keep, first_pruned = None, len(blocks)
        if self.pruning is not None and b.index < self.pinned_layers:
            keep = self.pruning.prefill_keep_mask(b.index)
            if keep is not None and len(keep) != T:
                keep = None
            if keep is not None:
                first_pruned = self.pruning.pinned
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
                    p_next = prob.mean(0)
            pred = torch.stack(preds, 1).to(device="cpu", dtype=torch.int16).numpy()
        if keep is not None:
            d0 = max(first_pruned - b.index, 1)  # first lookahead distance behind the prefix
            if d0 <= avail:
                pred[~keep, d0 - 1:] = -1
        if avail < depth:
            pred = np.concatenate([pred, np.full((T, depth - avail, k), -1, np.int16)], 1)
        return pred, (p_next.cpu().double().numpy() if p_next is not None else None)

    def _pre_evict(self, b: MoEBlock, ev: LayerEvent, pred: np.ndarray | None,
                   p_next: np.ndarray | None, protected: set) -> None:
        """ActiveEvict before layer l+1 (only when l+1 is an offloaded layer)."""
        nxt = b.index + 1
        if self.active_evict is None or pred is None or p_next is None \
                or nxt < self.pinned_layers or nxt >= self.layout.num_layers:
            return
        demand = {int(e) for e in np.unique(pred[:, 0, :]) if e >= 0}
        gone = self.active_evict.pre_evict(self.cache, nxt, demand, p_next, protected)
        ev.pre_evicted.extend(gone)
        for key in gone:
            self._pf_inflight.pop(key, None)

    def _note_routing(self, layer: int, topk_ids: np.ndarray) -> None:
        r = self._routing
        if r["step"] != self.probe.step:
            r["step"], r["prev"], r["cur"] = self.probe.step, r["cur"], {}
        if self.prefetch is not None:
            r["cur"][layer] = ranked_ids(topk_ids)

    def _prefetch(self, b: MoEBlock, ev: LayerEvent, pred: np.ndarray | None,
                  protected) -> None:
        """Ask the prefetch policy after ``b``'s router ran and copy its picks ahead of need
        (the same context, order and filters as trace replay's ``plan_prefetch``)."""
        if self.prefetch is None or self.engine is None:
            return
        lay = self.layout

        def pred_at(d: int) -> list[int]:
            if pred is None or d - 1 >= pred.shape[1]:
                return []
            return ranked_ids(pred[:, d - 1])

        def no_future(d: int) -> list[int]:
            raise RuntimeError("the live runtime cannot see the future (oracle is replay-only)")

        prev = self._routing["prev"]
        ctx = PrefetchContext(step=self.probe.step, layer=b.index, num_layers=lay.num_layers,
                              lead=self.prefetch_lead, pred=pred_at,
                              previous=lambda l: prev.get(l, []), future=no_future)
        pinned = [blk.index < self.pinned_layers for blk in lay.blocks]
        E = lay.num_experts
        cache = self.cache
        for k in select(self.prefetch.candidates(ctx), pinned, lay.num_layers, E,
                        self.prefetch_budget):
            key = (k // E, k % E)
            if key in cache:
                continue
            got = cache.admit(key, protected)
            if got is None:
                continue
            slot, evicted = got
            if evicted is not None:
                ev.evicted.append(evicted)
                self._pf_inflight.pop(evicted, None)
            self._pf_inflight[key] = self.engine.submit(key, slot, cache.slot_view(slot),
                                                        self.store.expert(*key))
            ev.prefetched.append(key)

    def _budget_topk(self, b: MoEBlock, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Budget-aware dynamic top-k (seed ActiveEvict eq. 18–21) for offloaded layer ``b``."""
        cache, layer = self.cache, b.index
        kmax = min(self.k_max or b.top_k, b.num_experts)
        with torch.no_grad():
            _, w_max, ids_max = b.route(hidden_states, top_k=kmax)
            # rank by the router's weights (monotone in its probabilities for every supported
            # router, including DeepSeek's unsorted top-k)
            order = torch.argsort(w_max.float(), dim=-1, descending=True, stable=True)
            ranked = torch.gather(ids_max, -1, order).cpu().numpy()
        avail = cache.num_slots - len(cache.slot_of)
        k = budget_topk(ranked, lambda e: (layer, e) in cache.slot_of, avail)
        if k == top_k_index.shape[-1]:
            return top_k_index, top_k_weights
        if k == kmax:
            return ids_max, w_max
        with torch.no_grad():
            _, w, ids = b.route(hidden_states, top_k=k)
        return ids, w

    def _pinned_forward(self, b: MoEBlock, original: Callable) -> Callable:
        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            ev, experts = self._layer_event(b, top_k_index, top_k_weights)
            ev.hits = experts
            self.cache.hits[b.index] += len(experts)
            pred, p_next = self._lookahead(b, hidden_states)
            if self.lookahead_depth > 0:
                ev.pred_ids = pred
            self._note_routing(b.index, ev.topk_ids)
            self._pre_evict(b, ev, pred, p_next, set())
            self._prefetch(b, ev, pred, frozenset())
            return original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)

        return forward

    def _offloaded_forward(self, b: MoEBlock, original: Callable) -> Callable:
        layer = b.index
        cache = self.cache
        sentinel = self.num_slots

        def run_group(hidden_states, top_k_index, top_k_weights, slot_map: dict[int, int]):
            """Run the model's experts forward on the experts in ``slot_map`` only."""
            lut = torch.full((b.num_experts,), sentinel, dtype=top_k_index.dtype,
                             device=top_k_index.device)
            for e, s in slot_map.items():
                lut[e] = s
            idx = lut[top_k_index]
            w = top_k_weights.masked_fill(idx == sentinel, 0)
            return original(hidden_states, idx, w)

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            if self.dynamic_topk and self.probe.step > 0:
                top_k_index, top_k_weights = self._budget_topk(
                    b, hidden_states, top_k_index, top_k_weights)
            ev, experts = self._layer_event(b, top_k_index, top_k_weights)
            pred, p_next = self._lookahead(b, hidden_states)
            if self.lookahead_depth > 0:
                ev.pred_ids = pred
            self._note_routing(layer, ev.topk_ids)
            ae = self.active_evict
            if ae is not None:
                ae.observe(layer, ev.topk_ids)
            cache.policy.begin_group(-1, self.probe.step)
            hits, misses = cache.lookup(layer, experts)
            ev.hits, ev.misses = hits, misses
            if self.hybrid is not None:
                ev.host = [e for e in misses if self.hybrid(ev.expert_tokens[e])]
            host = set(ev.host)
            fill = cache.fill(layer, experts, [e for e in misses if e not in host])
            inflight: list[tuple[int, Transfer]] = []
            # every routed expert of this layer is needed until the layer returns
            needed = {(layer, e) for e in experts} if ae is not None else set()
            pre_done = ae is None and self.prefetch is None

            def issue() -> None:
                nonlocal pre_done
                for e, slot, evicted in fill.issue():
                    if evicted is not None:
                        ev.evicted.append(evicted)
                        self._pf_inflight.pop(evicted, None)
                    assert self.engine is not None
                    tr = self.engine.submit((layer, e), slot, cache.slot_view(slot),
                                            self.store.expert(layer, e))
                    inflight.append((e, tr))
                if not pre_done and not fill.pending:
                    # all of this layer's misses have a slot: release slots for layer l+1
                    # while this layer still computes
                    pre_done = True
                    self._pre_evict(b, ev, pred, p_next, needed)
                    self._prefetch(b, ev, pred, fill.protected)

            issue()
            out = None
            for e in hits:  # a prefetched expert computes once its copy has landed
                tr = self._pf_inflight.pop((layer, e), None)
                if tr is not None:
                    t = time.perf_counter()
                    waited = tr.wait()
                    if waited > 0:
                        ev.stall_s += waited
                        self._span(_STALL, layer, e, t)
            if hits:
                out = run_group(hidden_states, top_k_index, top_k_weights,
                                {e: cache.slot_of[(layer, e)] for e in hits})
                fill.done(hits)
                issue()
            for e in ev.host:
                t = time.perf_counter()
                part = self._run_on_host(b, original, hidden_states, top_k_index,
                                         top_k_weights, e)
                self._span(_HOST, layer, e, t)
                out = part if out is None else out + part
            while inflight:
                e, tr = inflight.pop(0)
                t = time.perf_counter()
                waited = tr.wait()
                if waited > 0:
                    ev.stall_s += waited
                    self._span(_STALL, layer, e, t)
                part = run_group(hidden_states, top_k_index, top_k_weights, {e: tr.slot})
                out = part if out is None else out + part
                fill.done((e,))
                issue()
            if fill.pending:  # cannot happen with num_slots ≥ 1: every wait frees a slot
                raise RuntimeError(f"layer {layer}: {len(fill.pending)} experts found no slot")
            if out is None:  # no token routed here (empty input)
                out = torch.zeros_like(hidden_states)
            return out

        return forward

    def _run_on_host(self, b: MoEBlock, original: Callable, hidden_states: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     expert: int) -> torch.Tensor:
        """Expert ``expert``'s share of the layer output, computed by the model's own experts
        forward on the host over the host store's copy (a one-expert view, no copy of the
        weights); the slot pool is put back afterwards, whatever happens."""
        ex = b.experts
        host = self.store.layer(b.index)
        saved = {n: ex.__dict__[n] for n in b.expert_params}
        saved_n = ex.num_experts
        cpu = torch.device("cpu")
        idx = top_k_index.to(cpu)
        lut = torch.ones(b.num_experts, dtype=idx.dtype)  # 1 = the sentinel of a 1-expert view
        lut[expert] = 0
        idx = lut[idx]
        w = top_k_weights.to(cpu).masked_fill(idx == 1, 0)
        try:
            for n in b.expert_params:
                ex.__dict__[n] = host[n][expert:expert + 1]
            ex.num_experts = 1
            out = original(hidden_states.to(cpu), idx, w)
        finally:
            ex.__dict__.update(saved)
            ex.num_experts = saved_n
        return out.to(hidden_states.device)

    def _span(self, lane: int, layer: int, expert: int, t_start: float) -> None:
        t_end = time.perf_counter()
        self.probe.stalls.append(Span(
            clock=0, lane=lane, step=self.probe.step, layer=layer, expert=expert,
            start=t_start - self.probe.t0, end=t_end - self.probe.t0))
