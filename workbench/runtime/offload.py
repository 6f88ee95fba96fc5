"""Install expert offloading into a live ``transformers`` model, and take it out again.

For each MoE block found by the adapter:

- **pinned** layers (the first ``pinned_layers``) keep their fused expert tensors resident; their
  experts module only gets a recording wrapper.
- **offloaded** layers hand their fused expert tensors to the host store; the device keeps
  only the shared slot pool (:class:`~workbench.runtime.slots.SlotPool`). Each computation runs
  the model's *own* experts forward over the slots it needs, gathered into a compact tensor
  (:class:`~workbench.runtime.slots.ExpertsView`), so its cost follows the experts the layer
  routed to, not the size of the cache.

Every MoE block has **one interception point** (:meth:`Offloader._layer`). It names no
mechanism: it runs the hooks of the run's layer stages (:mod:`workbench.runtime.stages`, one
module per mechanism family, in the order of :data:`~workbench.runtime.stages.STAGES`) in
phases — route (dynamic top-k, on the router's raw output) → mask padding → route (dispatch) →
the layer event → observe (router lookahead, ActiveEvict hotness, ReaLB's decision) → price
(sub-experts) → access (prefetch candidates, pre-eviction, hybrid picks) →
:meth:`workbench.sim.step.Simulator.step`, the torch-free core that decides hits, misses,
admissions, prefetches, evictions and host runs and prices them on the modeled clock → the
execution of its typed schedule on real tensors (:mod:`workbench.runtime.executor`) → finish.
Trace replay calls the same core, so live runs and replay cannot drift apart.

Order of work in an offloaded layer (VisMMOE §3.4: a miss blocks only on that expert), as
the core schedules it: look up all routed experts → submit transfers for misses into
free/evictable slots → compute the hits while transfers run → for each miss in submission order
wait for it (a *stall*), compute it, and let its slot be reused. The output is the sum of the
group outputs, which equals the plain model's output up to floating-point summation order.

:class:`Offloader` is a context manager: on exit every wrapper is removed and every expert tensor
is back in place, whatever happened inside.
"""


from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from workbench.models.adapter import MoEBlock, MoELayout
from workbench.models.hooks import Hooks
from workbench.policies.active_evict import ActiveEvict
from workbench.runtime.executor import ComputeCall, Executor, StepProbe
from workbench.runtime.expert_store import HostExpertStore
from workbench.runtime.slots import ExpertsView, SlotPool
from workbench.runtime.stages import (HOOKS, ROUTER_LOGITS, STAGES, LayerCall, Stage,
                                      StageSetup, hooked)
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
        balance, rank_of_expert, low_precision: ReaLB's controller (None: off), the EP rank of
            each expert and the precision of the ranks it picks.
        low_down_input: whether those experts' down projection takes its input quantised
            (``quantised``: W4A4, the paper's) or not (``native``: W4A16 there).
        prism, prism_offload: MoE-Prism's :class:`~workbench.prism.execute.PrismSetup` (None:
            off) and whether the cache's keys are sub-experts.
        macs_centroids: MACS's calibrated centroids μ [L, E, D] on the device (None: η acts
            as 0).
        cache_routing: cache-aware routing's strength λ (Cache-Prior; None: off).
        stages: the run's layer stages, built already (a session builds them from its knobs:
            :func:`workbench.runtime.stages.from_knobs`); None: built from the arguments above.
        transfer_order: the modeled transfer lane's order, ``fifo`` or ``demand-first``
            (:mod:`workbench.sim.lane`; the core decides, the executor runs its schedule).
        offload_unit: ``expert`` (the per-expert cache), ``layerwise`` or
            ``layerwise-prefetch`` (whole layers copied in, :mod:`workbench.sim.unit`).

    Each feature is a layer stage (:mod:`workbench.runtime.stages`).
    """

    def __init__(self, layout: MoELayout, num_slots: int, pinned_layers: int, policy,
                 device: torch.device, probe: StepProbe, prices: Prices | None = None, *,
                 lookahead_depth: int = 0, active_evict: ActiveEvict | None = None,
                 dynamic_topk: bool = False, k_max: int | None = None, prefetch=None,
                 prefetch_lead: int = 1, prefetch_budget: int | None = None, pruning=None,
                 hybrid: bool | Callable[[int], bool] = False, dispatch=None,
                 balance=None, rank_of_expert: np.ndarray | None = None,
                 low_precision: str = "nvfp4", prism=None, prism_offload: bool = False,
                 macs_centroids: torch.Tensor | None = None,
                 cache_routing: float | None = None, stages: list[Stage] | None = None,
                 transfer_order: str = "fifo", low_down_input: str = "quantised",
                 offload_unit: str = "expert") -> None:
        self.layout = layout
        # no prices given: hit counts only, every modeled time 0
        self.prices = prices if prices is not None else Prices(get_profile("a100-40gb"), None)
        self._use_stages(stages if stages is not None else build_stages(StageSetup(
            layout, pinned_layers, self.prices, torch.device(device), lookahead_depth,
            active_evict, dynamic_topk, k_max, prefetch, prefetch_lead, prefetch_budget,
            pruning, hybrid, dispatch, balance, rank_of_expert, low_precision, prism,
            prism_offload, macs_centroids, cache_routing, low_down_input)))
        self.pinned_layers = pinned_layers
        self.probe = probe
        #: prefetched experts evicted before any access used them (the core's ``redundant``)
        self.redundant_prefetches = 0
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
        self.transfer_order, self.offload_unit = transfer_order, offload_unit
        self._use_cache(num_slots, policy)
        self.executor = Executor(self.slots, self.store, probe, part=self.part,
                                 low_precision=low_precision,
                                 prism=bool(self._hooked["runner"]))
        self._saved: list[tuple[MoEBlock, dict]] = []
        self._hooks = Hooks()  # each experts module's forward override
        #: per MoE layer, the last call of its router module: (its input, its logits), kept by
        #: a forward hook when a stage needs :data:`ROUTER_LOGITS` and taken by the layer call
        #: that follows it
        self._router_out: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        #: the routers' forward hooks keeping their logits: on in the steps whose stages need
        #: :data:`ROUTER_LOGITS` (:meth:`begin_step`; from install until then: whenever a stage
        #: may). A module hook costs every router call ≈ 4 µs of PyTorch's slow call path,
        #: read or not
        self._router_hooks = Hooks()
        #: what the stages need in the step in progress (:meth:`begin_step`; :attr:`needs`
        #: until the first)
        self.step_needs: frozenset[str] = self.needs

    def _use_stages(self, stages: list) -> None:
        """The run's stages, and what the layer call takes from them once."""
        self.stages = stages
        self._hooked = {h: hooked(stages, h) for h in HOOKS}
        self._before_mask = [s for s in self._hooked["route"] if s.before_mask]
        self._after_mask = [s for s in self._hooked["route"] if not s.before_mask]
        self._routes_nowhere = any(s.routes_nowhere for s in stages)
        #: what the stages need of the runtime (:data:`~workbench.runtime.stages.TOKEN_CONTEXT`,
        #: :data:`~workbench.runtime.stages.ROUTER_LOGITS`)
        self.needs: frozenset[str] = frozenset().union(*(s.needs for s in stages))
        #: the cache's keys are 1/part of an expert (a stage that splits experts: sub-expert
        #: e·part + s, slots of 1/part, only the ones run fetched)
        self._split = next((st for st in stages if st.part > 1), None)
        self.part = self._split.part if self._split is not None else 1

    def _use_cache(self, num_slots: int, policy) -> None:
        """The core (one cache of the offloaded layers' keys), the host store and the slots.
        ``num_slots`` is memory in expert-sized slots: part × as many slots of 1/part."""
        layout, part = self.layout, self.part
        first = layout.blocks[0]
        dtype = getattr(first.experts, first.expert_params[0]).dtype
        n_offloaded = sum(b.num_experts for b in self.offloaded) * part
        self.num_slots = min(num_slots * part, n_offloaded) if self.offloaded else 0
        self.sim = Simulator(
            Placement.single_device(layout.num_layers, layout.num_experts * part,
                                    layout.top_k * part, self.pinned_layers,
                                    max(self.num_slots, 1)),
            lambda: policy, transfer_s=self.prices.part(part).transfer, record_spans=True,
            transfer_order=self.transfer_order, offload_unit=self.offload_unit)
        self.store = HostExpertStore(pin_memory=self.device.type == "cuda")
        shapes = first.expert_shapes if self.offloaded else {}
        if self._split is not None:  # one key's block
            shapes = self._split.slot_shapes(shapes)
        self.slots = SlotPool(self.num_slots, shapes, dtype, self.device)

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
        out["cancelled_prefetches"] = int(self.sim.counters()["cancelled"].sum())
        out["low_precision_runs"] = self.executor.low_precision_runs
        return out

    def store_dims(self) -> dict[str, int]:
        """The run store's dimensions the stages record along (``ep_ranks``, ``subexperts``)."""
        out: dict[str, int] = {}
        for st in self.stages:
            out.update(st.store_dims())
        return out

    def max_k(self, top_k: int) -> int:
        """The widest routing a token may get of a layer whose router picks ``top_k``: the
        stages may add assignments (the store's k dimension holds them)."""
        return top_k + sum(st.max_added(self.layout.num_experts) for st in self.stages)

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
        if ROUTER_LOGITS in self.needs:
            self._router_hooks.post(b.router, self._keep_logits(b.index), with_kwargs=True)

    def keep_spans(self, keep: bool) -> None:
        """Whether the core books its modeled spans (the timelines a store keeps; False: a
        run without a store — the modeled clock, stalls and counters are the same)."""
        self.sim.record_spans = bool(keep)

    def begin_step(self, step: int) -> None:
        """Step ``step`` (0: the prefill) starts: :attr:`step_needs` is what its stages need
        (:meth:`~workbench.runtime.stages.Stage.needs_at`), and the routers keep their logits
        only if that holds :data:`ROUTER_LOGITS`."""
        self.step_needs = frozenset().union(*(s.needs_at(step) for s in self.stages))
        want = ROUTER_LOGITS in self.step_needs
        if want == bool(self._router_hooks):
            return
        self._router_out.clear()  # (nothing of another step is read)
        if not want:
            self._router_hooks.remove()
            return
        for b, _ in self._saved:  # the installed layers
            self._router_hooks.post(b.router, self._keep_logits(b.index), with_kwargs=True)

    def _keep_logits(self, index: int) -> Callable:
        """The forward hook on layer ``index``'s router: keeps its input and its logits (the
        first element of its output) for the layer call. Only the model's own call reaches
        it: :meth:`MoEBlock.route` (the stages' extra router runs) calls ``forward``
        directly, which runs no module hook."""
        def post(module, args, kwargs, out):
            x = args[0] if args else kwargs.get("hidden_states")
            self._router_out[index] = (x, out[0])
        return post

    def _logits_of(self, b: MoEBlock, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The logits layer ``b``'s router computed on ``hidden_states`` (the experts' input),
        or None when its last call was not on these very rows (another input, or none): the
        same memory, as many elements, the same width — the router reshapes its input to
        ``[-1, H]`` as the block does for its experts (DeepSeek-V2's gets ``[B, S, H]``)."""
        x, logits = self._router_out.pop(b.index, (None, None))
        if x is None or logits is None:
            return None
        same = (x.data_ptr() == hidden_states.data_ptr() and x.numel() == hidden_states.numel()
                and x.shape[-1] == hidden_states.shape[-1] and x.dtype == hidden_states.dtype
                and x.is_contiguous() and hidden_states.is_contiguous()
                and logits.shape[0] == hidden_states.shape[0])
        return logits if same else None

    def residency(self) -> np.ndarray:
        """bool [L, E]: experts resident now (pinned layers entirely); with sub-expert
        offloading, an expert any of whose sub-experts is."""
        r = self.sim.residency()
        if self.part > 1:
            r = r.reshape(r.shape[0], -1, self.part).any(-1)
        return r

    def _remove(self) -> None:
        self._hooks.remove()  # the model's own experts forwards first, then their tensors
        self._router_hooks.remove()
        self._router_out.clear()
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
        """One MoE layer call; each phase runs every stage's hook in :data:`STAGES` order and
        reads what the previous phases produced: route (raw) → mask → route → layer event →
        observe → price → access → the core's step → its schedule → finish."""
        mask = self.token_mask
        if mask is not None and mask.shape[0] != top_k_index.shape[0]:
            raise RuntimeError(f"MoE layer {b.index} got {top_k_index.shape[0]} tokens, the "
                               f"step's token mask {mask.shape[0]}")
        call = LayerCall(b, hidden_states, top_k_index, top_k_weights, self.probe.step,
                         b.index < self.pinned_layers, mask, self._mask_np, self._step_modality,
                         self._step_request, self.cache, self.part,
                         self._logits_of(b, hidden_states) if self._router_out else None)
        for st in self._before_mask:
            st.route(call)
        if mask is not None:  # padding and finished requests: routed nowhere
            call.ids = call.ids.masked_fill(~mask[:, None], b.num_experts)
            call.weights = call.weights.masked_fill(~mask[:, None], 0)
        for st in self._after_mask:
            st.route(call)
        # the id E is in the routing only where masking or a stage replaced the model's
        # tensor (none writes into it): a decode step a dispatch left alone has none
        sentinels = self._sentinels and call.ids is not top_k_index
        ev, routed = self._observe(call, sentinels)
        out = self.sim.step(self._access(call))
        self._note_outcome(ev, call.keys, out)
        result = self.executor.execute(ComputeCall(
            b, original, view, hidden_states, call.ids, call.weights, args, kwargs, ev,
            routed, call.low, sentinels, call.low_down_input), out)
        for st in self._hooked["finish"]:
            st.finish(call)
        return result

    def _observe(self, call: LayerCall, sentinels: bool = True
                 ) -> tuple[LayerEvent, torch.Tensor]:
        """The layer event of ``call``'s routing (``sentinels``: whether it may hold the
        routed-nowhere id E), then the stages' observe hooks; returns the event and the
        distinct routed experts (ascending, a tensor)."""
        ev, experts, routed = self._layer_event(call.block, call.ids, call.weights, sentinels)
        ev.dropped_ids, ev.rerouted_ids = call.dropped, call.rerouted
        ev.token_weights = call.token_weights
        call.event, call.experts = ev, experts
        call.real_ids = ev.topk_ids if call.real is None else ev.topk_ids[call.real]
        for st in self._hooked["observe"]:
            st.observe(call)
        return ev, routed

    def _access(self, call: LayerCall) -> Access:
        """What the cache looks up and its modeled prices (the stages' price hooks; by default
        each expert in its precision), then the stages' additions (access hooks)."""
        p, experts = self.prices, call.experts
        call.keys, call.key_ids = experts, call.real_ids
        call.tokens = [call.event.expert_tokens[e] for e in experts]
        for st in self._hooked["price"]:
            st.price(call)
        compute_s = call.compute_s
        if compute_s is None:
            low_price = p.expert_in(call.low_precision) if call.low else p.expert
            compute_s = [(low_price if e in call.low else p.expert)(n)
                         for e, n in zip(experts, call.tokens)]
        call.event.low_precision = sorted(call.low)
        acc = Access(step=call.step, layer=call.block.index, experts=call.keys,
                     compute_s=compute_s, dense_s=p.dense(int(call.real_ids.shape[0])))
        for st in self._hooked["access"]:
            st.access(call, acc)
        return acc

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
        # (tuple.__new__: a Span without its Python-level __new__, ≈ 2× faster per span)
        step, make = probe.step, tuple.__new__
        probe.modeled.extend(make(Span, (_MODELED, lane, step, layer, expert, start, end))
                             for lane, layer, expert, start, end in out.spans)

    # -- features before the step -------------------------------------------------------------
    def _layer_event(self, b: MoEBlock, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     sentinels: bool = True) -> tuple[LayerEvent, list[int], torch.Tensor]:
        """The layer's event and its distinct routed experts (ascending; list and tensor).
        An assignment the dispatch dropped (id E) is recorded as -1 and routes nowhere
        (looked for when ``sentinels`` and the run may have such ids)."""
        ids = top_k_index.detach().to("cpu")
        recorded = ids.numpy().astype(np.int32)
        if sentinels and self._sentinels:
            gone = recorded >= b.num_experts
            recorded[gone] = -1
            valid = recorded[~gone]
        else:
            valid = recorded.reshape(-1)
        if valid.size and valid.min() < 0:  # not an expert id: counted as torch counts it
            found, n = torch.unique(torch.from_numpy(valid), return_counts=True)
            experts, counts = found.numpy(), n.numpy()
        else:  # one bincount, where torch.unique sorts
            per = np.bincount(valid, minlength=b.num_experts)
            experts = np.flatnonzero(per)
            counts = per[experts]
        ev = LayerEvent(layer=b.index, pinned=b.index < self.pinned_layers,
                        topk_ids=recorded,
                        topk_weights=top_k_weights.detach().float().to("cpu").numpy(),
                        expert_tokens=dict(zip(experts.tolist(), counts.tolist())))
        self.probe.layers.append(ev)
        return ev, experts.tolist(), torch.from_numpy(experts).to(ids.dtype)
