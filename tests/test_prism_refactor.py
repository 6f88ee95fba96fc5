"""MoE-Prism's profiler and offline refactoring (issue 16 §1) on the real transformers experts."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from workbench.errors import InputError


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2",
                                  "qwen3_vl_moe"])
def test_sub_experts_sum_to_the_expert_exactly_on_every_architecture(arch):
    """The neuron layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]) holds for every
    supported architecture: the activations reproduce the model's own experts forward, and
    any partition of the neurons into sub-experts sums back to it."""
    from workbench.models.adapter import find_moe_blocks
    from workbench.models.tiny import tiny_model
    from workbench.prism import partition as P
    from workbench.prism.profile import activations, check_layout, neuron_layout

    b = find_moe_blocks(tiny_model(arch)).blocks[0]
    I, H = neuron_layout(b)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(0))
    assert check_layout(b, 2, x) < 1e-6
    with torch.no_grad():
        A = activations(b, 2, x)
        down = b.experts.down_proj[2]
        whole = A @ down.T
        parts = P.random_partition(I, 4, seed=1)
        summed = sum(A[:, parts == n] @ down[:, parts == n].T for n in range(4))
    torch.testing.assert_close(summed, whole, rtol=1e-5, atol=1e-6)


def test_refactor_the_embedded_model_save_and_load(embedded, tmp_path, tiny_ckpt):
    import workbench
    from workbench.prism import partition as P
    from workbench.prism import refactor as R

    ref = R.refactor(embedded, R.calibration_requests(8), iterations=500, max_tokens=32)
    L, E = embedded.layout.num_layers, embedded.layout.num_experts
    I = ref.meta["neurons"]
    assert ref.perm.shape == (L, E, I) and ref.gates.shape == (L, E, 4, 4)
    assert (np.sort(ref.perm, -1) == np.arange(I)).all()
    # annealing starts from the greedy partition and keeps the best: never worse
    assert (ref.objective["annealed"] <= ref.objective["greedy"] + 1e-9).all()
    assert ref.summary()["objective"]["annealed"] < ref.summary()["objective"]["random"]
    assert 0 < ref.tokens.max() <= 32
    # a gate neuron lies in its own sub-expert (contiguous slice of the permuted neurons)
    pos = np.argsort(ref.perm, -1)  # neuron → its place in the permuted order
    place = np.take_along_axis(pos, ref.gates.reshape(L, E, -1), -1).reshape(ref.gates.shape)
    assert ((place // (I // 4)) == np.arange(4)[:, None]).all()
    out = R.save(ref, tmp_path / "p")
    back = R.load(out, embedded)
    assert (back.perm == ref.perm).all() and (back.gates == ref.gates).all()
    assert back.meta["config_hash"] == embedded.config_hash
    with pytest.raises(InputError, match="already holds a MoE-Prism refactoring"):
        R.save(ref, out)
    other = workbench.load(tiny_ckpt(), device="cpu")
    with pytest.raises(InputError, match=r"was made for .*not for"):
        R.load(out, other)
    # tampered files are refused naming the problem
    meta = json.loads((out / R.CONFIG).read_text())
    from safetensors.numpy import load_file, save_file

    t = load_file(str(out / R.WEIGHTS))
    bad = dict(t, perm=np.zeros_like(t["perm"]))
    save_file(bad, str(out / R.WEIGHTS))
    with pytest.raises(InputError, match="must be a permutation"):
        R.load(out)
    g = t["gates"].copy()
    g[0, 0] = g[0, 0, ::-1]  # sub-experts' gate neurons swapped: not in their own group
    save_file(dict(t, gates=g), str(out / R.WEIGHTS))
    with pytest.raises(InputError, match="gate neuron must be a neuron of its own"):
        R.load(out)
    (out / R.CONFIG).write_text(json.dumps({**meta, "neurons": 10**9}))
    with pytest.raises(InputError, match="neurons must be a whole number"):
        R.load(out)
    (out / R.CONFIG).write_text("{not json")
    with pytest.raises(InputError, match="prism.json' is not valid JSON"):
        R.load(out)
    with pytest.raises(InputError, match="dividing the 64 neurons"):
        P.anneal_many([np.ones((2, 64))], 5)


def test_the_refactor_command(tmp_path, capsys):
    """workbench refactor writes the files, refuses to overwrite them without --overwrite and
    refuses sub-expert counts the experts' neurons do not allow, exit 2 without a traceback."""
    from workbench.cli import main
    from workbench.prism import refactor as R

    out = tmp_path / "p"
    args = ["refactor", "--out", str(out), "--requests", "4", "--iterations", "200",
            "--max-tokens", "16", "--json"]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["experts"] == 768 and (out / R.WEIGHTS).is_file() and R.load(out).subexperts == 4
    before = (out / R.WEIGHTS).read_bytes()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already holds a MoE-Prism refactoring" in err and "Traceback" not in err
    assert (out / R.WEIGHTS).read_bytes() == before
    assert main(["refactor", "--out", str(tmp_path / "q"), "--subexperts", "5"]) == 2
    assert "dividing the 64 neurons" in capsys.readouterr().err
    assert main(["refactor", "--out", str(tmp_path / "q"), "--iterations", "-1"]) == 2


def test_the_refactor_command_on_a_text_moe_with_its_own_prompts(tiny_ckpt, tmp_path, capsys):
    """A text-only model is calibrated on text: the user's prompts (--input, --input-file) or,
    without them, generated text-only requests (image requests would be refused). A bad file
    or line exits 2 naming it, without a traceback, and writes nothing."""
    from workbench.cli import main
    from workbench.prism import refactor as R

    ckpt = tiny_ckpt("mixtral")
    f = tmp_path / "cal.txt"
    f.write_text("# my calibration text\nthe quick brown fox\n\njumps over the lazy dog\n")
    base = ["refactor", "--model", str(ckpt), "--iterations", "200", "--json"]
    assert main([*base, "--out", str(tmp_path / "a"), "--input", "a third prompt",
                 "--input-file", str(f)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["calibration"] == {"requests": 3, "source": "given"}
    assert R.load(tmp_path / "a").subexperts == 4
    assert main([*base, "--out", str(tmp_path / "b"), "--requests", "4"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["calibration"] == {"requests": 4, "source": "generated, text-only"}
    bad = tmp_path / "bad.txt"
    for content, says in ((b"ok\n\xff\xfe\n", "is not UTF-8"),
                          (b"fine\n  \nx.png|  \n", "line 3: --input 'x.png|  ' has an empty "
                                                      "prompt")):
        bad.write_bytes(content)
        assert main([*base, "--out", str(tmp_path / "c"), "--input-file", str(bad)]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    assert main([*base, "--out", str(tmp_path / "c"), "--input-file",
                 str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt' does not exist" in capsys.readouterr().err
    big = tmp_path / "big.txt"
    big.write_bytes(b"")
    os.truncate(big, (16 << 20) + 1)  # sparse: refused by its size, before it is read
    assert main([*base, "--out", str(tmp_path / "c"), "--input-file", str(big)]) == 2
    assert "16,777,217 bytes; at most 16,777,216" in capsys.readouterr().err
    big.write_text("p\n" * 4097)
    assert main([*base, "--out", str(tmp_path / "c"), "--input-file", str(big)]) == 2
    assert "4097 calibration requests given; at most 4096" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "c"), "--input", "x.png|what is this?"]) == 2
    assert "--input: image 'x.png' does not exist" in capsys.readouterr().err  # before a load
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    assert main([*base, "--out", str(tmp_path / "c"), "--input",
                 f"{tmp_path / 'x.png'}|what is this?"]) == 2
    assert "text-only" in capsys.readouterr().err
    for content, says in ((b"# nothing\n\n", "has no requests (only blank lines and # comments)"),
                          (b"\xef\xbb\xbf# a comment after a BOM\n" + b"a" * 5_000_000,
                           "line 2: prompt is 5000000 characters; at most"),
                          ("one\u2028two\nx.png|  \n".encode(), "line 2: --input 'x.png|  '")):
        bad.write_bytes(content)
        assert main([*base, "--out", str(tmp_path / "c"), "--input-file", str(bad)]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v2"])
def test_every_sub_expert_active_equals_the_model(arch, tiny_ckpt, tmp_path):
    """prism=True with k_active = N (all sub-experts, any partition) gives the model's own
    greedy tokens and, step by step, logits allclose, offloaded with a small cache and a
    pinned layer; k_active < N computes less (and a k_active past N is refused)."""
    import workbench
    from workbench.prism import refactor as R

    rt = workbench.Runtime(tiny_ckpt(arch), max_new_tokens=6, cache_slots=6, pinned_layers=1,
                           ignore_eos=True)
    R.save(R.random_refactoring(rt.lm, seed=3), tmp_path / "p")
    kw = dict(record=False)
    before = {n: p.detach().clone() for n, p in rt.lm.model.named_parameters()}
    base = rt.run("the quick brown fox", **kw)
    for shortcut in (False, True):  # the sub-expert path itself, and whole experts
        el = rt.run("the quick brown fox", prism=True, prism_refactoring=str(tmp_path / "p"),
                    prism_shortcut=shortcut, **kw)
        assert el.token_ids == base.token_ids
        # the sub-expert layout lives only while the run is installed: the model's own bytes
        for n, p in rt.lm.model.named_parameters():
            assert torch.equal(p, before[n]), n
        assert el.subexperts_ran == el.subexperts_asked > 0
    half = rt.run("the quick brown fox", prism=True, prism_refactoring=str(tmp_path / "p"),
                  prism_k_active=2, **kw)
    assert half.subexperts_ran * 2 == half.subexperts_asked
    with pytest.raises(InputError, match=r"prism_k_active must be in 1 … 4"):
        rt.run("x", record=False, prism=True, prism_refactoring=str(tmp_path / "p"),
               prism_k_active=5)


def test_elastic_logits_match_and_the_embedded_model_keeps_its_answers(embedded, tmp_path):
    """The embedded VL model: the layer outputs with every sub-expert active are allclose to
    the experts' own (hooked per layer), and the greedy answers of a mixed batch are equal."""
    import workbench
    from workbench.prism import refactor as R

    ref = R.refactor(embedded, R.calibration_requests(8), iterations=300, max_tokens=16)
    R.save(ref, tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=6)
    reqs = workbench.mixed_batch(4, text_share=0.5, seed=2)
    outs = {}

    def grab(name):
        def hook(module, args, out):
            outs.setdefault(name, []).append(out.detach().clone())
        return hook

    blk = embedded.layout.blocks[5]
    for name, kw in (("base", {}), ("prism", dict(prism=True, prism_shortcut=False,
                                                   prism_refactoring=str(tmp_path / "p")))):
        h = blk.block.register_forward_hook(grab(name))
        try:
            res = rt.run(reqs, record=False, **kw)
        finally:
            h.remove()
        outs[name + "_tokens"] = [r["token_ids"] for r in res.batch]
    assert outs["base_tokens"] == outs["prism_tokens"]
    for a, b in zip(outs["base"], outs["prism"]):
        a = a[0] if isinstance(a, tuple) else a
        b = b[0] if isinstance(b, tuple) else b
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    with pytest.raises(workbench.WorkbenchError, match="prism_offload=True with "
                                                       "balance='realb' is not built yet"):
        rt.run(reqs[:1], record=False, prism=True, balance="realb", ep_ranks=4,
               prism_offload=True, prism_refactoring=str(tmp_path / "p"))
    missing = tmp_path / "none"
    with pytest.raises(InputError, match="run `workbench refactor`"):
        rt.run(reqs[:1], record=False, prism=True, prism_refactoring=str(missing))


def test_realb_low_precision_on_sub_experts(embedded, tmp_path, monkeypatch):
    """ReaLB with MoE-Prism: an expert ReaLB puts in low precision runs its chosen sub-experts
    from its weights quantised in the model's own layout. With every sub-expert active, on the
    sub-expert path, the layer outputs and the answers equal ReaLB's on the unmodified model,
    with the same low-precision computations; at k_active 2/4 the store records them, and the
    modeled clock prices a low expert's sub-experts in its precision."""
    import workbench
    from workbench.prism import refactor as R
    from workbench.sim.costs import CostSpec, Prices
    from workbench.sim.profiles import get_profile, get_target_model

    R.save(R.random_refactoring(embedded, seed=21), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=5, ignore_eos=True)
    reqs = workbench.mixed_batch(4, text_share=0.5, seed=3)
    # the down projection's input unquantised (W4A16 there): a sub-expert's own down GEMM
    # would group its input by the sub-expert's neurons, not the expert's (below: W4A4)
    realb = dict(ep_ranks=4, balance="realb-m1", low_precision="nvfp4",
                 low_precision_down_input="native")
    prism = dict(prism=True, prism_refactoring=str(tmp_path / "p"))
    outs, res = {}, {}
    blk = embedded.layout.blocks[5]
    for name, kw in (("base", {}), ("prism", dict(prism, prism_shortcut=False)),
                     ("shortcut", prism), ("base4", dict(low_precision_down_input="quantised")),
                     ("prism4", dict(prism, prism_shortcut=False,
                                     low_precision_down_input="quantised")),
                     ("shortcut4", dict(prism, low_precision_down_input="quantised"))):
        h = blk.block.register_forward_hook(
            lambda m, a, o, name=name: outs.setdefault(name, []).append(
                (o[0] if isinstance(o, tuple) else o).detach().clone()))
        try:
            res[name] = rt.run(reqs, record=False, **{**realb, **kw})
        finally:
            h.remove()
    assert res["base"].low_precision_runs > 0
    for base, name in (("base", "prism"), ("base", "shortcut"), ("base4", "shortcut4")):
        assert res[name].low_precision_runs == res[base].low_precision_runs
        assert [r["token_ids"] for r in res[name].batch] == [r["token_ids"]
                                                            for r in res[base].batch]
        for a, b in zip(outs[base], outs[name]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    # W4A4 on the sub-expert path: each sub-expert's down GEMM quantises its own input
    assert res["prism4"].low_precision_runs > 0
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(outs["prism"], outs["prism4"]))
    half = rt.run(reqs, store=tmp_path / "h.zarr", prism_k_active=2, **realb, **prism)
    ds = workbench.open_run(half.store)
    assert half.low_precision_runs > 0 and bool(ds["low_precision"].any())
    assert ds.moe.compute_share() == pytest.approx(0.5)
    # a global K leaves routed experts idle: those run in no precision, and the store and the
    # count agree (pinned and offloaded layers alike)
    gk = rt.run(reqs, store=tmp_path / "g.zarr", prism_k=3, **realb, **prism)
    assert int(workbench.open_run(gk.store)["low_precision"].sum()) == gk.low_precision_runs > 0
    p = Prices(get_profile("b200"), CostSpec.from_target(get_target_model("qwen3-vl-30b-a3b")))
    per_sub = np.array([[8, 8, 0, 0], [8, 8, 0, 0]])
    native, low = p.subexperts(per_sub), p.subexperts(per_sub, np.array([False, True]), "nvfp4")
    assert low[0] == native[0] and low[1] < native[1]
    # the clock alone (the quantiser the identity: the same routing and sub-experts either way)
    import workbench.precision as precision

    monkeypatch.setattr(precision, "fake_quant", lambda x, p="nvfp4", axis=None: x.clone())
    clock = dict(prism, prism_k_active=2, ep_ranks=4, profile="b200",
                 target_model="qwen3-vl-30b-a3b", record=False)
    fp4 = rt.run(reqs, balance="fp4-all", **clock)
    nat = rt.run(reqs, **clock)
    assert [r["token_ids"] for r in fp4.batch] == [r["token_ids"] for r in nat.batch]
    assert fp4.latency_modeled_s < nat.latency_modeled_s  # B200 has FP4 tensor cores


def test_the_sub_expert_layout_slices_without_copy_and_round_trips():
    """Sub-expert s of expert e in the layout is its neurons' gate rows, up rows and down
    columns (as the refactoring's perm names them; the down columns transposed, one
    contiguous block), read as views; a whole expert's down bytes read as [I, H] are its
    down matrix transposed, neurons in sub-expert order; undone bit for bit."""
    from workbench.prism.execute import (from_subexpert_layout, model_form, subexpert_rows,
                                         subexpert_shapes, to_subexpert_layout)

    g = torch.Generator().manual_seed(0)
    E, I, H, N = 3, 8, 5, 4
    c = I // N
    gu, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    perm = torch.stack([torch.randperm(I, generator=g) for _ in range(E)])
    lgu, ldown = to_subexpert_layout(gu, down, perm, N)
    assert lgu.shape == gu.shape and ldown.shape == down.shape
    blocks = subexpert_rows({"gate_up_proj": lgu, "down_proj": ldown}, N)
    sub_gu, sub_down = blocks["gate_up_proj"], blocks["down_proj"]
    assert sub_gu.data_ptr() == lgu.data_ptr() and sub_down.data_ptr() == ldown.data_ptr()
    assert sub_down.is_contiguous() and sub_down.shape[1:] == subexpert_shapes(
        {"gate_up_proj": (2 * I, H), "down_proj": (H, I)}, N)["down_proj"]
    as_model = model_form(blocks)["down_proj"]  # [E·N, H, c], a view
    assert as_model.data_ptr() == ldown.data_ptr()
    for e in range(E):
        assert torch.equal(ldown.reshape(E, I, H)[e], down[e][:, perm[e]].T)
        for s in range(N):
            neurons = perm[e, s * c:(s + 1) * c]
            assert torch.equal(sub_gu[e * N + s], torch.cat([gu[e, neurons], gu[e, neurons + I]]))
            assert torch.equal(as_model[e * N + s], down[e][:, neurons])
    back = from_subexpert_layout(lgu, ldown, perm, N)
    assert torch.equal(back[0], gu) and torch.equal(back[1], down)


def _a_layer_call(embedded, layer: int, partition: int, seed: int, T: int, N: int):
    """MoE layer ``layer``'s experts in the sub-expert layout of a random partition (seed
    ``partition``, N sub-experts) and T random tokens, each routed to top-k distinct experts:
    ``(block, perm, gates, gate_up, down, x, top_k_index, generator)`` (the generator goes on
    for the test's own draws)."""
    from workbench.prism import refactor as R
    from workbench.prism.execute import to_subexpert_layout

    b, E = embedded.layout.blocks[layer], embedded.layout.num_experts
    ref = R.random_refactoring(embedded, subexperts=N, seed=partition)
    perm, gates = torch.as_tensor(ref.perm), torch.as_tensor(ref.gates)
    gu, down = to_subexpert_layout(b.experts.gate_up_proj.data, b.experts.down_proj.data,
                                   perm[b.index], N)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, gu.shape[2], generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:embedded.layout.top_k]
                       for _ in range(T)])
    return b, perm, gates, gu, down, x, idx, g


@pytest.mark.parametrize("k_active,global_k", [(4, None), (2, None), (1, None), (4, 5)])
@pytest.mark.parametrize("call", ["every routed expert", "some experts", "sub-expert blocks",
                                  "blocks in a pool"])
def test_the_fused_sub_expert_product_equals_the_models_forward_per_sub_expert(
        embedded, k_active, global_k, call):
    """The fused product (whole experts, one group each, the unchosen sub-experts zeroed)
    equals the model's own experts forward over the chosen sub-experts as experts of their
    own (:meth:`PrismView.run_subexperts`, the reference) allclose, for every k_active and a
    global K: on every routed expert at once, on some experts, and on sub-expert blocks
    (sub-expert offloading's slots: some sub-experts of an expert absent), compact or read
    from a pool at their rows (the executor's slot pool); both record the same sub-experts
    as run."""
    from workbench.prism.execute import PrismView, subexpert_rows
    from workbench.runtime.slots import ExpertsView

    T, k, E, N = 9, embedded.layout.top_k, embedded.layout.num_experts, 4
    b, perm, gates, gu, down, x, idx, g = _a_layer_call(embedded, 3, 1, 7, T, N)
    ex = b.experts
    idx[2, 1] = E  # a slot the dispatch dropped
    w = torch.rand(T, k, generator=g)
    routed = torch.unique(idx[idx < E])
    experts = routed if call == "every routed expert" else routed[::2]

    def view(kernel="fused"):
        v = PrismView(ExpertsView(ex, b.expert_params), perm, gates, b.index, N, k_active,
                      ex.act_fn, global_k, apply_gate=ex._apply_gate, kernel=kernel)
        v.capture_gates(gu, x.device)
        v.choose(x, idx, w, E)
        return v

    fused, per_sub = view(), view()
    blocks = subexpert_rows({"gate_up_proj": gu, "down_proj": down}, N)
    subs = [int(e) * N + s for e in experts for s in range(N)]
    if call == "sub-expert blocks":
        subs = list(dict.fromkeys(subs[1::3] + subs[::7]))  # some of each expert's, out of order
        out = fused.run_blocks({n: t[subs] for n, t in blocks.items()}, subs, E, x, idx, w)
    elif call == "blocks in a pool":  # rows of a shuffled pool with other blocks in it
        subs = list(dict.fromkeys(subs[1::3] + subs[::7]))
        order = torch.randperm(E * N, generator=g)
        pool = {n: t[order] for n, t in blocks.items()}
        rows = [int(r) for r in torch.argsort(order)[subs]]
        with pytest.raises(ValueError, match="one row per sub-expert"):
            fused.run_blocks(pool, subs, E, x, idx, w, rows=rows[:-1])
        out = fused.run_blocks(pool, subs, E, x, idx, w, rows=rows)
    else:
        at = experts.long()
        out = fused({"gate_up_proj": gu[at], "down_proj": down[at]}, experts.tolist(), E, x,
                    idx, w, all_routed=experts if call == "every routed expert" else None)
    ref_out = per_sub.run_subexperts({n: t[subs] for n, t in blocks.items()}, subs, E, x, idx, w)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    assert out.abs().sum() > 0
    ran = fused.take()
    assert np.array_equal(ran, per_sub.take())
    # prism_kernel="per-subexpert": the same entry points run the reference itself
    kernel = view("per-subexpert")
    if call == "sub-expert blocks":
        got = kernel.run_blocks({n: t[subs] for n, t in blocks.items()}, subs, E, x, idx, w)
    elif call == "blocks in a pool":
        got = kernel.run_blocks(pool, subs, E, x, idx, w, rows=rows)
    else:
        got = kernel({"gate_up_proj": gu[at], "down_proj": down[at]}, experts.tolist(), E, x,
                     idx, w, all_routed=experts if call == "every routed expert" else None)
    if call in ("sub-expert blocks", "blocks in a pool"):
        assert torch.equal(got, ref_out)  # the reference's own sums, bit for bit
    else:  # every sub-expert of the call's experts, the reference over this call's subs
        torch.testing.assert_close(got, ref_out, rtol=1e-5, atol=1e-6)
    assert np.array_equal(kernel.take(), ran)


@pytest.mark.parametrize("dense", [True, False], ids=["every-expert", "grouped-slots"])
def test_the_proxy_gates_scores_are_its_definition_per_slot(embedded, dense):
    """The proxy gate's score of a slot's sub-expert (one dense product over every expert's
    resident gate-neuron rows, or — past ``DENSE_MACS`` — one grouped product over the routed
    slots') is its definition computed slot by slot from the model's own weights: the mean
    over the sub-expert's r gate neurons of |act(x·gate)·(x·up)|; a slot routed nowhere scores
    as expert E − 1 (it runs nothing)."""
    from workbench.prism.execute import PrismView
    from workbench.runtime.slots import ExpertsView

    T, k, E, N = 11, embedded.layout.top_k, embedded.layout.num_experts, 4
    b, perm, gates, gu, _, x, idx, _ = _a_layer_call(embedded, 5, 2, 3, T, N)
    ex, I = b.experts, b.experts.gate_up_proj.shape[1] // 2
    idx[4, 0] = E  # dropped by the dispatch
    v = PrismView(ExpertsView(ex, b.expert_params), perm, gates, b.index, N, 1, ex.act_fn)
    v.capture_gates(gu, x.device)
    if not dense:
        v.DENSE_MACS = 0  # every call past the bound: the grouped product
    got = v._scores(x, idx, E)
    assert (v._dense_w is not None) == dense and (v._gu_w is not None) != dense
    W = ex.gate_up_proj.data  # the model's own [E, 2I, H]: gate rows, then up rows
    neurons = gates[b.index]  # [E, N, r] gate neurons of each sub-expert (original index)
    want = torch.empty(T, k, N)
    for t in range(T):
        for j in range(k):
            e = min(int(idx[t, j]), E - 1)
            for s in range(N):
                n = neurons[e, s].long()
                a = ex.act_fn(W[e, n] @ x[t]) * (W[e, I + n] @ x[t])
                want[t, j, s] = a.abs().mean()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert len(set(got.argmax(-1).reshape(-1).tolist())) > 1  # scores that choose
    assert v._scores(x[:0], idx[:0], E).shape == (0, k, N)  # a call with no tokens


def test_the_compiled_choice_is_the_tensor_choice(embedded):
    """The proxy gate's choice in one compiled pass (:func:`~workbench.prism.execute.
    _choose_loop`) is the tensor path's (score, ``topk``, the slots routed nowhere -1) bit for
    bit on random calls of every third layer, N 2 and 4, every k_active < N, by the dense
    product (a decode call) and the grouped one (a prefill call), in magnitudes from tiny to
    huge; where it cannot be — two equal scores in a
    slot (``topk`` breaks ties its own way), a NaN or infinite score, a near-subnormal sum,
    more than 2 gate neurons per sub-expert, another dtype — it says so (None) and the tensor
    path chooses. Its Python source gives what the compiled loop gives."""
    from workbench.prism.execute import PrismView, _choose_loop, _compiled
    from workbench.runtime.slots import ExpertsView

    E = embedded.layout.num_experts
    taken = 0
    for layer in range(0, embedded.layout.num_layers, 3):
        for N in (2, 4):
            b, perm, gates, gu, _, x, idx, g = _a_layer_call(embedded, layer, layer, layer, 8, N)
            idx[3, 1] = E  # routed nowhere
            ex = b.experts
            for ka, dense in ((a, d) for a in range(1, N) for d in (True, False)):
                v = PrismView(ExpertsView(ex, b.expert_params), perm, gates, b.index, N, ka,
                              ex.act_fn)
                v.capture_gates(gu, x.device)
                if not dense:  # past DENSE_MACS (a prefill call): the grouped product
                    v.DENSE_MACS = 0
                for scale in (1e-30, 0.1, 1.0, 8.0, 1e30):
                    want = v._choose_tensors(x * scale, idx, None, E)
                    got = v._choose_compiled(x * scale, idx, E)
                    if gates.shape[-1] > 2 or scale in (1e-30, 1e30):  # > 2 neurons a
                        assert got is None  # sub-expert; subnormal or infinite sums
                    elif got is not None:  # (large inputs saturate gates to 0: ties)
                        assert torch.equal(got, want), (layer, N, ka, scale)
                        taken += 1
                    else:
                        assert scale != 1.0, "typical inputs take the compiled path"
                nan = x.clone()
                nan[2, 0] = float("nan")
                assert v._choose_compiled(nan, idx, E) is None
                assert v._choose_compiled(x.double(), idx, E) is None
            # k_active = N: every sub-expert in order, built on the host, the tensor path's
            v = PrismView(ExpertsView(ex, b.expert_params), perm, gates, b.index, N, N,
                          ex.act_fn)
            got, want = v.choose(x, idx, None, E), v._choose_tensors(x, idx, None, E)
            assert torch.equal(got, want) and got.dtype == want.dtype
            assert (got[3, 1] == -1).all() and got[0, 0].tolist() == list(range(N))
    assert taken >= 30
    # ties: a slot whose scores tie takes the tensor path; the Python source is the loop
    rng = np.random.default_rng(0)
    for trial in range(300):
        S, N, r = int(rng.integers(0, 7)), int(rng.choice([2, 3, 4])), int(rng.choice([1, 2]))
        G = N * r
        act = rng.choice([-1.0, 0.0, 0.5, 2.0], (S, G)).astype(np.float32)  # ties are likely
        gu = rng.choice([-2.0, 0.0, 1.0, 3.0], (S, 2 * G)).astype(np.float32)
        ids = rng.integers(0, 5, S).astype(np.int64)  # 4: routed nowhere (E = 4)
        ka = int(rng.integers(1, N))
        outs = []
        dest = rng.permutation(S).astype(np.int64)  # row q is slot dest[q]
        for fn in (_choose_loop, _compiled(_choose_loop)):
            out = np.full((S, ka), 9, np.int64)
            outs.append((fn(act[dest], gu[dest], ids, dest, 4, N, ka, out), out))
        assert outs[0][0] == outs[1][0] and (not outs[0][0] or (outs[0][1] == outs[1][1]).all())
        if outs[0][0]:
            score = np.abs(act * gu[:, G:]).reshape(S, N, r).sum(-1) / np.float32(r)
            for q in range(S):
                if ids[q] >= 4:
                    assert (outs[0][1][q] == -1).all()
                else:
                    assert len(set(score[q].tolist())) == N  # strict: no tie let through
                    assert outs[0][1][q].tolist() == np.argsort(-score[q])[:ka].tolist()


def _f32_choice(x, w, ids, E, N, ka):
    """The float32 tensor path's scores and choice (``PrismView._choose_tensors`` on the
    dense product) of a call given as the bounded loop's arrays: ``(scores [T, k, N], chosen
    [T, k, ka])``."""
    T, k = ids.shape
    G2 = w.shape[1]
    G = G2 // 2
    prod = (torch.from_numpy(x) @ torch.from_numpy(w).reshape(-1, w.shape[2]).T).view(T, E, G2)
    gu = torch.gather(prod, 1, torch.from_numpy(ids).clamp(max=E - 1)[..., None].expand(
        T, k, G2))
    score = (torch.nn.functional.silu(gu[..., :G]) * gu[..., G:]).abs().unflatten(
        -1, (N, -1)).mean(-1)
    chosen = score.topk(ka, dim=-1).indices.masked_fill(
        torch.from_numpy(ids >= E)[..., None], -1)
    return score.double().numpy(), chosen.numpy()


def _bounded(x, w, ids, E, N, ka, fn=None):
    """The bounded loop on a call: ``(answered, chosen, scores, bounds)``."""
    from workbench.prism.execute import _bounded_loop, _compiled

    T, k = ids.shape
    out = np.full((T, k, ka), 9, np.int64)
    sc, bd = np.full((T, k, N), np.nan), np.full((T, k, N), np.nan)
    ok = (fn or _compiled(_bounded_loop))(x, w, np.linalg.norm(w.astype(np.float64), axis=-1),
                                          ids, E, N, ka, out, sc, bd)
    return ok, out, sc, bd


def test_the_bounded_choice_is_the_tensor_choice(embedded):
    """The proxy gate's choice from the routed experts' rows with error bounds
    (:func:`~workbench.prism.execute._bounded_loop`) is the float32 tensor path's bit for
    bit wherever it answers: on random calls of every fourth layer, N 2 and 4, every k_active
    < N, r 1 to 3 gate neurons a sub-expert, magnitudes from tiny to huge, and near ties (a
    sub-expert's rows those of another times 1 + ε, ε from one float32 ulp to 1e-2). Every
    float32 score lies inside its bound. It refuses (None) exact ties, NaN, subnormal
    inputs, another dtype or activation, a lower matmul precision (no error either), a
    trained gate and calls past DENSE_MACS; typical calls take it."""
    from workbench.prism.execute import PrismView
    from workbench.runtime.slots import ExpertsView

    E = embedded.layout.num_experts
    taken = refused_near = inside = 0
    for layer in range(0, embedded.layout.num_layers, 4):
        for N in (2, 4):
            b, perm, gates, gu, _, x, idx, g = _a_layer_call(embedded, layer, layer, layer, 8, N)
            idx[3, 1] = E  # routed nowhere
            ex = b.experts
            for r in (1, 2, 3):  # each sub-expert's first r neurons its gate
                gts = perm.reshape(*perm.shape[:2], N, -1)[..., :r].contiguous()
                for ka in range(1, N):
                    v = PrismView(ExpertsView(ex, b.expert_params), perm, gts, b.index, N,
                                  ka, ex.act_fn)
                    v.capture_gates(gu, x.device)
                    for scale in (1e-30, 1e-3, 1.0, 8.0, 1e30):
                        want = v._choose_tensors(x * scale, idx, None, E)
                        got = v._choose_bounded(x * scale, idx.numpy(), E)
                        if got is not None:
                            assert torch.equal(got, want), (layer, N, r, ka, scale)
                            taken += 1
                        else:  # (large inputs saturate gates to 0: ties)
                            assert scale != 1.0, (layer, N, r, ka, "typical inputs take it")
                    # every float32 score inside its bound (the routed slots')
                    w = v._gu_rows.numpy()
                    for scale in (1e-3, 1.0, 8.0):
                        xs = (x * scale).numpy()
                        ok, _, sc, bd = _bounded(xs, w, idx.numpy(), E, N, ka)
                        exact = v._scores(torch.from_numpy(xs), idx, E).double().numpy()
                        routed = idx.numpy() < E
                        assert np.isfinite(sc[routed]).all() and (bd[routed] > 0).all()
                        assert (np.abs(exact - sc)[routed] <= bd[routed]).all()
                        inside += int(routed.sum())
                    # near ties: sub-expert 1's rows are sub-expert 0's times (1 + ε)
                    rows = v._gu_rows.clone()
                    G = rows.shape[1] // 2
                    rr = G // N
                    for eps in (2 ** -23, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2):
                        near = rows.clone()
                        for half in (0, G):
                            near[:, half + rr:half + 2 * rr] = (
                                rows[:, half:half + rr] * (1 + eps))
                        v._gu_rows, v._gu_np, v._dense_w = near, None, None
                        for _ in range(3):
                            xs = torch.randn(x.shape, generator=g)
                            want = v._choose_tensors(xs, idx, None, E)
                            got = v._choose_bounded(xs, idx.numpy(), E)
                            if got is not None:
                                assert torch.equal(got, want), (layer, N, r, ka, eps)
                                taken += 1
                            elif eps <= 1e-6:
                                refused_near += 1
                    # an exact tie (sub-expert 1 = sub-expert 0) is never let through
                    same = rows.clone()
                    for half in (0, G):
                        same[:, half + rr:half + 2 * rr] = rows[:, half:half + rr]
                    v._gu_rows, v._gu_np, v._dense_w = same, None, None
                    assert v._choose_bounded(x, idx.numpy(), E) is None
                    v._gu_rows, v._gu_np, v._dense_w = rows, None, None
            # refused where the bounds are not known to hold, or a call is past DENSE_MACS
            v = PrismView(ExpertsView(ex, b.expert_params), perm, gates, b.index, N, 1,
                          ex.act_fn)
            v.capture_gates(gu, x.device)
            assert v._choose_bounded(x, idx.numpy(), E) is not None
            nan = x.clone()
            nan[2, 0] = float("nan")
            assert v._choose_bounded(nan, idx.numpy(), E) is None
            sub = x.clone()
            sub[2, 0] = 1e-40  # subnormal: read as 0 in flush-to-zero mode
            assert v._choose_bounded(sub, idx.numpy(), E) is None
            assert v._choose_bounded(x.double(), idx.numpy(), E) is None
            assert v._choose_bounded(x[:, :-1], idx.numpy(), E) is None
            bad = idx.clone()
            bad[1, 1] = -1
            assert v._choose_bounded(x, bad.numpy(), E) is None
            v.DENSE_MACS = 0
            assert v._choose_bounded(x, idx.numpy(), E) is None
            v.DENSE_MACS = PrismView.DENSE_MACS
            # (the settings are read when a view first chooses: a view lives one run)
            old = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("medium")
            try:
                v._gu_np = None
                assert v._choose_bounded(x, idx.numpy(), E) is None
            finally:
                torch.set_float32_matmul_precision(old)
            mm = torch.backends.mkldnn.matmul
            mm.fp32_precision = "bf16"  # the new API: the legacy getter would raise
            try:
                v._gu_np = None
                assert v._choose_bounded(x, idx.numpy(), E) is None
            finally:
                mm.fp32_precision = "none"
            v._gu_np = None
            assert v._choose_bounded(x, idx.numpy(), E) is not None
            for act in (torch.nn.GELU(), type("MySiLU", (torch.nn.SiLU,), {
                    "forward": lambda self, t: torch.nn.functional.silu(t) * 1.5})()):
                other = PrismView(ExpertsView(ex, b.expert_params), perm, gates, b.index, N, 1,
                                  act)
                other.capture_gates(gu, x.device)
                assert other._choose_bounded(x, idx.numpy(), E) is None
            rows = v._gu_rows.clone()
            rows[0, 0, 0] = 1e-40  # a subnormal weight
            v._gu_rows, v._gu_np = rows, None
            assert v._choose_bounded(x, idx.numpy(), E) is None
    assert taken >= 200 and refused_near >= 20 and inside >= 2000, (taken, refused_near,
                                                                    inside)


def test_the_bounded_choice_on_hostile_calls():
    """The bounded loop on synthetic calls built to break its bounds — r up to 40 terms of
    huge scores (the float32 sum overflows before the mean), values near float32's range
    and its smallest normal numbers, subnormal tokens under flush-to-zero, ties, rows
    routed nowhere — answers only with the float32 tensor path's choice, every float32
    score inside its bound; its Python source gives what the compiled loop gives."""
    from workbench.prism.execute import _bounded_loop

    rng = np.random.default_rng(7)
    answered = 0
    for trial in range(400):
        T, H = int(rng.integers(1, 5)), int(rng.choice([1, 3, 8, 64]))
        N, r = int(rng.choice([2, 3, 4])), int(rng.choice([1, 2, 5, 40]))
        E, ka = 5, int(rng.integers(1, N))
        kind = trial % 5
        w = rng.standard_normal((E, 2 * N * r, H)).astype(np.float32)
        x = rng.standard_normal((T, H)).astype(np.float32)
        if kind == 1:  # huge: products near float32's largest, sums past it
            w *= np.float32(10.0 ** rng.uniform(15, 19))
            x *= np.float32(10.0 ** rng.uniform(0, 2))
        elif kind == 2:  # tiny: products underflow
            x *= np.float32(10.0 ** rng.uniform(-30, -18))
        elif kind == 3:  # ties
            w[:, r:2 * r] = w[:, :r]
            w[:, N * r + r:N * r + 2 * r] = w[:, N * r:N * r + r]
        ids = rng.integers(0, E + 1, (T, 3)).astype(np.int64)  # E: routed nowhere
        with np.errstate(all="ignore"):
            scores, want = _f32_choice(x, w, ids, E, N, ka)
        with np.errstate(all="ignore"):
            outs = [_bounded(x, w, ids, E, N, ka, fn) for fn in (_bounded_loop, None)]
        assert outs[0][0] == outs[1][0]
        ok, got, sc, bd = outs[1]
        if ok:
            answered += 1
            assert (got == outs[0][1]).all() and (got == want).all(), trial
            routed = ids < E
            assert (np.abs(scores - sc)[routed] <= bd[routed]).all(), trial
    assert answered >= 100, answered
    # r = 40 terms just under the largest product allowed: the mean is in range, the
    # float32 sum before it overflows (both scores inf, topk's order its own): refused
    x = np.ones((1, 1), np.float32)
    w = np.empty((1, 160, 1), np.float32)  # N = 2, r = 40: gate rows, then up rows
    w[0, :40], w[0, 40:80] = 3e18, 3.146e18
    w[0, 80:120], w[0, 120:] = 3e18, 3.146e18
    with np.errstate(all="ignore"):
        scores, want = _f32_choice(x, w, np.zeros((1, 1), np.int64), 1, 2, 1)
    assert np.isinf(scores).all()
    assert not _bounded(x, w, np.zeros((1, 1), np.int64), 1, 2, 1)[0]
    # the float32 SiLU the bounds allow for: within _ACT_ERR (relative) or _ABS of SiLU
    from workbench.prism.execute import _ABS, _ACT_ERR

    v = np.concatenate([np.geomspace(1e-38, 3e38, 200_000), np.linspace(-120, 120, 200_001)])
    v = np.concatenate([v, -v]).astype(np.float32)
    f32 = torch.nn.functional.silu(torch.from_numpy(v)).double().numpy()
    v64 = v.astype(np.float64)
    with np.errstate(over="ignore"):
        f64 = v64 / (1 + np.exp(-v64))
    assert (np.abs(f32 - f64) <= _ACT_ERR * np.abs(f64) + _ABS).all()
    # subnormal tokens under flush-to-zero: refused (the float32 product reads them as 0)
    x = np.array([[1e-39, 0, 0, 0]], np.float32)
    w = np.zeros((1, 4, 4), np.float32)
    w[0, :, 0] = [1e30, 2e30, 1e30, 2e30]
    was = torch.set_flush_denormal(True)
    try:
        assert not _bounded(x, w, np.zeros((1, 1), np.int64), 1, 2, 1)[0]
    finally:
        torch.set_flush_denormal(False)
    assert was in (True, False)


def test_the_store_records_which_sub_experts_ran(embedded, tmp_path):
    """subexpert_tokens: each routed (token, expert) counts once per sub-expert it ran — k_active
    of N, the run's own tally — so ds.moe sees the compute done; without prism each expert is
    one sub-expert equal to routed_tokens."""
    import workbench
    from workbench.prism import refactor as R

    R.save(R.random_refactoring(embedded, seed=1), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=3)
    reqs = workbench.mixed_batch(2, text_share=0.5, seed=4)
    res = rt.run(reqs, prism=True, prism_refactoring=str(tmp_path / "p"), prism_k_active=3,
                 store=str(tmp_path / "on.zarr"))
    ds = workbench.open_run(tmp_path / "on.zarr")
    assert ds.sizes["subexpert"] == 4
    sub = ds.moe.subexpert_counts()
    assert int(sub.sum()) == res.subexperts_ran > 0
    np.testing.assert_array_equal(sub.sum("subexpert").values, 3 * ds.moe.expert_counts().values)
    assert ds.moe.compute_share() == pytest.approx(0.75)
    by = ds.moe.compute_share(by="modality")
    assert float(by.sel(modality="image")) == pytest.approx(0.75)
    # the proxy gate picks per token: sub-experts of one expert are not all run alike
    assert (sub.max("subexpert") > sub.min("subexpert")).any()
    # per token: each routed slot ran exactly k_active sub-experts, and they add up to the counts
    ran = ds.subexpert_ran.values
    ids = ds.topk_ids.values
    np.testing.assert_array_equal(ran.sum(-1), np.where(ids >= 0, 3, 0))
    tok, lay, slot, s = np.nonzero(ran)
    again = np.zeros(sub.shape, np.int64)
    np.add.at(again, (lay, ids[tok, lay, slot], s), 1)
    np.testing.assert_array_equal(again, sub.values)
    fig = ds.moe.subexpert_heatmap(normalize=True)
    z = np.asarray(fig.data[0].z, float)
    assert z.shape == (4, ds.sizes["expert"]) and np.nanmax(z) <= 1.0
    np.testing.assert_allclose(np.nansum(z, 0)[~np.isnan(z).all(0)], 3.0)
    with pytest.raises(InputError, match="layer must be"):
        ds.moe.subexpert_heatmap(layer=99)
    rt.run(reqs, store=str(tmp_path / "off.zarr"))
    off = workbench.open_run(tmp_path / "off.zarr")
    assert off.sizes["subexpert"] == 1 and off.moe.compute_share() == 1.0
    np.testing.assert_array_equal(off.moe.subexpert_counts().isel(subexpert=0).values,
                                  off.moe.expert_counts().values)


def test_the_modeled_clock_prices_the_sub_experts_a_run_ran(embedded, tmp_path):
    """An expert running sub-experts is one op of their FLOPs and of the bytes of the distinct
    ones read: with all of them it costs what the expert does (the modeled latency equals the
    unmodified run's exactly), with fewer it costs less — on a GPU profile of a real model."""
    import workbench
    from workbench.prism import refactor as R
    from workbench.sim.costs import CostSpec, Prices
    from workbench.sim.profiles import get_profile, get_target_model

    R.save(R.random_refactoring(embedded, seed=2), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=4, ignore_eos=True)
    reqs = workbench.mixed_batch(2, text_share=0.5, seed=6)
    # every layer resident: the price of compute alone (k_active changes the routing after)
    kw = dict(record=False, profile="h200", target_model="qwen3-vl-30b-a3b",
              pinned_layers=embedded.layout.num_layers)
    el = dict(prism=True, prism_refactoring=str(tmp_path / "p"))
    lat = {k: rt.run(reqs, **kw, **(el if k else {}),
                     **({"prism_k_active": k} if k else {})).latency_modeled_s
           for k in (None, 4, 2, 1)}
    assert lat[4] == lat[None]
    assert lat[None] > lat[2] > lat[1] > 0
    # the op of one expert: one kernel overhead, FLOPs of the runs, bytes of distinct parts
    prof, tm = get_profile("h200"), get_target_model("qwen3-vl-30b-a3b")
    p = Prices(prof, CostSpec.from_target(tm))
    c = p.cost
    got = p.subexperts(np.array([[3, 0, 1, 0], [2, 2, 2, 2]]))
    assert got[0] == pytest.approx(prof.compute_time(4 * c.expert_flops_per_token / 4,
                                                     2 * c.expert_bytes / 4))
    assert got[1] == pytest.approx(p.expert(2))


def test_sub_expert_prices_from_the_table_are_each_rows_own_price():
    """Prices.subexperts reads each row's (runs, parts) price from a table it grows as codes
    come (per N and precision): every row priced as subexpert_op of its own counts, whatever
    came before, with some rows low, and past the table's bound (priced per call)."""
    from workbench.sim.costs import CostSpec, Prices
    from workbench.sim.profiles import get_profile, get_target_model

    p = Prices(get_profile("h200"), CostSpec.from_target(get_target_model("qwen3-vl-30b-a3b")))
    rng = np.random.default_rng(0)
    for hi in (3, 40, 2000, 300, 30_000):  # grows, shrinks, grows past the bound (4·5 per run)
        t = rng.integers(0, hi, (17, 4))
        t[0] = 0  # a row that runs nothing
        low = rng.random(17) < 0.3
        got = p.subexperts(t, low, "nvfp4")
        want = [p.subexpert_op(int(r.sum()), int((r > 0).sum()), 4, "nvfp4" if lo else "native")
                for r, lo in zip(t, low)]
        assert got.tolist() == want
        assert p.subexperts(t).tolist() == [p.subexpert_op(int(r.sum()), int((r > 0).sum()), 4)
                                            for r in t]
    assert p.subexperts(np.zeros((0, 4), np.int64)).shape == (0,)


def test_a_calls_counts_are_their_definition_compiled_or_not():
    """The layer call's counts (:func:`workbench.prism.execute._count_loop`, compiled by numba
    for the live path) are their definitions in tensor operations: tokens per sub-expert a
    bincount of e·N + s over the routed slots' chosen sub-experts, each expert's code
    runs·(N + 1) + parts, the sub-expert ids e·N + s that run (-1 elsewhere), the routed
    slots (id < E) and the runs (chosen ≥ 0) — on random calls with slots routed nowhere
    (id E), padding, every width and empty calls; its Python source gives the same. So are
    sub-expert offloading's keys (:func:`~workbench.prism.execute._key_loop`): the nonzero
    sub-experts of the call's experts, their tokens and shares of their expert's op."""
    from workbench.prism.execute import _compiled, _count_loop, _key_loop

    rng = np.random.default_rng(0)
    for trial in range(200):
        T, k, E, N = int(rng.integers(0, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 9)), \
            int(rng.choice([1, 2, 4]))
        w = int(rng.integers(1, N + 1))
        ids = torch.as_tensor(rng.integers(0, E + 1, (T, k)))  # E: routed nowhere
        chosen = torch.as_tensor(rng.integers(-1, N, (T, k, w))).masked_fill(
            (ids >= E)[..., None], -1)
        keys = (ids[..., None] * N + chosen).masked_fill(chosen < 0, E * N).reshape(-1)
        want = torch.bincount(keys, minlength=E * N + 1)[:E * N].reshape(E, N).numpy()
        want_code = want.sum(1) * (N + 1) + (want > 0).sum(1)
        want_ids = (ids[..., None] * N + chosen).masked_fill(chosen < 0, -1).reshape(T, k * w)
        experts = np.flatnonzero(rng.random(E) < 0.6)  # ascending, some idle
        cost = rng.random(len(experts))
        rows = want[experts]
        e_at, s_at = np.nonzero(rows)
        want_keys = (experts[e_at] * N + s_at).tolist()
        want_share = cost[e_at] * rows[e_at, s_at] / rows.sum(1)[e_at]
        for fn, keys_fn in ((_count_loop, _key_loop),
                           (_compiled(_count_loop), _compiled(_key_loop))):
            per_sub, code = np.zeros((E, N), np.int64), np.empty(E, np.int64)
            sub_ids = np.empty((T, k * w), np.int64)
            routed, runs = fn(ids.numpy(), chosen.numpy(), E, per_sub, code, sub_ids)
            assert (per_sub == want).all() and (code == want_code).all()
            assert (sub_ids == want_ids.numpy()).all()
            assert (routed, runs) == (int((ids < E).sum()), int((chosen >= 0).sum()))
            cap = len(experts) * N
            got = np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap)
            m = keys_fn(per_sub, experts.astype(np.int64), cost, *got)
            assert got[0][:m].tolist() == want_keys
            assert got[1][:m].tolist() == rows[e_at, s_at].tolist()
            assert got[2][:m].tolist() == want_share.tolist()  # the same float operations
            assert keys_fn(per_sub, np.array([E], np.int64), cost[:1], *got) == -1  # no expert


def test_a_fused_calls_slots_are_the_tensor_paths_compiled_or_not(embedded):
    """The fused product's slots in one compiled pass on the host
    (:meth:`PrismView._plan_compiled`, :func:`~workbench.prism.execute._slots_loop`) are the
    tensor path's (:meth:`PrismView._plan_tensors`) bit for bit — the slots grouped by expert
    (a stable sort), the groups' ends, the mask of the sub-experts that run here and the
    record of what ran — on random calls: slots routed nowhere (id E), padding, the call's
    experts a list in any order, a sorted tensor of every routed expert (``all_routed``), or
    none, some sub-experts absent (``present``), every width, empty calls. Its Python source
    gives what the compiled loop gives. So do sub-expert offloading's blocks placed in whole
    experts (:func:`~workbench.prism.execute._place_loop`): the experts ascending, each row's
    block (the first block where a sub-expert is absent), which are present; an id outside
    the layer's sub-experts refused."""
    from workbench.prism import execute as X
    from workbench.prism import refactor as R
    from workbench.runtime.slots import ExpertsView

    b, E = embedded.layout.blocks[2], embedded.layout.num_experts
    ref = R.random_refactoring(embedded, subexperts=4, seed=1)
    rng = np.random.default_rng(0)
    compiled = 0
    for trial in range(300):
        N = 4
        T, k = int(rng.integers(0, 9)), int(rng.integers(1, 5))
        w = int(rng.integers(1, N + 1))
        v = X.PrismView(ExpertsView(b.experts, b.expert_params), torch.as_tensor(ref.perm),
                        torch.as_tensor(ref.gates), b.index, N, w, b.experts.act_fn)
        idx = torch.as_tensor(rng.integers(0, E + 1, (T, k)))  # E: routed nowhere
        chosen = torch.as_tensor(np.argsort(rng.random((T, k, N)), -1)[..., :w])
        chosen = chosen.masked_fill(torch.as_tensor(rng.random((T, k, w)) < 0.2), -1)
        chosen = chosen.masked_fill((idx >= E)[..., None], -1)
        routed = torch.unique(idx[idx < E])
        form = rng.integers(0, 3)
        if form == 0:  # every routed expert, as the offloader's all-hit call hands them
            experts, all_routed = routed, routed
        else:  # some experts (and idle ones), a list in any order, or run_blocks' array
            pool = rng.permutation(E)[:int(rng.integers(0, E + 1))]
            experts, all_routed = ([int(e) for e in pool] if form == 1
                                   else np.sort(pool).astype(np.int64)), None
        n = len(experts)
        present = (None if rng.random() < 0.5 or not n else  # (run_blocks: some expert)
                   torch.as_tensor(rng.random((n, N)) < 0.6))
        partial = bool(w < N or present is not None or rng.random() < 0.3)
        start = torch.as_tensor(rng.integers(-1, N, (T, k, w)), dtype=torch.int16)
        outs = []
        for plan in (v._plan_tensors, v._plan_compiled):
            v._chosen_call, v._ran_call = chosen.clone(), start.clone()
            got = plan(experts, E, idx, all_routed, present, partial)
            outs.append((got, v._ran_call))
        (rows, offs, mask), ran = outs[0]
        (rows2, offs2, mask2), ran2 = outs[1]
        assert torch.equal(rows, rows2) and torch.equal(offs, offs2), trial
        assert torch.equal(ran, ran2) and ran2.dtype == torch.int16
        assert (mask is None) == (mask2 is None) == (not partial)
        if partial:
            assert torch.equal(mask, mask2)
        compiled += 1
    assert compiled == 300
    # the Python source is the compiled loop (its own arrays)
    for trial in range(100):
        P, w, n, E2, N = (int(rng.integers(0, 12)), int(rng.integers(1, 5)),
                          int(rng.integers(0, 6)), 6, 4)
        args = (rng.integers(0, E2 + 1, P), rng.permutation(E2)[:n].astype(np.int64), E2,
                rng.integers(-1, N, (P, w)),
                rng.random((n, N)) < 0.5 if rng.random() < 0.5 else np.zeros((0, 0), bool))
        res = []
        for fn in (X._slots_loop, X._compiled(X._slots_loop)):
            out = (np.full((P, w), -1, np.int16), np.zeros(2 * n + 1, np.int64),
                   np.zeros(P, np.int64), np.zeros((P, N), np.float32))
            res.append((fn(*args, *out), out))
        assert res[0][0] == res[1][0]
        assert all((a == c).all() for a, c in zip(res[0][1], res[1][1]))
    # an id the arrays cannot index: -1, nothing written (the call then takes the tensors)
    for fn in (X._slots_loop, X._compiled(X._slots_loop)):
        out = (np.full((2, 1), -1, np.int16), np.zeros(5, np.int64), np.zeros(2, np.int64),
               np.zeros((2, 4), np.float32))
        ids, ch = np.array([0, 1]), np.array([[0], [1]])
        assert fn(ids, np.array([0, 7]), 6, ch, np.zeros((0, 0), bool), *out) == -1
        assert fn(ids, np.array([0, 1]), 6, np.array([[0], [4]]), np.zeros((0, 0), bool),
                  *out) == -1
        for bad in (-1, 7):  # a slot's id the position table cannot read
            assert fn(np.array([0, bad]), np.array([0, 1]), 6, ch, np.zeros((0, 0), bool),
                      *out) == -1
        assert (out[0] == -1).all() and not out[1].any() and not out[3].any()
    # the blocks placed in whole experts: the reference is the definition, slot by slot
    for trial in range(200):
        E2, N = int(rng.integers(1, 7)), int(rng.choice([1, 2, 4]))
        m = int(rng.integers(0, 9))
        subs = rng.integers(0, E2 * N, m)
        rows = rng.integers(0, 50, m)
        ex = sorted({int(x) // N for x in subs})
        src = [int(rows[0]) if m else 0] * (len(ex) * N)
        pres = [False] * (len(ex) * N)
        for x, r in zip(subs, rows):
            src[ex.index(x // N) * N + x % N], pres[ex.index(x // N) * N + x % N] = r, True
        for fn in (X._place_loop, X._compiled(X._place_loop)):
            got = np.empty(m, np.int64), np.empty(m * N, np.int64), np.empty(m * N, bool)
            nn = fn(subs, rows, N, E2, *got)
            assert got[0][:nn].tolist() == ex and got[1][:nn * N].tolist() == src
            assert got[2][:nn * N].tolist() == pres
            assert fn(np.array([E2 * N], np.int64), np.zeros(1, np.int64), N, E2, *got) == -1


def test_a_global_k_picks_each_tokens_best_sub_experts(embedded, tmp_path):
    """prism_k (the seed's K): each token runs its K best (token, sub-expert) pairs among its
    routed experts' — K = top-k × N is the model exactly, any K in between runs K per token,
    spread unevenly over its experts; K and k_active together, or a K past top-k × N, refused."""
    import workbench
    from workbench.prism import refactor as R

    R.save(R.random_refactoring(embedded, seed=4), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=4, ignore_eos=True)
    reqs = workbench.mixed_batch(2, text_share=0.5, seed=3)
    kw = dict(prism=True, prism_refactoring=str(tmp_path / "p"))
    top_k = embedded.layout.top_k
    base = rt.run(reqs, record=False)
    full = rt.run(reqs, record=False, prism_k=top_k * 4, **kw)
    assert [r["token_ids"] for r in full.batch] == [r["token_ids"] for r in base.batch]
    res = rt.run(reqs, prism_k=7, store=tmp_path / "k7.zarr", **kw)
    ds = workbench.open_run(tmp_path / "k7.zarr")
    ran = ds.subexpert_ran.values  # [token, layer, k, N]
    routed = (ds.topk_ids.values >= 0).any(-1)  # tokens each layer routed
    np.testing.assert_array_equal(ran.sum((-1, -2))[routed], 7)
    per_slot = ran.sum(-1)[ds.topk_ids.values >= 0]
    assert per_slot.min() < per_slot.max()  # not k_active per expert: where the scores are
    assert res.subexperts_ran == int(ran.sum())
    assert ds.moe.compute_share() == pytest.approx(7 / (top_k * 4))
    # an expert whose sub-experts all lost is not looked up, live or in replay (= live)
    idle = (ds.topk_ids.values >= 0) & ~ran.any(-1)
    assert idle.any()
    rep = workbench.replay_trace(ds)
    np.testing.assert_array_equal(rep.hits + rep.misses, ds.hits.values + ds.misses.values)
    np.testing.assert_allclose(rep.step_latency_s, ds.latency_modeled_s.values, rtol=1e-9)
    with pytest.raises(InputError, match="set one, not both"):
        rt.run(reqs[:1], record=False, prism_k=4, prism_k_active=2, **kw)
    with pytest.raises(InputError, match=rf"prism_k must be in 1 … {top_k * 4}"):
        rt.run(reqs[:1], record=False, prism_k=top_k * 4 + 1, **kw)


def test_the_random_control_differs_only_in_the_partition(embedded, tmp_path):
    """random_control: random partitions whose gate neurons follow the proxy gate's rule on
    the same activations — a valid refactoring (load checks it) of the same model and shape."""
    from workbench.prism import refactor as R

    ref = R.random_refactoring(embedded, seed=1)
    rnd = R.random_control(embedded, ref, R.calibration_requests(4))
    assert rnd.meta["control"] == "random" and rnd.perm.shape == ref.perm.shape
    assert not np.array_equal(rnd.perm, ref.perm)
    R.save(rnd, tmp_path / "r")
    back = R.load(tmp_path / "r", embedded)
    np.testing.assert_array_equal(back.gates, rnd.gates)


def test_a_runtime_reads_its_refactoring_again_only_when_the_files_change(embedded, tmp_path):
    """Every run with prism=True reads its refactoring twice (the knob check, then the
    set-up): the runtime keeps the one it loaded, read-only, until a file is rewritten or
    replaced; a broken replacement is refused, not served from what was kept. A run on the
    kept one runs as a run that read the files."""
    import workbench
    from workbench.errors import InputError
    from workbench.prism import refactor as R

    out = R.save(R.random_refactoring(embedded, seed=1), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=3)
    knobs = rt.knobs.set(prism=True, prism_refactoring=str(out), prism_k_active=2)
    first, k = rt.prism_refactoring(knobs)
    assert k == 2 and not first.perm.flags.writeable and not first.gates.flags.writeable
    assert rt.prism_refactoring(knobs)[0] is first
    kw = dict(record=False, prism=True, prism_refactoring=str(out), prism_k_active=2,
              prism_shortcut=False)
    a = rt.run("count from 1 to 3.", **kw)
    assert rt.prism_refactoring(knobs)[0] is first
    b = workbench.Runtime(embedded, max_new_tokens=3).run("count from 1 to 3.", **kw)
    assert a.token_ids == b.token_ids and a.subexperts_ran == b.subexperts_ran > 0
    other = R.random_refactoring(embedded, seed=2)
    R.save(other, out, overwrite=True)
    again = rt.prism_refactoring(knobs)[0]
    assert again is not first
    np.testing.assert_array_equal(again.perm, other.perm)
    (out / R.WEIGHTS).write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="prism.safetensors' is not a safetensors file"):
        rt.prism_refactoring(knobs)


def test_the_whole_expert_shortcut_records_what_the_sub_expert_path_does(embedded, tmp_path):
    """prism_shortcut (default): with every sub-expert active whole experts run over the
    unchanged layout — the same tokens, and a store equal to the sub-expert path's (which
    sub-experts ran, cache decisions, the modeled clock), offloaded with a small cache."""
    import workbench
    from workbench.prism import refactor as R

    R.save(R.random_refactoring(embedded, seed=5), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=4, ignore_eos=True)
    reqs = workbench.mixed_batch(2, text_share=0.5, seed=8)
    kw = dict(prism=True, prism_refactoring=str(tmp_path / "p"), cache_slots=48,
              pinned_layers=1, profile="h200", target_model="qwen3-vl-30b-a3b")
    sub = rt.run(reqs, store=tmp_path / "sub.zarr", prism_shortcut=False, **kw)
    whole = rt.run(reqs, store=tmp_path / "whole.zarr", **kw)
    assert [r["token_ids"] for r in whole.batch] == [r["token_ids"] for r in sub.batch]
    a, b = workbench.open_run(tmp_path / "sub.zarr"), workbench.open_run(tmp_path / "whole.zarr")
    for var in ("subexpert_ran", "subexpert_tokens", "hits", "misses", "evictions",
                "latency_modeled_s", "stall_modeled_s"):
        np.testing.assert_array_equal(a[var].values, b[var].values, err_msg=var)
    assert whole.subexperts_ran == whole.subexperts_asked == sub.subexperts_ran


def test_the_per_subexpert_kernel_runs_what_the_fused_one_does(embedded, tmp_path):
    """prism_kernel="per-subexpert" (only the chosen sub-experts' products) against the
    default fused kernel, live at k_active 2 and with sub-expert offloading: the same tokens
    and a store equal in what ran, the cache's decisions and the modeled clock (the kernel
    changes how the products are grouped, nothing the run decides); a value it does not
    know is refused, naming the knob and the values."""
    import workbench
    from workbench.errors import KnobError
    from workbench.prism import refactor as R

    R.save(R.random_refactoring(embedded, seed=5), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=4, ignore_eos=True)
    reqs = workbench.mixed_batch(2, text_share=0.5, seed=8)
    kw = dict(prism=True, prism_refactoring=str(tmp_path / "p"), cache_slots=48,
              pinned_layers=1, profile="h200", target_model="qwen3-vl-30b-a3b")
    for name, extra in (("k2", dict(prism_k_active=2)),
                        ("offload", dict(prism_offload=True, prism_shortcut=False,
                                         prism_k_active=3))):
        runs = {kernel: rt.run(reqs, store=tmp_path / f"{name}-{kernel}.zarr",
                               prism_kernel=kernel, **kw, **extra)
                for kernel in ("fused", "per-subexpert")}
        a, b = (workbench.open_run(tmp_path / f"{name}-{k}.zarr") for k in runs)
        assert json.loads(b.attrs["knob.prism_kernel"]) == "per-subexpert"  # stored
        assert (a.attrs["prism_kernel_run"], b.attrs["prism_kernel_run"]) == (
            "fused", "per-subexpert") == (runs["fused"].prism_kernel,
                                          runs["per-subexpert"].prism_kernel)
        assert ([r["token_ids"] for r in runs["fused"].batch]
                == [r["token_ids"] for r in runs["per-subexpert"].batch]), name
        for var in ("subexpert_ran", "subexpert_tokens", "hits", "misses", "evictions",
                    "latency_modeled_s", "stall_modeled_s"):
            np.testing.assert_array_equal(a[var].values, b[var].values, err_msg=f"{name} {var}")
        assert runs["fused"].subexperts_ran == runs["per-subexpert"].subexperts_ran
    with pytest.raises(KnobError, match="prism_kernel.*'grouped'.*fused, per-subexpert"):
        rt.run(reqs, prism_kernel="grouped", **kw)
    # ReaLB quantises each expert with its own scales: not with sub-expert groups
    with pytest.raises(KnobError, match="prism_kernel='per-subexpert' with balance='realb'"):
        rt.run(reqs, prism_kernel="per-subexpert", balance="realb", **kw)
    from workbench.prism.execute import KERNELS, PrismView
    from workbench.prism.knobs import KERNEL_CHOICES, PrismKnobs

    # one list of kernels; the knob adds auto, its default
    assert tuple(PrismKnobs.param.prism_kernel.objects) == KERNEL_CHOICES == ("auto", *KERNELS)
    assert PrismKnobs.param.prism_kernel.default == "auto" and KERNELS == ("fused",
                                                                          "per-subexpert")
    with pytest.raises(ValueError, match="kernel must be one of fused, per-subexpert, not "
                                         "'grouped'"):
        PrismView(None, torch.zeros(1, 1, 4), torch.zeros(1, 1, 2, 1, dtype=torch.long), 0, 2,
                  1, None, kernel="grouped")


def test_the_auto_kernel_runs_per_subexpert_only_where_it_skips_work_on_wide_experts(
        embedded, tmp_path, monkeypatch):
    """prism_kernel=auto (the default) is fused on the embedded model's 64-wide experts —
    its runs are today's, bit for bit — and per-subexpert from AUTO_PER_SUBEXPERT_WIDTH when
    sub-experts are skipped (k_active < N or a global K), never at k_active = N nor with
    ReaLB's low precision. Live: which kernel the layer calls ran follows the rule."""
    import workbench
    from workbench.prism import knobs as PK
    from workbench.prism import refactor as R
    from workbench.prism.execute import PrismView

    pick = dict(subexperts=4, k_active=2, global_k=None, top_k=4, device="cpu")
    assert PK.choose_kernel("auto", width=512, **pick) == "per-subexpert"
    assert PK.choose_kernel("auto", width=PK.AUTO_PER_SUBEXPERT_WIDTH, **pick) == \
        "per-subexpert"
    assert PK.choose_kernel("auto", width=PK.AUTO_PER_SUBEXPERT_WIDTH - 1, **pick) == "fused"
    every = dict(subexperts=4, k_active=4, top_k=4, device="cpu")
    assert PK.choose_kernel("auto", width=512, global_k=None, **every) == "fused"
    assert PK.choose_kernel("auto", width=512, global_k=6, **every) == "per-subexpert"
    assert PK.choose_kernel("auto", width=512, global_k=16, **every) == "fused"  # all of them
    assert PK.choose_kernel("auto", width=512, balance="realb", **pick) == "fused"
    assert PK.choose_kernel("auto", width=512, **{**pick, "device": "cuda"}) == "fused"
    for k in PK.KERNELS:  # a kernel named is the kernel run
        assert PK.choose_kernel(k, width=1, **pick) == k

    R.save(R.random_refactoring(embedded, seed=5), tmp_path / "p")
    rt = workbench.Runtime(embedded, max_new_tokens=3, ignore_eos=True)
    kw = dict(record=False, prism=True, prism_refactoring=str(tmp_path / "p"), cache_slots=48,
              pinned_layers=1, prism_k_active=2)
    calls = []
    real = PrismView.run_subexperts
    monkeypatch.setattr(PrismView, "run_subexperts",
                        lambda self, *a, **k: calls.append(self.kernel) or real(self, *a, **k))

    def ran(**extra):
        calls.clear()
        out = rt.run("the quick brown fox", **{**kw, **extra})
        return out.token_ids, len(calls)

    fused, n = ran(prism_kernel="fused")
    assert n == 0
    assert ran() == (fused, 0)  # auto on 64-wide experts: fused, the same run
    out = rt.run("the quick brown fox", **kw)
    assert out.prism_kernel == "fused"  # what ran, and what the summary says
    assert "by the fused kernel (prism_kernel=auto)" in out.summary()
    assert f"{out.subexperts_ran} of {out.subexperts_asked} (token, sub-expert)" in out.summary()
    shortcut = rt.run("the quick brown fox", **{**kw, "prism_k_active": None})
    assert shortcut.prism_kernel == "shortcut"  # whole experts: no sub-expert kernel
    assert "as whole experts (the shortcut)" in shortcut.summary()
    assert rt.run("the quick brown fox", max_new_tokens=1, record=False).prism_kernel is None
    monkeypatch.setattr(PK, "AUTO_PER_SUBEXPERT_WIDTH", 64)  # as if these were wide
    per_sub = ran(prism_kernel="per-subexpert")
    assert per_sub[1] > 0 and ran() == per_sub
    assert ran(prism_k_active=None, prism_shortcut=False)[1] == 0  # k_active = N: fused


def test_the_host_memory_figure_sees_a_memory_cgroups_limit(tmp_path, monkeypatch):
    """The layout budget's available memory is capped by the process's memory cgroups'
    headroom — its own cgroup (from /proc/self/cgroup) and each above it, the smallest, each
    limit − (usage − inactive file cache): a container's or a job's limit, which the host's
    MemAvailable does not see. v2 and v1; no limit ("max", v1's huge number, no files): None."""
    import workbench.runtime.device as D

    def files(folder, **content):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in content.items():
            (folder / name.replace("_", ".", 1)).write_text(text)

    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    v2 = tmp_path / "v2"
    assert D._cgroup_headroom(str(tmp_path / "none"), str(proc)) is None
    files(v2, memory_current="9\n")  # the mount's root: no limit file
    files(v2 / "job", memory_max="max\n", memory_current="1000\n")
    files(v2 / "job" / "step", memory_max="max\n", memory_current="1000\n")
    assert D._cgroup_headroom(str(v2), str(proc)) is None
    (v2 / "job" / "memory.max").write_text(f"{3 << 30}\n")  # the parent's limit binds
    assert D._cgroup_headroom(str(v2), str(proc)) == (3 << 30) - 1000
    (v2 / "job" / "memory.stat").write_text("anon 400\ninactive_file 600\n")
    assert D._cgroup_headroom(str(v2), str(proc)) == (3 << 30) - 400  # cache is reclaimable
    (v2 / "job" / "step" / "memory.max").write_text("2000\n")  # the smaller one
    assert D._cgroup_headroom(str(v2), str(proc)) == 1000
    proc.write_text("0::/elsewhere\n")  # not under this mount's view: its root
    assert D._cgroup_headroom(str(v2), str(proc)) is None

    proc.write_text("5:cpu,cpuacct:/x\n4:memory:/job\n")
    v1 = tmp_path / "v1"
    files(v1 / "memory", memory_limit_in_bytes="9223372036854771712\n",
          memory_usage_in_bytes="5\n")
    files(v1 / "memory" / "job", memory_limit_in_bytes="9223372036854771712\n",
          memory_usage_in_bytes="5\n")
    assert D._cgroup_headroom(str(v1), str(proc)) is None
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text("105\n")
    (v1 / "memory" / "job" / "memory.stat").write_text("cache 3\ntotal_inactive_file 2\n")
    assert D._cgroup_headroom(str(v1), str(proc)) == 102
    monkeypatch.setattr(D, "_cgroup_headroom", lambda: 1 << 20)  # a container: 1 MiB left
    assert D.host_available_bytes() == 1 << 20


def test_a_kept_layout_is_reused_and_never_stale(tiny_ckpt, tmp_path, monkeypatch):
    """The sub-expert layout is converted once per model and partition and kept between runs
    (host tensors, within the layout budget): a second run converts nothing and answers
    alike, and the model gets its own tensors back each time (same memory, same bits). A
    parameter written in place, another partition, or a budget of 0 converts again — and
    the answers follow the weights the model has. The budget is the
    ``prism_layout_cache_bytes`` option (None: the larger of LAYOUT_CACHE_BYTES and half the
    available host memory), checked when set."""
    import workbench
    from workbench.prism import execute as X
    from workbench.prism import refactor as R

    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), max_new_tokens=5, cache_slots=6,
                           pinned_layers=1, ignore_eos=True)
    for seed in (3, 4):
        R.save(R.random_refactoring(rt.lm, seed=seed), tmp_path / f"p{seed}")
    converted = []
    real = X.to_subexpert_layout
    monkeypatch.setattr(X, "to_subexpert_layout",
                        lambda *a: converted.append(1) or real(*a))
    blocks = rt.lm.layout.blocks
    ptrs = [b.experts.gate_up_proj.data_ptr() for b in blocks]
    before = {n: p.detach().clone() for n, p in rt.lm.model.named_parameters()}

    def run(p="p3", own_memory=True):
        converted.clear()
        out = rt.run("the quick brown fox", record=False, prism=True, prism_shortcut=False,
                     prism_k_active=2, prism_refactoring=str(tmp_path / p))
        if own_memory:  # a kept layout: the module's own tensors back, not a copy
            assert [b.experts.gate_up_proj.data_ptr() for b in blocks] == ptrs
        return out.token_ids, len(converted)

    first, n_first = run()
    assert n_first == len(blocks)
    again, n_again = run()
    assert (again, n_again) == (first, 0)
    for n, p in rt.lm.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert run("p4")[1] == len(blocks)  # another partition
    assert run("p4")[1] == 0
    with torch.no_grad():  # written in place: that layer is converted again, the rest kept
        blocks[2].experts.down_proj.mul_(-1)
    flipped, n = run("p4")
    assert n == 1
    plain = rt.run("the quick brown fox", record=False, prism=True, prism_shortcut=False,
                   prism_k_active=2, prism_refactoring=str(tmp_path / "p4"))
    assert plain.token_ids == flipped
    X._kept.clear()
    with torch.no_grad():
        blocks[2].experts.down_proj.mul_(-1)
    with workbench.set_options(prism_layout_cache_bytes=0):
        # converted and converted back (new tensors, the same bits), every run
        assert run(own_memory=False) == (first, len(blocks))
        assert run(own_memory=False)[1] == len(blocks)
    for n, p in rt.lm.model.named_parameters():
        assert torch.equal(p, before[n]), n
    # the default budget (the option None): the larger of LAYOUT_CACHE_BYTES and half the
    # host memory available
    import workbench.runtime.device as D

    assert X.layout_budget() >= max(X.LAYOUT_CACHE_BYTES, D.host_available_bytes() // 4)
    monkeypatch.setattr(D, "host_available_bytes", lambda: 10 << 30)
    assert X.layout_budget() == 5 << 30
    monkeypatch.setattr(X, "LAYOUT_CACHE_BYTES", 0)
    monkeypatch.setattr(D, "host_available_bytes", lambda: 0)
    X._kept.clear()
    assert run(own_memory=False)[1] == len(blocks)
    with workbench.set_options(prism_layout_cache_bytes=1 << 30):  # the option over it
        assert run(own_memory=False)[1] == len(blocks)
        assert run(own_memory=False)[1] == 0
    for bad in (-1, True, 1.5, "1GB"):
        with pytest.raises(ValueError, match="prism_layout_cache_bytes"):
            workbench.set_options(prism_layout_cache_bytes=bad)
