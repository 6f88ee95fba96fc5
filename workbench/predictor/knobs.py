"""The predictor's knob group (torch-free): ``predictor``, ``window`` (W), ``decay`` (γ),
``predictor_path``, and the predictor's budget B when ``prefetch_budget`` is None.

Separate from :mod:`workbench.predictor.policy` so that the policies that read these knobs (the
``slab`` eviction policy, the ``vismmoe`` prefetch policy) take their defaults from here without
importing each other. Registered by :mod:`workbench.features`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import param

from workbench.errors import KnobError
from workbench.knobs import KnobGroup

if TYPE_CHECKING:
    from workbench.knobs import Knobs, ModelShape

#: B: experts of y_l the live predictor keeps, and the ``vismmoe`` prefetch cap when
#: ``prefetch_budget`` is None (the paper's B)
DEFAULT_BUDGET = 20


class PredictorKnobs(KnobGroup):
    """Compression-guided lookahead predictor (VisMMOE §3.3)."""

    title = "Lookahead predictor"

    predictor = param.Selector(
        default="none", objects=["none", "vismmoe"],
        doc="'vismmoe' runs the calibrated lookahead predictor at every MoE layer "
            "(prefetch=vismmoe uses its top-B experts and turns it on).")
    window = param.Integer(
        default=5, bounds=(1, None), softbounds=(1, 8),
        doc="W: layers ahead the predictor's candidates may target.")
    decay = param.Number(
        default=0.8, bounds=(0.0, 1.0), inclusive_bounds=(False, True), softbounds=(0.5, 1.0),
        doc="γ: weight of a candidate d layers ahead is γ^(d−1) (and of the training targets).")
    predictor_path = param.String(
        default=None, allow_None=True,
        doc="Directory of a calibrated predictor (workbench calibrate --out); None: "
            "<workspace>/predictors/<model config hash>, else one shipped in "
            "<model dir>/workbench/predictor.")

    @staticmethod
    def in_use(knobs: "Knobs") -> bool:
        """Whether a live run of ``knobs`` runs the predictor (``predictor=vismmoe``, or a
        prefetch policy that reads its outputs, ``needs`` "predicted_ids": vismmoe, which turns
        it on)."""
        pf = knobs.group("prefetch").selected("prefetch")
        return knobs.predictor == "vismmoe" or "predicted_ids" in getattr(pf, "needs", ())

    def check(self, knobs: "Knobs", shape: "ModelShape", *, live: bool = True) -> None:
        """Live: an eviction policy that needs the predictor (``slab``) needs it on. (Replay
        reads a trace's recorded predictions instead.)"""
        if not live:
            return
        ev = knobs.group("cache").selected("eviction")
        if "predictor" in getattr(ev, "needs", ()) and not self.in_use(knobs):
            raise KnobError(
                f"eviction {knobs.eviction!r} keeps the experts the lookahead predictor names "
                f"for the next window layers, so it needs the predictor: set predictor=vismmoe "
                f"(or prefetch=vismmoe), or choose another eviction policy")
