"""Capacity-aware dispatch (issue 14, §3): the `dispatch` registry, CAI-MoE Token Drop on
traces, its invariants as property tests, and its effect in replay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import distinct_ids
from workbench.errors import KnobError
from workbench.knobs import Knobs
from workbench.replay import replay_trace
from workbench.sim.dispatch import DISPATCH, CapacityDrop, check_capacity, dispatch_trace
from workbench.traces import Trace


def _trace(T=200, L=3, E=8, K=2, seed=0, weights=True, p_step=0.3) -> Trace:
    rng = np.random.default_rng(seed)
    ids = distinct_ids(rng, (T, L, K), E, none_share=0.1)
    w = np.where(ids >= 0, rng.random(ids.shape), np.nan).astype(np.float32) if weights else None
    steps = np.cumsum(rng.random(T) < p_step)
    mod = (rng.random(T) < 0.5).astype(np.int8)
    return Trace(topk_ids=ids, token_step=steps - steps[0], num_experts=E, topk_weights=w,
                 token_modality=mod)


def _capacity(tr: Trace, pol: CapacityDrop) -> np.ndarray:
    """The rule's capacity per (step, layer), by plain loops: T = tokens routed there, k =
    the most slots any of them fills."""
    S, L = tr.num_steps, tr.num_layers
    n = np.zeros((S, L), np.int64)
    k = np.zeros((S, L), np.int64)
    for t in range(tr.num_tokens):
        for layer in range(L):
            slots = int((tr.topk_ids[t, layer] >= 0).sum())
            n[tr.token_step[t], layer] += slots > 0
            k[tr.token_step[t], layer] = max(k[tr.token_step[t], layer], slots)
    return pol.capacity(n, k, tr.num_experts)


def test_registry_and_knobs():
    assert DISPATCH.available()[:2] == ["topk", "capacity-drop"]
    k = Knobs(dispatch="capacity-drop", capacity_factor=0.5)
    assert k.dispatch == "capacity-drop" and k.capacity_factor == 0.5
    for bad in (dict(capacity_factor=0), dict(capacity_factor=-1), dict(min_capacity=-1),
                dict(dispatch="nope")):
        with pytest.raises(KnobError):
            Knobs(**bad)


def test_capacity_counts_the_k_the_router_used_not_the_traces_width():
    """A trace padded to a wider k (dynamic top-k records k_max) sizes capacity by the slots
    the router filled (review: padding to 4 slots had doubled C for a top-2 prefill)."""
    ids = np.zeros((16, 1, 2), np.int16)
    ids[:, 0, 1] = 1  # 16 tokens, all on experts 0 and 1, top-2
    w = np.full(ids.shape, 0.5, np.float32)
    padded = np.concatenate([ids, np.full((16, 1, 2), -1, np.int16)], axis=2)
    pw = np.concatenate([w, np.full((16, 1, 2), np.nan, np.float32)], axis=2)
    pol = CapacityDrop(0.5)
    a = pol.apply(ids, w, np.zeros(16), 8)
    b = pol.apply(padded, pw, np.zeros(16), 8)
    assert int((a >= 0).sum()) == int((b >= 0).sum()) == 2 * 2  # C = ⌈0.5·16·2/8⌉ = 2
    huge = CapacityDrop(1.0, min_capacity=10**19)  # no int64 wrap-around: nothing dropped
    np.testing.assert_array_equal(huge.apply(ids, w, np.zeros(16), 8), ids)


def test_token_drop_keeps_the_highest_scores_by_hand():
    """One step, one layer, 4 experts, top-1, 4 tokens all on expert 2 with scores
    .1 .9 .5 .7; γ0 = 1: C = ⌈1·4·1/4⌉ = 1, so only token 1 (score .9) stays."""
    ids = np.array([[[2]], [[2]], [[2]], [[2]]], np.int16)
    w = np.array([[[.1]], [[.9]], [[.5]], [[.7]]], np.float32)
    out = CapacityDrop(1.0).apply(ids, w, np.zeros(4, np.int64), 4)
    np.testing.assert_array_equal(out[:, 0, 0], [-1, 2, -1, -1])
    out = CapacityDrop(2.0).apply(ids, w, np.zeros(4, np.int64), 4)  # C = 2: .9 and .7
    np.testing.assert_array_equal(out[:, 0, 0], [-1, 2, -1, 2])
    # without weights: the top-k rank, then the token, decides
    ids2 = np.array([[[2, 1]], [[1, 2]], [[2, 0]]], np.int16)
    nan = np.full(ids2.shape, np.nan, np.float32)
    out = CapacityDrop(1.0, min_capacity=1).apply(ids2, nan, np.zeros(3, np.int64), 3)
    # C = ⌈3·2/3⌉ = 2 per expert; expert 2 has (t0, rank 0), (t1, rank 1), (t2, rank 0):
    # the two rank-0 assignments stay, t1's rank-1 one is dropped
    np.testing.assert_array_equal(out[:, 0], [[2, 1], [1, -1], [2, 0]])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), gamma=st.sampled_from([0.05, 0.25, 0.5, 1.0, 1.8, 5.0]),
       min_cap=st.integers(0, 3), weights=st.booleans(), E=st.integers(2, 12),
       K=st.integers(1, 3))
def test_token_drop_invariants(seed, gamma, min_cap, weights, E, K):
    K = min(K, E)
    tr = _trace(T=60, L=2, E=E, K=K, seed=seed, weights=weights)
    pol = CapacityDrop(gamma, min_cap)
    out, stats = dispatch_trace(tr, pol, chunk_accesses=17)
    r = stats.result(("text", "image", "video"))
    # kept + rerouted + dropped = assigned; a dropped slot was routed; nothing new routed
    assert r["kept"] + r["rerouted"] + r["dropped"] == r["assigned"] == int((tr.topk_ids >= 0).sum())
    assert r["kept"] == int((out.topk_ids >= 0).sum())
    assert np.all((out.topk_ids == tr.topk_ids) | (out.topk_ids == -1))
    # no expert over its capacity in any (step, layer)
    check_capacity(out.topk_ids, out.token_step, E, _capacity(tr, pol))
    # deterministic, chunking aside
    again, _ = dispatch_trace(tr, pol)
    np.testing.assert_array_equal(again.topk_ids, out.topk_ids)
    assert r["max_expert_load_after"] <= r["max_expert_load_before"]
    if "by_modality" in r:
        total = sum(v["assigned"] for v in r["by_modality"].values())
        assert total == r["assigned"]


def test_a_capacity_nobody_reaches_equals_topk():
    tr = _trace(seed=3)
    out, stats = dispatch_trace(tr, CapacityDrop(capacity_factor=100.0))
    np.testing.assert_array_equal(out.topk_ids, tr.topk_ids)
    assert stats.dropped == 0
    a = replay_trace(tr, belady=False, cache_slots=6, pinned_layers=0)
    # a trace without phases is all decode: capacity on every step
    b = replay_trace(tr, belady=False, cache_slots=6, pinned_layers=0, dispatch="capacity-drop",
                     capacity_factor=100.0, capacity_scope="all")
    assert a.metrics()["hits"] == b.metrics()["hits"]
    assert b.extra["dispatch"]["drop_rate"] == 0.0


def test_replay_with_token_drop_reports_drops_and_lowers_the_straggler(tmp_path, capsys):
    """A tight capacity drops assignments; the replay's cache and EP figures are those of the
    dispatched routing (fewer accesses, a smaller busiest rank)."""
    from workbench.cli import main

    # ~20 tokens a step; a trace without phases is all decode: capacity on every step
    tr = _trace(T=600, L=4, E=8, K=2, seed=5, p_step=0.05)
    base = replay_trace(tr, belady=False, ep_ranks=4, cache_slots=8, pinned_layers=0)
    drop = replay_trace(tr, belady=False, ep_ranks=4, cache_slots=8, pinned_layers=0,
                        dispatch="capacity-drop", capacity_factor=0.5, capacity_scope="all")
    d = drop.extra["dispatch"]
    assert 0 < d["drop_rate"] < 1 and d["max_expert_load_after"] < d["max_expert_load_before"]
    assert set(d["by_modality"]) == {"text", "image"}
    assert drop.metrics()["accesses"] <= base.metrics()["accesses"]
    assert drop.extra["ep"]["mean_max_rank_load"] < base.extra["ep"]["mean_max_rank_load"]
    p = tmp_path / "t.npy"
    np.save(p, tr.topk_ids)
    assert main(["replay", str(p), "--set", "dispatch=capacity-drop", "--set",
                 "capacity_factor=0.5", "--set", "capacity_scope=all", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dispatch"]["policy"] == "capacity-drop" and out["dispatch"]["dropped"] >= 0


# -- live: inside the real experts forward -----------------------------------------------------
import math  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from workbench.models.adapter import find_moe_blocks  # noqa: E402
from workbench.models.tiny import (TINY_ARCHITECTURES, greedy_outputs, tiny_inputs,  # noqa: E402
                                   tiny_model)
from workbench.policies.eviction import EVICTION  # noqa: E402
from workbench.runtime.executor import StepProbe  # noqa: E402
from workbench.runtime.offload import Offloader  # noqa: E402


def _offloader(layout, slots, pinned, dispatch, probe=None):
    return Offloader(layout, slots, pinned, EVICTION.create("lru"), "cpu",
                     probe or StepProbe(time.perf_counter()), dispatch=dispatch)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_live_token_drop_with_room_for_everyone_equals_topk_exactly(arch):
    """A capacity no expert reaches changes nothing on every supported architecture,
    offloaded and pinned layers alike: the same routing at every layer call, the same tokens,
    the same logits (to the offloader's own run-to-run tolerance: misses are added as their
    copies land, in whichever order that is)."""
    model = tiny_model(arch)
    inputs = tiny_inputs(model, arch)
    layout = find_moe_blocks(model)
    for slots, pinned in ((3, 1), (64, 0), (2, layout.num_layers)):
        ref_probe, probe = StepProbe(time.perf_counter()), StepProbe(time.perf_counter())
        with _offloader(layout, slots, pinned, DISPATCH.create("topk"), ref_probe):
            ref_logits, ref_tokens = greedy_outputs(model, inputs)
        off = _offloader(layout, slots, pinned, CapacityDrop(capacity_factor=1000.0), probe)
        with off:
            logits, tokens = greedy_outputs(model, inputs)
        assert torch.equal(tokens, ref_tokens), (arch, slots, pinned)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
        assert len(probe.layers) == len(ref_probe.layers)
        for a, b in zip(probe.layers, ref_probe.layers):
            np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
            assert a.expert_tokens == b.expert_tokens
        assert off.dispatch_assigned > 0 and off.dispatch_dropped == 0


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_live_token_drop_obeys_capacity_and_is_the_cores_rule(arch):
    """γ0 = 0.25 drops assignments live: every layer call's recorded routing (-1 = dropped)
    keeps each expert within ⌈γ0·T·k/E⌉; layer 0 of the forward (whose input no drop touched)
    is exactly the core's dispatch of the router's choice; outputs change."""
    model = tiny_model(arch)
    inputs = tiny_inputs(model, arch)
    layout = find_moe_blocks(model)
    E, k = layout.num_experts, layout.top_k
    ref_probe = StepProbe(time.perf_counter())
    with _offloader(layout, 64, 1, None, ref_probe):
        with torch.no_grad():
            ref = model(**inputs).logits
    pol = CapacityDrop(capacity_factor=0.25)
    for pinned in (1, 0):
        probe = StepProbe(time.perf_counter())
        off = _offloader(layout, 64, pinned, pol, probe)
        with off:
            with torch.no_grad():
                got = model(**inputs).logits
        assert off.dispatch_dropped > 0
        assert not torch.equal(got, ref)  # a dropped token skips an expert: another output
        for ev in probe.layers:
            T = ev.topk_ids.shape[0]
            routed = int((ev.topk_ids >= 0).any(axis=1).sum())
            cap = max(1, math.ceil(0.25 * routed * k / E))
            counts = np.bincount(ev.topk_ids[ev.topk_ids >= 0].ravel(), minlength=E)
            assert counts.max() <= cap, (arch, ev.layer, counts, cap, T)
            assert set(ev.expert_tokens) == set(np.flatnonzero(counts).tolist())
        first, want = probe.layers[0], ref_probe.layers[0]
        core = pol.apply(want.topk_ids[:, None, :].astype(np.int16),
                         want.topk_weights[:, None, :], np.zeros(len(want.topk_ids)), E)[:, 0]
        np.testing.assert_array_equal(first.topk_ids, core)


def _live_gates(arch, pol, valid=None):
    """One forward of the tiny ``arch`` with ``pol``, every layer offloaded: the router calls
    of each layer (``forward`` counted on the instance, so the model's own call and
    :meth:`MoEBlock.route`'s alike) and, per dispatch context built, ``(block, the call's
    input rows, the rows dispatched, its gates)``. ``valid``: the offloader's token mask
    (None: every row real)."""
    from workbench.models.hooks import Hooks
    from workbench.runtime.stages.dispatch import DispatchStage

    model = tiny_model(arch)
    inputs = tiny_inputs(model, arch)
    layout = find_moe_blocks(model)
    calls = dict.fromkeys(range(layout.num_layers), 0)
    seen = []

    def counting(b):
        forward = b.router.forward

        def counted(*a, **kw):
            calls[b.index] += 1
            return forward(*a, **kw)
        return counted

    off = _offloader(layout, 64, 0, pol)
    stage = next(s for s in off.stages if isinstance(s, DispatchStage))
    context = stage._context

    def spy(call, b, hidden_states, real, logits):
        ctx = context(call, b, hidden_states, real, logits)
        rows = (np.arange(len(hidden_states)) if call.mask is None
                else call.mask.nonzero().squeeze(1).numpy())
        seen.append((b, call.hidden_states.clone(), rows, ctx.gates))
        return ctx

    stage._context = spy
    with Hooks() as hooks, torch.no_grad():
        for b in layout.blocks:
            hooks.override(b.router, "forward", counting(b))
        with off:
            if valid is not None:
                off.set_token_mask(valid(inputs["input_ids"].numel()))
            model(**inputs)
    return layout, calls, seen


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_live_dispatch_gates_are_the_routers_own_logits(arch):
    """Issue 41 §3: MACS rerouting and Expanded Drop read every expert's probability from the
    logits the model's router computed for the layer call — each router runs once per layer
    call, with masked rows too (stop 57: the real rows of the call's logits, no second run on
    them) — and the gates are bit for bit the softmax of a router run over the call's rows,
    at the rows dispatched."""
    from workbench.sim.dispatch import CapacityExpanded, Macs

    for pol in (CapacityExpanded(capacity_factor=0.5, ep_ranks=2),
                Macs(capacity_factor=0.25, macs_semantic_load=False,
                     macs_dynamic_capacity=False, macs_eta=0.0, ep_ranks=2)):
        for valid in (None, lambda n: np.arange(n) % 3 != 0):
            layout, calls, seen = _live_gates(arch, pol, valid)
            assert seen, (arch, pol.name)  # a context was built (Expanded Drop: every call)
            if pol.name == "capacity-expanded":
                assert len(seen) == layout.num_layers
            assert calls == dict.fromkeys(calls, 1), (arch, pol.name)
            for b, hs, rows, gates in seen:
                if valid is not None:
                    assert len(rows) < len(hs)  # masked rows were left out
                with torch.no_grad():
                    want = torch.softmax(b.route(hs)[0].float(), dim=-1).numpy()[rows]
                assert gates.dtype == np.float32 and gates.shape == (len(rows), 1,
                                                                     b.num_experts)
                assert np.array_equal(gates[:, 0, :], want), (arch, pol.name, b.index)


@pytest.mark.parametrize("scope", ["prefill", "all"])
def test_routers_keep_their_logits_only_in_the_steps_a_dispatch_reads_them(embedded, scope):
    """The routers' forward hooks (which keep the logits MACS reroutes by) are on in a step
    only where the dispatch acts (``capacity_scope``): a module hook costs every router call
    PyTorch's slow call path, read or not. A decode step outside the scope calls its routers
    without one; the prefill's layer calls still get the model's own logits."""
    from workbench.runtime.offload import Offloader

    rt = workbench.Runtime(embedded)
    lay = embedded.layout
    seen: dict[int, list[tuple[bool, bool]]] = {}  # step → (router hooked, logits handed)
    layer = Offloader._layer

    def spy(self, b, original, view, hidden_states, top_k_index, top_k_weights, args, kw):
        seen.setdefault(self.probe.step, []).append(
            (bool(b.router._forward_hooks), self._router_out.get(b.index) is not None))
        return layer(self, b, original, view, hidden_states, top_k_index, top_k_weights,
                     args, kw)

    Offloader._layer = spy
    try:
        res = rt.run("what is in the picture?", max_new_tokens=4, ignore_eos=True,
                     record=False, dispatch="macs", capacity_factor=1.0, ep_ranks=2,
                     capacity_scope=scope, cache_slots=lay.num_layers * lay.num_experts)
    finally:
        Offloader._layer = layer
    assert sorted(seen) == list(range(4)) and res.dispatch_assigned > 0
    assert seen[0] == [(True, True)] * lay.num_layers  # the prefill: hooked, logits kept
    for step in (1, 2, 3):
        assert seen[step] == [(scope == "all",) * 2] * lay.num_layers, (scope, step)
    assert not any(b.router._forward_hooks for b in lay.blocks)  # all removed after the run

def test_a_live_run_with_token_drop_records_the_dispatched_routing(embedded, demo_inputs,
                                                                   tmp_path):
    """`workbench.Runtime.run(..., dispatch="capacity-drop")` on the embedded model with an
    image: the summary counts the drops, the store holds the routing as dispatched."""
    img, prompt, _ = next(d for d in demo_inputs if d[0] is not None)
    rt = workbench.Runtime(embedded, max_new_tokens=3)
    res = rt.run(prompt, images=[img], store=tmp_path / "d.zarr", dispatch="capacity-drop",
                 capacity_factor=0.5)
    assert 0 < res.dispatch_dropped < res.dispatch_assigned
    assert "dispatch capacity-drop" in res.summary()
    ds = workbench.open_run(res.store)
    ids = ds.topk_ids.values
    steps = ds.token_step.values
    pre = ids[steps == 0]  # the prefill: every token enters every layer (no compression)
    E = ds.sizes["expert"]
    cap = CapacityDrop(0.5).capacity(np.full((1, pre.shape[1]), len(pre)), ids.shape[2], E)
    check_capacity(pre, np.zeros(len(pre)), E, cap)
    assert int((pre < 0).sum()) > 0  # recorded as dropped (-1)


import workbench  # noqa: E402


def test_a_sweep_over_dispatch_and_capacity_factor(tiny_ckpt, tmp_path, capsys, dask_scheduler):
    """Issue 14 §5: a sweep over capacity_factor × dispatch works like any other knob grid."""
    from workbench.analysis.sweep import open_summary
    from workbench.cli import main

    out = tmp_path / "sw"
    assert main(["sweep", "--model", str(tiny_ckpt("qwen3_moe")), "--input", "abcdefghij",
                 "--grid", "dispatch=topk,capacity-drop", "--grid", "capacity_factor=0.25,1",
                 "--set", "max_new_tokens=2", "--out", str(out), "--scheduler", dask_scheduler]) == 0
    capsys.readouterr()
    df = open_summary(out).to_dataframe().reset_index()
    assert set(df["dispatch"]) == {"topk", "capacity-drop"} and len(df) == 4


def test_a_store_recorded_with_a_dispatch_replays_its_routing_as_it_is(tiny_ckpt, tmp_path,
                                                                     capsys):
    """The store holds the routing after the live dispatch: replaying it with the recorded
    dispatch applies nothing twice (review: a second pass recounted T and dropped more);
    another dispatch on it is refused with the reason."""
    from workbench.cli import main

    store = tmp_path / "s.zarr"
    assert main(["run", "--model", str(tiny_ckpt("qwen3_moe")), "--prompt",
                 "abcdefghijklmnopqrstuvwxyz0123456789", "--max-new-tokens", "2", "--store",
                 str(store), "--set", "dispatch=capacity-drop", "--set", "capacity_factor=0.25",
                 "--set", "pinned_layers=0", "--set", "cache_slots=4", "--json"]) == 0
    live = json.loads(capsys.readouterr().out)
    assert live["dispatch_dropped"] > 0
    ds = workbench.open_run(store)
    as_recorded = replay_trace(ds, belady=False)
    plain = replay_trace(ds, belady=False, dispatch="topk")
    assert as_recorded.metrics()["accesses"] == plain.metrics()["accesses"]
    assert as_recorded.extra["dispatch"]["recorded"] is True
    with pytest.raises(KnobError, match="recorded with dispatch=capacity-drop"):
        replay_trace(ds, belady=False, capacity_factor=1.0)
    # the EP figures of the replay and of ds.moe agree (both read the routing as recorded)
    ep = replay_trace(ds, belady=False, ep_ranks=4).extra["ep"]
    assert ep["max_rank_load"] == ds.moe.ep_summary(ranks=4)["max_rank_load"]


def test_the_ep_summary_of_a_run_with_live_only_knobs(tiny_ckpt, tmp_path, capsys):
    """`workbench run --set ep_ranks=2` with knobs only a live run takes (active_evict) still
    prints its EP section (review: the summary checked every group as a replay and exited 2
    after a complete run); without a store it says why there is none."""
    from workbench.cli import main

    args = ["run", "--model", str(tiny_ckpt("qwen3_moe")), "--prompt", "abcdefgh",
            "--max-new-tokens", "2", "--set", "ep_ranks=2", "--set", "active_evict=true",
            "--set", "pinned_layers=0", "--json"]
    assert main([*args, "--store", str(tmp_path / "a.zarr")]) == 0
    assert json.loads(capsys.readouterr().out)["ep"]["ranks"] == 2
    assert main([*args, "--no-record"]) == 0
    assert "--no-record" in json.loads(capsys.readouterr().out)["ep"]["note"]


def test_hostile_ep_and_dispatch_replays_stay_small(tmp_path):
    """A 2 MB .npy of a million one-access steps with expert id 4095 (review): EP replay on
    4096 ranks and Token Drop used to allocate 32–256 GiB (dense groups × ranks, steps × layers
    × experts); both now work in chunks of bounded cells."""
    import resource

    from workbench.traces import load_trace

    T = 1 << 18
    a = np.zeros((T, 1, 1), np.int16)
    a[::7] = 4095
    p = tmp_path / "big.npy"
    np.save(p, a)
    tr = load_trace(p, num_experts=4096)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ep = replay_trace(tr, belady=False, ep_ranks=4096).extra["ep"]
    d = replay_trace(tr, belady=False, dispatch="capacity-drop",
                     capacity_scope="all").extra["dispatch"]
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert ep["groups"] == T and ep["max_rank_load"] == 1
    assert d["dropped"] == 0 and d["max_expert_load_before"] == 1
    assert grown_mb < 600, grown_mb


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), gamma=st.sampled_from([0.1, 0.5, 1.0, 2.0, 8.0]),
       T=st.integers(1, 40), E=st.integers(2, 16), K=st.integers(1, 4))
def test_the_live_shortcut_agrees_with_the_rule(seed, gamma, T, E, K):
    """``fits`` (the live path's one-bincount shortcut) says "nothing drops" exactly when
    ``apply`` drops nothing, for a live layer call (every token routed to k experts)."""
    K = min(K, E)
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int16)[:, None, :]
    w = rng.random(ids.shape).astype(np.float32)
    pol = CapacityDrop(gamma)
    kept = pol.apply(ids, w, np.zeros(T), E)
    top = int(np.bincount(ids.ravel(), minlength=E).max())
    assert pol.fits(top, T, K, E) == bool((kept >= 0).all())
