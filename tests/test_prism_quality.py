"""Teacher-forced NLL under the runtime's elastic execution (issue 16 §2, operating points):
:func:`workbench.prism.quality.score`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench.errors import InputError

PROMPTS = ["the quick brown fox", "a b c", "hello there, how are you today"]
CONTS = [" jumps over the lazy dog", " d e", "?"]


@pytest.fixture(scope="module")
def tiny(tiny_ckpt, tmp_path_factory):
    """A tiny Qwen3-MoE runtime (offloaded: small cache, a pinned layer) and a random
    refactoring of it (N = 4)."""
    import workbench
    from workbench.prism import refactor as R

    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=6, pinned_layers=1)
    path = tmp_path_factory.mktemp("prism") / "p"
    R.save(R.random_refactoring(rt.lm, seed=3), path)
    return rt, str(path)


def _direct_nll(lm, prompt: str, cont: str) -> np.ndarray:
    """Per-token NLL of cont + EOS from one plain forward of the model over the whole
    sequence (no runtime, no generate)."""
    from workbench.models.inputs import Request, build_batch_inputs

    p = build_batch_inputs(lm, [Request(prompt, [])]).tensors["input_ids"][0].tolist()
    c = lm.tokenizer(cont, add_special_tokens=False)["input_ids"] + [
        lm.model.generation_config.eos_token_id]
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([p + c])).logits[0].double()
    lp = torch.log_softmax(logits[len(p) - 1:-1], -1)
    return -lp[torch.arange(len(c)), torch.tensor(c)].numpy()


def test_teacher_forcing_scores_the_continuation_like_one_forward(tiny):
    """Position by position the scorer's NLL (offloaded, batched, left-padded, sorted by
    length) is the model's own NLL of the continuation and its EOS, in the caller's order;
    batch size does not change it."""
    from workbench.prism.quality import score

    rt, _ = tiny
    s = score(rt, PROMPTS, CONTS, batch_size=2)
    assert [len(x) for x in s.nll] == [len(rt.lm.tokenizer(c, add_special_tokens=False)
                                           ["input_ids"]) + 1 for c in CONTS]
    for p, c, got in zip(PROMPTS, CONTS, s.nll):
        np.testing.assert_allclose(got, _direct_nll(rt.lm, p, c), rtol=1e-4, atol=1e-5)
    one = score(rt, PROMPTS, CONTS, batch_size=1)
    for a, b in zip(s.nll, one.nll):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert s.ppl == pytest.approx(np.exp(s.sum_nll.sum() / s.counts.sum()))
    assert s.compute_share is None and s.subexperts_asked == 0
    # token ids score like their text; without eos the EOS is not scored
    ids = [rt.lm.tokenizer(c, add_special_tokens=False)["input_ids"] for c in CONTS]
    by_ids = score(rt, PROMPTS, ids, eos=False)
    for a, b in zip(by_ids.nll, s.nll):
        np.testing.assert_allclose(a, b[:-1], rtol=1e-4, atol=1e-5)


def test_greedy_output_scores_as_exact(tiny):
    """The model's own greedy answer is, token by token, its argmax (exact) and scores a
    lower NLL than another continuation of the same length."""
    from workbench.prism.quality import score

    rt, _ = tiny
    eos = rt.lm.model.generation_config.eos_token_id
    res = rt.run(PROMPTS[0], max_new_tokens=5, record=False)
    own = [t for t in res.token_ids if t != eos]
    s = score(rt, [PROMPTS[0]], [own], eos=eos in res.token_ids)
    assert s.exact.all() and s.top1[0].all()
    other = [(t + 7) % rt.lm.model.get_output_embeddings().weight.shape[0] for t in own]
    other = [t if t != eos else t + 1 for t in other]
    worse = score(rt, [PROMPTS[0]], [other], eos=False)
    assert not worse.exact.any()
    assert worse.sum_nll[0] > s.nll[0][:len(own)].sum()


def test_prism_all_active_equals_the_model_and_fewer_sub_experts_change_it(tiny):
    """prism=True with every sub-expert active scores the unmodified model's NLL within
    float rounding; k_active = 1 of 4 runs a quarter of the routed compute and changes it."""
    from workbench.prism.quality import paired_nll, score

    rt, path = tiny
    base = score(rt, PROMPTS, CONTS)
    allk = score(rt, PROMPTS, CONTS, prism=True, prism_refactoring=path)
    for a, b in zip(allk.nll, base.nll):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert allk.compute_share == 1.0
    d, se = paired_nll(allk, base)
    assert abs(d) < 1e-5
    one = score(rt, PROMPTS, CONTS, prism=True, prism_refactoring=path, prism_k_active=1)
    assert one.compute_share == 0.25
    assert max(float(np.abs(a - b).max()) for a, b in zip(one.nll, base.nll)) > 1e-3
    d, se = paired_nll(one, base)
    assert d != 0 and np.isfinite(se)
    # the model is its own again after the prism runs (up to the offloaded path's own
    # float rounding: the cache's state changes the order of the experts' sums)
    again = score(rt, PROMPTS, CONTS)
    for a, b in zip(again.nll, base.nll):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_embedded_vl_model_all_sub_experts_equal_it(embedded, tmp_path):
    """The embedded Qwen3-VL-MoE on held-out questions with images and text only: every
    sub-expert active scores its NLL; the reference answers are its greedy answers."""
    import workbench
    from workbench.analysis.vismmoe.config import eval_seed
    from workbench.models.embedded.v2.tasks import make_split
    from workbench.models.inputs import Request
    from workbench.prism import refactor as R
    from workbench.prism.quality import score

    R.save(R.random_refactoring(embedded, seed=1), tmp_path / "p")
    rt = workbench.Runtime(embedded)
    ex = make_split(eval_seed(), 6)
    reqs = [Request(q, [img] if img is not None else []) for img, q, _ in ex]
    answers = [a for _, _, a in ex]
    assert any(img is None for img, _, _ in ex) and any(img is not None for img, _, _ in ex)
    base = score(rt, reqs, answers, batch_size=3)
    allk = score(rt, reqs, answers, batch_size=3, prism=True,
                 prism_refactoring=str(tmp_path / "p"))
    for a, b in zip(allk.nll, base.nll):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert base.exact.mean() >= 0.5 and base.ppl < 2


def test_bad_input_is_refused_naming_the_thing(tiny):
    from workbench.prism.quality import paired_nll, score

    rt, path = tiny
    eos = rt.lm.model.generation_config.eos_token_id
    cases = [
        (dict(requests=PROMPTS, continuations=CONTS[:2]), "3 requests but 2 continuations"),
        (dict(requests=[], continuations=[]), "no requests"),
        (dict(requests="abc", continuations=["d"]), "must be lists"),
        (dict(requests=["a"], continuations=[""]), "continuation 0 is empty"),
        (dict(requests=["a", "b"], continuations=["x", [1.5]]), "continuation 1: token ids must "
                                                               "be ints"),
        (dict(requests=["a"], continuations=[[5, 10**6]]), r"token id 1000000 is outside the "
                                                           r"model's vocabulary 0 … 127"),
        (dict(requests=["a"], continuations=[[5, eos, 6]]), f"end-of-sequence token {eos} at "
                                                            f"position 1"),
        (dict(requests=["a"], continuations=[3]), "continuation 0 must be text"),
        (dict(requests=[3], continuations=["x"]), "request 0 must be a Request"),
        (dict(requests=["a"], continuations=["x"], batch_size=0), "batch_size must be an int"),
        (dict(requests=["a"], continuations=["x"], max_new_tokens=3), "sets max_new_tokens "
                                                                      "itself"),
        (dict(requests=["a"], continuations=["x"], prism=True, prism_refactoring=path,
              prism_k_active=5), r"prism_k_active must be in 1 … 4"),
    ]
    for kw, msg in cases:
        with pytest.raises(InputError, match=msg):
            score(rt, **kw)
    with pytest.raises(InputError, match="rt must be a workbench.Runtime"):
        score(object(), ["a"], ["x"])
    a, b = score(rt, ["a"], ["x"]), score(rt, ["a"], ["y"])
    with pytest.raises(InputError, match="same continuations"):
        paired_nll(a, b)
