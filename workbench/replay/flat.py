"""Classic one-key-at-a-time caching over a flattened trace (the libCacheSim / textbook view).

Each access is its own group and nothing is pinned, so the hit counts are directly comparable
with other cache simulators on the same key sequence.

``engine="fast"`` runs LRU, Belady, ARC and S3-FIFO through dedicated kernels
(:func:`~workbench.replay.kernel.flat_lru_hits`, :func:`~workbench.replay.kernel.flat_belady_hits`,
:func:`~workbench.replay.kernel.flat_arc_hits`, :func:`~workbench.replay.kernel.flat_s3fifo_hits`:
O(1), O(log slots), O(1) and amortised O(1) per access after an O(n) relabelling of the keys;
LRU and Belady skip the relabelling and read integer keys of any width as they are where their
range is dense, as every MoE trace's ``layer · E + expert`` is: :data:`FLAT_ON_KEYS`);
the other compiled
policies, and ``engine="python"`` (the reference: the real cache and policy objects), go
through the grouped replay with one access per group. Tests hold all of them equal.
"""

from __future__ import annotations

import numpy as np

from workbench.errors import KnobError
from workbench.knobs import Knobs
from workbench.policies.eviction import EVICTION
from workbench.replay import kernel as K
from workbench.replay.engine import make_policy, run_fast, run_python
from workbench.sim.placement import Placement
from workbench.traces.trace import Groups

#: the flat kernels by policy name (the others replay through the grouped kernel), on keys
#: relabelled 0..n-1: ``kernel(ids, n_keys, cache_slots)``
FLAT_KERNELS = {"lru": K.flat_lru_hits, "belady": K.flat_belady_hits, "arc": K.flat_arc_hits,
                 "s3fifo": K.flat_s3fifo_hits}
#: those that also read integer keys as they are, ``kernel(keys, cache_slots)``: no int64
#: copy or relabelling of a dense trace (10⁹ uint16 keys: Belady 6 bytes per access, not 26;
#: LRU the keys' 2 and tables over the key range)
FLAT_ON_KEYS = {"belady": K.belady_hits, "lru": K.lru_hits}


def flat_hits(keys: np.ndarray, cache_slots: int, eviction: str = "lru",
              engine: str = "fast") -> int:
    """Hits of a classic one-key-at-a-time cache of ``cache_slots`` slots over ``keys`` (any
    ints, one access each, in order) — the flattened trace libCacheSim and textbooks use. Every
    miss is admitted (Belady too, as libCacheSim's). Each access is its own group; nothing is
    pinned. Pass a compact dtype for a long trace (``uint16`` keys of 10⁹ accesses: 2 GB; the
    Belady bound then needs ≈ 6 bytes per access in all)."""
    keys = K.integer_keys(keys)  # any integer width as given: 10⁹ uint16 keys are 2 GB, not 8
    if cache_slots < 1:
        raise KnobError(f"cache_slots must be at least 1, not {cache_slots}")
    EVICTION.get(eviction)  # an unknown name is refused here
    # the keys' range, read once for the fit check and the kernels' tables or relabelling
    bounds = K.key_bounds(keys) if engine == "fast" and keys.size else None
    if engine == "fast":
        n_keys = K.distinct_at_most(keys, cache_slots, bounds)
        if n_keys is not None:
            # every key fits: the cache asks a policy for a victim only when every slot is
            # taken (sim/cache.py), so nothing is ever evicted and, for every policy, the only
            # misses are the first accesses (tests/test_replay_speed.py holds this to the
            # kernels and the reference engine)
            return len(keys) - n_keys
    if engine == "fast" and eviction in FLAT_ON_KEYS:
        return FLAT_ON_KEYS[eviction](keys, cache_slots, bounds)
    if engine == "fast" and eviction in FLAT_KERNELS:
        ids, n_keys = K.dense_keys(keys, bounds)
        return FLAT_KERNELS[eviction](ids, n_keys, cache_slots)
    keys = np.asarray(keys, np.int64)
    uniq, dense_keys = np.unique(keys, return_inverse=True)
    n = len(keys)
    cache_slots = min(cache_slots, max(len(uniq), 1))  # more slots than keys change nothing
    groups = Groups(step=np.arange(n, dtype=np.int32), layer=np.zeros(n, np.int32),
                    ptr=np.arange(n + 1, dtype=np.int64), expert=dense_keys.astype(np.int32),
                    expert_tokens=np.ones(n, np.int32), step_tokens=np.ones(n, np.int64),
                    num_layers=1, num_experts=max(len(uniq), 1))
    z = np.zeros(n)
    placement = Placement(1, max(len(uniq), 1), np.zeros(1, bool), np.zeros(1, np.int64),
                          np.array([cache_slots], np.int64))
    empty = (np.zeros(n + 1, np.int64), np.zeros(0, np.int64))
    if engine == "fast":
        if eviction not in K.POLICY_CODES:
            raise KnobError(f"eviction {eviction!r} has no compiled replay; use engine='python'")
        out = run_fast(groups, z, z, placement, K.POLICY_CODES[eviction], Knobs().to_dict(),
                        *empty, 0.0, n)
    else:
        out = run_python(groups, z, z, placement, lambda: make_policy(
            eviction, {}, groups, None), *empty, 0.0, n)
    return int(out[0].sum())
