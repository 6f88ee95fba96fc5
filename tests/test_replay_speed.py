"""Issue 11's fast replay paths give exactly the reference answers (correctness only: the speed
figures are in BENCHMARKS.md, measured by benchmarks/bench_replay_speed.py).

- flat LRU / Belady kernels = a textbook OrderedDict LRU / brute-force Belady (and the reference
  Python engine), on seeded random and zipf key sequences, any key values, many slot counts;
- the grouped kernel = the Python engine on generated traces (decode and multi-token steps,
  unrouted slots, pinned layers, both scopes, prefetch, every compiled policy);
- ``Trace.groups()`` = a direct per-(step, layer) count; Belady's future by counting = by sorting.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from conftest import distinct_ids

from workbench.policies.prefetch import PREFETCH
from workbench.replay import kernel as K
from workbench.replay.engine import replay
from workbench.replay.flat import flat_hits
from workbench.traces import Trace

REPO = Path(__file__).resolve().parents[1]


def _zipf_module():
    spec = importlib.util.spec_from_file_location("zipf_trace", REPO / "benchmarks/zipf_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- independent references ----------------------------------------------------------------------
def lru_reference(keys: list[int], slots: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            if len(cache) >= slots:
                cache.popitem(last=False)
            cache[k] = None
    return hits


def belady_reference(keys: list[int], slots: int) -> int:
    """MIN, always admitting: on a miss with a full cache, evict the resident whose next access
    is farthest (found by scanning the rest of the sequence)."""
    cache: set[int] = set()
    hits = 0
    for i, k in enumerate(keys):
        if k in cache:
            hits += 1
            continue
        if len(cache) >= slots:
            def next_access(x: int) -> float:
                for j in range(i + 1, len(keys)):
                    if keys[j] == x:
                        return j
                return float("inf")
            cache.remove(max(cache, key=next_access))
        cache.add(k)
    return hits


def _sequences():
    rng = np.random.default_rng(11)
    for n, universe, alpha in ((0, 1, 1.3), (1, 1, 1.3), (300, 5, 1.1), (400, 40, 1.3),
                               (500, 200, 1.6), (300, 1000, 1.2)):
        ranks = rng.zipf(alpha, n) % universe
        yield f"zipf{alpha}-u{universe}-n{n}", ranks.astype(np.int64)
    yield "uniform", rng.integers(0, 30, 400)
    yield "cyclic", np.tile(np.arange(17), 20)  # LRU's worst case
    # keys far apart and negative: the hash path of the relabelling
    base = rng.integers(0, 25, 300)
    yield "sparse", base * 10**15 - 2**62
    yield "extremes", np.array([2**63 - 1, -2**63, 0, 2**63 - 1, 5, -2**63, 0, 7, 5])


@pytest.mark.parametrize("name,keys", list(_sequences()), ids=lambda v: v if isinstance(v, str)
                         else "")
@pytest.mark.parametrize("slots", [1, 2, 3, 8, 31, 64, 4096])
def test_flat_lru_and_belady_equal_the_textbook_references(name, keys, slots):
    ref = keys.tolist()
    assert flat_hits(keys, slots, "lru") == lru_reference(ref, slots)
    assert flat_hits(keys, slots, "belady") == belady_reference(ref, slots)


@pytest.mark.parametrize("slots", [1, 4, 16, 64])
def test_flat_fast_kernels_equal_the_reference_engine(slots):
    rng = np.random.default_rng(slots)
    keys = rng.zipf(1.3, 600) % 50 * 3 + 1
    for ev in ("lru", "belady"):
        assert flat_hits(keys, slots, ev, engine="fast") == flat_hits(keys, slots, ev,
                                                                      engine="python")


@pytest.mark.parametrize("extra", [0, 1, 1000])
def test_where_every_key_fits_each_policy_misses_only_first_accesses(extra):
    """With at least as many slots as keys no policy evicts (the cache asks for a victim only
    when full), so the fast path answers accesses − distinct keys without a kernel: equal to
    the reference engine's policy objects and to the compiled kernels given the same slots."""
    from workbench.policies.eviction import EVICTION
    from workbench.replay.flat import FLAT_KERNELS

    rng = np.random.default_rng(extra)
    keys = rng.zipf(1.2, 500) % 40 * 7 - 100
    n = len(np.unique(keys))
    for ev in EVICTION.available():
        if EVICTION.get(ev).needs - {"future"}:
            continue  # a predictor's policy needs recorded predictions, not a flat trace
        fast = flat_hits(keys, n + extra, ev)
        assert fast == len(keys) - n
        assert fast == flat_hits(keys, n + extra, ev, engine="python"), ev
        if ev in FLAT_KERNELS:
            ids, n_ids = K.dense_keys(keys)
            assert fast == FLAT_KERNELS[ev](ids, n_ids, n + extra), ev


def test_distinct_at_most_stops_past_its_limit():
    keys = np.array([3, 3, 9, 4, 9, 3, 11], np.int64)
    assert K.distinct_at_most(keys, 4) == 4 and K.distinct_at_most(keys, 10) == 4
    assert K.distinct_at_most(keys, 3) is None
    sparse = keys * 10**15
    assert K.distinct_at_most(sparse, 4) == 4 and K.distinct_at_most(sparse, 3) is None
    assert K.distinct_at_most(np.zeros(0, np.int64), 1) == 0


def test_dense_keys_relabels_in_order_of_first_appearance():
    rng = np.random.default_rng(3)
    for keys in (rng.integers(0, 50, 1000), rng.integers(-2**63, 2**63 - 1, 5000),
                 np.repeat(rng.integers(-2**63, 2**63 - 1, 700), 3)[::-1]):
        ids, n = K.dense_keys(keys)
        _, first = np.unique(keys, return_index=True)
        assert n == len(first)
        order = np.sort(first)  # positions of first appearances, in order
        np.testing.assert_array_equal(ids[order], np.arange(n))
        # same key ↔ same id
        pairs = set(zip(keys.tolist(), ids.tolist()))
        assert len(pairs) == n == len({i for _, i in pairs})


def test_occurrences_by_counting_equal_a_stable_sort():
    rng = np.random.default_rng(5)
    ptr = np.r_[0, np.cumsum(rng.integers(0, 6, 300))]
    keys = rng.integers(0, 40, ptr[-1])
    occ_ptr, occ_grp = K.occurrences(ptr, keys, 40)
    g_of = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
    want_ptr = np.r_[0, np.cumsum(np.bincount(keys, minlength=40))]
    np.testing.assert_array_equal(occ_ptr, want_ptr)
    np.testing.assert_array_equal(occ_grp, g_of[np.argsort(keys, kind="stable")])


# -- generated traces: grouped kernel = Python engine ------------------------------------------
def _traces():
    z = _zipf_module()
    yield "zipf-decode", Trace(topk_ids=z.zipf_routing(60, 4, 16, 3, 1.3, seed=1),
                               token_step=np.arange(60), num_experts=16)
    rng = np.random.default_rng(7)
    T, L, E, k = 240, 3, 24, 4
    ids = z.zipf_routing(T, L, E, k, 1.1, seed=2).astype(np.int64)
    ids[rng.random(ids.shape) < 0.08] = -1  # unrouted slots
    steps = np.cumsum(rng.random(T) < 0.3)  # multi-token steps (prefill-like)
    yield "zipf-multi-token", Trace(topk_ids=ids, token_step=steps - steps[0], num_experts=E)


def _grouped_configs():
    for ev in ("lru", "belady", "lfu", "hotness", "least-stale", "reuse-eta", "arc",
               "s3fifo"):
        for pf, scope, pinned, slots in (("none", "global", 0, 6), ("none", "per-layer", 1, 16),
                                         ("oracle", "global", 1, 10),
                                         ("previous-step", "per-layer", 0, 18)):
            yield ev, pf, scope, pinned, slots


@pytest.mark.parametrize("trace_name,trace", list(_traces()),
                         ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("eviction,prefetch,scope,pinned,slots", list(_grouped_configs()))
def test_grouped_kernel_equals_the_python_engine(trace_name, trace, eviction, prefetch, scope,
                                                 pinned, slots):
    kw = dict(eviction=eviction, cache_slots=slots, pinned_layers=pinned, prefetch=prefetch,
              prefetch_lead=1, scope=scope, target_model="qwen3-vl-30b-a3b",
              transfer_order="fifo")  # (demand-first, both engines: tests/test_transfer_order.py)
    a, b = replay(trace, engine="fast", **kw), replay(trace, engine="python", **kw)
    assert int(a.evictions.sum()) > 0  # the cache really evicts
    for name in ("hits", "misses", "prefetch_loads", "prefetch_hits", "evictions", "redundant"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.stall_s, b.stall_s, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(a.step_latency_s, b.step_latency_s, rtol=1e-12, atol=1e-15)
    assert a.unused_at_end == b.unused_at_end


_FIELDS = ("hits", "misses", "pinned_accesses", "prefetch_loads", "prefetch_hits", "evictions",
           "redundant", "host_runs", "stall_s", "step_latency_s")


@pytest.mark.parametrize("eviction,prefetch,scope,pinned,slots", list(_grouped_configs()))
def test_a_replay_streamed_in_chunks_equals_one_pass(monkeypatch, eviction, prefetch, scope,
                                                     pinned, slots):
    """The fast engine streams a trace in chunks of steps, carrying its state (issue 26):
    chunks of a few accesses — each step its own chunk, steps split nowhere — give every
    per-(step, layer) output of the one-chunk replay, Belady's future and the previous step
    of a chunk's plan included; counts kept narrow (uint8) give the same values."""
    from workbench.replay import engine

    _, trace = list(_traces())[1]  # multi-token steps, unrouted slots
    kw = dict(eviction=eviction, cache_slots=slots, pinned_layers=pinned, prefetch=prefetch,
              prefetch_lead=1, scope=scope, target_model="qwen3-vl-30b-a3b", engine="fast",
              transfer_order="fifo")  # (demand-first in chunks: tests/test_transfer_order.py)
    whole = replay(trace, **kw)
    for chunk, narrow in ((1, False), (7, True), (50, False)):
        monkeypatch.setattr(engine, "CHUNK_ACCESSES", chunk)
        monkeypatch.setattr(engine, "NARROW_CELLS", 0 if narrow else 1 << 22)
        assert len(trace.step_chunks(chunk)) > 3
        part = replay(trace, **kw)
        for name in _FIELDS:
            a, b = getattr(part, name), getattr(whole, name)
            assert (a.dtype == np.uint8) == (narrow and name not in ("stall_s",
                                                                      "step_latency_s")), name
            np.testing.assert_array_equal(a, b, err_msg=f"{name}, chunks of {chunk}")
        assert part.unused_at_end == whole.unused_at_end
        assert part.metrics()["hit_rate"] == whole.metrics()["hit_rate"]


def test_step_chunks_cover_every_step_once():
    _, trace = list(_traces())[1]
    for n in (1, 5, 64, 10**9):
        chunks = trace.step_chunks(n)
        assert chunks[0][0] == 0 and chunks[-1][1] == trace.num_steps
        assert all(a < b for a, b in chunks)
        assert all(chunks[i][1] == chunks[i + 1][0] for i in range(len(chunks) - 1))
    sub = trace.step_slice(3, 9)
    assert sub.num_steps == 6
    np.testing.assert_array_equal(sub.topk_ids, trace.topk_ids[np.isin(trace.token_step,
                                                                       range(3, 9))])


@pytest.mark.parametrize("scope,pinned,slots,prefetch", [("global", 1, 10, "oracle"),
                                                        ("per-layer", 0, 18, "none")])
def test_belady_without_its_tree_equals_the_python_engine(monkeypatch, scope, pinned, slots,
                                                          prefetch):
    """Where packed priorities would not fit (≥ 2^31 groups), Belady scans the pool instead
    of keeping its tree: forced here by lowering the limit."""
    _, trace = list(_traces())[1]
    kw = dict(eviction="belady", cache_slots=slots, pinned_layers=pinned, prefetch=prefetch,
              scope=scope, target_model="qwen3-vl-30b-a3b", transfer_order="fifo")
    b = replay(trace, engine="python", **kw)
    monkeypatch.setattr(K, "TREE_MAX_GROUPS", 0)
    a = replay(trace, engine="fast", **kw)
    for name in ("hits", "misses", "prefetch_loads", "prefetch_hits", "evictions", "redundant"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.unused_at_end == b.unused_at_end


def test_belady_s_future_is_int32_where_every_group_index_fits():
    """4 bytes per access up to 2^31 - 1 groups, 8 beyond (the suite does not compile the
    int64 specialisation of ``_simulate``: the same loop at another dtype, tens of seconds)."""
    assert K.occ_dtype(K.PACK_NEVER - 1) == np.int32 and K.no_future().dtype == np.int32
    assert K.occ_dtype(K.PACK_NEVER) == np.int64


def test_grouped_belady_is_flat_belady_when_every_group_is_one_access():
    """Decode steps of one layer and top-1: the grouped replay is the flat one."""
    z = _zipf_module()
    ids = z.zipf_routing(500, 1, 40, 1, 1.2, seed=4)
    tr = Trace(topk_ids=ids, token_step=np.arange(500), num_experts=40)
    for slots in (1, 5, 20):
        for ev in ("lru", "belady"):
            res = replay(tr, eviction=ev, cache_slots=slots, pinned_layers=0, engine="fast")
            assert int(res.hits.sum()) == flat_hits(ids.reshape(-1), slots, ev)


# -- grouping -----------------------------------------------------------------------------------
def _direct_groups(ids: np.ndarray, steps: np.ndarray, kept: np.ndarray | None):
    """(step, layer, experts ascending, counts, tokens reaching the layer) by plain loops."""
    out = []
    for s in range(int(steps.max()) + 1 if len(steps) else 0):
        toks = np.flatnonzero(steps == s)
        for layer in range(ids.shape[1]):
            counts: dict[int, int] = {}
            reach = 0
            for t in toks:
                routed = [int(e) for e in ids[t, layer] if e >= 0]
                for e in routed:
                    counts[e] = counts.get(e, 0) + 1
                reach += bool(routed) or kept is None or bool(kept[t])
            if counts:
                ex = sorted(counts)
                out.append((s, layer, ex, [counts[e] for e in ex], reach))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_groups_equal_a_direct_count(seed):
    rng = np.random.default_rng(seed)
    T, L = int(rng.integers(1, 120)), int(rng.integers(1, 5))
    K_ = int(rng.integers(1, 5))
    E = int(rng.choice([1, 7, 64, 65, 200]))  # one, several and partial 64-bit words
    ids = distinct_ids(rng, (T, L, K_), E)  # a token's experts at a layer are distinct
    steps = np.cumsum(rng.random(T) < rng.choice([1.0, 0.3, 0.05]))
    steps -= steps[0]
    kept = None
    if seed % 2:
        kept = rng.random(T) < 0.6
        ids[~kept, 1:] = -1  # pruned tokens lose their routing behind the first layer
    g = Trace(topk_ids=ids, token_step=steps, num_experts=E, kept=kept).groups()
    want = _direct_groups(ids, steps, kept)
    assert g.num_groups == len(want)
    for i, (s, layer, ex, cnt, reach) in enumerate(want):
        sl = slice(g.ptr[i], g.ptr[i + 1])
        assert (g.step[i], g.layer[i]) == (s, layer)
        assert g.expert[sl].tolist() == ex and g.expert_tokens[sl].tolist() == cnt
        assert g.layer_tokens[i] == reach
    assert (g.step.dtype, g.layer.dtype, g.ptr.dtype, g.expert.dtype, g.expert_tokens.dtype,
            g.layer_tokens.dtype) == (np.int32, np.int32, np.int64, np.int32, np.int32,
                                      np.int64)


def test_zipf_generator_is_deterministic_and_routes_distinct_experts():
    z = _zipf_module()
    a, b = z.zipf_routing(300, 3, 20, 5, 1.3, seed=9), z.zipf_routing(300, 3, 20, 5, 1.3, seed=9)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int16 and a.shape == (300, 3, 5)
    s = np.sort(a, axis=-1)
    assert (np.diff(s, axis=-1) > 0).all() and a.min() >= 0 and a.max() < 20
    assert not np.array_equal(a, z.zipf_routing(300, 3, 20, 5, 1.3, seed=10))


def test_a_streamed_replay_asks_a_stateful_policy_each_group_once_at_its_global_step(
        monkeypatch):
    """A registered prefetch policy sees the trace's own step numbers and every group exactly
    once, however the replay is chunked (review of issue 26: chunk-local steps changed a
    policy reading ``ctx.step``)."""
    from workbench.policies.prefetch import PREFETCH, PrefetchPolicy
    from workbench.replay import engine

    asked: list[tuple[int, int]] = []

    class EvenSteps(PrefetchPolicy):
        """previous-step's candidates on even steps only; records what it was asked"""

        def candidates(self, ctx):
            asked.append((ctx.step, ctx.layer))
            if ctx.step % 2 or ctx.layer + 1 >= ctx.num_layers:
                return []
            return [(ctx.layer + 1, e) for e in ctx.previous(ctx.layer + 1)]

    monkeypatch.setitem(PREFETCH._classes, "even-steps-test", EvenSteps)
    EvenSteps.name = "even-steps-test"
    _, trace = list(_traces())[1]
    kw = dict(eviction="lru", cache_slots=8, pinned_layers=0, prefetch="even-steps-test",
              target_model="qwen3-vl-30b-a3b", engine="fast", transfer_order="fifo")
    whole = replay(trace, **kw)
    asked_whole = list(asked)
    asked.clear()
    monkeypatch.setattr(engine, "CHUNK_ACCESSES", 7)
    part = replay(trace, **kw)
    assert asked == asked_whole  # the same (step, layer) questions, once each, in order
    assert int(whole.prefetch_loads.sum()) > 0
    for name in _FIELDS:
        np.testing.assert_array_equal(getattr(part, name), getattr(whole, name), err_msg=name)


def test_the_clock_bound_counts_a_groups_prefetch_candidates_not_every_key():
    """Belady keeps its winner tree while the access clock fits 32 bits; the bound of a
    group's prefetch candidates decides it (every key, 6144 for Qwen3-VL, switched the tree off
    past ~15 k decode steps: 4× slower)."""
    from workbench.knobs import Knobs
    from workbench.replay.engine import _candidates_per_group

    E, nk = 128, 48 * 128
    for pf, lead, budget, want in (("none", 1, None, 0), ("previous-step", 1, None, E),
                                   ("previous-step", 3, None, 3 * E),
                                   ("previous-step", 3, 5, 5), ("oracle", 2, None, 2 * E),
                                   ("vismmoe", 1, None, 20)):
        k = Knobs(prefetch=pf, prefetch_lead=lead, prefetch_budget=budget)
        policy = PREFETCH.create(pf, **k.to_dict())
        assert _candidates_per_group(policy, k, E, nk) == want, pf


def test_belady_reads_compact_keys_as_they_are():
    """A compact trace (10⁹ uint16 keys are 2 GB, 8 GB as int64) is replayed as it is: the same
    hits as its int64 copy, and besides the keys Belady allocates 4 bytes per access (the
    next-access array) and tables over the key range, nothing per access more. (One width
    here: each width compiles the kernels again, seconds of the suite's cold start.)"""
    import tracemalloc

    rng = np.random.default_rng(3)
    keys64 = (rng.zipf(1.2, 200_000) % 100).astype(np.int64) + 900
    keys = keys64.astype(np.uint16)
    for slots in (1, 7, 40):
        assert flat_hits(keys, slots, "belady") == flat_hits(keys64, slots, "belady")
        assert flat_hits(keys, slots, "lru") == flat_hits(keys64, slots, "lru")  # LRU reads
    assert flat_hits(keys[:500], 9, "belady") == belady_reference(keys[:500].tolist(), 9)
    assert flat_hits(keys[:500], 9, "lru") == lru_reference(keys[:500].tolist(), 9)  # them too
    assert K.distinct_at_most(keys, 1000) == len(np.unique(keys64))
    tracemalloc.start()
    try:
        flat_hits(keys, 16, "belady")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 4 * len(keys) <= peak <= 4 * len(keys) + (1 << 20), peak  # the int32 next accesses


def test_belady_and_lru_relabel_keys_too_sparse_for_a_table():
    keys = np.array([7, 2**40, 7, -3, 2**40, 9, -3, 7], np.int64)  # a range far past the trace
    for slots in (1, 2, 3):
        assert flat_hits(keys, slots, "belady") == belady_reference(keys.tolist(), slots)
        assert flat_hits(keys, slots, "lru") == lru_reference(keys.tolist(), slots)


@pytest.mark.parametrize("seed", range(4))
def test_belady_bitmap_equals_the_textbook_belady_across_levels(seed):
    """The bitmap of next uses (one level per 64× the accesses) gives the textbook Belady's
    hits on traces long enough for two and three levels, keys never used again among them."""
    rng = np.random.default_rng(seed)
    for n in (1, 63, 64, 65, 700, 4097, 6000):
        keys = (rng.zipf(1.3, n) % int(rng.integers(2, 60))).astype(np.int64)
        slots = int(rng.integers(1, 12))
        assert flat_hits(keys, slots, "belady") == belady_reference(keys.tolist(), slots), n
