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
from workbench.traces.trace import Trace, routed_per_step

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


class EPReplay:
    """What :func:`ep_replay` holds over a replay: the ranks, the placement's owner of each
    expert, the link, the prices and (``placement`` = eplb) the schedule. :meth:`add` sums
    the loads (and modeled times) of one chunk of steps into an :class:`EPSummary`;
    :meth:`result` makes the figures. Fed the chunks :meth:`Trace.step_chunks` cuts at
    :attr:`chunk_accesses`, in order (the whole traffic before a modality's share with EPLB,
    whose plans the whole traffic makes), it gives :func:`ep_replay`'s figures: :func:`ep_replay` and :class:`EPStream` (a run's, as its
    store is written) are its two drivers."""

    def __init__(self, knobs: Any, num_layers: int, num_experts: int, prices: Any = None
                 ) -> None:
        R, E = int(knobs.ep_ranks), int(num_experts)
        self.knobs, self.R, self.E, self.L = knobs, R, E, int(num_layers)
        self.owner = rank_of_expert(knobs.placement, E, R)
        self.dynamic = EP_PLACEMENT.get(knobs.placement).dynamic
        self.link = get_interconnect(knobs.interconnect)
        self.prices = prices
        self.priced = prices is not None and prices.available
        # a token's hidden state on the wire: the cost spec's (the target model's, or the
        # recorded run's own; 0 in stores older than it: then no communication is priced)
        self.hidden = float(prices.cost.activation_bytes_per_token) if self.priced else 0.0
        #: (token, layer, rank) slots per chunk of steps, about (:meth:`Trace.step_chunks`):
        #: the per-chunk loads are groups × ranks (a million one-access groups on 4096 ranks
        #: would be 32 GiB)
        self.chunk_accesses = max(CHUNK_ACCESSES // R, 1)
        self.sched = None
        if self.dynamic:
            from workbench.sim.eplb_replay import EPLBSchedule

            self.sched = EPLBSchedule(
                self.L, E, R, int(knobs.num_redundant_experts), int(knobs.eplb_window),
                int(knobs.eplb_interval),
                expert_bytes=float(prices.cost.expert_bytes) if self.priced else 0.0,
                link=self.link, price=prices.expert if self.priced else None)

    def summary(self) -> EPSummary:
        return EPSummary(self.R, self.knobs.placement)

    def add(self, summary: EPSummary, chunk: Trace, s0: int, modality: int | None = None
            ) -> None:
        """Sum ``chunk`` (steps ``s0`` … of the trace, renumbered from 0:
        :meth:`Trace.step_slice`) into ``summary``: all its tokens, or those of ``modality``
        (their routing alone, masked chunk by chunk: no copy of the whole trace)."""
        g = (chunk if modality is None else _modality_view(chunk, modality)).groups()
        link = self.link if self.hidden else None
        if self.sched is not None:
            load, compute = _eplb_groups(self.sched, g, s0, chunk.num_steps, self.L, self.E,
                                         modality is None)
            summary.add(load, layer_times(load, compute, self.hidden, link))
            return
        load = rank_load(g.ptr, g.expert, g.expert_tokens, self.owner, self.R)
        compute = None
        if self.priced:
            comp = Prices.many(self.prices.expert, g.expert_tokens)
            compute = rank_compute_s(g.ptr, g.expert, comp, self.owner, self.R)
        summary.add(load, layer_times(load, compute, self.hidden, link))

    def result(self, summary: EPSummary, by_modality: dict[int, EPSummary] | None = None
               ) -> dict[str, Any]:
        """:meth:`EPSummary.result` with the interconnect, EPLB's rebalances and, when more
        than one modality's summary is given, ``by_modality`` (in code order)."""
        out = summary.result()
        out["interconnect"] = self.knobs.interconnect
        sched, k = self.sched, self.knobs
        if sched is not None:
            out["eplb"] = {"rebalances": len(sched.rebalances),
                           "bytes_moved": float(sum(r["bytes"] for r in sched.rebalances)),
                           "rebalance_s_modeled": float(sum(r["seconds"]
                                                            for r in sched.rebalances)),
                           "window": int(k.eplb_window), "interval": int(k.eplb_interval),
                           "redundant": int(k.num_redundant_experts)}
        if by_modality is not None and len(by_modality) > 1:
            out["by_modality"] = {MODALITIES[c]: by_modality[c].result()
                                  for c in sorted(by_modality)}
        return out


def ep_replay(trace: Trace, knobs: Any, prices: Any = None) -> dict[str, Any]:
    """EP figures of ``trace`` under ``knobs`` (``ep_ranks``, ``placement``, ``interconnect``,
    ``target_model``); ``prices``: the replay's :class:`~workbench.sim.costs.Prices` (None or
    unavailable: loads only). Returns :meth:`EPSummary.result` with ``by_modality`` added
    when the trace holds more than one modality."""
    rep = EPReplay(knobs, trace.num_layers, trace.num_experts, prices)
    chunks = trace.step_chunks(rep.chunk_accesses)

    def summarize(modality: int | None = None) -> EPSummary:
        summary = rep.summary()
        for s0, s1 in chunks:
            rep.add(summary, trace.step_slice(s0, s1), s0, modality)
        return summary

    whole = summarize()  # (first: EPLB's plans are the whole traffic's)
    codes = np.unique(np.asarray(trace.token_modality)) if trace.num_tokens else []
    return rep.result(whole, {int(c): summarize(int(c)) for c in codes}
                      if len(codes) > 1 else None)


def summary_prices(knobs: Any, source: Any, shape: Any) -> Prices:
    """What the EP summary of a run store prices its recorded routing with, ``knobs`` (the
    run's, from its store's attributes) set to the routing as recorded — a live dispatch and
    a live ReaLB are already applied to it, not replayed — and their EP group checked
    against ``shape`` (the run's other knobs were checked when it ran, and some are
    live-only: a full replay check would refuse them). ``source``: anything with the
    store's ``attrs`` (its ``cost_spec``)."""
    from workbench.replay.engine import cost_of

    knobs.set(dispatch="topk", balance="none")  # (the caller's own Knobs)
    knobs.group("ep").check(knobs, shape, live=False)
    cost, prof = cost_of(source, knobs.profile, knobs.target_model, None)
    return Prices(prof, cost)


class EPStream:
    """A run's EP summary while its store is written: fed the columns of each batch of steps
    the recorder writes, in order (:meth:`add_columns`), :meth:`result` is
    ``open_run(store).moe.ep_summary()`` bit for bit (tested), without reading the store
    back.

    The routing is cut into the chunks :meth:`Trace.step_chunks` makes of the whole store —
    one ends after the step whose running count of routed slots first reaches past a
    multiple of :attr:`EPReplay.chunk_accesses` — and each is summed as :func:`ep_replay`
    sums it, every modality's share right after it (a chunk without a modality's tokens adds
    nothing to that modality's figures, so :func:`ep_replay`'s later pass over all the chunks
    sums the same). Static placements only: EPLB's plans come from the whole traffic before
    any modality's share is served (:meth:`for_store` gives None). Memory: the routing of
    about one chunk and one batch (a run whose steps route nothing, which never ends a
    chunk, is kept whole until its end)."""

    def __init__(self, rep: EPReplay, pinned: np.ndarray) -> None:
        self.rep = rep
        self.pinned = np.asarray(pinned, bool)
        self.whole = rep.summary()
        self.by_modality: dict[int, EPSummary] = {}
        #: the routing of the steps not summed yet: (topk_ids, token_step, token_modality,
        #: kept) per batch, and each step's phase
        self._parts: list[tuple[np.ndarray, ...]] = []
        self._phase: list[np.ndarray] = []
        self._s0 = 0  # the first step not summed
        self._steps = 0  # steps seen
        self._routed = 0  # routed (token, layer, k) slots seen
        #: the step ranges summed so far, each as one chunk (``step_chunks``' of the store)
        self.chunks: list[tuple[int, int]] = []
        #: an error while summing (the summary is then read from the store: None here)
        self.error: BaseException | None = None

    @classmethod
    def for_store(cls, attrs: dict[str, Any], pinned: np.ndarray, num_layers: int,
                  num_experts: int, width: int) -> "EPStream | None":
        """The stream of a run store whose attributes are ``attrs`` (the run's knobs, its
        cost spec), ``width`` its routing's k: None unless the run has ``ep_ranks`` > 1 on a
        static placement, or when its knobs or prices cannot be set up (the summary read
        from the store then says what is wrong)."""
        from types import SimpleNamespace

        from workbench.knobs import Knobs, ModelShape

        try:
            k = Knobs.from_attrs(attrs)
            if k.ep_ranks <= 1 or EP_PLACEMENT.get(k.placement).dynamic:
                return None
            # (ModelShape.of the store's trace: its k dim, at most E)
            shape = ModelShape(num_layers=int(num_layers), top_k=min(int(width),
                                                                      int(num_experts)),
                               num_experts=int(num_experts))
            prices = summary_prices(k, SimpleNamespace(attrs=dict(attrs)), shape)
            return cls(EPReplay(k, num_layers, num_experts, prices), pinned)
        except Exception:
            return None

    def add_columns(self, cols: dict[str, np.ndarray]) -> None:
        """The next batch of steps, as the recorder writes them (``topk_ids``,
        ``token_step``, ``token_modality``, ``kept``, ``phase``). Never raises: an error is
        kept (:attr:`error`) and the stream stops."""
        if self.error is not None:
            return
        try:
            self._add(cols)
        except Exception as e:
            self.error = e
            self._parts, self._phase = [], []

    def _add(self, cols: dict[str, np.ndarray]) -> None:
        phase = np.asarray(cols["phase"])
        n = len(phase)
        if not n:
            return
        ids, ts = np.asarray(cols["topk_ids"]), np.asarray(cols["token_step"])
        base = self._steps
        if len(ts) and (int(ts[0]) < base or int(ts[-1]) >= base + n):
            raise ValueError(f"a batch of steps {base}…{base + n - 1} holds tokens of steps "
                             f"{int(ts[0])}…{int(ts[-1])}")
        self._parts.append((ids, ts, np.asarray(cols["token_modality"]),
                            np.asarray(cols["kept"])))
        self._phase.append(phase)
        self._steps += n
        # routed slots per step: step_chunks' own count
        routed = routed_per_step(np.ascontiguousarray(ids, np.int16),
                                 (ts - base).astype(np.int32), n)
        a = self.rep.chunk_accesses
        end = self._routed
        for i, r in enumerate(routed):
            start, end = end, end + int(r)
            # the smallest multiple of a (at least a) not below the count before this step:
            # passed by this step, it ends a chunk after it (step_chunks' cut)
            m = max(a, -(-start // a) * a)
            if m < end:
                self._chunk(base + i + 1)
        self._routed = end

    def _chunk(self, s1: int) -> None:
        """Sum steps ``_s0 … s1-1`` (buffered) as one chunk."""
        s0 = self._s0
        ids, ts, mod, kept = (np.concatenate(x) for x in zip(*self._parts))
        phase = np.concatenate(self._phase)
        cut = int(np.searchsorted(ts, s1, "left"))
        rest = tuple(a[cut:].copy() for a in (ids, ts, mod, kept))  # (frees the chunk's)
        self._parts = [rest] if len(rest[0]) else []
        self._phase = [phase[s1 - s0:]] if s1 - s0 < len(phase) else []
        self._s0 = s1
        self.chunks.append((s0, s1))
        chunk = Trace(topk_ids=ids[:cut], token_step=ts[:cut] - s0, num_experts=self.rep.E,
                      token_modality=mod[:cut], phase=phase[:s1 - s0], pinned=self.pinned,
                      kept=kept[:cut])
        self.rep.add(self.whole, chunk, s0)
        for c in np.unique(chunk.token_modality):
            summary = self.by_modality.setdefault(int(c), self.rep.summary())
            self.rep.add(summary, chunk, s0, int(c))

    def result(self) -> dict[str, Any] | None:
        """The run's EP figures (:func:`ep_replay`'s) once every step was added; None after
        an error."""
        if self.error is None and self._s0 < self._steps:
            try:
                self._chunk(self._steps)
            except Exception as e:
                self.error = e
        if self.error is not None:
            return None
        return self.rep.result(self.whole, self.by_modality)
