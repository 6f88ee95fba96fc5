"""Batched requests (issue 14 §1): a batch runs together through the real model, each
request's greedy answer equals running it alone, and the store holds the real tokens only,
each with its request index."""

import json

import numpy as np
import pytest

import workbench
from workbench.errors import InputError
from workbench.models.batches import HELDOUT_SEED, batch, mixed_batch
from workbench.models.inputs import Request
from workbench.runtime.runtime import Runtime


@pytest.fixture(scope="module")
def rt(embedded):
    return Runtime(embedded, cache_slots=24, max_new_tokens=10)


@pytest.fixture(scope="module")
def mixed_run(rt, tmp_path_factory):
    """A mixed batch (image and text-only requests of unequal lengths: some finish early)."""
    reqs = mixed_batch(5, text_share=0.4, seed=3)
    store = tmp_path_factory.mktemp("batch") / "b.zarr"
    res = rt.run(reqs, store=store, prefetch="previous-step")
    return reqs, res, workbench.open_run(store)


def test_each_answer_equals_the_request_run_alone(rt, mixed_run):
    reqs, res, _ = mixed_run
    assert len(res.batch) == len(reqs) == 5
    lengths = {len(r["token_ids"]) for r in res.batch}
    assert len(lengths) > 1  # requests finish at different steps: finished rows are masked
    for req, got in zip(reqs, res.batch):
        alone = rt.run(req, record=False, prefetch="previous-step")
        assert got["token_ids"] == alone.token_ids and got["text"] == alone.text
    assert res.text == res.batch[0]["text"] and res.texts == [r["text"] for r in res.batch]


def test_store_holds_real_tokens_with_their_request(rt, mixed_run):
    reqs, res, ds = mixed_run
    req = ds["token_request"].values
    step = ds["token_step"].values
    meta = json.loads(ds.attrs["requests"])
    assert ds.attrs["batch_size"] == 5 and [m["prompt"] for m in meta] == [r.prompt for r in reqs]
    # the prefill holds each request's real prompt tokens (no padding), in request order
    pre = req[step == 0]
    assert np.all(np.diff(pre) >= 0)
    assert np.bincount(pre, minlength=5).tolist() == [m["prompt_tokens"] for m in meta]
    assert [m["prompt_tokens"] for m in meta] == [r["prompt_tokens"] for r in res.batch]
    # decode step s holds one token per request still generating at s
    for s in range(1, int(ds.sizes["step"])):
        alive = [b for b, r in enumerate(res.batch) if len(r["token_ids"]) > s]
        assert sorted(req[step == s].tolist()) == alive
    # image tokens belong to the image requests only
    mod = ds["token_modality"].values
    with_images = {b for b, r in enumerate(reqs) if r.images}
    assert set(np.unique(req[mod == 1]).tolist()) == with_images and with_images
    # every stored token is routed (nothing of the padding reached an expert)
    ids = ds["topk_ids"].values
    assert (ids >= 0).all()
    assert int(ds["routed_tokens"].sum()) == ids.size
    assert int(ds["step_tokens"].sum()) == ds.sizes["token"]


def test_batch_store_replays_live(mixed_run, assert_replays_live):
    _, _, ds = mixed_run
    from workbench.replay import replay_trace

    assert_replays_live(replay_trace(ds), ds)


def test_padding_takes_no_capacity_and_no_cache(rt, embedded):
    """A batch's padding neither competes for an expert's capacity nor touches the cache:
    the dispatch sees k assignments per real token per layer."""
    reqs = batch(3, mix="mixed", seed=11)
    res = rt.run(reqs, record=False, dispatch="capacity-drop", capacity_factor=1.0)
    real = sum(r["prompt_tokens"] + len(r["token_ids"]) - 1 for r in res.batch)
    lay = embedded.layout
    assert res.dispatch_assigned == real * lay.top_k * lay.num_layers
    assert 0 < res.dispatch_dropped < res.dispatch_assigned


def test_text_moe_batch_equals_alone(tiny_ckpt):
    rt = Runtime(str(tiny_ckpt()), cache_slots=4, max_new_tokens=5)
    reqs = [Request("hello there my friend"), Request("a"), Request("what is up")]
    res = rt.run(reqs, record=False)
    for req, got in zip(reqs, res.batch):
        assert got["token_ids"] == rt.run(req, record=False).token_ids


def test_a_batch_of_one_is_the_single_request_run(rt):
    req = batch(1, seed=5)[0]
    one, listed = rt.run(req, record=False), rt.run([req], record=False)
    assert listed.token_ids == one.token_ids and listed.batch == []
    assert (listed.hits, listed.misses, listed.loads) == (one.hits, one.misses, one.loads)


@pytest.mark.parametrize("call, fragment", [
    (lambda rt: rt.run([]), "the batch is empty"),
    (lambda rt: rt.run([Request("a")], images=["x.png"]), "carry their own images"),
    (lambda rt: rt.run([Request("a"), "b"]), "request 1 of the batch: must be a workbench Request"),
    (lambda rt: rt.run([Request("a"), Request("  ")]), "request 1 of the batch: prompt is empty"),
    (lambda rt: rt.run([Request("a"), Request("b")], compression="saliency"),
     "a batch of 2 requests needs compression='none'"),
    (lambda rt: rt.run([Request("a")] * 257), "from 1 to 256 requests, not 257"),
])
def test_bad_batches_are_refused_clearly(rt, call, fragment):
    with pytest.raises(InputError, match=None) as e:
        call(rt)
    assert fragment in str(e.value)


def test_batch_builders():
    mixed = batch(12)
    assert mixed == batch(12)  # deterministic (same prompts, same images)
    assert any(r.images for r in mixed) and any(not r.images for r in mixed)
    assert all(not r.images for r in batch(4, mix="text"))
    assert all(r.images for r in batch(4, mix="image"))
    m = mixed_batch(8, text_share=0.25)
    assert sum(not r.images for r in m) == 2
    assert [bool(r.images) for r in mixed_batch(4, text_share=0.5)] == [False, True, False, True]
    from workbench.models.embedded.demo import read_demo

    items = read_demo()
    assert [r.prompt for r in batch(7, source="demo")] == [
        items[i % len(items)]["prompt"] for i in range(7)]
    from workbench.models.embedded.v2.train import HELDOUT_SEED as trained

    assert HELDOUT_SEED == trained
    for kw, fragment in (({"n": 0}, "from 1 to 256"), ({"source": "web"}, "one of heldout, demo"),
                         ({"mix": "audio"}, "one of mixed, image, text"),
                         ({"seed": -1}, "from 0 to 2**63")):
        with pytest.raises(InputError, match=None) as e:
            batch(**{"n": 2, **kw})
        assert fragment in str(e.value)
    with pytest.raises(InputError, match=r"text_share must be a number in \[0, 1\]"):
        mixed_batch(4, text_share=2)


def test_cli_batch(capsys, tmp_path):
    from workbench.cli import main

    store = tmp_path / "b.zarr"
    rc = main(["run", "--batch", "3", "--batch-mix", "mixed", "--json", "--store", str(store),
               "--set", "ep_ranks=2", "--max-new-tokens", "4"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(out["batch"]) == 3 and out["ep"]["ranks"] == 2
    ds = workbench.open_run(store)
    assert sorted(set(ds["token_request"].values.tolist())) == [0, 1, 2]
    rc = main(["run", "--input", "what is 2 plus 3?", "--input", "count from 1 to 3.",
               "--no-record", "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert rc == 0 and "answer 1: " in out and "batch of 2 requests" in out


@pytest.mark.parametrize("args, fragment", [
    (["--prompt", "x", "--batch", "2"], "not --prompt and --batch"),
    ([], "give one of --prompt"),
    (["--batch", "2", "--image", "a.png"], "--image goes with --prompt"),
    (["--batch", "0"], "from 1 to 256 requests, not 0"),
    (["--input", "  "], "has an empty prompt"),
    (["--input", "x.png|  "], "has an empty prompt"),
])
def test_cli_bad_batches_exit_2(capsys, args, fragment):
    from workbench.cli import main

    assert main(["run", "--no-record", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_a_store_older_than_batches_reads_request_0():
    from pathlib import Path

    ds = workbench.open_run(Path(__file__).parent / "data" / "store_v3.zarr")
    r = ds["token_request"]
    assert r.dims == ("token",) and r.shape == ds["token_id"].shape and int(r.max()) == 0


def test_request_load_splits_expert_counts_by_request(mixed_run):
    reqs, _, ds = mixed_run
    load = ds.moe.request_load()
    assert load.dims == ("request", "layer", "expert") and load.sizes["request"] == 5
    np.testing.assert_array_equal(load.sum("request").values, ds.moe.expert_counts().values)
    img = ds.moe.request_load("image")
    text_only = [b for b, r in enumerate(reqs) if not r.images]
    assert int(img.sel(request=text_only).sum()) == 0 and int(img.sum()) > 0


def test_dashboard_runs_its_request_in_a_batch(tmp_path):
    """The dashboard's batch: the typed request first (its answer is the one shown), then
    generated held-out requests of the chosen mix."""
    from workbench.ui.datastore import DataStore

    st = DataStore(workspace=tmp_path)
    st.param.update(prompt="count from 2 to 5.", image=None, batch_size=3, batch_mix="image")
    path = st.start_run()
    st.wait(120)
    st.poll()
    assert st.error == ""
    ds = workbench.open_run(path)
    meta = json.loads(ds.attrs["requests"])
    assert [m["prompt"] for m in meta][0] == "count from 2 to 5." and len(meta) == 3
    assert all(m["images"] == ["<PIL image>"] for m in meta[1:])
    alone = Runtime(max_new_tokens=st.knobs.max_new_tokens).run("count from 2 to 5.",
                                                                record=False)
    assert st.answer == alone.text


def test_sweep_point_runs_a_batch(tmp_path):
    """A sweep input in a batch: its point id differs from the single input's, and the
    worker runs the batch (the Dask side is the one every point takes)."""
    from workbench.analysis.sweep import SweepInput, point_id, run_point
    from workbench.knobs import Knobs

    inp = SweepInput.parse("what is 2 plus 3?")
    b = inp.batched(3, "text")
    k = Knobs(max_new_tokens=4).to_dict()
    assert point_id(k, inp) != point_id(k, b) and "batch of 3, text" in b.name
    assert point_id(k, inp) == point_id(k, inp.batched(1))
    out = run_point(None, k, b.prompt, b.images, str(tmp_path / "p.zarr"),
                    str(tmp_path / "p.json"), {"id": "p", "batch": 3, "mix": "text"})
    assert out["status"] == "complete", out.get("error")
    assert len(out["result"]["batch"]) == 3
    with pytest.raises(InputError, match="from 1 to 256"):
        inp.batched(0)


def test_review_mends_for_batches(rt, tmp_path):
    """Padding never decides a prefetch (a batch store replays to its live counters with a
    speculative prefetcher); a text prompt may hold '|'; the lookahead predictor, which reads
    one request's image summary, is refused with a batch."""
    from workbench.analysis.sweep import SweepInput
    from workbench.replay import replay_trace

    store = tmp_path / "spec.zarr"
    rt.run(mixed_batch(4, seed=9), store=store, prefetch="speculative")
    ds = workbench.open_run(store)
    res = replay_trace(ds)
    np.testing.assert_array_equal(res.hits, ds["hits"].values)
    np.testing.assert_array_equal(res.prefetch_loads, ds["prefetches"].values)
    assert SweepInput.parse("what is 1|2?").prompt == "what is 1|2?"
    assert SweepInput.parse("a.png,b.jpg|what?").images == ("a.png", "b.jpg")
    from workbench.runtime.session import RunSession

    # (a run checks its predictor first: the session refuses a batch whatever the folder holds)
    with pytest.raises(InputError, match="lookahead predictor"):
        RunSession(rt, rt.knobs.copy(prefetch="vismmoe"), [Request("a"), Request("b")])
