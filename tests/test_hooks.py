"""workbench.models.hooks: the one place hooks go on a model, and everything it installs comes
off again (the invariants of its module docstring; the source rule — no other module registers
a hook — is in tests/test_imports.py)."""

from __future__ import annotations

import pytest
import torch

from workbench.models.hooks import Hooks


def _hooks_of(model: torch.nn.Module) -> dict[str, tuple]:
    """Every forward (pre-)hook and instance attribute override of ``model``'s modules."""
    return {name: (tuple(m._forward_pre_hooks), tuple(m._forward_hooks),
                   tuple(k for k in vars(m) if k in ("forward", "_deepstack_process")))
            for name, m in model.named_modules()}


def test_hooks_run_in_install_order_and_come_off_last_first():
    lin = torch.nn.Linear(2, 2)
    seen: list[str] = []
    with Hooks() as hooks:
        hooks.pre(lin, lambda m, a: seen.append("pre1"))
        hooks.pre(lin, lambda m, a, kw: seen.append("pre2"), with_kwargs=True)
        hooks.post(lin, lambda m, a, o: seen.append("post"))
        hooks.override(lin, "extra_repr", lambda: "over")
        lin(torch.zeros(1, 2))
        assert seen == ["pre1", "pre2", "post"] and lin.extra_repr() == "over"
        assert len(hooks) == 4
    assert len(hooks) == 0
    assert not lin._forward_pre_hooks and not lin._forward_hooks
    assert "extra_repr" not in vars(lin) and lin.extra_repr() != "over"
    seen.clear()
    lin(torch.zeros(1, 2))
    assert seen == []


def test_a_failed_install_removes_what_it_had_installed():
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="boom"):
        with Hooks() as hooks:
            hooks.pre(lin, lambda m, a: None)
            hooks.override(lin, "forward", lambda x: x)
            raise ValueError("boom")
    assert not lin._forward_pre_hooks and "forward" not in vars(lin)


def test_an_override_of_an_override_puts_the_first_back():
    lin = torch.nn.Linear(2, 2)
    theirs = lambda x: 3 * x  # noqa: E731  (an instance override someone else installed)
    lin.forward = theirs
    with Hooks() as hooks:
        hooks.override(lin, "forward", lambda x: x)
        hooks.override(lin, "forward", lambda x: 2 * x)
        assert lin(torch.ones(1)) == 2
    assert vars(lin)["forward"] is theirs


def test_a_run_leaves_no_hook_on_the_model(embedded, vismmoe_run, demo_inputs):
    """Offloader, token compression, predictor and step boundaries all installed; after the
    run (and after a failed one) the model holds exactly the hooks it held before."""
    import workbench

    before = _hooks_of(embedded.model)
    image, prompt, _ = demo_inputs[0]
    knobs = dict(compression="affinity", predictor="vismmoe", cache_slots=16,
                 predictor_path=str(vismmoe_run[0].parent / "predictor"))
    rt = workbench.Runtime(embedded, max_new_tokens=2)
    res = rt.run(prompt, [image], record=False, **knobs)
    assert res.predictor_cost["calls"] > 0  # the predictor's hooks did run
    assert _hooks_of(embedded.model) == before

    def boom(token_id, text):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rt.run(prompt, [image], record=False, on_token=boom, **knobs)
    assert _hooks_of(embedded.model) == before
