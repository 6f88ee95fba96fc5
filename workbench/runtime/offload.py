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

:class:`Offloader` is a context manager: on exit every wrapper is removed and every expert tensor
is back in place, whatever happened inside.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from workbench.models.adapter import MoEBlock, MoELayout
from workbench.runtime.expert_cache import ExpertCache
from workbench.runtime.expert_store import HostExpertStore
from workbench.runtime.transfer import Transfer, TransferEngine
from workbench.telemetry.events import LANES, LayerEvent, Span

_STALL = LANES.index("stall")


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
    """

    def __init__(self, layout: MoELayout, num_slots: int, pinned_layers: int, policy,
                 device: torch.device, probe: StepProbe) -> None:
        self.layout = layout
        self.pinned_layers = pinned_layers
        self.probe = probe
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

    def _pinned_forward(self, b: MoEBlock, original: Callable) -> Callable:
        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            ev, experts = self._layer_event(b, top_k_index, top_k_weights)
            ev.hits = experts
            self.cache.hits[b.index] += len(experts)
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
            ev, experts = self._layer_event(b, top_k_index, top_k_weights)
            hits, misses = cache.lookup(layer, experts)
            ev.hits, ev.misses = hits, misses
            fill = cache.fill(layer, experts, misses)
            inflight: list[tuple[int, Transfer]] = []

            def issue() -> None:
                for e, slot, evicted in fill.issue():
                    if evicted is not None:
                        ev.evicted.append(evicted)
                    assert self.engine is not None
                    tr = self.engine.submit((layer, e), slot, cache.slot_view(slot),
                                            self.store.expert(layer, e))
                    inflight.append((e, tr))

            issue()
            out = None
            if hits:
                out = run_group(hidden_states, top_k_index, top_k_weights,
                                {e: cache.slot_of[(layer, e)] for e in hits})
                fill.done(hits)
                issue()
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

    def _span(self, lane: int, layer: int, expert: int, t_start: float) -> None:
        t_end = time.perf_counter()
        self.probe.stalls.append(Span(
            clock=0, lane=lane, step=self.probe.step, layer=layer, expert=expert,
            start=t_start - self.probe.t0, end=t_end - self.probe.t0))
