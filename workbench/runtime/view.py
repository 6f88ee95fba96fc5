"""What a run's session and its stages read of the :class:`~workbench.runtime.runtime.Runtime`.

A structural type: the Runtime satisfies it, and the modules that take one (``session``,
``stages``) annotate with it instead of importing ``runtime.runtime``, which imports them —
so the annotation adds no import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from workbench.knobs import Knobs
    from workbench.models.loading import LoadedModel


class RuntimeView(Protocol):
    """The Runtime as a run uses it: the model, the carried ReaLB state, and its per-knobs
    plans (slots, budgets, predictor, MACS calibration, store attrs). Read only: a run never
    changes its Runtime (the Runtime keeps what it loaded for later runs — the predictor, the
    MACS calibration, the MoE-Prism refactoring — which changes no answer)."""

    lm: "LoadedModel"
    realb_carry: Any

    def macs_calibration(self, knobs: "Knobs", policy: Any = None) -> Any: ...

    def prism_refactoring(self, knobs: "Knobs") -> tuple[Any, int]: ...

    def uses_predictor(self, knobs: "Knobs") -> bool: ...

    def prefetch_budget(self, knobs: "Knobs") -> int | None: ...

    def predictor_budget(self, knobs: "Knobs") -> int: ...

    def predictor(self, knobs: "Knobs") -> Any: ...

    def num_slots(self, knobs: "Knobs | None" = None) -> int: ...

    def run_attrs(self, *args: Any, **kwargs: Any) -> dict: ...
