"""Load balance on the live runtime: ReaLB's low-precision ranks (with EPLB's placement).

Per layer call, ReaLB (:class:`workbench.sim.realb.ReaLB`) reads the per-rank loads and
visual assignments of the real tokens (``rank_of_expert`` maps an expert to its EP rank) and
picks the ranks whose experts run in ``low_precision`` this call: weights and activations
quantised → dequantised (:mod:`workbench.precision`), by the executor's low-precision runner
(:meth:`workbench.runtime.executor.Executor.run_low`). The controller's carried state (M_d) is
the controller's own; a run that carries it on gets it from ``realb_carry`` at setup.
"""

from __future__ import annotations

import numpy as np

from workbench.runtime.stages.base import TOKEN_CONTEXT, LayerCall, Stage, StageSetup


class BalanceStage(Stage):
    """ReaLB's per-call decision: ``call.low`` (the experts in low precision) and
    ``call.event.realb`` (the decision, for the store)."""

    needs = frozenset({TOKEN_CONTEXT})

    def __init__(self, controller, rank_of_expert: np.ndarray, low_precision: str) -> None:
        self.controller = controller
        self.rank_of_expert = np.asarray(rank_of_expert)
        self.low_precision = low_precision
        self.ranks = int(self.rank_of_expert.max()) + 1

    @classmethod
    def from_knobs(cls, setup: StageSetup) -> "BalanceStage | None":
        if setup.balance is None:
            return None
        return cls(setup.balance, setup.rank_of_expert, setup.low_precision)

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
