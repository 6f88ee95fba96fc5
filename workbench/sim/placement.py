"""Placement: where each expert of the model may live.

Vocabulary (that of vLLM's EPLB, so the expert-parallel work extends this module rather than
inventing a second one): a **logical** expert is the model's (layer, expert); a **physical**
expert is one copy of it in some pool of slots; a logical expert may have several physical
copies (**redundant** experts) — ``logcnt[layer, expert]`` counts them, ``log2phy`` lists them
and ``phy2log`` maps a physical copy back. Today every run is on one device: each logical
expert has exactly one physical copy, in the single pool of its layer (``scope="global"``: one
pool of slots shared by every offloaded layer; ``"per-layer"``: one pool per offloaded layer),
and every pool lives on rank 0.

Layers of the pinned prefix are resident: they are in no pool.

Invariants: ``pool_of_layer[l]`` is a valid pool index for every offloaded layer;
``pool_slots[p] ≥ 1``; ``rank_of_pool[p] == 0`` (one device).

**Expert-parallel placement** (:data:`EP_PLACEMENT`, the ``placement`` knob): which of R ranks
owns each of a layer's E experts — ``contiguous`` (expert e on rank ⌊e·R/E⌋: vLLM's and
DeepSpeed's default blocks) or ``round-robin`` (e mod R). A registry, like the cache policies:
EPLB-style placements (issue 15) register beside them. Ranks are virtual today
(:mod:`workbench.sim.ep`): the expert cache above stays on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.errors import KnobError
from workbench.policies.registry import Registry

SCOPES = ("global", "per-layer")


@dataclass(frozen=True)
class Placement:
    """Pools of slots and which layers each serves (see the module docstring)."""

    num_layers: int
    num_experts: int
    pinned: np.ndarray  # bool [L]: layer of the pinned prefix (resident, in no pool)
    pool_of_layer: np.ndarray  # int64 [L]: the pool serving each layer (ignored when pinned)
    pool_slots: np.ndarray  # int64 [P]: slots of each pool
    scope: str = "global"

    @property
    def num_pools(self) -> int:
        return len(self.pool_slots)

    @property
    def rank_of_pool(self) -> np.ndarray:
        """int64 [P]: the expert-parallel rank holding each pool (one device: all 0)."""
        return np.zeros(self.num_pools, np.int64)

    @property
    def logcnt(self) -> np.ndarray:
        """int64 [L, E]: physical copies of each logical expert (one each; 0 none: pinned)."""
        c = np.ones((self.num_layers, self.num_experts), np.int64)
        c[self.pinned] = 0
        return c

    @classmethod
    def single_device(cls, num_layers: int, num_experts: int, top_k: int, pinned_layers: int,
                      cache_slots: int, scope: str = "global") -> "Placement":
        """The pools of one device: ``cache_slots`` slots shared by the offloaded layers
        (``global``), or split evenly among them (``per-layer``). A pool never has more slots
        than the experts it can hold. The knobs were checked against the model
        (:meth:`workbench.knobs.Knobs.check`: ``pinned_layers`` ≤ layers, ``cache_slots`` ≥
        top-k); what only a placement knows raises :class:`KnobError` here: an unknown scope, or
        a per-layer share below top-k."""
        L, E = num_layers, num_experts
        if scope not in SCOPES:
            raise KnobError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
        pinned = np.arange(L) < pinned_layers
        n_off = int((~pinned).sum())
        if scope == "global":
            pool_of_layer = np.zeros(L, np.int64)
            pool_slots = np.array([max(min(cache_slots, n_off * E), 1)], np.int64)
        else:
            share = cache_slots // max(n_off, 1)
            if n_off and share < top_k:
                raise KnobError(
                    f"cache_slots must give every offloaded layer at least top-k = {top_k} "
                    f"slots with scope=per-layer ({n_off} layers → ≥ {n_off * top_k}), "
                    f"not {cache_slots}")
            pool_of_layer = np.arange(L, dtype=np.int64)
            pool_slots = np.full(L, max(min(share, E), 1), np.int64)
        return cls(L, E, pinned, pool_of_layer, pool_slots, scope)


def check_eplb(experts: int, ranks: int, redundant: int, window: int, interval: int) -> None:
    """:class:`KnobError` unless EPLB can serve these sizes: whole numbers, ``ranks``,
    ``window``, ``interval`` ≥ 1, ``redundant`` in 0 … experts × ranks (a full copy on every
    rank) and experts + redundant a multiple of ranks."""
    for name, v, lo in (("ep_ranks", ranks, 1), ("eplb_window", window, 1),
                        ("eplb_interval", interval, 1), ("num_redundant_experts", redundant, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise KnobError(f"{name} must be a whole number ≥ {lo}, not {v!r}")
    if redundant > experts * ranks:
        raise KnobError(f"num_redundant_experts ({redundant}) must be at most the {experts} "
                        f"experts × {ranks} ranks = {experts * ranks} (a full copy on every "
                        f"rank)")
    if (experts + redundant) % ranks:
        raise KnobError(f"placement 'eplb' needs the {experts} experts + num_redundant_experts "
                        f"({redundant}) to be a multiple of ep_ranks ({ranks})")


class EPPlacement:
    """Base of expert-parallel placements: :meth:`rank_of_expert` maps a layer's experts to
    ranks. Every rank gets at least one expert when ``ranks ≤ num_experts`` (the knob's rule)."""

    name = ""
    #: the placement changes over the run (replicas refitted on its history): live, a rule
    #: that decides per owning rank refuses it; the EP views and replay follow its schedule
    dynamic = False

    @classmethod
    def check_sizes(cls, ep, num_experts: int) -> None:
        """:class:`KnobError` unless the placement can serve ``ep`` (the expert-parallel knob
        group) on ``num_experts`` experts per layer. The base serves any."""

    def rank_of_expert(self, num_experts: int, ranks: int) -> np.ndarray:
        raise NotImplementedError


EP_PLACEMENT: Registry[EPPlacement] = Registry("placement", knob="placement")


@EP_PLACEMENT.register("contiguous")
class Contiguous(EPPlacement):
    """Expert e on rank ⌊e·R/E⌋: blocks of about E/R neighbouring ids (vLLM's default)."""

    def rank_of_expert(self, num_experts: int, ranks: int) -> np.ndarray:
        return (np.arange(num_experts, dtype=np.int64) * ranks) // num_experts


@EP_PLACEMENT.register("round-robin")
class RoundRobin(EPPlacement):
    """Expert e on rank e mod R: neighbouring ids on different ranks."""

    def rank_of_expert(self, num_experts: int, ranks: int) -> np.ndarray:
        return np.arange(num_experts, dtype=np.int64) % ranks


@EP_PLACEMENT.register("eplb")
class EPLBPlacement(EPPlacement):
    """EPLB (deepseek-ai/EPLB, what vLLM and SGLang ship): the contiguous placement until the
    first rebalance, then every ``eplb_interval`` steps a plan refitted on the last
    ``eplb_window`` steps' loads with ``num_redundant_experts`` replicas
    (:class:`workbench.sim.eplb_replay.EPLBSchedule`) — applied to the recorded routing by the
    EP views and the EP replay. :meth:`rank_of_expert` is its static start (one owner per
    expert), which is why live MACS, Expanded Drop and ReaLB refuse it."""

    dynamic = True

    @classmethod
    def check_sizes(cls, ep, num_experts: int) -> None:
        check_eplb(num_experts, ep.ep_ranks, ep.num_redundant_experts, ep.eplb_window,
                   ep.eplb_interval)

    def rank_of_expert(self, num_experts: int, ranks: int) -> np.ndarray:
        return (np.arange(num_experts, dtype=np.int64) * ranks) // num_experts


def rank_of_expert(placement: str, num_experts: int, ranks: int) -> np.ndarray:
    """int64 [E]: the rank owning each expert under EP placement ``placement``;
    :class:`KnobError` for an unknown name or ``ranks`` outside 1 … ``num_experts``."""
    if not 1 <= ranks <= num_experts:
        raise KnobError(f"ep_ranks must be between 1 and the model's {num_experts} experts per "
                        f"layer (each rank owns at least one), not {ranks}")
    return EP_PLACEMENT.create(placement).rank_of_expert(num_experts, ranks)
