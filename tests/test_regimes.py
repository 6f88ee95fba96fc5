"""The regime map (issue 39 §4–5, ``workbench.analysis.regimes``): the ridge in tokens is where
the one clock's expert price stops being the weight read; a crossover exists where the busy
experts pass it and none below; the EP clock prices recorded routing on another profile."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from workbench.analysis import regimes as G
from workbench.errors import KnobError
from workbench.sim.costs import CostSpec, Prices
from workbench.sim.profiles import get_profile, get_target_model

STORE = Path(__file__).parent / "data" / "store_v3.zarr"


def _prices(profile: str) -> Prices:
    return Prices(get_profile(profile), CostSpec.from_target(get_target_model(G.TARGET)))


@pytest.mark.parametrize("profile", ["a100-40gb", "rtx-5090", "b200"])
def test_ridge_is_where_the_clock_stops_reading_weights(profile):
    p = _prices(profile)
    n = G.ridge_tokens(profile)
    floor = p.expert(0)  # overhead + the weight read
    assert p.expert(math.floor(n)) == pytest.approx(floor, rel=1e-12)
    assert p.expert(math.ceil(n) + 1) > floor * (1 + 1e-9)
    # NVFP4 on a GPU with FP4 moves the ridge (the FP4 rate, 4.5/16 of the bytes); without
    # FP4 (a100) it is the native one
    low = G.ridge_tokens(profile, precision="nvfp4")
    prof = get_profile(profile)
    if prof.supports("nvfp4"):
        assert low == pytest.approx(n * prof.fp4_flops / prof.device_flops * 4.5 / 16, rel=1e-9)
        q = p.expert_in("nvfp4")
        assert q(math.floor(low)) == pytest.approx(q(0), rel=1e-12) and \
            q(math.ceil(low) + 1) > q(0)
    else:
        assert low == n


def test_crossover_rules():
    assert G.crossover([8, 16, 32], [0.9, 0.95, 0.99]) is None
    assert G.crossover([8, 16, 32], [0.9, 1.2, 0.99]) is None  # not above 1 at the largest
    x = G.crossover([32, 8, 16], [1.2, 0.8, 1.2])  # order of the input does not matter
    assert x["batch"] == 16 and not x["at_smallest"]
    assert x["estimate"] == pytest.approx(2 ** (3 + 0.5))  # halfway in log2 from 8 to 16
    # a dip then a rise: the crossover is where it stays above
    assert G.crossover([8, 16, 32, 64], [1.1, 0.9, 1.05, 1.2])["batch"] == 32
    assert G.crossover([8, 16], [1.01, 1.1]) == {"batch": 8.0, "estimate": 8.0,
                                                 "at_smallest": True}


def _measured(profile: str, link: str, batches, busiest) -> dict:
    """A map input whose clocks are the real expert prices of one busiest expert per batch:
    vanilla runs it over ``busiest[B]`` tokens, a capacity method over half of them."""
    p = _prices(profile)
    cells = []
    for B, n in zip(batches, busiest):
        for name, tokens in (("vanilla", n), ("Token Drop γ0=0.5", n // 2)):
            c = p.expert(int(tokens))
            cells.append({"batch": B, "method": name, "n": 4, "correct": [True] * 4,
                          "accuracy": 1.0, "wall_s": 0.0,
                          "load": {"tokens": B * 50.0, "assignments": B * 200.0,
                                   "tokens_per_expert": n / 8, "busiest_expert": float(n),
                                   "tokens_per_rank": n / 2, "busiest_rank": float(tokens)},
                          "clock": {f"{profile}|{link}": {
                              "moe_layer_s": c, "dispatch_s": 0.0, "compute_s": c,
                              "combine_s": 0.0, "switch_s": 0.0}}})
    return {"target_model": G.TARGET, "ranks": G.RANKS, "realb_gate": G.REALB_GATE,
            "hardware": [[profile, link, "test"]], "cells": cells}


def test_crossover_where_experts_pass_the_ridge_and_none_below():
    batches = [8, 16, 32, 64, 128, 256]
    busiest = [4 * b for b in batches]  # 32 … 1024 tokens on the busiest expert
    ridge = G.ridge_tokens("a100-40gb")  # ≈ 368 tokens
    mp = G.regime_map(_measured("a100-40gb", "nvlink-a100", batches, busiest))
    (s,) = mp["series"]
    # the vanilla busiest expert passes the ridge at B = 128 (512 tokens): capping it then
    # shortens the slowest expert; below, the capped expert still reads all its weights
    first_above = next(b for b, n in zip(batches, busiest) if n > ridge)
    assert first_above == 128
    assert s["crossover"]["batch"] == first_above and s["reason"] is None
    for r in mp["rows"]:
        if r["busiest_expert"] <= ridge:
            assert r["speedup"] == pytest.approx(1.0)
        assert r["regime"] == ("compute-bound" if r["busiest_expert"] >= ridge
                               else "memory-bound")
    # the paper's point is marked on its hardware row (MACS: 8 × A100 over NVLink)
    assert s["paper_point"]["claim"].startswith("single MoE layer")
    # only the memory-bound batches: no crossover, and the computed reason says why
    mp = G.regime_map(_measured("a100-40gb", "nvlink-a100", batches[:4], busiest[:4]))
    (s,) = mp["series"]
    assert s["crossover"] is None
    assert s["reason"].startswith("memory-bound up to B = 64") and "256 tokens" in s["reason"]


def test_ep_times_prices_recorded_routing_on_another_profile():
    import workbench

    ds = workbench.open_run(STORE)
    own = ds.moe.ep_times(ranks=4)
    same = ds.moe.ep_times(ranks=4, profile=ds.moe._ep_knobs(4, None).profile)
    assert np.array_equal(own["moe_layer_s"].values, same["moe_layer_s"].values)
    fast = ds.moe.ep_times(ranks=4, profile="b200", interconnect="nvlink-b200")
    busy = own["compute_s"].values > 0
    assert busy.any() and (fast["compute_s"].values[busy] < own["compute_s"].values[busy]).all()
    assert np.array_equal(fast["load"].values, own["load"].values)  # the routing as recorded
    with pytest.raises(KnobError, match="profile 'h100x' is unknown"):
        ds.moe.ep_times(profile="h100x")
    with pytest.raises(KnobError, match="interconnect 'nvlink9'"):
        ds.moe.ep_times(interconnect="nvlink9")


def test_record_refuses_bad_input_in_one_line(tmp_path):
    from workbench.errors import InputError

    with pytest.raises(InputError, match="regime method 'MACS' is unknown; known: vanilla"):
        G.record(8, 8, ["MACS"], tmp_path)
    with pytest.raises(InputError, match="batch must be a whole number ≥ 1, not 0"):
        G.record(0, 8, ["vanilla"], tmp_path)
