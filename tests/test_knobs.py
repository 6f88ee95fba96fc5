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
