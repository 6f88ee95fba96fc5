"""A *measured* serving run driven by the QoS scheduler (issue 16 §3, "optionally drive the real
runtime from the same scheduler"): requests arrive in real time, the scheduler's own decision
kernel (:func:`workbench.prism.scheduler.choose_level`, the one the simulation runs) picks which
waiting requests to launch at which level m, and the runtime serves each batch —
``Runtime.run`` of those requests together, ``prism=True, prism_k_active=m`` — while the wall
clock stamps every token.

What is measured and what is decided:

- The **decisions** are priced by the cost table, as in the simulation: a policy must estimate
  what a batch will cost before it runs it (prism's utility, Σ tokens / C). Arrivals, k_min
  and token counts are the :class:`~workbench.prism.scheduler.Requests`' (replayed in real
  time from the start of the run).
- The **times** are measured: a request's ``start_s`` is its batch's launch, ``first_token_s``
  its first streamed token, ``finish_s`` the streamed token that completes its
  ``out_tokens`` (every request of a batch runs until the batch's longest, ``ignore_eos``, as
  in the simulation and the runtime). Seconds from the run's start.

The result is a :class:`~workbench.prism.scheduler.Schedule` like the simulation's, so the same
``metrics()`` / ``good()`` read it, and :func:`compare` puts the two side by side: how far the
simulation's predictions (same requests, same table, same policy) are from what the machine
did. One server, one batch at a time, in this process (the runtime is not re-entrant across
threads; a batch blocks the loop, which is what "the server is busy" means).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from workbench.errors import InputError
from workbench.prism.costs import CostTable
from workbench.prism.scheduler import (Requests, Schedule, SchedulerKnobs, choose_level, take_requests,
                                       level_queues, get, simulate)

__all__ = ["serve", "compare"]


def serve(rt: Any, requests: Requests, prompts: Sequence[Any], table: CostTable,
          knobs: SchedulerKnobs | None = None, *, sleep=time.sleep, **run_knobs: Any
          ) -> Schedule:
    """Serve ``requests`` in real time through ``rt`` (a :class:`~workbench.Runtime`):
    request i is ``prompts[i]`` (a :class:`workbench.Request`), arriving ``arrival_s[i]``
    seconds after the start, generating ``out_tokens[i]`` tokens at its batch's level.
    ``table`` prices the decisions (its levels 1 … N must be the refactoring's); ``knobs``
    the policy, batch size and timeout; ``run_knobs`` go to every ``rt.run`` (e.g.
    ``prism_refactoring``, ``cache_slots``). Returns the measured :class:`Schedule`."""
    k = knobs or SchedulerKnobs()
    N = table.subexperts
    n = len(requests)
    if requests.subexperts != N:
        raise InputError(f"the requests' k_min range is 1 … {requests.subexperts}, the cost "
                         f"table's levels 1 … {N}: they must agree")
    if len(prompts) != n:
        raise InputError(f"serve needs one prompt per request: {n} requests, "
                         f"{len(prompts)} prompts")
    from workbench.models.inputs import Request

    bad = [i for i, p in enumerate(prompts) if not isinstance(p, Request)]
    if bad:  # before the clock starts, not at request bad[0]'s batch
        raise InputError(f"prompt {bad[0]} must be a workbench Request (prompt + images), not "
                         f"{type(prompts[bad[0]]).__name__}")
    for name in ("prism", "prism_k_active", "prism_k", "max_new_tokens", "record",
                 "on_token", "ignore_eos"):
        if name in run_knobs:
            raise InputError(f"serve sets {name} itself (from the scheduler's decision); "
                             f"do not pass it")
    B = k.batch_size
    decode, prefill = table.grid(B)
    code = get(k.policy).code
    timeout = np.inf if k.timeout_s is None else float(k.timeout_s)
    arrival, kmin = requests.arrival_s, requests.kmin
    prompt, out = requests.prompt_tokens, requests.out_tokens
    lvl, off = level_queues(kmin, N)
    head, arrived = np.zeros(N, np.int64), np.zeros(N, np.int64)
    takes, take = np.zeros((N, N), np.int64), np.zeros(N, np.int64)
    ids = np.empty(B, np.int64)
    start, first, finish = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    level, bsize = np.zeros(n, np.int64), np.zeros(n, np.int64)
    launches: list[tuple[float, int, int, int]] = []
    nxt = served = 0
    t0 = time.perf_counter()
    while served < n:
        now = time.perf_counter() - t0
        if nxt < n and served == nxt and arrival[nxt] > now:  # idle until the next arrival
            sleep(arrival[nxt] - now)
            now = max(time.perf_counter() - t0, float(arrival[nxt]))
        while nxt < n and arrival[nxt] <= now:
            arrived[kmin[nxt] - 1] += 1
            nxt += 1
        m, trig = choose_level(code, now, nxt == n, N, B, timeout, k.baseline_level == "full",
                          head, arrived, lvl, off, arrival, prompt, out, decode, prefill,
                          float(table.prompt_tokens), takes, take)
        if m == 0:  # the policy waits for the next arrival
            sleep(max(0.0, arrival[nxt] - (time.perf_counter() - t0)))
            continue
        b = take_requests(take, head, lvl, off, N, ids)
        batch = ids[:b].copy()
        steps = int(out[batch].max())
        stamps: list[float] = []
        launched = time.perf_counter() - t0
        try:
            res = rt.run([prompts[i] for i in batch], record=False, prism=True,
                         prism_k_active=m, max_new_tokens=steps, ignore_eos=True,
                         on_token=lambda *_: stamps.append(time.perf_counter() - t0),
                         **run_knobs)
        except InputError as e:  # name the served requests, not positions in the batch
            raise InputError(f"serving requests {batch.tolist()} at level {m}: {e}") from None
        if len(stamps) != steps:
            raise RuntimeError(f"a served batch streamed {len(stamps)} steps, not {steps} "
                               f"(stopped or failed: {getattr(res, 'status', '?')})")
        for i in batch:
            start[i], first[i], finish[i] = launched, stamps[0], stamps[out[i] - 1]
            level[i], bsize[i] = m, b
        launches.append((launched, m, b, trig))
        served += b
    lt = np.array(launches, dtype=float).reshape(-1, 4)
    return Schedule(requests, k, start, first, finish, level, bsize, lt[:, 0],
                    lt[:, 1].astype(np.int64), lt[:, 2].astype(np.int64),
                    lt[:, 3].astype(np.int64), time.perf_counter() - t0)


def compare(measured: Schedule, table: CostTable) -> dict[str, Any]:
    """The simulation of the same requests, knobs and table beside a measured run: both
    ``metrics()`` and, per latency, the simulated P50/P99 over the measured (1.0: the
    simulation predicted the machine)."""
    sim = simulate(table, measured.knobs, measured.requests)
    a, b = measured.metrics(), sim.metrics()
    ratio = {}
    for lat in ("ttft_s", "tpot_s", "e2e_s"):
        for p in ("p50", "p99"):
            x, y = a[lat][p], b[lat][p]
            ratio[f"{lat} {p}"] = (y / x) if x and y is not None else None
    ratio["throughput_rps"] = b["throughput_rps"] / a["throughput_rps"]
    return {"measured": a, "simulated": b, "simulated_over_measured": ratio,
            "same_launches": bool(len(sim.launch_level) == len(measured.launch_level) and (
                sim.launch_level == measured.launch_level).all() and (
                sim.launch_batch == measured.launch_batch).all())}
