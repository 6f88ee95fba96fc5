"""The share-of-Belady study (issue 40 §3) on a generated trace: shares in [0, 1 + ε], Belady's
share 1, prefill + decode = the whole run, oracle and tuned labels, the computed verdict and
the figure."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from workbench.analysis.eviction_study import (online_policies, policy_kind, share_figure,
                                               share_study, share_table, verdict)
from workbench.errors import InputError
from workbench.traces import Trace

EPS = 1e-9


def _trace(seed=3) -> Trace:
    """Two requests of zipf routing (8 layers × 32 experts, top-2): each a prefill step of 12
    tokens, then 40 one-token decode steps."""
    spec = importlib.util.spec_from_file_location(
        "zipf_trace", Path(__file__).resolve().parents[1] / "benchmarks" / "zipf_trace.py")
    z = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(z)
    pre, dec = 12, 40
    ids = z.zipf_routing(2 * (pre + dec), 8, 32, 2, 1.1, seed)
    one = np.r_[np.zeros(pre, np.int32), np.arange(1, dec + 1, dtype=np.int32)]
    token_step = np.r_[one, one + dec + 1].astype(np.int32)
    phase = np.r_[0, np.ones(dec, np.int8), 0, np.ones(dec, np.int8)].astype(np.int8)
    req = np.r_[np.zeros(dec + 1, np.int32), np.ones(dec + 1, np.int32)]
    return Trace(topk_ids=ids, token_step=token_step, num_experts=32, phase=phase,
                 step_request=req)


@pytest.fixture(scope="module")
def study():
    tr = _trace()
    return share_study({"gen": tr, "gen-b": _trace(seed=5)}, sizes=(0.05, 0.1, 0.3, 0.5),
                       extra_slots=(64,), tuned_on={"reuse-eta": ["gen"]})


def test_shares_bounded_and_belady_is_one(study):
    d = study[study.share.notna()]
    assert (d.share >= 0).all()
    # Belady maximises the whole run's hits: over all steps no policy passes it (a share over
    # one phase alone may)
    assert (d[d.phase == "all"].share <= 1 + EPS).all()
    bel = study[study.policy == "belady"]
    assert (bel.kind == "oracle").all()
    assert np.allclose(bel[bel.belady_hits > 0].share, 1.0)
    assert set(study.policy) == {"belady", *online_policies()}
    assert "slab" not in set(study.policy) and policy_kind("slab") == "predictor"


def test_prefill_and_decode_add_up(study):
    key = ["trace", "policy", "slots"]
    a = study[study.phase == "all"].set_index(key)
    p = study[study.phase == "prefill"].set_index(key)
    d = study[study.phase == "decode"].set_index(key)
    for col in ("hits", "belady_hits", "accesses", "steps"):
        assert (a[col] == p[col] + d[col]).all(), col
    assert (p.steps == 2).all() and (d.steps == 80).all()
    assert (p.hits > 0).any()  # the second request's prefill finds the first one's experts


def test_sizes_labels_and_verdict(study):
    assert sorted(set(study.slots)) == [13, 26, 64, 77, 128]
    assert study[(study.policy == "reuse-eta") & (study.trace == "gen")].tuned.all()
    assert not study[(study.policy == "reuse-eta") & (study.trace == "gen-b")].tuned.any()
    assert not study[study.policy == "lru"].tuned.any()
    t = share_table(study, "decode")
    assert "belady" not in t.columns and len(t) == 10
    v = verdict(study, goal=0.5, slots=(64, 128))
    best = v["all"]["best"]
    cells = study[(study.phase == "decode") & (study.policy == best) & study.slots.isin([64, 128])]
    assert v["all"]["score"] == pytest.approx(cells.share.min())
    assert v["all"]["score"] == max(v["all"]["scores"].values())
    assert v["met"] == (v["all"]["score"] >= 0.5)
    assert "reuse-eta" in v["held_out"]["scores"] and "belady" not in v["all"]["scores"]
    assert verdict(study, goal=1.5)["met"] is False


def test_share_figure(study):
    d = study[(study.trace == "gen") & (study.phase == "decode")]
    fig = share_figure(d)
    assert {t.name for t in fig.data} >= {"lru", "belady (ceiling)"}
    assert fig.layout.yaxis.title.text == "share of Belady's hits"
    with pytest.raises(InputError):
        share_figure(study[study.phase == "decode"])
    with pytest.raises(InputError):
        share_study({"gen": _trace()}, sizes=(0.0,))


def test_concat_traces_is_a_stream():
    from workbench.analysis.eviction_study import concat_traces
    from workbench.replay.engine import replay

    a, b = _trace(3), _trace(5)
    c = concat_traces([a, b])
    assert c.num_steps == a.num_steps + b.num_steps and c.num_tokens == a.num_tokens + b.num_tokens
    assert (c.phase == np.r_[a.phase, b.phase]).all()
    assert sorted(set(c.step_request.tolist())) == [0, 1, 2, 3]
    kw = dict(eviction="lru", cache_slots=40, pinned_layers=0, prefetch="none", hits_only=True)
    whole, first = replay(c, **kw), replay(a, **kw)
    assert (whole.hits[:a.num_steps] == first.hits).all()  # the first part is served as alone
    with pytest.raises(InputError):
        concat_traces([])


def test_run_store_accessor(tmp_path):
    """``ds.moe.eviction_share`` is the study of a run store's routing."""
    import workbench

    store = Path(__file__).resolve().parent / "data"
    stores = sorted(store.glob("**/*.zarr"))
    if not stores:
        pytest.skip("no run store under tests/data")
    ds = workbench.open_run(stores[0])
    df = ds.moe.eviction_share(sizes=(0.1, 0.5), policies=["lru", "least-stale"])
    assert set(df.policy) == {"belady", "lru", "least-stale"}
    assert np.allclose(df[(df.policy == "belady") & (df.belady_hits > 0)].share, 1.0)


def test_the_foresight_study_runs_from_lru_to_belady():
    """``belady-horizon`` sees h layer turns ahead: h = 0 is LRU, a horizon past the trace is
    Belady, in between it is an oracle (never online); the study and its table say so."""
    from workbench.analysis.eviction_study import foresight_needed, foresight_study
    from workbench.replay.engine import replay

    tr = _trace()
    groups = tr.num_steps * tr.num_layers
    df = foresight_study({"gen": tr}, slots=(16, 40), horizons=(0, 8, groups), phase="all")
    for n in (16, 40):
        def hits(**kw):
            return int(replay(tr, cache_slots=n, pinned_layers=0, hits_only=True,
                              **kw).hits.sum())
        row = df[df.slots == n].set_index("horizon")
        assert row.loc[0, "hits"] == hits(eviction="lru")
        assert row.loc[groups, "hits"] == row.loc[groups, "belady_hits"] == hits(eviction="belady")
        assert row.loc[8, "tokens_ahead"] == 1.0  # 8 layers
        assert (row.share <= 1 + EPS).all() and row.loc[8, "hits"] > row.loc[0, "hits"]
    need = foresight_needed(df, goal=0.999)
    assert (need.horizon == groups).all() and (need.best_share > 0.999).all()
    assert policy_kind("belady-horizon") == "oracle" and "belady-horizon" not in online_policies()
    from workbench.errors import KnobError
    from workbench.knobs import Knobs
    with pytest.raises(KnobError, match="belady_horizon"):
        Knobs(belady_horizon=-1)
