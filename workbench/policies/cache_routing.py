"""Cache-aware routing (issue 40 §2): bias the router toward experts already in the cache.

The rule is **Cache-Prior** of Skliar, van Rozendaal et al., *Mixture of Cache-Conditional
Experts for Efficient Mobile Device Inference* (arXiv 2412.00099, TMLR 2025). Per MoE layer and
token, with router logits ``z [E]`` and ``m [E]`` = 1 for the experts of that layer resident in
the cache, 0 for the others:

    z' = z + λ · Δ_avg · m

the top-k is taken on ``z'`` and the combine weights come from the **unmodified** logits (the
router's own probabilities of the chosen experts, renormalised over them when the model's
router renormalises its top-k). ``λ`` (``cache_routing_strength``) ∈ [0, 1]: 0 is the
model's own routing, 1 lets a resident expert displace any non-resident one whose logit is
within a whole typical logit range of it. ``Δ_avg`` is a running average of the per-token logit
range ``max z − min z`` of that layer, so λ is a fraction of a typical range whatever the
router's scale.

Where the rule was taken from: the paper's own text could not be read here (only its abstract);
the rule above is as three independent implementations citing the paper state it (an additive
``λ · Δ · m`` on the router logits, used to re-rank only, weights untouched; ``Δ_avg`` a running
average of each token's logit range; λ = 0 the baseline). Two details are **this workbench's
choices**, not verified against the paper: ``Δ_avg`` is the plain mean over every real token the
layer has routed in the run so far (prefill included, the current call's tokens included before
the bias is applied), and the bias applies to **decode steps of offloaded layers** only (the
paper's setting is token-by-token generation; a pinned layer is always resident, so a bias
there would change outputs for nothing).

It changes which experts run, hence the model's output, and the routing the store records
(the ids after the rewrite): a replay of such a store replays that routing as recorded and
cannot re-route (it has no router). Live only.

This module is torch-free: the knob group and a NumPy reference of the rule (the live stage,
:mod:`workbench.runtime.stages.cache_routing`, runs the same rule on the device).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import param

from workbench.errors import KnobError
from workbench.knobs import KnobGroup

if TYPE_CHECKING:
    from workbench.knobs import Knobs, ModelShape


class CacheRoutingKnobs(KnobGroup):
    """Cache-aware routing (Cache-Prior, arXiv 2412.00099): prefer experts already cached."""

    title = "Cache-aware routing"

    cache_routing = param.Boolean(
        default=False,
        doc="Cache-aware routing (Cache-Prior, arXiv 2412.00099; changes routing, hence "
            "outputs): at each offloaded layer of a decode step, add λ·Δ_avg to the router "
            "logits of the experts already in the cache before the top-k (Δ_avg: the layer's "
            "running mean logit range); the weights stay the router's own. Live only: a replay "
            "replays the routing as recorded.")
    cache_routing_strength = param.Number(
        default=0.2, bounds=(0.0, 1.0), softbounds=(0.0, 1.0),
        doc="λ of Cache-Prior, in [0, 1]: 0 = the model's own routing; 1 = a resident expert "
            "displaces any non-resident one whose logit is within one typical logit range. "
            "Default 0.2: the largest λ with no measured accuracy cost on the embedded model "
            "(BENCHMARKS.md, cache-aware routing).")

    def check(self, knobs: "Knobs", shape: "ModelShape", *, live: bool = True) -> None:
        """Live cache-aware routing reads whole experts' residency: not with sub-expert
        offloading (MoE-Prism's ``prism_offload``) yet."""
        if live and self.cache_routing and getattr(knobs, "prism", False) \
                and getattr(knobs, "prism_offload", False):
            raise KnobError("cache_routing=True with prism_offload=True is not built yet (it "
                            "reads whole experts' residency, the cache holds sub-experts): set "
                            "one of them false")


def cache_prior(logits: np.ndarray, resident: np.ndarray, strength: float, delta: float,
                top_k: int, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Cache-Prior on NumPy (the reference of the live stage): ``logits [T, E]``, ``resident
    [E]`` bool → ``(ids [T, k], weights [T, k])``, ids in descending biased logit, weights the
    softmax of the unmodified logits at those ids (renormalised over them if ``normalize``)."""
    z = np.asarray(logits, np.float64)
    zb = z + strength * delta * np.asarray(resident, np.float64)[None, :]
    ids = np.argsort(-zb, axis=-1, kind="stable")[:, :top_k]
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w = np.take_along_axis(p, ids, -1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    return ids, w


__all__ = ["CacheRoutingKnobs", "cache_prior"]
