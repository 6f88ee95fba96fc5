"""The layer stages: one module per mechanism family, run in the order of :data:`STAGES`.

See :mod:`workbench.runtime.stages.base` for what a stage is and when its hooks run. A new
mechanism family is one module here and one entry in :data:`STAGES`; the runtime names no
mechanism.
"""

from __future__ import annotations

from workbench.runtime.stages.base import (HOOKS, TOKEN_CONTEXT, LayerCall, RunContext, Stage,
                                           StageSetup, hooked)
from workbench.runtime.stages.balance import BalanceStage
from workbench.runtime.stages.cache_routing import CacheRouting
from workbench.runtime.stages.dispatch import DispatchStage
from workbench.runtime.stages.hybrid import HostRuns
from workbench.runtime.stages.lookahead import DynamicTopK, Lookahead
from workbench.runtime.stages.subexperts import SubExpertStage

#: every stage class, in the order their hooks run within each phase (cache-aware routing
#: after dynamic top-k, whose k it keeps, and before the dispatch, which must see the routing
#: the tokens ask for)
STAGES: tuple[type[Stage], ...] = (DynamicTopK, CacheRouting, DispatchStage, Lookahead,
                                    BalanceStage, SubExpertStage, HostRuns)

__all__ = ["HOOKS", "STAGES", "TOKEN_CONTEXT", "LayerCall", "RunContext", "Stage", "StageSetup",
           "build", "from_knobs", "hooked"]


def build(setup: StageSetup) -> list[Stage]:
    """The stages over mechanism objects made elsewhere (the offloader's arguments): those of
    :data:`STAGES` whose feature is on, in order."""
    return [s for s in (cls.from_setup(setup) for cls in STAGES) if s is not None]


def from_knobs(knobs, run: RunContext) -> list[Stage]:
    """A run's stages, each built from its knob group: those of :data:`STAGES` whose feature
    is on, in order."""
    return [s for s in (cls.from_knobs(knobs, run) for cls in STAGES) if s is not None]
