"""The measured clock, and the modeled clock's sizes of a loaded model.

*Measured*: wall time of what really ran here (``perf_counter``), per lane: compute (the main
thread working), transfer (the copy engine busy), stall (compute waiting for a transfer), host
(hybrid mode: an expert run on the host copy).

*Modeled*: the discrete-event timeline of :mod:`workbench.sim.step` (the core live runs and
replay share), priced by :class:`workbench.sim.costs.Prices`; :func:`layout_cost_spec` gives it
the sizes of the loaded model when no target model is named.
"""

from __future__ import annotations

from workbench.models.adapter import MoELayout
from workbench.sim.costs import CostSpec
from workbench.telemetry.events import CLOCKS, LANES, Span, StepEvent

_MEASURED = CLOCKS.index("measured")
_COMPUTE, _TRANSFER = LANES.index("compute"), LANES.index("transfer")
_STALL = LANES.index("stall")


def layout_cost_spec(layout: MoELayout, dtype_bytes: int) -> CostSpec:
    """Costs of the loaded model itself, at the run's dtype."""
    b = layout.blocks[0]
    params_per_expert = sum(int(getattr(b.experts, p)[0].numel()) for p in b.expert_params)
    backbone_params = layout.backbone_bytes / max(
        getattr(b.experts, b.expert_params[0]).element_size(), 1)
    dense_params_per_layer = backbone_params / layout.num_layers
    router_w = next(p for p in b.router.parameters() if p.dim() == 2)  # [E, hidden]
    return CostSpec(
        source="loaded model",
        expert_bytes=params_per_expert * dtype_bytes,
        expert_flops_per_token=2.0 * params_per_expert,
        dense_bytes_per_layer=dense_params_per_layer * dtype_bytes,
        dense_flops_per_token_per_layer=2.0 * dense_params_per_layer,
        activation_bytes_per_token=float(router_w.shape[-1] * dtype_bytes),
    )


def measured_spans(ev: StepEvent, stalls: list[Span], transfers: list, t0: float, *,
                   spans: bool = True) -> None:
    """Fill the step's measured lanes: compute = the step minus its stalls and host runs;
    transfer = the copy engine's busy intervals (a CPU copy job's transfers each report the
    job's interval: they land together); stall and host (hybrid mode: an expert run on
    the host copy) = as recorded. ``t0`` is the run start (perf_counter). The step's
    ``transfer_bytes`` and ``stall_measured_s`` are summed either way; ``spans`` False
    appends no span (a run without a store: nothing reads them)."""
    ev.stall_measured_s = sum(s.end - s.start for s in stalls if s.lane == _STALL)
    if not spans:
        ev.transfer_bytes += sum(tr.nbytes for tr in transfers)
        return
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
