"""The two clocks.

*Measured*: wall time of what really ran here (``perf_counter``), per lane: compute (the main
thread working), transfer (the copy engine busy), stall (compute waiting for a transfer).

*Modeled*: a discrete-event timeline of a compute lane and a transfer lane under a named
:class:`~workbench.runtime.profiles.HardwareProfile`, driven by the same step events. Every figure
it produces is labelled *modeled*. Per MoE layer of a step with T tokens:

1. dense work (attention, router, shared experts): ``compute_time(T_l·dense_flops, dense_bytes)``
   where T_l = the tokens that reach the layer (:func:`layer_tokens`: T, except behind the
   pinned prefix of a prefill with visual-token compression, where pruned tokens are gone);
2. the router's misses are queued on the transfer lane at the end of the dense work (FIFO,
   ``transfer_time(expert_bytes)`` each);
3. resident experts compute first, ``compute_time(n_e·expert_flops, expert_bytes)`` each;
4. each missed expert computes when both the compute lane and its transfer are done; the gap is a
   modeled stall;
5. prefetches issued at the layer are queued behind its misses; a later layer that routes to a
   prefetched expert still in flight stalls until it lands;
6. GPU–CPU hybrid mode (``hybrid``): a miss that :func:`runs_on_host` is not transferred; it
   runs on the host lane (activations over the link and back, the expert on the host copy),
   starting when the layer's dense work ends, and the layer ends when the host lane has
   delivered its outputs (a later finish is a modeled stall).

Steps run back to back on the compute lane.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.models.adapter import MoELayout
from workbench.runtime.profiles import HardwareProfile, TargetModel
from workbench.telemetry.events import CLOCKS, LANES, Span, StepEvent

_MODELED = CLOCKS.index("modeled")
_MEASURED = CLOCKS.index("measured")
_COMPUTE, _TRANSFER, _STALL, _HOST = (LANES.index(x)
                                      for x in ("compute", "transfer", "stall", "host"))


@dataclass(frozen=True)
class CostSpec:
    """Sizes the modeled clock prices work with (bytes; FLOPs per token)."""

    source: str  # "loaded model" or a target model name
    expert_bytes: float
    expert_flops_per_token: float
    dense_bytes_per_layer: float
    dense_flops_per_token_per_layer: float
    # hidden-state bytes of one token (hidden size × dtype bytes): what hybrid mode moves over
    # the link to run an expert on the host and back; 0 in stores written before it existed
    activation_bytes_per_token: float = 0.0

    @classmethod
    def from_layout(cls, layout: MoELayout, dtype_bytes: int) -> "CostSpec":
        """Costs of the loaded model itself, at the run's dtype."""
        b = layout.blocks[0]
        params_per_expert = sum(
            int(getattr(b.experts, p)[0].numel()) for p in b.expert_params)
        backbone_params = layout.backbone_bytes / max(
            getattr(b.experts, b.expert_params[0]).element_size(), 1)
        dense_params_per_layer = backbone_params / layout.num_layers
        router_w = next(p for p in b.router.parameters() if p.dim() == 2)  # [E, hidden]
        return cls(
            source="loaded model",
            expert_bytes=params_per_expert * dtype_bytes,
            expert_flops_per_token=2.0 * params_per_expert,
            dense_bytes_per_layer=dense_params_per_layer * dtype_bytes,
            dense_flops_per_token_per_layer=2.0 * dense_params_per_layer,
            activation_bytes_per_token=float(router_w.shape[-1] * dtype_bytes),
        )

    @classmethod
    def from_target(cls, target: TargetModel) -> "CostSpec":
        """Costs of a real model: each MoE layer of the trace is priced as one of its layers."""
        return cls(
            source=target.name,
            expert_bytes=float(target.expert_bytes),
            expert_flops_per_token=float(target.expert_flops_per_token),
            dense_bytes_per_layer=target.backbone_bytes / target.num_layers,
            dense_flops_per_token_per_layer=float(target.dense_flops_per_token_per_layer),
            activation_bytes_per_token=float(target.hidden_size * 2),  # bf16 hidden states
        )


def layer_tokens(num_tokens: int, kept: np.ndarray | None, topk_ids: np.ndarray) -> int:
    """Tokens of a step of ``num_tokens`` that reach a layer whose routing is ``topk_ids``
    ``[T, k]``: every token that was kept (``kept`` None = all: ``num_tokens``) or that the
    layer routed (a pruned visual token still runs the pinned prefix, where it has routing;
    behind the prefix its routing is all -1). Trace replay counts the same way
    (:meth:`workbench.traces.trace.Trace.groups`)."""
    if kept is None:
        return num_tokens
    kept = np.asarray(kept, bool)
    T = int(topk_ids.shape[0])
    if kept.all() or len(kept) != T:
        return num_tokens
    ids = np.asarray(topk_ids).reshape(T, -1)
    return int((kept | (ids >= 0).any(1)).sum())


def host_expert_time(profile: HardwareProfile, cost: CostSpec, n_tokens: int) -> float:
    """Modeled seconds to run one routed expert for ``n_tokens`` on the host copy (GPU–CPU
    hybrid mode): the tokens' hidden states cross the link to the host and the outputs come
    back (two transfers), and the host computes the expert over its weights in host memory."""
    act = n_tokens * cost.activation_bytes_per_token
    return 2 * profile.transfer_time(act) + profile.host_compute_time(
        n_tokens * cost.expert_flops_per_token, cost.expert_bytes)


def runs_on_host(profile: HardwareProfile, cost: CostSpec, n_tokens: int) -> bool:
    """The hybrid rule (seed VisMMOE §3.4 "GPU–CPU hybrid"; the comparison Fiddler makes): a
    missed expert runs on the host when doing so ends sooner than copying it and computing it
    on the device, i.e. ``host_expert_time(n) < transfer_time(expert_bytes) +
    compute_time(n·flops, expert_bytes)``. It depends only on the expert's token count, so the
    live runtime and trace replay decide every miss the same way. Decode (one token) usually
    goes to the host, large prefill groups to the device."""
    device = profile.transfer_time(cost.expert_bytes) + profile.compute_time(
        n_tokens * cost.expert_flops_per_token, cost.expert_bytes)
    return host_expert_time(profile, cost, n_tokens) < device


class ModeledClock:
    """Discrete-event timeline of one run. ``price(step_event)`` fills the step's modeled fields
    and appends its modeled spans; the timeline continues across steps."""

    def __init__(self, profile: HardwareProfile, cost: CostSpec) -> None:
        self.profile = profile
        self.cost = cost
        self.now = 0.0  # compute lane free at
        self.transfer_free = 0.0
        self.host_free = 0.0  # host lane (hybrid mode) free at
        self.prefetch_ready: dict[tuple[int, int], float] = {}  # prefetched, not yet used

    def price(self, ev: StepEvent) -> None:
        p, c = self.profile, self.cost
        n_tokens = len(ev.token_ids)
        step_start = self.now
        stall_total = 0.0
        moved = 0
        spans = ev.spans
        t = self.now
        for le in ev.layers:
            T = layer_tokens(n_tokens, ev.kept, le.topk_ids)
            dense = p.compute_time(T * c.dense_flops_per_token_per_layer, c.dense_bytes_per_layer)
            spans.append(Span(_MODELED, _COMPUTE, ev.step, le.layer, -1, t, t + dense))
            t += dense
            ready: dict[int, float] = {}
            host = set(le.host)
            host_done = t
            for e in le.host:  # hybrid: on the host lane, beside the device's work
                start = max(self.host_free, t)
                end = start + host_expert_time(p, c, le.expert_tokens.get(e, 0))
                spans.append(Span(_MODELED, _HOST, ev.step, le.layer, e, start, end))
                self.host_free = host_done = end
            for e in le.misses:
                if e in host:
                    continue
                start = max(self.transfer_free, t)
                end = start + p.transfer_time(c.expert_bytes)
                spans.append(Span(_MODELED, _TRANSFER, ev.step, le.layer, e, start, end))
                self.transfer_free = end
                ready[e] = end
                moved += int(c.expert_bytes)
                self.prefetch_ready.pop((le.layer, e), None)
            for key in le.prefetched:
                start = max(self.transfer_free, t)
                end = start + p.transfer_time(c.expert_bytes)
                spans.append(Span(_MODELED, _TRANSFER, ev.step, key[0], key[1], start, end))
                self.transfer_free = end
                self.prefetch_ready[key] = end
                moved += int(c.expert_bytes)
            for e in le.hits:  # a prefetched expert may still be in flight
                r = self.prefetch_ready.pop((le.layer, e), None)
                if r is not None:
                    ready[e] = r
            for e in [*le.hits, *le.misses]:
                if e in host:
                    continue
                if e in ready and ready[e] > t:
                    spans.append(Span(_MODELED, _STALL, ev.step, le.layer, e, t, ready[e]))
                    stall_total += ready[e] - t
                    t = ready[e]
                n = le.expert_tokens.get(e, 0)
                d = p.compute_time(n * c.expert_flops_per_token, c.expert_bytes)
                spans.append(Span(_MODELED, _COMPUTE, ev.step, le.layer, e, t, t + d))
                t += d
            if host_done > t:  # the layer's output needs the host's experts too
                spans.append(Span(_MODELED, _STALL, ev.step, le.layer, le.host[-1], t, host_done))
                stall_total += host_done - t
                t = host_done
        self.now = t
        ev.latency_modeled_s = t - step_start
        ev.stall_modeled_s = stall_total
        ev.transfer_bytes_modeled = moved


def measured_spans(ev: StepEvent, stalls: list[Span], transfers: list, t0: float) -> None:
    """Fill the step's measured lanes: compute = the step minus its stalls and host runs;
    transfer = the copy engine's busy intervals; stall and host (hybrid mode: an expert run on
    the host copy) = as recorded. ``t0`` is the run start (perf_counter)."""
    start, end = ev.step_start_s, ev.step_start_s + ev.latency_measured_s
    cursor = start
    for s in sorted(stalls, key=lambda s: s.start):
        if s.start > cursor:
            ev.spans.append(Span(_MEASURED, _COMPUTE, ev.step, -1, -1, cursor, s.start))
        ev.spans.append(s)
        cursor = max(cursor, s.end)
    if end > cursor:
        ev.spans.append(Span(_MEASURED, _COMPUTE, ev.step, -1, -1, cursor, end))
    for tr in transfers:
        layer, expert = tr.key
        ev.spans.append(Span(_MEASURED, _TRANSFER, ev.step, layer, expert,
                             tr.start - t0, tr.end - t0))
        ev.transfer_bytes += tr.nbytes
    ev.stall_measured_s = sum(s.end - s.start for s in stalls if s.lane == _STALL)
