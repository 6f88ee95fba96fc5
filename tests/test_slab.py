"""VisMMOE slab cache, safety-guarded eviction (issue 5 §3, SPEC §1c): the Required /
Speculative / Expired states, the eviction order and its fallback, live = replay, and the
refusal without a predictor."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.policies.eviction import EVICTION, Slab, SlabStates

L, E = 6, 5


@st.composite
def scenario(draw):
    """Random windows and accesses: per (step, layer) a ranked prediction, some uses and
    prefetch loads, then a victim asked among random candidates."""
    window = draw(st.integers(1, 4))
    decay = draw(st.sampled_from([0.5, 0.8, 1.0]))
    events = []
    for step in range(draw(st.integers(1, 3))):
        for layer in range(L):
            ranked = draw(st.lists(st.tuples(st.integers(0, E - 1),
                                             st.floats(0.0, 1.0, width=32)),
                                   max_size=E, unique_by=lambda p: p[0]))
            uses = draw(st.lists(st.integers(0, E - 1), max_size=3, unique=True))
            loads = draw(st.lists(st.tuples(st.integers(0, L - 1), st.integers(0, E - 1)),
                                  max_size=3))
            cands = draw(st.lists(st.tuples(st.integers(0, L - 1), st.integers(0, E - 1)),
                                  min_size=1, max_size=12, unique=True))
            events.append((step, layer, ranked, uses, loads, cands))
    return window, decay, events


@settings(max_examples=150, deadline=None)
@given(scenario())
def test_victim_order_never_required_while_another_exists(sc):
    window, decay, events = sc
    s = SlabStates(window, decay)
    t = 0
    expected_fallbacks = {"speculative": 0, "required": 0}
    prev, routed_all = None, set()
    for step, layer, ranked, uses, loads, cands in events:
        s.begin_layer(step, layer, ranked)
        for e in uses:
            t += 1
            s.note_use((layer, e), t)
        for k in loads:
            t += 1
            s.note_use(k, t, inserted=True)
        states = {k: s.state(k) for k in cands}
        # the window is exactly the predicted (layer + d, e), d = 1 … W, plus the routed keys
        win = {(layer + d, e) for d in range(1, window + 1) for e, _ in ranked}
        # routed: what the current layer used or loaded (a demand miss) since it began
        routed = {(layer, e) for e in uses} | {k for k in loads if k[0] == layer}
        routed_all = routed_all | routed if prev == (step, layer) else routed
        prev = (step, layer)
        for k in cands:
            assert (states[k] == s.REQUIRED) == (k in win or k in routed_all)
        v = s.victim(cands)
        assert v in cands
        expired = [k for k in cands if states[k] == s.EXPIRED]
        spec = [k for k in cands if states[k] == s.SPECULATIVE]
        if expired or spec:
            assert states[v] != s.REQUIRED  # never a Required key while another exists
        if expired:
            assert states[v] == s.EXPIRED
            low = min(s.priority.get(k, 0.0) for k in expired)
            assert s.priority.get(v, 0.0) == low  # lowest predictor priority first
        elif spec:
            expected_fallbacks["speculative"] += 1
            assert states[v] == s.SPECULATIVE
            assert s.priority.get(v, 0.0) == min(s.priority.get(k, 0.0) for k in spec)
        else:
            expected_fallbacks["required"] += 1
            assert v[0] - layer == max(k[0] - layer for k in cands)  # farthest in the window
    assert s.fallbacks == expected_fallbacks


def test_states_by_hand():
    s = SlabStates(window=2, decay=0.5)
    s.begin_layer(0, 1, [(3, 0.9), (4, 0.2)])
    # window: (2,3):0.9 (2,4):0.2 (3,3):0.45 (3,4):0.1
    assert s.required == {(2, 3): 0.9, (2, 4): 0.2, (3, 3): 0.45, (3, 4): 0.1}
    s.note_use((1, 0), 1)
    assert s.state((1, 0)) == s.REQUIRED  # routed by the layer being computed
    s.begin_layer(0, 2, [(1, 0.7)])
    assert s.state((3, 4)) == s.SPECULATIVE  # predicted before, layer still ahead, now outside
    assert s.state((1, 0)) == s.EXPIRED  # its layer finished for this token
    assert s.state((3, 1)) == s.REQUIRED
    # Expired first (lowest priority: (0, 0) never predicted, 0.0 < (2, 4)'s 0.2)
    assert s.victim([(3, 1), (3, 4), (2, 4), (0, 0)]) == (0, 0)
    assert s.victim([(3, 1), (3, 4)]) == (3, 4) and s.fallbacks["speculative"] == 1
    assert s.victim([(3, 1), (4, 1)]) == (4, 1) and s.fallbacks["required"] == 1
    s.begin_layer(1, 0, [])  # a new step: last step's speculation is stale
    assert s.state((3, 4)) == s.EXPIRED


def test_registered_and_knobs():
    from workbench.knobs import Knobs

    assert "slab" in EVICTION.available()
    assert Knobs(eviction="slab").eviction == "slab"  # in the knob's menu
    pol = EVICTION.create("slab", window=3, decay=0.5)
    assert isinstance(pol, Slab) and pol.states.window == 3
    with pytest.raises(ValueError):
        Slab(window=0)


@pytest.fixture(scope="module")
def lm():
    from workbench.models.loading import load as load_model

    return load_model(None, device="cpu")


@pytest.fixture(scope="module")
def predictor_dir(lm, tmp_path_factory):
    from workbench.predictor.calibrate import calibrate, scene_requests
    from workbench.predictor.model import save

    pred, rep = calibrate(lm, scene_requests(0, 4), steps=20, seed=0, max_new_tokens=1,
                          ablation=False)
    path = tmp_path_factory.mktemp("slab") / "p"
    save(pred, path, rep)
    return path


def test_slab_refused_without_predictor(lm):
    import workbench
    from workbench.errors import KnobError

    with pytest.raises(KnobError, match="needs the predictor"):
        workbench.Runtime(lm, device="cpu", eviction="slab")


@pytest.mark.parametrize("knobs", [dict(cache_slots=12, pinned_layers=0, predictor="vismmoe"),
                                   dict(cache_slots=14, pinned_layers=1, prefetch="vismmoe",
                                        prefetch_budget=6, window=3, decay=0.7)])
def test_live_slab_equals_replay(lm, predictor_dir, tmp_path, knobs, assert_replays_live):
    import workbench
    from workbench.errors import KnobError
    from workbench.replay.engine import replay
    from workbench.analysis import open_run
    from workbench.traces import from_store

    rt = workbench.Runtime(lm, device="cpu", max_new_tokens=5, ignore_eos=True)
    path = tmp_path / "slab.zarr"
    live = rt.run("what shape is red?", ["data/demo/scene_0.png"], store=path, eviction="slab",
                  predictor_path=str(predictor_dir), **knobs)
    assert live.evictions > 0
    assert live.eviction_stats["slab_victims"] > 0
    ds = open_run(path)
    res = ds.moe.replay()
    assert res.config["eviction"] == "slab" and res.config["engine"] == "python"
    assert_replays_live(res, ds)
    assert res.evictions.sum() == live.evictions
    m = res.metrics()
    for k in ("slab_victims", "slab_fallback_speculative", "slab_fallback_required"):
        assert m[k] == live.eviction_stats[k]
    with pytest.raises(KnobError, match="no compiled replay"):
        replay(from_store(ds), eviction="slab", engine="fast")
