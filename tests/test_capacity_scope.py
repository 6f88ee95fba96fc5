"""Where capacity-aware dispatch acts (issue 39 §3): the ``capacity_scope`` knob.

``prefill`` dispatches the prefill steps only and leaves every decode step's routing as the
router chose it; ``all`` dispatches every step, exactly as the workbench did before the knob.
The rule is one (:meth:`workbench.sim.dispatch.Dispatch.acts_on`): the live stage and trace
replay give the same routing for both values; old stores read back as ``all``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import distinct_ids
from workbench.errors import KnobError
from workbench.knobs import PREDATING, Knobs
from workbench.runtime.stages.base import LayerCall
from workbench.runtime.stages.dispatch import DispatchStage
from workbench.sim.dispatch import (CAPACITY_SCOPES, DISPATCH, CapacityDrop, Macs, check_scope,
                                    dispatch_trace)
from workbench.traces import Trace

E, K, L = 8, 2, 3


def _trace(seed=0, prefill=40, decode_steps=12, per_step=6) -> Trace:
    """A prefill step of ``prefill`` tokens, then decode steps of ``per_step`` tokens (a batch),
    with weights and modalities; phase 0 for the prefill, 1 after."""
    rng = np.random.default_rng(seed)
    steps = np.r_[np.zeros(prefill, np.int64), np.repeat(np.arange(1, decode_steps + 1),
                                                          per_step)]
    T = len(steps)
    ids = distinct_ids(rng, (T, L, K), E, none_share=0.0)
    # concentrated routing: expert 0 in most tokens' first slot (capacity binds)
    hot = rng.random(T) < 0.7
    ids[hot, :, 0] = 0
    ids[hot, :, 1] = np.where(ids[hot, :, 1] == 0, 1, ids[hot, :, 1])
    w = rng.random(ids.shape).astype(np.float32)
    mod = (rng.random(T) < 0.5).astype(np.int8)
    mod[prefill:] = 0  # decode tokens are text
    phase = np.r_[0, np.ones(decode_steps, np.int8)].astype(np.int8)
    return Trace(topk_ids=ids.astype(np.int16), token_step=steps, num_experts=E, topk_weights=w,
                 token_modality=mod, phase=phase)


def _policies(scope: str):
    ep = Knobs(capacity_scope=scope, capacity_factor=0.5, ep_ranks=2, macs_semantic_load=False,
               macs_reroute=False).group("ep")
    drop = DISPATCH.get("capacity-drop").for_knobs(ep)
    macs = DISPATCH.get("macs").for_knobs(ep)
    macs.classes = np.tile(np.array([1, -1, 0, 0, 1, -1, 0, 0], np.int8), (L, 1))
    return drop, macs


def _live(trace: Trace, policy) -> np.ndarray:
    """The live stage's routing of every (step, layer) layer call of ``trace``: each call is
    handed to :meth:`DispatchStage.route` as the runtime hands it (one step, one layer, the
    step counted from 0 = the prefill)."""
    stage = DispatchStage(policy)
    out = np.full(trace.topk_ids.shape, -1, np.int16)
    ts = np.asarray(trace.token_step)
    for s in range(trace.num_steps):
        rows = np.flatnonzero(ts == s)
        for layer in range(L):
            ids = torch.as_tensor(trace.topk_ids[rows, layer].astype(np.int64))
            w = torch.as_tensor(trace.topk_weights[rows, layer])
            call = LayerCall(block=SimpleNamespace(num_experts=E, index=layer),
                             hidden_states=torch.zeros(len(rows), 4), ids=ids, weights=w,
                             step=s, pinned=False,
                             modality=np.asarray(trace.token_modality)[rows])
            stage.route(call)
            got = call.ids.numpy()
            out[rows, layer] = np.where(got >= E, -1, got)[:, :K]
    return out, stage


@pytest.mark.parametrize("scope", CAPACITY_SCOPES)
def test_live_equals_replay_exactly(scope):
    """Token Drop and MACS (static parts: DC on, SL and SR off, as replay runs it), the live
    stage's per-call routing = the replay's dispatch of the whole trace, for both scopes."""
    tr = _trace()
    for pol in _policies(scope):
        rep, stats = dispatch_trace(tr, pol)
        live, stage = _live(tr, pol)
        np.testing.assert_array_equal(live, rep.topk_ids)
        assert stage.dispatch_assigned == stats.assigned
        assert stage.dispatch_dropped == stats.dropped


def test_prefill_scope_leaves_decode_routing_untouched():
    """Under ``prefill`` every decode token keeps the router's top-k (live and replay); the
    prefill is dispatched as under ``all``; under ``all`` decode steps drop too."""
    tr = _trace()
    decode = np.asarray(tr.token_step) > 0
    for pre, every in zip(_policies("prefill"), _policies("all")):
        a, _ = dispatch_trace(tr, pre)
        b, _ = dispatch_trace(tr, every)
        np.testing.assert_array_equal(a.topk_ids[decode], tr.topk_ids[decode])
        np.testing.assert_array_equal(a.topk_ids[~decode], b.topk_ids[~decode])
        assert (a.topk_ids[~decode] < 0).any()  # the prefill is dispatched
        assert (b.topk_ids[decode] < 0).any()  # 'all' drops at decode (C small)
        live, _ = _live(tr, pre)
        np.testing.assert_array_equal(live[decode], tr.topk_ids[decode])


def test_all_equals_the_dispatch_before_the_knob():
    """``all`` is exactly the old rule: the policy applied to every step of the trace at once
    (what :func:`dispatch_trace` did before the knob), and a policy made without knobs acts
    on every step."""
    tr = _trace(seed=3)
    assert CapacityDrop().capacity_scope == "all" and Macs().acts_on(1)
    for pol in _policies("all"):
        ctx = None
        if isinstance(pol, Macs):
            from workbench.sim.macs import DispatchContext

            ctx = DispatchContext(modality=np.asarray(tr.token_modality),
                                  layers=np.arange(L), expert_class=None)
        old = pol.apply_weighted(tr.topk_ids, tr.topk_weights, tr.token_step, E, ctx)[0]
        new, _ = dispatch_trace(tr, pol)
        np.testing.assert_array_equal(new.topk_ids, old)


def test_knob_default_bounds_and_old_stores():
    """Default ``prefill`` (the papers' regime, docs/macs.md); a store written before the knob
    reads back as ``all`` (what it ran); a bad value is refused in one line."""
    assert Knobs().capacity_scope == "prefill"
    assert PREDATING["capacity_scope"] == "all"
    assert Knobs.from_attrs({}).capacity_scope == "all"
    assert Knobs.from_attrs(Knobs().to_attrs()).capacity_scope == "prefill"
    with pytest.raises(KnobError) as e:
        Knobs(capacity_scope="decode")
    assert "\n" not in str(e.value) and "capacity_scope" in str(e.value)
    with pytest.raises(ValueError, match="capacity_scope must be one of prefill, all"):
        check_scope("decode")


def test_cli_bad_scope_exits_2_with_one_line(capsys):
    from workbench.cli import main

    assert main(["run", "--set", "capacity_scope=decode"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "capacity_scope" in err


def test_live_run_prefill_scope_keeps_decode_routing(embedded, tmp_path):
    """The embedded model, a batch of 4, γ0 = 0.5: under ``prefill`` no decode step of the
    store loses an assignment, the prefill does; under ``all`` decode steps lose some; every
    store says its scope."""
    import workbench

    rt = workbench.Runtime(embedded, max_new_tokens=4)
    reqs = workbench.mixed_batch(4, text_share=0.5, seed=1)
    drops = {}
    for scope in CAPACITY_SCOPES:
        store = tmp_path / f"{scope}.zarr"
        res = rt.run(reqs, store=store, dispatch="capacity-drop", capacity_factor=0.5,
                     capacity_scope=scope)
        ds = workbench.open_run(store)
        assert Knobs.from_attrs(ds.attrs).capacity_scope == scope
        d = ds["dispatch_dropped"].sum(("layer", "expert", "modality")).values
        drops[scope] = d
        assert int(d.sum()) == res.dispatch_dropped
        steps = ds.token_step.values
        dec = ds.topk_ids.values[steps > 0]
        if scope == "prefill":
            assert (dec >= 0).all() and int(d[1:].sum()) == 0
    assert drops["prefill"][0] > 0 and drops["all"][1:].sum() > 0
