"""GPU–CPU hybrid on the live runtime (VisMMOE §3.4).

A miss the rule picks (a function of the key's token count; True: the modeled prices decide,
:meth:`workbench.sim.costs.Prices.on_host`, of a key — an expert, or a sub-expert with 1/part
of its bytes and FLOPs) is not loaded: the executor runs the model's own experts forward over
the host store's copy of that one key, on the host, after the hits were launched (on CUDA the
device keeps computing meanwhile); the cache is unchanged.
"""

from __future__ import annotations

from typing import Callable

from workbench.knobs import CacheKnobs, Knobs
from workbench.runtime.stages.base import LayerCall, RunContext, Stage, StageSetup
from workbench.sim.step import Access


class HostRuns(Stage):
    """The hybrid rule's picks and their modeled host seconds, for offloaded layers."""

    def __init__(self, rule: Callable[[int], bool] | None, prices) -> None:
        self.rule = rule  # None: the modeled prices decide
        self.prices = prices

    @classmethod
    def from_knobs(cls, knobs: Knobs, run: RunContext) -> "HostRuns | None":
        """The ``hybrid`` knob: the modeled prices decide."""
        cache: CacheKnobs = knobs.group("cache")
        return cls(None, run.prices) if cache.hybrid else None

    @classmethod
    def from_setup(cls, setup: StageSetup) -> "HostRuns | None":
        if not setup.hybrid:
            return None
        return cls(None if setup.hybrid is True else setup.hybrid, setup.prices)

    def access(self, call: LayerCall, access: Access) -> None:
        if call.pinned:
            return
        prices = self.prices.part(call.part)
        rule = self.rule or prices.on_host
        access.on_host = [rule(n) for n in call.tokens]
        access.host_s = [prices.host(n) for n in call.tokens]
