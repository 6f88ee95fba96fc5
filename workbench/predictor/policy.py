"""The ``vismmoe`` prefetch policy, the live predictor hook and the predictor knobs.

Knobs (group ``predictor``): ``predictor`` (none | vismmoe), ``window`` (W = 5),
``decay`` (γ = 0.8), ``predictor_path`` (a ``workbench calibrate --out`` directory; None:
``<model dir>/workbench/predictor``). The existing ``prefetch_budget`` is B; for ``vismmoe``
None means **20** (the paper's B), not "unlimited".

Live: :class:`LivePredictor` is a :class:`~workbench.predictor.features.RoutingProbe` whose
``on_layer`` runs the predictor right after layer l's router (before the offloader asks the
prefetch policy, which happens inside the experts call), and keeps y_l's top-B experts with
their scores. :class:`VisMMoEPrefetch` reads them through :attr:`PrefetchContext.predicted`
when the caller provides it (trace replay of recorded predictions), else from the attached
live predictor — so the offloader needs no change. Installed when ``predictor = vismmoe`` or
``prefetch = vismmoe``; the runtime then records every step's predictions
(:meth:`LivePredictor.step_predictions`) in the store variables ``predicted_ids`` /
``predicted_scores``, which replay feeds back through ``PrefetchContext.predicted`` (live =
replay, tested).

Candidates at layer l: the pairs (l + d, e) for d = 1 … W (cut at the last layer) and e in
the top-B of y_l, ordered by γ^(d−1)·σ(y_l)_e (descending; ties: nearer layer, then rank), so
the most likely experts of the next layer come first and farther layers get the strong ones
only; ``select`` then drops pinned layers and caps at B.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import param
import torch

from workbench.knobs import KnobGroup, register_group
from workbench.policies.prefetch import PREFETCH, PrefetchContext, PrefetchPolicy
from workbench.predictor.features import RoutingProbe, build_feature, now, window_targets

DEFAULT_BUDGET = 20


class PredictorKnobs(KnobGroup):
    """Compression-guided lookahead predictor (seed VisMMOE §3.3, SPEC §1b)."""

    title = "Lookahead predictor"

    predictor = param.Selector(
        default="none", objects=["none", "vismmoe"],
        doc="'vismmoe' runs the calibrated lookahead predictor at every MoE layer "
            "(prefetch=vismmoe uses its top-B experts and turns it on).")
    window = param.Integer(
        default=5, bounds=(1, None), softbounds=(1, 8),
        doc="W: layers ahead the predictor's candidates may target.")
    decay = param.Number(
        default=0.8, bounds=(0.0, 1.0), inclusive_bounds=(False, True), softbounds=(0.5, 1.0),
        doc="γ: weight of a candidate d layers ahead is γ^(d−1) (and of the training targets).")
    predictor_path = param.String(
        default=None, allow_None=True,
        doc="Directory of a calibrated predictor (workbench calibrate --out); None: "
            "<model dir>/workbench/predictor.")


register_group("predictor", PredictorKnobs)


def default_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / "workbench" / "predictor"


def ordered_candidates(layer: int, num_layers: int, ranked: list[tuple[int, float]],
                       window: int, decay: float) -> list[tuple[int, int]]:
    """(layer + d, e) pairs by γ^(d−1)·score, nearer layer then rank on ties."""
    items = []
    for d in range(1, window + 1):
        if layer + d >= num_layers:
            break
        w = decay ** (d - 1)
        for r, (e, s) in enumerate(ranked):
            items.append((-w * s, d, r, layer + d, e))
    items.sort()
    return [(t, e) for _, _, _, t, e in items]


@PREFETCH.register("vismmoe")
class VisMMoEPrefetch(PrefetchPolicy):
    """VisMMOE lookahead predictor: the top-B experts of y_l for the layers within the window W,
    weighted γ^(d−1) (live; replay needs recorded predictor outputs)."""

    needs = frozenset({"predicted_ids"})
    #: prefetch_budget None means B = 20 live, so replay must cap the same way
    default_budget = DEFAULT_BUDGET

    def __init__(self, window: int = 5, decay: float = 0.8, **_: object) -> None:
        self.window = int(window)
        self.decay = float(decay)
        self.live: "LivePredictor | None" = None

    def attach(self, live: "LivePredictor") -> None:
        self.live = live

    def candidates(self, ctx: PrefetchContext) -> list[tuple[int, int]]:
        if ctx.predicted is not None:
            ranked = ctx.predicted()
        elif self.live is not None:
            ranked = self.live.ranked(ctx.step, ctx.layer)
        else:
            ranked = []
        return ordered_candidates(ctx.layer, ctx.num_layers, ranked, self.window, self.decay)


class LivePredictor(RoutingProbe):
    """Runs a :class:`~workbench.predictor.model.LookaheadPredictor` once per MoE layer of a
    live model; ``ranked(step, layer)`` gives y_layer's top-``budget`` (expert, σ) pairs;
    ``costs`` the measured seconds of each call (features + forward)."""

    def __init__(self, model, layout, predictor, budget: int, placement=None) -> None:
        super().__init__(model, layout, placement=placement, keep_steps=False)
        self.predictor = predictor.eval()
        self.budget = int(budget)
        self.costs: list[float] = []
        self.by_step: dict[int, dict[int, list[tuple[int, float]]]] = {}
        #: ``f(step, layer)`` called after each layer's prediction (e.g. the slab eviction policy)
        self.listeners: list = []
        self.on_layer = LivePredictor._on_layer

    def _on_layer(self, layer: int) -> None:
        self._predict(layer)
        for f in self.listeners:
            f(self.step, layer)

    def _predict(self, layer: int) -> None:
        if layer >= self.L - 1 or self.hmean is None:
            return
        t0 = now()
        cfg = self.predictor.cfg
        prev_g = (window_targets(self.prev_active, cfg.window, cfg.decay)
                  if self.prev_active is not None else None)
        hv = self.visual_summary() if cfg.use_visual else None
        x = build_feature(layer, self.hist, prev_g, self.hmean[layer], hv, self.L,
                          cfg.use_visual)
        with torch.no_grad():
            s = self.predictor.scores(x)[0]
        top = np.argsort(-s, kind="stable")[: self.budget]
        # float32 scores (σ in float32): the store keeps them exactly, so replay ties the same
        self.by_step.setdefault(self.step, {})[layer] = [(int(e), float(np.float32(s[e])))
                                                         for e in top]
        self.by_step.pop(self.step - 2, None)  # keep memory bounded
        self.costs.append(now() - t0)

    def ranked(self, step: int, layer: int) -> list[tuple[int, float]]:
        return self.by_step.get(step, {}).get(layer, [])

    def step_predictions(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """What the predictor said in ``step``, for the run store (and so for trace replay):
        ``ids`` int16 ``[L, budget]`` (y_layer's top experts best first; -1 where it did not run
        for the layer) and their σ(y_layer) ``scores`` float32 (the exact values
        :meth:`ranked` gives, so replay orders candidates as the live policy did)."""
        ids = np.full((self.L, self.budget), -1, np.int16)
        scores = np.zeros((self.L, self.budget), np.float32)
        for layer, ranked in self.by_step.get(step, {}).items():
            for r, (e, s) in enumerate(ranked):
                ids[layer, r], scores[layer, r] = e, s
        return ids, scores

    def cost_summary(self) -> dict[str, float]:
        if not self.costs:
            return {"calls": 0}
        t = np.asarray(self.costs)
        return {"calls": int(t.size), "p50_s": float(np.percentile(t, 50)),
                "p99_s": float(np.percentile(t, 99)), "mean_s": float(t.mean())}
