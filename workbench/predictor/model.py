"""The lookahead predictor network, its files and its metric.

Bottleneck MLP (VisMMOE §3.3): ``z = ψ(W2 ψ(W1 x))``, ``y = Wo z ∈ R^E`` with
ψ = BatchNorm-ReLU-Dropout. Inputs are standardised with the calibration set's mean and std
(kept as buffers, saved with the weights).

Files (a directory, :func:`save` / :func:`load`): ``predictor.safetensors`` (every tensor of
the state dict, nothing executable) and ``predictor.json`` (the architecture and calibration
settings needed to rebuild the module, plus the calibration report). No pickle anywhere;
``torch.load`` is never used.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from workbench.errors import InputError
from workbench.fileio import read_bytes_bounded, read_json, shorten

WEIGHTS = "predictor.safetensors"
CONFIG = "predictor.json"
FORMAT = "workbench-lookahead-predictor/1"


@dataclass
class PredictorConfig:
    num_layers: int
    num_experts: int
    hidden_size: int
    use_visual: bool = True
    window: int = 5
    decay: float = 0.8
    width: int = 128
    bottleneck: int = 64
    dropout: float = 0.1
    model_id: str = ""
    config_hash: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def in_dim(self) -> int:
        from workbench.predictor.features import feature_dim

        return feature_dim(self.num_layers, self.num_experts, self.hidden_size, self.use_visual)


def _psi(n: int, p: float) -> nn.Sequential:
    return nn.Sequential(nn.BatchNorm1d(n), nn.ReLU(), nn.Dropout(p))


class LookaheadPredictor(nn.Module):
    """``forward(x [n, D]) -> y [n, E]`` logits (σ(y) ≈ g)."""

    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.W1 = nn.Linear(cfg.in_dim, cfg.width)
        self.psi1 = _psi(cfg.width, cfg.dropout)
        self.W2 = nn.Linear(cfg.width, cfg.bottleneck)
        self.psi2 = _psi(cfg.bottleneck, cfg.dropout)
        self.Wo = nn.Linear(cfg.bottleneck, cfg.num_experts)
        self.register_buffer("x_mean", torch.zeros(cfg.in_dim))
        self.register_buffer("x_std", torch.ones(cfg.in_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.x_mean) / self.x_std
        z = self.psi2(self.W2(self.psi1(self.W1(x))))
        return self.Wo(z)

    @torch.no_grad()
    def scores(self, x: np.ndarray) -> np.ndarray:
        """σ(y) ``[n, E]`` in eval mode."""
        was = self.training
        self.eval()
        try:
            y = self(torch.as_tensor(np.atleast_2d(x), dtype=torch.float32))
        finally:
            self.train(was)
        return torch.sigmoid(y).numpy()


def save(pred: LookaheadPredictor, out: str | Path, report: dict | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in pred.state_dict().items()}
    save_file(sd, str(out / WEIGHTS), metadata={"format": FORMAT})
    doc = {"format": FORMAT, "config": asdict(pred.cfg), "report": report or {}}
    (out / CONFIG).write_text(json.dumps(doc, indent=1, default=float))
    return out


#: largest predictor.json read (a real one is a few kB: the config and the calibration report)
MAX_CONFIG_BYTES = 4 * 1024 * 1024
#: largest size (layers, experts, hidden size, widths, window) a predictor config may name
MAX_SIZE = 1 << 20
#: the config fields and what each must be: (type test, what is allowed)
_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SIZE,
        f"an integer between 1 and {MAX_SIZE:,}")
_FIELDS: dict[str, tuple[Any, str]] = {
    "num_layers": _INT, "num_experts": _INT, "hidden_size": _INT, "width": _INT,
    "bottleneck": _INT, "window": _INT,
    "use_visual": (lambda v: isinstance(v, bool), "true or false"),
    "decay": (lambda v: _real(v) and 0.0 < v <= 1.0, "a number with 0 < decay ≤ 1"),
    "dropout": (lambda v: _real(v) and 0.0 <= v < 1.0, "a number with 0 ≤ dropout < 1"),
    "model_id": (lambda v: isinstance(v, str) and len(v) <= 1000, "text"),
    "config_hash": (lambda v: isinstance(v, str) and len(v) <= 1000, "text"),
    "extra": (lambda v: isinstance(v, dict), "a JSON object"),
}
_REQUIRED = ("num_layers", "num_experts", "hidden_size")
#: safetensors dtypes a stored tensor may have, by the module's own dtype
_FLOAT_ST = ("F32", "F64", "F16", "BF16")
_INT_ST = ("I64", "I32")


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)


def read_config(path: str | Path) -> PredictorConfig:
    """The :class:`PredictorConfig` of the predictor folder ``path``, every field's type and
    range checked (nothing is built). Raises :class:`InputError` naming the folder and field."""
    p = Path(path)
    where = f"predictor in {str(p)!r}"
    doc = read_json(p / CONFIG, MAX_CONFIG_BYTES, f"{where}: {CONFIG}")
    if doc.get("format") != FORMAT:
        raise InputError(f"{where}: {CONFIG} has format {shorten(doc.get('format'))}, expected "
                         f"{FORMAT!r}")
    cfg = doc.get("config")
    if not isinstance(cfg, dict):
        raise InputError(f"{where}: {CONFIG} field 'config' is {shorten(cfg)}, expected an "
                         f"object")
    unknown = sorted(str(k) for k in cfg if k not in _FIELDS)
    if unknown:
        raise InputError(f"{where}: {CONFIG} has unknown config field {shorten(unknown[0])}; "
                         f"known: {', '.join(_FIELDS)}")
    for name in _REQUIRED:
        if name not in cfg:
            raise InputError(f"{where}: {CONFIG} lacks config field {name!r}")
    for name, value in cfg.items():
        ok, allowed = _FIELDS[name]
        if not ok(value):
            raise InputError(f"{where}: {CONFIG} field config.{name} is {shorten(value)}; it "
                             f"must be {allowed}")
    return PredictorConfig(**cfg)


def check_against_model(cfg: PredictorConfig, path: str | Path, lm: Any) -> None:
    """Refuse a predictor calibrated for another model than ``lm`` (a loaded model): MoE
    layers, experts per layer and, when both are known, the config hash. One line naming the
    folder, the field and both values."""
    lay = lm.layout
    where = f"predictor in {str(Path(path))!r}"
    for name, mine, theirs in (("num_layers", cfg.num_layers, lay.num_layers),
                               ("num_experts", cfg.num_experts, lay.num_experts)):
        if mine != theirs:
            raise InputError(
                f"{where} was calibrated for {name}={mine}, this model ({lm.model_id}) has "
                f"{theirs} ({cfg.num_layers} MoE layers × {cfg.num_experts} experts vs "
                f"{lay.num_layers} × {lay.num_experts}); run workbench calibrate for it")
    if cfg.config_hash and lm.config_hash and cfg.config_hash != lm.config_hash:
        raise InputError(
            f"{where} was calibrated for config_hash={cfg.config_hash!r} "
            f"({cfg.model_id or 'another model'}), this model ({lm.model_id}) has config_hash="
            f"{lm.config_hash!r}; run workbench calibrate for it")


def _check_tensors(cfg: PredictorConfig, path: Path) -> dict[str, dict[str, Any]]:
    """The weights file's header (read and checked on its own, nothing loaded) must hold exactly
    the tensors ``cfg`` describes, with their shapes and a fitting dtype; returns it."""
    from workbench.errors import ModelLoadError
    from workbench.models.loading import read_safetensors_header

    where = f"predictor in {str(path)!r}"
    try:
        stored = read_safetensors_header(path / WEIGHTS)
    except ModelLoadError as e:
        raise InputError(f"predictor {e}") from None  # "predictor weights in '…' could not …"
    with torch.device("meta"):  # shapes only, no memory
        wanted = {k: v for k, v in LookaheadPredictor(cfg).state_dict().items()}
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    if missing or extra:
        what = (f"lacks tensor {missing[0]!r}" if missing else f"has unexpected tensor "
                                                               f"{shorten(extra[0])}")
        n = len(missing) + len(extra)
        raise InputError(f"{where}: {WEIGHTS} {what}" + (f" (and {n - 1} more differences)"
                                                         if n > 1 else "")
                         + f"; it does not match {CONFIG}")
    for name, t in wanted.items():
        info = stored[name]
        if tuple(info["shape"]) != tuple(t.shape):
            field_ = _shape_field(name)
            raise InputError(
                f"{where}: tensor {name!r} in {WEIGHTS} has shape {shorten(list(info['shape']))}, "
                f"but "
                f"{CONFIG} (config {field_}) needs {list(t.shape)}; the files do not belong "
                f"together")
        allowed = _FLOAT_ST if t.is_floating_point() else _INT_ST
        if info["dtype"] not in allowed:
            raise InputError(f"{where}: tensor {name!r} in {WEIGHTS} is {info['dtype']}, "
                             f"expected one of {', '.join(allowed)}")
    return stored


def _shape_field(name: str) -> str:
    if name.startswith(("x_", "W1.weight")):
        return "num_layers, num_experts, hidden_size, use_visual" + (
            ", width" if name.startswith("W1") else "")
    if name.startswith(("W1", "psi1")):
        return "width"
    if name.startswith("W2.weight"):
        return "width, bottleneck"
    if name.startswith(("W2", "psi2")):
        return "bottleneck"
    if name.startswith("Wo.weight"):
        return "num_experts, bottleneck"
    return "num_experts"


def _check_values(pred: LookaheadPredictor, path: Path) -> None:
    """Every floating-point tensor finite; ``x_std`` > 0 and running variances ≥ 0."""
    where = f"predictor in {str(path)!r}"
    for name, t in pred.state_dict().items():
        if not t.is_floating_point():
            continue
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise InputError(f"{where}: tensor {name!r} holds NaN or inf ({bad:,} of "
                             f"{t.numel():,} values); the predictor is corrupt, calibrate it "
                             f"again")
    if not bool((pred.x_std > 0).all()):
        raise InputError(f"{where}: tensor 'x_std' holds values ≤ 0 (min "
                         f"{float(pred.x_std.min()):g}); standard deviations must be positive")
    for name in ("psi1.0.running_var", "psi2.0.running_var"):
        v = pred.state_dict()[name]
        if not bool((v >= 0).all()):
            raise InputError(f"{where}: tensor {name!r} holds negative variances (min "
                             f"{float(v.min()):g})")


def load(path: str | Path, model: Any = None) -> LookaheadPredictor:
    """Rebuild a saved predictor (eval mode). Everything is checked before the module is
    built: ``predictor.json`` (size, JSON, every config field's type and range), the
    safetensors header (readable, not truncated, exactly the tensors the config describes,
    their shapes and dtypes) and, given ``model`` (a loaded model), that the predictor was
    calibrated for it (:func:`check_against_model`); then the values (finite, positive
    standard deviations). Any fault raises :class:`InputError` naming the folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    from workbench.models.loading import safetensors_budget

    p = Path(path)
    # there but not a regular file (a FIFO, a directory): read_config / the reads below say so
    if not all(_exists(p / f) for f in (CONFIG, WEIGHTS)):
        raise InputError(f"{str(p)!r} holds no calibrated predictor ({CONFIG} + {WEIGHTS}); "
                         f"make one with `workbench calibrate --out {p}`")
    cfg = read_config(p)
    if model is not None:
        check_against_model(cfg, p, model)
    raw = read_bytes_bounded(p / WEIGHTS, safetensors_budget(_check_tensors(cfg, p)),
                             f"predictor in {str(p)!r}: {WEIGHTS}")
    try:
        pred = LookaheadPredictor(cfg)
        pred.load_state_dict(load(raw))
    except (ValueError, KeyError, TypeError, RuntimeError, OSError, SafetensorError) as e:
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise InputError(f"predictor in {str(p)!r} is not readable: {msg}") from None
    _check_values(pred, p)
    return pred.eval()


def _exists(p: Path) -> bool:
    try:
        return os.path.lexists(p)
    except (OSError, ValueError):  # name too long, permission denied on a parent …
        return False


def hot_recall(scores: np.ndarray, active: np.ndarray, k: int) -> np.ndarray:
    """Per sample: share of the activated experts (``active [n, E]`` bool) among the top-``k``
    of ``scores [n, E]`` (NaN where nothing is active). Ties by lower id."""
    n, E = scores.shape
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    hit = np.take_along_axis(active, order, axis=1).sum(1)
    tot = active.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, hit / np.maximum(tot, 1), np.nan)


def random_recall(active: np.ndarray, k: int) -> np.ndarray:
    """Expected Hot Recall@k of k experts drawn uniformly: min(k, E)/E (NaN where nothing is
    active)."""
    n, E = active.shape
    tot = active.sum(1)
    return np.where(tot > 0, min(k, E) / E, np.nan)


def oracle_recall(active: np.ndarray, k: int) -> np.ndarray:
    """Best possible Hot Recall@k: min(k, |E_{l+1}|)/|E_{l+1}| (1 when k covers them)."""
    tot = active.sum(1).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, np.minimum(k, tot) / np.maximum(tot, 1), np.nan)
