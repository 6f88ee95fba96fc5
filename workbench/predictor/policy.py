"""The ``vismmoe`` prefetch policy, the live predictor hook and the predictor knobs.

Knobs (group ``predictor``, declared in :mod:`workbench.predictor.knobs`): ``predictor``
(none | vismmoe), ``window`` (W = 5), ``decay`` (γ = 0.8), ``predictor_path`` (a
``workbench calibrate --out`` directory; None: :func:`default_path`). The existing
``prefetch_budget`` is B; for ``vismmoe`` None means **20** (the paper's B), not "unlimited".

This module is torch-free; :class:`LivePredictor` lives in :mod:`workbench.predictor.live`
(``workbench.predictor.policy.LivePredictor`` still finds it, imported on first access).

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
from typing import TYPE_CHECKING, Any

from workbench.policies.prefetch import PREFETCH, PrefetchContext, PrefetchPolicy
from workbench.predictor.knobs import DEFAULT_BUDGET, PredictorKnobs

if TYPE_CHECKING:
    from workbench.predictor.live import LivePredictor

__all__ = ["DEFAULT_BUDGET", "PredictorKnobs", "VisMMoEPrefetch", "LivePredictor",
           "default_path", "ordered_candidates", "workspace_path"]


def __getattr__(name: str) -> Any:
    if name == "LivePredictor":  # torch: imported on first use
        from workbench.predictor.live import LivePredictor

        return LivePredictor
    raise AttributeError(f"module 'workbench.predictor.policy' has no attribute {name!r}")


def workspace_path(config_hash: str) -> Path:
    """Where ``workbench calibrate`` puts a model's predictor by default:
    ``<workspace>/predictors/<config hash>`` (the workspace option, $WORKBENCH_WORKSPACE), a
    folder of the user's, never the model's folder or the installed package."""
    from workbench.options import get_options

    return Path(get_options()["workspace"]) / "predictors" / str(config_hash)


def default_path(model_dir: str | Path, config_hash: str) -> Path:
    """The predictor a run uses when ``predictor_path`` is None: the user's calibration in the
    workspace (:func:`workspace_path`) if there is one, else one shipped beside the model
    (``<model dir>/workbench/predictor``, read only) if there is one, else the workspace path
    (whose "no calibrated predictor" error then says to calibrate into it)."""
    mine, shipped = workspace_path(config_hash), Path(model_dir) / "workbench" / "predictor"
    for candidate in (mine, shipped):
        if (candidate / "predictor.json").is_file():
            return candidate
    return mine


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

    def __init__(self, window: int = PredictorKnobs.param.window.default,
                 decay: float = PredictorKnobs.param.decay.default) -> None:
        self.window = int(window)
        self.decay = float(decay)
        self.live: "LivePredictor | None" = None

    @classmethod
    def from_knobs(cls, knobs) -> "VisMMoEPrefetch":
        pred: PredictorKnobs = knobs.group("predictor")
        return cls(pred.window, pred.decay)

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
