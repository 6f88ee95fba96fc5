"""The offload unit (issue 39 §2): ``expert`` (the per-expert cache, the default), ``layerwise``
(accelerate's hooks: a layer's E experts copied in, the layer waits for all, nothing kept) and
``layerwise-prefetch`` (the next layer copied while this one computes), in the core
(:mod:`workbench.sim.unit`), live and in replay.

Held here: the knob (values, default, old stores read as ``expert``, bad combinations refused
in one line, the CLI exits 2); the core's counts (loads = E × offloaded layers × steps, hits 0
under ``layerwise``) and clock (``layerwise`` waits for its whole unit; prefetch never makes it
slower); live = replay exactly for each value on the embedded model, the same tokens under the
three values, ``layerwise`` modeled latency ≥ ``expert``'s and ``layerwise-prefetch`` ≤
``layerwise``'s on the real store.
"""

from __future__ import annotations

import numpy as np
import pytest

from workbench.errors import KnobError
from workbench.knobs import Knobs, ModelShape
from workbench.replay.engine import replay
from workbench.sim.placement import Placement
from workbench.sim.schedule import Freed, LayerUnit, Prefetch
from workbench.sim.step import Access, Simulator
from workbench.sim.unit import OFFLOAD_UNITS
from workbench.traces import Trace

UNITS = OFFLOAD_UNITS


# -- the knob -----------------------------------------------------------------------------------
def test_the_knob_offers_the_units_defaults_to_expert_and_old_stores_read_as_expert():
    k = Knobs()
    assert k.offload_unit == "expert"
    assert tuple(k.group("cache").param["offload_unit"].objects) == UNITS
    with pytest.raises(KnobError) as e:
        Knobs(offload_unit="module")
    assert "offload_unit" in str(e.value) and "\n" not in str(e.value)
    attrs = {a: v for a, v in Knobs(offload_unit="layerwise").to_attrs().items()
             if a != "knob.offload_unit"}
    assert Knobs.from_attrs(attrs).offload_unit == "expert"
    assert Knobs.from_attrs(Knobs(offload_unit="layerwise").to_attrs()).offload_unit \
        == "layerwise"


SHAPE = ModelShape(num_layers=4, top_k=2, num_experts=8)


@pytest.mark.parametrize("unit", UNITS[1:])
@pytest.mark.parametrize("bad,fragment", [
    (dict(prefetch="oracle"), "prefetch must be 'none'"),
    (dict(hybrid=True), "hybrid must be False"),
    (dict(active_evict=True, lookahead_depth=1), "active_evict must be False"),
    (dict(cache_routing=True), "cache_routing must be False"),
    (dict(cache_slots=7), "needs at least"),
])
def test_bad_combinations_are_refused_in_one_line(unit, bad, fragment):
    k = Knobs(offload_unit=unit, **{"cache_slots": 16, "pinned_layers": 1, **bad})
    with pytest.raises(KnobError) as e:
        k.check(SHAPE, live=False)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert f"offload_unit={unit!r}" in str(e.value)


def test_prefetch_needs_two_layers_of_slots_unless_one_layer_is_offloaded():
    Knobs(offload_unit="layerwise", cache_slots=8).check(SHAPE, live=False)
    with pytest.raises(KnobError, match="two layers' experts"):
        Knobs(offload_unit="layerwise-prefetch", cache_slots=15).check(SHAPE, live=False)
    Knobs(offload_unit="layerwise-prefetch", cache_slots=16).check(SHAPE, live=False)
    Knobs(offload_unit="layerwise-prefetch", cache_slots=8, pinned_layers=3).check(
        SHAPE, live=False)


# -- the core -----------------------------------------------------------------------------------
def _trace(S=5, L=4, E=8, K=2, seed=0) -> Trace:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(S * L)]).reshape(S, L, K)
    return Trace(topk_ids=ids.astype(np.int16), token_step=np.arange(S), num_experts=E)


@pytest.mark.parametrize("pinned", [0, 1])
def test_counts_layerwise_loads_every_expert_of_every_offloaded_layer_and_hits_nothing(pinned):
    tr = _trace()
    S, L, E = tr.num_steps, tr.num_layers, tr.num_experts
    r = {u: replay(tr, offload_unit=u, cache_slots=16, pinned_layers=pinned,
                   expert_bytes=1e6).metrics() for u in UNITS}
    lw, pf = r["layerwise"], r["layerwise-prefetch"]
    assert lw["transfers"] == pf["transfers"] == E * (L - pinned) * S
    assert lw["hits"] == 0 and lw["misses"] == r["expert"]["accesses"]
    # every unrouted copy is unused: the over-fetch is the redundant share
    assert lw["redundant_transfers"] == lw["transfers"] - lw["misses"]
    assert lw["evictions"] == lw["transfers"]
    # the prefetched units: their routed experts are hits on a prefetch; the first
    # offloaded layer of a step is prefetched only behind a pinned layer
    assert pf["hits"] == pf["prefetch_hits"]
    assert pf["misses"] == (0 if pinned else lw["misses"] - pf["hits"])
    assert lw["latency_s"] >= r["expert"]["latency_s"]
    assert pf["latency_s"] <= lw["latency_s"]


def test_layerwise_waits_for_the_whole_unit_and_frees_it_at_the_layers_end():
    from workbench.policies.eviction import EVICTION

    E, x = 4, 1.0
    sim = Simulator(Placement.single_device(2, E, 1, 0, 8), lambda: EVICTION.create("lru"),
                    transfer_s=x, offload_unit="layerwise")
    o = sim.step(Access(step=0, layer=0, experts=[2], compute_s=[0.5], dense_s=0.25))
    assert o.hits == [] and o.misses == [2] and o.moved == E
    assert o.stall_s == pytest.approx(E * x)  # the unit, not the one routed expert
    assert o.end_s == pytest.approx(0.25 + E * x + 0.5)
    kinds = [type(a) for a in o.schedule]
    assert kinds == [Prefetch] * E + [LayerUnit] + [Freed] * E
    assert sim.residency().sum() == 0  # nothing kept across layers
    assert len(o.redundant) == E - 1 and len(o.evicted) == E


def test_layerwise_prefetch_overlaps_the_next_layers_copy_with_this_layers_compute():
    from workbench.policies.eviction import EVICTION

    E, x = 4, 1.0
    sims = {u: Simulator(Placement.single_device(3, E, 1, 1, 8), lambda: EVICTION.create("lru"),
                         transfer_s=x, offload_unit=u) for u in UNITS[1:]}
    ends = {}
    for u, sim in sims.items():
        for layer in range(3):
            o = sim.step(Access(step=0, layer=layer, experts=[1], compute_s=[3.0]))
        ends[u] = o.end_s
        assert int(sim.counters()["loads"].sum()) == 2 * E
    # layerwise: 3 + (4 + 3) + (4 + 3); prefetch: layer 1's copy under layer 0's compute,
    # layer 2's under layer 1's (each copy 4 > compute 3: a stall of 1 each)
    assert ends["layerwise"] == pytest.approx(17.0)
    # copy 1 at 0-4 under compute 0-3; copy 2 at 4-8; layer 1 computes 4-7, layer 2 8-11
    assert ends["layerwise-prefetch"] == pytest.approx(11.0)


def test_a_simulator_refuses_a_pool_smaller_than_the_unit():
    from workbench.policies.eviction import EVICTION

    with pytest.raises(ValueError, match="needs 8 slots"):
        Simulator(Placement.single_device(3, 4, 1, 0, 7), lambda: EVICTION.create("lru"),
                  offload_unit="layerwise-prefetch")


def test_replay_runs_a_layerwise_unit_on_the_python_engine_and_refuses_the_fast_one():
    tr = _trace()
    assert replay(tr, offload_unit="layerwise", cache_slots=8).config["engine"] == "python"
    assert replay(tr, offload_unit="expert", cache_slots=8).config["engine"] == "fast"
    with pytest.raises(KnobError) as e:
        replay(tr, offload_unit="layerwise", cache_slots=8, engine="fast")
    assert "no compiled replay" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(KnobError, match="scope must be 'global'"):
        replay(tr, offload_unit="layerwise", cache_slots=32, scope="per-layer")


# -- live ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live_runs(embedded, demo_inputs, tmp_path_factory):
    """The same request under each unit (6 tokens, one pinned layer, 2E slots), stored."""
    import workbench

    image, prompt, _ = demo_inputs[2]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=6, ignore_eos=True)
    root = tmp_path_factory.mktemp("unit")
    slots = 2 * embedded.layout.num_experts
    return {u: (rt.run(prompt, [image], store=root / f"{u}.zarr", cache_slots=slots,
                       pinned_layers=1, offload_unit=u), root / f"{u}.zarr") for u in UNITS}


@pytest.mark.parametrize("unit", UNITS)
def test_live_equals_replay_for_each_unit(live_runs, unit, assert_replays_live):
    from workbench.analysis import open_run

    res, path = live_runs[unit]
    ds = open_run(path)
    rep = ds.moe.replay(engine="python")
    assert rep.config["offload_unit"] == unit
    assert_replays_live(rep, ds)
    assert rep.loads == res.loads == int(ds["loads"].sum())
    assert rep.metrics()["latency_s"] == pytest.approx(res.latency_modeled_s, rel=1e-9)


def test_live_units_give_the_same_tokens_and_the_papers_order_of_latency(live_runs, embedded):
    lay = embedded.layout
    res = {u: r for u, (r, _) in live_runs.items()}
    assert res["layerwise"].token_ids == res["expert"].token_ids \
        == res["layerwise-prefetch"].token_ids
    steps = res["layerwise"].steps
    for u in UNITS[1:]:
        assert res[u].loads == lay.num_experts * (lay.num_layers - 1) * steps
    assert res["layerwise"].hits == 0
    assert res["layerwise"].latency_modeled_s >= res["expert"].latency_modeled_s
    assert res["layerwise-prefetch"].latency_modeled_s <= res["layerwise"].latency_modeled_s


def test_a_layerwise_unit_with_idle_routed_experts_runs_what_the_expert_unit_does(
        embedded, tmp_path):
    """MoE-Prism's global K can leave a routed expert with no sub-expert to run: it is not
    looked up, so a layer-wise unit's call holds fewer experts than the layer routed to. Its
    slots then map by the call's own experts (not a sorted search over every routed one,
    which gave another expert's weights to some slots until stop 58: other tokens): the same
    tokens and sub-experts as under the expert unit."""
    import workbench
    from workbench.prism import refactor as R

    R.save(R.random_refactoring(embedded, subexperts=4, seed=4), tmp_path / "p")
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=6)
    reqs = workbench.mixed_batch(2, text_share=0.5, seed=3)
    kw = dict(prism=True, prism_refactoring=str(tmp_path / "p"), prism_k=3, pinned_layers=1,
              cache_slots=2 * embedded.layout.num_experts, record=False)
    runs = {u: rt.run(reqs, offload_unit=u, **kw) for u in ("expert", "layerwise")}
    assert [r["token_ids"] for r in runs["layerwise"].batch] == \
        [r["token_ids"] for r in runs["expert"].batch]
    assert runs["layerwise"].subexperts_ran == runs["expert"].subexperts_ran > 0


def test_cli_refuses_a_bad_combination_with_exit_2_and_one_line(tiny_ckpt, capsys):
    from workbench.cli import main

    rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--no-record",
               "--set", "offload_unit=layerwise", "--set", "prefetch=speculative",
               "--set", "lookahead_depth=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("workbench: error:") and "Traceback" not in err
    assert "offload_unit='layerwise'" in err and len(err.strip().splitlines()) == 1


def test_a_sweep_takes_the_unit_as_a_grid_axis_and_runs_its_points(tiny_ckpt, tmp_path):
    """The grid parses the three values; a point runs the unit (a worker's ``run_point``, in
    process: the cluster itself is test_sweep's); a point beside a prefetch policy is refused
    before any cluster starts."""
    import json

    from workbench.analysis.sweep import check_points, parse_grid, run_point
    from workbench.models.loading import load

    assert parse_grid(["offload_unit=expert,layerwise,layerwise-prefetch"]) == {
        "offload_unit": list(UNITS)}
    ck = tiny_ckpt()
    lay = load(ck, device="cpu").layout
    base = dict(cache_slots=2 * lay.num_experts, pinned_layers=1, max_new_tokens=2,
                ignore_eos=True, device="cpu")
    out = {}
    for u in UNITS:
        k = Knobs(offload_unit=u, **base).to_dict()
        out[u] = run_point(str(ck), k, "hello", [], str(tmp_path / f"{u}.zarr"),
                           str(tmp_path / f"{u}.json"), {"grid": {"offload_unit": u}})
        assert out[u]["status"] == "complete", out[u]
    steps = out["layerwise"]["result"]["steps"]
    assert out["layerwise"]["result"]["loads"] == \
        lay.num_experts * (lay.num_layers - 1) * steps
    assert out["layerwise"]["result"]["token_ids"] == out["expert"]["result"]["token_ids"]
    bad = Knobs(offload_unit="layerwise", prefetch="speculative", lookahead_depth=1,
                **base).to_dict()
    refused = check_points(ck, [{"id": "p0", "knobs": bad, "grid": {}},
                                {"id": "p1", "knobs": Knobs(**base).to_dict(), "grid": {}}])
    assert list(refused) == ["p0"] and "offload_unit='layerwise'" in str(refused["p0"])
    json.loads((tmp_path / "layerwise.json").read_text())
