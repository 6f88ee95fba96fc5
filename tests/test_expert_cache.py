"""The expert cache's invariants, under random access sequences (hypothesis)."""

from collections import OrderedDict

import numpy as np

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.policies.eviction import EVICTION
from workbench.sim.cache import ExpertCache


def _drive(cache, accesses, layer_of):
    """Serve accesses one layer-group at a time as the runtime does; check invariants."""
    for layer, experts in accesses:
        hits, misses = cache.lookup(layer, experts)
        assert sorted(hits + misses) == sorted(experts)
        protected = {(layer, e) for e in experts}
        for e in hits:
            protected.discard((layer, e))  # hits are computed first
        for e in misses:
            got = cache.admit((layer, e), protected)
            assert got is not None
            slot, evicted = got
            assert evicted not in protected
            protected.discard((layer, e))
        # bookkeeping is a bijection and never exceeds the slots
        assert len(cache.slot_of) <= cache.num_slots
        for key, s in cache.slot_of.items():
            assert cache.key_in[s] == key


access = st.tuples(st.integers(0, 3), st.sets(st.integers(0, 7), min_size=1, max_size=4))


@settings(max_examples=150, deadline=None)
@given(st.lists(access, min_size=1, max_size=60), st.integers(4, 12),
       st.sampled_from(["lru", "lfu", "arc", "s3fifo", "least-stale", "reuse-eta"]))
def test_invariants_hold_for_any_sequence(seq, slots, policy):
    cache = ExpertCache(slots, EVICTION.create(policy), num_layers=4, num_experts=8)
    _drive(cache, [(l, sorted(es)) for l, es in seq], None)
    c = cache.counters()
    assert c["hits"].sum() + c["misses"].sum() == sum(len(es) for _, es in seq)
    assert c["loads"].sum() == c["misses"].sum()
    assert c["loads"].sum() - c["evictions"].sum() == len(cache.slot_of)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=80),
       st.integers(1, 6))
def test_lru_matches_reference_on_single_accesses(seq, slots):
    """One expert per access: hits equal an independent OrderedDict LRU."""
    cache = ExpertCache(slots, EVICTION.create("lru"), num_layers=3, num_experts=6)
    ref: OrderedDict = OrderedDict()
    ref_hits = 0
    for layer, e in seq:
        key = (layer, e)
        if key in ref:
            ref_hits += 1
            ref.move_to_end(key)
        else:
            if len(ref) >= slots:
                ref.popitem(last=False)
            ref[key] = True
        hits, misses = cache.lookup(layer, [e])
        if misses:
            cache.admit(key)
    assert cache.counters()["hits"].sum() == ref_hits == sum(cache.hits)
    assert set(cache.slot_of) == set(ref)


def test_admit_refuses_when_every_slot_is_protected():
    cache = ExpertCache(2, EVICTION.create("lru"), num_layers=1, num_experts=4)
    cache.admit((0, 0))
    cache.admit((0, 1))
    assert cache.admit((0, 2), protected={(0, 0), (0, 1)}) is None
    slot, evicted = cache.admit((0, 2), protected={(0, 1)})
    assert evicted == (0, 0) and cache.key_in[slot] == (0, 2)
    with pytest.raises(ValueError, match="already resident"):
        cache.admit((0, 2))


def test_lfu_keeps_frequent_expert():
    cache = ExpertCache(2, EVICTION.create("lfu"), num_layers=1, num_experts=4)
    for e in (0, 0, 0, 1, 2):
        _, miss = cache.lookup(0, [e])
        if miss:
            cache.admit((0, e))
    assert (0, 0) in cache and (0, 2) in cache and (0, 1) not in cache


@pytest.mark.parametrize("seed", range(6))
def test_lru_victims_by_order_of_use_equal_the_scan(seed):
    """LRU's order of uses (:meth:`LRU.victim`) evicts exactly what the scan of every
    unprotected resident key does (:meth:`EvictionPolicy.victim` → ``choose_victim``), over
    random layer calls with protected keys, pre-evictions, cancellations, and a policy reset
    with keys resident (then it scans); a clock that repeats a ``t`` turns it to scanning."""
    from workbench.policies.eviction import LRU, EvictionPolicy

    class ScanLRU(LRU):
        victim = EvictionPolicy.victim

    rng = np.random.default_rng(seed)
    L, E, slots = 3, 12, int(rng.integers(2, 12))
    caches = [ExpertCache(slots, cls(), L, E) for cls in (LRU, ScanLRU)]
    for step in range(300):
        layer = int(rng.integers(L))
        experts = [int(e) for e in rng.choice(E, size=min(int(rng.integers(1, 4)), slots),
                                              replace=False)]
        outs = []
        for c in caches:
            hits, misses = c.lookup(layer, experts)
            fill = c.fill(layer, experts, misses)
            fill.done(hits)
            got = []
            while fill.pending:
                out = fill.issue()
                got += out
                fill.done([e for e, _, _ in out])
            outs.append((hits, got))
        assert outs[0] == outs[1]
        if step % 37 == 5:  # a pre-eviction / a cancelled prefetch of the same key in both
            key = next(iter(caches[0].slot_of))
            (caches[0].evict if step % 2 else caches[0].cancel)(key)
            (caches[1].evict if step % 2 else caches[1].cancel)(key)
        if step == 150:
            for c in caches:
                c.policy.reset()
    assert [c.slot_of for c in caches][0] == caches[1].slot_of
    assert caches[0].counters()["evictions"].tolist() == caches[1].counters()["evictions"].tolist()
    assert caches[0].counters()["evictions"].sum() > 0
    class MRU(LRU):  # a subclass choosing its own way: its choice, not LRU's order
        def choose_victim(self, candidates, t):
            return max(candidates, key=lambda k: self.last_use.get(k, -1))

    mru = MRU()
    for t, key in enumerate([(0, 1), (0, 2), (0, 3)]):
        mru.on_insert(key, t)
    assert mru.victim({(0, 1): 0, (0, 2): 1, (0, 3): 2}, {(0, 3)}, 9) == (0, 2)
    lru = LRU()
    lru.on_hit((0, 1), 5)
    lru.on_hit((0, 2), 5)  # the same t twice: from here on, the scan
    assert not lru._ordered and lru.victim({(0, 1): 0, (0, 2): 1}, set(), 6) == (0, 1)
