import json

import pytest

from workbench.errors import KnobError
from workbench.knobs import CacheKnobs, Knobs
from workbench.policies.eviction import EVICTION, LRU


def test_defaults_and_flat_names_are_unique():
    k = Knobs()
    names = k.names()
    assert len(names) == len(set(names))
    for required in ("cache_slots", "cache_bytes", "pinned_layers", "eviction", "profile",
                     "target_model", "device", "dtype"):
        assert required in names


@pytest.mark.parametrize("assign, fragment", [
    ("cache_slots=0", "cache_slots must be at least 1, not 0"),
    ("pinned_layers=-1", "pinned_layers must be at least 0, not -1"),
    ("eviction=fifo", "eviction does not accept 'fifo'"),
    ("profile=tpu", "profile does not accept 'tpu'"),
    ("cache_slots=many", "cache_slots must be an integer, not 'many'"),
    ("sampling=maybe", "sampling must be a boolean"),
    ("nope=1", "unknown knob 'nope'"),
    ("cache_slots", "NAME=VALUE"),
])
def test_bad_values_name_knob_value_and_range(assign, fragment):
    k = Knobs()
    with pytest.raises(KnobError) as e:
        k.set_from_strings([assign])
    assert fragment in str(e.value)


def test_failed_set_changes_nothing():
    k = Knobs(cache_slots=8)
    with pytest.raises(KnobError):
        k.set(cache_slots=16, pinned_layers=-3)
    assert k.cache_slots == 8


def test_strings_are_parsed_by_type():
    k = Knobs().set_from_strings(["cache_slots=12", "cache_bytes=none", "sampling=yes",
                                  "temperature=0.5", "eviction=lfu"])
    assert (k.cache_slots, k.cache_bytes, k.sampling, k.temperature, k.eviction) == (
        12, None, True, 0.5, "lfu")


def test_attrs_round_trip():
    k = Knobs(cache_slots=7, cache_bytes=1000, eviction="lfu", target_model="deepseek-vl2")
    attrs = k.to_attrs()
    assert json.loads(attrs["knob.cache_slots"]) == 7
    assert Knobs.from_attrs(attrs).to_dict() == k.to_dict()


def test_model_checks_name_the_allowed_range():
    k = Knobs(cache_slots=3, pinned_layers=2)
    with pytest.raises(KnobError, match=r"cache_slots must be at least 4 \(top-k\), not 3"):
        k.check_against(num_layers=8, top_k=4, expert_bytes=100)
    with pytest.raises(KnobError, match="pinned_layers must be between 0 and 8"):
        Knobs(pinned_layers=9).check_against(num_layers=8, top_k=4, expert_bytes=100)
    with pytest.raises(KnobError, match="cache_bytes must hold at least 4 experts"):
        Knobs(cache_bytes=350).check_against(num_layers=8, top_k=4, expert_bytes=100)
    # everything pinned: the cache is unused, so its size is not checked
    Knobs(cache_slots=1, pinned_layers=8).check_against(num_layers=8, top_k=4, expert_bytes=100)
    assert Knobs(cache_bytes=1000).effective_slots(100) == 10


def test_new_policy_appears_in_menu_without_ui_changes():
    @EVICTION.register("test-mru")
    class MRU(LRU):
        def choose_victim(self, candidates, t):
            return max(candidates, key=lambda k: self.last_use.get(k, -1))

    try:
        assert "test-mru" in Knobs().group("cache").param["eviction"].objects
        assert Knobs(eviction="test-mru").eviction == "test-mru"
    finally:
        EVICTION._classes.pop("test-mru")
    assert "test-mru" not in CacheKnobs().param["eviction"].objects


def test_every_group_renders_with_plain_panel_param():
    """Notebook users call pn.Param(knobs.group(...)) directly: every group must render."""
    import panel as pn

    pn.extension()
    k = Knobs()
    for key, group in k.groups.items():
        # what a notebook does to show it: raises if a widget cannot hold its knob's value
        pn.Param(group)._repr_mimebundle_()


# -- issue 11: declared dependencies, group checks, one default per knob, aliases -----------------
def test_registry_passes_each_policy_only_the_knobs_it_declares():
    from workbench.policies.registry import Registry

    reg = Registry("demo", knob="demo")

    @reg.register("plain")
    class Plain:
        def __init__(self, a: int = 1) -> None:
            self.a = a

    @reg.register("legacy")
    class Legacy:  # the old convention: takes every knob
        def __init__(self, **kw) -> None:
            self.kw = kw

    assert reg.params("plain") == {"a"} and reg.params("legacy") is None
    assert reg.create("plain", a=3, b=4).a == 3  # b is not its knob: not passed
    assert reg.create("legacy", a=3, b=4).kw == {"a": 3, "b": 4}
    assert reg.kwargs_for("plain", {"a": 1, "z": 2}) == {"a": 1}


def test_built_in_policies_declare_knobs_by_name():
    """Declared dependencies: every built-in policy's parameters are knob names, and none
    takes **kwargs (so a misspelt knob cannot slip through unnoticed)."""
    from workbench.compression.policies import COMPRESSION
    from workbench.policies.prefetch import PREFETCH

    names = set(Knobs().names())
    declared = {}
    for reg in (EVICTION, PREFETCH, COMPRESSION):
        for n in reg.available():
            p = reg.params(n)
            assert p is not None, f"{reg.family} {n!r} takes **kwargs"
            assert p <= names, f"{reg.family} {n!r} declares non-knobs {sorted(p - names)}"
            declared[(reg.family, n)] = p
    assert declared[("eviction", "hotness")] == {"hotness_decay", "hotness_window"}
    assert declared[("eviction", "slab")] == {"window", "decay"}
    assert declared[("eviction", "lru")] == set()
    assert declared[("prefetch", "vismmoe")] == {"window", "decay"}
    assert declared[("compression", "affinity")] == {"beta", "alpha", "lam"}
    assert declared[("compression", "random")] == {"beta", "seed"}
    # the runtime's call: every knob in, each policy takes its own
    kd = Knobs(eviction="hotness", hotness_window=4).to_dict()
    assert EVICTION.create("hotness", **kd).window == 4
    assert EVICTION.create("lru", **kd).__class__.__name__ == "LRU"


def test_needs_is_one_field_and_the_old_flags_read_it():
    from workbench.compression.policies import COMPRESSION
    from workbench.policies.prefetch import PREFETCH

    belady, lru, slab = EVICTION.get("belady"), EVICTION.get("lru"), EVICTION.get("slab")
    assert belady.needs == {"future"} and belady.needs_future is True
    assert lru.needs_future is False and lru.needs_predictor is False
    assert slab.needs == {"predictor"} and slab.needs_predictor is True
    assert EVICTION.create("slab").needs_predictor is True  # on instances too
    assert PREFETCH.get("oracle").needs_future and not PREFETCH.get("apex").needs_future
    aff, rnd = COMPRESSION.create("affinity"), COMPRESSION.create("random")
    assert aff.needs_saliency and aff.needs_prefix_routing
    assert not rnd.needs_saliency and not rnd.needs_prefix_routing


def test_policy_defaults_are_the_knob_defaults():
    from workbench.compression.policies import COMPRESSION
    from workbench.policies.active_evict import ActiveEvict
    from workbench.policies.eviction import SlabStates
    from workbench.policies.prefetch import PREFETCH

    d = Knobs().to_dict()
    hot = EVICTION.get("hotness")()
    assert (hot.decay, hot.window) == (d["hotness_decay"], d["hotness_window"])
    slab = EVICTION.get("slab")()
    assert (slab.states.window, slab.states.decay) == (d["window"], d["decay"])
    assert (SlabStates().window, SlabStates().decay) == (d["window"], d["decay"])
    vis = PREFETCH.get("vismmoe")()
    assert (vis.window, vis.decay) == (d["window"], d["decay"])
    aff = COMPRESSION.get("affinity")()
    assert (aff.beta, aff.alpha, aff.lam) == (d["beta"], d["alpha"], d["lam"])
    assert COMPRESSION.get("random")().seed == d["seed"]
    ae = ActiveEvict(2, 4)
    assert (ae.alpha, ae.tau, ae.r_max, ae.hot.window) == (
        d["ae_alpha"], d["ae_tau"], d["ae_rmax"], d["ae_window"])


def test_group_checks_hold_the_multi_knob_rules():
    from workbench.knobs import ModelShape

    shape = ModelShape(num_layers=8, num_experts=16, top_k=4, expert_bytes=100)
    Knobs().check(shape)
    with pytest.raises(KnobError, match=r"alpha must be at most beta .* alpha=0\.6 > beta=0\.5"):
        Knobs(compression="affinity", alpha=0.6, beta=0.5).check(shape)
    Knobs(compression="none", alpha=0.6, beta=0.5).check(shape)  # compression off: no rule
    with pytest.raises(KnobError, match=r"k_max must be between 1 and 16 \(experts per layer\)"):
        Knobs(k_max=17).check(shape)
    with pytest.raises(KnobError, match="eviction 'slab' .* needs the predictor"):
        Knobs(eviction="slab").check(shape)
    Knobs(eviction="slab", predictor="vismmoe").check(shape)
    Knobs(eviction="slab", prefetch="vismmoe").check(shape)
    with pytest.raises(KnobError, match="eviction 'belady' needs the future"):
        Knobs(eviction="belady").check(shape)
    with pytest.raises(KnobError, match="prefetch 'oracle' needs the future"):
        Knobs(prefetch="oracle").check(shape)
    with pytest.raises(KnobError, match="lookahead_depth must be at least 1, not 0"):
        Knobs(prefetch="apex", lookahead_depth=0).check(shape)
    # trace replay: the future is there, the predictor's outputs are recorded, no live rules
    Knobs(eviction="belady", prefetch="oracle").check(shape, live=False)
    Knobs(eviction="slab", k_max=17).check(shape, live=False)
    with pytest.raises(KnobError, match="active_evict runs live only"):
        Knobs(active_evict=True).check(shape, live=False)
    with pytest.raises(KnobError, match=r"pinned_layers must be between 0 and 8 \(the trace's"):
        Knobs(pinned_layers=9).check(shape, live=False)
    with pytest.raises(KnobError, match=r"cache_slots must be at least 4 \(top-k\), not 2"):
        Knobs(cache_slots=2).check(shape, live=False)
    # the old spelling still works, and shapes come from any layout-like object
    Knobs(k_max=17).check_against(num_layers=8, top_k=4, expert_bytes=100)  # experts unknown
    lay = type("Layout", (), dict(num_layers=8, num_experts=16, top_k=4, expert_bytes=100))()
    assert ModelShape.of(lay) == shape


def test_knobs_alone_has_every_group_and_groups_register_once():
    from workbench.knobs import knob_groups, register_group

    keys = list(knob_groups())
    assert keys == ["cache", "prefetch", "cost", "ep", "exec", "generation", "active_evict",
                    "cache_routing", "compression", "predictor", "prism"]
    assert list(Knobs().groups) == keys
    # registering a group's class again is harmless; another class under its names is not
    register_group("cache", CacheKnobs)
    with pytest.raises(ValueError, match="already"):
        register_group("cache2", type("Clash", (CacheKnobs,), {}))


def test_an_old_knob_name_keeps_working_through_its_alias():
    import param

    from workbench.knobs import KnobGroup, aliases, register_group, unregister_group

    class DemoKnobs(KnobGroup):
        aliases = {"demo_old": "demo_new"}
        demo_new = param.Integer(default=3, bounds=(1, 10))

    register_group("demo", DemoKnobs)
    try:
        assert aliases()["demo_old"] == "demo_new"
        k = Knobs(demo_old=5)
        assert k.demo_new == 5 and k.demo_old == 5 and "demo_old" not in k.names()
        k.set(demo_old=6)
        assert k.demo_new == 6
        k.set_from_strings(["demo_old=7"])
        assert k.demo_new == 7
        with pytest.raises(KnobError, match="must be at most 10"):
            k.set_from_strings(["demo_old=11"])
        with pytest.raises(KnobError, match="name the same knob"):
            k.set(demo_old=2, demo_new=3)
        assert k.copy(demo_old=8).demo_new == 8
        assert "knob.demo_old" not in k.to_attrs()
        # a store written before the rename
        old_store = {"knob.demo_old": "9", "knob.cache_slots": "12"}
        assert Knobs.from_attrs(old_store).demo_new == 9
        # both names: the current one wins
        assert Knobs.from_attrs({**old_store, "knob.demo_new": "4"}).demo_new == 4
        with pytest.raises(KnobError, match="store attribute 'knob.demo_old'"):
            Knobs.from_attrs({"knob.demo_old": "0"})
        # an alias may not take a knob's name, nor point outside its group
        bad = type("Bad", (KnobGroup,), {"aliases": {"cache_slots": "x"},
                                         "x": param.Integer(default=1)})
        with pytest.raises(ValueError):
            register_group("bad", bad)
        bad2 = type("Bad2", (KnobGroup,), {"aliases": {"zz_old": "cache_slots"},
                                           "zz": param.Integer(default=1)})
        with pytest.raises(ValueError):
            register_group("bad2", bad2)
    finally:
        unregister_group("demo")
    assert "demo_old" not in aliases() and "demo_new" not in Knobs().names()
