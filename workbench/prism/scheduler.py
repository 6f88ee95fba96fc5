"""MoE-Prism's QoS-aware batch scheduler (issue 16 §3, seed §5.1 and §6.1.2): a discrete-event
simulation of one server running batches of requests, each request with a quality floor
``k_min`` (1 … N sub-experts per routed expert), priced by a cost table C(m, b)
(:class:`~workbench.prism.costs.CostTable`).

The model of serving (where the seed is silent, our decisions):

- A request has an arrival time, ``k_min``, ``prompt_tokens`` and ``out_tokens`` (generated
  tokens, the first one by the prefill). Arrivals are Poisson at ``rate`` or replayed from an
  array (:meth:`Requests.poisson`, :meth:`Requests.replay`).
- **Static batches** (what the seed's FullBatch and "launch a batch" describe, and what the
  runtime's batched ``generate`` does): a launched batch of b requests at level m runs its
  prefill — ``table.prefill(b, m)`` scaled to the batch's longest prompt — then decode steps
  of ``C(b, m)`` each until its longest request is done (a finished request's row still runs,
  as in the runtime). Request i's first token comes at the end of the prefill (TTFT), its last
  ``out_tokens − 1`` steps later (TPOT = C(b, m)). One batch at a time: the server is busy
  until the batch's last step.
- **Policies** decide, whenever the server is free and a request waits (or a request arrives
  to a waiting policy), which requests to launch at which level m; requests are taken oldest
  first within the chosen set. Registered here (:func:`available`):

  - ``prism`` (seed §5.1): a virtual queue Q_m per level m, a request in every Q_m with
    m ≥ k_min; the candidate batch of Q_m is its oldest ``batch_size`` requests, its utility
    U_m = Σ out_tokens / (its service time at level m) — "the local throughput (tokens per
    second) if that batch were launched" (eq. 3 with C the batch's time). Triggers, in this
    order: **timeout** — the oldest waiting request has waited ≥ ``timeout_s``: launch the
    best queue that holds it (m ≥ its k_min) "irrespective of" the others' utility;
    **batch-full** — some |Q_m| ≥ ``batch_size``: launch the best full queue; otherwise the
    queue of highest utility. The server never idles while a request waits (as FIFO), so the
    triggers choose *which* queue, not *when*. Launched requests leave every queue (they are
    the heads of the per-k_min lists the queues are made of).
  - ``fifo`` (§6.1.2): every waiting request, oldest first, up to ``batch_size``, launched as
    soon as the server is free.
  - ``fullbatch`` (§6.1.2): waits until ``batch_size`` requests wait, then launches the oldest
    ``batch_size``; after the last arrival it launches what is left (else they never finish).

  Both baselines run "the highest K value requested within the batch" (§6.1.2) —
  ``baseline_level="batch_max"`` — or, with ``baseline_level="full"``, every batch at m = N
  (the original model, which has no sub-expert dial).

The simulation is one numba kernel (a single server needs no event heap: the next event is
the earlier of the next arrival and the end of the running batch); see the benchmark
``benchmarks/bench_prism_scheduler.py`` for its speed. Deterministic given ``seed``.
Units: seconds, requests, tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numba as nb
import numpy as np
import param

from workbench.errors import InputError, KnobError
from workbench.prism.costs import MAX_BATCH, CostTable

#: launch triggers recorded per batch (``Schedule.launch_trigger``)
TRIGGERS = ("free", "batch-full", "timeout", "drain")
BASELINE_LEVELS = ("batch_max", "full")
#: most requests one simulation may hold (arrays of ~ 80 bytes each)
MAX_REQUESTS = 50_000_000


@dataclass(frozen=True)
class Policy:
    """A registered scheduling policy: ``code`` selects its branch of the kernel's
    :func:`choose_level`; ``doc`` one line."""

    name: str
    code: int
    doc: str


_POLICIES: dict[str, Policy] = {}
#: branches of :func:`choose_level` (a new policy adds its branch there, then registers its code)
_CODES = 3


def register(name: str, code: int, doc: str) -> Policy:
    """Add policy ``name`` (its decision is branch ``code`` of :func:`choose_level`)."""
    if name in _POLICIES or any(p.code == code for p in _POLICIES.values()):
        raise ValueError(f"scheduler policy {name!r} or code {code} is already registered")
    if not 0 <= code < _CODES:
        raise ValueError(f"scheduler policy code must be a branch of choose_level (0 … "
                         f"{_CODES - 1}), not {code}")
    _POLICIES[name] = Policy(name, code, doc)
    return _POLICIES[name]


def available() -> list[str]:
    """Registered policy names, in registration order."""
    return list(_POLICIES)


def get(name: str) -> Policy:
    """The policy registered as ``name``; unknown names list the available ones."""
    try:
        return _POLICIES[name]
    except (KeyError, TypeError):
        raise KnobError(f"policy must be one of {', '.join(available())}, not "
                        f"{name!r}") from None


register("prism", 0, "virtual queue per level, highest utility; batch-full and timeout "
                     "triggers (seed §5.1)")
register("fifo", 1, "every waiting request, oldest first, up to batch_size, as soon as the "
                    "server is free (seed §6.1.2)")
register("fullbatch", 2, "waits for batch_size requests (seed §6.1.2); the rest after the "
                         "last arrival")


class SchedulerKnobs(param.Parameterized):
    """Knobs of a scheduler simulation (not of a run: nothing here changes what a model
    computes). Values are checked like run knobs (:func:`workbench.knobs.check_value`)."""

    policy = param.Selector(default="prism", objects=available(),
                            doc="Which scheduler launches batches (module docstring).")
    rate = param.Number(default=10.0, bounds=(0, 1e9), inclusive_bounds=(False, True),
                        softbounds=(0.1, 200.0),
                        doc="Poisson arrival rate, requests per second (ignored when "
                            "arrivals are replayed).")
    requests = param.Integer(default=20_000, bounds=(1, MAX_REQUESTS), softbounds=(100, 10**6),
                             doc="Requests simulated (Poisson arrivals).")
    batch_size = param.Integer(default=16, bounds=(1, MAX_BATCH), softbounds=(1, 256),
                               doc="B_max: most requests in one batch; at most the cost "
                                   "table's largest batch.")
    timeout_s = param.Number(default=1.0, allow_None=True, bounds=(0, 1e6),
                             doc="T_max (prism): a request waiting this long launches a queue "
                                 "that holds it; None: no timeout trigger. Seconds.")
    ttft_slo_s = param.Number(default=None, allow_None=True, bounds=(0, 1e6),
                              inclusive_bounds=(False, True),
                              doc="Time-to-first-token limit of a good request (goodput); "
                                  "None: no limit. Seconds.")
    tpot_slo_s = param.Number(default=None, allow_None=True, bounds=(0, 1e6),
                              inclusive_bounds=(False, True),
                              doc="Time-per-output-token limit (after the first token); None: "
                                  "no limit. Seconds.")
    e2e_slo_s = param.Number(default=None, allow_None=True, bounds=(0, 1e6),
                             inclusive_bounds=(False, True),
                             doc="End-to-end latency limit; None: no limit. Seconds.")
    slo_attainment = param.Number(default=0.9, bounds=(0, 1), inclusive_bounds=(False, True),
                                  doc="Share of requests that must meet every limit for a rate "
                                      "to count as served under the SLO (DistServe's 90 %).")
    kmin_weights = param.List(default=None, allow_None=True,
                              doc="Relative frequency of k_min = 1 … N (N numbers ≥ 0); None: "
                                  "uniform.")
    prompt_tokens = param.Integer(default=128, bounds=(1, 1 << 20),
                                  doc="Mean prompt tokens of a request.")
    out_tokens = param.Integer(default=64, bounds=(1, 1 << 20),
                               doc="Mean generated tokens of a request (the first by the "
                                   "prefill).")
    token_spread = param.Number(default=0.5, bounds=(0, 1), inclusive_bounds=(True, False),
                                doc="Token counts are uniform in mean·(1 ± spread), rounded, "
                                    "at least 1.")
    baseline_level = param.Selector(default="batch_max", objects=list(BASELINE_LEVELS),
                                    doc="Level of fifo / fullbatch batches: the batch's highest "
                                        "k_min (seed §6.1.2) or full (m = N: the original "
                                        "model).")
    seed = param.Integer(default=0, bounds=(0, 2**63 - 1),
                         doc="Seed of arrivals, k_min and token counts.")

    def __init__(self, **values: Any) -> None:
        super().__init__()
        self.param.policy.objects = available()  # policies registered after this class
        self.set(**values)

    def set(self, **values: Any) -> "SchedulerKnobs":
        """Set knobs, each checked (:class:`KnobError` naming the knob, value and range)."""
        from workbench.knobs import check_value

        for k, v in values.items():
            if k not in self.param or k == "name":
                raise KnobError(f"{k!r} is not a scheduler knob; knobs: "
                                f"{', '.join(n for n in self.param if n != 'name')}")
            setattr(self, k, check_value(self.param[k], k, v))
        return self

    def copy(self, **values: Any) -> "SchedulerKnobs":
        cur = {k: getattr(self, k) for k in self.param if k != "name"}
        return SchedulerKnobs(**{**cur, **values})

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.param if k != "name"}


# -- requests ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Requests:
    """The requests of one simulation, in arrival order: ``arrival_s`` float64 (non-decreasing,
    finite, ≥ 0), ``kmin`` int64 in 1 … ``subexperts``, ``prompt_tokens`` and ``out_tokens``
    int64 ≥ 1; all of one length ≥ 1."""

    arrival_s: np.ndarray
    kmin: np.ndarray
    prompt_tokens: np.ndarray
    out_tokens: np.ndarray
    subexperts: int

    def __post_init__(self) -> None:
        a = np.asarray(self.arrival_s)
        if a.ndim != 1 or not 1 <= len(a) <= MAX_REQUESTS or a.dtype.kind not in "iuf":
            raise InputError(f"arrival times must be a 1-D array of 1 … {MAX_REQUESTS} "
                             f"numbers, not {a.dtype} of shape {list(a.shape)}")
        a = a.astype(np.float64)
        if not np.isfinite(a).all() or (a < 0).any():
            i = int(np.flatnonzero(~np.isfinite(a) | (a < 0))[0])
            raise InputError(f"arrival time {i} must be a finite number of seconds ≥ 0, "
                             f"not {a[i]!r}")
        if (np.diff(a) < 0).any():
            i = int(np.flatnonzero(np.diff(a) < 0)[0])
            raise InputError(f"arrival times must not decrease: {a[i]!r} at {i} then "
                             f"{a[i + 1]!r}")
        N = self.subexperts
        out = {"arrival_s": a}
        for name, lo, hi in (("kmin", 1, N), ("prompt_tokens", 1, 1 << 30),
                             ("out_tokens", 1, 1 << 30)):
            v = np.asarray(getattr(self, name))
            if v.shape != a.shape or v.dtype.kind not in "iu":
                raise InputError(f"{name} must be {len(a)} whole numbers (one per request), "
                                 f"not {v.dtype} of shape {list(v.shape)}")
            bad = (v < lo) | (v > hi)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InputError(f"{name} of request {i} must be in {lo} … {hi}, not {v[i]}")
            out[name] = v.astype(np.int64)
        for k, v in out.items():
            v.flags.writeable = False
            object.__setattr__(self, k, v)

    def __len__(self) -> int:
        return len(self.arrival_s)

    @classmethod
    def replay(cls, arrival_s: Iterable[float], subexperts: int,
               knobs: SchedulerKnobs | None = None, kmin: Sequence[int] | None = None,
               prompt_tokens: Sequence[int] | None = None,
               out_tokens: Sequence[int] | None = None) -> "Requests":
        """Requests arriving at the recorded times ``arrival_s`` (sorted, seconds); ``kmin``
        and token counts given, or drawn from ``knobs`` (seeded)."""
        a = np.asarray(list(arrival_s) if not isinstance(arrival_s, np.ndarray)
                       else arrival_s)
        k = knobs or SchedulerKnobs()
        rng = np.random.default_rng(k.seed)
        n = len(a) if a.ndim == 1 else 0
        drawn = _draw(rng, n, subexperts, k)
        return cls(a, *(np.asarray(g) if g is not None else d for g, d in
                        zip((kmin, prompt_tokens, out_tokens), drawn)), subexperts=subexperts)

    @classmethod
    def poisson(cls, subexperts: int, knobs: SchedulerKnobs | None = None) -> "Requests":
        """``knobs.requests`` Poisson arrivals at ``knobs.rate`` per second from t = 0
        (exponential gaps), k_min and token counts drawn from the knobs (seeded)."""
        k = knobs or SchedulerKnobs()
        rng = np.random.default_rng(k.seed)
        a = np.cumsum(rng.exponential(1.0 / k.rate, k.requests))
        return cls(a, *_draw(rng, k.requests, subexperts, k), subexperts=subexperts)


def _draw(rng: np.random.Generator, n: int, N: int, k: SchedulerKnobs):
    w = np.ones(N) if k.kmin_weights is None else np.asarray(k.kmin_weights, dtype=float)
    if w.shape != (N,) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise KnobError(f"kmin_weights must be {N} numbers ≥ 0 (k_min = 1 … {N}) with a "
                        f"positive sum, not {k.kmin_weights!r}")
    kmin = rng.choice(np.arange(1, N + 1), size=n, p=w / w.sum())

    def tokens(mean: int) -> np.ndarray:
        lo = max(1, round(mean * (1 - k.token_spread)))
        hi = max(lo, round(mean * (1 + k.token_spread)))
        return rng.integers(lo, hi + 1, size=n)

    return kmin, tokens(k.prompt_tokens), tokens(k.out_tokens)


# -- the kernel -------------------------------------------------------------------------------
@nb.njit(cache=True)
def _oldest(upto, limit, head, arrived, lvl, off, take, prompt, out):
    """The ``limit`` oldest waiting requests of levels 0 … upto − 1 (a merge of the per-level
    lists by request index = arrival order): ``take[j]`` of level j. Returns (count, Σ out,
    max out, max prompt)."""
    take[:] = 0
    count, so, mo, mp = 0, 0, 0, 0
    while count < limit:
        best, bi = -1, 1 << 62
        for j in range(upto):
            p = head[j] + take[j]
            if p < arrived[j] and lvl[off[j] + p] < bi:
                best, bi = j, lvl[off[j] + p]
        if best < 0:
            break
        take[best] += 1
        count += 1
        so += out[bi]
        mo = max(mo, out[bi])
        mp = max(mp, prompt[bi])
    return count, so, mo, mp


@nb.njit(cache=True)
def choose_level(code, now, draining, N, B, timeout, full_level, head, arrived, lvl, off,
            arrival, prompt, out, decode, prefill, p_ref, takes, take):
    """Policy ``code``'s decision: (level m, trigger), ``take`` filled with the requests per
    k_min level; m = 0: wait for the next arrival."""
    if code == 0:  # prism
        oldest, oj = 1 << 62, -1
        for j in range(N):
            if head[j] < arrived[j] and lvl[off[j] + head[j]] < oldest:
                oldest, oj = lvl[off[j] + head[j]], j
        timed_out = now - arrival[oldest] >= timeout
        util = np.full(N, -1.0)
        anyfull = False
        for m in range(1, N + 1):
            b, so, mo, mp = _oldest(m, B, head, arrived, lvl, off, takes[m - 1], prompt, out)
            if b > 0:
                t = prefill[m - 1, b] * mp / p_ref + (mo - 1) * decode[m - 1, b]
                util[m - 1] = so / t
                anyfull = anyfull or b == B
        trig = 2 if timed_out else (1 if anyfull else 0)
        best, bu = 0, -1.0
        for m in range(1, N + 1):
            if util[m - 1] < 0 or (trig == 2 and m <= oj):
                continue
            if trig == 1 and takes[m - 1].sum() < B:
                continue
            if util[m - 1] >= bu:  # ties: the higher level (the same throughput, better)
                best, bu = m, util[m - 1]
        take[:] = takes[best - 1]
        return best, trig
    # fifo (1) and fullbatch (2)
    waiting = 0
    for j in range(N):
        waiting += arrived[j] - head[j]
    if code == 2 and waiting < B and not draining:
        return 0, 0
    b, so, mo, mp = _oldest(N, B, head, arrived, lvl, off, take, prompt, out)
    m = N
    if not full_level:
        while take[m - 1] == 0:
            m -= 1
    trig = 1 if b == B else (3 if code == 2 else 0)
    return m, trig


@nb.njit(cache=True)
def level_queues(kmin, N):
    """Per-level lists of request indices in arrival order, flat: level j's are
    ``lvl[off[j]:off[j + 1]]`` (Q_m is levels 0 … m − 1)."""
    n = kmin.shape[0]
    cnt = np.zeros(N, np.int64)
    for i in range(n):
        cnt[kmin[i] - 1] += 1
    off = np.zeros(N + 1, np.int64)
    for j in range(N):
        off[j + 1] = off[j] + cnt[j]
    lvl = np.empty(n, np.int64)
    fill = off[:N].copy()
    for i in range(n):
        lvl[fill[kmin[i] - 1]] = i
        fill[kmin[i] - 1] += 1
    return lvl, off


@nb.njit(cache=True)
def take_requests(take, head, lvl, off, N, ids):
    """The requests a decision takes (``take[j]`` oldest of level j) into ``ids``; they leave
    every queue (``head`` advances). Returns how many."""
    b = 0
    for j in range(N):
        for c in range(take[j]):
            ids[b] = lvl[off[j] + head[j] + c]
            b += 1
        head[j] += take[j]
    return b


@nb.njit(cache=True)
def _simulate(code, arrival, kmin, prompt, out, N, B, timeout, full_level, decode, prefill,
              p_ref, start, first, finish, level, bsize, l_t, l_m, l_b, l_trig):
    n = arrival.shape[0]
    lvl, off = level_queues(kmin, N)
    head = np.zeros(N, np.int64)  # served of each level
    arrived = np.zeros(N, np.int64)  # arrived of each level
    takes = np.zeros((N, N), np.int64)
    take = np.zeros(N, np.int64)
    ids = np.empty(B, np.int64)
    nxt, served, nl = 0, 0, 0
    now, free = 0.0, 0.0
    while served < n:
        if now < free:
            now = free
        if nxt < n and served == nxt and arrival[nxt] > now:  # idle: jump to the next arrival
            now = arrival[nxt]
        while nxt < n and arrival[nxt] <= now:
            arrived[kmin[nxt] - 1] += 1
            nxt += 1
        m, trig = choose_level(code, now, nxt == n, N, B, timeout, full_level, head, arrived, lvl,
                          off, arrival, prompt, out, decode, prefill, p_ref, takes, take)
        if m == 0:
            now = arrival[nxt]
            continue
        b = take_requests(take, head, lvl, off, N, ids)
        mo, mp = 0, 0
        for c in range(b):
            mo = max(mo, out[ids[c]])
            mp = max(mp, prompt[ids[c]])
        pre = prefill[m - 1, b] * mp / p_ref
        step = decode[m - 1, b]
        for c in range(b):
            i = ids[c]
            start[i] = now
            first[i] = now + pre
            finish[i] = now + pre + (out[i] - 1) * step
            level[i] = m
            bsize[i] = b
        l_t[nl], l_m[nl], l_b[nl], l_trig[nl] = now, m, b, trig
        nl += 1
        served += b
        free = now + pre + (mo - 1) * step
    return nl


# -- results ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    """What a simulation served: per request ``start_s`` (launch), ``first_token_s``,
    ``finish_s``, ``level`` (the m it ran at, ≥ its k_min) and ``batch`` (its batch's size);
    per launch ``launch_s``, ``launch_level``, ``launch_batch``, ``launch_trigger`` (index
    into :data:`TRIGGERS`)."""

    requests: Requests
    knobs: SchedulerKnobs
    start_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    level: np.ndarray
    batch: np.ndarray
    launch_s: np.ndarray
    launch_level: np.ndarray
    launch_batch: np.ndarray
    launch_trigger: np.ndarray
    elapsed_s: float = 0.0

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.requests.arrival_s

    @property
    def e2e_s(self) -> np.ndarray:
        return self.finish_s - self.requests.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        """Seconds per output token after the first (vLLM's TPOT); NaN for one-token
        requests."""
        n = self.requests.out_tokens - 1
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, (self.finish_s - self.first_token_s) / np.maximum(n, 1),
                            np.nan)

    def good(self) -> np.ndarray:
        """bool per request: meets every limit set (TTFT, TPOT, end-to-end) — vLLM's
        ``--goodput`` rule; a one-token request has no TPOT to fail."""
        k = self.knobs
        ok = np.ones(len(self.requests), bool)
        if k.ttft_slo_s is not None:
            ok &= self.ttft_s <= k.ttft_slo_s
        if k.tpot_slo_s is not None:
            ok &= ~(self.tpot_s > k.tpot_slo_s)
        if k.e2e_slo_s is not None:
            ok &= self.e2e_s <= k.e2e_slo_s
        return ok

    def metrics(self) -> dict[str, Any]:
        """Throughput (requests and generated tokens per second over the makespan: first
        arrival to last finish), goodput (requests meeting every limit per second), SLO
        attainment, P50/P99 of TTFT, TPOT and end-to-end latency (seconds), the levels served
        and the launches by trigger."""
        r = self.requests
        span = float(self.finish_s.max() - r.arrival_s.min())
        span = span if span > 0 else float("nan")
        good = self.good()
        tpot = self.tpot_s[np.isfinite(self.tpot_s)]

        def pct(a: np.ndarray) -> dict[str, float | None]:
            if not len(a):
                return {"p50": None, "p99": None}
            p50, p99 = np.percentile(a, [50, 99])
            return {"p50": float(p50), "p99": float(p99)}

        gap = float(r.arrival_s[-1] - r.arrival_s[0])
        return {
            "policy": self.knobs.policy, "requests": len(r),
            "offered_rps": (len(r) - 1) / gap if gap > 0 else None,
            "makespan_s": span,
            "throughput_rps": len(r) / span, "tokens_per_s": float(r.out_tokens.sum()) / span,
            "goodput_rps": float(good.sum()) / span, "slo_attainment": float(good.mean()),
            "ttft_s": pct(self.ttft_s), "tpot_s": pct(tpot), "e2e_s": pct(self.e2e_s),
            "mean_level": float(self.level.mean()),
            "upgraded": float((self.level > r.kmin).mean()),
            "mean_batch": float(self.launch_batch.mean()), "launches": len(self.launch_s),
            "launches_by": {t: int((self.launch_trigger == i).sum())
                            for i, t in enumerate(TRIGGERS)},
            "sim_s": self.elapsed_s,
        }


def simulate(table: CostTable, knobs: SchedulerKnobs | None = None,
             requests: Requests | None = None, **values: Any) -> Schedule:
    """Serve ``requests`` (default: Poisson arrivals from the knobs) under ``knobs.policy``
    priced by ``table``; ``values`` override knobs for this call."""
    import time

    k = (knobs or SchedulerKnobs()).copy(**values) if values else (knobs or SchedulerKnobs())
    N = table.subexperts
    req = requests if requests is not None else Requests.poisson(N, k)
    if req.subexperts != N:
        raise InputError(f"the requests' k_min range is 1 … {req.subexperts}, the cost "
                         f"table's levels 1 … {N}: they must agree")
    decode, prefill = table.grid(k.batch_size)
    n = len(req)
    start, first, finish = np.empty(n), np.empty(n), np.empty(n)
    level, bsize = np.empty(n, np.int64), np.empty(n, np.int64)
    l_t, l_m, l_b, l_trig = (np.empty(n), np.empty(n, np.int64), np.empty(n, np.int64),
                             np.empty(n, np.int64))
    t0 = time.perf_counter()
    nl = _simulate(get(k.policy).code, req.arrival_s, req.kmin, req.prompt_tokens,
                   req.out_tokens, N, k.batch_size,
                   math.inf if k.timeout_s is None else float(k.timeout_s),
                   k.baseline_level == "full", decode, prefill, float(table.prompt_tokens),
                   start, first, finish, level, bsize, l_t, l_m, l_b, l_trig)
    elapsed = time.perf_counter() - t0
    return Schedule(req, k, start, first, finish, level, bsize, l_t[:nl].copy(),
                    l_m[:nl].copy(), l_b[:nl].copy(), l_trig[:nl].copy(), elapsed)


def max_rate_under_slo(table: CostTable, knobs: SchedulerKnobs, rates: Sequence[float],
                       rel_tol: float = 0.005, grow: int = 4) -> dict[str, Any] | None:
    """The highest Poisson rate at which ``knobs.policy`` keeps at least
    ``knobs.slo_attainment`` of its requests within every limit (DistServe's "maximum rate
    under SLO attainment"), and what it serves there. ``rates`` (increasing) are tried first —
    attainment need not fall monotonically with the rate (FullBatch waits longest at low
    rates) — then, when the largest holds, up to ``grow`` doublings of it, then the gap above
    the highest rate that holds is bisected to ``rel_tol``. Every rate uses the same seed, so
    the arrivals of two rates are one draw scaled (common random numbers). None when no rate
    holds; ``"capped"`` True when even the last doubling holds."""
    rates = sorted(float(r) for r in rates)

    def at(rate: float) -> dict[str, Any]:
        return simulate(table, knobs.copy(rate=rate)).metrics()

    def holds(m: dict[str, Any]) -> bool:
        return m["slo_attainment"] >= knobs.slo_attainment

    tried = [(r, at(r)) for r in rates]
    ok = [i for i, (_, m) in enumerate(tried) if holds(m)]
    if not ok:
        return None
    lo, best = tried[ok[-1]]
    hi = tried[ok[-1] + 1][0] if ok[-1] + 1 < len(tried) else None
    for _ in range(grow if hi is None else 0):
        m = at(2 * lo)
        if not holds(m):
            hi = 2 * lo
            break
        lo, best = 2 * lo, m
    while hi is not None and hi - lo > rel_tol * lo:
        mid = 0.5 * (lo + hi)
        m = at(mid)
        if holds(m):
            lo, best = mid, m
        else:
            hi = mid
    return {"rate": lo, "throughput_rps": best["throughput_rps"],
            "goodput_rps": best["goodput_rps"], "slo_attainment": best["slo_attainment"],
            "capped": hi is None}


__all__ = ["SchedulerKnobs", "Requests", "Schedule", "Policy", "register", "available", "get",
           "simulate", "max_rate_under_slo", "TRIGGERS", "BASELINE_LEVELS"]
