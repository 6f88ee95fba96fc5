"""``RunMetadata``: a run store's attributes, parsed and checked once
(``workbench.telemetry.metadata``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import pytest

import workbench
from workbench.errors import StoreError
from workbench.knobs import Knobs
from workbench.telemetry.metadata import _FIELDS, JSON_ATTRS, RunMetadata, attr_json

SPEC = {"source": "loaded model", "expert_bytes": 1024, "expert_flops_per_token": 2048.0,
        "dense_bytes_per_layer": 10.0, "dense_flops_per_token_per_layer": 20.0,
        "activation_bytes_per_token": 64.0}


@pytest.fixture(scope="module")
def stored(tiny_ckpt, tmp_path_factory):
    """A real run store (non-default knobs) and its RunResult."""
    store = tmp_path_factory.mktemp("meta") / "r.zarr"
    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=5, pinned_layers=1,
                           eviction="lfu", max_new_tokens=4, device="cpu", profile="rtx-3090")
    res = rt.run("metadata of a real run", store=store)
    return workbench.open_run(store), res


def test_a_real_store_reads_typed(stored):
    ds, res = stored
    m = RunMetadata.from_attrs(ds.attrs)
    assert m.problems == {} and m.status == "complete" and m.error is None
    assert m.knobs.to_dict() == Knobs.from_attrs(ds.attrs).to_dict()  # as replay_trace reads
    assert (m.knobs.eviction, m.knobs.cache_slots, m.knobs.profile) == ("lfu", 5, "rtx-3090")
    assert set(m.recorded_knobs) == set(Knobs().names())
    assert m.cache_slots == 5 == m.live_plan["slots"] and m.max_new_tokens == 4
    assert type(m.cost_spec).__name__ == "CostSpec" and m.cost_spec.expert_bytes > 0
    assert dataclasses.asdict(m.cost_spec) == json.loads(ds.attrs["cost_spec"])
    assert m.text == res.text and m.summary["steps"] == res.steps
    assert m.model_id == res.model_id and m.top_k == ds.moe.top_k
    assert m.images == () and m.image_grid_thw == () and m.spatial_merge_size >= 1
    assert m.hardware_profile == "rtx-3090" and m.prompt == "metadata of a real run"
    assert m.phase_names == ("prefill", "decode") and m.committed["step"] == ds.sizes["step"]
    assert isinstance(m.modeled_plan, Mapping) and m.modeled_plan["slots"] >= 1
    assert m.schema_version >= 1 and isinstance(m.created, str)


def test_images_and_grids_of_a_vision_run():
    attrs = {"images": json.dumps(["data/demo/scene_0.png", "<PIL image>"]),
             "image_grid_thw": json.dumps([[1, 8, 8], [1, 4, 6]]), "spatial_merge_size": 2}
    m = RunMetadata.from_attrs(attrs)
    assert m.images == ("data/demo/scene_0.png", "<PIL image>")
    assert m.image_grid_thw == ((1, 8, 8), (1, 4, 6)) and m.spatial_merge_size == 2
    # decoded values (a trace's attrs, another zarr writer) read the same as JSON text
    same = RunMetadata.from_attrs({**attrs, "images": ["data/demo/scene_0.png", "<PIL image>"],
                                   "image_grid_thw": [[1, 8, 8], [1, 4, 6]]})
    assert same.images == m.images and same.image_grid_thw == m.image_grid_thw


def test_missing_attributes_read_as_none_and_knob_defaults():
    m = RunMetadata.from_attrs({})
    # a store without knob.transfer_order predates it: it ran the FIFO lane (Knobs.PREDATING;
    # likewise W4A16 at the down projection, low_precision_down_input 'native')
    from workbench.knobs import PREDATING

    assert PREDATING["transfer_order"] == "fifo"
    assert PREDATING["low_precision_down_input"] == "native"
    assert m.knobs.to_dict() == Knobs(**PREDATING).to_dict()
    assert m.recorded_knobs == ()
    for name in _FIELDS:
        want = () if name in ("images", "image_grid_thw", "requests") else None
        assert getattr(m, name) == want, name
    assert m.text is None and m.cache_slots is None and m.max_new_tokens is None
    # an older store: only some knobs, no plans or summary
    old = RunMetadata.from_attrs({"knob.cache_slots": "7", "knob.no_such_knob": "1",
                                  "status": "complete"})
    assert old.recorded_knobs == ("cache_slots",) and old.cache_slots == 7
    assert old.knobs.eviction == "lru" and old.summary is None and old.cost_spec is None


def test_knob_values_as_replay_trace_recovers_them():
    attrs = {**Knobs(eviction="lfu", cache_slots=9, prefetch="previous-step",
                     prefetch_budget=2, hybrid=True).to_attrs(),
             "knob.eviction": json.dumps("no-longer-registered")}
    m = RunMetadata.from_attrs(attrs)
    assert m.knobs.to_dict() == Knobs.from_attrs(attrs).to_dict()
    assert m.knobs.eviction == "lru"  # an unregistered policy keeps the default
    assert (m.knob("prefetch_budget"), m.knob("hybrid"), m.knob("nope", 1)) == (2, True, 1)


@pytest.mark.parametrize("attr, text", [
    ("summary", "{not json"),
    ("cost_spec", "{\"source\": "),
    ("live_plan", "{broken"),
    ("modeled_plan", "[1, 2"),
    ("images", "['single quotes']"),
    ("image_grid_thw", "[[1, 2, 3]"),
    ("predictor_cost", "nope"),
    ("committed", "{"),
    ("knob.cache_slots", "["),
    ("knob.hotness_decay", "NaN"),
])
def test_malformed_json_raises_store_error_naming_the_attribute(attr, text):
    attrs = {"status": "complete", attr: text}
    with pytest.raises(StoreError) as e:
        RunMetadata.from_attrs(attrs)
    msg = str(e.value)
    assert f"store attribute {attr!r}" in msg and "not valid JSON" in msg
    assert repr(text)[:40] in msg  # the bad value is shown
    # lenient: the attribute reads as missing, the problem is kept and raised on demand
    m = RunMetadata.from_attrs(attrs, strict=False)
    assert list(m.problems) == [attr] and m.problems[attr] == msg and m.status == "complete"
    with pytest.raises(StoreError, match="store attribute"):
        m.check(attr)
    with pytest.raises(StoreError):
        m.check()
    assert m.check("status") is m
    if attr.startswith("knob."):
        assert m.knob_values is None and m.knob("cache_slots") is None
        with pytest.raises(StoreError, match=attr):
            m.knobs
    else:
        assert m.knobs.cache_slots == 64


@pytest.mark.parametrize("attr, value, expected", [
    ("summary", "[1, 2]", "a JSON object"),
    ("live_plan", "42", "a JSON object"),
    ("images", "[1]", "a list of texts"),
    ("image_grid_thw", "[[1, 2]]", "[t, h, w]"),
    ("image_grid_thw", "[[1, -2, 3]]", "[t, h, w]"),
    ("cost_spec", json.dumps({**SPEC, "expert_bytes": -1}), "a number from 0 to 1e+18"),
    ("cost_spec", json.dumps({**SPEC, "expert_bytes": 1.7e308}), "a number from 0 to 1e+18"),
    ("cost_spec", json.dumps({**SPEC, "source": 3}), "'source' as text"),
    ("cost_spec", json.dumps({"source": "x"}), "an object with"),
    ("cost_spec", json.dumps({**SPEC, "extra": 1}), "an object with"),
    ("spatial_merge_size", 0, "whole number ≥ 1"),
    ("spatial_merge_size", True, "whole number"),
    ("top_k", "2", "whole number"),
    ("prompt", 12345, "text"),
    ("hardware_profile", 42, "text"),
    ("created", {"when": "now"}, "text"),
    ("committed", json.dumps({"step": -1}), "row counts"),
    ("knob.eviction", "7", "eviction"),
])
def test_wrong_shapes_raise_store_error_naming_the_attribute(attr, value, expected):
    with pytest.raises(StoreError, match=f"store attribute '{attr}'") as e:
        RunMetadata.from_attrs({attr: value})
    assert expected in str(e.value)
    assert attr in RunMetadata.from_attrs({attr: value}, strict=False).problems


def test_cost_spec_without_the_optional_field_of_older_stores():
    spec = {k: v for k, v in SPEC.items() if k != "activation_bytes_per_token"}
    m = RunMetadata.from_attrs({"cost_spec": json.dumps(spec)})
    assert m.cost_spec.activation_bytes_per_token == 0.0 and m.cost_spec.expert_bytes == 1024


def test_metadata_is_read_only():
    m = RunMetadata.from_attrs({"summary": json.dumps({"text": "hi"}), "knob.cache_slots": "4"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.status = "x"
    with pytest.raises(TypeError):
        m.summary["text"] = "changed"
    with pytest.raises(TypeError):
        m.knob_values["cache_slots"] = 1
    k = m.knobs
    k.cache_slots = 99  # a new Knobs each time: the metadata does not change
    assert m.knobs.cache_slots == 4


def test_attributes_that_are_not_a_mapping():
    with pytest.raises(StoreError, match="mapping"):
        RunMetadata.from_attrs(["knob.cache_slots"])


def test_attr_json_and_the_parser_table():
    assert attr_json({"a": "[1, 2]"}, "a") == [1, 2]
    assert attr_json({"a": [1]}, "a") == [1] and attr_json({}, "a") is None
    with pytest.raises(StoreError, match="store attribute 'a' is not valid JSON"):
        attr_json({"a": "[" * 100_000}, "a")
    # every JSON-text attribute of docs/telemetry.md has a field, and every field a parser
    assert set(JSON_ATTRS) <= {a for a, is_json, _ in _FIELDS.values() if is_json}
    names = {f.name for f in dataclasses.fields(RunMetadata)}
    assert names - {"knob_values", "recorded_knobs", "problems"} == set(_FIELDS)
