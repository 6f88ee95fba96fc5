"""Quality of elastic execution (issue 16 §2, *operating points*): teacher-forced negative
log-likelihood of given continuations, run through the runtime like any other run.

:func:`score` serves each request through :meth:`workbench.Runtime.run` — the offloader,
the expert cache, and MoE-Prism's sub-expert views (``prism=True``, ``prism_k_active``) or
any other knob installed exactly as for generation — and **teacher-forces** the given
continuation: at generated position i the model's next-token distribution is read and the
continuation's token i is forced, so position i + 1 sees the continuation's prefix. Per
position it keeps −log p(token_i | prompt, token_<i), in nats, from the model's *raw* logits
(a forward hook on the model reads them; they are not changed by generation's logits
processors, sampling or ``ignore_eos``), log-softmax in float64.

- ``continuations`` are text (tokenised with the model's tokenizer, no special tokens) or
  token ids. With ``eos=True`` (default) the end-of-sequence token is scored after each
  continuation too — the model has to *stop*, as an exact-match answer needs.
- Requests run in batches of ``batch_size`` (left-padded by the runtime, padding routed to no
  expert), grouped by continuation length so that no batch runs many forced steps for one
  long row; results come back in the caller's order.
- Top-k′ routing of the original model (dropping whole experts) is not a knob: install its
  hook around the call (``benchmarks/bench_prism_points.py::top_k_prime``); the scorer scores
  whatever the model computes.

    >>> s = score(rt, [Request("what is 7 times 8?", [])], ["5 6"], prism=True, prism_k_active=2)
    >>> s.nll[0], s.ppl, s.compute_share

Equal knobs give equal numbers; with every sub-expert active (``prism=True``, k_active = N)
the NLL equals the unmodified model's within float rounding (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from workbench.errors import InputError
from workbench.models.hooks import Hooks

__all__ = ["Scores", "score", "paired_nll"]

#: knobs the scorer sets itself (a value given for them is refused, naming it)
_OWN = ("max_new_tokens", "logits_processor", "sampling", "on_token", "stop")


@dataclass
class Scores:
    """Teacher-forced NLL of each continuation (nats per token, request order)."""

    nll: list[np.ndarray]  # per request: float64 [tokens scored]
    tokens: list[list[int]]  # per request: the token ids scored (the EOS included with eos)
    top1: list[np.ndarray] = field(default_factory=list)  # per request: bool, token = argmax
    subexperts_ran: int = 0  # MoE-Prism's (token, sub-expert) runs over all batches (0: off)
    subexperts_asked: int = 0  # … of routed experts' sub-experts (ran/asked: compute share)
    runs: list[Any] = field(default_factory=list)  # RunResult of each batch

    @property
    def sum_nll(self) -> np.ndarray:
        """float64 [requests]: each continuation's total NLL."""
        return np.array([float(x.sum()) for x in self.nll])

    @property
    def counts(self) -> np.ndarray:
        """int64 [requests]: tokens scored per continuation."""
        return np.array([len(x) for x in self.nll], np.int64)

    @property
    def exact(self) -> np.ndarray:
        """bool [requests]: every scored token was the model's argmax — greedy decoding would
        reproduce the continuation token for token (with ``eos``: and stop after it)."""
        return np.array([bool(x.all()) for x in self.top1])

    @property
    def mean_nll(self) -> float:
        """Mean NLL per token over every continuation (nats)."""
        return float(self.sum_nll.sum() / self.counts.sum())

    @property
    def ppl(self) -> float:
        """Perplexity: exp(mean NLL per token)."""
        return math.exp(self.mean_nll)

    @property
    def compute_share(self) -> float | None:
        """Share of the routed experts' sub-expert compute the runs ran (None: no MoE-Prism
        run, every routed expert ran whole)."""
        return self.subexperts_ran / self.subexperts_asked if self.subexperts_asked else None

    def to_json(self) -> dict[str, Any]:
        return {"mean_nll": self.mean_nll, "ppl": self.ppl, "compute_share": self.compute_share,
                "tokens": int(self.counts.sum()), "accuracy": float(self.exact.mean()),
                "sum_nll": self.sum_nll.tolist(), "counts": self.counts.tolist(),
                "exact": self.exact.tolist()}


def paired_nll(a: Scores, b: Scores) -> tuple[float, float]:
    """(Δ, SE): mean NLL per token of ``a`` minus ``b`` — the log of their perplexity ratio —
    and its standard error paired over continuations (each one a cluster of tokens: both
    scored the same tokens, so Δ = Σ_i d_i / Σ_i n_i with d_i the i-th continuation's NLL
    difference, SE = √m · sd(d) / Σ n). :class:`InputError` when they scored other tokens."""
    if a.tokens != b.tokens:
        raise InputError("paired_nll needs two scorings of the same continuations (their "
                         "token ids differ)")
    d = a.sum_nll - b.sum_nll
    n, m = float(a.counts.sum()), len(d)
    se = math.sqrt(m) * float(d.std(ddof=1)) / n if m > 1 else float("nan")
    return float(d.sum() / n), se


def _token_ids(tok, continuations: Sequence[Any], vocab: int, eos: int | None
               ) -> list[list[int]]:
    out = []
    for i, c in enumerate(continuations):
        if isinstance(c, str):
            ids = list(tok(c, add_special_tokens=False)["input_ids"])
        elif isinstance(c, (list, tuple, np.ndarray, torch.Tensor)):
            ids = [x.item() if hasattr(x, "item") else x for x in
                   (c.tolist() if hasattr(c, "tolist") else c)]
            bad = [x for x in ids if isinstance(x, bool) or not isinstance(x, (int, np.integer))]
            if bad:
                raise InputError(f"continuation {i}: token ids must be ints, not "
                                 f"{type(bad[0]).__name__} ({bad[0]!r})")
            ids = [int(x) for x in ids]
            out_of = [x for x in ids if not 0 <= x < vocab]
            if out_of:
                raise InputError(f"continuation {i}: token id {out_of[0]} is outside the "
                                 f"model's vocabulary 0 … {vocab - 1}")
        else:
            raise InputError(f"continuation {i} must be text (str) or a list of token ids, "
                             f"not {type(c).__name__}")
        if eos is not None and eos in ids:
            raise InputError(f"continuation {i} holds the end-of-sequence token {eos} at "
                             f"position {ids.index(eos)}; give the text without it (eos=True "
                             f"scores it after the continuation)")
        if not ids:
            raise InputError(f"continuation {i} is empty ({c!r}): nothing to score")
        out.append(ids)
    return out


class _Forcer:
    """Reads the raw last-position logits of every forward (a forward hook on the model),
    scores each row's target token and forces it (a logits processor); rows past their
    targets are forced to ``stop`` (EOS: the row finishes) and not scored."""

    def __init__(self, targets: list[list[int]], stop: int) -> None:
        self.targets, self.stop = targets, stop
        self.nll = [np.zeros(len(t)) for t in targets]
        self.top1 = [np.zeros(len(t), bool) for t in targets]
        self.step = 0
        self.logits: torch.Tensor | None = None

    def hook(self, module, args, kwargs, output) -> None:
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)) and output:
            logits = output[0]
        self.logits = logits[:, -1, :] if logits is not None else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        raw, i = self.logits, self.step
        if raw is None or raw.shape[0] != scores.shape[0]:
            raise RuntimeError("teacher forcing: the model's logits of this step were not seen "
                               "(its forward returned no logits)")
        self.logits = None
        lp = torch.log_softmax(raw.detach().to(torch.float64), -1).cpu()
        best = lp.argmax(-1)
        forced = torch.full_like(scores, float("-inf"))
        for b, t in enumerate(self.targets):
            if i < len(t):
                self.nll[b][i] = -float(lp[b, t[i]])
                self.top1[b][i] = int(best[b]) == t[i]
                forced[b, t[i]] = 0.0
            else:
                forced[b, self.stop] = 0.0
        self.step += 1
        return forced


def score(rt, requests: Sequence[Any], continuations: Sequence[Any], *, eos: bool = True,
          batch_size: int = 8, **knobs: Any) -> Scores:
    """Teacher-forced NLL of ``continuations[i]`` after ``requests[i]`` (module docstring).

    ``rt``: a :class:`workbench.Runtime`. ``requests``: :class:`~workbench.models.inputs.Request`
    items or prompt strings (text only). ``knobs``: any run knobs (``prism``,
    ``prism_k_active``, ``prism_refactoring``, ``cache_slots`` …), ``record`` (default False)
    and ``store``; ``max_new_tokens``, ``sampling`` and the generation callbacks are the
    scorer's own. Bad input raises :class:`InputError` naming the item at fault."""
    from workbench.models.inputs import MAX_BATCH, Request

    if not hasattr(rt, "run") or not hasattr(rt, "lm"):
        raise InputError(f"rt must be a workbench.Runtime, not {type(rt).__name__}")
    own = [k for k in _OWN if k in knobs]
    if own:
        raise InputError(f"score sets {own[0]} itself (teacher forcing); leave it out")
    if isinstance(requests, (str, Request)) or isinstance(continuations, str):
        raise InputError("requests and continuations must be lists (one continuation per "
                         "request); wrap a single one in a list")
    requests, continuations = list(requests), list(continuations)
    if len(requests) != len(continuations):
        raise InputError(f"{len(requests)} requests but {len(continuations)} continuations: "
                         f"give one continuation per request")
    if not requests:
        raise InputError("no requests to score: give at least one")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
            or not 1 <= batch_size <= MAX_BATCH:
        raise InputError(f"batch_size must be an int in 1 … {MAX_BATCH}, not {batch_size!r}")
    reqs = []
    for i, r in enumerate(requests):
        if isinstance(r, str):
            r = Request(r, [])
        if not isinstance(r, Request):
            raise InputError(f"request {i} must be a Request or a prompt (str), not "
                             f"{type(r).__name__}")
        reqs.append(r)
    lm = rt.lm
    tok = lm.tokenizer
    eos_ids = lm.model.generation_config.eos_token_id
    eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
    eos_id = eos_ids[0] if eos_ids else None
    if eos and eos_id is None:
        raise InputError(f"model {lm.model_id!r} has no end-of-sequence token: score with "
                         f"eos=False")
    vocab = int(lm.model.get_output_embeddings().weight.shape[0])
    ids = _token_ids(tok, continuations, vocab, eos_id)
    targets = [t + [eos_id] if eos else t for t in ids]
    stop = eos_id if eos_id is not None else (tok.pad_token_id or 0)
    order = sorted(range(len(reqs)), key=lambda i: len(targets[i]))
    out = Scores(nll=[np.zeros(0)] * len(reqs), tokens=targets,
                 top1=[np.zeros(0, bool)] * len(reqs))
    knobs = {"record": False, **knobs}
    for a in range(0, len(order), batch_size):
        idx = order[a:a + batch_size]
        forcer = _Forcer([targets[i] for i in idx], stop)
        with Hooks() as hooks:  # before the run's own: it reads the model's raw logits
            hooks.post(lm.model, forcer.hook, with_kwargs=True)
            res = rt.run([reqs[i] for i in idx], max_new_tokens=max(len(targets[i]) for i in idx),
                         sampling=False, logits_processor=[forcer], **knobs)
        for j, i in enumerate(idx):
            if forcer.step < len(targets[i]):  # a run stopped early (never by the scorer)
                raise RuntimeError(f"teacher forcing stopped after {forcer.step} of "
                                   f"{len(targets[i])} tokens of continuation {i}")
            out.nll[i], out.top1[i] = forcer.nll[j], forcer.top1[j]
        out.subexperts_ran += int(res.subexperts_ran or 0)
        out.subexperts_asked += int(res.subexperts_asked or 0)
        out.runs.append(res)
    return out
