"""Share of Belady per eviction policy × cache size, prefill and decode apart (issue 40 §3).

A policy's *share of Belady* at a cache size is its hits over Belady's hits on the same trace
with the same settings (global pool, no pinned layers, no prefetch unless given): 1.0 is as good
as the offline optimum. Every trace is replayed **once** per (policy, size), from an empty
cache, in serving order; the hits of its prefill steps (``trace.phase`` 0) and of its decode
steps (phase 1) are then counted apart, so prefill + decode = the whole run and the decode
steps start with the cache the prefill left (as a server would). Replay hit counts are exact:
one replay is the measurement.

Policies are labelled by what they need (:attr:`EvictionPolicy.needs`):

- ``oracle``: needs the future (``belady``). Never part of "online": it is the denominator.
- ``predictor``: needs a recorded lookahead predictor (``slab``); on a trace without recorded
  predictions it would be LRU, so the study leaves it out unless asked for by name.
- ``online``: needs neither (past accesses and the layer being served only).

``tuned_on`` says which traces a policy's constants were chosen on; every row carries
``tuned`` so that a report keeps traces a policy was tuned on apart from those it was not
(the issue's rule). :func:`verdict` computes the issue's goal from the rows.

>>> df = share_study({"t": trace}, sizes=(0.1, 0.5))                     # doctest: +SKIP
>>> share_figure(df[(df.trace == "t") & (df.phase == "decode")])          # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from workbench.errors import InputError
from workbench.policies.eviction import EVICTION

__all__ = ["DEFAULT_SIZES", "ORACLE", "policy_kind", "online_policies", "concat_traces", "share_study",
           "share_table", "verdict", "share_figure"]

#: cache sizes, shares of the trace's (layer, expert) keys
DEFAULT_SIZES = (0.05, 0.10, 0.20, 0.30, 0.50)
#: the policy every share is taken against
ORACLE = "belady"
PHASES = ("all", "prefill", "decode")


def policy_kind(name: str) -> str:
    """``"oracle"`` (needs the future), ``"predictor"`` (needs a recorded predictor) or
    ``"online"``."""
    needs = EVICTION.get(name).needs
    if "future" in needs:
        return "oracle"
    if needs:
        return "predictor"
    return "online"


def online_policies() -> list[str]:
    """Every registered eviction policy that needs neither the future nor a predictor."""
    return [p for p in EVICTION.available() if policy_kind(p) == "online"]


def concat_traces(traces: Sequence[Any], name: str = "concat"):
    """One trace of ``traces`` served one after another (a stream of requests through one
    cache): steps renumbered in order, each source's requests after the previous one's; the
    routing, weights, modality and phases as recorded. Lookahead, predictor and sub-expert
    records are dropped (the study does not read them); kept tokens are kept. Same layers, experts and top-k."""
    from workbench.replay import as_trace
    from workbench.traces import Trace

    trs = [as_trace(t) for t in traces]
    if not trs:
        raise InputError("concat_traces needs at least one trace")
    shape = {(t.num_layers, t.num_experts, t.top_k) for t in trs}
    if len(shape) > 1:
        raise InputError(f"concat_traces needs one (layers, experts, top-k), not {sorted(shape)}")
    steps, reqs = np.cumsum([0] + [t.num_steps for t in trs]), 0
    req = []
    for t in trs:
        r = np.asarray(t.step_request, np.int64)
        req.append(r - r.min() + reqs)
        reqs = int(req[-1].max()) + 1
    return Trace(
        topk_ids=np.concatenate([t.topk_ids for t in trs]),
        token_step=np.concatenate([np.asarray(t.token_step, np.int64) + o
                                   for t, o in zip(trs, steps)]).astype(np.int32),
        num_experts=trs[0].num_experts,
        topk_weights=np.concatenate([t.topk_weights for t in trs]),
        token_modality=np.concatenate([t.token_modality for t in trs]),
        phase=np.concatenate([t.phase for t in trs]),
        step_request=np.concatenate(req).astype(np.int32),
        kept=np.concatenate([t.kept for t in trs]), pinned=trs[0].pinned, attrs={"source": name, "parts": len(trs)})


def _slots_for(trace, sizes: Sequence[float], extra_slots: Sequence[int]) -> list[tuple[int, float]]:
    keys = trace.num_layers * trace.num_experts
    out = {}
    for s in sizes:
        if not 0.0 < float(s) <= 1.0:
            raise InputError(f"cache sizes must be shares in (0, 1], not {s!r}")
        out.setdefault(max(trace.top_k, int(round(float(s) * keys))), float(s))
    for n in extra_slots:
        if trace.top_k <= int(n) <= keys:
            out.setdefault(int(n), int(n) / keys)
    return sorted(out.items())


def share_study(traces: Mapping[str, Any], policies: Iterable[str] | None = None,
                sizes: Sequence[float] = DEFAULT_SIZES, extra_slots: Sequence[int] = (),
                tuned_on: Mapping[str, Iterable[str]] | None = None, **knobs: Any
                ) -> pd.DataFrame:
    """One row per (trace, policy, cache size, phase): ``hits``, ``belady_hits``,
    ``accesses`` (cache lookups), ``share`` = hits / belady_hits (NaN where Belady has none),
    ``hit_rate``, ``kind`` (:func:`policy_kind`) and ``tuned`` (the trace is in the policy's
    ``tuned_on``). ``traces``: name → a Trace, a run Dataset or a path
    (:func:`workbench.replay.as_trace`). ``policies``: default :func:`online_policies`;
    Belady is always replayed and gets rows too (share 1). ``sizes``: shares of the trace's
    (layer, expert) keys, at least top-k slots; ``extra_slots``: absolute sizes added where a
    trace has room for them. ``knobs``: replay knobs (default a global pool, no pinned layers).
    Phases: ``all`` always, ``prefill`` / ``decode`` where the trace has such steps."""
    from workbench.replay import as_trace
    from workbench.replay.engine import replay

    pols = list(online_policies() if policies is None else policies)
    for p in pols:
        EVICTION.get(p)  # unknown name: the registry's error
    pols = [ORACLE] + [p for p in pols if p != ORACLE]
    tuned_on = {k: set(v) for k, v in (tuned_on or {}).items()}
    kw = dict(pinned_layers=0, prefetch="none")
    kw.update(knobs)
    scope = kw.pop("scope", "global")
    rows = []
    for name, src in traces.items():
        tr = as_trace(src)
        masks = {"all": np.ones(tr.num_steps, bool)}
        for code, ph in ((0, "prefill"), (1, "decode")):
            m = np.asarray(tr.phase) == code
            if m.any():
                masks[ph] = m
        for slots, size in _slots_for(tr, sizes, extra_slots):
            bel = None
            for p in pols:
                r = replay(tr, eviction=p, cache_slots=slots, scope=scope, hits_only=True, **kw)
                h = r.hits.astype(np.int64).sum(axis=1)
                n = h + r.misses.astype(np.int64).sum(axis=1)
                if p == ORACLE:
                    bel = h
                for ph, m in masks.items():
                    hits, b, acc = int(h[m].sum()), int(bel[m].sum()), int(n[m].sum())
                    rows.append(dict(
                        trace=name, policy=p, kind=policy_kind(p),
                        tuned=name in tuned_on.get(p, ()), slots=slots, size=size, phase=ph,
                        steps=int(m.sum()), accesses=acc, hits=hits, belady_hits=b,
                        hit_rate=hits / acc if acc else float("nan"),
                        share=hits / b if b else float("nan")))
    return pd.DataFrame(rows)


def share_table(df: pd.DataFrame, phase: str = "decode", kind: str | None = "online"
                ) -> pd.DataFrame:
    """Share of Belady as a (trace, size) × policy table for one phase; ``kind`` keeps one
    kind of policy (None: every one)."""
    d = df[df.phase == phase]
    if kind is not None:
        d = d[d.kind == kind]
    rows = pd.MultiIndex.from_tuples(list(dict.fromkeys(zip(d.trace, d.slots))),
                                     names=["trace", "slots"])
    t = d.set_index(["trace", "slots", "policy"])["share"].unstack("policy")
    return t.reindex(index=rows, columns=list(dict.fromkeys(d.policy)))


def verdict(df: pd.DataFrame, goal: float = 0.90, slots: Sequence[int] = (64, 128),
            phase: str = "decode", traces: Iterable[str] | None = None) -> dict:
    """The issue's goal, computed: does the best *online* policy reach ``goal`` of Belady's
    hits at every size in ``slots`` on every trace (``phase`` steps), and does it on the
    traces it was not tuned on? A policy's score is its worst share over the (trace, size)
    cells; the best policy is the one with the highest score. Returned for three sets of
    cells — ``all``, ``held_out`` (the policy was not tuned on the trace) and ``tuned`` —
    each with the best policy, its score, every policy's score and ``met``; ``met`` overall
    needs the goal on all cells, held-out ones included."""
    d = df[(df.phase == phase) & (df.kind == "online") & df.slots.isin(list(slots))
           & df.share.notna()]
    if traces is not None:
        d = d[d.trace.isin(list(traces))]
    out: dict[str, Any] = dict(goal=goal, slots=list(slots), phase=phase,
                               traces=sorted(set(d.trace)))
    for part, sel in (("all", d), ("held_out", d[~d.tuned]), ("tuned", d[d.tuned])):
        if sel.empty:
            out[part] = None
            continue
        score = sel.groupby("policy", sort=False).share.min()
        # a policy held out on only some traces is scored on those
        best = str(score.idxmax())
        out[part] = dict(best=best, score=float(score[best]), met=bool(score[best] >= goal),
                         cells=len(sel[sel.policy == best]),
                         scores={k: float(v) for k, v in score.items()})
    out["met"] = bool(out["all"] is not None and out["all"]["met"])
    return out


def foresight_study(traces: Mapping[str, Any], slots: Sequence[int] = (64, 128),
                    horizons: Sequence[int] = (0, 1, 8, 32, 64, 96, 128), phase: str = "decode",
                    **knobs: Any) -> pd.DataFrame:
    """How much of the future an eviction policy must see to get Belady's hits: one row per
    (trace, slots, horizon) with ``hits`` of the ``belady-horizon`` oracle (Belady that sees
    ``horizon`` layer turns ahead, LRU beyond), ``belady_hits``, ``share`` and ``tokens_ahead``
    = horizon / the trace's layers. Counted on the ``phase`` steps (``all``: every step). A
    horizon of 0 is LRU. An online policy knows at most the router lookahead (a layer or two
    of the current token) and statistics of the past, so the smallest horizon whose share
    reaches a goal is foresight no online policy has. ``knobs``: replay knobs (default a
    global pool, no pinned layers, no prefetch)."""
    from workbench.replay import as_trace
    from workbench.replay.engine import replay

    kw = dict(pinned_layers=0, prefetch="none")
    kw.update(knobs)
    rows = []
    for name, src in traces.items():
        tr = as_trace(src)
        m = (np.ones(tr.num_steps, bool) if phase == "all"
             else np.asarray(tr.phase) == {"prefill": 0, "decode": 1}[phase])
        for n in slots:
            def hits(**pol: Any) -> int:
                r = replay(tr, cache_slots=n, hits_only=True, **pol, **kw)
                return int(r.hits.astype(np.int64).sum(axis=1)[m].sum())
            bel = hits(eviction=ORACLE)
            for h in horizons:
                got = hits(eviction="belady-horizon", belady_horizon=int(h))
                rows.append(dict(trace=name, slots=int(n), horizon=int(h),
                                 tokens_ahead=int(h) / tr.num_layers, hits=got,
                                 belady_hits=bel, share=got / bel if bel else float("nan")))
    return pd.DataFrame(rows)


def foresight_needed(df: pd.DataFrame, goal: float = 0.90) -> pd.DataFrame:
    """Per (trace, slots) of :func:`foresight_study`: the smallest horizon studied whose share
    reaches ``goal`` (NaN: none did), in layer turns and in tokens."""
    out = []
    for (t, n), g in df.groupby(["trace", "slots"], sort=False):
        ok = g[g.share >= goal].sort_values("horizon")
        h = float(ok.horizon.iloc[0]) if len(ok) else float("nan")
        out.append(dict(trace=t, slots=n, horizon=h,
                        tokens_ahead=float(ok.tokens_ahead.iloc[0]) if len(ok) else float("nan"),
                        best_share=float(g.share.max())))
    return pd.DataFrame(out).set_index(["trace", "slots"])


def share_figure(df: pd.DataFrame, title: str = "share of Belady's hits vs cache size"):
    """Share of Belady against cache size (% of the trace's experts), one line per policy of
    ``df`` (rows of :func:`share_study` for one trace and phase), Belady the dashed ceiling at
    1. Drawn by the replay view's :func:`workbench.ui.replay.curves_figure`."""
    from workbench.ui.replay import curves_figure

    if df.empty:
        raise InputError("share_figure needs at least one row of share_study")
    if df.trace.nunique() > 1 or df.phase.nunique() > 1:
        raise InputError("share_figure draws one trace and one phase: select them first")
    c = pd.DataFrame({"eviction": df.policy, "cache_slots": df["size"] * 100,
                      "hit_rate": df.share, "belady_share": df.share,
                      "blocking_io_s": np.nan})
    fig = curves_figure(c, title)
    for t in fig.data:
        t.customdata = None
        t.hovertemplate = f"{t.name} · %{{x:.1f}} % of experts: %{{y:.3f}} of Belady<extra></extra>"
    top = float(np.nanmax(np.r_[c.hit_rate.to_numpy(float), 1.0]))
    fig.update_xaxes(title="cache size, % of the experts")
    fig.update_yaxes(title="share of Belady's hits", tickformat=".2f",
                     range=[min(0.0, float(np.nanmin(c.hit_rate))) - 0.02, top + 0.02])
    return fig
