"""The simulation core (workbench.sim): the numba kernel equals Simulator.step on generated
traces, the schedule the live runtime executes is consistent, and the core imports no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.policies.eviction import EVICTION
from workbench.replay.engine import replay
from workbench.sim.cache import ExpertCache
from workbench.sim.lane import TRANSFER_ORDERS
from workbench.sim.placement import Placement
from workbench.sim.schedule import Hits, Load, Miss, Prefetch
from workbench.sim.step import Access, Simulator
from workbench.traces.trace import Trace


@st.composite
def traces(draw):
    """A routing trace: S steps (the first a prefill of several tokens), L layers, top-k of E,
    expert ids drawn from a skewed distribution so that caches both hit and miss."""
    E = draw(st.integers(2, 12))
    k = draw(st.integers(1, min(3, E)))
    L = draw(st.integers(1, 4))
    S = draw(st.integers(1, 12))
    prefill = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    T = prefill + S - 1
    p = 1.0 / np.arange(1, E + 1) ** draw(st.sampled_from([0.0, 0.8, 1.5]))
    p /= p.sum()
    ids = np.empty((T, L, k), np.int16)
    for t in range(T):
        for l in range(L):
            ids[t, l] = rng.choice(E, size=k, replace=False, p=p)
    token_step = np.r_[np.zeros(prefill, np.int64), np.arange(1, S, dtype=np.int64)]
    return Trace(topk_ids=ids, token_step=token_step, num_experts=E)


CONFIGS = st.fixed_dictionaries({
    "eviction": st.sampled_from(["lru", "lfu", "belady", "hotness", "least-stale",
                                  "reuse-eta", "arc", "s3fifo"]),
    "prefetch": st.sampled_from(["none", "oracle", "previous-step"]),
    "scope": st.sampled_from(["global", "per-layer"]),
    "extra_slots": st.integers(0, 10),
    "pinned_layers": st.integers(0, 2),
    "prefetch_lead": st.integers(1, 2),
    "prefetch_budget": st.sampled_from([None, 1, 3]),
    "transfer_order": st.sampled_from(TRANSFER_ORDERS),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), cfg=CONFIGS)
def test_kernel_equals_the_core_on_generated_traces(trace, cfg):
    L, k = trace.num_layers, trace.top_k
    pinned = min(cfg["pinned_layers"], L)
    n_off = max(L - pinned, 1)
    per_pool = k + cfg["extra_slots"]
    slots = per_pool * (n_off if cfg["scope"] == "per-layer" else 1)
    kw = dict(eviction=cfg["eviction"], cache_slots=slots, pinned_layers=pinned,
              scope=cfg["scope"], prefetch=cfg["prefetch"], prefetch_lead=cfg["prefetch_lead"],
              prefetch_budget=cfg["prefetch_budget"], target_model="qwen3-vl-30b-a3b",
              transfer_order=cfg["transfer_order"])
    fast, core = replay(trace, engine="fast", **kw), replay(trace, engine="python", **kw)
    for name in ("hits", "misses", "pinned_accesses", "prefetch_loads", "prefetch_hits",
                 "evictions", "redundant", "cancelled"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(core, name), err_msg=name)
    np.testing.assert_allclose(fast.stall_s, core.stall_s, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(fast.step_latency_s, core.step_latency_s, rtol=1e-12,
                               atol=1e-15)
    assert fast.unused_at_end == core.unused_at_end
    # every access is counted exactly once: a cache lookup or a pinned-prefix access
    routed = np.zeros((trace.num_steps, L), np.int64)
    g = trace.groups()
    np.add.at(routed, (g.step, g.layer), np.diff(g.ptr))
    np.testing.assert_array_equal(core.hits + core.misses + core.pinned_accesses, routed)
    assert (core.pinned_accesses[:, pinned:] == 0).all()
    assert (core.hits[:, :pinned] == 0).all() and (core.misses[:, :pinned] == 0).all()


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_the_schedule_is_what_the_live_runtime_can_execute(data):
    """Replaying the schedule on a slot map reproduces the cache: a load goes into a slot no
    expert of the layer still needs, a miss is computed after its load, every routed expert
    is computed exactly once, and the slots the hits name hold those experts."""
    E = data.draw(st.integers(2, 10))
    k = data.draw(st.integers(1, E))
    L = data.draw(st.integers(1, 3))
    slots = data.draw(st.integers(k, k + 6))
    sim = Simulator(Placement.single_device(L, E, k, 0, slots), lambda: EVICTION.create("lru"))
    held: dict[int, tuple[int, int]] = {}  # slot → key, as the live slot pool would hold
    for step in range(data.draw(st.integers(1, 8))):
        for layer in range(L):
            experts = sorted(data.draw(st.sets(st.integers(0, E - 1), min_size=1,
                                               max_size=k)))
            prefetch = data.draw(st.lists(st.tuples(st.integers(0, L - 1),
                                                    st.integers(0, E - 1)), max_size=3))
            out = sim.step(Access(step, layer, experts, [0.0] * len(experts),
                                  prefetch=prefetch))
            computed, loaded = [], set()
            for action in out.schedule:
                if isinstance(action, (Load, Prefetch)):
                    key = (layer, action.expert) if isinstance(action, Load) else action.key
                    slot, victim = action.slot, action.victim
                    assert held.get(slot) == victim  # the slot held the victim (or nothing)
                    if victim is not None:
                        assert victim[0] != layer or victim[1] not in experts \
                            or victim[1] in computed  # never an expert still needed
                    held[slot] = key
                    if isinstance(action, Load):
                        loaded.add(action.expert)
                elif isinstance(action, Hits):
                    assert [held[s] for s in action.slots] == [(layer, e) for e in out.hits]
                    computed.extend(out.hits)
                elif isinstance(action, Miss):
                    assert action.expert in loaded
                    computed.append(action.expert)
            assert sorted(computed) == experts
            cache = sim.pool(layer)
            assert {s: key for s, key in held.items() if cache.slot(key) == s} == \
                {cache.slot(key): key for key in cache.resident()}


def test_pinned_layers_are_accesses_not_hits():
    sim = Simulator(Placement.single_device(3, 4, 2, 1, 4), lambda: EVICTION.create("lru"))
    out = sim.step(Access(0, 0, [1, 2], [0.0, 0.0]))
    assert out.pinned and out.hits == [] and out.misses == []
    c = sim.counters()
    assert c["pinned_accesses"].tolist() == [2, 0, 0] and c["hits"].sum() == 0
    assert sim.residency()[0].all()


def test_the_cache_never_evicts_a_protected_key():
    cache = ExpertCache(2, EVICTION.create("lru"), 1, 4)
    assert cache.admit((0, 0)) == (0, None) and cache.slot((0, 0)) == 0
    cache.admit((0, 1))
    assert cache.admit((0, 2), protected={(0, 0), (0, 1)}) is None
    assert cache.free_slots() == 0 and sorted(cache.resident()) == [(0, 0), (0, 1)]


@pytest.mark.parametrize("module", ["workbench.sim.step", "workbench.sim.placement",
                                    "workbench.sim.costs", "workbench.sim.plan",
                                    "workbench.sim.profiles", "workbench.sim.cache"])
def test_the_core_imports_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
