"""Offloading must not change the model: same greedy tokens, logits allclose.

For every supported architecture (tiny random configs built from the real transformers classes),
any cache size ≥ top-k and any number of pinned layers; plus the embedded trained model.
"""

import time

import pytest
import torch

from workbench.models.adapter import find_moe_blocks
from workbench.models.tiny import TINY_ARCHITECTURES, greedy_outputs, tiny_inputs, tiny_model
from workbench.policies.eviction import EVICTION
from workbench.runtime.executor import StepProbe
from workbench.runtime.offload import Offloader

CASES = [(2, 0), (3, 1), (5, 2), (4, 3), (24, 0)]  # (cache_slots, pinned_layers); top-k = 2


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_offloaded_equals_plain(arch):
    model = tiny_model(arch)
    inputs = tiny_inputs(model, arch)
    ref_logits, ref_tokens = greedy_outputs(model, inputs)
    layout = find_moe_blocks(model)
    params_before = {n: p for n, p in model.named_parameters()}
    for slots, pinned in CASES:
        probe = StepProbe(time.perf_counter())
        with Offloader(layout, slots, pinned, EVICTION.create("lru"), "cpu", probe) as off:
            logits, tokens = greedy_outputs(model, inputs)
            c = off.cache.counters()
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
        assert torch.equal(tokens, ref_tokens), (arch, slots, pinned)
        offloaded = [b.index for b in layout.blocks if b.index >= pinned]
        if offloaded:  # every offloaded layer went through the cache
            assert (c["misses"][offloaded] > 0).all()
            assert c["loads"].sum() == c["misses"][offloaded].sum()
    # the context restored every parameter object and value
    assert {n: p for n, p in model.named_parameters()}.keys() == params_before.keys()
    for n, p in model.named_parameters():
        assert p is params_before[n]
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, ref_logits)


def test_restored_after_an_error_inside_the_context():
    model = tiny_model("mixtral")
    ids = torch.randint(3, 120, (1, 8))
    with torch.no_grad():
        ref = model(ids).logits
    layout = find_moe_blocks(model)
    with pytest.raises(RuntimeError, match="boom"):
        with Offloader(layout, 2, 1, EVICTION.create("lru"), "cpu", StepProbe(0.0)):
            raise RuntimeError("boom")
    assert all("forward" not in b.experts.__dict__ for b in layout.blocks)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


@pytest.mark.parametrize("slots, pinned", [(4, 0), (8, 2), (64, 1)])
def test_embedded_model_offloaded_equals_plain(embedded, demo_inputs, slots, pinned):
    from workbench.models.inputs import Request, build_inputs

    image, prompt, _ = demo_inputs[0]
    inputs = build_inputs(embedded, Request(prompt, [image])).tensors
    model = embedded.model
    gen = dict(max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        ref_logits = model(**inputs).logits
        ref_tokens = model.generate(**inputs, **gen)
        with Offloader(embedded.layout, slots, pinned, EVICTION.create("lfu"), "cpu",
                       StepProbe(0.0)):
            logits = model(**inputs).logits
            tokens = model.generate(**inputs, **gen)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, ref_tokens)
