"""The execution of the core's schedule on real tensors, and the measured probe of a step.

:meth:`workbench.sim.step.Simulator.step` decides what one MoE layer call does (hits, loads,
prefetches, pre-evictions, host runs, misses) and returns its schedule as typed records
(:mod:`workbench.sim.schedule`). :class:`Executor` runs them in order:

- :class:`~workbench.sim.schedule.Load` / :class:`~workbench.sim.schedule.Prefetch` submit a
  copy from the host store into a slot (:class:`~workbench.runtime.transfer.TransferEngine`);
  the victim's prefetch still in flight is forgotten (its slot is being reused);
- :class:`~workbench.sim.schedule.PreEvicted` / :class:`~workbench.sim.schedule.Cancelled`
  forget the key's copy in flight (its slot is free again; the modeled lane never started a
  cancelled prefetch, the live copy may have run: the slot's next copy overwrites it);
- :class:`~workbench.sim.schedule.Hits` compute the hits over their slots (a prefetched one
  waits for its copy first) — or, in a pinned layer, the model's own experts forward;
- :class:`~workbench.sim.schedule.HostRun` computes one miss on the host;
- :class:`~workbench.sim.schedule.Miss` waits for that miss's copy (a *stall*, measured) and
  computes it, together with the next misses whose copies have already landed;
- :class:`~workbench.sim.schedule.LayerUnit` (a layer-wise ``offload_unit``) waits for every
  copy of the layer and computes its routed experts at once; :class:`~workbench.sim.schedule.Freed`
  forgets a key of the unit (its slot is free again).

The layer output is the sum of the parts, equal to the plain model's up to floating-point
summation order. Measured times are ``time.perf_counter`` seconds, spans relative to the run
start (:attr:`StepProbe.t0`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from workbench.models.adapter import MoEBlock
from workbench.runtime.expert_store import HostExpertStore
from workbench.runtime.slots import SlotPool
from workbench.runtime.transfer import Transfer, TransferEngine
from workbench.sim.cache import Key
from workbench.sim.schedule import (Cancelled, Freed, Hits, HostRun, LayerUnit, Load, Miss,
                                    PreEvicted, Prefetch)
from workbench.sim.step import Outcome
from workbench.telemetry.events import LANES, LayerEvent, Span

STALL_LANE, HOST_LANE = LANES.index("stall"), LANES.index("host")


class StepProbe:
    """What the step in progress produced: its layer events, measured stall/host spans and
    the modeled clock's spans and totals."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0  # run start (perf_counter)
        self.step = -1
        self.begin(-1)

    def begin(self, step: int, modeled_now: float = 0.0) -> None:
        self.step = step
        self.layers: list[LayerEvent] = []
        self.stalls: list[Span] = []
        self.modeled: list[Span] = []
        self.modeled_start = modeled_now  # the compute lane when the step began
        self.stall_modeled_s = 0.0
        self.moved = 0  # experts copied (modeled: every load and prefetch)


@dataclass(slots=True)
class ComputeCall:
    """One MoE layer call as the executor runs it: the block, the model's own experts forward
    (``original``), the view that runs it over other weights, the call's (rewritten) routing
    and passthrough arguments, its event, its distinct routed experts (ascending, a tensor),
    the experts that run in low precision, and whether routing may hold the "routed nowhere"
    id E (dispatch drops, masked rows)."""

    block: MoEBlock
    original: Callable
    view: object
    hidden_states: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor
    args: tuple
    kwargs: dict
    event: LayerEvent
    routed: torch.Tensor
    low: set[int]
    sentinels: bool
    low_down_input: str = "quantised"  # the low experts' down_proj input: or 'native'

    def run(self, weights: dict[str, torch.Tensor], experts, **extra) -> torch.Tensor:
        """``experts``' share of the layer output over ``weights`` (the view's call)."""
        return self.view(weights, experts, self.block.num_experts, self.hidden_states,
                         self.top_k_index, self.top_k_weights, *self.args, **extra,
                         **self.kwargs)


class Executor:
    """Runs schedules over the slot pool and the host store; owns the transfers in flight.

    ``part`` > 1: the schedule's experts are sub-expert keys (MoE-Prism's sub-expert
    offloading), their slots and host rows sub-expert blocks. ``prism``: the views are
    MoE-Prism's. ``engine`` is set while the offloader is installed (None: nothing offloaded).
    """

    def __init__(self, slots: SlotPool, store: HostExpertStore, probe: StepProbe, *,
                 part: int = 1, low_precision: str = "nvfp4", prism: bool = False) -> None:
        self.slots, self.store, self.probe = slots, store, probe
        self.part, self.low_precision, self.prism = part, low_precision, prism
        self.engine: TransferEngine | None = None
        self.inflight: dict[Key, Transfer] = {}  # prefetched, not yet computed
        #: (layer call, expert) computations run in low precision
        self.low_precision_runs = 0

    def execute(self, call: ComputeCall, out: Outcome) -> torch.Tensor:
        """Run ``out``'s schedule for ``call``; returns the layer output."""
        layer = call.block.index
        result = None
        loading: dict[int, Transfer] = {}  # this layer's misses in flight
        schedule, i = out.schedule, 0
        batches = self.engine is not None and self.engine.batches
        while i < len(schedule):
            action = schedule[i]
            i += 1
            kind = type(action)
            if kind is Load:
                # the run of loads one admission pass issued (the layer's misses that got a
                # slot at once): one submission where the engine makes it one copy job (CPU)
                j = i
                while batches and j < len(schedule) and type(schedule[j]) is Load:
                    j += 1
                if j == i:
                    self.inflight.pop(action.victim, None)
                    loading[action.expert] = self.submit((layer, action.expert), action.slot)
                    continue
                run, i = schedule[i - 1:j], j
                for a in run:
                    self.inflight.pop(a.victim, None)
                loading.update(zip((a.expert for a in run), self.submit_many(layer, run)))
            elif kind is Prefetch:
                self.inflight.pop(action.victim, None)
                self.inflight[action.key] = self.submit(action.key, action.slot)
            elif kind is PreEvicted or kind is Cancelled or kind is Freed:  # slot free again
                self.inflight.pop(action.key, None)
            elif kind is Hits:  # the first computation of the layer
                result = (self.run_pinned(call) if out.pinned
                          else self.run_hits(call, out.hits, action.slots))
            elif kind is HostRun:
                t = time.perf_counter()
                part = self.run_on_host(call, action.expert)
                self.span(HOST_LANE, layer, action.expert, t)
                result = part if result is None else result + part
            elif kind is Miss:
                part, i = self.run_misses(call, schedule, i - 1, loading)
                result = part if result is None else result + part
            elif kind is LayerUnit:
                result = self.run_unit(call, action)
        if result is None:  # no token routed here (empty input)
            result = torch.zeros_like(call.hidden_states)
        return result

    # -- transfers and spans ------------------------------------------------------------------
    def submit(self, key: Key, slot: int) -> Transfer:
        assert self.engine is not None
        return self.engine.submit(key, slot, self.slots.view(slot), self.store.expert(*key))

    def submit_many(self, layer: int, loads: list[Load]) -> list[Transfer]:
        """``loads``' copies (of ``layer``), submitted together
        (:meth:`TransferEngine.submit_many`)."""
        assert self.engine is not None
        return self.engine.submit_many([(layer, a.expert) for a in loads],
                                       [a.slot for a in loads], self.slots.tensors,
                                       self.store.layer(layer), [a.expert for a in loads])

    def wait(self, ev: LayerEvent, layer: int, e: int, tr: Transfer | None) -> None:
        """Wait for ``tr`` (None: nothing to wait for); a wait that blocked is a stall."""
        if tr is None:
            return
        if tr.done:  # landed already (a copy job's others, most misses): nothing blocked —
            # a measured wait would still read a few hundred ns, a stall span per miss
            if tr.error is not None:
                raise tr.error
            return
        t = time.perf_counter()
        waited = tr.wait()
        if waited > 0:
            ev.stall_s += waited
            self.span(STALL_LANE, layer, e, t)

    def span(self, lane: int, layer: int, expert: int, t_start: float) -> None:
        """A measured span from ``t_start`` to now into the probe."""
        t_end = time.perf_counter()
        self.probe.stalls.append(Span(
            clock=0, lane=lane, step=self.probe.step, layer=layer, expert=expert,
            start=t_start - self.probe.t0, end=t_end - self.probe.t0))

    # -- the computations -----------------------------------------------------------------------
    def run_hits(self, c: ComputeCall, hits: list[int], slots: list[int]
                 ) -> torch.Tensor | None:
        """The hits' share (None: no hits); a prefetched hit computes once its copy landed."""
        layer = c.block.index
        for e in hits:
            self.wait(c.event, layer, e, self.inflight.pop((layer, e), None))
        if not hits:
            return None
        # every routed expert a hit: no token needs masking
        every = c.routed if len(hits) == len(c.routed) and self.part == 1 else None
        return self.run_slots(c, hits, slots, every)

    def run_unit(self, c: ComputeCall, unit: LayerUnit) -> torch.Tensor | None:
        """A layer-wise unit: wait for every copy of the layer (the unit waits for all of its
        experts, routed or not), then its routed experts over their slots, at once."""
        layer = c.block.index
        for key in [k for k in self.inflight if k[0] == layer]:
            self.wait(c.event, layer, key[1], self.inflight.pop(key))
        if not unit.experts:
            return None
        # every routed expert in the unit's call (a global K may leave some idle: not then)
        every = (c.routed if self.part == 1 and len(unit.experts) == len(c.routed)
                 else None)
        return self.run_slots(c, list(unit.experts), list(unit.slots), every)

    def run_misses(self, c: ComputeCall, schedule: list, i: int, loading: dict[int, Transfer]
                   ) -> tuple[torch.Tensor, int]:
        """The miss at ``schedule[i]`` once its copy landed, with the next misses whose copies
        have already landed (nothing waits for them, so no miss blocks on another's
        transfer); returns their share and the index of the next action."""
        layer = c.block.index
        e = schedule[i].expert
        tr = loading.pop(e)
        self.wait(c.event, layer, e, tr)
        batch, slots = [e], [tr.slot]
        i += 1
        while i < len(schedule) and type(schedule[i]) is Miss \
                and loading[schedule[i].expert].done:
            nxt = loading.pop(schedule[i].expert)
            self.wait(c.event, layer, schedule[i].expert, nxt)  # collects a copy error
            batch.append(schedule[i].expert)
            slots.append(nxt.slot)
            i += 1
        return self.run_slots(c, batch, slots), i

    def run_pinned(self, c: ComputeCall) -> torch.Tensor:
        """A pinned layer: every routed expert over its resident weights — the model's own
        forward, the low-precision experts apart; MoE-Prism's sub-experts as slices."""
        b, view = c.block, c.view
        if self.prism and not view.whole:
            if not c.low and view.kernel == "fused" and not c.args and not c.kwargs:
                # the fused product over the resident tensors in place: every expert one
                # group, the unrouted ones empty — no copy of the routed experts' weights
                E = b.num_experts
                return c.run({n: getattr(b.experts, n) for n in b.expert_params}, range(E),
                             all_routed=torch.arange(E, device=c.top_k_index.device))
            ids = c.routed.tolist()  # the routed experts' resident weights, as slices
            at = c.routed.long()
            own = {n: getattr(b.experts, n)[at] for n in b.expert_params}
            if c.low:  # ReaLB: those experts' sub-experts in low precision
                return self.run_split(c, ids, own)
            return c.run(own, ids, all_routed=c.routed)
        idx, w = c.top_k_index, c.top_k_weights
        low = sorted(c.low)
        if low:  # those experts run below, in low precision
            mine = torch.isin(idx, torch.as_tensor(low, device=idx.device))
            idx = idx.masked_fill(mine, b.num_experts)
        if c.sentinels or low:  # the model's own forward: no sentinel ids
            gone = idx >= b.num_experts
            idx, w = idx.masked_fill(gone, 0), w.masked_fill(gone, 0)
        result = c.original(c.hidden_states, idx, w, *c.args, **c.kwargs)
        if self.prism:  # the shortcut: every routed slot ran all
            view.record_all()
        if low:
            own = {n: getattr(b.experts, n)[low] for n in b.expert_params}
            result = result + self.run_low(c, low, own)
        return result

    def run_slots(self, c: ComputeCall, experts: list[int], slots: list[int],
                  all_routed: torch.Tensor | None = None) -> torch.Tensor:
        """``experts``' share of the layer output, over their ``slots`` gathered compactly —
        sub-expert blocks placed in whole experts straight from the pool instead
        (:meth:`~workbench.prism.execute.PrismView.run_blocks`) — (``all_routed``: see
        :meth:`ExpertsView.__call__`); the ones in low precision this call run apart
        (:meth:`run_low`)."""
        if self.part > 1:  # ``experts`` are sub-experts, their slots sub-expert blocks,
            # placed in whole experts straight from the pool (no compact copy first)
            return c.view.run_blocks(self.slots.tensors, experts, c.block.num_experts,
                                     c.hidden_states, c.top_k_index, c.top_k_weights,
                                     *c.args, rows=slots, **c.kwargs)
        weights = self.slots.gather(slots)
        if not any(e in c.low for e in experts):
            return c.run(weights, experts, all_routed=all_routed)
        return self.run_split(c, experts, weights)

    def run_split(self, c: ComputeCall, experts: list[int], weights: dict[str, torch.Tensor]
                  ) -> torch.Tensor:
        """``experts``' share of the layer output (``weights`` theirs), those in low precision
        this call apart (:meth:`run_low`), the others natively."""
        low = [i for i, e in enumerate(experts) if e in c.low]
        nat = [i for i in range(len(experts)) if i not in set(low)]
        out = self.run_low(c, [experts[i] for i in low],
                           {n: t[low] for n, t in weights.items()})
        if nat:
            out = out + c.run({n: t[nat] for n, t in weights.items()},
                              [experts[i] for i in nat])
        return out

    def run_low(self, c: ComputeCall, experts: list[int], weights: dict[str, torch.Tensor]
                ) -> torch.Tensor:
        """``experts``' share in ``low_precision``: each expert's weight tensors and the
        layer's input quantised → dequantised (W4A4 for NVFP4, W8A8 for FP8), then the model's
        own experts forward. With ``c.low_down_input`` 'quantised' the down projection's input
        is quantised too, inside that forward (:func:`workbench.precision.quantises_input`:
        every GEMM the ``down_proj`` weight enters quantises its activation operand, grouped
        along the contraction axis, one global scale per GEMM call); 'native' leaves it in the
        model's dtype (W4A16 there)."""
        from workbench.precision import fake_quant, quantises_input

        p = self.low_precision
        if self.prism and not getattr(c.view, "whole", True):
            # sub-expert layout: quantised in the model's own (block groups of its matrices)
            q = c.view.fake_quant(weights, experts, p)
        else:
            q = {n: torch.stack([fake_quant(t[i], p) for i in range(t.shape[0])])
                 for n, t in weights.items()}
        if c.low_down_input == "quantised":
            q["down_proj"] = quantises_input(q["down_proj"], p)
        self.low_precision_runs += len(experts)
        return c.view(q, experts, c.block.num_experts, fake_quant(c.hidden_states, p),
                      c.top_k_index, c.top_k_weights, *c.args, **c.kwargs)

    def run_on_host(self, c: ComputeCall, expert: int) -> torch.Tensor:
        """Expert ``expert``'s share of the layer output, computed by the model's own experts
        forward on the host over the host store's copy (a one-expert view, no copy of the
        weights); with sub-expert offloading ``expert`` is a sub-expert key, its host rows a
        sub-expert block."""
        cpu = torch.device("cpu")
        b = c.block
        host = self.store.layer(b.index)
        rows = {n: host[n][expert:expert + 1] for n in b.expert_params}
        run = c.view.run_subexperts if self.part > 1 else c.view
        out = run(rows, [expert], b.num_experts, c.hidden_states.to(cpu),
                  c.top_k_index.to(cpu), c.top_k_weights.to(cpu), *c.args, **c.kwargs)
        return out.to(c.hidden_states.device)
