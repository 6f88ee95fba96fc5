"""The Elastic experts knob group (MoE-Prism, issue 16 §2): torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING

import param

from workbench.errors import KnobError
from workbench.knobs import KnobGroup

if TYPE_CHECKING:
    from workbench.knobs import Knobs, ModelShape


class PrismKnobs(KnobGroup):
    """MoE-Prism: each routed expert runs k_active of its sub-experts (workbench refactor)."""

    title = "Elastic experts"

    prism = param.Boolean(
        default=False,
        doc="Run experts as sub-experts (MoE-Prism; needs a refactoring: workbench refactor). "
            "Live only.")
    prism_k_active = param.Integer(
        default=None, allow_None=True, bounds=(1, None),
        doc="Sub-experts each routed expert runs, chosen per token by the proxy gate (None: "
            "all of them, which computes what the experts do). At most the refactoring's "
            "sub-experts.")
    prism_refactoring = param.String(
        default=None, allow_None=True,
        doc="Folder of a MoE-Prism refactoring (workbench refactor --out); None: "
            "<workspace>/prism/<model config hash>, else one shipped in "
            "<model dir>/workbench/prism.")

    def check(self, knobs: "Knobs", shape: "ModelShape", *, live: bool = True) -> None:
        """Live only, and not yet with ReaLB's low precision (both split the experts' runs)."""
        if not self.prism:
            return
        if not live:
            raise KnobError("prism=True runs sub-experts live; trace replay of sub-experts is "
                            "not built yet: replay with prism=False")
        if getattr(knobs, "balance", "none") != "none":
            raise KnobError(f"prism=True with balance={knobs.balance!r} is not built yet: run "
                            f"one or the other")


__all__ = ["PrismKnobs"]
