"""Expert parallelism, part 1 (issue 14): EP placements, per-rank load and its metrics, the
modeled EP layer clock, and EP replay of any trace (`workbench replay --set ep_ranks=R`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import distinct_ids
from workbench.errors import KnobError
from workbench.knobs import Knobs
from workbench.replay import replay_trace
from workbench.sim.ep import EPSummary, group_metrics, layer_times, rank_load
from workbench.sim.placement import EP_PLACEMENT, rank_of_expert
from workbench.sim.profiles import INTERCONNECTS, get_interconnect
from workbench.traces import Trace

SHARED = Path(__file__).resolve().parents[2] / "shared"
MIXTRAL = SHARED / "data" / "traces" / "mixtral-8x7b-vllm" / "humaneval_2_routing.jsonl"
needs_mixtral = pytest.mark.skipif(not MIXTRAL.exists(),
                                   reason=f"the real Mixtral trace is not at {MIXTRAL} "
                                          "(../shared absent)")


def _trace(T=300, L=3, E=16, k=2, seed=0, modality=None) -> Trace:
    rng = np.random.default_rng(seed)
    ids = distinct_ids(rng, (T, L, k), E)
    steps = np.cumsum(rng.random(T) < 0.4)
    return Trace(topk_ids=ids, token_step=steps - steps[0], num_experts=E,
                 token_modality=modality)


def test_placements_own_every_expert_once_and_every_rank_gets_one():
    assert set(EP_PLACEMENT.available()) >= {"contiguous", "round-robin"}
    np.testing.assert_array_equal(rank_of_expert("contiguous", 8, 4), [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(rank_of_expert("round-robin", 8, 3), [0, 1, 2, 0, 1, 2, 0, 1])
    for name in EP_PLACEMENT.available():
        for E, R in ((8, 1), (8, 8), (128, 7), (60, 16)):
            owner = rank_of_expert(name, E, R)
            assert owner.shape == (E,) and set(owner.tolist()) == set(range(R))
    with pytest.raises(KnobError, match="ep_ranks must be between 1 and the model's 8"):
        rank_of_expert("contiguous", 8, 9)
    with pytest.raises(KnobError, match="placement must be one of"):
        rank_of_expert("nope", 8, 2)


def test_ep_ranks_above_the_experts_is_refused_naming_both(tmp_path, capsys):
    from workbench.cli import main

    p = tmp_path / "t.npy"
    np.save(p, _trace(E=16).topk_ids)
    assert main(["replay", str(p), "--set", "ep_ranks=17"]) == 2
    err = capsys.readouterr().err
    assert "ep_ranks must be at most the model's 16 experts per layer" in err and "17" in err
    with pytest.raises(KnobError):
        Knobs(ep_ranks=0)


def test_rank_load_equals_a_direct_count():
    tr = _trace()
    g = tr.groups()
    for name in EP_PLACEMENT.available():
        owner = rank_of_expert(name, tr.num_experts, 4)
        load = rank_load(g.ptr, g.expert, g.expert_tokens, owner, 4)
        want = np.zeros((g.num_groups, 4), np.int64)
        for i, (s, layer) in enumerate(zip(g.step, g.layer)):
            for e in tr.topk_ids[tr.token_step == s, layer].reshape(-1):
                if e >= 0:
                    want[i, owner[e]] += 1
        np.testing.assert_array_equal(load, want)
        # every routed (token, expert) lands on exactly one rank
        assert load.sum() == int((tr.topk_ids >= 0).sum())


def test_group_metrics_are_the_literature_ratios():
    m = group_metrics(np.array([[4, 0], [2, 2], [0, 0], [3, 1]]))
    np.testing.assert_array_equal(m["used"], [True, True, False, True])
    np.testing.assert_allclose(m["imbalance"], [2.0, 1.0, 1.5])       # max / mean
    np.testing.assert_allclose(m["balancedness"], [0.5, 1.0, 2 / 3])  # mean / max
    np.testing.assert_allclose(m["imbalance_ratio"], [1.0, 0.0, 0.5])  # (max - mean) / mean
    s = EPSummary(2, "contiguous")
    s.add(np.array([[4, 0], [2, 2]]))
    s.add(np.array([[0, 0], [3, 1]]))
    r = s.result()
    assert r["groups"] == 3 and r["max_rank_load"] == 4 and r["worst_imbalance"] == 2.0
    assert r["imbalance"] == pytest.approx(1.5) and r["rank_share"] == [0.75, 0.25]
    assert r["aggregate_imbalance"] == pytest.approx(9 / 6)


def test_modeled_ep_layer_is_dispatch_slowest_rank_combine():
    link = get_interconnect("nvlink-h100")
    load = np.array([[6, 2], [4, 4]])
    comp = np.array([[3e-3, 1e-3], [2e-3, 2e-3]])
    t = layer_times(load, comp, 4096.0, link)
    remote = np.array([6, 4]) * 4096.0 * (1 / 2)  # the busiest receiver; half is local
    assert t["dispatch_s"] == pytest.approx(2 * link.latency_s + remote.sum() / link.bandwidth)
    assert t["combine_s"] == t["dispatch_s"]
    assert t["compute_s"] == pytest.approx(5e-3) and t["compute_balanced_s"] == pytest.approx(4e-3)
    assert t["moe_layer_s"] == pytest.approx(2 * t["dispatch_s"] + 5e-3)
    assert layer_times(load, None, 4096.0, None) == {}
    # the interconnects are ordered sensibly: NVLink is faster than PCIe
    assert INTERCONNECTS["nvlink-h100"].bandwidth > INTERCONNECTS["pcie5"].bandwidth \
        > INTERCONNECTS["pcie4"].bandwidth


def test_ep_replay_streamed_equals_one_chunk_and_splits_by_modality(monkeypatch):
    from workbench.replay import ep as ep_mod

    rng = np.random.default_rng(3)
    tr = _trace(T=400, modality=(rng.random(400) < 0.5).astype(np.int8))
    kw = dict(ep_ranks=4, target_model="qwen3-vl-30b-a3b", belady=False)
    whole = replay_trace(tr, **kw).extra["ep"]
    monkeypatch.setattr(ep_mod, "CHUNK_ACCESSES", 5)
    part = replay_trace(tr, **kw).extra["ep"]
    for key in ("groups", "max_rank_load", "rank_share", "aggregate_imbalance"):
        assert part[key] == whole[key], key
    for key in ("imbalance", "balancedness", "imbalance_ratio", "dispatch_s_modeled",
                "compute_s_modeled", "moe_layer_s_modeled"):
        assert part[key] == pytest.approx(whole[key], rel=1e-12), key
    assert set(whole["by_modality"]) == {"text", "image"}
    # each modality's groups are a subset's: more skewed, never more groups
    for sub in whole["by_modality"].values():
        assert sub["groups"] <= whole["groups"] and sub["imbalance"] >= 1.0
    assert replay_trace(tr, belady=False).extra.get("ep") is None  # ep_ranks=1: no EP section


@needs_mixtral
def test_ep_replay_of_the_real_mixtral_trace(capsys):
    """The CLI's JSON carries an ``ep`` section for any trace; the real routing is imbalanced
    per (step, layer) and balanced over the whole trace."""
    from workbench.cli import main

    assert main(["replay", str(MIXTRAL), "--set", "ep_ranks=4", "--set",
                 "target_model=qwen3-vl-30b-a3b", "--json"]) == 0
    ep = json.loads(capsys.readouterr().out)["ep"]
    assert ep["ranks"] == 4 and ep["placement"] == "contiguous"
    assert ep["imbalance"] > 1.0 and 0 < ep["balancedness"] < 1.0
    assert ep["imbalance_ratio"] == pytest.approx(ep["imbalance"] - 1.0)
    assert sum(ep["rank_share"]) == pytest.approx(1.0)
    assert 1.0 <= ep["aggregate_imbalance"] < ep["imbalance"]
    assert ep["moe_layer_s_modeled"] > ep["compute_s_modeled"] >= ep["compute_balanced_s_modeled"]
    assert main(["replay", str(MIXTRAL), "--set", "ep_ranks=8"]) == 0
    out = capsys.readouterr().out
    assert "EP: 8 ranks, contiguous" in out and "imbalance (max/mean)" in out


def test_a_live_run_reports_its_ep_load_from_its_store(embedded_dir, tmp_path, capsys):
    """Ranks are virtual: ``workbench run --set ep_ranks=R`` computes what it computes with 1,
    and reports the per-rank load of what it routed, image tokens apart (issue 14)."""
    from workbench.cli import main

    img = embedded_dir.parent / "demo" / "scene_0.png"
    args = ["run", "--prompt", "what color is the triangle?", "--image", str(img),
            "--max-new-tokens", "3", "--json"]
    assert main([*args, "--store", str(tmp_path / "a.zarr")]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "ep" not in plain
    assert main([*args, "--store", str(tmp_path / "b.zarr"), "--set", "ep_ranks=4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain["token_ids"]  # virtual ranks change nothing computed
    ep = out["ep"]
    assert ep["ranks"] == 4 and ep["imbalance"] >= 1.0 and set(ep["by_modality"]) == {
        "text", "image"}
    import workbench

    ds = workbench.open_run(tmp_path / "b.zarr")
    assert ds.moe.ep_summary() == {**ep, "interconnect": ep["interconnect"]}
    load = ds.moe.ep_load()
    assert load.sizes["rank"] == 4 and int(load.sum()) == int((ds.topk_ids.values >= 0).sum())


@pytest.mark.parametrize("kind", ["compression", "prism"])
def test_the_ep_summary_of_the_ep_arrays_equals_the_whole_stores(embedded, demo_inputs,
                                                                 tmp_path, kind):
    """``EP_ARRAYS`` (what ``workbench run --set ep_ranks=R`` opens for its summary) hold all
    the summary reads: on a run with an image and token compression (``kept``, modalities)
    and on one with sub-experts (MoE-Prism, k_active 2), the summary of those arrays alone
    equals the whole store's, each rank's and modality's figures included."""
    import workbench
    from workbench.prism import refactor as R
    from workbench.replay.ep import EP_ARRAYS

    img, prompt, _ = next(d for d in demo_inputs if d[0] is not None)
    rt = workbench.Runtime(embedded, max_new_tokens=3)
    extra = dict(compression="affinity", beta=0.5)
    if kind == "prism":  # a random partition: what is recorded does not depend on it
        R.save(R.random_refactoring(embedded), tmp_path / "prism")
        extra = dict(prism=True, prism_k_active=2, prism_refactoring=str(tmp_path / "prism"))
    res = rt.run(prompt, images=[img], store=tmp_path / "r.zarr", ep_ranks=4, **extra)
    whole = workbench.open_run(res.store)
    if kind == "compression":
        assert not whole.kept.values.all()  # some tokens were left out (compression)
    else:
        assert whole.sizes["subexpert"] == 4
    part = workbench.open_run(res.store, variables=EP_ARRAYS)
    assert set(part.data_vars) == set(EP_ARRAYS)
    summary = part.moe.ep_summary()
    assert set(summary["by_modality"]) == {"text", "image"}
    assert summary == whole.moe.ep_summary()


def test_load_volatility_on_hand_built_loads():
    from workbench.sim.ep import load_volatility

    steady = np.tile(np.array([[5.0, 1, 1, 1]]), (6, 2, 1))
    v = load_volatility(steady, window=2)
    assert v["hot_change"] == 0.0 and v["history_hot_hit"] == 1.0
    assert np.isnan(v["history_corr"]) or v["history_corr"] == pytest.approx(1.0)
    steady[:, :, 1] += np.arange(6)[:, None] * 0.1  # not constant: correlation defined
    assert load_volatility(steady, 2)["history_corr"] > 0.99
    flip = np.zeros((4, 1, 2))
    flip[0::2, 0, 0] = 3
    flip[1::2, 0, 1] = 3
    f = load_volatility(flip, window=1)
    assert f["hot_change"] == 1.0 and f["history_hot_hit"] == 0.0
    assert f["history_corr"] == pytest.approx(-1.0) and f["pairs"] == 3
    gap = flip.copy()
    gap[1] = 0  # a step with no load is skipped, not a change
    assert load_volatility(gap, 1)["pairs"] == 1


@pytest.mark.parametrize("kind", ["batch", "compression", "prism", "eplb"])
def test_the_summary_summed_while_the_store_is_written_equals_the_stores(
        embedded, demo_inputs, tmp_path, monkeypatch, kind):
    """A run with ``ep_ranks`` > 1 sums its EP summary as its store is written
    (``RunResult.ep``, :class:`EPStream` on the recorder's columns), and it is the store's
    ``ds.moe.ep_summary()`` bit for bit — every figure, rank share and modality — also where
    the recorder writes the steps in many batches and the summary's chunks end inside a
    batch (a small ``CHUNK_ACCESSES``): on a mixed batch with images under MACS, with token
    compression (``kept``), with sub-experts, and on a round-robin placement. EPLB's
    placement (its plans are the whole run's) is summed from the store: ``ep`` is None and
    the CLI's summary reads the store."""
    import workbench
    from types import SimpleNamespace

    from workbench.cli import _run_ep
    from workbench.prism import refactor as R
    from workbench.replay import ep as ep_mod

    monkeypatch.setattr(ep_mod, "CHUNK_ACCESSES", 4 * 700)  # chunks of ≈ 700 slots / rank
    rt = workbench.Runtime(embedded, max_new_tokens=6)
    img, prompt, _ = next(d for d in demo_inputs if d[0] is not None)
    extra: dict = dict(ep_ranks=4, ignore_eos=True)
    if kind == "batch":
        extra.update(dispatch="macs", capacity_factor=1.0, placement="round-robin")
        run = dict(requests=workbench.mixed_batch(4, text_share=0.5, seed=2))
    else:
        run = dict(requests=prompt, images=[img])
    if kind == "compression":
        extra.update(compression="affinity", beta=0.5)
    elif kind == "prism":
        R.save(R.random_refactoring(embedded), tmp_path / "prism")
        extra.update(prism=True, prism_k_active=2, prism_refactoring=str(tmp_path / "prism"))
    elif kind == "eplb":
        extra.update(placement="eplb", num_redundant_experts=4, eplb_window=2,
                     eplb_interval=2)
    with workbench.set_options(flush_every=2):
        res = rt.run(run.pop("requests"), store=tmp_path / "r.zarr", **run, **extra)
    ds = workbench.open_run(res.store)
    want = ds.moe.ep_summary()
    steps = ds.sizes["step"]
    assert steps == 6 and set(want["by_modality"]) == {"text", "image"}
    if kind == "eplb":
        assert res.ep is None and want["eplb"]["rebalances"] > 0
        assert _run_ep(res, SimpleNamespace(ep_ranks=4)) == want  # from the store
        return
    assert res.ep == want
    assert _run_ep(res, SimpleNamespace(ep_ranks=4)) is res.ep
    # the chunks ended inside the recorder's batches: more than one, not at batch ends
    cuts = workbench.traces.from_store(ds).step_chunks(ep_mod.CHUNK_ACCESSES // 4)
    assert len(cuts) > 1 and any(s1 % 2 for _, s1 in cuts[:-1]), cuts
    assert "ep" not in res.to_json()  # the stored summary holds what it held


def test_the_stream_cuts_the_chunks_step_chunks_cuts_whatever_the_batches():
    """:class:`EPStream` fed a trace's columns in batches of any size sums the chunks
    ``Trace.step_chunks`` cuts (the same step ranges) and gives ``ep_replay``'s figures bit
    for bit, per modality too; steps with many routed slots pass several multiples at once,
    and a batch that does not start where the last ended is an error kept, not raised."""
    from types import SimpleNamespace

    from workbench.knobs import Knobs, ModelShape
    from workbench.replay import ep as ep_mod

    rng = np.random.default_rng(11)
    for trial in range(30):
        T = int(rng.integers(1, 300))
        tr = _trace(T=T, seed=trial,
                    modality=(rng.random(T) < 0.4).astype(np.int8) if trial % 3 else None)
        tr.kept = rng.random(T) < 0.8 if trial % 4 == 0 else tr.kept
        a = int(rng.choice([1, 7, 40, 200, 1 << 20]))
        k = Knobs(ep_ranks=4, placement=("contiguous", "round-robin")[trial % 2],
                  target_model="qwen3-vl-30b-a3b")
        prices = ep_mod.summary_prices(k, SimpleNamespace(attrs={}), ModelShape.of(tr))
        rep = ep_mod.EPReplay(k, tr.num_layers, tr.num_experts, prices)
        rep.chunk_accesses = a
        want_rep = ep_mod.EPReplay(k, tr.num_layers, tr.num_experts, prices)
        want_rep.chunk_accesses = a
        chunks = tr.step_chunks(a)
        whole = want_rep.summary()
        for s0, s1 in chunks:
            want_rep.add(whole, tr.step_slice(s0, s1), s0)
        codes = np.unique(tr.token_modality)
        by = {}
        for c in codes:
            by[int(c)] = want_rep.summary()
            for s0, s1 in chunks:
                want_rep.add(by[int(c)], tr.step_slice(s0, s1), s0, int(c))
        want = want_rep.result(whole, by if len(codes) > 1 else None)
        stream = ep_mod.EPStream(rep, tr.pinned)
        S, size = tr.num_steps, int(rng.integers(1, 6))
        for b0 in range(0, S, size):
            sub = tr.step_slice(b0, min(b0 + size, S))
            stream.add_columns({"topk_ids": sub.topk_ids, "token_step": sub.token_step + b0,
                                "token_modality": sub.token_modality, "kept": sub.kept,
                                "phase": sub.phase})
        assert stream.result() == want, trial
        assert stream.chunks == chunks, (trial, a, size)
    stream = ep_mod.EPStream(rep, tr.pinned)
    stream.add_columns({"topk_ids": tr.topk_ids[:0], "token_step": tr.token_step[:0],
                        "token_modality": tr.token_modality[:0], "kept": tr.kept[:0],
                        "phase": np.zeros(2, np.int8)})
    late = tr.step_slice(3, 4)
    stream.add_columns({"topk_ids": late.topk_ids, "token_step": late.token_step + 5,
                        "token_modality": late.token_modality, "kept": late.kept,
                        "phase": late.phase})
    assert stream.error is not None and stream.result() is None
