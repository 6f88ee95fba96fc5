"""MoE-Prism's profiler and offline refactoring (issue 16 §1) on the real transformers experts."""

from __future__ import annotations

import json

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
    with pytest.raises(InputError, match="not a readable"):
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
