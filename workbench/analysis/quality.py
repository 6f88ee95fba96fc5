"""Quality cost of a routing change (budget-aware dynamic top-k): reference vs modified run.

Dynamic top-k (ActiveEvict §3.4, knob ``dynamic_topk``) is the only knob of the live runtime
that changes routing and therefore the model's outputs. :func:`compare_runs` measures what it
costs on one request:

1. **reference**: the request with the given knobs and ``dynamic_topk=False``, greedy; every
   next-token distribution is recorded (the scores ``generate`` picks the token from);
2. **modified**: the same knobs with ``dynamic_topk=True``, **teacher-forced** on the reference
   tokens (a logits processor records the scores, then forces the reference token), so both runs
   see the same sequence and their distributions align position by position;
3. per generated position: top-1 agreement (argmax equal) and KL(reference ‖ modified) of the
   softmax distributions (float64; clamped at 0 against rounding).

With ``dynamic_topk=False`` the modified configuration *is* the reference configuration, so its
distributions are the reference's (computed once): agreement is exactly 1.0 and KL exactly 0.0.
Both runs go through :meth:`workbench.Runtime.run` (offloading, cache, ActiveEvict as configured),
so their :class:`~workbench.runtime.runtime.RunResult` also show the I/O side of the trade-off
(misses, loads, stall). Sampling is always off here (teacher forcing follows the greedy
reference).

    >>> rep = rt.quality("what color is the circle?", images=[img], active_evict=True)
    >>> rep.agreement, rep.kl_mean, rep.reference.misses, rep.modified.misses
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["QualityReport", "compare_runs", "compare_distributions"]


class _Recorder:
    """transformers logits processor: records each step's scores; with ``tokens``, forces the
    i-th step to choose ``tokens[i]`` (teacher forcing)."""

    def __init__(self, tokens: Sequence[int] | None = None) -> None:
        self.tokens = list(tokens) if tokens is not None else None
        self.scores: list[np.ndarray] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.scores.append(scores[0].detach().to("cpu", torch.float64).numpy().copy())
        if self.tokens is None:
            return scores
        i = len(self.scores) - 1
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[min(i, len(self.tokens) - 1)]] = 0.0
        return forced


def compare_distributions(ref_scores: Sequence[np.ndarray], mod_scores: Sequence[np.ndarray]
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Per position: (top-1 agreement bool, KL(softmax(ref) ‖ softmax(mod)) ≥ 0)."""
    n = min(len(ref_scores), len(mod_scores))
    agree = np.zeros(n, bool)
    kl = np.zeros(n, np.float64)
    for i in range(n):
        r = torch.as_tensor(ref_scores[i], dtype=torch.float64)
        m = torch.as_tensor(mod_scores[i], dtype=torch.float64)
        lr, lm = torch.log_softmax(r, -1), torch.log_softmax(m, -1)
        pr = lr.exp()
        terms = torch.where(pr > 0, pr * (lr - lm), torch.zeros_like(pr))
        kl[i] = max(float(terms.sum()), 0.0)
        agree[i] = int(torch.argmax(r)) == int(torch.argmax(m))
    return agree, kl


@dataclass
class QualityReport:
    """Reference (dynamic top-k off) vs modified run of one request, position by position."""

    agreement: float  # share of positions whose top-1 token agrees, in [0, 1]
    kl_mean: float  # mean KL(reference ‖ modified), nats, ≥ 0
    kl_max: float
    positions: int
    reference_tokens: list[int]
    reference: Any  # RunResult
    modified: Any  # RunResult (teacher-forced; is `reference` when dynamic_topk is off)
    knobs: dict[str, Any] = field(default_factory=dict)  # the modified run's knobs
    agree: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    kl: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def to_json(self) -> dict[str, Any]:
        return {"agreement": self.agreement, "kl_mean": self.kl_mean, "kl_max": self.kl_max,
                "positions": self.positions, "reference_tokens": self.reference_tokens,
                "kl": self.kl.tolist(), "agree": self.agree.tolist(),
                "reference": self.reference.to_json(), "modified": self.modified.to_json(),
                "knobs": self.knobs}

    def summary(self) -> str:
        r, m = self.reference, self.modified
        return (f"dynamic top-k quality over {self.positions} positions: top-1 agreement "
                f"{self.agreement:.1%}, KL(ref ‖ mod) mean {self.kl_mean:.4g} max "
                f"{self.kl_max:.4g} nats\n"
                f"I/O: misses {r.misses} → {m.misses}, loads {r.loads} → {m.loads}, stall "
                f"(modeled) {r.stall_modeled_s * 1e3:.2f} → {m.stall_modeled_s * 1e3:.2f} ms")


def compare_runs(runtime, prompt, images: Sequence[Any] = (), *, dynamic_topk: bool = True,
                 **knob_values: Any) -> QualityReport:
    """Quality cost of ``dynamic_topk`` on one request (see the module docstring).

    ``runtime`` is a :class:`workbench.Runtime`; ``knob_values`` apply to both runs (e.g.
    ``cache_slots``, ``active_evict``, ``k_max``); only ``dynamic_topk`` differs. Nothing is
    recorded to a store.
    """
    knob_values.pop("sampling", None)
    common = dict(knob_values, sampling=False, record=False)
    ref_rec = _Recorder()
    reference = runtime.run(prompt, images, dynamic_topk=False, logits_processor=[ref_rec],
                            **common)
    tokens = list(reference.token_ids)
    if dynamic_topk:
        mod_rec = _Recorder(tokens)
        common["max_new_tokens"] = max(len(tokens), 1)
        modified = runtime.run(prompt, images, dynamic_topk=True, logits_processor=[mod_rec],
                               **common)
        mod_scores = mod_rec.scores
    else:  # the same configuration: the reference is its own modified run
        modified, mod_scores = reference, ref_rec.scores
    ref_scores = ref_rec.scores[:len(tokens)]
    agree, kl = compare_distributions(ref_scores, mod_scores)
    n = len(kl)
    return QualityReport(
        agreement=float(agree.mean()) if n else 1.0, kl_mean=float(kl.mean()) if n else 0.0,
        kl_max=float(kl.max()) if n else 0.0, positions=n, reference_tokens=tokens,
        reference=reference, modified=modified, knobs=modified.knobs, agree=agree, kl=kl)
