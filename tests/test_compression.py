"""Visual-token compression (issue 5 §1, seed VisMMOE Algorithm 1): faithful placement,
the selection policies, telemetry of pruned runs and the knobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench.compression.placement import PrunedPlacement
from workbench.compression.policies import (COMPRESSION, AffinityCompression, SelectionInput,
                                            affinity_keep, marginal_expansion, minmax)
from workbench.errors import KnobError
from workbench.telemetry.events import TEXT

STEPS = 4


def _inputs(lm, demo_inputs, i=0):
    from workbench.models.inputs import Request, build_inputs

    image, prompt, _ = demo_inputs[i]
    return build_inputs(lm, Request(prompt, [image])).tensors


def _eos(model):
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


@torch.no_grad()
def _generate(model, tensors, steps=STEPS):
    out = model.generate(**tensors, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         temperature=None, top_p=None, top_k=None, output_logits=True,
                         return_dict_in_generate=True)
    S = tensors["input_ids"].shape[1]
    return out.sequences[0, S:].tolist(), torch.cat(out.logits)


@torch.no_grad()
def _reference(model, tensors, keep_positions, kept_visual, steps=STEPS):
    """The model on the input with the pruned visual tokens removed, at their original M-RoPE
    positions (the text model called directly; greedy with EOS masked like min_new_tokens)."""
    eos = _eos(model)

    def pick(lg):
        lg = lg.clone()
        lg[..., eos] = -float("inf")
        return int(lg.argmax())

    m = model.model
    ids = tensors["input_ids"]
    emb = m.get_input_embeddings()(ids)
    feats = m.get_image_features(tensors["pixel_values"], tensors["image_grid_thw"],
                                 return_dict=True)
    vis = ids == model.config.image_token_id
    emb = emb.masked_scatter(vis[..., None], torch.cat(feats.pooler_output).to(emb.dtype))
    pos, _ = m.get_rope_index(ids, tensors["mm_token_type_ids"], tensors["image_grid_thw"],
                              attention_mask=tensors["attention_mask"])  # [3, 1, S]
    kp = keep_positions
    ds = [torch.cat(f)[kept_visual] for f in feats.deepstack_features]
    out = m.language_model(inputs_embeds=emb[:, kp], position_ids=pos[:, :, kp],
                           visual_pos_masks=vis[:, kp], deepstack_visual_embeds=ds,
                           use_cache=True)
    cache, last = out.past_key_values, pos[:, :, kp][..., -1:]
    logits = [model.lm_head(out.last_hidden_state[:, -1])]
    toks = [pick(logits[-1])]
    for i in range(steps - 1):
        e = m.get_input_embeddings()(torch.tensor([[toks[-1]]]))
        out = m.language_model(inputs_embeds=e, position_ids=last + 1 + i, past_key_values=cache,
                               use_cache=True)
        logits.append(model.lm_head(out.last_hidden_state[:, -1]))
        toks.append(pick(logits[-1]))
    return toks, torch.cat(logits)


def _no_hooks_left(lm):
    tm = lm.model.model.language_model
    assert "_deepstack_process" not in tm.__dict__
    assert not tm._forward_pre_hooks
    for layer in tm.layers:
        assert not layer._forward_pre_hooks and not layer.mlp.gate._forward_hooks
    for block in lm.model.model.visual.blocks:
        assert not block.attn._forward_hooks


# -- (a) faithful placement ---------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["random", "saliency", "affinity"])
def test_pinned_zero_equals_the_model_without_the_pruned_tokens(embedded, demo_inputs, policy):
    model = embedded.model
    T = _inputs(embedded, demo_inputs, 0)
    comp = COMPRESSION.create(policy, beta=0.5, alpha=0.1, lam=2.0, seed=3)
    with PrunedPlacement(model, embedded.layout, 0, comp, saliency_check=True) as pl:
        toks, logits = _generate(model, T)
    _no_hooks_left(embedded)
    n = int((T["input_ids"] == embedded.image_token_id).sum())
    assert pl.num_visual == n and pl.kept_visual.numel() == n // 2
    ref_toks, ref_logits = _reference(model, T, pl.keep_positions, pl.kept_visual)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # negative control: the unpruned model differs, so the comparison is sensitive
    _, plain = _generate(model, T)
    assert (plain - logits).abs().max() > 1e-2


def test_pinned_zero_through_the_runtime(embedded, demo_inputs):
    """Runtime.run with offloading and compression gives the reference's tokens."""
    import workbench

    image, prompt, _ = demo_inputs[1]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=STEPS, ignore_eos=True)
    res = rt.run(prompt, [image], record=False, compression="random", beta=0.5, seed=1,
                 pinned_layers=0, cache_slots=32)
    T = _inputs(embedded, demo_inputs, 1)
    comp = COMPRESSION.create("random", beta=0.5, seed=1)
    with PrunedPlacement(embedded.model, embedded.layout, 0, comp) as pl:
        toks, _ = _generate(embedded.model, T)
    assert res.token_ids == toks
    ref, _ = _reference(embedded.model, T, pl.keep_positions, pl.kept_visual)
    assert res.token_ids == ref
    assert res.kept_visual_tokens == res.visual_tokens // 2


# -- (b) pinned prefix, decoding, hooks removed ---------------------------------------------------
def test_pinned_prefix_keeps_text_and_exactly_k_keep(embedded, demo_inputs, tmp_path):
    import workbench
    from workbench import open_run

    T = _inputs(embedded, demo_inputs, 2)
    _, before = _generate(embedded.model, T)
    image, prompt, _ = demo_inputs[2]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=STEPS, ignore_eos=True)
    res = rt.run(prompt, [image], store=tmp_path / "a.zarr", compression="affinity", beta=0.7,
                 pinned_layers=2, cache_slots=24)
    _no_hooks_left(embedded)
    n = res.visual_tokens
    assert n > 0 and res.kept_visual_tokens == int(0.7 * n)
    assert len(res.token_ids) == STEPS and res.steps == STEPS
    ds = open_run(res.store)
    kept, mod = ds["kept"].values, ds["token_modality"].values
    assert kept[mod == TEXT].all()  # text (prompt and generated) is never pruned
    assert int((kept & (mod != TEXT)).sum()) == int(0.7 * n)
    assert float(ds.attrs["compression_select_s"]) > 0 and float(
        ds.attrs["compression_saliency_s"]) > 0
    _, after = _generate(embedded.model, T)
    torch.testing.assert_close(after, before, atol=0, rtol=0)  # the model is untouched


# -- (c) saliency is affinity with λ = 0 -------------------------------------------------------
def test_saliency_is_affinity_with_lambda_zero(embedded, demo_inputs):
    import workbench

    image, prompt, _ = demo_inputs[3]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=2, pinned_layers=2,
                           cache_slots=24)
    captured = {}
    for name, lam in (("saliency", 2.0), ("affinity", 0.0)):
        orig = AffinityCompression.select

        def spy(self, inp, _name=name, _orig=orig):
            out = _orig(self, inp)
            captured[_name] = (inp, out)
            return out

        AffinityCompression.select = spy
        try:
            rt.run(prompt, [image], record=False, compression=name, lam=lam)
        finally:
            AffinityCompression.select = orig
    assert torch.equal(captured["saliency"][1], captured["affinity"][1])
    inp = captured["saliency"][0]
    assert inp.prefix_topk.shape[:2] == (2, inp.num_visual)
    # and as pure functions, on the recorded inputs
    for beta in (0.3, 0.5, 0.9):
        a = affinity_keep(inp.saliency, inp.prefix_topk, inp.num_experts, 0.1, beta, 0.0)
        s = COMPRESSION.create("saliency", beta=beta, alpha=0.1, lam=5.0).select(inp)
        assert torch.equal(a, s) and a.numel() == int(beta * inp.num_visual)


# -- (d) affinity prefers tokens inside E_target ---------------------------------------------
def _recorded_selection_input(embedded, demo_inputs) -> SelectionInput:
    T = _inputs(embedded, demo_inputs, 0)
    got = {}

    class Spy(AffinityCompression):
        def select(self, inp):
            got["inp"] = inp
            return super().select(inp)

    with PrunedPlacement(embedded.model, embedded.layout, 2, Spy(beta=0.5)):
        with torch.no_grad():
            embedded.model(**T)
    return got["inp"]


def test_affinity_prefers_tokens_whose_experts_are_in_the_target(embedded, demo_inputs):
    inp = _recorded_selection_input(embedded, demo_inputs)
    N, E = inp.num_visual, inp.num_experts
    P, _, k = inp.prefix_topk.shape
    alpha, beta, lam = 0.1, 0.5, 2.0
    st = minmax(inp.saliency)
    core = torch.argsort(-st, stable=True)[: int(alpha * N)]
    delta = marginal_expansion(inp.prefix_topk, core, E)
    # Δ against a direct set computation
    target = {(p, int(e)) for j in core.tolist() for p in range(P)
              for e in inp.prefix_topk[p, j].tolist()}
    for i in range(N):
        Ei = {(p, int(e)) for p in range(P) for e in inp.prefix_topk[p, i].tolist()}
        assert delta[i].item() == pytest.approx(len(Ei - target) / len(Ei))
    keep = set(affinity_keep(inp.saliency, inp.prefix_topk, E, alpha, beta, lam).tolist())
    assert set(core.tolist()) <= keep and len(keep) == int(beta * N)
    # dominance: a non-core token at least as salient and at most as expanding as a kept one
    # is kept too
    p = st - lam * delta
    rest = [i for i in range(N) if i not in set(core.tolist())]
    for i in rest:
        for j in rest:
            if j in keep and i not in keep:
                assert p[i] < p[j] or (p[i] == p[j] and i > j)
    # a constructed case: equal saliency, token 1's experts are the core's, token 2's are new
    s = torch.tensor([1.0, 0.5, 0.5, 0.0])
    pre = torch.tensor([[[0, 1], [0, 1], [2, 3], [0, 1]]])  # [P=1, N=4, k=2]
    assert affinity_keep(s, pre, 4, 0.25, 0.5, 2.0).tolist() == [0, 1]
    pre2 = torch.tensor([[[0, 1], [2, 3], [0, 1], [0, 1]]])
    assert affinity_keep(s, pre2, 4, 0.25, 0.5, 2.0).tolist() == [0, 2]
    # with λ = 0 the tie goes to the lower index whatever the experts
    assert affinity_keep(s, pre2, 4, 0.25, 0.5, 0.0).tolist() == [0, 1]
    # λ trades saliency against expansion: a low-saliency token inside E_target beats a
    # salient one outside it only when λ outweighs their saliency gap
    s3 = torch.tensor([1.0, 0.9, 0.0])
    pre3 = torch.tensor([[[0, 1], [2, 3], [0, 1]]])
    assert affinity_keep(s3, pre3, 4, 0.34, 0.67, 2.0).tolist() == [0, 2]
    assert affinity_keep(s3, pre3, 4, 0.34, 0.67, 0.5).tolist() == [0, 1]


# -- (e) the store of a pruned run; replay reproduces it -------------------------------------
@pytest.mark.parametrize("policy,pinned,prefetch", [("affinity", 2, "none"), ("random", 1, "none"),
                                                    ("saliency", 2, "speculative")])
def test_pruned_store_and_replay(embedded, demo_inputs, tmp_path, policy, pinned, prefetch):
    import workbench
    from workbench import open_run

    image, prompt, _ = demo_inputs[4]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=STEPS, ignore_eos=True)
    res = rt.run(prompt, [image], store=tmp_path / "p.zarr", compression=policy, beta=0.5,
                 pinned_layers=pinned, cache_slots=16, lookahead_depth=1,
                 prefetch=prefetch)
    ds = open_run(res.store)
    kept = ds["kept"].values
    vis = ds["token_modality"].values != TEXT
    assert int((kept & vis).sum()) == int(0.5 * res.visual_tokens)
    ids = ds["topk_ids"].values  # [token, layer, k]
    pruned = ~kept
    assert pruned.sum() == res.visual_tokens - res.kept_visual_tokens
    assert (ids[pruned][:, pinned:] == -1).all()
    assert (ds["topk_weights"].values[pruned][:, pinned:] == 0).all()
    assert (ds["pred_ids"].values[pruned][:, pinned:] == -1).all()
    assert (ids[pruned][:, :pinned] >= 0).all()
    assert (ids[kept] >= 0).all()
    assert ds.attrs["knob.compression"] == f'"{policy}"'
    r = ds.moe.replay()
    assert int(ds["misses"].sum()) > 0
    np.testing.assert_array_equal(r.hits, ds["hits"].values)
    np.testing.assert_array_equal(r.misses, ds["misses"].values)
    np.testing.assert_array_equal(r.evictions, ds["evictions"].values)
    np.testing.assert_array_equal(r.prefetch_loads, ds["prefetches"].values)
    np.testing.assert_allclose(r.step_latency_s, ds["latency_modeled_s"].values, rtol=1e-9)


def test_text_only_request_is_a_no_op(embedded):
    import workbench

    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=3, ignore_eos=True)
    a = rt.run("hello there", record=False, compression="affinity", pinned_layers=1)
    b = rt.run("hello there", record=False, pinned_layers=1)
    assert a.token_ids == b.token_ids and a.visual_tokens == 0


# -- (f) knobs -------------------------------------------------------------------------------
def test_bad_compression_knobs_are_refused(embedded):
    import workbench

    k = workbench.Knobs()
    assert k.compression == "none" and k.alpha == 0.1 and k.lam == 2.0
    assert COMPRESSION.available() == ["none", "random", "affinity", "saliency"]
    with pytest.raises(KnobError, match=r"beta.*0"):
        workbench.Knobs(beta=0)
    with pytest.raises(KnobError, match=r"beta.*1\.5"):
        workbench.Knobs(beta=1.5)
    with pytest.raises(KnobError, match="visionzip"):
        workbench.Knobs(compression="visionzip")
    with pytest.raises(KnobError, match="lam"):
        workbench.Knobs().set_from_strings(["lam=-1"])
    with pytest.raises(KnobError, match="alpha must be at most beta"):
        workbench.Runtime(embedded, device="cpu").run("x", record=False, compression="affinity",
                                                      alpha=0.6, beta=0.5)
    assert workbench.Knobs().set_from_strings(["compression=saliency", "beta=0.7"]).beta == 0.7


# -- (g) pricing of pruned layers; lookahead restricted to kept tokens -------------------------
def test_pruned_prefill_prices_only_the_tokens_reaching_each_layer(embedded, demo_inputs,
                                                                   tmp_path, monkeypatch):
    """Dense work behind the pinned prefix is priced over text + kept visual tokens: the pruned
    prefill is cheaper than the unpruned one (same knobs otherwise) and replay prices it the
    same; a trace without ``kept`` prices every layer over all of the step's tokens."""
    import dataclasses

    import workbench
    from workbench import open_run
    from workbench.replay.engine import replay
    from workbench.sim import profiles
    from workbench.sim.costs import layer_tokens
    from workbench.traces import from_store

    # a compute-starved device, so that the tiny model's dense work is compute-bound (it is
    # weight-read-bound on the real profiles at ~80 tokens) and grows with the token count
    slow = dataclasses.replace(profiles.PROFILES["a100-40gb"],
                               device_flops=profiles.PROFILES["a100-40gb"].device_flops / 1e4)
    monkeypatch.setitem(profiles.PROFILES, "a100-40gb", slow)
    image, prompt, _ = demo_inputs[3]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=2, ignore_eos=True)
    L = embedded.layout.num_layers
    kw = dict(pinned_layers=1, cache_slots=L * embedded.layout.num_experts)  # no evictions
    plain = rt.run(prompt, [image], store=tmp_path / "n.zarr", **kw)
    pruned = rt.run(prompt, [image], store=tmp_path / "p.zarr", compression="random",
                    beta=0.5, seed=3, **kw)
    assert pruned.kept_visual_tokens < pruned.visual_tokens
    assert pruned.prefill_modeled_s < plain.prefill_modeled_s
    ds = open_run(pruned.store)
    kept = ds["kept"].values
    S = int((ds["token_step"].values == 0).sum())
    ids0 = ds["topk_ids"].values[:S]  # prefill tokens [S, layer, k]
    assert layer_tokens(S, kept[:S], ids0[:, 0]) == S  # the pinned layer sees every token
    assert layer_tokens(S, kept[:S], ids0[:, 1]) == int(kept[:S].sum())
    tr = from_store(pruned.store)
    assert not tr.kept.all()
    g = tr.groups()
    pre = g.step == 0
    np.testing.assert_array_equal(g.layer_tokens[pre & (g.layer == 0)], [S])
    assert (g.layer_tokens[pre & (g.layer >= 1)] == int(kept[:S].sum())).all()
    assert (g.layer_tokens[~pre] == 1).all()
    for store in (pruned.store, plain.store):
        r = ds.moe.replay() if store == pruned.store else open_run(store).moe.replay()
        np.testing.assert_allclose(r.step_latency_s, open_run(store)["latency_modeled_s"].values,
                                   rtol=1e-9)
    # without kept (an older store): every layer priced over the whole step, as before
    old = dataclasses.replace(tr, kept=None)
    assert old.kept.all()
    go = old.groups()
    assert (go.layer_tokens == go.step_tokens[go.step]).all()
    # same routing, same cache outcome: only the dense work of the pruned layers differs
    knobs = dict(cache_slots=kw["cache_slots"], pinned_layers=1, eviction="lru")
    a, b = replay(old, **knobs), replay(tr, **knobs)
    np.testing.assert_array_equal(a.misses, b.misses)
    cost = rt.cost_spec()
    dense = [slow.compute_time(n * cost.dense_flops_per_token_per_layer,
                               cost.dense_bytes_per_layer) for n in (S, int(kept[:S].sum()))]
    assert dense[0] > dense[1]
    # the prefill saves exactly the dense work of the L − 1 layers behind the prefix
    np.testing.assert_allclose(a.step_latency_s[0] - b.step_latency_s[0],
                               (dense[0] - dense[1]) * (L - 1), rtol=1e-9)
    np.testing.assert_allclose(a.step_latency_s[1:], b.step_latency_s[1:], rtol=1e-12)


@pytest.mark.parametrize("policy,pinned,depth,prefetch",
                         [("affinity", 2, 1, "speculative"), ("random", 2, 2, "apex"),
                          ("affinity", 2, 2, "speculative")])
def test_lookahead_behind_the_prefix_skips_pruned_tokens(embedded, demo_inputs, tmp_path,
                                                         policy, pinned, depth, prefetch):
    """Router lookahead of pinned layers predicts nothing for pruned tokens on layers behind
    the prefix (once the selection is known: the last pinned layer; every pinned layer for a
    policy that needs no prefix routing), and replay of the run still reproduces it."""
    import workbench
    from workbench import open_run

    image, prompt, _ = demo_inputs[4]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=STEPS, ignore_eos=True)
    res = rt.run(prompt, [image], store=tmp_path / "p.zarr", compression=policy, beta=0.5,
                 pinned_layers=pinned, cache_slots=16, lookahead_depth=depth,
                 prefetch=prefetch)
    ds = open_run(res.store)
    kept = ds["kept"].values
    pred = ds["pred_ids"].values  # [token, layer, depth, k]
    pruned, S = ~kept, int((ds["token_step"].values == 0).sum())
    assert pruned.sum() > 0
    L = embedded.layout.num_layers
    first = 0 if policy == "random" else pinned - 1  # first layer that knows the selection
    for l in range(first, pinned):
        for d in range(1, min(depth, L - 1 - l) + 1):
            if l + d >= pinned:
                assert (pred[pruned, l, d - 1] == -1).all()
                assert (pred[:S][kept[:S], l, d - 1] >= 0).all()  # kept tokens still predicted
            else:
                assert (pred[pruned, l, d - 1] >= 0).all()  # inside the prefix: all tokens
    if policy == "affinity" and depth > 1:  # layer 0 cannot know affinity's selection yet
        assert (pred[pruned, 0, 1] >= 0).all()
    r = ds.moe.replay()
    np.testing.assert_array_equal(r.hits, ds["hits"].values)
    np.testing.assert_array_equal(r.misses, ds["misses"].values)
    np.testing.assert_array_equal(r.prefetch_loads, ds["prefetches"].values)
    np.testing.assert_allclose(r.step_latency_s, ds["latency_modeled_s"].values, rtol=1e-9)
