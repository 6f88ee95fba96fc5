"""The live predictor hook: :class:`LivePredictor` runs the lookahead predictor right after
each MoE layer's router of a live model (torch; imported by the runtime when the predictor is on).
See :mod:`workbench.predictor.policy` for the prefetch policy that reads it."""

from __future__ import annotations

import numpy as np
import torch

from workbench.predictor.features import RoutingProbe, build_feature, now, window_targets


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
