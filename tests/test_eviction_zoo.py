"""The adaptive and MoE-aware eviction policies of issue 40: ARC and S3-FIFO equal
libCacheSim's on the same flat traces; Least-Stale and reuse-eta follow their layer-cyclic
rules; all of them keep the cache's invariants."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from workbench.policies.eviction import EVICTION
from workbench.replay.flat import flat_hits
from workbench.sim.cache import ExpertCache
from workbench.traces import Trace, read_jsonl

SHARED = Path(os.environ.get("WORKBENCH_SHARED", Path(__file__).resolve().parents[2] / "shared"))
MIXTRAL = SHARED / "data" / "traces" / "mixtral-8x7b-vllm" / "humaneval_2_routing.jsonl"
NEW = ("arc", "s3fifo", "least-stale", "reuse-eta")
needs_mixtral = pytest.mark.skipif(not MIXTRAL.exists(),
                                   reason=f"real Mixtral trace not found at {MIXTRAL}")


def _zipf_keys(steps=400, layers=8, experts=32, k=2, alpha=1.1, seed=3) -> np.ndarray:
    spec = importlib.util.spec_from_file_location(
        "zipf_trace", Path(__file__).resolve().parents[1] / "benchmarks" / "zipf_trace.py")
    z = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(z)
    ids = z.zipf_routing(steps, layers, experts, k, alpha, seed)
    return Trace(topk_ids=ids, token_step=np.arange(steps), num_experts=experts).groups().keys()


def _libcachesim_hits(lcs, cache, keys: np.ndarray) -> int:
    hits = 0
    for i, k in enumerate(keys.tolist()):
        r = lcs.Request()
        r.obj_id, r.obj_size, r.clock_time = k + 1, 1, i
        hits += bool(cache.get(r))
    return hits


def _flat_traces():
    yield "zipf", _zipf_keys
    yield "mixtral", lambda: read_jsonl(MIXTRAL, num_experts=8).groups().keys()


# S3-FIFO: libCacheSim refuses a small queue of 0 keys (< 10 slots) and admits nothing into one
# of 1 key (< 20 slots); the policy here always admits, so the sizes start at 20 for it
@pytest.mark.parametrize("trace_name,make", list(_flat_traces()), ids=lambda v: v
                         if isinstance(v, str) else "")
@pytest.mark.parametrize("policy,slots", [("arc", s) for s in (2, 7, 15, 31, 64, 100, 150)]
                         + [("s3fifo", s) for s in (20, 31, 64, 100, 150, 200)])
def test_arc_and_s3fifo_equal_libcachesim_on_flat_traces(trace_name, make, policy, slots):
    """The flattened trace (one key per access, serving order, nothing pinned) — the view
    libCacheSim simulates: the workbench's policy objects give its hit counts exactly."""
    lcs = pytest.importorskip("libcachesim", reason="libcachesim is in the test extra")
    if trace_name == "mixtral" and not MIXTRAL.exists():
        pytest.skip(f"real Mixtral trace not found at {MIXTRAL}")
    keys = make()
    cls = {"arc": lcs.ARC, "s3fifo": lcs.S3FIFO}[policy]
    want = _libcachesim_hits(lcs, cls(cache_size=slots), keys)
    got = flat_hits(keys, slots, policy, engine="python")
    assert got == want
    assert flat_hits(keys, slots, policy, engine="fast") == want  # the numba kernel's
    if slots >= 64:
        assert got > 0  # the comparison is not between two empty caches


def _cache(policy: str, slots: int, layers: int = 4, experts: int = 4) -> ExpertCache:
    return ExpertCache(slots, EVICTION.create(policy), num_layers=layers, num_experts=experts)


def test_arc_moves_a_ghost_hit_to_t2_and_adapts_p():
    c = _cache("arc", 2, 1, 8)
    pol = c.policy

    def access(e):
        if c.lookup(0, [e])[1]:
            c.admit((0, e))

    for e in (0, 0, 1, 2):  # 0 reaches T2; 2 evicts T1's LRU (1) into B1 (|T1| > p = 0)
        access(e)
    assert list(pol.t2) == [(0, 0)] and list(pol.b1) == [(0, 1)] and pol.p == 0.0
    access(1)  # found in B1: p grows by max(|B2|/|B1|, 1); |T1| = p now, so T2's LRU goes
    assert pol.p == 1.0 and list(pol.t2) == [(0, 1)] and list(pol.b2) == [(0, 0)]
    assert list(pol.t1) == [(0, 2)] and not pol.b1


def test_s3fifo_promotes_keys_used_twice_in_the_small_queue():
    c = _cache("s3fifo", 20, 1, 64)
    pol = c.policy
    for e in range(40):
        if e == 22:  # key 20 is used twice while in S: it moves to M instead of leaving
            for _ in range(2):
                c.lookup(0, [20])
        hits, misses = c.lookup(0, [e])
        if misses:
            c.admit((0, e))
    assert pol.evicted_any and (0, 20) in pol.main and (0, 20) in c
    assert len(pol.ghost) <= 18 and (0, 21) in pol.ghost


def test_least_stale_evicts_the_layer_just_served_first():
    pol = EVICTION.create("least-stale")
    pol.bind_cache(8, 4, 4)
    pol.begin_layer(2)
    cands = [(0, 1), (1, 1), (2, 3), (3, 0)]
    for i, k in enumerate(cands):
        pol.on_insert(k, i)
    # next turns: layer 3 in 1 group, 0 in 2, 1 in 3, 2 (the current one) in 4
    assert [pol.ahead(k) for k in cands] == [2, 3, 4, 1]
    assert pol.choose_victim(cands, 10) == (2, 3)
    assert pol.choose_victim([(0, 1), (1, 1), (3, 0)], 10) == (1, 1)
    pol.on_insert((1, 0), 20)  # same layer: the least recently used goes
    assert pol.choose_victim([(1, 0), (1, 1)], 21) == (1, 1)


def test_reuse_eta_waits_grow_with_age_where_routing_decays():
    """Keys that ran at every turn of their layer have a short wait; keys that stopped a
    while ago a long one; the victim is the longest expected wait."""
    pol = EVICTION.create("reuse-eta")
    pol.bind_cache(4, 2, 4)
    t = 0
    for step in range(30):
        for layer in (0, 1):
            pol.begin_layer(layer)
            used = [0] if step % 2 == 0 else [0, 1]  # expert 0 every turn, 1 every other
            if step < 5:
                used = used + [2]  # expert 2 only early on
            for e in used:
                t += 1
                pol.on_hit((layer, e), t)
    w = pol.waits()
    assert w[0] < w[1] < w[pol.AGE_CAP]
    pol.begin_layer(0)
    assert pol.age((1, 0)) == 0 and pol.age((1, 2)) > 5
    assert pol.choose_victim([(1, 0), (1, 1), (1, 2)], t) == (1, 2)
    assert pol.wait((0, 0)) > pol.wait((1, 0))  # layer 0 was just served: a turn farther


@pytest.mark.parametrize("policy", NEW)
def test_new_policies_are_in_the_registry_and_online(policy):
    assert policy in EVICTION.available()
    pol = EVICTION.create(policy)
    assert not pol.needs_future and not pol.needs_predictor


@needs_mixtral
@pytest.mark.parametrize("policy", NEW)
def test_grouped_replay_of_new_policies_is_deterministic_and_below_belady(policy):
    """The grouped replay (a layer's experts protected while it computes) runs every new
    policy through the real cache; Belady's hits bound them (no pinning, global pool)."""
    from workbench.replay.engine import replay

    tr = read_jsonl(MIXTRAL, num_experts=8, problem=0)
    kw = dict(cache_slots=64, pinned_layers=0)
    a = replay(tr, eviction=policy, **kw)
    b = replay(tr, eviction=policy, **kw)
    bel = replay(tr, eviction="belady", **kw)
    np.testing.assert_array_equal(a.hits, b.hits)
    assert 0 < int(a.hits.sum()) <= int(bel.hits.sum())


def test_the_kernel_runs_the_new_policies_with_the_policys_constants():
    from workbench.policies.eviction import ReuseETA
    from workbench.replay import kernel as K

    assert K.AGE_CAP == ReuseETA.AGE_CAP
    assert {"least-stale", "reuse-eta", "arc", "s3fifo"} <= set(K.POLICY_CODES)
