"""Which of the paper's effects appear: :func:`findings` turns the study results into
``(effect, appears, sentence with the numbers)`` — an effect appears when it has the paper's
sign and exceeds two standard errors of the paired difference — and :func:`findings_markdown`
renders them as a list."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pandas as pd
import xarray as xr

from workbench.analysis.vismmoe.config import PAPER
from workbench.analysis.vismmoe.routing import layer_range, chance_jaccard


def _paired(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean of ``y − x`` over paired samples and its standard error."""
    d = np.asarray(y, float) - np.asarray(x, float)
    d = d[np.isfinite(d)]
    if len(d) < 2:
        return (float(d.mean()) if len(d) else float("nan")), float("nan")
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


def _clear(diff: float, se: float, direction: int) -> bool:
    """``diff`` lies in ``direction`` (−1: down, +1: up) by more than two standard errors."""
    if not np.isfinite(diff):
        return False
    return direction * diff > 0 and (not np.isfinite(se) or abs(diff) > 2 * se)


def _grows(claim: str, before: np.ndarray, after: np.ndarray,
           detail: Callable[[float, float], str]) -> tuple[str, bool, str]:
    """A verdict row: ``claim`` holds when ``after`` − ``before`` (paired) is above zero by
    more than 2 SE; ``detail`` words the numbers from the difference and its SE."""
    d, se = _paired(before, after)
    return claim, _clear(d, se, +1), detail(d, se)


def findings(ladder: xr.Dataset | None = None, sweep: pd.DataFrame | None = None,
             pruning: xr.Dataset | None = None, accuracy: xr.Dataset | None = None,
             recall: xr.Dataset | None = None) -> list[tuple[str, bool, str]]:
    """``(effect, appears, sentence with the numbers)`` for each effect of the paper that the
    given study results speak to. An effect *appears* when it has the paper's sign and is
    larger than two standard errors of the paired difference over requests (questions for
    accuracy); the sentences quote the numbers, so text built from them is never stale."""
    out: list[tuple[str, bool, str]] = []
    if ladder is not None:
        lat = ladder["latency_modeled_s"]
        base = float(lat.isel(stage=0).mean())
        names = [str(s) for s in ladder["stage"].values]
        paper = PAPER["ladder_s"]
        for prev, cur in zip(names, names[1:]):
            d, se = _paired(lat.sel(stage=prev).values, lat.sel(stage=cur).values)
            ref = (f"; paper {paper[prev] / paper['base']:.1%} → {paper[cur] / paper['base']:.1%}"
                   if prev in paper and cur in paper else "")
            out.append((f"{cur} lowers the modeled latency", _clear(d, se, -1),
                        f"{prev} → {cur}: {float(lat.sel(stage=prev).mean()) / base:.1%} → "
                        f"{float(lat.sel(stage=cur).mean()) / base:.1%} of base, "
                        f"{d * 1e3:+.1f} ± {se * 1e3:.1f} ms per request (modeled){ref}"))
        if "+compression" in names:
            m = ladder["latency_measured_s"]
            d, se = _paired(m.sel(stage=names[0]).values, m.sel(stage="+compression").values)
            out.append(("compression lowers the measured latency here", _clear(d, se, -1),
                        f"{names[0]} → +compression: {d * 1e3:+.1f} ± {se * 1e3:.1f} ms per "
                        f"request (measured, CPU wall time)"))
    if sweep is not None:
        v = sweep[sweep["valid"]]
        for b, d in v.groupby("budget_slots"):
            d = d.sort_values("pinned_layers")
            y = d["latency_modeled_ms"].to_numpy()
            x = d["pinned_layers"].to_numpy()
            i = int(np.argmin(y))
            u = len(y) >= 3 and 0 < i < len(y) - 1
            shape = ("U-shaped" if u else "decreasing" if np.all(np.diff(y) <= 0)
                     else "increasing" if np.all(np.diff(y) >= 0) else "irregular")
            pts = ", ".join(f"{p} → {t:.1f}" for p, t in zip(x, y))
            out.append((f"U-shaped latency vs pinned_layers at {b} expert slots", u,
                        f"valid depths {x.min()}–{x.max()} (cache {d['cache_slots'].max()}–"
                        f"{d['cache_slots'].min()} slots), modeled ms {pts}: {shape}, lowest "
                        f"at {x[i]} ({len(y)} valid point{'s' if len(y) != 1 else ''})"))
    if pruning is not None:
        after = pruning.isel(layer=layer_range(pruning, "after-prefix"))
        conc = after["concentration"].mean("layer")
        inact = after["inactive"].mean("layer")
        sim = after["similarity_next"].mean("layer", skipna=True)
        g = [str(x) for x in pruning["group"].values]
        ct, cr = conc.sel(group="text").values, conc.sel(group="visual (raw)").values
        d, se = _paired(cr, ct)
        out.append(("text tokens route more concentrated than raw visual tokens",
                    _clear(d, se, +1),
                    f"top-{pruning.attrs['top_k']} concentration text {np.nanmean(ct):.3f} vs "
                    f"raw visual {np.nanmean(cr):.3f} ({d:+.3f} ± {se:.3f}), on "
                    f"{float(pruning['tokens'].sel(group='text').mean()):.0f} text vs "
                    f"{float(pruning['tokens'].sel(group='visual (raw)').isel(layer=0).mean()):.0f}"
                    f" visual tokens per request"))
        chance = chance_jaccard(pruning.attrs["top_k"], pruning.attrs["num_experts"])
        for name in (x for x in g if x.startswith("visual (kept")):
            dc, sc = _paired(cr, conc.sel(group=name).values)
            di, si = _paired(inact.sel(group="visual (raw)").values,
                             inact.sel(group=name).values)
            ds_, ss = _paired(sim.sel(group="visual (raw)").values, sim.sel(group=name).values)
            rel = dc / np.nanmean(cr)
            out.append((f"{name} routes more concentrated than raw visual", _clear(dc, sc, +1),
                        f"concentration {np.nanmean(cr):.3f} → "
                        f"{float(conc.sel(group=name).mean()):.3f} ({rel:+.1%}; paper Fig. 1: "
                        f"+32 %)"))
            i0 = float(inact.sel(group="visual (raw)").mean())
            out.append((f"{name} leaves more experts inactive", _clear(di, si, +1),
                        f"inactive experts per layer {i0:.1f} → "
                        f"{float(inact.sel(group=name).mean()):.1f} ({di:+.2f} ± {si:.2f}, "
                        f"{di / i0:+.1%}; paper Fig. 3b: nearly doubles)"))
            out.append((f"{name} raises inter-layer routing similarity", _clear(ds_, ss, +1),
                        f"Jaccard l→l+1 {float(sim.sel(group='visual (raw)').mean()):.3f} → "
                        f"{float(sim.sel(group=name).mean()):.3f} ({ds_:+.3f} ± {ss:.3f}); "
                        f"unrelated routing would give {chance:.3f}"))
        if {"visual (kept: affinity)", "visual (kept: random)"} <= set(g):
            for what, arr, sign in (("concentration", conc, +1), ("inactive experts", inact, +1)):
                d, se = _paired(arr.sel(group="visual (kept: random)").values,
                                arr.sel(group="visual (kept: affinity)").values)
                va = float(arr.sel(group="visual (kept: affinity)").mean())
                vr = float(arr.sel(group="visual (kept: random)").mean())
                out.append((f"affinity keeps a set with higher {what} than random at equal β",
                            _clear(d, se, sign),
                            f"{what}: affinity {va:.3f} vs random {vr:.3f} ({d:+.3f} ± "
                            f"{se:.3f}, layers behind the prefix)"))
    if accuracy is not None:
        none = accuracy["correct_none"].values.astype(float)
        betas = [float(b) for b in accuracy["beta"].values if float(b) != 1.0]
        nq = accuracy.sizes["question"]
        for pol in accuracy["policy"].values:
            parts, loss = [], False
            for b in betas:
                c = accuracy["correct"].sel(policy=pol, beta=b).values.astype(float)
                d, se = _paired(none, c)
                parts.append(f"β {b:g}: {c.mean():.1%} ({d * 100:+.1f} ± {se * 100:.1f} "
                             f"points)")
                loss = loss or _clear(d, se, -1)
            out.append((f"{pol} compression costs no measurable accuracy", not loss,
                        f"no compression {none.mean():.1%}; " + "; ".join(parts)
                        + f" ({nq} questions)"))
        pols = [str(p) for p in accuracy["policy"].values]
        if {"affinity", "random"} <= set(pols):
            for b in betas:
                ca = accuracy["correct"].sel(policy="affinity", beta=b).values.astype(float)
                cr = accuracy["correct"].sel(policy="random", beta=b).values.astype(float)
                d, se = _paired(cr, ca)
                out.append((f"affinity is more accurate than random at β = {b:g}",
                            _clear(d, se, +1),
                            f"affinity {ca.mean():.1%} vs random {cr.mean():.1%} "
                            f"({d * 100:+.1f} ± {se * 100:.1f} points, {nq} questions)"))
    if recall is not None:
        lo, hi = PAPER["hot_recall_x_random"]
        p = recall.sel(variant="predictor")
        a = recall.sel(variant="without h^(v)")
        for k in recall["k"].values[recall["scaled"].values]:
            k = int(k)
            x, xm = float(p["x_random"].sel(k=k)), float(p["x_random_max"].sel(k=k))
            out.append((f"Hot Recall@{k} is {lo}–{hi}× random", lo <= x <= hi,
                        f"@{k} ({k / recall.attrs['num_experts']:.1%} of the experts): "
                        f"{float(p['hot_recall'].sel(k=k)):.1%} vs random "
                        f"{float(p['random'].sel(k=k)):.1%} = {x:.2f}× (a perfect predictor: "
                        f"{xm:.2f}×)"))
            hv, nv = float(p["hot_recall"].sel(k=k)), float(a["hot_recall"].sel(k=k))
            out.append((f"the visual summary h^(v) raises Hot Recall@{k}", hv > nv + 0.005,
                        f"@{k}: {hv:.1%} with h^(v), {nv:.1%} without"))
    return out


def findings_markdown(items: Sequence[tuple[str, bool, str]]) -> str:
    """A markdown list: ✓ appears / ✗ does not appear, with the sentence."""
    return "\n".join(f"- {'✓ appears' if ok else '✗ does not appear'} — **{eff}**: {txt}"
                      for eff, ok, txt in items)


def scale_findings(pruning: dict[int, xr.Dataset] | None = None,
                   accuracy: dict[int, xr.Dataset] | None = None) -> list[tuple[str, bool, str]]:
    """Issue 39 §8, VisMMOE's premise with redundant visual tokens: the same scenes at a larger
    scene scale (every object over ``scale²`` times the patches). For each larger scale against
    the smallest, paired over the same requests (questions): does pruning concentrate the kept
    tokens' routing more (Figs. 1, 3), does affinity keep a more concentrated set than random by
    more, does compression cost less accuracy, and does affinity's accuracy lead over random
    grow (Table 3)? Same rule as :func:`findings`: the paper's sign, beyond two standard errors."""
    out: list[tuple[str, bool, str]] = []
    if pruning:
        s0, *rest = sorted(pruning)
        for s1 in rest:
            conc = {s: pruning[s].isel(layer=layer_range(pruning[s], "after-prefix"))["concentration"]
                    .mean("layer") for s in (s0, s1)}
            groups = [str(g) for g in pruning[s0]["group"].values if str(g).startswith("visual (kept")]
            for g in groups:
                gain = {s: conc[s].sel(group=g).values - conc[s].sel(group="visual (raw)").values
                        for s in (s0, s1)}
                out.append(_grows(
                    f"{g} gains more concentration over raw visual at {s1}× than at {s0}×",
                    gain[s0], gain[s1], lambda d, se:
                    f"kept − raw top-{pruning[s0].attrs['top_k']} concentration: "
                    f"{np.nanmean(gain[s0]):+.3f} at {s0}× vs {np.nanmean(gain[s1]):+.3f} at "
                    f"{s1}× ({d:+.3f} ± {se:.3f}, {pruning[s0].sizes['request']} scenes)"))
            if {"visual (kept: affinity)", "visual (kept: random)"} <= set(groups):
                lead = {s: conc[s].sel(group="visual (kept: affinity)").values
                        - conc[s].sel(group="visual (kept: random)").values for s in (s0, s1)}
                out.append(_grows(
                    f"affinity's concentration lead over random grows at {s1}×",
                    lead[s0], lead[s1], lambda d, se:
                    f"affinity − random concentration: {np.nanmean(lead[s0]):+.3f} at {s0}× vs "
                    f"{np.nanmean(lead[s1]):+.3f} at {s1}× ({d:+.3f} ± {se:.3f})"))
    if accuracy:
        s0, *rest = sorted(accuracy)
        for s1 in rest:
            a0, a1 = accuracy[s0], accuracy[s1]
            nq = a0.sizes["question"]
            for b in (float(x) for x in a0["beta"].values if float(x) != 1.0):
                def cost(a, pol):
                    return (a["correct"].sel(policy=pol, beta=b).values.astype(float)
                            - a["correct_none"].values.astype(float))
                for pol in (str(p) for p in a0["policy"].values):
                    c0, c1 = cost(a0, pol), cost(a1, pol)
                    out.append(_grows(
                        f"{pol} compression at β = {b:g} costs less accuracy at {s1}×",
                        c0, c1, lambda d, se:
                        f"accuracy change vs no compression: {c0.mean() * 100:+.1f} points at "
                        f"{s0}× vs {c1.mean() * 100:+.1f} at {s1}× ({d * 100:+.1f} ± "
                        f"{se * 100:.1f} points, {nq} questions)"))
                pols = {str(p) for p in a0["policy"].values}
                if {"affinity", "random"} <= pols:
                    lead = {s: (a["correct"].sel(policy="affinity", beta=b).values.astype(float)
                                - a["correct"].sel(policy="random", beta=b).values.astype(float))
                            for s, a in ((s0, a0), (s1, a1))}
                    out.append(_grows(
                        f"affinity's accuracy lead over random at β = {b:g} grows at {s1}×",
                        lead[s0], lead[s1], lambda d, se:
                        f"affinity − random: {lead[s0].mean() * 100:+.1f} points at {s0}× vs "
                        f"{lead[s1].mean() * 100:+.1f} at {s1}× ({d * 100:+.1f} ± "
                        f"{se * 100:.1f} points)"))
    return out
