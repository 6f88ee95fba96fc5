"""Cache-aware routing (Cache-Prior, arXiv 2412.00099; issue 40 §2): the rule, the live stage,
its exactness at λ = 0, live = replay on a store recorded with it, and its knobs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from workbench.errors import KnobError
from workbench.knobs import Knobs
from workbench.policies.cache_routing import cache_prior


def test_the_rule_moves_near_ties_to_residents_and_keeps_confident_routing():
    z = np.array([[4.0, 3.9, 3.0, 0.0, -1.0],    # expert 2 within 0.9 of expert 1
                  [9.0, 8.0, 1.0, 0.5, 0.0]])    # expert 2 far below the top-2
    resident = np.array([False, False, True, False, False])
    ids0, w0 = cache_prior(z, resident, 0.0, 5.0, 2)
    assert ids0.tolist() == [[0, 1], [0, 1]]  # λ = 0: the model's top-k
    ids, w = cache_prior(z, resident, 0.2, 5.0, 2)  # bias 1.0
    assert ids.tolist() == [[0, 2], [0, 1]]  # 3.0 + 1.0 ties 4.0: the lower id first
    p = np.exp(z[0] - z[0].max())
    p /= p.sum()
    np.testing.assert_allclose(w[0], p[[0, 2]] / p[[0, 2]].sum())  # unmodified logits' weights
    np.testing.assert_allclose(w[1], w0[1])


class _Cache:
    def __init__(self, keys):
        self.keys = set(keys)

    def __contains__(self, key):
        return key in self.keys


def _call(block, hs, step, cache):
    from workbench.runtime.stages import LayerCall

    with torch.no_grad():
        _, w, ids = block.route(hs)
    return LayerCall(block, hs, ids, w, step, False, cache=cache)


def test_the_stage_runs_the_rule_on_the_router_and_counts_what_it_moved():
    from workbench.models.adapter import find_moe_blocks
    from workbench.models.tiny import tiny_model
    from workbench.runtime.stages.cache_routing import CacheRouting

    model = tiny_model("qwen3_moe")
    b = find_moe_blocks(model).blocks[1]
    torch.manual_seed(0)
    hs = torch.randn(12, model.config.hidden_size)
    E, k = b.num_experts, b.top_k
    resident = {0, 3}
    cache = _Cache({(b.index, e) for e in resident})
    st = CacheRouting(0.6)
    prefill = _call(b, hs, 0, cache)
    ids_before = prefill.ids.clone()
    st.route(prefill)  # prefill: Δ_avg only, routing untouched
    assert torch.equal(prefill.ids, ids_before) and st.delta(b.index) > 0
    call = _call(b, hs, 1, cache)
    with torch.no_grad():
        logits = b.route(hs)[0].float()
    delta = (st.delta(b.index) * 12 + float((logits.max(-1).values
                                             - logits.min(-1).values).sum())) / 24
    orig_ids, orig_w = call.ids.clone(), call.weights.clone()
    st.route(call)
    m = np.isin(np.arange(E), list(resident))
    # the tiny model's router renormalises its top-k or not (norm_topk_prob): the stage
    # follows the model's own rule
    norm = bool(getattr(model.config, "norm_topk_prob", False))
    ref_ids, ref_w = cache_prior(logits.numpy(), m, 0.6, delta, k, normalize=norm)
    got = call.ids.numpy()
    changed = np.sort(ref_ids, -1) != np.sort(orig_ids.numpy(), -1)
    changed = changed.any(-1)
    assert changed.any()  # the bias moved some tokens
    np.testing.assert_array_equal(np.sort(got[changed], -1), np.sort(ref_ids[changed], -1))
    # the others keep the router's ids and weights exactly
    assert torch.equal(call.ids[~torch.as_tensor(changed)], orig_ids[~torch.as_tensor(changed)])
    assert torch.equal(call.weights[~torch.as_tensor(changed)],
                       orig_w[~torch.as_tensor(changed)])
    # every moved token gained residents, and its weights are the router's probabilities
    for t in np.nonzero(changed)[0]:
        assert m[got[t]].sum() > m[orig_ids[t].numpy()].sum()
        order = np.argsort(got[t])
        np.testing.assert_allclose(call.weights[t].numpy()[order],
                                   ref_w[t][np.argsort(ref_ids[t])], rtol=1e-5)
    moved = sum(len(set(got[t]) - set(orig_ids[t].tolist())) for t in range(len(got)))
    assert st.cache_rerouted == moved > 0


@pytest.fixture(scope="module")
def embedded_runs(embedded, demo_inputs, tmp_path_factory):
    """Demo input 0 on the embedded model at 48 slots, no pinned layers: off, λ = 0 and
    λ = 1 (stored)."""
    from workbench.runtime.runtime import Runtime

    root = tmp_path_factory.mktemp("cacherouting")
    image, prompt, _ = demo_inputs[0]
    base = dict(cache_slots=48, pinned_layers=0, max_new_tokens=8, ignore_eos=True,
                device="cpu")
    out = {}
    for name, kn in (("off", {}), ("zero", dict(cache_routing=True, cache_routing_strength=0.0)),
                     ("one", dict(cache_routing=True, cache_routing_strength=1.0))):
        rt = Runtime(embedded, knobs=Knobs(**base, **kn))
        out[name] = (rt.run(prompt, [image], store=root / f"{name}.zarr"), root / f"{name}.zarr")
    return out


def test_strength_zero_is_the_model_exactly(embedded_runs):
    import workbench

    (off, off_store), (zero, zero_store) = embedded_runs["off"], embedded_runs["zero"]
    assert zero.token_ids == off.token_ids and zero.text == off.text
    assert (zero.hits, zero.misses, zero.loads) == (off.hits, off.misses, off.loads)
    assert zero.cache_rerouted == 0
    a, b = workbench.open_run(off_store), workbench.open_run(zero_store)
    np.testing.assert_array_equal(a["topk_ids"].values, b["topk_ids"].values)
    assert off.knobs["cache_routing"] is False and zero.knobs["cache_routing"] is True


def test_a_bias_saves_misses_and_the_store_replays_live(embedded_runs, assert_replays_live):
    import workbench
    from workbench.replay import replay_trace

    off, (one, store) = embedded_runs["off"][0], embedded_runs["one"]
    assert one.cache_rerouted > 0
    assert one.misses < off.misses
    ds = workbench.open_run(store)
    assert json.loads(ds.attrs["knob.cache_routing"]) is True
    # the store holds the routing after the rewrite: its replay is the live run
    res = replay_trace(ds, belady=False)
    assert_replays_live(res, ds)
    assert int(res.misses.sum()) == one.misses


@pytest.mark.parametrize("assign, fragment", [
    ("cache_routing_strength=1.5", "cache_routing_strength"),
    ("cache_routing_strength=-0.1", "cache_routing_strength"),
    ("cache_routing_strength=strong", "cache_routing_strength"),
    ("cache_routing=maybe", "cache_routing must be a boolean"),
])
def test_bad_values_are_one_clear_line(assign, fragment):
    with pytest.raises(KnobError) as e:
        Knobs().set_from_strings([assign])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_not_with_subexpert_offloading_live_but_replay_takes_it():
    from workbench.knobs import ModelShape

    k = Knobs(cache_routing=True, prism=True, prism_offload=True)
    shape = ModelShape(num_layers=4, top_k=2)
    with pytest.raises(KnobError, match="cache_routing=True with prism_offload=True"):
        k.group("cache_routing").check(k, shape, live=True)
    k.group("cache_routing").check(k, shape, live=False)


def test_off_by_default_and_listed_with_the_knobs():
    k = Knobs()
    assert k.cache_routing is False and 0.0 <= k.cache_routing_strength <= 1.0
    assert "cache_routing" in k.to_dict() and "cache_routing_strength" in k.to_dict()
