"""The core's modeled clock (workbench.sim.step) against hand-computed timelines, and the
profiles' figures."""

from types import SimpleNamespace

import numpy as np
import pytest

from workbench.errors import KnobError
from workbench.policies.eviction import EVICTION
from workbench.sim.costs import CostSpec, Prices
from workbench.sim.placement import Placement
from workbench.sim.profiles import (PROFILES, TARGET_MODELS, available_profiles,
                                    get_profile, get_target_model)
from workbench.sim.step import TRANSFER, Access, Simulator

COST = CostSpec(source="test", expert_bytes=1e7, expert_flops_per_token=1e7,
                dense_bytes_per_layer=1e8, dense_flops_per_token_per_layer=1e8)


def _step(layers, T=1):
    """One step whose layer l hits the experts ``layers[l][0]`` (made resident first) and
    misses ``layers[l][1]``, every expert over T tokens."""
    return SimpleNamespace(layers=layers, T=T)


class ModeledClock:
    """Prices a :func:`_step` through the core and writes the step's modeled totals on it."""

    def __init__(self, profile, cost) -> None:
        self.prices = Prices(profile, cost)

    def price(self, ev) -> None:
        p, L = self.prices, len(ev.layers)
        sim = Simulator(Placement.single_device(L, 8, 1, 0, 64), lambda: EVICTION.create("lru"),
                        transfer_s=p.transfer, record_spans=True)
        for layer, (hits, _) in enumerate(ev.layers):
            for e in hits:
                sim.pool(layer).admit((layer, e))
        outs = []
        for layer, (hits, misses) in enumerate(ev.layers):
            experts = sorted(hits + misses)
            outs.append(sim.step(Access(0, layer, experts, [p.expert(ev.T)] * len(experts),
                                        p.dense(ev.T))))
            assert outs[-1].hits == sorted(hits) and outs[-1].misses == sorted(misses)
        ev.latency_modeled_s = sim.lanes.compute
        ev.stall_modeled_s = sum(o.stall_s for o in outs)
        ev.transfer_bytes_modeled = sum(o.moved for o in outs) * int(p.cost.expert_bytes)
        ev.spans = [SimpleNamespace(lane=s[0], start=s[3], end=s[4]) for o in outs
                    for s in o.spans]


def test_all_hits_never_stall_and_sum_compute():
    p = get_profile("a100-40gb")
    ev = _step([([0, 1], []), ([2, 3], [])])
    ModeledClock(p, COST).price(ev)
    dense = p.compute_time(1e8, 1e8)
    expert = p.compute_time(1e7, 1e7)
    assert ev.stall_modeled_s == 0 and ev.transfer_bytes_modeled == 0
    assert ev.latency_modeled_s == pytest.approx(2 * dense + 4 * expert)


def test_a_miss_stalls_by_the_transfer_left_after_the_hits():
    p = get_profile("rtx-3090")
    ev = _step([([0], [5])])
    ModeledClock(p, COST).price(ev)
    dense = p.compute_time(1e8, 1e8)
    expert = p.compute_time(1e7, 1e7)
    xfer = p.transfer_time(int(1e7))
    # the transfer starts when the router is done (after dense work), the hit computes meanwhile
    expected_stall = max(0.0, xfer - expert)
    assert ev.stall_modeled_s == pytest.approx(expected_stall)
    assert ev.latency_modeled_s == pytest.approx(dense + max(xfer, expert) + expert)
    assert ev.transfer_bytes_modeled == int(1e7)


def test_transfers_queue_fifo_on_one_lane():
    p = get_profile("jetson-orin")  # slow SSD link: transfers dominate
    ev = _step([([], [1, 2, 3])])
    ModeledClock(p, COST).price(ev)
    xfer = p.transfer_time(int(1e7))
    transfers = sorted((s.start, s.end) for s in ev.spans if s.lane == TRANSFER)
    assert len(transfers) == 3
    for (s0, e0), (s1, e1) in zip(transfers, transfers[1:]):
        assert s1 == pytest.approx(e0) and e1 - s1 == pytest.approx(xfer)
    assert ev.stall_modeled_s > 2 * xfer


def test_faster_link_never_slower():
    ev = lambda: _step([([0], [1, 2]), ([3], [4, 5, 6])], T=4)  # noqa: E731
    times = {}
    for name in ("jetson-orin", "a100-40gb", "h200"):
        e = ev()
        ModeledClock(get_profile(name), COST).price(e)
        times[name] = e.latency_modeled_s
    assert times["h200"] < times["a100-40gb"] < times["jetson-orin"]


def test_profiles_and_targets_carry_sources_and_the_cited_expert_sizes():
    assert {"a100-40gb", "rtx-3090", "h200", "jetson-orin"} <= set(available_profiles())
    for p in PROFILES.values():
        assert p.sources and p.link_bandwidth > 0 and p.device_flops > 0
        assert p.transfer_time(10**6) == pytest.approx(p.link_latency_s + 1e6 / p.link_bandwidth)
    assert get_target_model("qwen3-vl-30b-a3b").expert_bytes == 17_300_000
    assert get_target_model("deepseek-vl2").expert_bytes == 23_600_000
    for t in TARGET_MODELS.values():
        assert t.sources
    with pytest.raises(KnobError, match="profile 'tpu-v9' is unknown; available: a100-40gb"):
        get_profile("tpu-v9")


def test_target_cost_spec_uses_the_target_sizes():
    t = get_target_model("qwen3-vl-30b-a3b")
    c = CostSpec.from_target(t)
    assert c.expert_bytes == 17.3e6 and c.dense_bytes_per_layer == pytest.approx(4.1e9 / 48)


@pytest.mark.parametrize("prism_offload", [False, True], ids=["experts", "sub-expert keys"])
def test_a_run_without_a_store_builds_no_spans_and_keeps_every_total(embedded, tmp_path,
                                                                     prism_offload):
    """A run without a store books no timeline spans (nothing reads them), yet its modeled
    clock, stalls, transfer bytes and counters are those of the same run recorded, whose
    store holds both clocks' spans — whole experts and sub-expert keys alike."""
    import workbench
    from workbench.prism import refactor as R
    from workbench.runtime import session as S

    R.save(R.random_refactoring(embedded, subexperts=4, seed=2), tmp_path / "p")
    kw = dict(prism=True, prism_offload=True, prism_shortcut=False, prism_k_active=2,
              prism_refactoring=str(tmp_path / "p")) if prism_offload else {}
    rt = workbench.Runtime(embedded, max_new_tokens=4)
    reqs = workbench.mixed_batch(2, seed=3)
    seen = []
    ended = S.RunSession._step_ended

    def spy(self, *a):
        ended(self, *a)
        seen.append((self.recorder is not None, self.offloader.sim.record_spans,
                     len(self.pending[-1].spans)))

    S.RunSession._step_ended = spy
    try:
        bare = rt.run(reqs, record=False, pinned_layers=1, cache_slots=32, **kw)
        kept = rt.run(reqs, store=str(tmp_path / "r.zarr"), pinned_layers=1, cache_slots=32,
                      **kw)
    finally:
        S.RunSession._step_ended = ended
    assert {(r, keep) for r, keep, _ in seen} == {(False, False), (True, True)}
    assert all(n == 0 for r, _, n in seen if not r) and all(n > 0 for r, _, n in seen if r)
    a, b = bare.to_json(), kept.to_json()
    for name in ("token_ids", "hits", "misses", "loads", "evictions", "latency_modeled_s",
                 "stall_modeled_s", "prefill_modeled_s", "transfer_bytes",
                 "transfer_bytes_modeled", "steps"):
        assert a[name] == b[name], name
    assert bare.transfer_bytes > 0 and bare.stall_modeled_s > 0
    from workbench.telemetry.events import CLOCKS, LANES

    ds = workbench.open_run(tmp_path / "r.zarr")
    clocks = set(ds["span_clock"].values.tolist())
    assert clocks == {CLOCKS.index("modeled"), CLOCKS.index("measured")}
    assert LANES.index("transfer") in set(ds["span_lane"].values.tolist())


def test_prices_are_shared_per_profile_and_cost():
    """``Prices.shared`` hands every run of one (profile, cost) pair the same instance, so
    its memos carry over; another pair gets its own; the prices are a fresh instance's."""
    from dataclasses import replace

    a100, h100 = get_profile("a100-40gb"), get_profile("h200")
    p = Prices.shared(a100, COST)
    assert Prices.shared(a100, replace(COST)) is p  # equal pair, another object
    assert Prices.shared(h100, COST) is not p and Prices.shared(a100, None) is not p
    fresh = Prices(a100, COST)
    assert p.expert(7) == fresh.expert(7) and p.dense(3) == fresh.dense(3)
    assert p.subexpert_op(5, 2, 4) == fresh.subexpert_op(5, 2, 4)
    code = np.array([0, 7, 11, 3])
    assert (p.subexperts_coded(code, 4) == fresh.subexperts_coded(code, 4)).all()
