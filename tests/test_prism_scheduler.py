"""MoE-Prism's cost table C(m, b) and QoS-aware batch scheduler (issue 16 §2 cost model, §3)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from workbench.errors import InputError, KnobError
from workbench.prism import scheduler as S
from workbench.prism.costs import CostTable


def _table(**kw) -> CostTable:
    """N = 2, sizes 1, 2, 4: C(b, 1) = 1, 1.5, (2.0), 2.5 s; C(b, 2) = 2, 3, (4.5), 6 s;
    prefill 1 s (m = 1), 2 s (m = 2) for prompts of 10 tokens."""
    return CostTable(**{"decode_s": [[1.0, 1.5, 2.5], [2.0, 3.0, 6.0]],
                        "prefill_s": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], "sizes": (1, 2, 4),
                        "prompt_tokens": 10, "clock": "modeled", **kw})


def _run(policy, arrivals, kmin, batch_size, **knobs):
    n = len(arrivals)
    req = S.Requests.replay(arrivals, 2, kmin=kmin, prompt_tokens=[10] * n,
                            out_tokens=[2] * n)
    knobs = {"timeout_s": None, **knobs}
    return S.simulate(_table(), S.SchedulerKnobs(policy=policy, batch_size=batch_size,
                                                 **knobs), req)


def _launches(s):
    return [(float(t), int(m), int(b), S.TRIGGERS[g]) for t, m, b, g in
            zip(s.launch_s, s.launch_level, s.launch_batch, s.launch_trigger)]


def test_the_cost_table_interpolates_scales_and_refuses_what_it_does_not_hold():
    t = _table()
    assert t(1, 1) == 1.0 and t(3, 1) == 2.0 and t(3, 2) == 4.5 and t(4, 2) == 6.0
    assert t.prefill(2, 2) == 2.0 and t.prefill(2, 2, prompt_tokens=25) == 5.0
    dec, pre = t.grid(4)
    assert dec.shape == (2, 5) and dec[1, 3] == 4.5 and pre[0, 4] == 1.0
    with pytest.raises(KnobError, match=r"1 … 4 \(the largest in this modeled"):
        t(5, 1)
    with pytest.raises(KnobError, match=r"k_active must be a whole number in 1 … 2"):
        t(1, 3)
    with pytest.raises(KnobError, match="batch_size must be in 1 … 4"):
        S.simulate(t, S.SchedulerKnobs(batch_size=8, requests=10))
    # above 1 the smallest size's price is not extrapolated below it
    assert CostTable([[2.0, 3.0]], [[1.0, 1.0]], (2, 4), 1, "measured")(1, 1) == 2.0


def test_fifo_by_hand():
    """r0 (k_min 1) at 0 alone: m = 1, prefill 1 + one step of 1 → 2. r1 (k_min 2, 0.5)
    and r2 (k_min 1, 1.0) then together at the batch's highest k_min 2: 2 + 3 → 7."""
    s = _run("fifo", [0.0, 0.5, 1.0], [1, 2, 1], 3)
    assert _launches(s) == [(0.0, 1, 1, "free"), (2.0, 2, 2, "free")]
    np.testing.assert_allclose(s.first_token_s, [1, 4, 4])
    np.testing.assert_allclose(s.finish_s, [2, 7, 7])
    np.testing.assert_allclose(s.ttft_s, [1, 3.5, 3])
    np.testing.assert_allclose(s.tpot_s, [1, 3, 3])
    np.testing.assert_allclose(s.e2e_s, [2, 6.5, 6])
    # the original model: every batch at m = N
    full = _run("fifo", [0.0, 0.5, 1.0], [1, 2, 1], 3, baseline_level="full")
    np.testing.assert_allclose(full.finish_s, [4, 9, 9])


def test_fullbatch_by_hand():
    """Waits for 2: r0 + r1 at 0.5 (m = 2): 0.5 + 2 + 3 = 5.5; r2 after the last arrival
    alone (drain): 5.5 + 1 + 1 = 7.5."""
    s = _run("fullbatch", [0.0, 0.5, 1.0], [1, 2, 1], 2)
    assert _launches(s) == [(0.5, 2, 2, "batch-full"), (5.5, 1, 1, "drain")]
    np.testing.assert_allclose(s.finish_s, [5.5, 5.5, 7.5])
    np.testing.assert_allclose(s.ttft_s, [2.5, 2, 5.5])


def test_prism_by_hand_utility_and_timeout():
    """At 0 r0 alone: U_1 = 2 / (1 + 1) = 1 > U_2 = 2 / (2 + 2): m = 1 → 2. At 2 Q_1 = {r2},
    Q_2 = {r1, r2}: U_1 = 1 > U_2 = 4 / (2 + 3) = 0.8 → r2 at m = 1 (→ 4), then r1 at m = 2
    (→ 8). With T_max = 1 the oldest (r1, waited 1.5) times out: Q_2 launches as FIFO's."""
    s = _run("prism", [0.0, 0.5, 1.0], [1, 2, 1], 3)
    assert _launches(s) == [(0.0, 1, 1, "free"), (2.0, 1, 1, "free"), (4.0, 2, 1, "free")]
    np.testing.assert_allclose(s.finish_s, [2, 8, 4])
    assert s.level.tolist() == [1, 2, 1]
    t = _run("prism", [0.0, 0.5, 1.0], [1, 2, 1], 3, timeout_s=1.0)
    assert _launches(t) == [(0.0, 1, 1, "free"), (2.0, 2, 2, "timeout")]
    np.testing.assert_allclose(t.finish_s, [2, 7, 7])
    assert t.level.tolist() == [1, 2, 2] and t.metrics()["upgraded"] == pytest.approx(1 / 3)
    # waited 1.5 < 2: no timeout, the utility decides as without one; at 4 r1 has waited
    # 3.5 and is launched by the timeout (the only queue holding it: the same launch)
    assert _launches(_run("prism", [0.0, 0.5, 1.0], [1, 2, 1], 3, timeout_s=2.0)) == \
        [(0.0, 1, 1, "free"), (2.0, 1, 1, "free"), (4.0, 2, 1, "timeout")]


def test_prism_batch_full_trigger():
    """ra (k_min 1) runs 0 … 2; r0, r1 (k_min 2) and r2 (k_min 1) wait. At 2 with B = 2,
    Q_2's oldest two {r0, r1} are a full batch: launched although U_1 = 1 > U_2 = 0.8. With
    B = 4 nothing is full and the utility picks Q_1 = {r2} (U_2 = 6 / (2 + 4.5) < 1)."""
    arr, kmin = [0.0, 0.1, 0.2, 0.3], [1, 2, 2, 1]
    full = _run("prism", arr, kmin, 2)
    assert _launches(full) == [(0.0, 1, 1, "free"), (2.0, 2, 2, "batch-full"),
                               (7.0, 1, 1, "free")]
    np.testing.assert_allclose(full.finish_s, [2, 7, 7, 9])
    free = _run("prism", arr, kmin, 4)
    assert _launches(free) == [(0.0, 1, 1, "free"), (2.0, 1, 1, "free"),
                               (4.0, 2, 2, "free")]


@pytest.mark.parametrize("policy", S.available())
@pytest.mark.parametrize("level", S.BASELINE_LEVELS)
def test_every_request_is_served_once_at_or_above_its_floor(policy, level):
    N = 4
    t = CostTable.modeled("h200", "deepseek-vl2", subexperts=N, sizes=(1, 2, 4, 8))
    k = S.SchedulerKnobs(policy=policy, batch_size=8, requests=5000, rate=1500.0,
                         timeout_s=0.02, kmin_weights=[1, 2, 3, 4], baseline_level=level,
                         seed=7)
    s = S.simulate(t, k)
    r = s.requests
    assert np.isfinite(s.finish_s).all()
    assert s.launch_batch.sum() == len(r) and (s.launch_batch <= 8).all()
    assert (s.level >= r.kmin).all() and (s.level <= N).all()
    assert (s.start_s >= r.arrival_s).all() and (s.first_token_s > s.start_s).all()
    # the launches partition the requests: each one's members start at its time
    starts, counts = np.unique(s.start_s, return_counts=True)
    np.testing.assert_array_equal(starts, s.launch_s)
    np.testing.assert_array_equal(counts, s.launch_batch)
    # one batch at a time: the next launch after the previous batch's last step
    ends = np.array([s.finish_s[s.start_s == t0].max() for t0 in s.launch_s])
    assert (s.launch_s[1:] >= ends[:-1] - 1e-12).all()
    if policy != "prism":
        lv = np.array([r.kmin[s.start_s == t0].max() for t0 in s.launch_s])
        np.testing.assert_array_equal(s.launch_level, N if level == "full" else lv)
        # oldest first: launch order is arrival order
        assert (np.diff(s.start_s) >= 0).all()
    if policy == "fullbatch":
        assert (s.launch_batch[:-1] == 8).all()
    m = s.metrics()
    assert 0 < m["goodput_rps"] == m["throughput_rps"]  # no limit set: every request is good
    assert m["ttft_s"]["p50"] <= m["ttft_s"]["p99"] and m["e2e_s"]["p99"] >= m["ttft_s"]["p99"]


def test_poisson_rate_and_determinism_and_replay():
    k = S.SchedulerKnobs(rate=5.0, requests=40_000, seed=3)
    a = S.Requests.poisson(4, k)
    gaps = np.diff(np.concatenate([[0.0], a.arrival_s]))
    se = 0.2 / math.sqrt(len(gaps))
    assert abs(gaps.mean() - 0.2) < 4 * se
    assert abs((gaps > 0.2).mean() - math.exp(-1)) < 0.01  # exponential, not any spread
    assert abs(gaps.std() / gaps.mean() - 1) < 0.03
    counts = np.bincount(a.kmin, minlength=5)[1:] / len(a)
    np.testing.assert_allclose(counts, 0.25, atol=0.01)
    assert np.array_equal(S.Requests.poisson(4, k).arrival_s, a.arrival_s)
    assert not np.array_equal(S.Requests.poisson(4, k.copy(seed=4)).arrival_s, a.arrival_s)
    t = _table()
    s1, s2 = (S.simulate(t, S.SchedulerKnobs(requests=300, rate=0.3, seed=1,
                                                          batch_size=4)) for _ in "ab")
    np.testing.assert_array_equal(s1.finish_s, s2.finish_s)
    # replayed arrivals: an idle server launches each request when it arrives
    times = [0.0, 10.0, 10.0, 25.5, 40.0]
    s = S.simulate(t, S.SchedulerKnobs(policy="fifo", batch_size=4),
                   S.Requests.replay(times, 2, out_tokens=[2] * 5, prompt_tokens=[10] * 5,
                                     kmin=[1] * 5))
    np.testing.assert_array_equal(s.requests.arrival_s, times)
    assert _launches(s) == [(0.0, 1, 1, "free"), (10.0, 1, 2, "free"), (25.5, 1, 1, "free"),
                            (40.0, 1, 1, "free")]
    with pytest.raises(InputError, match="must not decrease"):
        S.Requests.replay([0.0, 2.0, 1.0], 2)
    with pytest.raises(InputError, match="finite number of seconds"):
        S.Requests.replay([0.0, float("nan")], 2)
    with pytest.raises(InputError, match=r"kmin of request 1 must be in 1 … 2, not 3"):
        S.Requests.replay([0.0, 1.0], 2, kmin=[1, 3])


def test_slo_goodput_and_the_best_rate_under_the_slo():
    s = _run("fifo", [0.0, 0.5, 1.0], [1, 2, 1], 3, ttft_slo_s=3.2, tpot_slo_s=2.5)
    # ttft 1, 3.5, 3; tpot 1, 3, 3: only r0 meets both
    assert s.good().tolist() == [True, False, False]
    m = s.metrics()
    assert m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["goodput_rps"] == pytest.approx(1 / 7) and m["throughput_rps"] == \
        pytest.approx(3 / 7)
    # the highest rate under the SLO: found between the grid's rates, and it holds there
    t = CostTable.modeled("h200", "deepseek-vl2", sizes=(1, 2, 4, 8))
    s_full = t.prefill(8, 4) + 47 * t(8, 4)
    k = S.SchedulerKnobs(policy="fifo", batch_size=8, requests=3000, out_tokens=32,
                         ttft_slo_s=s_full, e2e_slo_s=2 * s_full, seed=2)
    grid = [0.5 * 8 / s_full * f for f in (0.25, 0.5, 1, 2, 4)]
    best = S.max_rate_under_slo(t, k, grid)
    assert grid[0] <= best["rate"] < grid[-1] and not best["capped"]
    assert best["slo_attainment"] >= 0.9
    assert S.simulate(t, k.copy(rate=best["rate"])).metrics()["throughput_rps"] == \
        best["throughput_rps"]
    assert S.max_rate_under_slo(t, k.copy(ttft_slo_s=1e-6), grid) is None
    assert S.max_rate_under_slo(t, k.copy(ttft_slo_s=None, e2e_slo_s=None), grid)["capped"]


def test_scheduler_knobs_refuse_bad_values():
    with pytest.raises(KnobError, match="batch_size"):
        S.SchedulerKnobs(batch_size=0)
    with pytest.raises(KnobError, match="rate must be a finite number"):
        S.SchedulerKnobs(rate=float("nan"))
    with pytest.raises(KnobError, match="policy must be one of prism, fifo, fullbatch"):
        S.get("lifo")
    with pytest.raises(KnobError, match="not a scheduler knob"):
        S.SchedulerKnobs(batch=3)
    with pytest.raises(KnobError, match=r"kmin_weights must be 2 numbers"):
        S.simulate(_table(), S.SchedulerKnobs(requests=10, kmin_weights=[1, 1, 1]))


def test_modeled_costs_follow_the_profile():
    from workbench.sim.costs import CostSpec, Prices
    from workbench.sim.profiles import get_profile, get_target_model

    t = CostTable.modeled("h200", "deepseek-vl2", sizes=(1, 4, 64))
    ind = CostTable.modeled("h200", "deepseek-vl2", sizes=(1, 4, 64), sub_choice="independent")
    prof, tm = get_profile("h200"), get_target_model("deepseek-vl2")
    c = CostSpec.from_target(tm)
    for m in (1, 3):  # one token touches top_k experts, m/N of each
        want = tm.num_layers * (Prices(prof, c).dense(1) + prof.compute_time(
            tm.top_k * m / 4 * c.expert_flops_per_token, tm.top_k * m / 4 * c.expert_bytes))
        assert t(1, m) == pytest.approx(want) == ind(1, m)
    assert (np.diff(t.decode_s, axis=0) > 0).all() and (np.diff(t.decode_s, axis=1) > 0).all()
    assert (ind.decode_s[:3, 1:] > t.decode_s[:3, 1:]).all()
    np.testing.assert_allclose(ind.decode_s[3], t.decode_s[3])
    # the live clock's pricing: one op (one launch overhead) per touched expert
    per = CostTable.modeled("h200", "deepseek-vl2", sizes=(1, 4, 64), kernel="per_expert")
    assert per(1, 2) == pytest.approx(tm.num_layers * (Prices(prof, c).dense(1) + tm.top_k * (
        prof.compute_time(2 / 4 * c.expert_flops_per_token, 2 / 4 * c.expert_bytes))))
    assert (per.decode_s > t.decode_s).all()
    with pytest.raises(KnobError, match="kernel must be one of grouped, per_expert"):
        CostTable.modeled("h200", "deepseek-vl2", kernel="fused")
    assert t.meta["profile"] == "h200" and t.clock == "modeled"


def test_cost_table_save_load_round_trip_and_malformed_files(tmp_path):
    t = CostTable.modeled("a100-40gb", "qwen3-vl-30b-a3b", sizes=(1, 2, 8))
    p = t.save(tmp_path / "c.json")
    back = CostTable.load(p)
    np.testing.assert_array_equal(back.decode_s, t.decode_s)
    np.testing.assert_array_equal(back.prefill_s, t.prefill_s)
    assert back.sizes == t.sizes and back.meta == t.meta and back.clock == "modeled"
    with pytest.raises(InputError, match="already exists"):
        t.save(p)
    doc = json.loads(p.read_text())

    def refused(match, text=None, **change):
        bad = tmp_path / "bad.json"
        bad.write_text(text if text is not None else json.dumps({**doc, **change}))
        with pytest.raises(InputError, match=match) as e:
            CostTable.load(bad)
        assert "bad.json" in str(e.value)

    neg = [row[:] for row in doc["decode_s"]]
    neg[1][2] = -0.5
    refused(r"decode_s\[1\]\[2\] must be a finite number of seconds above 0, not -0.5",
            decode_s=neg)
    refused(r"NaN is not standard JSON", text=p.read_text().replace(
        str(doc["prefill_s"][0][0]), "NaN", 1))
    refused(r"decode_s must be 4 lists", decode_s=doc["decode_s"][:3])
    refused(r"prefill_s must be 4 lists \(subexperts\) of 3", prefill_s=[r[:2] for r in
                                                                        doc["prefill_s"]])
    refused("subexperts must be a whole number in 1 … 1024, not 1000000000",
            subexperts=10**9)
    refused("sizes must be strictly increasing", sizes=[1, 8, 2])
    refused(r"sizes\[2\] must be a whole number in 1 … 65536", sizes=[1, 2, 10**12])
    refused("sizes must be a list of 1 … 1024", sizes=list(range(1, 2000)))
    refused("cost table .* is not valid JSON", text="{not json")
    refused("nested deeper than 64", text="[" * 100 + "]" * 100)
    refused("is not a workbench-prism-costs/1 file", format="something else")
    refused("clock must be one of measured, modeled", clock="guessed")
    big = tmp_path / "big.json"
    big.write_text(" " * (17 << 20))
    with pytest.raises(InputError, match="cost table .* is too large"):
        CostTable.load(big)
    with pytest.raises(InputError, match="cost table .* does not exist"):
        CostTable.load(tmp_path / "missing.json")
    with pytest.raises(InputError, match="must be a finite number of seconds above 0"):
        CostTable([[1.0, float("inf")]], [[1.0, 1.0]], (1, 2), 1, "measured")


def test_measure_times_the_real_runtime(embedded, tmp_path):
    """A short real measurement: a 2-sub-expert refactoring of the embedded model, b ∈ {1, 2},
    one round of 3 tokens; every cell a positive measured time, the table saved and read."""
    import workbench
    from workbench.prism import refactor as R

    R.save(R.random_refactoring(embedded, subexperts=2), tmp_path / "p")
    rt = workbench.Runtime(embedded)
    t = CostTable.measure(rt, sizes=(1, 2), repeats=1, steps=3, native=False,
                          prism_refactoring=str(tmp_path / "p"))
    assert t.clock == "measured" and t.subexperts == 2 and t.sizes == (1, 2)
    assert (t.decode_s > 0).all() and (t.decode_s < 5).all() and (t.prefill_s > 0).all()
    assert t.meta["model_id"] == embedded.model_id and t.meta["steps"] == 3
    assert t.prompt_tokens > 1
    back = CostTable.load(t.save(tmp_path / "c.json"))
    np.testing.assert_array_equal(back.decode_s, t.decode_s)
    assert S.simulate(back, S.SchedulerKnobs(batch_size=2, requests=50, rate=5.0)
                      ).launch_batch.sum() == 50


def test_a_measured_serving_run_follows_the_scheduler(embedded, tmp_path):
    """The scheduler's own decision kernel drives the real runtime (issue 16 §3, a measured
    serving run): every request served once, at a level ≥ its k_min, in batches ≤ B, its
    times measured in order (arrival ≤ launch < first token ≤ last); with every request
    arrived at 0 and no timeout, the decisions depend on no clock, so the launches are the
    simulation's exactly. What serve sets itself is refused as a run knob."""
    import workbench
    from workbench.prism import refactor as R
    from workbench.prism import serving as V

    R.save(R.random_refactoring(embedded, subexperts=2), tmp_path / "p")
    rt = workbench.Runtime(embedded)
    lay = embedded.layout
    table = _table()
    n = 5
    req = S.Requests(np.zeros(n), np.array([1, 2, 1, 2, 2]), np.full(n, 10),
                     np.array([2, 3, 2, 2, 3]), subexperts=2)
    prompts = workbench.batch(n, mix="image")
    k = S.SchedulerKnobs(policy="prism", batch_size=2, timeout_s=None)
    run = dict(prism_refactoring=str(tmp_path / "p"), pinned_layers=0,
               cache_slots=lay.num_layers * lay.num_experts)
    sch = V.serve(rt, req, prompts, table, k, **run)
    assert np.isfinite(sch.finish_s).all() and sch.launch_batch.sum() == n
    assert (sch.level >= req.kmin).all() and (sch.batch <= 2).all()
    assert (sch.start_s >= req.arrival_s).all() and (sch.first_token_s > sch.start_s).all()
    assert (sch.finish_s >= sch.first_token_s).all()
    assert (sch.finish_s[req.out_tokens > 1] > sch.first_token_s[req.out_tokens > 1]).all()
    c = V.compare(sch, table)
    assert c["same_launches"], (sch.launch_level, S.simulate(table, k, req).launch_level)
    assert c["measured"]["requests"] == n and c["simulated_over_measured"]["throughput_rps"] > 0
    with pytest.raises(InputError, match="one prompt per request"):
        V.serve(rt, req, prompts[:3], table, k, **run)
    with pytest.raises(InputError, match="prism_k_active"):
        V.serve(rt, req, prompts, table, k, prism_k_active=1, **run)
