"""EP replay: expert-parallel load of any trace, without a model.

``ep_replay(trace, knobs)`` streams the trace in chunks of steps (as the cache replay does),
attributes every routed (token, expert) of each (step, layer) group to the rank owning the
expert under ``placement``, and sums the figures of :class:`workbench.sim.ep.EPSummary`: over
all tokens, and per modality when the trace has more than one. With a cost model it also
sums the modeled EP layer times (dispatch / compute / combine, MACS Fig. 3), with the cost
model's hidden-state bytes (the target model's, or a run store's own).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from workbench.sim.ep import EPSummary, layer_times, rank_compute_s, rank_load
from workbench.sim.placement import rank_of_expert
from workbench.sim.profiles import get_interconnect
from workbench.sim.costs import Prices
from workbench.telemetry.events import MODALITIES
from workbench.traces.trace import Trace

#: accesses per chunk (about): bounds the working set whatever the trace's length
CHUNK_ACCESSES = 1 << 20


def _modality_view(trace: Trace, code: int) -> Trace:
    """``trace`` (a chunk of one: :meth:`Trace.step_slice`) with the routing of tokens of
    other modalities removed (-1): their loads are that modality's alone. One int16 copy of
    the chunk's routing."""
    ids = np.where((np.asarray(trace.token_modality) == code)[:, None, None],
                   trace.topk_ids, np.int16(-1))
    out = trace.step_slice(0, trace.num_steps)
    out.topk_ids = ids
    return out


def ep_replay(trace: Trace, knobs: Any, prices: Any = None) -> dict[str, Any]:
    """EP figures of ``trace`` under ``knobs`` (``ep_ranks``, ``placement``, ``interconnect``,
    ``target_model``); ``prices``: the replay's :class:`~workbench.sim.costs.Prices` (None or
    unavailable: loads only). Returns :meth:`EPSummary.result` with ``by_modality`` added
    when the trace holds more than one modality."""
    R, E = int(knobs.ep_ranks), trace.num_experts
    owner = rank_of_expert(knobs.placement, E, R)
    link = get_interconnect(knobs.interconnect)
    priced = prices is not None and prices.available
    # a token's hidden state on the wire: the cost spec's (the target model's, or the
    # recorded run's own; 0 in stores older than it: then no communication is priced)
    hidden = float(prices.cost.activation_bytes_per_token) if priced else 0.0

    def summarize(modality: int | None = None) -> dict[str, Any]:
        summary = EPSummary(R, knobs.placement)
        # chunks of about CHUNK_ACCESSES (group, rank) cells: the per-chunk loads are
        # groups × ranks (a million one-access groups on 4096 ranks would be 32 GiB); a
        # modality's routing is masked chunk by chunk (no copy of the whole trace)
        for s0, s1 in trace.step_chunks(max(CHUNK_ACCESSES // R, 1)):
            sub = trace.step_slice(s0, s1)
            g = (sub if modality is None else _modality_view(sub, modality)).groups()
            load = rank_load(g.ptr, g.expert, g.expert_tokens, owner, R)
            compute = None
            if priced:
                comp = Prices.many(prices.expert, g.expert_tokens)
                compute = rank_compute_s(g.ptr, g.expert, comp, owner, R)
            summary.add(load, layer_times(load, compute, hidden, link if hidden else None))
        return summary.result()

    out = summarize()
    out["interconnect"] = knobs.interconnect
    codes = np.unique(np.asarray(trace.token_modality)) if trace.num_tokens else []
    if len(codes) > 1:
        out["by_modality"] = {MODALITIES[int(c)]: summarize(int(c)) for c in codes}
    return out
