"""Router lookahead, ActiveEvict pre-eviction, budget-aware dynamic top-k and its quality cost
(seed 003, SPEC §2)."""

import time

import numpy as np
import pytest
import torch

import workbench
from workbench.errors import KnobError
from workbench.knobs import Knobs
from workbench.models.adapter import find_moe_blocks
from workbench.models.inputs import Request, build_inputs
from workbench.models.tiny import TINY_ARCHITECTURES, greedy_outputs, tiny_inputs, tiny_model
from workbench.policies.active_evict import (ActiveEvict, Hotness, budget_topk, release_target)
from workbench.policies.eviction import EVICTION
from workbench.sim.cache import ExpertCache
from workbench.runtime.executor import StepProbe
from workbench.runtime.offload import Offloader


def _ae(layout):
    return ActiveEvict(layout.num_layers, layout.num_experts, alpha=0.5, decay=0.9, window=8,
                       tau=0.05, r_max=2)


# -- router lookahead ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_lookahead_equals_next_router_on_the_same_hidden_state(arch):
    model = tiny_model(arch)
    inputs = tiny_inputs(model, arch)
    layout = find_moe_blocks(model)
    L, k = layout.num_layers, layout.top_k
    seen: dict[int, torch.Tensor] = {}  # layer → the MoE block's input, as its router saw it
    hooks = [b.block.register_forward_pre_hook(
        lambda m, args, i=b.index: seen.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for b in layout.blocks]
    probe = StepProbe(time.perf_counter())
    try:
        with Offloader(layout, 3, 1, EVICTION.create("lru"), "cpu", probe, lookahead_depth=2):
            with torch.no_grad():
                model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    assert [ev.layer for ev in probe.layers] == list(range(L))
    for ev in probe.layers:
        pred = ev.pred_ids
        T = seen[ev.layer].shape[0]
        assert pred.dtype == np.int16 and pred.shape[0] == T and pred.shape[2] == k
        for d in (1, 2):
            j = ev.layer + d
            if j >= L:  # past the last layer: nothing predicted
                assert pred.shape[1] < d or (pred[:, d - 1] == -1).all()
                continue
            with torch.no_grad():  # independent: the router module itself, called normally
                _, _, want = layout.blocks[j].router(seen[ev.layer])
            np.testing.assert_array_equal(pred[:, d - 1], want.numpy(),
                                          err_msg=f"{arch} layer {ev.layer} + {d}")


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_lookahead_and_active_evict_do_not_change_outputs(arch):
    model = tiny_model(arch)
    inputs = tiny_inputs(model, arch)
    ref_logits, ref_tokens = greedy_outputs(model, inputs)
    layout = find_moe_blocks(model)
    top_ks = [b.router.top_k for b in layout.blocks]
    for slots, pinned in [(2, 0), (3, 1), (5, 2), (24, 0)]:
        with Offloader(layout, slots, pinned, EVICTION.create("lru"), "cpu",
                       StepProbe(time.perf_counter()), lookahead_depth=2,
                       active_evict=_ae(layout)):
            logits, tokens = greedy_outputs(model, inputs)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
        assert torch.equal(tokens, ref_tokens), (arch, slots, pinned)
    assert [b.router.top_k for b in layout.blocks] == top_ks


def test_lookahead_is_invisible_to_router_logit_recording():
    """transformers records router logits with hooks on the router modules; lookahead calls
    the routers' forward directly, so the recorded logits are the model's own."""
    model = tiny_model("mixtral")
    ids = torch.randint(3, 120, (1, 9))
    with torch.no_grad():
        ref = model(ids, output_router_logits=True).router_logits
        layout = find_moe_blocks(model)
        with Offloader(layout, 4, 1, EVICTION.create("lru"), "cpu", StepProbe(0.0),
                       lookahead_depth=2, active_evict=_ae(layout)):
            got = model(ids, output_router_logits=True).router_logits
    assert len(got) == len(ref) == layout.num_layers
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


# -- ActiveEvict ------------------------------------------------------------------------------
def test_release_target_and_budget_topk_follow_the_paper():
    p = np.array([0.30, 0.25, 0.20, 0.19, 0.06])  # sorted already
    # k = 2 predicted, 1 resident → gap 1; boundary gaps p(2)-p(3)=0.05, p(3)-p(4)=0.01
    assert release_target(p, 2, 1, tau=0.02, r_max=2) == 1 + 1
    assert release_target(p, 2, 1, tau=0.06, r_max=2) == 1 + 2
    assert release_target(p, 2, 1, tau=0.06, r_max=1) == 1 + 1
    assert release_target(p, 2, 2, tau=0.0, r_max=2) == 0
    assert release_target(p[::-1], 2, 0, tau=0.0, r_max=0) == 2  # order of p̂ does not matter
    ranked = np.array([[5, 1, 2, 7]])
    resident = {1, 7}
    assert budget_topk(ranked, resident.__contains__, avail=0) == 1  # at least 1
    assert budget_topk(ranked, resident.__contains__, avail=1) == 2
    assert budget_topk(ranked, resident.__contains__, avail=2) == 4
    # several tokens: misses are counted once over the union
    two = np.array([[5, 1], [5, 2]])
    assert budget_topk(two, resident.__contains__, avail=1) == 1
    assert budget_topk(two, resident.__contains__, avail=2) == 2


def test_hotness_is_a_decayed_sliding_window():
    h = Hotness(num_layers=1, num_experts=4, window=3, decay=0.5)
    for ids in ([[0, 1]], [[1, 2]], [[3, -1]], [[1, 3]]):
        h.observe(0, np.array(ids))
    # window = last 3 tokens: {1,2} γ², {3} γ, {1,3} 1
    np.testing.assert_allclose(h.u(0), [0.0, 0.25 + 1, 0.25, 0.5 + 1])
    h.observe(0, np.array([[0, 1], [0, 2], [0, 3], [2, 1]]))  # more tokens than the window
    # last 3: {0,2} γ², {0,3} γ, {2,1} 1
    np.testing.assert_allclose(h.u(0), [0.25 + 0.5, 1.0, 0.25 + 1, 0.5])


def _full_cache():
    cache = ExpertCache(6, EVICTION.create("lru"), num_layers=3, num_experts=6)
    for key in [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (2, 3)]:
        cache.admit(key)
    return cache


def test_pre_evict_frees_delta_slots_lowest_importance_first_and_spares_protected():
    protected = {(1, 0), (1, 1)}  # the current layer (1) still needs both of its experts
    p_next = np.array([0.1, 0.1, 0.1, 0.1, 0.3, 0.3])

    def make(alpha):
        ae = ActiveEvict(3, 6, alpha=alpha, decay=1.0, window=4, tau=0.0, r_max=0)
        ae.observe(2, np.array([[0, 1], [0, 1], [0, 2]]))  # layer 2: u = [3, 2, 1, 0, 0, 0]
        return ae

    cache = _full_cache()
    # predicted {3}: resident → Δ = 1 − 1 = 0, nothing to release
    assert make(1.0).pre_evict(cache, 2, {3}, p_next, protected) == []
    # predicted {4, 5}: Δ = 2, no free slot → the two coldest unprotected experts go
    ev = cache.evictions.copy()
    victims = make(1.0).pre_evict(cache, 2, {4, 5}, p_next, protected)
    assert victims == [(2, 3), (2, 2)] and not set(victims) & protected
    assert all(v not in cache.slot_of for v in victims) and len(cache._free) == 2
    assert cache.evictions[2] == ev[2] + 2  # counted as evictions of their layer
    # free slots count towards Δ: nothing more to do
    assert make(1.0).pre_evict(cache, 2, {4, 5}, p_next, protected) == []
    # a predicted expert is never pre-evicted, even when it is the coldest
    cache = _full_cache()
    assert make(1.0).pre_evict(cache, 2, {3, 4}, p_next, protected) == [(2, 2)]
    # α = 0: prediction only (p̂ of layer 2 ranks (2,0) lowest, ties by key)
    cache = _full_cache()
    p = np.array([0.0, 0.2, 0.1, 0.1, 0.3, 0.3])
    assert make(0.0).pre_evict(cache, 2, {4}, p, protected) == [(2, 0)]
    # everything protected or predicted: nothing may go, whatever Δ says
    cache = _full_cache()
    assert make(0.5).pre_evict(cache, 2, {4, 5}, p_next, set(cache.slot_of)) == []
    assert len(cache.slot_of) == 6


def test_importance_reduces_to_hotness_at_alpha_1_and_to_prediction_at_alpha_0():
    resident = [(2, 0), (2, 1), (2, 2), (1, 0)]
    p = np.array([0.05, 0.6, 0.3, 0.05])
    s = {}
    for a in (0.0, 0.3, 1.0):
        ae = ActiveEvict(3, 4, alpha=a, decay=1.0, window=4, tau=0.0, r_max=0)
        ae.observe(2, np.array([[0, 1], [0, 2], [0, 1]]))  # layer 2: u = [3, 2, 1, 0]
        ae.p_hat[2] = p
        s[a] = ae.scores(resident[:3], resident)
    # h normalised over layer 2's resident experts: u / (3 + 2 + 1)
    h = {(2, e): u / 6 for e, u in enumerate([3, 2, 1])}
    assert s[1.0] == pytest.approx(h)  # α = 1: hotness only
    assert s[0.0] == pytest.approx({(2, e): p[e] for e in range(3)})  # α = 0: prediction only
    assert s[0.3] == pytest.approx({k: 0.3 * h[k] + 0.7 * p[k[1]] for k in h})
    # the two signals rank the experts oppositely here, so α decides who is evicted first
    assert min(s[1.0], key=s[1.0].get) == (2, 2) and min(s[0.0], key=s[0.0].get) == (2, 0)


def test_dynamic_topk_narrows_when_the_release_slack_misses_a_misprediction():
    """The budget of dynamic top-k (free slots at the gate, B − H_l) is what pre-eviction
    released: Δ = (k − Ĥ) + r_k. A misprediction of l+1 beyond r_k narrows k; r_k slots of
    slack cover it."""
    protected = {(1, e) for e in range(4)}  # layer 1 is computing its top-4
    predicted = {0, 1, 2, 3}  # of layer 2; 0 and 1 resident → Ĥ = 2
    actual = np.array([[0, 2, 3, 7]])  # layer 2's router: 1 mispredicted as 7

    def gate_k(r_max: int, p_next: np.ndarray) -> tuple[int, int]:
        cache = ExpertCache(10, EVICTION.create("lru"), num_layers=3, num_experts=8)
        for key in [*sorted(protected), (2, 0), (2, 1), (2, 4), (2, 5), (2, 6), (0, 7)]:
            cache.admit(key)
        ae = ActiveEvict(3, 8, alpha=0.5, decay=1.0, window=4, tau=0.02, r_max=r_max)
        ae.pre_evict(cache, 2, predicted, p_next, protected)
        avail = cache.free_slots()
        return budget_topk(actual, lambda e: (2, e) in cache, avail), avail

    flat = np.full(8, 1 / 8)  # every boundary gap < τ: r_k = r_max
    assert gate_k(0, flat) == (3, 2)  # Δ = 2 frees 2 slots; u(4) = 3 (2, 3, 7) → k = 3
    assert gate_k(2, flat) == (4, 4)  # Δ = 2 + 2 covers the misprediction → full top-4
    steep = np.array([0.35, 0.3, 0.15, 0.1, 0.06, 0.02, 0.01, 0.01])  # gaps at 4, 5 > τ
    assert gate_k(2, steep)[0] == 3  # r_k = 0 at a confident boundary: narrows again


def test_runtime_active_evict_protects_the_current_layer_and_books_pre_evictions(tiny_ckpt,
                                                                                 tmp_path):
    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=3, pinned_layers=0,
                           max_new_tokens=8, ignore_eos=True, device="cpu")
    seen = []
    orig = ActiveEvict.pre_evict

    def spy(self, cache, next_layer, demand, p_next, protected):
        victims = orig(self, cache, next_layer, demand, p_next, protected)
        seen.append((next_layer, set(protected), victims))
        return victims

    ActiveEvict.pre_evict = spy
    try:
        res = rt.run("protect me", store=tmp_path / "ae.zarr", active_evict=True)
    finally:
        ActiveEvict.pre_evict = orig
    assert res.pre_evictions > 0 and seen
    ds = workbench.open_run(res.store)
    L = ds.sizes["layer"]
    # one decision per (step, layer l < L-1), in order; its protected set is exactly layer l's
    # routed experts of that step (from the store), and no victim is protected
    assert len(seen) == ds.sizes["step"] * (L - 1)
    i = 0
    for step in range(ds.sizes["step"]):
        tok = ds.token_step.values == step
        for layer in range(L - 1):
            nxt, protected, victims = seen[i]
            i += 1
            routed = {(layer, int(e)) for e in np.unique(ds.topk_ids.values[tok, layer])}
            assert nxt == layer + 1 and protected == routed
            assert not set(victims) & protected
    # the store books pre-evictions (and counts them as evictions)
    assert int(ds.pre_evictions.sum()) == res.pre_evictions == sum(len(v) for *_, v in seen)
    assert int(ds.evictions.sum()) == res.evictions
    assert (ds.pre_evictions <= ds.evictions).all()
    assert json_knob(ds, "active_evict") is True
    # lookahead recorded: depth coordinate 1..2, nothing past the last layer
    assert ds.sizes["depth"] == 2 and list(ds.depth.values) == [1, 2]
    assert (ds.pred_ids.values[:, L - 1] == -1).all()
    assert (ds.pred_ids.values[:, L - 2, 1] == -1).all()
    assert (ds.pred_ids.values[:, 0, 0] >= 0).all()


def json_knob(ds, name):
    import json

    return json.loads(ds.attrs[f"knob.{name}"])


def test_lookahead_off_stores_no_predictions(tiny_ckpt, tmp_path):
    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=4, pinned_layers=1,
                           max_new_tokens=3, device="cpu")
    ds = workbench.open_run(rt.run("off", store=tmp_path / "o.zarr", lookahead_depth=0).store)
    assert ds.sizes["depth"] == 1 and (ds.pred_ids.values == -1).all()
    assert (ds.pre_evictions.values == 0).all()
    assert (ds.topk_used.values == ds.attrs["top_k"]).all()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_active_evict_generates_the_plain_models_tokens(tiny_ckpt, arch):
    rt = workbench.Runtime(tiny_ckpt(arch), max_new_tokens=10, ignore_eos=True, device="cpu")
    inputs = build_inputs(rt.lm, Request("same tokens"), 10).tensors
    with torch.no_grad():
        plain = rt.lm.model.generate(**inputs, max_new_tokens=10, min_new_tokens=10,
                                     do_sample=False, temperature=None, top_p=None, top_k=None)
    want = plain[0, inputs["input_ids"].shape[-1]:].tolist()
    for slots, pinned in [(2, 0), (3, 1), (16, 1)]:
        res = rt.run("same tokens", record=False, cache_slots=slots, pinned_layers=pinned,
                     active_evict=True, dynamic_topk=False)
        assert res.token_ids == want, (arch, slots, pinned)


def test_embedded_active_evict_generates_the_plain_models_tokens(embedded, demo_inputs):
    image, prompt, _ = demo_inputs[0]
    rt = workbench.Runtime(embedded, max_new_tokens=8, ignore_eos=True)
    inputs = build_inputs(embedded, Request(prompt, [image]), 8).tensors
    with torch.no_grad():
        plain = embedded.model.generate(**inputs, max_new_tokens=8, min_new_tokens=8,
                                        do_sample=False, temperature=None, top_p=None,
                                        top_k=None)
    want = plain[0, inputs["input_ids"].shape[-1]:].tolist()
    res = rt.run(Request(prompt, [image]), record=False, cache_slots=16, active_evict=True)
    assert res.token_ids == want and res.pre_evictions > 0


# -- dynamic top-k --------------------------------------------------------------------------------
def test_dynamic_topk_uses_k_within_bounds_and_narrows_under_pressure(tiny_ckpt, tmp_path):
    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=2, pinned_layers=1,
                           max_new_tokens=8, ignore_eos=True, device="cpu")
    res = rt.run("narrow", store=tmp_path / "d.zarr", dynamic_topk=True)
    ds = workbench.open_run(res.store)
    used = ds.topk_used.values  # [step, layer]
    k = ds.attrs["top_k"]
    assert (used[0] == k).all()  # the prefill keeps the model's top-k
    assert (used[:, 0] == k).all()  # the pinned layer too
    dec = used[1:, 1:]
    assert ((dec >= 1) & (dec <= k)).all() and (dec < k).any()
    # the store's routing holds exactly the used experts
    ids = ds.topk_ids.values
    for s in range(ds.sizes["step"]):
        tok = ds.token_step.values == s
        for l in range(ds.sizes["layer"]):
            assert ((ids[tok, l] >= 0).sum(-1) == used[s, l]).all()


def test_dynamic_topk_can_widen_up_to_k_max(tiny_ckpt, tmp_path):
    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=16, pinned_layers=1,
                           max_new_tokens=6, ignore_eos=True, device="cpu")
    res = rt.run("wide", store=tmp_path / "w.zarr", dynamic_topk=True, k_max=4)
    ds = workbench.open_run(res.store)
    assert ds.sizes["k"] == 4
    dec = ds.topk_used.values[1:, 1:]
    assert ((dec >= 1) & (dec <= 4)).all() and (dec > ds.attrs["top_k"]).any()
    with pytest.raises(KnobError, match="k_max must be between 1 and 8"):
        rt.run("too wide", record=False, dynamic_topk=True, k_max=9)


def test_quality_reports_agreement_and_kl(tiny_ckpt):
    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=2, pinned_layers=1,
                           max_new_tokens=8, ignore_eos=True, device="cpu")
    q = rt.quality("quality", dynamic_topk=True)
    assert 0.0 <= q.agreement <= 1.0 and q.kl_mean >= 0.0 and (q.kl >= 0).all()
    assert q.positions == len(q.reference_tokens) == 8
    assert q.modified.knobs["dynamic_topk"] and not q.reference.knobs["dynamic_topk"]
    assert q.modified.token_ids == q.reference_tokens  # teacher-forced on the reference
    assert q.modified.misses < q.reference.misses  # it did narrow routing
    assert q.kl_mean > 0.0  # ... which changes the distributions
    plain = rt.run("quality", record=False)
    assert q.reference_tokens == plain.token_ids
    off = rt.quality("quality", dynamic_topk=False, active_evict=True)
    assert off.agreement == 1.0 and off.kl_mean == 0.0 and off.kl_max == 0.0
    assert "agreement" in q.summary()


def test_quality_on_the_embedded_model(embedded, demo_inputs):
    image, prompt, _ = demo_inputs[0]
    rt = workbench.Runtime(embedded, max_new_tokens=6, ignore_eos=True)
    q = rt.quality(Request(prompt, [image]), cache_slots=16)
    assert 0.0 <= q.agreement <= 1.0 and q.kl_mean >= 0.0 and q.positions == 6


def test_knob_group_is_registered_with_bounds():
    k = Knobs()
    g = k.group("active_evict")
    assert {"lookahead_depth", "active_evict", "ae_alpha", "ae_decay", "ae_window", "ae_tau",
            "ae_rmax", "dynamic_topk", "k_max"} <= set(g.knob_names())
    assert (k.lookahead_depth, k.active_evict, k.dynamic_topk, k.k_max) == (2, False, False,
                                                                            None)
    for bad in ("ae_alpha=1.5", "ae_decay=0", "ae_window=0", "lookahead_depth=-1", "k_max=0"):
        with pytest.raises(KnobError):
            Knobs().set_from_strings([bad])
    assert Knobs.from_attrs(Knobs(active_evict=True, k_max=3).to_attrs()).k_max == 3
