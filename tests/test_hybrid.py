"""GPU–CPU hybrid mode (issue 5 §3, SPEC §1c "Modes"): a miss the rule picks runs on the host
copy of the expert instead of being loaded. It must not change the model's output, it has its
own timeline lane, and trace replay reproduces the live run."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import workbench
from workbench.errors import KnobError
from workbench.models.adapter import find_moe_blocks
from workbench.models.tiny import TINY_ARCHITECTURES, greedy_outputs, tiny_inputs, tiny_model
from workbench.policies.eviction import EVICTION
from workbench.sim.costs import CostSpec, host_expert_time, runs_on_host
from workbench.runtime.executor import StepProbe
from workbench.runtime.offload import Offloader
from workbench.sim.profiles import get_profile, get_target_model
from workbench.telemetry.events import LANES
from workbench.viz.heatmap import timeline_figure


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_host_runs_leave_the_output_unchanged(arch):
    """An arbitrary rule (odd token counts to the host) mixes host and device experts in
    every layer; greedy tokens equal, logits allclose, and a host run is never loaded."""
    model = tiny_model(arch)
    inputs = tiny_inputs(model, arch)
    ref_logits, ref_tokens = greedy_outputs(model, inputs)
    layout = find_moe_blocks(model)
    probe = StepProbe(time.perf_counter())

    def rule(n: int) -> bool:
        return n % 2 == 1

    with Offloader(layout, 3, 1, EVICTION.create("lru"), "cpu", probe, hybrid=rule) as off:
        logits, tokens = greedy_outputs(model, inputs)
        c = off.cache.counters()
    for le in probe.layers:
        assert set(le.host) <= set(le.misses)
        assert all(rule(le.expert_tokens[e]) for e in le.host)
    host_runs = sum(len(le.host) for le in probe.layers)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    assert torch.equal(tokens, ref_tokens), arch
    assert host_runs > 0
    assert c["loads"].sum() > 0  # even counts still went through the cache
    assert c["loads"].sum() == sum(len(le.misses) - len(le.host) for le in probe.layers)
    # the experts module has its slot pool back (no host view left behind)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, ref_logits)


def test_the_rule_sends_decode_misses_to_the_host_and_big_groups_to_the_device():
    """Qwen3-VL-30B-A3B on the A100 profile (modeled): one token is cheaper on the host than a
    17.3 MB copy; the crossover is where host compute outgrows transfer + device compute."""
    prof = get_profile("a100-40gb")
    cost = CostSpec.from_target(get_target_model("qwen3-vl-30b-a3b"))
    assert cost.activation_bytes_per_token == 2048 * 2
    assert runs_on_host(prof, cost, 1)
    assert not runs_on_host(prof, cost, 4096)
    decisions = [runs_on_host(prof, cost, n) for n in range(1, 4097)]
    crossover = decisions.index(False)
    assert all(decisions[:crossover]) and not any(decisions[crossover:])  # one threshold
    n = crossover + 1
    device = prof.transfer_time(cost.expert_bytes) + prof.compute_time(
        n * cost.expert_flops_per_token, cost.expert_bytes)
    assert host_expert_time(prof, cost, n) >= device > host_expert_time(prof, cost, n - 1) - 1e-3


@pytest.fixture(scope="module")
def hybrid_runs(embedded, demo_inputs, tmp_path_factory):
    image, prompt, _ = demo_inputs[1]
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=6, ignore_eos=True,
                           cache_slots=12, pinned_layers=1, target_model="qwen3-vl-30b-a3b")
    out = {}
    for hybrid in (False, True):
        path = tmp_path_factory.mktemp("hybrid") / f"h{int(hybrid)}.zarr"
        out[hybrid] = (rt.run(prompt, [image], store=path, hybrid=hybrid),
                       workbench.open_run(path))
    return out


def test_hybrid_run_answers_the_same_and_books_host_runs(hybrid_runs):
    (r0, d0), (r1, d1) = hybrid_runs[False], hybrid_runs[True]
    assert r1.token_ids == r0.token_ids
    assert r0.host_runs == 0 and int(d0["host_runs"].sum()) == 0
    assert r1.host_runs == int(d1["host_runs"].sum()) > 0
    assert d1.attrs["knob.hybrid"] in (True, "True", "true")
    # host runs are misses that were not loaded
    assert r1.misses == int(d1["misses"].values[:, 1:].sum())
    assert int(d1["loads"].sum()) == r1.loads == int(d1["misses"].sum() - d1["host_runs"].sum())
    assert r1.transfer_bytes_modeled == r1.loads * CostSpec.from_target(
        get_target_model("qwen3-vl-30b-a3b")).expert_bytes
    # the host lane: modeled spans per host run, measured spans of the real host compute
    lane = d1["span_lane"].values
    clock = d1["span_clock"].values
    host = LANES.index("host")
    assert int(((lane == host) & (clock == 1)).sum()) == r1.host_runs
    assert int(((lane == host) & (clock == 0)).sum()) == r1.host_runs
    assert not (d0["span_lane"].values == host).any()
    names = [t.name for t in timeline_figure(d1, "modeled").data]
    assert "host (modeled)" in names
    assert "host (modeled)" not in [t.name for t in timeline_figure(d0, "modeled").data]


def test_replay_reproduces_the_hybrid_run(hybrid_runs, assert_replays_live):
    _, ds = hybrid_runs[True]
    res = ds.moe.replay()
    assert res.config["hybrid"] is True and res.config["engine"] == "python"
    assert_replays_live(res, ds)
    m = res.metrics()
    assert m["host_runs"] == int(ds["host_runs"].sum())
    assert m["demand_loads"] == m["misses"] - m["host_runs"]
    # the same trace without hybrid loads every miss
    off = ds.moe.replay(hybrid=False)
    assert off.metrics()["host_runs"] == 0
    assert off.metrics()["demand_loads"] == off.metrics()["misses"]


def test_hybrid_has_no_compiled_replay(hybrid_runs):
    _, ds = hybrid_runs[True]
    with pytest.raises(KnobError, match="hybrid=True has no compiled replay"):
        ds.moe.replay(engine="fast")


def test_cli_sets_hybrid(tmp_path, demo_inputs):
    import json
    import subprocess
    import sys

    image, prompt, _ = demo_inputs[0]
    out = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", "--image", str(image), "--prompt", prompt,
         "--set", "hybrid=true", "--set", "max_new_tokens=2", "--set", "cache_slots=8",
         "--set", "target_model=qwen3-vl-30b-a3b", "--json", "--no-record"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["knobs"]["hybrid"] is True and res["host_runs"] > 0
    bad = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", "--image", str(image), "--prompt", prompt,
         "--set", "hybrid=maybe"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "hybrid" in bad.stderr
    assert np.isfinite(res["latency_modeled_s"])


def test_with_the_embedded_models_own_sizes_no_miss_goes_to_the_host(embedded):
    """Priced as itself (48 KiB experts), a copy is always cheaper than the two activation
    transfers a host run needs: hybrid mode changes nothing on the small model's own costs."""
    rt = workbench.Runtime(embedded, device="cpu")
    prof, cost = get_profile(rt.knobs.profile), rt.cost_spec()
    assert cost.source == "loaded model"
    assert not any(runs_on_host(prof, cost, n) for n in (1, 8, 64, 512))
