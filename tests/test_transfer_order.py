"""Transfer order (issue 39 §1): ``fifo`` and ``demand-first`` on the modeled transfer lane.

What is proved and held here:
- without prefetch both orders are the same lane: every count and modeled time identical, in
  replay (both engines) and live;
- demand-first: a demand load waits for at most one prefetch — it starts less than one
  transfer time after max(its issue time, the previous demand load's end) — whatever the
  prefetches queued (FIFO has no such bound: it waits for all of them);
- a prefetch not started when its layer has run is cancelled and its slot freed;
- live = replay stays exact under demand-first.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.errors import KnobError
from workbench.knobs import Knobs
from workbench.policies.eviction import EVICTION
from workbench.replay.engine import replay
from workbench.sim.lane import TRANSFER_ORDERS, TransferLane
from workbench.sim.placement import Placement
from workbench.sim.schedule import Cancelled
from workbench.sim.step import Access, Simulator

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
def test_demand_first_with_prefetch_runs_on_the_python_engine(prefetch):
    tr = _trace()
    kw = dict(cache_slots=96, pinned_layers=2, target_model="qwen3-vl-30b-a3b", prefetch=prefetch,
              prefetch_lead=2)
    fifo = replay(tr, transfer_order="fifo", **kw)
    df = replay(tr, transfer_order="demand-first", **kw)
    assert fifo.config["engine"] == "fast" and df.config["engine"] == "python"
    m_f, m_d = fifo.metrics(), df.metrics()
    assert m_f["cancelled_prefetches"] == 0
    assert m_d["transfers"] == m_d["demand_loads"] + m_d["prefetch_loads"] \
        - m_d["cancelled_prefetches"]
    with pytest.raises(KnobError, match="no compiled replay"):
        replay(tr, transfer_order="demand-first", engine="fast", **kw)


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
    rep = ds.moe.replay()
    assert rep.config["transfer_order"] == "demand-first" and rep.config["engine"] == "python"
    assert_replays_live(rep, ds)
    assert res.cancelled_prefetches > 0  # the exactness covers cancellations
    assert int(rep.cancelled.sum()) == res.cancelled_prefetches
    assert rep.loads == res.loads


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
