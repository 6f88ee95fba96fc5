"""EP replay: expert-parallel load of any trace, without a model.

``ep_replay(trace, knobs)`` streams the trace in chunks of steps (as the cache replay does),
attributes every routed (token, expert) of each (step, layer) group to the rank owning the
expert under ``placement``, and sums the figures of :class:`workbench.sim.ep.EPSummary`: over
all tokens, and per modality when the trace has more than one. With a cost model it also
sums the modeled EP layer times (dispatch / compute / combine, MACS Fig. 3), with the cost
model's hidden-state bytes (the target model's, or a run store's own).

``placement`` = ``eplb``: the loads follow EPLB's plans (:class:`EPLBSchedule`: refitted every
``eplb_interval`` steps on the last ``eplb_window`` steps of this very replay, never on what it
then serves), each replica serving its share of its expert's tokens; the result adds
``eplb`` (rebalances, bytes moved, their modeled seconds — the rebalance lane). A modality's
figures are its tokens under the plans the whole traffic made.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from workbench.sim.ep import EPSummary, layer_times, rank_compute_s, rank_load
from workbench.sim.placement import EP_PLACEMENT, rank_of_expert
from workbench.sim.profiles import get_interconnect
from workbench.sim.costs import Prices
from workbench.telemetry.events import MODALITIES
from workbench.traces.trace import Trace

#: accesses per chunk (about): bounds the working set whatever the trace's length
CHUNK_ACCESSES = 1 << 20

#: the run store's arrays a trace for :func:`ep_replay` is made of: the routing, its steps
#: and modality (what it reads), ``kept`` (token compression: read by the trace's groups for
#: their token counts, not by the EP figures), ``phase`` and ``pinned`` (the steps and
#: layers). ``open_run(path, variables=EP_ARRAYS).moe.ep_summary()`` equals the whole
#: store's (tested on runs with images, token compression and sub-experts) and reads about
#: half of ``TRACE_ARRAYS`` — what ``workbench run --set ep_ranks=R`` opens for its summary.
#: The arrays left out are neither read nor checked: a store whose predictions or weights
#: are damaged, or over the trace memory budget, still gives its EP summary
EP_ARRAYS = ("topk_ids", "token_step", "token_modality", "kept", "phase", "pinned")


def _modality_view(trace: Trace, code: int) -> Trace:
    """``trace`` (a chunk of one: :meth:`Trace.step_slice`) with the routing of tokens of
    other modalities removed (-1): their loads are that modality's alone. One int16 copy of
    the chunk's routing."""
    ids = np.where((np.asarray(trace.token_modality) == code)[:, None, None],
                   trace.topk_ids, np.int16(-1))
    out = trace.step_slice(0, trace.num_steps)
    out.topk_ids = ids
    return out


def _eplb_groups(sched: Any, g: Any, s0: int, steps: int, L: int, E: int, fit: bool):
    """The per-rank loads and compute ``[groups, R]`` of a chunk's groups under EPLB: the
    chunk's per-(step, layer, expert) counts served by ``sched`` (``fit``: the whole traffic,
    which advances and refits the schedule) or under the plans it already made (a modality's
    share of the same steps)."""
    counts = np.zeros((steps, L, E))
    grp = np.repeat(np.arange(len(g.step)), np.diff(g.ptr))
    np.add.at(counts, (np.asarray(g.step)[grp], np.asarray(g.layer)[grp],
                       np.asarray(g.expert, np.int64)), g.expert_tokens)
    if fit:
        load, compute = sched.serve(counts)
    else:
        load = sched.served_under_plans(counts, s0)
        compute = None
        if sched.price is not None:  # priced under the plan in force at each step
            compute = np.concatenate([sched._priced(counts[i:i + 1], sched.share_at(s0 + i))
                                      for i in range(steps)]) if steps else np.zeros(
                (0, L, sched.R))
    st, ly = np.asarray(g.step), np.asarray(g.layer)
    return load[st, ly], (compute[st, ly] if compute is not None else None)


def ep_replay(trace: Trace, knobs: Any, prices: Any = None) -> dict[str, Any]:
    """EP figures of ``trace`` under ``knobs`` (``ep_ranks``, ``placement``, ``interconnect``,
    ``target_model``); ``prices``: the replay's :class:`~workbench.sim.costs.Prices` (None or
    unavailable: loads only). Returns :meth:`EPSummary.result` with ``by_modality`` added
    when the trace holds more than one modality."""
    R, E = int(knobs.ep_ranks), trace.num_experts
    owner = rank_of_expert(knobs.placement, E, R)
    dynamic = EP_PLACEMENT.get(knobs.placement).dynamic
    link = get_interconnect(knobs.interconnect)
    priced = prices is not None and prices.available
    # a token's hidden state on the wire: the cost spec's (the target model's, or the
    # recorded run's own; 0 in stores older than it: then no communication is priced)
    hidden = float(prices.cost.activation_bytes_per_token) if priced else 0.0

    sched = None
    if dynamic:
        from workbench.sim.eplb_replay import EPLBSchedule

        sched = EPLBSchedule(trace.num_layers, E, R, int(knobs.num_redundant_experts),
                             int(knobs.eplb_window), int(knobs.eplb_interval),
                             expert_bytes=float(prices.cost.expert_bytes) if priced else 0.0,
                             link=link, price=prices.expert if priced else None)

    def summarize(modality: int | None = None) -> dict[str, Any]:
        summary = EPSummary(R, knobs.placement)
        # chunks of about CHUNK_ACCESSES (group, rank) cells: the per-chunk loads are
        # groups × ranks (a million one-access groups on 4096 ranks would be 32 GiB); a
        # modality's routing is masked chunk by chunk (no copy of the whole trace)
        for s0, s1 in trace.step_chunks(max(CHUNK_ACCESSES // R, 1)):
            sub = trace.step_slice(s0, s1)
            g = (sub if modality is None else _modality_view(sub, modality)).groups()
            if sched is not None:
                load, compute = _eplb_groups(sched, g, s0, s1 - s0, trace.num_layers, E,
                                             modality is None)
                summary.add(load, layer_times(load, compute, hidden, link if hidden else None))
                continue
            load = rank_load(g.ptr, g.expert, g.expert_tokens, owner, R)
            compute = None
            if priced:
                comp = Prices.many(prices.expert, g.expert_tokens)
                compute = rank_compute_s(g.ptr, g.expert, comp, owner, R)
            summary.add(load, layer_times(load, compute, hidden, link if hidden else None))
        return summary.result()

    out = summarize()
    out["interconnect"] = knobs.interconnect
    if sched is not None:
        out["eplb"] = {"rebalances": len(sched.rebalances),
                       "bytes_moved": float(sum(r["bytes"] for r in sched.rebalances)),
                       "rebalance_s_modeled": float(sum(r["seconds"]
                                                        for r in sched.rebalances)),
                       "window": int(knobs.eplb_window), "interval": int(knobs.eplb_interval),
                       "redundant": int(knobs.num_redundant_experts)}
    codes = np.unique(np.asarray(trace.token_modality)) if trace.num_tokens else []
    if len(codes) > 1:
        out["by_modality"] = {MODALITIES[int(c)]: summarize(int(c)) for c in codes}
    return out
