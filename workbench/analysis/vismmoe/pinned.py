"""The pinned prefix under a fixed expert budget (VisMMOE Fig. 12 in kind): :func:`pinned_sweep`
runs every depth of the valid interval with the rest of the budget as cache, and
:func:`choose_pinned` picks the depth with the lowest modeled latency (the paper's offline
profiling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from workbench.analysis.vismmoe.config import (PROFILE, TARGET, pinned_cache_slots,
                                               expert_budget_slots, scaled_plan, stage_knobs)
from workbench.errors import InputError


def pinned_sweep(rt, requests: Sequence[tuple[Any, str, str]], *,
                 knobs: Mapping[str, Any] | None = None,
                 budgets: Iterable[int] | None = None, pinned: Iterable[int] | None = None,
                 semantic_layers: int = 1, predictor_path: str | Path | None = None,
                 max_new_tokens: int = 32) -> pd.DataFrame:
    """Latency vs ``pinned_layers`` at fixed expert budgets (VisMMOE Fig. 12). For each budget
    (default: :func:`expert_budget_slots`) every depth in ``pinned`` (default: its valid
    interval, :func:`scaled_plan`) runs with ``cache_slots = budget − E · depth`` and
    ``knobs`` (default: the *full* stage of :data:`LADDER`). Depths outside the interval are
    listed with ``valid=False`` and not run. One row per (budget, depth): means over the
    requests (modeled latency parts, hit rate, loads) and the median measured latency."""
    lay = rt.lm.layout
    budgets = [expert_budget_slots(lay.num_layers, lay.num_experts)] if budgets is None \
        else [int(b) for b in budgets]
    if knobs is None:
        knobs = stage_knobs(lay, "full", budget_slots=budgets[0], pinned_full=semantic_layers,
                            predictor_path=predictor_path, max_new_tokens=max_new_tokens)
    rows = []
    for b in budgets:
        lo, hi = scaled_plan(lay, b, 0, semantic_layers=semantic_layers).valid_interval
        depths = range(lo, hi + 1) if pinned is None else pinned
        for p in depths:
            p = int(p)
            row = {"budget_slots": b, "pinned_layers": p,
                   "cache_slots": pinned_cache_slots(lay, b, p), "valid": lo <= p <= hi}
            if row["valid"]:
                lat, pre, dec, meas, hits, misses, loads = [], [], [], [], 0, 0, []
                for img, q, _a in requests:
                    res = rt.run(q, images=[img], record=False,
                                 **{**knobs, "pinned_layers": p,
                                    "cache_slots": row["cache_slots"]})
                    lat.append(res.latency_modeled_s)
                    pre.append(res.prefill_modeled_s)
                    dec.append((res.latency_modeled_s - res.prefill_modeled_s)
                               / max(res.steps - 1, 1))
                    meas.append(res.latency_measured_s)
                    hits, misses = hits + res.hits, misses + res.misses
                    loads.append(res.loads)
                row.update(latency_modeled_ms=np.mean(lat) * 1e3,
                           prefill_modeled_ms=np.mean(pre) * 1e3,
                           decode_modeled_ms_per_token=np.mean(dec) * 1e3,
                           hit_rate=hits / max(hits + misses, 1), loads=np.mean(loads),
                           latency_measured_ms_median=np.median(meas) * 1e3)
            rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs = {"study": "latency vs pinned_layers (VisMMOE Fig. 12)",
                "modeled": f"latency_modeled_ms, prefill_modeled_ms, "
                           f"decode_modeled_ms_per_token ({TARGET} experts on {PROFILE})",
                "measured": "latency_measured_ms_median (CPU wall time here), hit_rate, loads",
                "requests": len(requests), "knobs": repr(dict(knobs)),
                "semantic_layers": semantic_layers}
    return df


def choose_pinned(sweep: pd.DataFrame, budget_slots: int | None = None) -> int:
    """The valid depth with the lowest mean modeled latency (ties: the shallower one, which
    leaves more cache) — the paper's offline profiling inside the valid interval."""
    d = sweep[sweep["valid"]]
    if budget_slots is not None:
        d = d[d["budget_slots"] == budget_slots]
    if d.empty:
        raise InputError("the sweep has no valid pinned depth to choose from")
    d = d.sort_values(["latency_modeled_ms", "pinned_layers"], kind="stable")
    return int(d["pinned_layers"].iloc[0])
