"""The valid pinned-prefix interval of seed VisMMOE eq. (10) in the memory plans:
L_semantic ≤ pinned_layers ≤ ⌊(M_avail − C_safe) / S_layer⌋."""

import json
import math

import pytest

from workbench.cli import main
from workbench.errors import KnobError
from workbench.knobs import Knobs
from workbench.sim.plan import MemoryPlan

GiB = 2 ** 30


def _qwen_hi(device_gib: float, reserve_slots: int = 8) -> int:
    """eq. (10) by hand with Qwen3-VL-30B-A3B's paper numbers: backbone 4.1 GB, 128 experts of
    17.3 MB per MoE layer, 48 MoE layers, top-8."""
    m_avail = device_gib * GiB - 4.1e9
    c_safe = reserve_slots * 17.3e6
    return min(48, math.floor((m_avail - c_safe) / (128 * 17.3e6)))


@pytest.mark.parametrize("profile, device_gib, expected", [("a100-40gb", 40, 17),
                                                           ("rtx-3090", 24, 9)])
def test_modeled_interval_of_the_target_model_on_two_profiles(tiny_ckpt, profile, device_gib,
                                                                expected):
    import workbench

    assert _qwen_hi(device_gib) == expected
    rt = workbench.Runtime(tiny_ckpt(), target_model="qwen3-vl-30b-a3b", profile=profile)
    live, modeled = rt.plans()
    assert modeled.valid_interval == (0, expected)
    assert live.valid_interval[1] == 3 if not live.budget_bytes else live.valid_interval[1] <= 3
    # semantic_layers sets the lower end; cache_reserve_slots moves the upper one
    rt = workbench.Runtime(tiny_ckpt(), target_model="qwen3-vl-30b-a3b", profile=profile,
                           semantic_layers=1, cache_reserve_slots=300)
    assert rt.plans()[1].valid_interval == (1, _qwen_hi(device_gib, 300))
    d = rt.plans()[1].as_dict()
    assert d["valid_interval"] == [1, _qwen_hi(device_gib, 300)] and d["pinned_valid"]
    assert d["reserve_bytes"] == 300 * 17.3e6 and d["layer_bytes"] == 128 * 17.3e6


def test_semantic_floor_defaults_to_one_for_affinity_only():
    assert Knobs().semantic_floor() == 0
    assert Knobs(compression="random").semantic_floor() == 0
    assert Knobs(compression="saliency").semantic_floor() == 0
    assert Knobs(compression="affinity").semantic_floor() == 1
    assert Knobs(compression="affinity", lam=0.0).semantic_floor() == 0
    assert Knobs(compression="affinity", semantic_layers=0).semantic_floor() == 0
    assert Knobs(semantic_layers=3).semantic_floor() == 3
    assert Knobs().reserve_slots(8) == 8 and Knobs(cache_reserve_slots=2).reserve_slots(8) == 2


def _plan(**kw) -> MemoryPlan:
    base = dict(label="modeled plan (qwen3-vl-30b-a3b on a100-40gb)", num_layers=48,
                num_experts=128, pinned_layers=20, slots=8, expert_bytes=17.3e6,
                backbone_bytes=4.1e9, budget_bytes=40 * GiB, semantic_layers=1,
                reserve_slots=8)
    return MemoryPlan(**{**base, **kw})


def test_refusal_names_the_value_and_the_interval():
    with pytest.raises(KnobError) as e:
        _plan().check_pinned()
    msg = str(e.value)
    assert msg.startswith("pinned_layers must be within the valid interval [1, 17] for the "
                          "modeled plan (qwen3-vl-30b-a3b on a100-40gb)")
    assert msg.endswith("not 20") and "C_safe" in msg and "S_layer" in msg
    with pytest.raises(KnobError, match=r"interval \[1, 17\].*not 0"):
        _plan(pinned_layers=0).check_pinned()
    for ok in (1, 17):
        _plan(pinned_layers=ok).check_pinned()
    # unbounded device: up to every MoE layer; not even C_safe fits: empty
    assert _plan(budget_bytes=0).valid_interval == (1, 48)
    with pytest.raises(KnobError, match=r"\[1, -1\] is empty"):
        _plan(budget_bytes=4.2e9, pinned_layers=1).check_pinned()


def test_upper_end_agrees_with_the_fit_check():
    """With a cache of exactly C_safe, the interval's upper end is the fit check's bound."""
    for gib in (24, 40, 80):
        p = _plan(budget_bytes=gib * GiB)
        assert p.valid_interval[1] == p.max_pinned_layers()


def test_runtime_refuses_outside_the_interval(tiny_ckpt):
    import workbench

    with pytest.raises(KnobError, match=r"valid interval \[2, 3\] .*not 1"):
        workbench.Runtime(tiny_ckpt(), semantic_layers=2, pinned_layers=1)
    rt = workbench.Runtime(tiny_ckpt(), pinned_layers=1, cache_slots=3, max_new_tokens=1)
    with pytest.raises(KnobError, match=r"valid interval \[0, 0\] for the modeled plan "
                                        r"\(qwen3-vl-30b-a3b on rtx-3090\).*not 1"):
        rt.run("x", record=False, target_model="qwen3-vl-30b-a3b", profile="rtx-3090",
               cache_reserve_slots=1200)


def test_info_json_has_the_interval_and_cli_exits_2(tiny_ckpt, capsys):
    assert main(["info", "--model", str(tiny_ckpt()), "--json", "--set",
                 "target_model=qwen3-vl-30b-a3b", "--set", "profile=rtx-3090"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["modeled_plan"]["valid_interval"] == [0, 9]
    assert info["live_plan"]["valid_interval"][0] == 0
    assert main(["info", "--model", str(tiny_ckpt()), "--set", "semantic_layers=1"]) == 0
    assert "valid pinned prefix: [1, 3]" in capsys.readouterr().out
    rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--no-record",
               "--set", "semantic_layers=2", "--set", "pinned_layers=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("workbench: error: pinned_layers must be within the "
                                      "valid interval [2, 3]") and "not 1" in err
