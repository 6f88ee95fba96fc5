"""The one place that imports the feature packages and registers their knob groups.

:mod:`workbench.knobs` imports no feature package; it imports this module the first time the
knob groups are needed (``Knobs()``, a group instance, ``register_group``, ``knob_groups``), so
``from workbench.knobs import Knobs`` alone gives every group. Importing a feature module
registers its *policies* in their registries (``@EVICTION.register(...)``), never a knob group:
groups are registered here, in the order menus, ``workbench knobs`` and the dashboard show
them, each Selector knob bound to the registry (or function) that lists its choices.

Everything imported here is torch-free, so ``Knobs()`` does not import torch (tested in
``tests/test_imports.py``). A new capability: declare its :class:`~workbench.knobs.KnobGroup` in
its package and add one line to :data:`GROUPS`.
"""

from __future__ import annotations

from workbench.compression.policies import COMPRESSION, CompressionKnobs
from workbench.knobs import (CacheKnobs, CostKnobs, ExecKnobs, GenerationKnobs, PrefetchKnobs,
                             register_group)
from workbench.policies.active_evict import ActiveEvictKnobs
from workbench.policies.cache_routing import CacheRoutingKnobs
from workbench.policies.eviction import EVICTION
from workbench.policies.prefetch import PREFETCH
from workbench.predictor import policy as _predictor_policy  # noqa: F401  (prefetch "vismmoe")
from workbench.predictor.knobs import PredictorKnobs
from workbench.prism.knobs import PrismKnobs
from workbench.sim.dispatch import DISPATCH
from workbench.sim.knobs import ExpertParallelKnobs
from workbench.sim.placement import EP_PLACEMENT
from workbench.sim.profiles import (available_interconnects, available_profiles,
                                    available_target_models)


def _target_models() -> list[str]:
    return ["none", *available_target_models()]


#: (key, group, {Selector knob: source of its choices}), in menu order
GROUPS = (
    ("cache", CacheKnobs, {"eviction": EVICTION}),
    ("prefetch", PrefetchKnobs, {"prefetch": PREFETCH}),
    ("cost", CostKnobs, {"profile": available_profiles, "target_model": _target_models}),
    ("ep", ExpertParallelKnobs, {"placement": EP_PLACEMENT,
                                 "interconnect": available_interconnects,
                                 "dispatch": DISPATCH}),
    ("exec", ExecKnobs, {}),
    ("generation", GenerationKnobs, {}),
    ("active_evict", ActiveEvictKnobs, {}),
    ("cache_routing", CacheRoutingKnobs, {}),
    ("compression", CompressionKnobs, {"compression": COMPRESSION}),
    ("predictor", PredictorKnobs, {}),
    ("prism", PrismKnobs, {}),
)

for _key, _cls, _choices in GROUPS:
    register_group(_key, _cls, choices=_choices)
