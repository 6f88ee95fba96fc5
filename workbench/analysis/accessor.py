"""``ds.moe``: metrics and figures of a run store, as pure functions of the Dataset.

Importing this module registers the accessor (``workbench.open_run`` does it for you)::

    ds = workbench.open_run("runs/r1.zarr")
    ds.moe.hit_rate()                      # offloaded layers, whole run
    ds.moe.expert_counts(modality="image", phase="prefill")
    ds.moe.heatmap(modality="text").show()

Nothing here needs a model or torch: every number comes from the variables documented in
``docs/telemetry.md``. Arguments are checked; a bad one raises :class:`ValueError` (as
:class:`workbench.errors.InputError`) naming the argument, the bad value and the allowed values.

Conventions
-----------
- ``steps`` selects on the ``step`` coordinate like ``Dataset.sel``: an int, a list of ints or a
  ``slice(a, b)`` **including both ends** (step numbers, not positions).
- ``modality`` is ``None``/``"all"`` (every token) or a name of the ``modality`` coordinate
  (``"text"``, ``"image"``, ``"video"``); ``phase`` is ``None`` (both), ``"prefill"`` or
  ``"decode"``.
- Counts are (token, routed expert) pairs: a token routed to k experts adds 1 to each of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import xarray as xr

from workbench.errors import InputError
from workbench.telemetry.events import MODALITIES, PHASES
from workbench.telemetry.schema import LEGACY_PRED_ORDER, PRED_ORDER

__all__ = ["MoEAccessor", "merged_token_cells"]

_HIT_RATE_BY = (None, "layer", "step")
_RECALL_BASELINES = (None, "random", "oracle")


def _bad(arg: str, value: Any, allowed: str) -> InputError:
    return InputError(f"{arg} must be {allowed}, not {value!r}")


@xr.register_dataset_accessor("moe")
class MoEAccessor:
    """Expert-offloading metrics of one run store (see the module docstring for conventions)."""

    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = ds

    # -- argument helpers --------------------------------------------------------------------
    @property
    def _modalities(self) -> tuple[str, ...]:
        if "modality" in self._ds.coords:
            return tuple(str(m) for m in self._ds["modality"].values)
        return MODALITIES

    @property
    def _phases(self) -> tuple[str, ...]:
        return tuple(self._ds.attrs.get("phase_names", PHASES))

    def _modality(self, modality: str | None) -> str | None:
        """Validated modality name, or None for all tokens."""
        if modality is None or modality == "all":
            return None
        if not isinstance(modality, str) or modality not in self._modalities:
            raise _bad("modality", modality,
                       "None, 'all' or one of " + ", ".join(map(repr, self._modalities)))
        return modality

    def _phase_code(self, phase: str | None) -> int | None:
        if phase is None or phase == "all":
            return None
        if not isinstance(phase, str) or phase not in self._phases:
            raise _bad("phase", phase, "None or one of " + ", ".join(map(repr, self._phases)))
        return self._phases.index(phase)

    def _select(self, obj: xr.DataArray, steps: Any = None, phase: str | None = None
                ) -> xr.DataArray:
        """``obj`` (with a step dim) cut to ``steps`` (label based, inclusive) and ``phase``."""
        if steps is not None:
            ok = (isinstance(steps, slice)
                  or (isinstance(steps, (int, np.integer)) and not isinstance(steps, bool))
                  or (isinstance(steps, (Sequence, np.ndarray)) and not isinstance(steps, str)
                      and all(isinstance(s, (int, np.integer)) for s in steps)))
            if not ok:
                raise _bad("steps", steps, "None, an int, a list of ints or a slice of steps")
            if isinstance(steps, (int, np.integer)):
                steps = [int(steps)]
            try:
                obj = obj.sel(step=steps)
            except KeyError as e:
                n = self._ds.sizes.get("step", 0)
                raise _bad("steps", steps, f"steps recorded in this store (0..{n - 1})") from e
        code = self._phase_code(phase)
        if code is not None:
            ph = self._ds["phase"].sel(step=obj["step"]).values
            obj = obj.isel(step=np.flatnonzero(ph == code))
        return obj

    def _pinned(self) -> np.ndarray:
        """bool [layer]: layers of the always-resident prefix (all False if not recorded)."""
        if "pinned" in self._ds:
            return np.asarray(self._ds["pinned"].values, bool)
        return np.zeros(self._ds.sizes["layer"], bool)

    def _pinned_accesses(self) -> xr.DataArray | int:
        """``pinned_accesses`` [step, layer] (schema ≥ 4 and every store ``open_run`` reads),
        or 0 for a Dataset without it, whose pinned-layer accesses are in ``hits``."""
        return self._ds["pinned_accesses"] if "pinned_accesses" in self._ds else 0

    @property
    def top_k(self) -> int:
        """Experts per token: attrs ``top_k``, else the length of the ``k`` dim."""
        return int(self._ds.attrs.get("top_k", self._ds.sizes.get("k", 1)))

    # -- cache -------------------------------------------------------------------------------
    def hit_rate(self, by: str | None = None, include_pinned: bool = False
                 ) -> float | xr.DataArray:
        """Expert-cache hit rate = hits / (hits + misses), a fraction in [0, 1].

        ``hits``/``misses`` count each routed expert once per layer and step. Pinned layers
        (always resident) are left out unless ``include_pinned``, which counts their accesses
        (``pinned_accesses``) as hits. A Dataset without ``pinned_accesses`` (built by hand in
        the schema ≤ 3 meaning, where a pinned layer's accesses are its ``hits``) gives the
        same numbers.
        ``by=None`` gives one float for the run; ``"layer"`` a DataArray over ``layer`` (pinned
        layers NaN when excluded); ``"step"`` a DataArray over ``step``. NaN where there was no
        access.
        """
        if by not in _HIT_RATE_BY:
            raise _bad("by", by, "None, 'layer' or 'step'")
        keep = xr.DataArray(np.ones_like(self._pinned()) if include_pinned else ~self._pinned(),
                            dims="layer")
        hits = (self._ds["hits"] + self._pinned_accesses()) if include_pinned \
            else self._ds["hits"].where(keep, 0)
        misses = self._ds["misses"].where(keep, 0)
        if by is None:
            h, m = int(hits.sum()), int(misses.sum())
            return h / (h + m) if h + m else float("nan")
        other = "step" if by == "layer" else "layer"
        h, m = hits.sum(other), misses.sum(other)
        rate = (h / (h + m).where(h + m > 0)).astype(float)
        if by == "layer":
            rate = rate.where(keep)
        rate.name = "hit_rate"
        rate.attrs = {"units": "fraction", "long_name": "expert-cache hit rate",
                      "description": "hits / (hits + misses)"
                      + ("" if include_pinned else "; pinned layers excluded")}
        return rate

    # -- routing -----------------------------------------------------------------------------
    def expert_counts(self, modality: str | None = None, steps: Any = None,
                      phase: str | None = None) -> xr.DataArray:
        """Routed tokens per expert, DataArray [layer, expert] (int64, (token, expert) pairs).

        Summed over the selected ``steps`` and ``phase``; ``modality`` keeps only tokens of
        that modality. The grand total over all modalities is ``step_tokens.sum() × top_k`` for
        a run where every layer routes every token.
        """
        name = self._modality(modality)
        rt = self._select(self._ds["routed_tokens"], steps, phase)
        rt = rt.sum("modality") if name is None else rt.sel(modality=name, drop=True)
        out = rt.sum("step").astype(np.int64).transpose("layer", "expert")
        out.name = "expert_counts"
        out.attrs = {"units": "tokens", "long_name": "routed tokens",
                     "modality": name or "all", "phase": phase or "all",
                     "steps": "all" if steps is None else str(steps)}
        return out

    def request_load(self, modality: str | None = None) -> xr.DataArray:
        """Routed tokens per request of the run's batch and expert, DataArray
        ``[request, layer, expert]`` (int64, (token, expert) pairs; one request for a run of
        one, or a store before batches). ``modality``: only that modality's tokens. Summed
        over ``request`` it is :meth:`expert_counts` (every token belongs to one request)."""
        ds = self._ds
        name = self._modality(modality)
        req = np.asarray(ds["token_request"].values, np.int64)
        ids = np.asarray(ds["topk_ids"].values, np.int64)  # [token, layer, k], -1 = none
        L, E = ds.sizes["layer"], ds.sizes["expert"]
        B = int(ds.attrs.get("batch_size", 1) or 1)
        B = max(B, int(req.max()) + 1 if req.size else 1)
        keep = ids >= 0
        if name is not None:
            keep &= (np.asarray(ds["token_modality"].values)
                     == self._modalities.index(name))[:, None, None]
        flat = (req[:, None, None] * L + np.arange(L)[None, :, None]) * E + ids
        out = np.bincount(flat[keep], minlength=B * L * E).reshape(B, L, E)
        return xr.DataArray(out, dims=("request", "layer", "expert"),
                            coords={"request": np.arange(B), "layer": np.arange(L),
                                    "expert": np.arange(E)},
                            name="request_load",
                            attrs={"units": "tokens", "long_name": "routed tokens per request",
                                   "modality": name or "all"})

    def subexpert_counts(self, modality: str | None = None, steps: Any = None,
                         phase: str | None = None) -> xr.DataArray:
        """Tokens that ran each sub-expert, DataArray [layer, expert, subexpert] (int64),
        summed over the selected ``steps`` and ``phase`` (MoE-Prism; a run without sub-experts
        has one per expert, equal to :meth:`expert_counts`). Over ``subexpert`` it sums to
        the sub-experts each routed token ran — ``k_active ×`` :meth:`expert_counts` with
        ``prism_k_active``; K per token and layer with a global ``prism_k``."""
        name = self._modality(modality)
        st = self._select(self._ds["subexpert_tokens"], steps, phase)
        st = st.sum("modality") if name is None else st.sel(modality=name, drop=True)
        out = st.sum("step").astype(np.int64).transpose("layer", "expert", "subexpert")
        out.name = "subexpert_counts"
        out.attrs = {"units": "tokens", "long_name": "tokens that ran the sub-expert",
                     "modality": name or "all", "phase": phase or "all",
                     "steps": "all" if steps is None else str(steps)}
        return out

    def compute_share(self, by: str | None = None) -> float | xr.DataArray:
        """The share of the routed experts' compute the run did: (token, sub-expert) runs /
        (routed tokens × N) — MoE-Prism's k_active / N where every expert ran, 1.0 without
        sub-experts. ``by``: None (the run), ``"step"``, ``"layer"`` or ``"modality"``."""
        if by not in (None, "step", "layer", "modality"):
            raise _bad("by", by, "None, 'step', 'layer' or 'modality'")
        ds = self._ds
        N = ds.sizes["subexpert"]
        ran = ds["subexpert_tokens"].sum("subexpert")
        asked = ds["routed_tokens"] * N
        if by is None:
            a = int(asked.sum())
            return float(int(ran.sum()) / a) if a else float("nan")
        keep = [by]
        r = ran.sum([d for d in ran.dims if d not in keep])
        q = asked.sum([d for d in asked.dims if d not in keep])
        out = (r / q.where(q > 0)).astype(float)
        out.name = "compute_share"
        out.attrs = {"units": "fraction", "long_name": "share of the routed experts' compute run",
                     "subexperts": N}
        return out

    def subexpert_heatmap(self, layer: int | None = None, modality: str | None = "all",
                          normalize: bool = True):
        """Expert × sub-expert heatmap (plotly) of :meth:`subexpert_counts` at one MoE
        ``layer`` (default: the first offloaded one); ``normalize``: each expert's column as
        the share of its tokens that ran the sub-expert (k_active / N on average)."""
        from workbench.viz.heatmap import subexpert_heatmap

        counts = self.subexpert_counts(modality)
        L = counts.sizes["layer"]
        if layer is None:
            off = np.nonzero(~self._pinned())[0]
            layer = int(off[0]) if len(off) else 0
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < L:
            raise _bad("layer", layer, f"an int in 0 … {L - 1}")
        one = counts.isel(layer=int(layer), drop=True)
        if normalize:
            tok = self.expert_counts(modality).isel(layer=int(layer), drop=True)
            shown = (one / tok.where(tok > 0)).astype(float)
            shown.attrs = {**one.attrs, "units": "share of the expert's tokens"}
        else:
            shown = one
        return subexpert_heatmap(shown, f"tokens per sub-expert, layer {layer} — "
                                        f"{one.attrs['modality']} tokens")

    def working_set(self, window: int | None = None) -> xr.DataArray:
        """Distinct (layer, expert) pairs routed, DataArray over ``step`` (int64).

        With ``window=w`` the count is over the union of steps ``s-w+1 .. s`` (fewer at the
        start); ``window=None`` or 1 is per step. All layers count, pinned ones included.
        """
        if window is not None and (not isinstance(window, (int, np.integer))
                                   or isinstance(window, bool) or window < 1):
            raise _bad("window", window, "None or an int ≥ 1 (steps)")
        used = (self._ds["routed_tokens"].sum("modality") > 0).transpose("step", "layer",
                                                                          "expert")
        u = np.asarray(used.values, np.int32).reshape(used.shape[0], -1)
        w = 1 if window is None else int(window)
        if w > 1:
            c = np.cumsum(u, axis=0)
            lag = np.zeros_like(c)
            lag[w:] = c[:-w]
            u = (c - lag) > 0
        out = xr.DataArray(u.sum(axis=1).astype(np.int64), dims="step",
                           coords={"step": used["step"]}, name="working_set")
        out.attrs = {"units": "(layer, expert) pairs", "window": w,
                     "long_name": "expert working set"}
        return out

    def concentration(self, top: int | None = None, modality: str | None = None
                      ) -> xr.DataArray:
        """Share of each layer's routed-token mass taken by its ``top`` busiest experts.

        DataArray over ``layer``, fraction in [top/E, 1] (1 = everything on ``top`` experts);
        ``top`` defaults to the model's top-k. NaN for a layer with no routed tokens.
        """
        E = self._ds.sizes["expert"]
        n = self.top_k if top is None else top
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 1 <= n <= E:
            raise _bad("top", top, f"None or an int in 1..{E} (experts per layer)")
        c = self.expert_counts(modality)
        v = np.sort(c.values, axis=1)[:, ::-1]
        tot = v.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(tot > 0, v[:, :n].sum(axis=1) / tot, np.nan)
        return xr.DataArray(share, dims="layer", coords={"layer": c["layer"]},
                            name="concentration",
                            attrs={"units": "fraction", "top": int(n),
                                   "modality": c.attrs["modality"],
                                   "long_name": f"routed-token share of the top-{n} experts"})

    def entropy(self, modality: str | None = None) -> xr.DataArray:
        """Shannon entropy of each layer's expert-usage distribution, in bits.

        DataArray over ``layer``, in [0, log2 E] (log2 E = perfectly uniform usage); NaN for a
        layer with no routed tokens.
        """
        c = self.expert_counts(modality)
        v = c.values.astype(float)
        tot = v.sum(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            p = v / tot
            h = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)
        h = np.where(tot[:, 0] > 0, h, np.nan)
        return xr.DataArray(h, dims="layer", coords={"layer": c["layer"]}, name="entropy",
                            attrs={"units": "bits", "modality": c.attrs["modality"],
                                   "long_name": "expert-usage entropy"})

    def inactive_experts(self, modality: str | None = None) -> xr.DataArray:
        """Experts of each layer that received no routed token (int64 over ``layer``)."""
        c = self.expert_counts(modality)
        out = (c == 0).sum("expert").astype(np.int64)
        out.name = "inactive_experts"
        out.attrs = {"units": "experts", "modality": c.attrs["modality"],
                     "long_name": "experts with zero routed tokens"}
        return out

    def layer_similarity(self, modality: str | None = None) -> xr.DataArray:
        """Inter-layer routing similarity, DataArray [layer, layer2] in [0, 1].

        VisMMOE (Fig. 4) reports "inter-layer routing similarity" without a formula, so this uses:
        for every routed token t, S(t, l) = its set of top-k experts at layer l (``topk_ids``,
        -1 padding ignored); similarity(l, m) = mean over tokens of the Jaccard overlap
        |S(t, l) ∩ S(t, m)| / |S(t, l) ∪ S(t, m)|, over tokens routed at both layers. Expert ids
        are compared by index across layers (expert e of layer l vs expert e of layer m), so
        the consecutive-layer similarity ``np.diagonal(sim, 1)`` measures how much a token's
        routing carries over to the next layer. The diagonal is 1; NaN where no token counts.
        """
        name = self._modality(modality)
        ids = np.asarray(self._ds["topk_ids"].transpose("token", "layer", "k").values)
        if name is not None:
            code = self._modalities.index(name)
            ids = ids[np.asarray(self._ds["token_modality"].values) == code]
        T, L, _ = ids.shape
        E = self._ds.sizes["expert"]
        total = np.zeros((L, L))
        count = np.zeros((L, L))
        chunk = max(1, (1 << 21) // (L * (E + 1)))  # ≈ 8 MB of one-hot per chunk
        for s in range(0, T, chunk):
            blk = ids[s:s + chunk].astype(np.int64)
            blk = np.where((blk < 0) | (blk >= E), E, blk)  # padding → a dropped column
            b = blk.shape[0]
            onehot = np.zeros((b, L, E + 1), np.float32)
            onehot[np.arange(b)[:, None, None], np.arange(L)[None, :, None], blk] = 1.0
            onehot = onehot[..., :E]
            size = onehot.sum(-1).astype(np.float64)  # [b, L]
            inter = (onehot @ onehot.transpose(0, 2, 1)).astype(np.float64)  # [b, L, L], exact
            union = size[:, :, None] + size[:, None, :] - inter
            valid = (size[:, :, None] > 0) & (size[:, None, :] > 0)
            total += np.where(valid, inter / np.maximum(union, 1), 0.0).sum(0)
            count += valid.sum(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            sim = np.where(count > 0, total / count, np.nan)
        layer = self._ds["layer"].values
        return xr.DataArray(
            sim, dims=("layer", "layer2"), coords={"layer": layer, "layer2": layer},
            name="layer_similarity",
            attrs={"units": "fraction", "modality": name or "all",
                   "long_name": "inter-layer routing similarity",
                   "definition": "mean over tokens of the Jaccard overlap of the token's top-k "
                                 "expert sets at the two layers"})

    # -- visual tokens (token compression, issue 5) ---------------------------------------
    def visual_tokens(self) -> xr.Dataset:
        """The prompt's merged visual tokens on their images' grids, kept or pruned.

        Dataset over ``visual_token`` (the image tokens of the prompt, in input order):
        ``image`` (index into the attrs ``images``), ``row`` and ``col`` (cell of that image's
        merged-token grid, row 0 at the top, col 0 at the left; see
        :func:`merged_token_cells`), ``kept`` (False: pruned after the pinned prefix by token
        compression; all True without compression) and ``token`` (position on the store's
        ``token`` dim). Attrs ``grids``: JSON ``[[rows, cols], …]`` per image.

        Needs the attrs ``image_grid_thw`` and ``spatial_merge_size`` (recorded by every live
        run) and the variables ``token_modality`` and ``kept``; a store without them, or whose
        image-token count disagrees with the grids, raises :class:`InputError` naming it.
        """
        ds = self._ds
        missing = [a for a in ("image_grid_thw", "spatial_merge_size") if a not in ds.attrs]
        missing += [v for v in ("token_modality", "kept") if v not in ds.variables]
        if missing:
            raise InputError(
                f"this store lacks {', '.join(map(repr, missing))}, needed to place visual "
                f"tokens on the image (stores written before the image grid was recorded, or "
                f"imported traces, have no image layout); re-run the request to record it")
        from workbench.telemetry.metadata import RunMetadata

        meta = RunMetadata.from_attrs(ds.attrs, strict=False)
        meta.check("image_grid_thw", "spatial_merge_size")  # StoreError naming a bad one
        grids = [list(g) for g in meta.image_grid_thw]
        merge = meta.spatial_merge_size
        image, row, col, shapes = merged_token_cells(grids, merge)
        if "image" not in self._modalities:
            raise InputError(f"this store has no 'image' modality (it has "
                             f"{', '.join(self._modalities)})")
        code = self._modalities.index("image")
        token = np.flatnonzero(np.asarray(ds["token_modality"].values) == code)
        if token.size != image.size:
            raise InputError(
                f"the store has {token.size} image tokens but its image_grid_thw {grids} with "
                f"spatial_merge_size {merge} makes {image.size}; the store does not match its "
                f"image layout")
        kept = np.asarray(ds["kept"].values, bool)[token]
        return xr.Dataset(
            {"image": ("visual_token", image), "row": ("visual_token", row),
             "col": ("visual_token", col), "kept": ("visual_token", kept),
             "token": ("visual_token", token.astype(np.int64))},
            attrs={"grids": json.dumps(shapes), "spatial_merge_size": merge,
                   "description": "merged visual tokens of the prompt on their image grids; "
                                  "kept False = pruned after the pinned prefix"})

    def token_overlay(self, images: Sequence[Any] | None = None):
        """Kept vs pruned visual tokens drawn over the run's image(s) (plotly ``go.Figure``,
        :func:`workbench.viz.tokens.token_overlay_figure`). ``images`` (PIL images or paths)
        default to the image files recorded in the attrs ``images``; an image that cannot be
        opened (an in-memory PIL image of the run, a moved file) is drawn as a blank canvas of
        its grid, with a note saying why."""
        from workbench.viz.tokens import open_run_image, run_images, token_overlay_figure

        imgs = run_images(self._ds.attrs) if images is None else [open_run_image(i)
                                                                   for i in images]
        return token_overlay_figure(self.visual_tokens(), imgs)

    # -- lookahead predictor (issue 5) ---------------------------------------------------
    def hot_recall(self, k: int = 10, window: int | None = None, baseline: str | None = None,
                   steps: Any = None, phase: str | None = None) -> xr.DataArray:
        """Hot Recall@k of the run's lookahead predictor per MoE layer, a fraction in [0, 1].

        For step s and layer l: A = the experts (ids) any token of step s activated in layers
        l+1 … min(l+W, L−1) (from ``routed_tokens``; W = ``window``, default the run's knob
        ``window``), P = the predictor's top-``k`` of y_l (the first k of
        ``predicted_ids[s, l]``). The sample's recall is |P ∩ A| / |A|, computed by the same
        function as ``workbench calibrate`` (:func:`workbench.predictor.model.hot_recall`). A
        is the support of the training target g
        (:func:`workbench.predictor.features.window_targets`), so the decay γ plays no part;
        with ``window=1`` this is calibration's held-out per-layer figure, which scores layer
        l+1 only. The value at layer l is the mean over the selected steps (``steps``,
        ``phase`` as elsewhere) where the predictor ran at l and A is non-empty; NaN where
        there is none (the last layer always: nothing lies ahead of it).

        ``baseline="random"``: the expected recall of k experts drawn uniformly, min(k, E)/E,
        over the same samples; ``"oracle"``: the best any k experts can do, min(k, |A|)/|A|.
        Coordinates on ``layer``: ``pinned`` (always-resident prefix) and ``samples`` (steps
        averaged). Runs recorded without the predictor (``predicted_ids`` missing or all -1)
        raise :class:`InputError`.
        """
        from workbench.predictor.features import window_targets
        from workbench.predictor.model import hot_recall, oracle_recall, random_recall

        ds = self._ds
        ids_var = ds.get("predicted_ids")
        if ids_var is None or not bool((np.asarray(ids_var.values) >= 0).any()):
            raise InputError(
                "Hot Recall needs the lookahead predictor's predictions, and this run has none "
                "(store variable 'predicted_ids' is missing or all -1); record the run with "
                "predictor=vismmoe or prefetch=vismmoe")
        if baseline not in _RECALL_BASELINES:
            raise _bad("baseline", baseline, "None, 'random' or 'oracle'")
        order = PRED_ORDER if PRED_ORDER in ids_var.dims else LEGACY_PRED_ORDER  # (schema ≤ 3)
        B = int(ids_var.sizes[order])
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= B:
            raise _bad("k", k, f"an int in 1..{B} (the predictor's top-B recorded by this run, "
                               f"B = prefetch_budget)")
        if window is None:
            if "knob.window" not in ds.attrs:
                raise InputError("this store has no 'knob.window' attr; pass window=W (layers "
                                 "ahead)")
            from workbench.telemetry.metadata import RunMetadata

            window = RunMetadata.from_attrs(ds.attrs, strict=False).knobs.window
        if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 1:
            raise _bad("window", window, "None (the run's knob) or an int ≥ 1 (layers ahead)")
        ids = np.asarray(self._select(ids_var, steps, phase)
                         .transpose("step", "layer", order).values).astype(np.int64)
        routed = self._select(ds["routed_tokens"], steps, phase).sum("modality")
        active = np.asarray((routed > 0).transpose("step", "layer", "expert").values)
        S, L, E = active.shape
        ahead = np.stack([window_targets(a, int(window), 1.0) > 0 for a in active]) \
            if S else np.zeros((0, L, E), bool)
        A = ahead.reshape(S * L, E)
        if baseline is None:
            # the recorded order as scores: position r → B − r, experts not listed → −1, so
            # the top-k of the scores are exactly the first k recorded ids (k ≤ B)
            scores = np.full((S, L, E), -1.0)
            s_i, l_i, r_i = np.nonzero((ids >= 0) & (ids < E))
            scores[s_i, l_i, ids[s_i, l_i, r_i]] = B - r_i
            per = hot_recall(scores.reshape(S * L, E), A, int(k))
        else:
            per = (random_recall if baseline == "random" else oracle_recall)(A, int(k))
        per = per.reshape(S, L)
        per[~(ids >= 0).any(-1)] = np.nan  # the predictor did not run there
        n = np.isfinite(per).sum(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(n > 0, np.nansum(per, 0) / np.maximum(n, 1), np.nan)
        who = {None: "the predictor's top-k", "random": "k experts drawn uniformly (expected)",
               "oracle": "the best k experts (oracle)"}[baseline]
        return xr.DataArray(
            mean, dims="layer",
            coords={"layer": ds["layer"].values, "pinned": ("layer", self._pinned()),
                    "samples": ("layer", n.astype(np.int64))},
            name="hot_recall" if baseline is None else f"hot_recall_{baseline}",
            attrs={"units": "fraction", "k": int(k), "window": int(window),
                   "baseline": baseline or "none",
                   "long_name": f"Hot Recall@{k}",
                   "definition": f"share of the experts activated in layers l+1 … l+{window} of "
                                 f"the same step that are among {who} at layer l, mean over "
                                 f"steps"})

    # -- figures -----------------------------------------------------------------------------
    def heatmap(self, modality: str | None = "all", steps: Any = None, phase: str | None = None,
                normalize: bool = True):
        """Layer × expert heatmap (plotly ``go.Figure``) of :meth:`expert_counts`.

        ``normalize=True`` shows each layer's row as the share of that layer's routed tokens
        (rows sum to 1; an empty layer is blank); ``False`` shows raw token counts.
        """
        from workbench.viz.heatmap import expert_heatmap

        counts = self.expert_counts(modality, steps, phase)
        if normalize:
            tot = counts.sum("expert")
            shown = (counts / tot.where(tot > 0)).astype(float)
            shown.attrs = {**counts.attrs, "units": "share of layer's routed tokens"}
        else:
            shown = counts
        what = f"{counts.attrs['modality']} tokens" if modality not in (None, "all") \
            else "all tokens"
        parts = [what, f"{phase} phase" if phase else "all phases"]
        if steps is not None:
            parts.append(f"steps {_fmt_steps(steps)}")
        return expert_heatmap(shown, "routed tokens per expert — " + ", ".join(parts))

    # -- headline ----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Headline numbers of the run, computed from the data (works on a running store).

        Cache counts (``hits``, ``misses``, ``hit_rate``) cover offloaded layers only, as
        ``RunResult`` does; ``loads``/``evictions`` all layers. Times are seconds and bytes are
        bytes, each key saying whether it is *measured* (wall time / real copies here) or
        *modeled* (the hardware profile's timeline).
        """
        ds = self._ds
        off = xr.DataArray(~self._pinned(), dims="layer")
        hits = int(ds["hits"].where(off, 0).sum())
        misses = int(ds["misses"].where(off, 0).sum())
        phase = np.asarray(ds["phase"].values)
        prefill = phase == self._phases.index("prefill") if "prefill" in self._phases \
            else np.zeros_like(phase, bool)

        def tot(var: str, mask: np.ndarray | None = None) -> float:
            v = np.asarray(ds[var].values)
            return float(v[mask].sum() if mask is not None else v.sum())

        return {
            "status": ds.attrs.get("status"),
            "steps": int(ds.sizes.get("step", 0)),
            "tokens": int(ds.sizes.get("token", 0)),
            "hit_rate": hits / (hits + misses) if hits + misses else float("nan"),
            "hits": hits,
            "misses": misses,
            "loads": int(ds["loads"].sum()),
            "evictions": int(ds["evictions"].sum()),
            # hybrid mode: misses run on the host copy (0 in stores that predate it)
            "host_runs": int(ds["host_runs"].sum()) if "host_runs" in ds else 0,
            "latency_measured_s": tot("latency_measured_s"),
            "latency_modeled_s": tot("latency_modeled_s"),
            "prefill_latency_measured_s": tot("latency_measured_s", prefill),
            "prefill_latency_modeled_s": tot("latency_modeled_s", prefill),
            "stall_measured_s": tot("stall_measured_s"),
            "stall_modeled_s": tot("stall_modeled_s"),
            "transfer_bytes_measured": int(tot("transfer_bytes")),
            "transfer_bytes_modeled": int(tot("transfer_bytes_modeled")),
        }


    # -- tables and export ----------------------------------------------------------------------
    def per_step(self) -> Any:
        """One row per generation step (index ``step``): ``phase``; ``hits``, ``misses`` and
        ``hit_rate`` over the offloaded layers (as :meth:`summary`); ``loads``, ``evictions``
        and ``prefetches`` over all layers; every per-step latency, stall and transfer-byte
        variable of the store, with its unit (``_s``: seconds, ``_bytes``/``bytes``: bytes;
        *measured* or *modeled* in the name). A tidy table of the store's numbers, derived."""
        import pandas as pd

        ds = self._ds
        off = xr.DataArray(~self._pinned(), dims="layer")
        codes = np.asarray(ds["phase"].values)
        names = list(self._phases)
        out = {"phase": [names[int(c)] if 0 <= int(c) < len(names) else str(c) for c in codes]}
        hits = ds["hits"].where(off, 0).sum("layer").values
        misses = ds["misses"].where(off, 0).sum("layer").values
        out.update(hits=hits, misses=misses)
        with np.errstate(invalid="ignore", divide="ignore"):
            out["hit_rate"] = np.where(hits + misses > 0, hits / np.maximum(hits + misses, 1), np.nan)
        for var in ("loads", "evictions", "prefetches"):
            if var in ds:
                out[var] = ds[var].sum("layer").values
        for var in ("latency_measured_s", "latency_modeled_s", "stall_measured_s", "stall_modeled_s",
                    "transfer_bytes", "transfer_bytes_modeled"):
            if var in ds:
                out[var] = np.asarray(ds[var].values)
        return pd.DataFrame(out, index=pd.Index(np.asarray(ds["step"].values), name="step"))

    def export(self, folder: str | Path, *, figures: Sequence[str] = ("html",)) -> list[Path]:
        """Write this run's tables and figures into ``folder`` (created if absent) and return
        the paths: ``summary.json`` (:meth:`summary`), ``per_step.csv`` (:meth:`per_step`),
        ``per_layer.csv`` (:meth:`io_metrics` by layer; times *modeled*), and, for each of
        ``figures`` (``"html"``: self-contained, interactive; ``"json"``: plotly's figure JSON),
        the expert heatmap, hit rate, latency and timeline figures. The store stays the source:
        exports are derived and can be re-made; each file is written whole (temporary name,
        then renamed), so a crash never leaves half a file under its real name."""
        from workbench.viz.heatmap import hit_rate_figure, latency_figure, timeline_figure

        bad = [f for f in figures if f not in ("html", "json")]
        if bad:
            raise _bad("figures", tuple(figures), "a list of 'html' and 'json'")
        from workbench.telemetry.destination import check_output_folder

        # the shared output check: '' (the current folder), blank names, dangling links and a
        # file in the way are refused before anything is computed or written
        out = check_output_folder(folder, "export folder")
        out.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []

        from workbench.telemetry.zarr_files import atomic_write

        def put(name: str, text: str) -> None:
            atomic_write(out / name, text.encode())  # the store's own whole-file writer
            written.append(out / name)

        put("summary.json", json.dumps(self.summary(), indent=2, default=str) + "\n")
        put("per_step.csv", self.per_step().to_csv())
        put("per_layer.csv", self.io_metrics(by="layer").to_dataframe().to_csv())
        figs = {"heatmap": self.heatmap(), "hit_rate": hit_rate_figure(self._ds),
                "latency": latency_figure(self._ds), "timeline": timeline_figure(self._ds)}
        for name, fig in figs.items():
            for fmt in figures:
                put(f"{name}.{fmt}", fig.to_html(include_plotlyjs=True, full_html=True) if fmt == "html"
                    else fig.to_json())
        return written

    def export_trace(self, path: str | Path, format: str | None = None,
                     overwrite: bool = False) -> dict:
        """Write this run's routing as a trace file (``.jsonl``, ``.npy`` or ``.wbtrace``;
        :func:`workbench.traces.export_trace`, which says what each format carries) and
        return what was written."""
        from workbench.traces import export_trace

        return export_trace(self._ds, path, format=format, overwrite=overwrite)

    # -- caching lab (issue 4): replay this run's routing under any cache/prefetch knobs -------
    def replay(self, knobs: Any = None, *, scope: str = "global", **knob_values: Any):
        """Replay this store's routing (:func:`workbench.replay_trace`): the run's own knobs
        unless ``knobs``/``knob_values`` change them. With unchanged knobs the result equals
        the live run (per step and layer; tested). Times are *modeled*."""
        from workbench.replay import replay_trace

        return replay_trace(self._ds, knobs, scope=scope, **knob_values)

    def io_metrics(self, by: str | None = None, *, scope: str = "global",
                   **knob_values: Any) -> Any:
        """ActiveEvict's I/O metrics and the bounds for this run (or for other knobs).

        ``by=None``: one dict — hit rate and share of the Belady hit rate, blocking and total I/O
        time (*modeled*, per the run's hardware profile), transfer bytes per token, redundant-
        transfer share, fetch precision and prefetch recall. ``by="layer"``: a Dataset of the
        per-layer figures (``hits``, ``misses``, ``hit_rate``, ``stall_s``, ``evictions``,
        ``redundant``, ``pinned``).
        """
        if by not in (None, "layer"):
            raise _bad("by", by, "None or 'layer'")
        res = self.replay(scope=scope, **knob_values)
        if by is None:
            return res.metrics()
        per = res.per_layer()
        return xr.Dataset({k: ("layer", np.asarray(v)) for k, v in per.items()},
                          coords={"layer": np.arange(len(per["hits"]))},
                          attrs={"times": "modeled", **{f"config.{k}": str(v)
                                                         for k, v in res.config.items()}})

    def eviction_share(self, sizes: Sequence[float] | None = None,
                       policies: Sequence[str] | None = None, extra_slots: Sequence[int] = (),
                       **knob_values: Any):
        """Share of Belady's hits per online eviction policy × cache size, prefill and decode
        apart, on this run's routing (:func:`workbench.analysis.eviction_study.share_study`: a
        global pool, nothing pinned unless ``knob_values`` say; ``sizes`` shares of the experts,
        default 5–50 %). One DataFrame row per (policy, size, phase); draw one phase with
        :func:`~workbench.analysis.eviction_study.share_figure`."""
        from workbench.analysis.eviction_study import DEFAULT_SIZES, share_study

        return share_study({str(self._ds.attrs.get("run_id", "run")): self._ds}, policies,
                           DEFAULT_SIZES if sizes is None else sizes, extra_slots,
                           **knob_values)

    # -- expert parallelism (issue 14) ---------------------------------------------------------
    #: knobs an EP view may change beside ranks and placement (EPLB's schedule)
    EP_VIEW_KNOBS = ("eplb_window", "eplb_interval", "num_redundant_experts")

    def _ep_knobs(self, ranks: int | None, placement: str | None,
                  pricing: dict[str, str | None] | None = None, **eplb: Any) -> Any:
        """The run's recorded EP knobs, changed by ``ranks`` / ``placement``, EPLB's
        ``eplb_window`` / ``eplb_interval`` / ``num_redundant_experts`` and ``pricing``
        (``profile`` / ``interconnect`` / ``target_model``: what the clock prices the recorded
        routing as; None keeps the run's), each checked (one line naming the bad value)."""
        from workbench.knobs import Knobs
        from workbench.sim.profiles import get_interconnect, get_profile, get_target_model

        bad = sorted(set(eplb) - set(self.EP_VIEW_KNOBS))
        if bad:
            raise InputError(f"an EP view takes {', '.join(self.EP_VIEW_KNOBS)} beside ranks "
                             f"and placement, not {bad[0]!r}")
        pricing = {n: v for n, v in (pricing or {}).items() if v is not None}
        for name, get in (("profile", get_profile), ("interconnect", get_interconnect),
                          ("target_model", get_target_model)):
            if name in pricing:
                get(pricing[name])  # KnobError: the value and the registered names
        k = Knobs.from_attrs(self._ds.attrs)
        values = {n: v for n, v in (("ep_ranks", ranks), ("placement", placement),
                                    *eplb.items()) if v is not None}
        values.update(pricing)
        return k.set(**values)  # k is this call's own: set in place, checked as copy() would

    def ep_load(self, ranks: int | None = None, placement: str | None = None,
                modality: str | None = None, effective: bool = False,
                **eplb: Any) -> xr.DataArray:
        """Routed (token, expert) assignments each expert-parallel rank receives, int64
        ``[step, layer, rank]``, with ``ranks`` ranks under ``placement`` (default: the run's
        ``ep_ranks`` / ``placement`` knobs). ``modality``: only that modality's tokens. Ranks
        are virtual (:mod:`workbench.sim.ep`): each expert's ``routed_tokens`` go to the rank
        owning it — so any rank count or placement reads the store as recorded, also while it
        is being written. After a capacity-aware dispatch these are the kept assignments
        (:meth:`ep_dropped` the others). ``effective``: MACS's effective load instead — the
        semantic weights w(x) of the assignments (``effective_load``; float; equal to the
        counts in a run without MACS). ``placement="eplb"``: EPLB's plans over the run
        (``eplb``: ``eplb_window``, ``eplb_interval``, ``num_redundant_experts``, default the
        run's knobs), each replica serving its share (float)."""
        if effective:
            out = self._per_rank("effective_load", ranks, placement, modality, "ep_load",
                                 **eplb)
            out.attrs["units"] = "weighted token-expert assignments (MACS effective load)"
            return out
        return self._per_rank("routed_tokens", ranks, placement, modality, "ep_load", **eplb)

    def ep_dropped(self, ranks: int | None = None, placement: str | None = None,
                   modality: str | None = None, **eplb: Any) -> xr.DataArray:
        """The assignments a capacity-aware dispatch dropped, per ``[step, layer, rank]`` of
        the expert they were taken from (``dispatch_dropped``; 0 without a dispatch)."""
        return self._per_rank("dispatch_dropped", ranks, placement, modality, "ep_dropped",
                              **eplb)

    def ep_rerouted(self, ranks: int | None = None, placement: str | None = None,
                    modality: str | None = None, **eplb: Any) -> xr.DataArray:
        """The assignments MACS rerouted, per ``[step, layer, rank]`` of the expert they left
        (``dispatch_rerouted``; 0 without a rerouting dispatch)."""
        return self._per_rank("dispatch_rerouted", ranks, placement, modality, "ep_rerouted",
                              **eplb)

    def dispatch_rates(self) -> dict[str, Any]:
        """Drop and reroute rates of the run's dispatch, over all tokens and per modality:
        ``{"all": {"assigned", "dropped", "rerouted", "drop_rate", "reroute_rate"}, <modality>:
        …}``. Assigned = what the router chose = kept (``routed_tokens`` of the router's own
        experts) + dropped; a rerouted assignment is kept on another expert. Expanded Drop's
        added pairs count in ``routed_tokens``: its assigned figure is then an upper bound."""
        ds = self._ds
        routed = ds["routed_tokens"].sum(("step", "layer", "expert"))
        dropped = ds["dispatch_dropped"].sum(("step", "layer", "expert"))
        rer = ds["dispatch_rerouted"].sum(("step", "layer", "expert"))
        out: dict[str, Any] = {}
        for name in ["all", *[str(m) for m in ds["modality"].values]]:
            sel = (lambda v: int(v.sum())) if name == "all" else \
                (lambda v, n=name: int(v.sel(modality=n)))
            a = sel(routed) + sel(dropped)
            if name != "all" and a == 0:
                continue
            out[name] = {"assigned": a, "dropped": sel(dropped), "rerouted": sel(rer),
                         "drop_rate": sel(dropped) / a if a else None,
                         "reroute_rate": sel(rer) / a if a else None}
        return out

    def _per_rank(self, var: str, ranks: int | None, placement: str | None,
                  modality: str | None, name: str, **eplb: Any) -> xr.DataArray:
        from workbench.sim.ep import counts_per_rank
        from workbench.sim.placement import EP_PLACEMENT, rank_of_expert

        k = self._ep_knobs(ranks, placement, **eplb)
        if var not in self._ds:
            raise InputError(f"this store has no {var!r}; EP loads need it")
        counts = self._ds[var]  # [step, layer, expert, modality]
        m = self._modality(modality)
        counts = counts.sel(modality=m) if m is not None else counts.sum("modality")
        E, R = counts.sizes["expert"], int(k.ep_ranks)
        if EP_PLACEMENT.get(k.placement).dynamic:  # EPLB: the plans fitted on the whole
            # traffic serve this view too
            sched, load, _ = self._eplb_schedule(k)
            out = (load.copy() if var == "routed_tokens" and m is None
                   else sched.served_under_plans(counts.values, 0))
        else:
            out = counts_per_rank(counts.values, rank_of_expert(k.placement, E, R), R)
        return xr.DataArray(out, dims=("step", "layer", "rank"),
                            coords={"step": counts["step"].values,
                                    "layer": np.arange(out.shape[1]), "rank": np.arange(R)},
                            name=name, attrs={"units": "token-expert assignments",
                                              "placement": k.placement, "ranks": R})

    def _eplb_schedule(self, k: Any, price=None):
        """EPLB (``placement`` = eplb, knobs ``eplb_window``, ``eplb_interval``,
        ``num_redundant_experts``) served over this run's routing: ``(schedule, load [S, L,
        R], compute [S, L, R] or None)``; rebalances priced with the run's expert bytes on its
        interconnect (*modeled*). Kept per settings on this accessor: a view asks for the
        loads per modality, the clock and the title of one schedule (the Dataset is fixed)."""
        from workbench.sim.eplb_replay import EPLBSchedule
        from workbench.sim.profiles import get_interconnect

        key = (int(k.ep_ranks), int(k.num_redundant_experts), int(k.eplb_window),
               int(k.eplb_interval), k.profile, k.target_model, k.interconnect,
               price is not None)
        memo = self.__dict__.setdefault("_eplb_memo", {})
        if key in memo:
            return memo[key]
        counts = self._ds["routed_tokens"].sum("modality").values
        S, L, E = counts.shape
        cost = self._prices(k.profile, k.target_model).cost
        sched = EPLBSchedule(L, E, int(k.ep_ranks), int(k.num_redundant_experts),
                             int(k.eplb_window), int(k.eplb_interval),
                             expert_bytes=float(cost.expert_bytes) if cost is not None else 0.0,
                             link=get_interconnect(k.interconnect), price=price)
        load, compute = sched.serve(counts)
        if len(memo) >= 8:  # a few settings at a time (a dashboard's knob changes)
            memo.pop(next(iter(memo)))
        for arr in (load, compute):
            if arr is not None:  # shared by later calls: never written in place
                arr.flags.writeable = False
        memo[key] = (sched, load, compute)
        return memo[key]

    def ep_imbalance(self, ranks: int | None = None, placement: str | None = None,
                     modality: str | None = None, **eplb: Any) -> xr.DataArray:
        """Imbalance max/mean over ranks per ``[step, layer]`` (NaN where nothing was
        routed); balancedness as vLLM reports it is its inverse."""
        from workbench.sim.ep import imbalance

        load = self.ep_load(ranks, placement, modality, **eplb)
        return xr.DataArray(imbalance(load.values), dims=("step", "layer"),
                            coords={"step": load["step"].values, "layer": load["layer"].values},
                            name="ep_imbalance")

    def ep_times(self, ranks: int | None = None, placement: str | None = None,
                 overlap: bool | None = None, convert: bool = True,
                 profile: str | None = None, interconnect: str | None = None,
                 target_model: str | None = None, **eplb: Any) -> xr.Dataset:
        """The modeled EP clock of every (step, layer) (MACS Fig. 3): ``dispatch_s`` and
        ``combine_s`` [step, layer] (the all-to-alls, the busiest receiver's bytes on the
        ``interconnect``), ``compute_s`` [step, layer, rank] (each rank's experts, priced
        like the cache clock), ``load`` [step, layer, rank] and ``moe_layer_s`` [step, layer]
        = dispatch + the slowest rank + combine. All *modeled*; 0 where nothing was routed
        (or no hidden-state size is known: stores older than the cost spec's). From the
        per-expert ``routed_tokens`` (the dashboard's in-memory run has no per-token routing):
        the same figures :meth:`ep_summary` sums.

        A ReaLB run (``balance`` ≠ none): the experts it ran low (``low_precision``) are
        priced in the run's ``low_precision`` (the profile's rate; native where it has none),
        and ``switch_s`` [step, layer] is its online weight conversion
        (:func:`workbench.sim.realb.switch_s`; 0 for FP4-All, quantised offline), hidden
        under the dispatch (``max``) or after it with ``realb-seq`` (``+``); ``overlap``
        True / False prices the same run either way (ReaLB vs ReaLB-seq: the same
        decisions); ``convert`` False: the low-precision copies were kept beside the native
        weights (no online conversion, only the metadata; a second, 4.5-bit copy of each
        expert in memory).

        ``profile`` / ``interconnect`` / ``target_model``: price the recorded routing (and
        its recorded low-precision experts) as on that GPU, link and model instead of the
        run's own knobs — the same clock, e.g. one batch's routing over several hardware
        profiles (``workbench.analysis.regimes``)."""
        from workbench.sim.costs import Prices
        from workbench.sim.ep import counts_per_rank, phase_s
        from workbench.sim.placement import EP_PLACEMENT, rank_of_expert
        from workbench.sim.profiles import get_interconnect, get_profile
        from workbench.sim.realb import ONLINE_SWITCH, SEQUENTIAL, balances, switch_s

        k = self._ep_knobs(ranks, placement, {"profile": profile, "interconnect": interconnect,
                                              "target_model": target_model}, **eplb)
        counts = np.asarray(self._ds["routed_tokens"].sum("modality").values, np.int64)
        S, L, E = counts.shape
        R = int(k.ep_ranks)
        owner = rank_of_expert(k.placement, E, R)  # KnobError for a bad R or placement
        # the run's own cost spec (or the target model's): the per-expert counts priced as
        # the cache clock prices them (an expert no token reached costs nothing)
        prices = self._prices(k.profile, k.target_model)
        load = counts_per_rank(counts, owner, R).astype(np.float64)
        low = np.asarray(self._ds["low_precision"].values, bool) \
            if balances(k.balance) else np.zeros(counts.shape, bool)
        rebalance = np.zeros(S)
        if EP_PLACEMENT.get(k.placement).dynamic:  # replicas: each on its share;
            # rebalances on their own lane
            sched, load, comp = self._eplb_schedule(
                k, price=prices.expert if prices.available else None)
            if comp is None:
                comp = np.zeros(load.shape)
            for r in sched.rebalances:
                rebalance[r["step"]] += r["seconds"]
        elif prices.available:
            per_expert = np.where(counts > 0, Prices.many(prices.expert, counts).reshape(
                counts.shape), 0.0)
            if low.any():  # the experts ReaLB ran low, in their precision
                low_p = Prices.many(prices.expert_in(k.low_precision), counts[low])
                per_expert[low] = np.asarray(low_p).reshape(-1)
            comp = counts_per_rank(per_expert, owner, R)
        else:
            comp = np.zeros(load.shape)
        hidden = float(prices.cost.activation_bytes_per_token) if prices.available else 0.0
        link = get_interconnect(k.interconnect)
        disp = (phase_s(load.reshape(-1, R), hidden, link)
                .reshape(S, L) if hidden > 0 else np.zeros((S, L)))
        switch = np.zeros((S, L))
        if prices.available and k.balance in ONLINE_SWITCH:
            # the gate keeps ReaLB idle (no metadata, no conversion) on small layer calls
            gated = np.asarray(self._ds["realb_gated"].values, bool)
            meta = link.all_to_all_s((R - 1) * E * 4.0)  # allgather of the per-expert loads
            converted = counts_per_rank(low.astype(np.float64), owner, R) if convert \
                else np.zeros((S, L, R))
            switch = np.where(gated, switch_s(
                get_profile(k.profile), prices.cost.expert_bytes, converted, k.low_precision,
                meta), 0.0)
        # ReaLB hides the conversion under the dispatch; ReaLB-seq waits for both
        if overlap is not None and not isinstance(overlap, (bool, np.bool_)):
            raise InputError(f"overlap must be True, False or None (the run's own), not "
                             f"{overlap!r}")
        if overlap is None:
            overlap = k.balance not in SEQUENTIAL
        front = np.maximum(disp, switch) if overlap else disp + switch
        coords = {"step": self._ds["step"].values, "layer": np.arange(L), "rank": np.arange(R)}
        return xr.Dataset(
            {"load": (("step", "layer", "rank"), load),
             "compute_s": (("step", "layer", "rank"), comp,
                           {"units": "s (modeled)", "long_name": "rank's expert compute"}),
             "dispatch_s": (("step", "layer"), disp, {"units": "s (modeled)"}),
             "combine_s": (("step", "layer"), disp.copy(), {"units": "s (modeled)"}),
             "rebalance_s": (("step",), rebalance,
                             {"units": "s (modeled)",
                              "long_name": "EPLB's weight movement at the step's rebalance"}),
             "switch_s": (("step", "layer"), switch,
                          {"units": "s (modeled)",
                           "long_name": "ReaLB's online precision conversion"}),
             "moe_layer_s": (("step", "layer"), front + disp + comp.max(-1),
                             {"units": "s (modeled)"})},
            coords=coords, attrs={"ranks": R, "placement": k.placement,
                                  "interconnect": k.interconnect, "clock": "modeled"})

    def eplb(self, ranks: int | None = None, redundant: int = 0, window: int = 16,
             interval: int = 8, num_groups: int = 1, num_nodes: int = 1):
        """EPLB over this run (:func:`workbench.sim.eplb_replay.eplb_over_time`): a plan of
        ``redundant`` extra expert slots per layer over ``ranks`` ranks (default the run's
        ``ep_ranks``), refitted every ``interval`` steps on the last ``window`` steps' loads
        and scored on the steps it serves; rebalances priced with the run's expert bytes on
        its ``interconnect`` (*modeled*). Returns the :class:`EPLBResult` (its ``summary()``:
        static vs EPLB imbalance, bytes moved, modeled rebalance time)."""
        from workbench.sim.eplb_replay import eplb_over_time
        from workbench.sim.profiles import get_interconnect

        k = self._ep_knobs(ranks, None)
        for name, v, lo in (("redundant", redundant, 0), ("window", window, 1),
                            ("interval", interval, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise InputError(f"{name} must be a whole number ≥ {lo}, not {v!r}")
        counts = self._ds["routed_tokens"].sum("modality").values
        prices = self._prices(k.profile, k.target_model)
        cost = prices.cost
        return eplb_over_time(counts, int(k.ep_ranks), int(redundant), int(window),
                              int(interval), num_groups=num_groups, num_nodes=num_nodes,
                              expert_bytes=float(cost.expert_bytes) if cost is not None else 0.0,
                              link=get_interconnect(k.interconnect),
                              price=prices.expert if prices.available else None,
                              hidden_bytes=float(cost.activation_bytes_per_token)
                              if cost is not None else 0.0)

    def realb(self, mode: str = "realb", ranks: int | None = None,
              placement: str | None = None, precision: str = "nvfp4", profile: str = "b200",
              gate: float = 0.0, **controller: Any) -> dict[str, Any]:
        """ReaLB over this run's recorded routing (:func:`workbench.sim.realb.realb_over_time`;
        *modeled*, nothing reruns): per (step, layer) the controller's decision from the
        per-rank loads and vision ratios (``routed_tokens`` by modality), each rank's experts
        priced in its precision on ``profile`` (default ``b200``, which has FP4), the slowest
        rank native vs decided. ``mode``: ``realb``, ``fixed`` (``fixed_m=0`` ReaLB-m1, 0.7
        m2), ``all`` (FP4-All), ``none``; ``controller``: ``c``, ``tau``, ``m0``, ``fixed_m``…
        Returns the arrays and ``speedup_modeled`` (Σ native slowest / Σ decided slowest over
        the MoE layers), ``low_share`` (of (step, layer, rank) cells in low precision) and
        ``supported`` (whether the profile has the precision: else no speedup is priced).
        ``mode`` may also be a ``balance`` knob setting (``fp4-all``, ``realb-m1``…)."""
        from workbench.sim.placement import rank_of_expert
        from workbench.sim.profiles import get_profile
        from workbench.precision import PRECISIONS
        from workbench.sim.realb import BALANCES, MODES, ReaLB, realb_over_time

        if precision not in PRECISIONS or precision == "native":
            raise InputError(f"precision must be one of "
                             f"{', '.join(p for p in PRECISIONS if p != 'native')}, not "
                             f"{precision!r}")
        allowed = ("c", "tau", "m0", "decrease", "increase", "fixed_m")
        bad = sorted(set(controller) - set(allowed))
        if bad:
            raise InputError(f"ds.moe.realb takes the controller settings {', '.join(allowed)}"
                             f", not {bad[0]!r}")
        if isinstance(mode, str) and mode not in MODES and mode in BALANCES:
            mode, fixed = BALANCES[mode]
            controller.setdefault("fixed_m", fixed)
        k = self._ep_knobs(ranks, placement)
        R = int(k.ep_ranks)
        rt = self._ds["routed_tokens"]
        counts = rt.sum("modality").values
        visual = (rt.sum("modality") - rt.sel(modality="text", drop=True)).values \
            if "text" in [str(m) for m in rt["modality"].values] else np.zeros_like(counts)
        S, L, E = counts.shape
        prices = self._prices(profile, k.target_model)
        out = realb_over_time(counts, visual, rank_of_expert(k.placement, E, R), R,
                              ReaLB(L, R, mode, gate=gate, **controller), prices.expert,
                              prices.expert_in(precision))
        native, decided = float(out["compute_native_s"].sum()), float(out["compute_s"].sum())
        out.update(speedup_modeled=native / decided if decided > 0 else None,
                   low_share=float(out["low"].mean()) if out["low"].size else 0.0,
                   supported=get_profile(profile).supports(precision), mode=mode,
                   profile=profile, precision=precision, ranks=R)
        return out

    def realb_state(self, mode: str | None = None, **realb: Any) -> xr.Dataset:
        """ReaLB's per-rank state [step, layer, ep_rank]: ``m`` (M_d the decision used),
        ``ib`` (IB_d), ``vision`` (R_vd), ``low`` (the rank ran low), and [step, layer]
        ``gated`` and ``ib_global``. ``mode`` None: what the run's live controller recorded
        (``realb_*`` arrays; a run with ``balance`` = none has none: give a ``mode``);
        a ``mode``: the controller run over the recorded routing (:meth:`realb`, *modeled*;
        ``realb`` keywords: ``ranks``, ``placement``, ``tau``, ``gate``…). ``attrs``:
        ``source`` and ``tau``."""
        from workbench.knobs import Knobs

        k = Knobs.from_attrs(self._ds.attrs)
        if mode is None:
            ds = self._ds
            if bool(np.isnan(ds["realb_m"].values).all()):
                raise InputError("this run had no ReaLB controller (balance = none): give a "
                                 "mode ('realb', 'fixed', 'all', 'none') to run it over the "
                                 "recorded routing")
            out = xr.Dataset({n: ds[f"realb_{n}"] for n in ("m", "ib", "vision", "low",
                                                              "gated")})
            out["ib_global"] = out["ib"].max("ep_rank")
            out.attrs.update(source=f"recorded live (balance = {k.balance})",
                             tau=float(k.realb_tau))
            return out
        realb.setdefault("tau", float(k.realb_tau))
        realb.setdefault("c", float(k.realb_c))
        realb.setdefault("gate", float(k.realb_gate))
        r = self.realb(mode, **realb)
        dims3, dims2 = ("step", "layer", "ep_rank"), ("step", "layer")
        out = xr.Dataset({"m": (dims3, r["m"]), "low": (dims3, r["low"]),
                          "ib": (dims3, r["ib"]), "vision": (dims3, r["vision"]),
                          "gated": (dims2, r["gated"]), "ib_global": (dims2, r["ib_global"])})
        out.attrs.update(source=f"modeled: the controller ({mode}) over the recorded routing",
                         tau=float(realb["tau"]))
        return out

    def plot_realb(self, layer: int | None = None, mode: str | None = None, **realb: Any):
        """M_d of every rank over the steps at one MoE ``layer`` (default: the first
        offloaded one), with the steps where IB_global > τ shaded and the ranks that ran low
        marked (seed 004 Fig. 9): :meth:`realb_state` (recorded, or ``mode`` over the recorded
        routing)."""
        from workbench.viz.ep import realb_m_figure

        st = self.realb_state(mode, **realb)
        if layer is None:
            pinned = self._ds["pinned"].values if "pinned" in self._ds else None
            off = np.nonzero(~pinned)[0] if pinned is not None else []
            layer = int(off[0]) if len(off) else 0
        L = st.sizes["layer"]
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < L:
            raise InputError(f"layer must be in 0 … {L - 1}, not {layer!r}")
        one = st.isel(layer=int(layer))
        return realb_m_figure(one["m"].values, one["ib_global"].values, one["low"].values,
                              st.attrs["tau"], f"ReaLB M_d per rank, layer {layer} — "
                              f"{st.attrs['source']}")

    def _prices(self, profile: str, target_model: str):
        """The modeled clock's prices of this run on ``profile``: the target model's sizes,
        else the cost spec the run recorded (``Prices.available`` False without either)."""
        from types import SimpleNamespace

        from workbench.replay.engine import cost_of
        from workbench.sim.costs import Prices

        cost, prof = cost_of(SimpleNamespace(attrs=dict(self._ds.attrs)), profile, target_model,
                           None)
        return Prices(prof, cost)

    def ep_summary(self, ranks: int | None = None, placement: str | None = None) -> dict:
        """The EP figures of ``workbench replay --set ep_ranks=R`` for this run (imbalance,
        balancedness, imbalance ratio, max rank load, per-rank shares, per modality, the
        modeled EP layer times): :func:`workbench.replay.ep.ep_replay`."""
        from workbench.knobs import ModelShape
        from workbench.replay.ep import ep_replay, summary_prices
        from workbench.traces import from_store

        k = self._ep_knobs(ranks, placement)  # (a new Knobs, no one else's)
        tr = from_store(self._ds)
        return ep_replay(tr, k, summary_prices(k, tr, ModelShape.of(tr)))


def merged_token_cells(grid_thw: Sequence[Sequence[int]], spatial_merge_size: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int]]]:
    """Where each merged visual token of a Qwen-VL prompt lies on its image.

    ``grid_thw``: per image the processor's patch grid ``(t, h, w)`` (``image_grid_thw``);
    ``spatial_merge_size`` m: the vision tower merges m × m patches into one language-model
    token. Returns ``(image, row, col, grids)``: per visual token, in the order the prompt
    holds them, its image index and cell on that image's ``(h/m) × (w/m)`` grid, and
    ``grids = [[h/m, w/m], …]``. Tokens are row-major per image, images one after another:
    the processor flattens patches as [h/m, w/m, m, m] and the merger joins m² consecutive
    ones (``Qwen2VLImageProcessor.patchify``), and the M-RoPE positions of the tokens are the
    same raster (``get_vision_position_ids``; ``tests/test_ui.py`` checks it against the
    model's own ``get_rope_index``). The processor resizes the whole image to ``(h·p, w·p)``
    pixels (no crop), so cell (r, c) covers rows r/(h/m) … (r+1)/(h/m) of the image height
    and likewise columns. Only images (t = 1): a video grid raises :class:`InputError`.
    """
    m = int(spatial_merge_size)
    if m < 1:
        raise _bad("spatial_merge_size", spatial_merge_size, "an int ≥ 1")
    image, row, col, grids = [], [], [], []
    for i, g in enumerate(grid_thw):
        t, h, w = (int(v) for v in g)
        if t != 1:
            raise InputError(f"image {i} has a temporal grid of {t} (a video); only images "
                             f"(t = 1) are placed on a grid")
        if h % m or w % m:
            raise InputError(f"image {i}'s patch grid {h}×{w} is not a multiple of "
                             f"spatial_merge_size {m}")
        rows, cols = h // m, w // m
        r, c = np.divmod(np.arange(rows * cols), cols)
        image.append(np.full(rows * cols, i))
        row.append(r)
        col.append(c)
        grids.append([rows, cols])
    cat = (lambda parts: np.concatenate(parts).astype(np.int64) if parts
           else np.zeros(0, np.int64))
    return cat(image), cat(row), cat(col), grids


def _fmt_steps(steps: Any) -> str:
    if isinstance(steps, slice):
        a = "" if steps.start is None else steps.start
        b = "" if steps.stop is None else steps.stop
        return f"{a}–{b}"
    return str(steps)
