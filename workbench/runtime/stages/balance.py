"""Load balance on the live runtime: ReaLB's low-precision ranks (with EPLB's placement).

Per layer call, ReaLB (:class:`workbench.sim.realb.ReaLB`) reads the per-rank loads and
visual assignments of the real tokens (``rank_of_expert`` maps an expert to its EP rank) and
picks the ranks whose experts run in ``low_precision`` this call: weights and activations
quantised → dequantised (:mod:`workbench.precision`; the down projection's input too unless
``low_precision_down_input`` is 'native'), by the executor's low-precision runner
(:meth:`workbench.runtime.executor.Executor.run_low`). The controller's carried state (M_d) is
the controller's own; a run that carries it on gets it from ``realb_carry`` at setup.
"""

from __future__ import annotations

import numpy as np

from workbench.runtime.stages.base import (TOKEN_CONTEXT, LayerCall, RunContext, Stage,
                                           StageSetup)
from workbench.knobs import Knobs
from workbench.sim.knobs import ExpertParallelKnobs
from workbench.sim.placement import rank_of_expert
from workbench.sim.realb import ReaLB, balances


class BalanceStage(Stage):
    """ReaLB's per-call decision: ``call.low`` (the experts in low precision) and
    ``call.event.realb`` (the decision, for the store)."""

    needs = frozenset({TOKEN_CONTEXT})

    def __init__(self, controller, rank_of_expert: np.ndarray, low_precision: str,
                 ranks: int | None = None, down_input: str = "quantised") -> None:
        self.controller = controller
        self.rank_of_expert = np.asarray(rank_of_expert)
        self.low_precision = low_precision
        self.down_input = down_input  # low_precision_down_input: 'quantised' (W4A4) or 'native'
        self.ranks = int(self.rank_of_expert.max()) + 1 if ranks is None else int(ranks)

    @classmethod
    def from_knobs(cls, knobs: Knobs, run: RunContext) -> "BalanceStage | None":
        """ReaLB's controller of the ``balance`` knob (None: 'none'), over the EP placement;
        under ``realb_carry`` its M_d is the one the Runtime carries from run to run."""
        ep: ExpertParallelKnobs = knobs.group("ep")  # the EP and ReaLB fields
        if not balances(ep.balance):
            return None
        lay, ranks = run.layout, int(ep.ep_ranks)
        ctl = ReaLB.for_balance(ep.balance, lay.num_layers, ranks, c=ep.realb_c,
                                tau=ep.realb_tau, gate=ep.realb_gate)
        if ep.realb_carry:  # the previous run's M_d (a controller that lives across batches)
            # shared: this run's updates are the next run's start
            ctl.m = run.runtime.realb_carry.share((ep.balance, ranks, ep.placement), ctl.m)
        return cls(ctl, rank_of_expert(ep.placement, lay.num_experts, ranks), ep.low_precision,
                   ranks, ep.low_precision_down_input)

    @classmethod
    def from_setup(cls, setup: StageSetup) -> "BalanceStage | None":
        if setup.balance is None:
            return None
        return cls(setup.balance, setup.rank_of_expert, setup.low_precision,
                   down_input=setup.low_down_input)

    def store_dims(self) -> dict[str, int]:
        return {"ep_ranks": self.ranks}

    def observe(self, call: LayerCall) -> None:
        """Per-rank loads and visual assignments of the real tokens → the experts of the
        ranks ReaLB puts in low precision."""
        roe = self.rank_of_expert
        ids = np.asarray(call.real_ids, np.int64)
        mod = call.modality
        if mod is not None and call.real is not None:
            mod = mod[call.real]
        vis_tok = (np.zeros(len(ids), bool) if mod is None or len(mod) != len(ids)
                   else np.asarray(mod) != 0)
        t, r = np.nonzero((ids >= 0) & (ids < len(roe)))
        owner = roe[ids[t, r]]
        load = np.bincount(owner, minlength=self.ranks).astype(np.float64)
        visual = np.bincount(owner[vis_tok[t]], minlength=self.ranks).astype(np.float64)
        d = call.event.realb = self.controller.decide(call.block.index, load, visual)
        call.low = {e for e in call.experts if d.low[roe[e]]}
        call.low_precision = self.low_precision
        call.low_down_input = self.down_input
