"""The lookahead predictor network, its files and its metric.

Bottleneck MLP (SPEC §1b): ``z = ψ(W2 ψ(W1 x))``, ``y = Wo z ∈ R^E`` with
ψ = BatchNorm-ReLU-Dropout. Inputs are standardised with the calibration set's mean and std
(kept as buffers, saved with the weights).

Files (a directory, :func:`save` / :func:`load`): ``predictor.safetensors`` (every tensor of
the state dict, nothing executable) and ``predictor.json`` (the architecture and calibration
settings needed to rebuild the module, plus the calibration report). No pickle anywhere;
``torch.load`` is never used.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from workbench.errors import InputError

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


def load(path: str | Path) -> LookaheadPredictor:
    """Rebuild a saved predictor (eval mode). A missing or malformed directory raises
    :class:`InputError`."""
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / CONFIG).is_file() or not (p / WEIGHTS).is_file():
        raise InputError(f"{str(p)!r} holds no calibrated predictor ({CONFIG} + {WEIGHTS}); "
                         f"make one with `workbench calibrate --out {p}`")
    try:
        doc = json.loads((p / CONFIG).read_text())
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
        cfg = PredictorConfig(**doc["config"])
        pred = LookaheadPredictor(cfg)
        pred.load_state_dict(load_file(str(p / WEIGHTS)))
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as e:
        raise InputError(f"predictor in {str(p)!r} is not readable: {e}") from None
    return pred.eval()


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
