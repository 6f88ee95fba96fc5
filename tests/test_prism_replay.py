"""MoE-Prism in trace replay (issue 16 §2, §4): a run's sub-experts are stored, replay prices
them as the live modeled clock did, and ``prism_offload`` replays the run with a cache of
sub-experts (slots of 1/N of an expert, only the sub-experts run are fetched)."""

from __future__ import annotations

import numpy as np
import pytest

from workbench.errors import InputError, KnobError

KW = dict(profile="h200", target_model="qwen3-vl-30b-a3b", cache_slots=96, pinned_layers=1)


@pytest.fixture(scope="module")
def prism_store(embedded, tmp_path_factory):
    """A stored run of the embedded model, a batch of 2, k_active 2 of 4 (random partitions):
    ``(store path, RunResult)``."""
    import workbench
    from workbench.prism import refactor as R

    root = tmp_path_factory.mktemp("prism-replay")
    R.save(R.random_refactoring(embedded, seed=5), root / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=6, ignore_eos=True)
    res = rt.run(workbench.mixed_batch(2, text_share=0.5, seed=7), prism=True,
                 prism_refactoring=str(root / "p"), prism_k_active=2, store=root / "run.zarr",
                 **KW)
    return root / "run.zarr", res


def test_replay_of_a_prism_run_equals_the_live_run(prism_store, assert_replays_live):
    import workbench

    ds = workbench.open_run(prism_store[0])
    assert workbench.load_trace(prism_store[0]).subexperts == 4
    for engine in ("fast", "python"):
        assert_replays_live(workbench.replay_trace(ds, engine=engine), ds)


def test_sub_expert_offloading_in_replay(prism_store, monkeypatch):
    """The cache's keys are the sub-experts run: N × the slots of 1/N the bytes; both engines
    and any chunking agree; with every layer resident both granularities price the same
    compute, so the same latency."""
    import workbench
    from workbench.replay import engine as RE

    ds = workbench.open_run(prism_store[0])
    whole = workbench.replay_trace(ds)
    sub = workbench.replay_trace(ds, prism_offload=True)
    assert sub.config["subexpert_slots"] == 4 * 96 and sub.config["subexperts"] == 4
    assert sub.expert_bytes == pytest.approx(whole.expert_bytes / 4)
    assert sub.transfer_time_s < whole.transfer_time_s
    # only the sub-experts run are accessed: 2 of 4 per routed (token, expert) — fewer bytes
    assert sub.loads * sub.expert_bytes < whole.loads * whole.expert_bytes
    py = workbench.replay_trace(ds, prism_offload=True, engine="python")
    np.testing.assert_array_equal(py.hits, sub.hits)
    np.testing.assert_allclose(py.step_latency_s, sub.step_latency_s, rtol=1e-12)
    monkeypatch.setattr(RE, "CHUNK_ACCESSES", 64)  # many chunks, one kernel state
    small = workbench.replay_trace(ds, prism_offload=True)
    np.testing.assert_array_equal(small.hits, sub.hits)
    np.testing.assert_allclose(small.step_latency_s, sub.step_latency_s, rtol=1e-12)
    monkeypatch.undo()
    L = ds.sizes["layer"]
    a = workbench.replay_trace(ds, pinned_layers=L)
    b = workbench.replay_trace(ds, pinned_layers=L, prism_offload=True)
    np.testing.assert_allclose(a.step_latency_s, b.step_latency_s, rtol=1e-9)


def test_sub_expert_offloading_is_refused_where_it_cannot_run(prism_store, embedded):
    import workbench

    rt = workbench.Runtime(embedded, max_new_tokens=2)
    with pytest.raises(KnobError, match="set prism=True too"):
        rt.run("x", record=False, prism_offload=True)
    # router lookahead names whole experts; the refusal lists what works on sub-experts
    with pytest.raises(KnobError, match=r"prefetch='speculative' is not built yet.*"
                                        r"one of none, previous-step"):
        rt.run("x", record=False, prism=True, prism_offload=True, prefetch="speculative")
    with pytest.raises(KnobError, match="active_evict=True is not built yet"):
        rt.run("x", record=False, prism=True, prism_offload=True, active_evict=True)
    with pytest.raises(KnobError, match="dynamic_topk=True is not built yet"):
        rt.run("x", record=False, prism=True, prism_offload=True, dynamic_topk=True)
    # replay: the trace's lookahead names whole experts, the cache's keys are sub-experts
    with pytest.raises(KnobError, match="names whole experts.*caches sub-experts"):
        workbench.replay_trace(workbench.open_run(prism_store[0]), prism_offload=True,
                               prefetch="speculative")
    plain = workbench.load_trace(prism_store[0])
    plain = type(plain)(topk_ids=plain.topk_ids, token_step=plain.token_step,
                        num_experts=plain.num_experts)
    with pytest.raises(KnobError, match="has none"):
        workbench.replay_trace(plain, prism_offload=True)


def test_a_trace_checks_its_sub_experts(prism_store):
    import workbench
    from workbench.traces.trace import Trace

    t = workbench.load_trace(prism_store[0])
    ran = t.subexpert_ran.copy()
    with pytest.raises(InputError, match=r"bool \[token, layer, k, N\]"):
        Trace(topk_ids=t.topk_ids, token_step=t.token_step, num_experts=t.num_experts,
              subexpert_ran=ran[:, :, :1])
    ids = t.topk_ids.copy()
    ids[0, 1, 0] = -1  # a slot routed nowhere cannot have run a sub-expert
    ran[0, 1, 0, 0] = True
    with pytest.raises(InputError, match="routed to no expert"):
        Trace(topk_ids=ids, token_step=t.token_step, num_experts=t.num_experts,
              subexpert_ran=ran)
    with pytest.raises(InputError, match="allowed with"):
        Trace(topk_ids=t.topk_ids, token_step=t.token_step, num_experts=t.num_experts,
              subexpert_ran=np.zeros((*t.topk_ids.shape, 1024), bool))
    sub = t.as_subexperts()
    assert sub.num_experts == 4 * t.num_experts and sub.top_k == 4 * t.top_k
    # each routed slot's sub-experts: ids e·N + s of its expert, as many as it ran
    got = sub.topk_ids.reshape(*t.topk_ids.shape, 4)
    routed = t.topk_ids >= 0
    assert ((got >= 0).sum(-1)[routed] == 2).all() and (got[~routed] == -1).all()
    assert ((got // 4)[got >= 0] == np.broadcast_to(t.topk_ids[..., None], got.shape)[
        got >= 0]).all()


def test_live_sub_expert_offloading(embedded, tmp_path, assert_replays_live):
    """prism_offload live: the cache holds sub-experts (N × the slots), only the sub-experts
    run are copied — every one of them (k_active = N) moves the bytes whole experts do and
    gives the same tokens; half of them moves fewer bytes. Its store replays exactly (both
    engines), and the model's own weights are back after."""
    import torch

    import workbench
    from workbench.prism import refactor as R

    R.save(R.random_refactoring(embedded, seed=9), tmp_path / "p")
    before = {n: p.detach().clone() for n, p in embedded.model.named_parameters()}
    rt = workbench.Runtime(embedded, max_new_tokens=4, ignore_eos=True)
    reqs = workbench.mixed_batch(2, text_share=0.5, seed=8)
    kw = dict(KW, prism=True, prism_refactoring=str(tmp_path / "p"))
    runs = {}
    for k in (4, 2):
        for sub in (False, True):
            runs[k, sub] = rt.run(reqs, prism_k_active=k, prism_offload=sub,
                                  store=tmp_path / f"{k}{sub}.zarr", **kw)
    tokens = {key: [r["token_ids"] for r in res.batch] for key, res in runs.items()}
    assert tokens[4, True] == tokens[4, False] and tokens[2, True] == tokens[2, False]
    assert runs[4, True].transfer_bytes == runs[4, False].transfer_bytes > 0
    assert runs[2, True].transfer_bytes < runs[2, False].transfer_bytes
    # lookups are of sub-experts: N per routed expert when every one runs
    assert runs[4, True].hits + runs[4, True].misses == 4 * (runs[4, False].hits
                                                             + runs[4, False].misses)
    ds = workbench.open_run(tmp_path / "2True.zarr")
    assert ds.sizes["subexpert"] == 4 and ds.moe.compute_share() == pytest.approx(0.5)
    for engine in ("fast", "python"):
        res = workbench.replay_trace(ds, engine=engine)
        assert res.config["prism_offload"] and res.config["subexpert_slots"] == 4 * 96
        assert_replays_live(res, ds)
    for n, p in embedded.model.named_parameters():
        assert torch.equal(p, before[n]), n


def _sub_expert_runs(embedded, tmp_path, seed: int, **feature):
    """Two stored runs of a batch of 2 on a cache of sub-experts (24 expert-sized slots,
    k_active 2/4, a random partition seeded ``seed``): without ``feature`` (plain.zarr) and
    with it (with.zarr); checks they answer alike. ``(plain, with)`` RunResults."""
    import workbench
    from workbench.prism import refactor as R

    R.save(R.random_refactoring(embedded, seed=seed), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=5, ignore_eos=True)
    kw = dict(KW, cache_slots=24, prism=True, prism_refactoring=str(tmp_path / "p"),
              prism_k_active=2, prism_offload=True)
    reqs = workbench.mixed_batch(2, text_share=0.5, seed=seed + 1)
    plain = rt.run(reqs, store=tmp_path / "plain.zarr", **kw)
    res = rt.run(reqs, store=tmp_path / "with.zarr", **kw, **feature)
    assert [r["token_ids"] for r in res.batch] == [r["token_ids"] for r in plain.batch]
    return plain, res


@pytest.mark.parametrize("budget", [None, 3])
def test_live_sub_expert_offloading_with_previous_step_prefetch(embedded, tmp_path, budget,
                                                                 assert_replays_live):
    """prefetch='previous-step' on a cache of sub-experts: the candidates are the sub-experts
    the next layers ran one step before (as replay plans them on the sub-expert trace), and
    the store replays exactly, prefetches included, in both engines."""
    import workbench

    _sub_expert_runs(embedded, tmp_path, 13, prefetch="previous-step", prefetch_lead=2,
                     prefetch_budget=budget)  # demand-first, the default: both engines too
    ds = workbench.open_run(tmp_path / "with.zarr")
    assert int(ds["prefetches"].sum()) > 0
    if budget is not None:  # at most the budget per layer call
        assert int(ds["prefetches"].max()) <= budget
    for engine in ("fast", "python"):
        r = workbench.replay_trace(ds, engine=engine)
        assert r.config["prism_offload"] and r.config["prefetch"] == "previous-step"
        assert_replays_live(r, ds)


def test_live_sub_expert_offloading_in_hybrid_mode(embedded, tmp_path, assert_replays_live):
    """GPU–CPU hybrid on a cache of sub-experts: each missed sub-expert is decided by its own
    tokens at 1/N of an expert's bytes and FLOPs, and one the rule picks runs from its host
    rows (the same sums: the tokens equal the run without hybrid). The store replays exactly,
    and replaying a store recorded without hybrid with hybrid on decides the same misses."""
    import workbench

    plain, res = _sub_expert_runs(embedded, tmp_path, 15, hybrid=True)
    ds = workbench.open_run(tmp_path / "with.zarr")
    assert int(ds.host_runs.sum()) > 0
    assert res.transfer_bytes < plain.transfer_bytes  # a miss run on the host is not copied
    r = workbench.replay_trace(ds)
    assert r.config["prism_offload"] and r.config["hybrid"]
    assert_replays_live(r, ds)
    replayed = workbench.replay_trace(workbench.open_run(tmp_path / "plain.zarr"), hybrid=True)
    np.testing.assert_array_equal(replayed.host_runs, ds.host_runs.values)
    np.testing.assert_array_equal(replayed.hits, ds.hits.values)


def test_the_hybrid_rule_of_a_sub_expert_is_its_own():
    """A sub-expert's host run and copy are 1/N of its expert's bytes and FLOPs: its rule is
    Prices.part(N)'s, which differs from the whole expert's at some token count."""
    from workbench.sim.costs import CostSpec, Prices
    from workbench.sim.profiles import get_profile, get_target_model

    p = Prices(get_profile("h200"), CostSpec.from_target(get_target_model("qwen3-vl-30b-a3b")))
    q = p.part(4)
    assert q.host(8) < p.host(8) and q.transfer < p.transfer  # (a copy has a fixed latency)
    assert any(q.on_host(n) != p.on_host(n) for n in range(1, 4096))


def test_a_store_with_impossible_sub_expert_sizes_is_refused(prism_store, tmp_path):
    """The reader bounds what sub-experts can make it read: chunks must span whole rows (the
    per-chunk bound then holds), and experts × sub-experts must fit a sub-expert id."""
    import json
    import shutil

    import workbench
    from workbench.errors import StoreError

    def edit(folder, name, **changes):
        f = folder / name / "zarr.json"
        meta = json.loads(f.read_text())
        meta.update(changes)
        f.write_text(json.dumps(meta))

    narrow = tmp_path / "narrow.zarr"
    shutil.copytree(prism_store[0], narrow)
    meta = json.loads((narrow / "subexpert_tokens" / "zarr.json").read_text())
    edit(narrow, "subexpert_tokens", chunk_grid={"name": "regular", "configuration": {
        "chunk_shape": [1, 1, 1, 1, 1]}})
    with pytest.raises(StoreError, match="chunks span the whole of"):
        workbench.open_run(narrow)
    wide = tmp_path / "wide.zarr"
    shutil.copytree(prism_store[0], wide)
    for name in ("subexpert_tokens", "subexpert_ran"):
        meta = json.loads((wide / name / "zarr.json").read_text())
        axis = meta["dimension_names"].index("subexpert")
        shape, chunk = meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"]
        shape[axis] = chunk[axis] = 600
        edit(wide, name, shape=shape, chunk_grid={"name": "regular",
                                                  "configuration": {"chunk_shape": chunk}})
    with pytest.raises(StoreError, match=r"64 experts × 600 sub-experts is over 32767"):
        workbench.open_run(wide)


def test_hybrid_mode_with_a_global_k_replays_exactly(embedded, tmp_path, assert_replays_live):
    """GPU–CPU hybrid decides each looked-up expert by its own tokens: with a global K the
    experts left idle are not looked up, and the decisions stay with their experts (replay =
    live, the Python engine: hybrid's)."""
    import workbench
    from workbench.prism import refactor as R

    R.save(R.random_refactoring(embedded, seed=11), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=4, ignore_eos=True)
    rt.run(workbench.mixed_batch(2, text_share=0.5, seed=12), prism=True, prism_k=3,
           prism_refactoring=str(tmp_path / "p"), hybrid=True, store=tmp_path / "h.zarr",
           **dict(KW, cache_slots=24))
    ds = workbench.open_run(tmp_path / "h.zarr")
    assert int(ds.host_runs.sum()) > 0
    assert_replays_live(workbench.replay_trace(ds, engine="python"), ds)
