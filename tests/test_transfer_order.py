"""Transfer order (issue 39 §1): ``fifo`` and ``demand-first`` on the modeled transfer lane.

What is proved and held here:
- without prefetch both orders are the same lane: every count and modeled time identical, in
  replay (both engines) and live;
- demand-first: a demand load waits for at most one prefetch — it starts less than one
  transfer time after max(its issue time, the previous demand load's end) — whatever the
  prefetches queued (FIFO has no such bound: it waits for all of them);
- a prefetch not started when its layer has run is cancelled and its slot freed;
- live = replay stays exact under demand-first;
- the compiled replay (numba kernel) = the python engine under both orders: every count
  (cancelled prefetches included) and modeled time identical, for every compiled eviction
  policy × every prefetch policy the trace can plan, on the shared Mixtral trace, generated
  traces (decode and multi-token steps, streamed in chunks too) and a store of the embedded
  model.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.errors import KnobError
from workbench.knobs import Knobs
from workbench.policies.eviction import EVICTION
from workbench.replay import kernel as K
from workbench.replay.engine import replay
from workbench.sim.lane import TRANSFER_ORDERS, TransferLane
from workbench.sim.placement import Placement
from workbench.sim.schedule import Cancelled
from workbench.sim.step import Access, Simulator
from workbench.traces import Trace

SHARED = Path(os.environ.get("WORKBENCH_SHARED", Path(__file__).resolve().parents[2] / "shared"))
MIXTRAL = SHARED / "data" / "traces" / "mixtral-8x7b-vllm" / "humaneval_2_routing.jsonl"


# -- the knob -----------------------------------------------------------------------------------
def test_the_knob_offers_the_lane_orders_and_refuses_others_in_one_line():
    k = Knobs()
    assert tuple(k.group("prefetch").param["transfer_order"].objects) == TRANSFER_ORDERS
    with pytest.raises(KnobError) as e:
        Knobs(transfer_order="lifo")
    assert "transfer_order" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(KnobError):
        Knobs().set_from_strings(["transfer_order=random"])
    assert Knobs().set_from_strings(["transfer_order=demand-first"]).transfer_order \
        == "demand-first"


def test_a_store_without_the_knob_reads_as_fifo():
    attrs = {k: v for k, v in Knobs(transfer_order="demand-first").to_attrs().items()
             if k != "knob.transfer_order"}
    assert Knobs.from_attrs(attrs).transfer_order == "fifo"
    assert Knobs.from_attrs(Knobs(transfer_order="demand-first").to_attrs()).transfer_order \
        == "demand-first"


# -- the lane -----------------------------------------------------------------------------------
events = st.lists(st.tuples(st.booleans(), st.floats(0, 5), st.integers(0, 3)), min_size=1,
                  max_size=40)


def _drive(lane: TransferLane, seq, x: float):
    """Feed ``seq`` (is demand, time gap, layer) to ``lane``; returns per demand (issue time,
    start, end)."""
    starts: dict = {}
    demands = []
    t = 0.0
    for i, (is_demand, gap, layer) in enumerate(seq):
        t += gap
        key = (layer, i)
        rec = lambda k, s, e: starts.__setitem__(k, (s, e))  # noqa: E731
        if is_demand:
            lane.demand(key, t, rec)
            demands.append((t, *starts[key]))
        else:
            lane.prefetch(key, t, layer, rec)
    return demands


@settings(max_examples=200, deadline=None)
@given(events, st.floats(0.1, 3))
def test_demand_first_waits_for_at_most_one_prefetch(seq, x):
    prev_end = 0.0
    for t, start, end in _drive(TransferLane(x, "demand-first"), seq, x):
        base = max(t, prev_end)
        # at most one transfer in its way (≤: base + x rounds to the in-flight copy's end when
        # base is far below x, e.g. 1e-81 + 1.0 == 1.0)
        assert base <= start <= base + x
        assert end == start + x
        prev_end = end


@settings(max_examples=200, deadline=None)
@given(events, st.floats(0.1, 3))
def test_no_demand_lands_later_than_under_fifo_when_only_demands_queue(seq, x):
    """Demands only: both orders are the same lane."""
    seq = [(True, g, lay) for _, g, lay in seq]
    assert _drive(TransferLane(x, "fifo"), seq, x) == _drive(TransferLane(x, "demand-first"),
                                                              seq, x)


def test_fifo_makes_a_demand_wait_for_every_queued_prefetch():
    seq = [(False, 0.0, 1), (False, 0.0, 1), (False, 0.0, 1), (True, 0.5, 1)]
    (t, start, _), = _drive(TransferLane(1.0, "fifo"), seq, 1.0)
    assert start == 3.0  # behind three prefetches
    (t, start, _), = _drive(TransferLane(1.0, "demand-first"), seq, 1.0)
    assert start == 1.0  # behind the one in flight only


def test_the_lane_refuses_an_unknown_order():
    with pytest.raises(ValueError, match="transfer_order"):
        TransferLane(1.0, "lifo")


# -- the simulator ------------------------------------------------------------------------------
def _sim(order: str, slots: int = 6) -> Simulator:
    return Simulator(Placement.single_device(3, 8, 2, 0, slots), lambda: EVICTION.create("lru"),
                     transfer_s=1.0, record_spans=True, transfer_order=order)


def test_demand_first_serves_the_miss_before_the_prefetches_and_cancels_unused_ones():
    fifo, df = _sim("fifo"), _sim("demand-first")
    for sim in (fifo, df):
        # layer 0: miss 0, 1; prefetch four experts of layer 1 (only 4 will be used)
        sim.step(Access(0, 0, [0, 1], [0.1, 0.1], prefetch=[(1, 4), (1, 5), (1, 6), (1, 7)]))
    # layer 1 routes to expert 4 (prefetched) and 2 (a miss)
    a = fifo.step(Access(0, 1, [2, 4], [0.1, 0.1]))
    b = df.step(Access(0, 1, [2, 4], [0.1, 0.1]))
    assert a.misses == b.misses == [2]
    assert b.end_s < a.end_s  # the miss no longer waits behind the unused prefetches
    assert a.cancelled == [] and sorted(b.cancelled) == [(1, 6), (1, 7)]
    assert [x for x in b.schedule if type(x) is Cancelled] == [Cancelled((1, 6)),
                                                               Cancelled((1, 7))]
    assert not df.is_resident((1, 6)) and fifo.is_resident((1, 6))
    assert int(df.counters()["cancelled"].sum()) == 2
    # copies made: fifo 2 + 4 + 1; demand-first two fewer
    assert int(fifo.counters()["loads"].sum()) == 7 and int(df.counters()["loads"].sum()) == 5


# -- replay -------------------------------------------------------------------------------------
def _trace():
    if not MIXTRAL.exists():
        pytest.skip(f"shared traces not found at {MIXTRAL}")
    from workbench.traces import read_jsonl

    return read_jsonl(MIXTRAL)


def _same(a, b):
    for name in ("hits", "misses", "evictions", "prefetch_loads", "prefetch_hits", "redundant",
                 "cancelled"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_array_equal(a.step_latency_s, b.step_latency_s)
    np.testing.assert_array_equal(a.stall_s, b.stall_s)


@pytest.mark.parametrize("engine", ["fast", "python"])
def test_without_prefetch_both_orders_replay_identically(engine):
    tr = _trace()
    kw = dict(cache_slots=96, pinned_layers=2, target_model="qwen3-vl-30b-a3b", engine=engine)
    _same(replay(tr, transfer_order="fifo", **kw), replay(tr, transfer_order="demand-first", **kw))


@pytest.mark.parametrize("prefetch", ["previous-step", "oracle"])
def test_demand_first_with_prefetch_runs_on_the_compiled_engine(prefetch):
    tr = _trace()
    kw = dict(cache_slots=96, pinned_layers=2, target_model="qwen3-vl-30b-a3b", prefetch=prefetch,
              prefetch_lead=2)
    fifo = replay(tr, transfer_order="fifo", **kw)
    df = replay(tr, transfer_order="demand-first", **kw)
    assert fifo.config["engine"] == df.config["engine"] == "fast"
    assert replay(tr, transfer_order="demand-first", engine="python",
                  **kw).config["engine"] == "python"  # the reference stays selectable
    m_f, m_d = fifo.metrics(), df.metrics()
    assert m_f["cancelled_prefetches"] == 0
    assert m_d["transfers"] == m_d["demand_loads"] + m_d["prefetch_loads"] \
        - m_d["cancelled_prefetches"]


# -- the compiled lane = the reference lane -----------------------------------------------------
_COUNTS = ("hits", "misses", "pinned_accesses", "evictions", "prefetch_loads", "prefetch_hits",
           "redundant", "host_runs", "cancelled")


def _engines_agree(trace, **kw):
    """Replay ``trace`` under ``kw`` on both engines: every per-(step, layer) count, the
    modeled stall and step latency, the residents never used and every metric but the measured
    ones are identical (not close: the kernel does the same float operations in the same
    order). Returns the python engine's result."""
    a = replay(trace, engine="fast", **kw)
    b = replay(trace, engine="python", **kw)
    assert (a.config["engine"], b.config["engine"]) == ("fast", "python")
    for name in _COUNTS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_array_equal(a.stall_s, b.stall_s, err_msg="stall_s")
    np.testing.assert_array_equal(a.step_latency_s, b.step_latency_s, err_msg="latency")
    assert a.unused_at_end == b.unused_at_end
    measured = ("replay_s_measured", "accesses_per_s_measured")
    ma, mb = a.metrics(), b.metrics()
    assert {k: v for k, v in ma.items() if k not in measured} \
        == {k: v for k, v in mb.items() if k not in measured}
    return b


@pytest.fixture(scope="module")
def mixtral_head():
    """The shared Mixtral trace's first 60 decode steps (32 layers × 8 experts, top-2)."""
    return _trace().step_slice(0, 60)


@pytest.mark.parametrize("order", TRANSFER_ORDERS)
@pytest.mark.parametrize("prefetch,scope,slots", [("previous-step", "global", 24),
                                                  ("oracle", "per-layer", 64)])
@pytest.mark.parametrize("eviction", sorted(K.POLICY_CODES))
def test_compiled_lane_equals_the_python_engine_on_mixtral(mixtral_head, eviction, prefetch,
                                                           scope, slots, order):
    """(The trace carries no router lookahead: previous-step and oracle are the prefetchers it
    can plan.)"""
    ref = _engines_agree(mixtral_head, eviction=eviction, prefetch=prefetch, scope=scope,
                         cache_slots=slots, pinned_layers=1, prefetch_lead=2,
                         target_model="qwen3-vl-30b-a3b", transfer_order=order)
    if order == "fifo":
        assert int(ref.cancelled.sum()) == 0
    elif prefetch == "previous-step":  # every policy cancels here: the kernel's cancels ran
        assert int(ref.cancelled.sum()) > 0


def _zipf_routing(*args, **kw):
    spec = importlib.util.spec_from_file_location(
        "zipf_trace", Path(__file__).resolve().parents[1] / "benchmarks/zipf_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.zipf_routing(*args, **kw)


def _lookahead(rng, topk: np.ndarray, E: int, depth: int, hit: float) -> np.ndarray:
    """Router lookahead ``[token, layer, depth, k]`` for ``topk`` ``[token, layer, k]``: the
    true experts of layer ``l + 1 + d`` with probability ``hit`` per slot, else a random
    expert (-1 past the last layer), distinct within each (token, layer, depth)."""
    T, L, k = topk.shape
    out = np.full((T, L, depth, k), -1, np.int64)
    for d in range(depth):
        nxt = topk[:, 1 + d:].astype(np.int64)
        guess = np.argsort(rng.random((T, L - 1 - d, E)), -1)[..., :k]
        pick = np.where(rng.random(nxt.shape) < hit, nxt, guess)
        for j in range(1, k):  # keep them distinct: a repeat falls back to the random guess
            dup = (pick[..., j:j + 1] == pick[..., :j]).any(-1)
            pick[..., j] = np.where(dup, -1, pick[..., j])
        out[:, :L - 1 - d, d] = pick
    return out


def _generated():
    """Two small zipf traces with router lookahead: decode (a token a step) and multi-token
    steps with unrouted slots."""
    rng = np.random.default_rng(39)
    T, L, E, k = 60, 4, 16, 3
    ids = _zipf_routing(T, L, E, k, 1.3, seed=1).astype(np.int64)
    yield "zipf-decode", Trace(topk_ids=ids, token_step=np.arange(T), num_experts=E,
                               pred_ids=_lookahead(rng, ids, E, 2, 0.6))
    T, L, E, k = 240, 3, 24, 4
    ids = _zipf_routing(T, L, E, k, 1.1, seed=2).astype(np.int64)
    look = _lookahead(rng, ids, E, 2, 0.5)
    ids[rng.random(ids.shape) < 0.08] = -1  # unrouted slots
    steps = np.cumsum(rng.random(T) < 0.3)  # multi-token steps (prefill-like)
    yield "zipf-multi-token", Trace(topk_ids=ids, token_step=steps - steps[0], num_experts=E,
                                    pred_ids=look)


_GENERATED = dict(_generated())


@pytest.mark.parametrize("order", TRANSFER_ORDERS)
@pytest.mark.parametrize("prefetch,scope,pinned,slots",
                         [("speculative", "global", 1, 8), ("apex", "per-layer", 0, 16),
                          ("previous-step", "global", 0, 10), ("oracle", "per-layer", 1, 12)])
@pytest.mark.parametrize("eviction", sorted(K.POLICY_CODES))
@pytest.mark.parametrize("name", sorted(_GENERATED))
def test_compiled_lane_equals_the_python_engine_on_generated_traces(name, eviction, prefetch,
                                                                    scope, pinned, slots, order):
    ref = _engines_agree(_GENERATED[name], eviction=eviction, prefetch=prefetch, scope=scope,
                         cache_slots=slots, pinned_layers=pinned, prefetch_lead=2,
                         target_model="qwen3-vl-30b-a3b", transfer_order=order)
    assert int(ref.evictions.sum()) > 0 and int(ref.prefetch_loads.sum()) > 0


def test_the_generated_traces_reach_both_kinds_of_cancellation(monkeypatch):
    """The equality above covers the lane's two cancellations: a pending prefetch evicted
    before its copy started (Simulator._unqueue), and one whose layer ran first (at a group's
    end, Simulator._end)."""
    seen = {"evicted": 0, "layer ran": 0}
    unqueue, cancel = Simulator._unqueue, TransferLane.cancel

    def counting_unqueue(self, out, key, now):
        got = unqueue(self, out, key, now)
        seen["evicted"] += got
        return got

    def counting_cancel(self, now, ran_layer, key, on_start):
        gone = cancel(self, now, ran_layer, key, on_start)
        if ran_layer is not None:
            seen["layer ran"] += len(gone)
        return gone

    monkeypatch.setattr(Simulator, "_unqueue", counting_unqueue)
    monkeypatch.setattr(TransferLane, "cancel", counting_cancel)
    for eviction in ("lru", "belady", "arc", "s3fifo"):
        replay(_GENERATED["zipf-decode"], engine="python", eviction=eviction,
               prefetch="apex", scope="per-layer", cache_slots=16, prefetch_lead=2,
               target_model="qwen3-vl-30b-a3b", transfer_order="demand-first")
    assert seen["evicted"] > 0 and seen["layer ran"] > 0, seen


@pytest.mark.parametrize("eviction", sorted(K.POLICY_CODES))
def test_demand_first_streamed_in_chunks_equals_one_pass(monkeypatch, eviction):
    """The pending prefetches (and their issue times) carry from chunk to chunk: chunks of a
    few accesses give the one-chunk replay's every output."""
    from workbench.replay import engine

    trace = _GENERATED["zipf-multi-token"]
    kw = dict(eviction=eviction, cache_slots=10, pinned_layers=0, prefetch="apex",
              prefetch_lead=2, scope="global", target_model="qwen3-vl-30b-a3b", engine="fast",
              transfer_order="demand-first")
    whole = replay(trace, **kw)
    assert int(whole.cancelled.sum()) > 0
    for chunk in (1, 7):
        monkeypatch.setattr(engine, "CHUNK_ACCESSES", chunk)
        part = replay(trace, **kw)
        for name in (*_COUNTS, "stall_s", "step_latency_s"):
            np.testing.assert_array_equal(getattr(part, name), getattr(whole, name),
                                          err_msg=f"{name}, chunks of {chunk}")
        assert part.unused_at_end == whole.unused_at_end


@pytest.mark.parametrize("priced", [True, False])
def test_demand_first_belady_without_its_tree_and_unpriced_replays_agree(monkeypatch, priced):
    """Belady scanning its pool (no winner tree: forced by lowering the limit) frees a cancelled
    prefetch's slot as the tree does; a trace with no model sizes (every transfer 0 s, times
    unavailable) cancels the same way on both engines."""
    trace = _GENERATED["zipf-decode"]
    kw = dict(eviction="belady", cache_slots=10, prefetch="apex", prefetch_lead=2,
              transfer_order="demand-first")
    if priced:
        kw["target_model"] = "qwen3-vl-30b-a3b"
        monkeypatch.setattr(K, "TREE_MAX_GROUPS", 0)
    ref = _engines_agree(trace, **kw)
    assert int(ref.cancelled.sum()) > 0


@pytest.fixture(scope="module")
def embedded_store(embedded, demo_inputs, tmp_path_factory):
    """A stored run of the embedded model (6 tokens, router lookahead recorded)."""
    import workbench

    image, prompt, _ = demo_inputs[2]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=6, ignore_eos=True)
    path = tmp_path_factory.mktemp("df") / "run.zarr"
    rt.run(prompt, [image], store=path, cache_slots=16, lookahead_depth=2)
    return path


@pytest.mark.parametrize("order", TRANSFER_ORDERS)
@pytest.mark.parametrize("prefetch", ["speculative", "apex", "previous-step", "oracle"])
@pytest.mark.parametrize("eviction", sorted(K.POLICY_CODES))
def test_compiled_lane_equals_the_python_engine_on_an_embedded_store(embedded_store, eviction,
                                                                     prefetch, order):
    from workbench.traces import from_store

    _engines_agree(from_store(embedded_store), eviction=eviction, prefetch=prefetch,
                   cache_slots=16, pinned_layers=1, prefetch_lead=2, transfer_order=order)


# -- live ---------------------------------------------------------------------------------------
def test_live_without_prefetch_is_the_same_under_both_orders(embedded, demo_inputs):
    import workbench

    image, prompt, _ = demo_inputs[1]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=4, ignore_eos=True)
    runs = [rt.run(prompt, [image], record=False, cache_slots=12, transfer_order=o)
            for o in TRANSFER_ORDERS]
    a, b = runs
    assert a.token_ids == b.token_ids
    for f in ("hits", "misses", "loads", "evictions", "latency_modeled_s", "stall_modeled_s",
              "transfer_bytes_modeled", "cancelled_prefetches"):
        assert getattr(a, f) == getattr(b, f), f


@pytest.mark.parametrize("prefetch,lead,slots", [("previous-step", 2, 16),
                                                  ("speculative", 1, 20)])
def test_live_demand_first_equals_replay(embedded, demo_inputs, tmp_path, prefetch, lead, slots,
                                         assert_replays_live):
    import workbench
    from workbench.analysis import open_run

    image, prompt, _ = demo_inputs[2]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=6, ignore_eos=True)
    path = tmp_path / "df.zarr"
    plain = rt.run(prompt, [image], record=False, cache_slots=slots)
    res = rt.run(prompt, [image], store=path, prefetch=prefetch, prefetch_lead=lead,
                 cache_slots=slots, pinned_layers=1, lookahead_depth=2,
                 transfer_order="demand-first")
    assert res.token_ids == plain.token_ids  # the order changes no answer
    ds = open_run(path)
    assert int(ds["prefetches"].sum()) > 0
    assert res.cancelled_prefetches > 0  # the exactness covers cancellations
    for engine in ("fast", "python"):  # (the compiled engine is auto's choice)
        rep = ds.moe.replay(engine=engine)
        assert rep.config["transfer_order"] == "demand-first" and rep.config["engine"] == engine
        assert_replays_live(rep, ds)
        assert int(rep.cancelled.sum()) == res.cancelled_prefetches
        assert rep.loads == res.loads
    assert ds.moe.replay().config["engine"] == "fast"


steps_st = st.lists(st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=3,
                                                unique=True),
                                       st.lists(st.tuples(st.integers(0, 3),
                                                          st.integers(0, 7)), max_size=5)),
                             min_size=4, max_size=4), min_size=1, max_size=6)


@settings(max_examples=120, deadline=None)
@given(steps_st, st.integers(3, 10), st.sampled_from(["lru", "lfu", "hotness"]))
def test_demand_first_keeps_the_cache_consistent_and_bounds_each_demand(steps, slots, policy):
    """Random steps of 4 layers (routed experts, prefetch candidates of any layer):
    demand-first's pending prefetches are resident keys, a cancelled key is not resident, the
    counters add up, and each demand copy starts less than one transfer time after max(its
    issue, the previous demand copy's end)."""
    from workbench.sim.step import COMPUTE, TRANSFER

    sim = Simulator(Placement.single_device(4, 8, 3, 0, slots), lambda: EVICTION.create(policy),
                    transfer_s=1.0, record_spans=True, transfer_order="demand-first")
    prev_end = 0.0
    issued = cancelled = 0
    for s, layers in enumerate(steps):
        for layer, (experts, pf) in enumerate(layers):
            experts = sorted(experts)
            o = sim.step(Access(s, layer, experts, [0.3] * len(experts), dense_s=0.2,
                                prefetch=[p for p in pf if p[0] > layer]))
            issued += len(o.prefetched)
            cancelled += len(o.cancelled)
            demand = {(layer, e) for e in o.misses}
            # demand copies are issued at the end of the layer's dense work
            issue = next(sp[4] for sp in o.spans if sp[0] == COMPUTE and sp[2] == -1)
            for lane, lay, e, start, end in o.spans:
                if lane == TRANSFER and (lay, e) in demand:
                    base = max(issue, prev_end)
                    assert base - 1e-9 <= start < base + 1.0 - 1e-9 or abs(start - base) < 1e-9
                    prev_end = end
            for key, _, _ in sim.lane.pending:
                assert sim.is_resident(key)
            for key in o.cancelled:
                assert not sim.is_resident(key) or key in demand or key in o.prefetched
            c = sim.counters()
            assert int(c["cancelled"].sum()) == cancelled
    assert cancelled <= issued
