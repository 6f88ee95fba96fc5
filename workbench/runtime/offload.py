"""Install expert offloading into a live ``transformers`` model, and take it out again.

For each MoE block found by the adapter:

- **pinned** layers (the first ``pinned_layers``) keep their fused expert tensors resident; their
  experts module only gets a recording wrapper.
- **offloaded** layers hand their fused expert tensors to the host store; the device keeps
  only the shared slot pool (:class:`~workbench.runtime.slots.SlotPool`). Each computation runs
  the model's *own* experts forward over the slots it needs, gathered into a compact tensor
  (:class:`~workbench.runtime.slots.ExpertsView`), so its cost follows the experts the layer
  routed to, not the size of the cache.

Every MoE block has **one interception point** (:meth:`Offloader._layer`) that runs the
features in a declared order: routing (dynamic top-k) → the layer event → router lookahead →
the step's feature inputs (ActiveEvict hotness, prefetch candidates, hybrid picks) →
:meth:`workbench.sim.step.Simulator.step`, the torch-free core that decides hits, misses,
admissions, prefetches, evictions and host runs and prices them on the modeled clock → the
execution of its schedule on real tensors. Trace replay calls the same core, so live runs and
replay cannot drift apart.

Order of work in an offloaded layer (VisMMOE §3.4: a miss blocks only on that expert), as
the core schedules it: look up all routed experts → submit transfers for misses into
free/evictable slots → compute the hits while transfers run → for each miss in submission order
wait for it (a *stall*), compute it, and let its slot be reused. The output is the sum of the
group outputs, which equals the plain model's output up to floating-point summation order.

Optional, per MoE layer l (ActiveEvict, :mod:`workbench.policies.active_evict`):

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
- **GPU–CPU hybrid** (``hybrid``, VisMMOE §3.4): a miss the rule picks (a function of the
  expert's token count, :func:`workbench.sim.costs.runs_on_host`) is not loaded: the model's
  own experts forward runs over the host store's copy of that one expert, on the host, after
  the hits were launched (on CUDA the device keeps computing meanwhile); the cache is unchanged.

:class:`Offloader` is a context manager: on exit every wrapper is removed and every expert tensor
is back in place, whatever happened inside.
"""


from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from workbench.models.adapter import MoEBlock, MoELayout
from workbench.models.hooks import Hooks
from workbench.policies.active_evict import ActiveEvict, budget_topk
from workbench.policies.prefetch import PrefetchContext, ranked_ids, select
from workbench.runtime.executor import ComputeCall, Executor, StepProbe
from workbench.runtime.expert_store import HostExpertStore
from workbench.runtime.slots import ExpertsView, SlotPool
from workbench.runtime.stages import HOOKS, STAGES, LayerCall, StageSetup, hooked
from workbench.runtime.stages import build as build_stages
from workbench.runtime.transfer import TransferEngine
from workbench.sim.costs import Prices
from workbench.sim.placement import Placement
from workbench.sim.profiles import get_profile
from workbench.sim.step import Access, Outcome, Simulator
from workbench.telemetry.events import CLOCKS, LayerEvent, Span

_MODELED = CLOCKS.index("modeled")
#: every stage's run-result counters
STAGE_COUNTS = tuple(name for cls in STAGES for name in cls.COUNTS)


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
        prefetch: a prefetch policy object (None: on demand only); asked once per layer, for
            ``prefetch_lead`` layers ahead, at most ``prefetch_budget`` experts; the core runs
            its picks when every miss of the layer has a slot. A prefetched expert a later
            layer routes to is a hit whose compute waits for its copy.
        pruning: the request's :class:`~workbench.compression.placement.PrunedPlacement`
            (None: no token compression); the lookahead asks it which tokens survive the
            pinned prefix.
        prices: the modeled clock's prices (None: nothing priced, times 0).
        hybrid: GPU–CPU hybrid mode: True runs on the host copy the misses
            :meth:`Prices.on_host` picks; a callable ``tokens -> bool`` is another rule.
        dispatch: a capacity-aware dispatch policy (:mod:`workbench.sim.dispatch`; None or
            ``topk``: the router's choice). Its dropped assignments are computed by no expert.
    """

    def __init__(self, layout: MoELayout, num_slots: int, pinned_layers: int, policy,
                 device: torch.device, probe: StepProbe, prices: Prices | None = None, *,
                 lookahead_depth: int = 0, active_evict: ActiveEvict | None = None,
                 dynamic_topk: bool = False, k_max: int | None = None, prefetch=None,
                 prefetch_lead: int = 1, prefetch_budget: int | None = None, pruning=None,
                 hybrid: bool | Callable[[int], bool] = False, dispatch=None,
                 balance=None, rank_of_expert: np.ndarray | None = None,
                 low_precision: str = "nvfp4", prism=None, prism_offload: bool = False,
                 macs_centroids: torch.Tensor | None = None) -> None:
        self.layout = layout
        # no prices given: hit counts only, every modeled time 0
        self.prices = prices if prices is not None else Prices(get_profile("a100-40gb"), None)
        self.stages = build_stages(StageSetup(
            layout, pinned_layers, self.prices, torch.device(device), lookahead_depth,
            active_evict, dynamic_topk, k_max, prefetch, prefetch_lead, prefetch_budget,
            pruning, hybrid, dispatch, balance, rank_of_expert, low_precision, prism,
            prism_offload, macs_centroids))
        self._hooked = {h: hooked(self.stages, h) for h in HOOKS}
        self._before_mask = [s for s in self._hooked["route"] if s.before_mask]
        self._after_mask = [s for s in self._hooked["route"] if not s.before_mask]
        self._routes_nowhere = any(s.routes_nowhere for s in self.stages)
        #: what the stages need of the runtime (:data:`~workbench.runtime.stages.TOKEN_CONTEXT`)
        self.needs: frozenset[str] = frozenset().union(*(s.needs for s in self.stages))
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
        #: the cache's keys are 1/part of an expert (a stage that splits experts: sub-expert
        #: e·part + s, slots of 1/part, only the ones run fetched)
        self._split = next((st for st in self.stages if st.part > 1), None)
        self.part = self._split.part if self._split is not None else 1
        # hybrid rule: tokens → run this miss on the host? (True: the modeled prices decide,
        # of a cache key: an expert, or a sub-expert with 1/part of its bytes and FLOPs)
        self.hybrid: Callable[[int], bool] | None = (
            self.prices.part(self.part).on_host if hybrid is True else (hybrid or None))
        #: prefetched experts evicted before any access used them (the core's ``redundant``)
        self.redundant_prefetches = 0
        self._routing: dict = {"step": -1, "prev": {}, "cur": {}}  # ranked experts per layer
        #: the real tokens of the step in progress (bool [B·T] on the device, row-major like
        #: the experts' flattened input; None: every token is real): a batch's left padding
        #: and the rows of requests that have finished are routed to no expert (the sentinel
        #: id E, weight 0), so they load nothing, count nowhere and take no capacity. Set by
        #: :meth:`set_token_mask` before each forward.
        self.token_mask: torch.Tensor | None = None
        self._mask_np: np.ndarray | None = None
        #: per flattened position of the step in progress: modality code and request (for
        #: the stages that need the token context; None: unknown — all text, one request)
        self._step_modality: np.ndarray | None = None
        self._step_request: np.ndarray | None = None
        self.device = torch.device(device)
        self.offloaded = [b for b in layout.blocks if b.index >= pinned_layers]
        first = layout.blocks[0]
        dtype = getattr(first.experts, first.expert_params[0]).dtype
        part = self.part
        n_offloaded = sum(b.num_experts for b in self.offloaded) * part
        # ``num_slots`` is memory in expert-sized slots: part × as many slots of 1/part
        self.num_slots = min(num_slots * part, n_offloaded) if self.offloaded else 0
        self.sim = Simulator(
            Placement.single_device(layout.num_layers, layout.num_experts * part,
                                    layout.top_k * part, pinned_layers, max(self.num_slots, 1)),
            lambda: policy, transfer_s=self.prices.part(part).transfer, record_spans=True)
        self.store = HostExpertStore(pin_memory=self.device.type == "cuda")
        shapes = first.expert_shapes if self.offloaded else {}
        if self._split is not None:  # one key's block
            shapes = self._split.slot_shapes(shapes)
        self.slots = SlotPool(self.num_slots, shapes, dtype, self.device)
        self.executor = Executor(self.slots, self.store, probe, part=part,
                                 low_precision=low_precision,
                                 prism=bool(self._hooked["runner"]))
        self._saved: list[tuple[MoEBlock, dict]] = []
        self._hooks = Hooks()  # each experts module's forward override

    def set_token_mask(self, valid: np.ndarray | None, modality: np.ndarray | None = None,
                       request: np.ndarray | None = None) -> None:
        """The real tokens of the next forward (bool, one per flattened position; None or all
        True: no masking), and each position's modality and request when known."""
        self._step_modality, self._step_request = modality, request
        if valid is None or bool(np.all(valid)):
            self.token_mask, self._mask_np = None, None
        else:
            self._mask_np = np.asarray(valid, bool)
            self.token_mask = torch.as_tensor(self._mask_np, device=self.device)

    @property
    def _sentinels(self) -> bool:
        """Whether routing may hold the "routed nowhere" id E (dispatch drops, masked rows)."""
        return self._routes_nowhere or self.token_mask is not None

    def counts(self) -> dict[str, int]:
        """The run's counters: the core's, the executor's and every stage's (0 when off)."""
        out = dict.fromkeys(STAGE_COUNTS, 0)
        for st in self.stages:
            out.update(st.counts())
        out["redundant_prefetches"] = self.redundant_prefetches
        out["low_precision_runs"] = self.executor.low_precision_runs
        return out

    def __getattr__(self, name: str):
        # a stage's counter by its name (e.g. ``dispatch_dropped``): 0 while the stage is off
        if name in STAGE_COUNTS:
            return next((getattr(st, name) for st in self.__dict__.get("stages", ())
                         if name in st.COUNTS), 0)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def engine(self) -> TransferEngine | None:
        """The transfers from the host store (None: not installed, or nothing offloaded)."""
        return self.executor.engine

    @property
    def cache(self):
        """The expert cache's bookkeeping (one pool on one device)."""
        return self.sim.pools[0]

    # -- install / remove -----------------------------------------------------------------
    def __enter__(self) -> "Offloader":
        try:
            if self.offloaded:
                self.executor.engine = TransferEngine(self.device)
            for b in self.layout.blocks:
                self._install(b)
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _install(self, b: MoEBlock) -> None:
        """Wrap ``b``'s experts module: its ``forward`` becomes the interception point. An
        offloaded layer's expert tensors go to the host store; on an accelerator the module's
        parameters then hold a zero-stride placeholder of the same shape (no memory) until
        :meth:`_remove` copies them back."""
        ex = b.experts
        moved: list = []
        self._saved.append((b, moved))
        view = ExpertsView(ex, b.expert_params)
        for st in self._hooked["runner"]:  # every path below calls the view
            view = st.runner(b, view)
        original = ex.forward
        if b.index >= self.pinned_layers:
            params = {n: ex._parameters[n] for n in b.expert_params}
            host = {n: p.data for n, p in params.items()}
            if self._split is not None:  # the store's rows are the keys (views: no copy)
                host = self._split.host_rows(host)
            self.store.add_layer(b.index, host)
            for name, p in params.items():
                if p.device.type != "cpu":  # a CPU tensor is the host store's copy itself
                    p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
                    moved.append((name, p))

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            return self._layer(b, original, view, hidden_states, top_k_index, top_k_weights,
                               args, kwargs)

        self._hooks.override(ex, "forward", forward)

    def residency(self) -> np.ndarray:
        """bool [L, E]: experts resident now (pinned layers entirely); with sub-expert
        offloading, an expert any of whose sub-experts is."""
        r = self.sim.residency()
        if self.part > 1:
            r = r.reshape(r.shape[0], -1, self.part).any(-1)
        return r

    def _remove(self) -> None:
        self._hooks.remove()  # the model's own experts forwards first, then their tensors
        while self._saved:
            b, moved = self._saved.pop()
            for name, p in moved:  # bring the device copy back from the host store
                p.data = self.store.layer(b.index)[name].to(self.device).reshape(p.shape)
            for st in self._hooked["uninstall"]:
                st.uninstall(b)
        if self.executor.engine is not None:
            self.executor.engine.close()
            self.executor.engine = None

    # -- the interception point ------------------------------------------------------------
    def _layer(self, b: MoEBlock, original: Callable, view: ExpertsView,
               hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """One MoE layer call; the features run in this order (each reads what the previous
        ones produced): dynamic top-k → layer event → lookahead → step inputs (ActiveEvict
        hotness, prefetch candidates, hybrid picks) → the core's step → its schedule."""
        pinned = b.index < self.pinned_layers
        mask = self.token_mask
        if mask is not None and mask.shape[0] != top_k_index.shape[0]:
            raise RuntimeError(f"MoE layer {b.index} got {top_k_index.shape[0]} tokens, the "
                               f"step's token mask {mask.shape[0]}")
        if not pinned and self.dynamic_topk and self.probe.step > 0:
            top_k_index, top_k_weights = self._budget_topk(
                b, hidden_states, top_k_index, top_k_weights)
        if mask is not None:  # padding and finished requests: routed nowhere
            top_k_index = top_k_index.masked_fill(~mask[:, None], b.num_experts)
            top_k_weights = top_k_weights.masked_fill(~mask[:, None], 0)
        call = LayerCall(b, hidden_states, top_k_index, top_k_weights, self.probe.step, pinned,
                         mask, self._mask_np, self._step_modality, self._step_request)
        for st in self._after_mask:
            st.route(call)
        top_k_index, top_k_weights = call.ids, call.weights
        ev, experts, routed = self._layer_event(b, top_k_index, top_k_weights)
        ev.dropped_ids, ev.rerouted_ids = call.dropped, call.rerouted
        ev.token_weights = call.token_weights
        pred, p_next = self._lookahead(b, hidden_states)
        if self.lookahead_depth > 0:
            ev.pred_ids = pred
        real_ids = ev.topk_ids if mask is None else ev.topk_ids[self._mask_np]
        # what the next routers say of the real tokens only (padding must not prefetch)
        pred_real = pred if mask is None or pred is None else pred[self._mask_np]
        if not pinned and self.active_evict is not None:
            self.active_evict.observe(b.index, real_ids)
        p = self.prices
        tokens = [ev.expert_tokens[e] for e in experts]
        call.event, call.experts, call.real_ids = ev, experts, real_ids
        for st in self._hooked["observe"]:
            st.observe(call)
        call.keys, call.tokens, call.key_ids = experts, tokens, real_ids
        for st in self._hooked["price"]:
            st.price(call)
        keys, tokens, compute_s = call.keys, call.tokens, call.compute_s
        if compute_s is None:
            low_price = p.expert_in(call.low_precision) if call.low else p.expert
            compute_s = [(low_price if e in call.low else p.expert)(n)
                         for e, n in zip(experts, tokens)]
        self._note_routing(b.index, call.key_ids)
        ev.low_precision = sorted(call.low)
        out = self.sim.step(Access(
            step=self.probe.step, layer=b.index, experts=keys,
            compute_s=compute_s,
            dense_s=p.dense(int(real_ids.shape[0])),
            prefetch=self._prefetch_candidates(b, pred_real),
            on_host=[self.hybrid(n) for n in tokens] if self.hybrid and not pinned else None,
            host_s=([p.part(self.part).host(n) for n in tokens] if self.hybrid and not pinned
                    else None),
            pre_evict=self._pre_evict_hook(b, pred_real, p_next)))
        self._note_outcome(ev, keys, out)
        result = self.executor.execute(ComputeCall(
            b, original, view, hidden_states, top_k_index, top_k_weights, args, kwargs, ev,
            routed, call.low, self._sentinels), out)
        for st in self._hooked["finish"]:
            st.finish(call)
        return result

    def _note_outcome(self, ev: LayerEvent, experts: list[int], out: Outcome) -> None:
        """The core's decisions into the layer event, its modeled spans into the probe."""
        ev.hits = list(experts) if out.pinned else out.hits
        ev.misses, ev.host = out.misses, out.host
        ev.evicted.extend(out.evicted)
        ev.pre_evicted.extend(out.pre_evicted)
        ev.prefetched.extend(out.prefetched)
        self.redundant_prefetches += len(out.redundant)
        probe = self.probe
        probe.stall_modeled_s += out.stall_s
        probe.moved += out.moved
        probe.modeled.extend(Span(_MODELED, lane, probe.step, layer, expert, start, end)
                             for lane, layer, expert, start, end in out.spans)

    # -- features before the step -------------------------------------------------------------
    def _layer_event(self, b: MoEBlock, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                     ) -> tuple[LayerEvent, list[int], torch.Tensor]:
        """The layer's event and its distinct routed experts (ascending; list and tensor).
        An assignment the dispatch dropped (id E) is recorded as -1 and routes nowhere."""
        ids = top_k_index.detach().to("cpu")
        recorded = ids.numpy().astype(np.int32)
        if self._sentinels:
            gone = ids >= b.num_experts
            experts, counts = torch.unique(ids[~gone], return_counts=True)
            recorded[gone.numpy()] = -1
        else:
            experts, counts = torch.unique(ids, return_counts=True)
        ev = LayerEvent(layer=b.index, pinned=b.index < self.pinned_layers,
                        topk_ids=recorded,
                        topk_weights=top_k_weights.detach().float().to("cpu").numpy(),
                        expert_tokens=dict(zip(experts.tolist(), counts.tolist())))
        self.probe.layers.append(ev)
        return ev, experts.tolist(), experts

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
                    if self.token_mask is not None:  # real tokens only
                        prob = prob[self.token_mask]
                    p_next = prob.mean(0)
            pred = torch.stack(preds, 1).to(device="cpu", dtype=torch.int16).numpy()
        if keep is not None:
            d0 = max(first_pruned - b.index, 1)  # first lookahead distance behind the prefix
            if d0 <= avail:
                pred[~keep, d0 - 1:] = -1
        if avail < depth:
            pred = np.concatenate([pred, np.full((T, depth - avail, k), -1, np.int16)], 1)
        return pred, (p_next.cpu().double().numpy() if p_next is not None else None)

    def _note_routing(self, layer: int, topk_ids: np.ndarray) -> None:
        r = self._routing
        if r["step"] != self.probe.step:
            r["step"], r["prev"], r["cur"] = self.probe.step, r["cur"], {}
        if self.prefetch is not None:
            r["cur"][layer] = ranked_ids(topk_ids)


    def _prefetch_candidates(self, b: MoEBlock, pred: np.ndarray | None) -> list:
        """The prefetch policy's picks after ``b``'s router ran, as ``(layer, expert)`` (the
        same context, order and filters as trace replay's ``plan_prefetch``); the core admits
        them when every miss of the layer has a slot."""
        if self.prefetch is None or self.engine is None:
            return []
        lay = self.layout

        def pred_at(d: int) -> list[int]:
            # the routers' lookahead names experts: none for sub-expert keys (as in replay,
            # whose sub-expert trace drops it)
            if pred is None or d - 1 >= pred.shape[1] or self.part > 1:
                return []
            return ranked_ids(pred[:, d - 1])

        def no_future(d: int) -> list[int]:
            raise RuntimeError("the live runtime cannot see the future (oracle is replay-only)")

        prev = self._routing["prev"]
        ctx = PrefetchContext(step=self.probe.step, layer=b.index, num_layers=lay.num_layers,
                              lead=self.prefetch_lead, pred=pred_at,
                              previous=lambda l: prev.get(l, []), future=no_future)
        pinned = [blk.index < self.pinned_layers for blk in lay.blocks]
        E = lay.num_experts * self.part  # the cache's keys: experts or sub-experts
        return [divmod(k, E) for k in select(self.prefetch.candidates(ctx), pinned,
                                             lay.num_layers, E, self.prefetch_budget)]

    def _pre_evict_hook(self, b: MoEBlock, pred: np.ndarray | None, p_next: np.ndarray | None):
        """ActiveEvict before layer l+1, for the core to call once layer l's misses have
        slots (None when it does not apply: off, no lookahead, or l+1 not offloaded)."""
        nxt = b.index + 1
        ae = self.active_evict
        if ae is None or pred is None or p_next is None \
                or nxt < self.pinned_layers or nxt >= self.layout.num_layers:
            return None
        demand = {int(e) for e in np.unique(pred[:, 0, :]) if e >= 0}

        def hook(cache, protected: set) -> list:
            return ae.pre_evict(cache, nxt, demand, p_next, protected)

        return hook

    def _budget_topk(self, b: MoEBlock, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Budget-aware dynamic top-k (ActiveEvict eq. 18–21) for offloaded layer ``b``."""
        cache, layer = self.cache, b.index
        kmax = min(self.k_max or b.top_k, b.num_experts)
        with torch.no_grad():
            _, w_max, ids_max = b.route(hidden_states, top_k=kmax)
            # rank by the router's weights (monotone in its probabilities for every supported
            # router, including DeepSeek's unsorted top-k)
            order = torch.argsort(w_max.float(), dim=-1, descending=True, stable=True)
            ranked = torch.gather(ids_max, -1, order).cpu().numpy()
        if self._mask_np is not None:  # the real tokens decide
            ranked = ranked[self._mask_np]
        k = budget_topk(ranked, lambda e: (layer, e) in cache, cache.free_slots())
        if k == top_k_index.shape[-1]:
            return top_k_index, top_k_weights
        if k == kmax:
            return ids_max, w_max
        with torch.no_grad():
            _, w, ids = b.route(hidden_states, top_k=k)
        return ids, w
