"""What things cost: :func:`modeled_costs`, what the modeled clock charges per MoE layer (compute
against expert copies, :data:`~workbench.analysis.vismmoe.config.TARGET` on
:data:`~workbench.analysis.vismmoe.config.PROFILE`), and :func:`timed`, the wall time of one call
here (measured)."""

from __future__ import annotations

import time
from typing import Any, Callable

import pandas as pd

from workbench.analysis.vismmoe.config import PROFILE, TARGET
from workbench.sim.profiles import get_target_model


def modeled_costs(top_k: int, prompt_tokens: int, prefill_experts_per_layer: float
                  ) -> pd.DataFrame:
    """What the modeled clock charges per MoE layer (:data:`TARGET` on :data:`PROFILE`): the
    compute of a decode step (1 token, ``top_k`` experts) and of a prefill (``prompt_tokens``
    spread over ``prefill_experts_per_layer`` experts), against copying one expert and against
    copying all of them (the layer's demand on a cold cache). Modeled."""
    from workbench.sim.costs import CostSpec
    from workbench.sim.profiles import get_profile

    p = get_profile(PROFILE)
    c = CostSpec.from_target(get_target_model(TARGET))
    one = p.transfer_time(c.expert_bytes)
    rows = {}
    for name, T, n in (("decode step", 1, top_k),
                       ("prefill", int(prompt_tokens), float(prefill_experts_per_layer))):
        dense = p.compute_time(T * c.dense_flops_per_token_per_layer, c.dense_bytes_per_layer)
        per = T * top_k / max(n, 1e-9)
        experts = n * p.compute_time(per * c.expert_flops_per_token, c.expert_bytes)
        rows[name] = {"tokens": T, "experts / layer": n,
                      "compute ms / layer": (dense + experts) * 1e3,
                      "one expert copy ms": one * 1e3,
                      "copying the layer's experts ms": n * one * 1e3,
                      "copies / compute": n * one / (dense + experts)}
    t = pd.DataFrame(rows).T
    t.index.name = "per MoE layer"
    t.attrs = {"modeled": f"{TARGET} costs on the {PROFILE} profile"}
    return t



def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``(fn(*args, **kwargs), seconds)``."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
