"""MoE-Prism's router fine-tune (seed §4.3.2; workbench.prism.finetune): a trained sub-expert
gate, saved and checked like the refactoring, used by runs with ``prism_router``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import workbench
from workbench.errors import InputError, KnobError
from workbench.prism import finetune as F
from workbench.prism import refactor as R


@pytest.fixture(scope="module")
def trained(embedded, tmp_path_factory):
    """A random 4-sub-expert refactoring of the embedded model and a router trained on it for
    8 steps (folders: ``ref``, ``router``)."""
    root = tmp_path_factory.mktemp("router")
    ref = R.random_refactoring(embedded, subexperts=4)
    R.save(ref, root / "ref")
    before = {n: p.detach().clone() for n, p in embedded.model.named_parameters()}
    grads = {n: p.requires_grad for n, p in embedded.model.named_parameters()}
    router = F.finetune(embedded, ref, R.calibration_requests(8), steps=8, batch_size=4)
    after = dict(embedded.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before), "the model must not change"
    assert {n: p.requires_grad for n, p in after.items()} == grads
    assert all("forward" not in b.experts.__dict__ for b in embedded.layout.blocks)
    F.save(router, root / "router")
    return ref, router, root


def test_finetune_trains_the_gate_and_leaves_the_model(trained, embedded):
    ref, router, root = trained
    lay = embedded.layout
    assert router.weight.shape == (lay.num_layers, lay.num_experts * 4,
                                   embedded.model.config.text_config.hidden_size)
    m = router.meta
    assert m["refactoring_hash"] == F.refactoring_hash(ref) and m["steps"] == 8
    assert np.isfinite(m["loss_first"]) and m["loss_last"] < m["loss_first"]
    back = F.load(root / "router", embedded, ref)
    np.testing.assert_array_equal(back.weight, router.weight)
    with pytest.raises(InputError, match="already holds a MoE-Prism router"):
        F.save(router, root / "router")


def test_a_router_is_refused_for_another_refactoring_or_when_malformed(trained, embedded,
                                                                       tmp_path):
    ref, router, root = trained
    other = R.random_refactoring(embedded, subexperts=4, seed=9)
    with pytest.raises(InputError, match="trained for refactoring .* retrain it"):
        F.load(root / "router", embedded, other)
    bad = F.Router(router.weight.copy(), dict(router.meta))
    bad.weight[0, 0, 0] = np.nan
    F.save(bad, tmp_path / "nan")
    with pytest.raises(InputError, match="not finite"):
        F.load(tmp_path / "nan")
    F.save(router, tmp_path / "big")
    meta = json.loads((tmp_path / "big" / F.CONFIG).read_text())
    meta["hidden"] = 1 << 21
    (tmp_path / "big" / F.CONFIG).write_text(json.dumps(meta))
    with pytest.raises(InputError, match="hidden must be a whole number"):
        F.load(tmp_path / "big")
    with pytest.raises(InputError, match="steps must be a whole number"):
        F.finetune(embedded, ref, R.calibration_requests(2), steps=0)


def test_runs_choose_by_the_trained_gate(trained, embedded, tmp_path):
    """With every sub-expert active the trained gate changes nothing (the answers are
    native); at k_active 1 it chooses other sub-experts than the proxy gate, and the run says
    which it ran. Without prism=True it is refused."""
    ref, router, root = trained
    rt = workbench.Runtime(embedded)
    reqs = workbench.batch(4, mix="image")
    lay = embedded.layout
    base = dict(max_new_tokens=4, record=False, pinned_layers=0,
                cache_slots=lay.num_layers * lay.num_experts,
                prism_refactoring=str(root / "ref"))
    native = rt.run(reqs, max_new_tokens=4, record=False)
    full = rt.run(reqs, prism=True, prism_router=str(root / "router"), **base)
    assert [r["token_ids"] for r in full.batch] == [r["token_ids"] for r in native.batch]
    one = dict(base, record=True, prism=True, prism_k_active=1)
    proxy = rt.run(reqs, store=tmp_path / "proxy.zarr", **one)
    mine = rt.run(reqs, store=tmp_path / "mine.zarr", prism_router=str(root / "router"), **one)
    assert mine.subexperts_ran == proxy.subexperts_ran  # one of 4 per routed slot, both
    a = workbench.open_run(tmp_path / "proxy.zarr")["subexpert_ran"].values
    b = workbench.open_run(tmp_path / "mine.zarr")["subexpert_ran"].values
    n = min(len(a), len(b))  # the prefill's tokens at least: the same inputs in both runs
    assert n > 0 and (a[:n] != b[:n]).any()  # the trained gate chose otherwise
    assert json.loads(workbench.open_run(tmp_path / "mine.zarr").attrs["knob.prism_router"]
                      ) == str(root / "router")
    with pytest.raises(KnobError, match="prism_router"):
        rt.run(reqs, prism_router=str(root / "router"), max_new_tokens=2, record=False)
