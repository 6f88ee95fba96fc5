"""Trace importers and the .wbtrace format, on real files: the Mixtral-8x7B routing recorded with
vLLM (shared data, read in place), a run recorded here with the embedded model, and small files
written by the tests."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import workbench
from workbench.errors import InputError, StoreExistsError
from workbench.traces import (FORMATS, Trace, from_store, load_trace, read_jsonl, read_npy,
                              read_plain, write_plain)

SHARED = Path(os.environ.get("WORKBENCH_SHARED") or Path(__file__).resolve().parents[2] / "shared")
MIXTRAL = SHARED / "data" / "traces" / "mixtral-8x7b-vllm"
needs_mixtral = pytest.mark.skipif(
    not (MIXTRAL / "humaneval_2_routing.jsonl").exists(),
    reason=f"shared Mixtral routing data not found under {MIXTRAL} (set WORKBENCH_SHARED)")


def assert_same(a: Trace, b: Trace, attrs: bool = True) -> None:
    """Every field equal (weights bit-for-bit up to NaN payloads); attrs but provenance."""
    assert a.num_experts == b.num_experts
    for name in ("topk_ids", "token_step", "token_modality", "phase", "step_request", "pinned"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    wa, wb = a.topk_weights, b.topk_weights
    assert wa.dtype == wb.dtype == np.float32
    assert np.array_equal(np.isnan(wa), np.isnan(wb))
    ok = ~np.isnan(wa)
    assert np.array_equal(wa[ok].view(np.uint32), wb[ok].view(np.uint32))  # keeps -0.0
    if attrs:
        strip = lambda d: {k: v for k, v in d.items() if k not in ("source", "path")}  # noqa: E731
        assert strip(a.attrs) == strip(b.attrs)


# -- the Mixtral-8x7B file (real data) ------------------------------------------------------------
@needs_mixtral
def test_mixtral_jsonl_loads_with_missing_records_counted_not_invented():
    path = MIXTRAL / "humaneval_2_routing.jsonl"
    tr = load_trace(path)
    assert (tr.num_layers, tr.num_experts, tr.top_k) == (32, 8, 2)
    assert tr.attrs["source"] == "jsonl" and tr.attrs["path"] == str(path)
    assert [r["problem_id"] for r in tr.attrs["requests"]] == [0, 1]
    # decode only: one token per step; the longest layer of each problem sets its step count
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [1 + max(r["token_idx"] for r in recs if r["problem_id"] == p) for p in (0, 1)]
    assert steps == [83, 255]
    assert np.bincount(tr.step_request).tolist() == steps
    assert tr.num_steps == tr.num_tokens == sum(steps) and (tr.phase == 1).all()
    assert np.array_equal(tr.token_step, np.arange(tr.num_tokens))
    # every record lands at (first step of its problem + token_idx, layer), nothing else is set
    first = {0: 0, 1: steps[0]}
    seen = np.zeros((tr.num_tokens, tr.num_layers), bool)
    for r in recs:
        t = first[r["problem_id"]] + r["token_idx"]
        assert tr.topk_ids[t, r["layer"]].tolist() == r["experts"]
        assert np.allclose(tr.topk_weights[t, r["layer"]], r["gating_probs"])
        seen[t, r["layer"]] = True
    missing = ~seen
    assert tr.attrs["missing_records"] == int(missing.sum()) == 32 * 338 - len(recs) == 37
    assert (tr.topk_ids[missing] == -1).all() and np.isnan(tr.topk_weights[missing]).all()
    # the caveat: per-layer counts differ by up to 3 per problem
    for p in (0, 1):
        rows = tr.step_request == p
        per_layer = (tr.topk_ids[rows, :, 0] >= 0).sum(0)
        assert per_layer.max() - per_layer.min() <= 3 and per_layer.max() == steps[p]
    g = tr.groups()
    assert g.num_accesses == int((tr.topk_ids >= 0).sum())  # top-2 ids of a token are distinct
    assert np.array_equal(g.step_tokens, np.ones(tr.num_steps))


@needs_mixtral
def test_mixtral_problem_filter_and_given_num_experts():
    tr = read_jsonl(MIXTRAL / "humaneval_2_routing.jsonl", num_experts=8, problem=1)
    assert tr.num_steps == 255 and (tr.step_request == 0).all()
    assert tr.attrs["requests"] == [{"dataset": "humaneval", "problem_id": 1}]
    with pytest.raises(InputError, match=r"problem 7 is not in .*problems \[0, 1\]"):
        read_jsonl(MIXTRAL / "humaneval_2_routing.jsonl", problem=7)
    with pytest.raises(InputError, match=r"line 1: expert id 6 is outside 0\.\.3"):
        read_jsonl(MIXTRAL / "humaneval_2_routing.jsonl", num_experts=4)


@needs_mixtral
def test_mixtral_raw_emission_order_has_a_prefill_and_matches_the_decode_file():
    raw = load_trace(MIXTRAL / "routing_raw.jsonl")
    assert raw.attrs["position_key"] == "token_pos"
    assert raw.phase[0] == 0 and (raw.phase[1:] == 1).all()
    prefill = int((raw.token_step == 0).sum())
    assert prefill == 135 and raw.num_steps == 84 and raw.num_tokens == prefill + 83
    # token_pos keeps its row, so a dropped record leaves a gap: counted, not invented
    assert raw.attrs["missing_records"] == int((raw.topk_ids[:, :, 0] < 0).sum()) > 0
    dec = read_jsonl(MIXTRAL / "humaneval_2_routing.jsonl", problem=0)
    # layer 0 is complete in both recordings of problem 0: same experts, token for token
    assert np.array_equal(raw.topk_ids[prefill:, 0], dec.topk_ids[:, 0])
    # npy round trip with a prefill step, on real routing
    with tempfile.TemporaryDirectory() as d:
        np.save(Path(d) / "r.npy", raw.topk_ids)
        back = read_npy(Path(d) / "r.npy", num_experts=8, prefill_tokens=prefill)
    for name in ("topk_ids", "token_step", "phase"):
        assert np.array_equal(getattr(back, name), getattr(raw, name)), name


# -- .wbtrace ------------------------------------------------------------------------------------
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(), kids, max_size=3),
    max_leaves=8)
_attr_key = st.text(min_size=1, max_size=12).filter(
    lambda k: not any(c in k for c in "\t\r\n") and k not in ("source", "path"))


@st.composite
def traces(draw) -> Trace:
    T = draw(st.integers(0, 6))
    L = draw(st.integers(1, 4))
    K = draw(st.integers(1, 3))
    E = draw(st.integers(1, 40))
    ids = draw(arrays(np.int16, (T, L, K), elements=st.integers(-1, E - 1)))
    # the trace rule: a token's experts at one layer are distinct (-1 may repeat)
    for t in range(T):
        for layer in range(L):
            seen = set()
            for r in range(K):
                if ids[t, layer, r] in seen:
                    ids[t, layer, r] = -1
                seen.add(int(ids[t, layer, r]))
    # the trace rule for weights: finite, or NaN (none recorded)
    w = draw(arrays(np.float32, (T, L, K), elements=st.floats(width=32, allow_nan=True,
                                                              allow_infinity=False)))
    grow = draw(st.lists(st.integers(0, 1), min_size=max(T - 1, 0), max_size=max(T - 1, 0)))
    token_step = np.r_[0, np.cumsum(grow)][:T] if T else np.zeros(0)
    S = int(token_step[-1]) + 1 if T else 0
    return Trace(topk_ids=ids, token_step=token_step, num_experts=E, topk_weights=w,
                 token_modality=draw(arrays(np.int8, T, elements=st.integers(0, 2))),
                 phase=draw(arrays(np.int8, S, elements=st.integers(0, 1))),
                 step_request=draw(arrays(np.int32, S)), pinned=draw(arrays(bool, L)),
                 attrs=draw(st.dictionaries(_attr_key, _json, max_size=4)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_plain_round_trip_is_lossless(tr):
    with tempfile.TemporaryDirectory() as d:
        path = write_plain(tr, Path(d) / "t.wbtrace")
        back = read_plain(path)
        assert_same(tr, back)
        assert back.attrs["source"] == "plain" and back.attrs["path"] == str(path)
        assert_same(tr, load_trace(path))


def test_plain_is_human_writable_and_refuses_to_overwrite(tmp_path):
    path = tmp_path / "hand.wbtrace"
    path.write_text(
        "wbtrace\tversion=1\tlayers=2\texperts=4\ttop_k=2\n"
        "@pinned\t0\n"
        "@attr\tmodel_id\t\"by hand\"\n"
        "# step\trequest\tphase\tmodality\tlayer 0\tlayer 1\n"
        "0\t0\tprefill\timage\t3:0.75,1:0.25\t2\n"
        "0\t0\tprefill\ttext\t1,0\t-\n"
        "\n"
        "1\t0\tdecode\ttext\t-1,2\t3:0.5\n")
    tr = read_plain(path)
    assert tr.topk_ids.tolist() == [[[3, 1], [2, -1]], [[1, 0], [-1, -1]], [[-1, 2], [3, -1]]]
    assert tr.topk_weights[0, 0].tolist() == [0.75, 0.25] and np.isnan(tr.topk_weights[1]).all()
    assert tr.phase.tolist() == [0, 1] and tr.token_modality.tolist() == [1, 0, 0]
    assert tr.pinned.tolist() == [True, False] and tr.attrs["model_id"] == "by hand"
    with pytest.raises(StoreExistsError, match="already exists"):
        write_plain(tr, path)
    write_plain(tr, path, overwrite=True)
    assert_same(tr, read_plain(path))


# -- npy -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefill", [0, 1, 5, 9])
def test_npy_round_trip_with_prefill(tmp_path, prefill):
    rng = np.random.default_rng(prefill)
    arr = np.stack([rng.permutation(16)[:2] for _ in range(9 * 3)]).reshape(9, 3, 2)
    np.save(tmp_path / "r.npy", arr.astype(np.int64))
    tr = read_npy(tmp_path / "r.npy", prefill_tokens=prefill)
    assert np.array_equal(tr.topk_ids, arr) and tr.num_experts == int(arr.max()) + 1
    n_steps = 9 - prefill + (1 if prefill else 0)
    assert tr.num_steps == n_steps and np.bincount(tr.token_step)[0] == max(prefill, 1)
    assert tr.phase.tolist() == ([0] if prefill else []) + [1] * (9 - prefill)
    assert tr.attrs["prefill_tokens"] == prefill and np.isnan(tr.topk_weights).all()
    # and back: the trace's ids saved again load to the same trace
    np.save(tmp_path / "again.npy", tr.topk_ids)
    assert_same(tr, load_trace(tmp_path / "again.npy", prefill_tokens=prefill), attrs=False)


# -- malformed inputs ----------------------------------------------------------------------------
GOOD = {"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": [.6, .4]}


def _line(**change) -> str:
    rec = {**GOOD, **change}
    return json.dumps({k: v for k, v in rec.items() if v is not ...})


@pytest.mark.parametrize("bad, message", [
    ('{"layer": 0, "token_idx": 1, ', r"line 2: not valid JSON"),
    ("[1, 2]", r"line 2: expected a JSON object, got list"),
    (_line(token_idx=...), r"line 2: missing key 'token_idx'"),
    (_line(experts=...), r"line 2: missing key 'experts'"),
    (_line(layer="1"), r"line 2: 'layer' must be an integer ≥ 0, got '1'"),
    (_line(token_idx=-1), r"line 2: 'token_idx' must be an integer ≥ 0, got -1"),
    (_line(experts=[1, -3]), r"line 2: expert id -3 is outside 0\.\.7 \(num_experts=8\)"),
    (_line(experts=[1, 8]), r"line 2: expert id 8 is outside 0\.\.7"),
    (_line(experts=[1, 2.0]), r"line 2: expert id 2\.0 in 'experts' is not an integer"),
    (_line(experts=[1, 2, 3], gating_probs=[.5, .3, .2]), r"line 2: 3 experts .* earlier lines "
                                                          r"have 2"),
    (_line(experts=[3, 3]), r"line 2: expert ids \[3, 3\] repeat"),
    (_line(gating_probs=[1.0]), r"line 2: 'gating_probs' must be a list of 2 numbers"),
    (_line(), r"line 2: a second record for problem 0, token_idx 0, layer 0 \(first on line 1\)"),
    (_line(token_pos=0, token_idx=...), r"line 2: has 'token_pos' but earlier lines have "
                                        r"'token_idx'"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(_line() + "\n" + bad + "\n")
    with pytest.raises(InputError, match=message) as err:
        read_jsonl(path, num_experts=8)
    assert "bad.jsonl" in str(err.value)


def test_jsonl_without_weights_or_problem_and_empty(tmp_path):
    path = tmp_path / "min.jsonl"
    path.write_text('{"layer": 1, "token_idx": 2, "experts": [4]}\n')
    tr = read_jsonl(path)
    assert (tr.num_tokens, tr.num_layers, tr.top_k, tr.num_experts) == (3, 2, 1, 5)
    assert tr.attrs["missing_records"] == 5 and tr.topk_ids[2, 1, 0] == 4
    assert np.isnan(tr.topk_weights).all()
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match="has no records"):
        read_jsonl(tmp_path / "empty.jsonl")


@pytest.mark.parametrize("array, kwargs, message", [
    (np.zeros((3, 2, 2), np.float32), {}, r"dtype float32; expected an integer dtype"),
    (np.zeros((3, 2, 2), bool), {}, r"dtype bool; expected an integer dtype"),
    (np.zeros((3, 2), np.int64), {}, r"shape \(3, 2\); expected 3 dims"),
    (np.zeros((0, 2, 2), np.int64), {}, r"every dim must be ≥ 1"),
    (np.array([[[0, 1]], [[2, -2]]]), {}, r"expert id -2 at index \[1, 0, 1\] .* outside -1\.\."),
    (np.array([[[0, 1]], [[2, 9]]]), {"num_experts": 8},
     r"expert id 9 at index \[1, 0, 1\] .* outside -1\.\.7"),
    (np.full((2, 1, 2), -1), {}, r"routes no token \(all -1\); pass num_experts"),
    (np.zeros((3, 1, 2), np.int8), {"prefill_tokens": 4}, r"prefill_tokens .* must be .* 0\.\.3"),
    (np.zeros((3, 1, 2), np.int8), {"num_experts": 0}, r"num_experts .* 1\.\.32767, got 0"),
    (np.array([[[0, None]]], dtype=object), {}, r"cannot be read without pickle"),
])
def test_malformed_npy_names_the_index(tmp_path, array, kwargs, message):
    path = tmp_path / "bad.npy"
    np.save(path, array, allow_pickle=True)
    with pytest.raises(InputError, match=message) as err:
        read_npy(path, **kwargs)
    assert "bad.npy" in str(err.value)


HEADER = "wbtrace\tversion=1\tlayers=2\texperts=4\ttop_k=2\n"


@pytest.mark.parametrize("text, message", [
    ("step\trequest\n", r"line 1: 'step' is not a \.wbtrace header"),
    ("wbtrace\tversion=2\tlayers=2\texperts=4\ttop_k=2\n", r"line 1: \.wbtrace version 2 is not"),
    ("wbtrace\tversion=1\tlayers=2\texperts=4\n", r"line 1: header lacks top_k"),
    ("wbtrace\tversion=1\tlayers=2\texperts=4\ttop_k=2\tcolor=red\n", r"line 1: header field "
                                                                       r"'color=red' is unknown"),
    (HEADER + "0\t0\tdecode\ttext\t1\n", r"line 2: 5 tab-separated fields; a token line has 6"),
    (HEADER + "1\t0\tdecode\ttext\t1\t2\n", r"line 2: step 1 after step -1"),
    (HEADER + "0\t0\tdecode\ttext\t1\t2\n# c\n2\t0\tdecode\ttext\t1\t2\n",
     r"line 4: step 2 after step 0"),
    (HEADER + "0\t0\tdecode\ttext\t1\t4\n", r"line 2, layer 1: expert id 4 is outside -1\.\.3"),
    (HEADER + "0\t0\tdecode\ttext\t1,2,3\t-\n", r"line 2, layer 0: 3 experts '1,2,3'; top_k is 2"),
    (HEADER + "0\t0\tdecode\ttext\t1:x\t-\n", r"line 2, layer 0: weight 'x' of expert 1 is not"),
    (HEADER + "0\t0\tdecoding\ttext\t1\t-\n", r"line 2: phase 'decoding' is not one of prefill, "
                                              r"decode"),
    (HEADER + "0\t0\tdecode\taudio\t1\t-\n", r"line 2: modality 'audio' is not one of text"),
    (HEADER + "0\t0\tdecode\ttext\t1\t-\n0\t1\tdecode\ttext\t1\t-\n",
     r"line 3: request 1 / phase 1 differ from the step's first token \(line 2"),
    (HEADER + "@pinned\t2\n", r"line 2: pinned layer 2 is outside 0\.\.1"),
    (HEADER + "@attr\tx\t{oops\n", r"line 2: value of attr 'x' is not JSON"),
    (HEADER + "@weights\t1\n", r"line 2: unknown directive '@weights'; allowed: @pinned, @attr"),
])
def test_malformed_plain_names_the_line(tmp_path, text, message):
    path = tmp_path / "bad.wbtrace"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as err:
        read_plain(path)
    assert "bad.wbtrace" in str(err.value)


def test_load_trace_dispatch_errors(tmp_path):
    assert FORMATS == ("auto", "store", "jsonl", "npy", "plain")
    (tmp_path / "t.csv").write_text("x")
    (tmp_path / "folder").mkdir()
    with pytest.raises(InputError, match=r"format 'csv' is unknown; allowed: auto, store, jsonl"):
        load_trace(tmp_path / "t.csv", format="csv")
    with pytest.raises(InputError, match=r"'.*nope\.jsonl' does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match=r"suffix '\.csv'; known suffixes: \.jsonl, \.npy"):
        load_trace(tmp_path / "t.csv")
    with pytest.raises(InputError, match=r"folder without zarr\.json"):
        load_trace(tmp_path / "folder")
    np.save(tmp_path / "r.npy", np.zeros((2, 1, 1), np.int16))
    with pytest.raises(InputError, match=r"option 'problem' does not apply to trace format 'npy'"
                                         r"; allowed options: num_experts, prefill_tokens"):
        load_trace(tmp_path / "r.npy", problem=0)
    assert load_trace(tmp_path / "r.npy", format="npy").num_tokens == 2
    with pytest.raises(InputError, match=r"trace file .*t\.csv.* line 1: 'x' is not a \.wbtrace"):
        load_trace(tmp_path / "t.csv", format="plain")


# -- a run recorded here -------------------------------------------------------------------------
def _record(embedded, demo_inputs, path, **knobs):
    image, prompt, _ = demo_inputs[0]
    rt = workbench.Runtime(embedded, cache_slots=6, pinned_layers=1, max_new_tokens=5,
                           ignore_eos=True, **knobs)
    return rt.run(prompt, images=[image], store=path).store


@pytest.fixture(scope="module")
def recorded(embedded, demo_inputs, tmp_path_factory):
    """A real run of the embedded model (vision prefill + 4 decode steps), lookahead depth 2."""
    return _record(embedded, demo_inputs, tmp_path_factory.mktemp("run") / "r.zarr",
                   lookahead_depth=2)


def test_from_store_groups_match_the_recorded_run(recorded):
    ds = workbench.open_run(recorded)
    tr = load_trace(recorded)
    assert tr.attrs["source"] == "store" and tr.attrs["path"] == str(recorded)
    assert tr.attrs["model_id"] == ds.attrs["model_id"] and tr.attrs["knob.cache_slots"] == "6"
    S, L, E = ds.sizes["step"], ds.sizes["layer"], ds.sizes["expert"]
    assert (tr.num_steps, tr.num_layers, tr.num_experts, tr.top_k) == (S, L, E, ds.sizes["k"])
    assert S == 5 and tr.phase.tolist() == [0, 1, 1, 1, 1] and (tr.step_request == 0).all()
    assert np.array_equal(tr.token_modality, ds.token_modality.values)
    assert (tr.token_modality == 1).any()  # the image's tokens are in the prefill
    assert np.array_equal(tr.pinned, ds.pinned.values) and tr.pinned.tolist()[:2] == [True, False]
    # independently of topk_ids: the per-step routed-token counts the recorder aggregated
    routed = ds.routed_tokens.sum("modality").transpose("step", "layer", "expert").values
    g = tr.groups()
    assert g.num_groups == S * L  # every layer routes every step
    assert np.array_equal(g.step, np.repeat(np.arange(S), L))
    assert np.array_equal(g.layer, np.tile(np.arange(L), S))
    assert np.array_equal(g.step_tokens, ds.step_tokens.values)
    hits, misses, pinned_acc = ds.hits.values, ds.misses.values, ds.pinned_accesses.values
    for i in range(g.num_groups):
        s, layer = g.step[i], g.layer[i]
        sl = slice(g.ptr[i], g.ptr[i + 1])
        assert g.expert[sl].tolist() == np.flatnonzero(routed[s, layer]).tolist()
        assert g.expert_tokens[sl].tolist() == routed[s, layer][routed[s, layer] > 0].tolist()
        n = int(g.ptr[i + 1] - g.ptr[i])
        if tr.pinned[layer]:  # the pinned prefix: accesses, not cache lookups
            assert (pinned_acc[s, layer], hits[s, layer], misses[s, layer]) == (n, 0, 0)
        else:
            assert hits[s, layer] + misses[s, layer] == n and pinned_acc[s, layer] == 0
    assert int(misses.sum()) > 0  # 6 slots for 7 offloaded layers: the cache really missed


def test_from_store_takes_recorded_lookahead(recorded, embedded, demo_inputs, tmp_path):
    ds = workbench.open_run(recorded)
    tr = from_store(ds)
    assert tr.attrs["path"] == str(recorded)
    assert np.array_equal(tr.pred_ids, ds.pred_ids.transpose("token", "layer", "depth", "k"))
    assert tr.pred_ids.shape[2] == 2 and (tr.pred_ids[:, :-1] >= 0).any()
    assert (tr.pred_ids[:, -1] == -1).all()  # nothing lies past the last layer
    # dims in another order are put back in the Trace's order
    swapped = ds.assign(pred_ids=ds.pred_ids.transpose("token", "depth", "layer", "k"))
    assert np.array_equal(from_store(swapped).pred_ids, tr.pred_ids)
    # a run without lookahead stores -1 only: no pred_ids
    off = from_store(_record(embedded, demo_inputs, tmp_path / "off.zarr", lookahead_depth=0))
    assert off.pred_ids is None
    with pytest.raises(InputError, match=r"has no variable 'topk_ids'"):
        from_store(ds.drop_vars("topk_ids"))
    with pytest.raises(InputError, match=r"run store .*missing\.zarr' does not exist"):
        from_store(tmp_path / "missing.zarr")


def test_store_trace_plain_round_trip(recorded, tmp_path):
    tr = from_store(recorded)
    back = read_plain(write_plain(tr, tmp_path / "run.wbtrace"))
    assert_same(tr, back)
    assert tr.pred_ids is not None and back.pred_ids is None
    assert back.attrs["knob.cache_slots"] == "6"
    assert "# pred_ids are not stored" in (tmp_path / "run.wbtrace").read_text()


def test_weights_written_short_when_exact():
    from workbench.traces.formats import _fmt_weight

    for x in (0.1, 0.75, 1e-40, 3.4e38, -0.0, math.pi):
        w = np.float32(x)
        s = _fmt_weight(w)
        assert np.float32(float(s)).view(np.uint32) == w.view(np.uint32)
    assert _fmt_weight(np.float32(0.1)) == "0.1"
