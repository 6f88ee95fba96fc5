"""The layer stages: one module per mechanism family, run in the order of :data:`STAGES`.

See :mod:`workbench.runtime.stages.base` for what a stage is and when its hooks run. A new
mechanism family is one module here and one entry in :data:`STAGES`; the runtime names no
mechanism.
"""

from __future__ import annotations

from dataclasses import replace

from workbench.runtime.stages.base import (HOOKS, ROUTER_LOGITS, RUN_HOOKS, TOKEN_CONTEXT,
                                           LayerCall, RunContext, Stage, StageSetup, hooked)
from workbench.runtime.stages.balance import BalanceStage
from workbench.runtime.stages.cache_routing import CacheRouting
from workbench.runtime.stages.compression import TokenCompression
from workbench.runtime.stages.dispatch import DispatchStage
from workbench.runtime.stages.hybrid import HostRuns
from workbench.runtime.stages.lookahead import DynamicTopK, Lookahead
from workbench.runtime.stages.subexperts import SubExpertStage

#: every stage class, in the order their hooks run within each phase (token compression
#: first: the stages after it read its placement; cache-aware routing after dynamic top-k,
#: whose k it keeps, and before the dispatch, which must see the routing the tokens ask for)
STAGES: tuple[type[Stage], ...] = (TokenCompression, DynamicTopK, CacheRouting, DispatchStage,
                                    Lookahead, BalanceStage, SubExpertStage, HostRuns)

__all__ = ["HOOKS", "ROUTER_LOGITS", "RUN_HOOKS", "STAGES", "TOKEN_CONTEXT", "LayerCall",
           "RunContext", "Stage", "StageSetup", "build", "from_knobs", "hooked", "provided"]


def build(setup: StageSetup) -> list[Stage]:
    """The stages over mechanism objects made elsewhere (the offloader's arguments): those of
    :data:`STAGES` whose feature is on, in order."""
    return [s for s in (cls.from_setup(setup) for cls in STAGES) if s is not None]


def from_knobs(knobs, run: RunContext) -> list[Stage]:
    """A run's stages, each built from its knob group: those of :data:`STAGES` whose feature
    is on, in order; each sees what the stages before it provide (:meth:`Stage.provides`)."""
    stages: list[Stage] = []
    for cls in STAGES:
        stage = cls.from_knobs(knobs, run)
        if stage is not None:
            stages.append(stage)
            run = provided([stage], run)
    return stages


def provided(stages, run: RunContext) -> RunContext:
    """``run`` with what ``stages`` provide (:meth:`Stage.provides`)."""
    for stage in stages:
        given = stage.provides()
        if given:
            run = replace(run, **given)
    return run
