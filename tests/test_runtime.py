import threading

import pytest

import workbench


@pytest.fixture(scope="module")
def rt(tiny_ckpt):
    return workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=3, pinned_layers=1,
                             max_new_tokens=6, device="cpu")


def test_streams_tokens_as_generated(rt):
    seen = []
    res = rt.run("stream", record=False, on_token=lambda tok, text: seen.append((tok, text)))
    assert [t for t, _ in seen] == res.token_ids
    assert seen[-1][1].strip() == res.text
    assert res.steps == len(res.token_ids)


def test_sampling_is_seeded_and_greedy_is_default(rt):
    a = rt.run("sample", record=False, sampling=True, seed=3, temperature=1.5)
    b = rt.run("sample", record=False, sampling=True, seed=3, temperature=1.5)
    assert a.token_ids == b.token_ids
    assert a.knobs["sampling"] and not rt.knobs.sampling  # per-run knobs do not stick


def test_stop_event_ends_generation_early(rt):
    stop = threading.Event()

    def on_token(tok, text):
        if len(text) >= 2:
            stop.set()

    res = rt.run("stop me", record=False, stop=stop, on_token=on_token, max_new_tokens=50)
    assert res.stopped and res.steps < 50


def test_default_store_goes_to_the_workspace(rt, tmp_path):
    with workbench.set_options(workspace=tmp_path / "ws"):
        res = rt.run("where", max_new_tokens=2)
    assert res.store.startswith(str(tmp_path / "ws"))
    assert workbench.open_run(res.store).sizes["step"] == 2


def test_more_slots_never_fewer_hits_for_lru_on_this_request(rt):
    """LRU is a stack algorithm: with the same access sequence more slots never lose hits."""
    hits = [rt.run("the same request", record=False, cache_slots=s, pinned_layers=0).hits
            for s in (2, 4, 8, 16)]
    assert hits == sorted(hits) and hits[-1] > hits[0]
