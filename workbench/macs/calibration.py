"""MACS calibration: expert classes and centroids from a calibration set (seed 002 App. A.2–3).

``workbench calibrate-macs`` runs the model's own forward (prefill) over calibration requests
— generated scenes and text puzzles of a seed disjoint from the held-out split by default —
and, for every MoE layer, counts each expert's routed tokens by modality and sums the MoE
inputs z of the tokens routed to it. From these:

- f_j^m = share of modality-m tokens whose top-k holds expert j (eq. 12), Δ_j = f_j^vis −
  f_j^txt (eq. 13), m_j = +1 (visual) if Δ_j ≥ threshold (0.1), −1 (text) if ≤ −threshold,
  else 0 (shared) — :func:`workbench.sim.macs.expert_classes`;
- μ_k = mean of the z routed to expert k (eq. 14); an expert no calibration token reached has
  a zero centroid (its cosine is 0: it ranks by router probability alone).

Files (a folder; never overwritten silently): ``macs.safetensors`` (``classes`` int8 [L, E],
``delta`` / ``freq_visual`` / ``freq_text`` float32 [L, E], ``centroids`` float16 [L, E, D],
``counts`` int64 [L, E]) and ``macs.json`` (format, model id, config hash, threshold, requests,
token counts). :func:`load` checks both before anything is used (sizes, shapes against the
model, dtypes, finite values, classes in {−1, 0, 1}). No pickle anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from workbench.errors import InputError
from workbench.fileio import read_json, shorten

FORMAT = "workbench-macs-calibration/1"
WEIGHTS = "macs.safetensors"
CONFIG = "macs.json"
#: largest macs.json read (a real one is under a kilobyte)
MAX_CONFIG_BYTES = 1 << 20
#: most centroid features read (a 10⁵-wide hidden state is far beyond any model here; a
#: header claiming more is refused before its data is read)
MAX_CENTROID_FEATURES = 1 << 16
#: seed of the calibration requests by default (disjoint from the held-out and demo seeds)
CALIBRATION_SEED = 20_251_126
_TENSORS = {"classes": ("I8", 2), "delta": ("F32", 2), "freq_visual": ("F32", 2),
            "freq_text": ("F32", 2), "centroids": ("F16", 3), "counts": ("I64", 2)}


@dataclass
class MacsCalibration:
    """Expert classes and centroids of one model (see the module docstring)."""

    classes: np.ndarray  # int8 [L, E]: +1 visual, −1 text, 0 shared
    delta: np.ndarray  # float32 [L, E]
    freq_visual: np.ndarray  # float32 [L, E]
    freq_text: np.ndarray  # float32 [L, E]
    centroids: np.ndarray  # float [L, E, D]
    counts: np.ndarray  # int64 [L, E]: calibration tokens routed to each expert
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.classes.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.classes.shape[1])

    def summary(self) -> dict[str, Any]:
        c = self.classes
        return {"visual_experts": int((c == 1).sum()), "text_experts": int((c == -1).sum()),
                "shared_experts": int((c == 0).sum()), "layers": self.num_layers,
                "experts": self.num_experts, **{k: self.meta[k] for k in (
                    "visual_tokens", "text_tokens", "requests", "threshold") if k in self.meta}}


def workspace_path(config_hash: str) -> Path:
    """Where ``workbench calibrate-macs`` writes by default: ``<workspace>/macs/<config hash>``."""
    from workbench.options import get_options

    return Path(get_options()["workspace"]) / "macs" / str(config_hash)


def default_path(model_dir: str | Path, config_hash: str) -> Path:
    """The calibration a run uses when ``macs_calibration`` is None: the workspace's, else one
    shipped beside the model (``<model dir>/workbench/macs``), else the workspace path (whose
    "no calibration" error then says to calibrate into it). A ``macs.json`` that is there but
    not a regular file is chosen all the same, so that loading it says what is wrong with it."""
    mine, shipped = workspace_path(config_hash), Path(model_dir) / "workbench" / "macs"
    for candidate in (mine, shipped):
        # anything named macs.json is that folder's calibration: a FIFO, a device or a broken
        # link there is refused by :func:`load` naming it, never silently passed over
        if os.path.lexists(candidate / CONFIG):
            return candidate
    return mine


def calibration_requests(n: int = 64, seed: int = CALIBRATION_SEED):
    """A balanced calibration set: ``n`` requests, half text-only puzzles and half image
    requests (scenes and digit strips) of the embedded model's task generator."""
    from workbench.models.batches import mixed_batch

    return mixed_batch(n, text_share=0.5, seed=seed)


def calibrate(lm, requests: Sequence[Any], threshold: float = 0.1, batch_size: int = 8,
              progress=None) -> MacsCalibration:
    """Run ``lm``'s forward (prefill) over ``requests`` in batches and build the calibration
    (module docstring). ``lm``: a :class:`~workbench.models.loading.LoadedModel`.
    ``progress("calibration requests", done, total)`` after each batch
    (:mod:`workbench.progress`)."""
    import torch

    from workbench.models.hooks import prefill_experts

    lay = lm.layout
    L, E = lay.num_layers, lay.num_experts
    if not requests:
        raise InputError("the MACS calibration needs at least one request")
    if not 0.0 < float(threshold) < 1.0:
        raise InputError(f"the class threshold must be in (0, 1), not {threshold!r}")
    routed = np.zeros((L, E, 3), np.int64)
    tokens = np.zeros(3, np.int64)
    sums: list[torch.Tensor | None] = [None] * L
    state: dict[str, Any] = {}

    def on_experts(b, hs, idx):
        mod = state["modality"]
        ids = idx.detach().cpu().numpy().astype(np.int64)
        t, r = np.nonzero((ids >= 0) & (ids < E))
        np.add.at(routed[b.index], (ids[t, r], mod[t]), 1)
        z = hs.detach().float()
        if sums[b.index] is None:
            sums[b.index] = torch.zeros(E, z.shape[-1], dtype=torch.float64)
        onehot = torch.zeros(z.shape[0], E, dtype=torch.float64)
        onehot[torch.as_tensor(t), torch.as_tensor(ids[t, r])] = 1.0
        sums[b.index] += onehot.T @ z.double().cpu()

    def on_batch(inputs, valid):
        nonlocal tokens
        mod = np.clip(inputs.modality[valid].astype(np.int64), 0, 2)
        state["modality"] = mod
        tokens += np.bincount(mod, minlength=3)

    prefill_experts(lm, requests, batch_size, on_experts, on_batch, progress,
                    "calibration requests")
    from workbench.sim.macs import expert_classes

    classes, delta = expert_classes(routed, tokens, threshold)
    n_text, n_vis = max(int(tokens[0]), 1), max(int(tokens[1:].sum()), 1)
    counts = routed.sum(-1)
    D = next((s.shape[1] for s in sums if s is not None), 1)
    cent = np.zeros((L, E, D), np.float32)
    for l, s in enumerate(sums):
        if s is not None:
            cent[l] = (s.numpy() / np.maximum(counts[l], 1)[:, None]).astype(np.float32)
    return MacsCalibration(
        classes=classes, delta=delta,
        freq_visual=(routed[..., 1:].sum(-1) / n_vis).astype(np.float32),
        freq_text=(routed[..., 0] / n_text).astype(np.float32),
        centroids=cent.astype(np.float16), counts=counts,
        meta={"format": FORMAT, "model_id": lm.model_id, "config_hash": lm.config_hash,
              "threshold": float(threshold), "requests": len(requests),
              "visual_tokens": int(tokens[1:].sum()), "text_tokens": int(tokens[0])})


def save(cal: MacsCalibration, out: str | Path, overwrite: bool = False) -> Path:
    """Write ``cal`` into folder ``out`` (created); an existing calibration there is replaced
    only with ``overwrite`` (each file written to a temporary name, then renamed)."""
    from workbench.tensorfiles import save_folder

    tensors = {"classes": cal.classes.astype(np.int8), "delta": cal.delta.astype(np.float32),
               "freq_visual": cal.freq_visual.astype(np.float32),
               "freq_text": cal.freq_text.astype(np.float32),
               "centroids": cal.centroids.astype(np.float16),
               "counts": cal.counts.astype(np.int64)}
    return save_folder(out, WEIGHTS, CONFIG, tensors, {**cal.meta, "format": FORMAT}, FORMAT,
                       "MACS calibration", overwrite)


def load(path: str | Path, num_layers: int | None = None, num_experts: int | None = None,
         config_hash: str | None = None, hidden_size: int | None = None) -> MacsCalibration:
    """The calibration in folder ``path``, checked (module docstring) and against a model of
    ``num_layers`` × ``num_experts`` (and ``config_hash``, and centroids of ``hidden_size``)
    when given — all from the header, before any tensor is read; :class:`InputError` naming
    the file and what is wrong otherwise."""
    from workbench.errors import ModelLoadError
    from workbench.models.loading import read_safetensors_header, safetensors_budget
    from workbench.tensorfiles import load_weights

    path = Path(path)
    where = f"MACS calibration in {str(path)!r}"
    cfg = path / CONFIG
    if not os.path.lexists(cfg):
        raise InputError(f"no {where} (no {CONFIG}); run `workbench calibrate-macs` for the "
                         f"model (or set macs_calibration to a calibration folder)")
    meta = read_json(cfg, MAX_CONFIG_BYTES, f"{where}: {CONFIG}")
    if meta.get("format") != FORMAT:
        raise InputError(f"{where}: {CONFIG} is not a {FORMAT} file (its format is "
                         f"{shorten(meta.get('format'))})")
    try:  # refuses a FIFO or device before it is opened
        header = read_safetensors_header(path / WEIGHTS)
    except ModelLoadError as e:
        raise InputError(f"{where}: {e}") from None
    if set(header) != set(_TENSORS):
        raise InputError(f"{where}: {WEIGHTS} holds {shorten(sorted(header))}, expected "
                         f"{sorted(_TENSORS)}")
    shapes = {}
    for name, (dtype, ndim) in _TENSORS.items():
        info = header[name]
        if info["dtype"] != dtype or len(info["shape"]) != ndim:
            raise InputError(f"{where}: tensor {name!r} is {info['dtype']} "
                             f"{shorten(list(info['shape']))}, expected {dtype} with {ndim} "
                             f"dims")
        shapes[name] = tuple(info["shape"])
    L, E = shapes["classes"]
    if any(shapes[n][:2] != (L, E) for n in _TENSORS):
        raise InputError(f"{where}: its tensors disagree on [layers, experts] = [{L}, {E}]")
    D = shapes["centroids"][2]
    if hidden_size is not None and D != hidden_size:
        raise InputError(f"{where}: its centroids have {D} features, this model's MoE input "
                         f"has {hidden_size}; calibrate it for this model")
    if D > MAX_CENTROID_FEATURES:
        raise InputError(f"{where}: its centroids have {D:,} features; at most "
                         f"{MAX_CENTROID_FEATURES:,} are read")
    if (num_layers is not None and L != num_layers) or \
            (num_experts is not None and E != num_experts):
        raise InputError(f"{where} is for {L} layers × {E} experts; this model has "
                         f"{num_layers} × {num_experts}; calibrate it for this model")
    if config_hash and meta.get("config_hash") and meta["config_hash"] != config_hash:
        raise InputError(f"{where} was made for config_hash={shorten(meta['config_hash'])} "
                         f"({shorten(meta.get('model_id', 'another model'))}), this model has "
                         f"{config_hash!r}; calibrate it for this model")
    t = load_weights(path, WEIGHTS, safetensors_budget(header))
    if not np.isin(t["classes"], (-1, 0, 1)).all():
        raise InputError(f"{where}: classes must be −1, 0 or +1")
    for n in ("delta", "freq_visual", "freq_text", "centroids"):
        if not np.isfinite(t[n]).all():
            raise InputError(f"{where}: tensor {n!r} holds NaN or infinite values")
    if (t["counts"] < 0).any():
        raise InputError(f"{where}: counts must be ≥ 0")
    return MacsCalibration(classes=t["classes"], delta=t["delta"],
                           freq_visual=t["freq_visual"], freq_text=t["freq_text"],
                           centroids=t["centroids"], counts=t["counts"], meta=meta)
