"""The expert cache's invariants, under random access sequences (hypothesis)."""

from collections import OrderedDict

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
    assert cache.hits.sum() == ref_hits
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
