"""MoE-Prism's offline refactoring (issue 16 §1): profile → partition every expert → proxy gate,
saved beside the model as safetensors + JSON (no pickle; never overwritten silently).

A :class:`Refactoring` holds, per (layer, expert):

- ``perm`` int64 [L, E, I]: the neuron order that makes sub-expert n the contiguous slice
  n·I/N … (n+1)·I/N − 1 of the permuted fused tensors (rows of ``gate_up_proj``'s gate and up
  halves, columns of ``down_proj``);
- ``gates`` int64 [L, E, N, r]: each sub-expert's gate neurons (original neuron ids), the
  training-free proxy gate (:func:`workbench.prism.partition.gate_neurons`);
- the objective (seed eq. 2, on the profiled activations) of the annealed partition and of
  the greedy start, a random and the contiguous partition — ``objective_*`` float64 [L, E] —
  and the calibration tokens each expert saw (``tokens`` [L, E]).

The JSON header names the model (``model_id``, ``config_hash``), the shapes and the settings;
:func:`load` checks them (and that every ``perm`` row is a permutation and every gate neuron
lies in its sub-expert) before a run may use it, and refuses a refactoring made for another
model or expert shape naming both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from workbench.errors import InputError
from workbench.prism import partition as P

FORMAT = "workbench-prism-refactoring/1"
WEIGHTS, CONFIG = "prism.safetensors", "prism.json"
CALIBRATION_SEED = 424242
OBJECTIVES = ("contiguous", "random", "greedy", "annealed")


@dataclass
class Refactoring:
    """See the module docstring."""

    perm: np.ndarray
    gates: np.ndarray
    objective: dict[str, np.ndarray]
    tokens: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def subexperts(self) -> int:
        return int(self.meta["subexperts"])

    def summary(self) -> dict[str, Any]:
        """The objective summed over every expert per partition, and the annealed one's
        ratio to each (lower is better)."""
        tot = {k: float(v.sum()) for k, v in self.objective.items()}
        a = tot["annealed"]
        return {"objective": tot,
                "annealed_vs": {k: a / v if v > 0 else None for k, v in tot.items()
                                if k != "annealed"},
                "experts": int(self.tokens.size), "tokens_mean": float(self.tokens.mean())}


def default_path(model_dir, config_hash: str) -> Path:
    """Where a run looks when ``prism_refactoring`` is None: the workspace's
    ``prism/<config hash>`` (what ``workbench refactor`` writes), else one shipped beside the
    model (``<model dir>/workbench/prism``), else the workspace path (whose error then says to
    refactor into it)."""
    from workbench.options import get_options

    mine = Path(get_options()["workspace"]) / "prism" / str(config_hash)
    shipped = Path(model_dir) / "workbench" / "prism" if model_dir else None
    for candidate in (mine, shipped):
        if candidate is not None and (candidate / CONFIG).is_file():
            return candidate
    return mine


def run_path(lm, knobs) -> Path:
    """The folder of the refactoring a run of ``knobs`` reads: ``prism_refactoring``, else
    :func:`default_path`."""
    return Path(knobs.prism_refactoring) if knobs.prism_refactoring else \
        default_path(getattr(lm, "path", None), lm.config_hash)


def for_run(lm, knobs, loader: Callable[[Path, Any], Refactoring] | None = None
            ) -> tuple[Refactoring, int]:
    """The refactoring a run with ``prism=True`` uses and its k_active (None: all),
    checked: the refactoring is this model's, k_active within 1 … its sub-experts, prism_k
    (not with prism_k_active) within 1 … top-k × sub-experts. The runtime calls it when it
    checks its knobs (before any run starts: a sweep checks every point so) and again when a
    run sets up its sub-experts. ``loader``: what reads the folder (``load``'s signature and
    checks; None: :func:`load`), e.g. the runtime's, which keeps what it read."""
    if knobs.prism_k is not None and knobs.prism_k_active is not None:
        raise InputError(f"prism_k (the K best sub-experts of a token's routed experts) and "
                         f"prism_k_active (per expert) are two ways to choose: set one, not "
                         f"both (prism_k_active={knobs.prism_k_active}, "
                         f"prism_k={knobs.prism_k})")
    path = run_path(lm, knobs)
    if not (path / CONFIG).is_file():
        raise InputError(f"prism=True needs a MoE-Prism refactoring of {lm.model_id!r}; none "
                         f"at {str(path)!r} — run `workbench refactor` (or set "
                         f"prism_refactoring)")
    ref = (load if loader is None else loader)(path, lm)
    N = ref.subexperts
    k = N if knobs.prism_k_active is None else int(knobs.prism_k_active)
    if not 1 <= k <= N:
        raise InputError(f"prism_k_active must be in 1 … {N} (the refactoring's sub-experts "
                         f"per expert), not {knobs.prism_k_active}")
    K, top_k = knobs.prism_k, lm.layout.top_k
    if K is not None and not 1 <= K <= top_k * N:
        raise InputError(f"prism_k must be in 1 … {top_k * N} (top-k {top_k} × {N} "
                         f"sub-experts), not {K}")
    return ref, k


def calibration_requests(n: int = 64, seed: int = CALIBRATION_SEED, text_only: bool = False):
    """Balanced calibration requests of the embedded model's task generator (its own seed,
    not the held-out split's): half text-only, half image requests, or all text-only
    (``text_only``: for a text-only model)."""
    from workbench.models.batches import mixed_batch

    return mixed_batch(n, text_share=1.0 if text_only else 0.5, seed=seed)


def refactor(lm, requests: Sequence[Any], subexperts: int = 4, deactivated: int | None = None,
             r: int = 4, active: float = 0.75, iterations: int = P.ITERATIONS,
             max_tokens: int = 128, seed: int = 0, progress=None) -> Refactoring:
    """Profile ``lm`` over ``requests``, partition every expert into ``subexperts`` (greedy +
    annealing, K = ``deactivated``, default N // 2), pick ``r`` gate neurons each.
    ``progress(phase, done, total)`` (:mod:`workbench.progress`) follows the two long phases:
    "profiling requests" and "annealing experts"."""
    from workbench.prism.profile import neuron_activations, neuron_layout

    lay = lm.layout
    I, _ = neuron_layout(lay.blocks[0])
    t0 = time.perf_counter()
    M = neuron_activations(lm, requests, max_tokens=max_tokens, progress=progress)
    t_profile = time.perf_counter() - t0
    L, E = len(M), len(M[0])
    flat = [m for layer in M for m in layer]
    K = subexperts // 2 if deactivated is None else deactivated
    t0 = time.perf_counter()
    parts = P.anneal_many(flat, subexperts, K, iterations=iterations, seed=seed,
                          progress=progress)
    t_anneal = time.perf_counter() - t0
    perm = np.empty((L * E, I), np.int64)
    gates = np.empty((L * E, subexperts, r), np.int64)
    obj = {k: np.zeros(L * E) for k in OBJECTIVES}
    for i, (m, a) in enumerate(zip(flat, parts)):
        perm[i] = P.permutation(a, subexperts)
        gates[i] = P.gate_neurons(m, a, subexperts, r=r, active=active) if len(m) \
            else perm[i].reshape(subexperts, -1)[:, :r]
        for k, part in (("contiguous", P.contiguous(I, subexperts)),
                        ("random", P.random_partition(I, subexperts, seed + i)),
                        ("greedy", P.greedy(m, subexperts)), ("annealed", a)):
            obj[k][i] = P.objective(m, part, subexperts, K) if len(m) else 0.0
    return Refactoring(
        perm=perm.reshape(L, E, I), gates=gates.reshape(L, E, subexperts, r),
        objective={k: v.reshape(L, E) for k, v in obj.items()},
        tokens=np.array([[len(m) for m in layer] for layer in M], np.int64),
        meta={"format": FORMAT, "model_id": lm.model_id, "config_hash": lm.config_hash,
              "layers": L, "experts": E, "neurons": I, "subexperts": subexperts,
              "deactivated": K, "gate_neurons": r, "active": active, "iterations": iterations,
              "t0": P.T0, "cooling": P.COOLING, "max_tokens": max_tokens, "seed": seed,
              "requests": len(requests), "profile_s": t_profile, "anneal_s": t_anneal})


def random_refactoring(lm, subexperts: int = 4, r: int = 2, seed: int = 0) -> Refactoring:
    """A valid refactoring of ``lm`` from random partitions, no profiling (each sub-expert's
    first ``r`` neurons its gate): for exactness tests and speed benchmarks, where any
    partition serves; its objectives are 0 (not measured)."""
    from workbench.prism.profile import neuron_layout

    lay = lm.layout
    L, E, I = lay.num_layers, lay.num_experts, neuron_layout(lay.blocks[0])[0]
    P.check_problem(np.zeros((1, I)), subexperts, subexperts // 2)
    perm = np.stack([np.stack([P.permutation(P.random_partition(I, subexperts,
                                                                seed + 97 * l + e), subexperts)
                               for e in range(E)]) for l in range(L)])
    gates = perm.reshape(L, E, subexperts, I // subexperts)[..., :r].copy()
    return Refactoring(
        perm=perm, gates=gates, objective={k: np.zeros((L, E)) for k in OBJECTIVES},
        tokens=np.zeros((L, E), np.int64),
        meta={"format": FORMAT, "model_id": lm.model_id, "config_hash": lm.config_hash,
              "layers": L, "experts": E, "neurons": I, "subexperts": subexperts,
              "gate_neurons": r, "random": True, "seed": seed})


def random_control(lm, ref: Refactoring, requests: Sequence[Any]) -> Refactoring:
    """The control of ``ref``: random partitions (seeded per expert), each sub-expert's gate
    neurons picked by the proxy gate's rule on the activations profiled over ``requests``
    (so only the partition differs from an annealed refactoring). Objectives are ``ref``'s
    (not recomputed)."""
    from workbench.prism.profile import neuron_activations

    M = neuron_activations(lm, requests)
    N, I, r = ref.subexperts, ref.meta["neurons"], ref.gates.shape[-1]
    rnd = Refactoring(perm=np.empty_like(ref.perm), gates=np.empty_like(ref.gates),
                      objective={k: v.copy() for k, v in ref.objective.items()},
                      tokens=ref.tokens.copy(), meta={**ref.meta, "control": "random"})
    for l in range(lm.layout.num_layers):
        for e in range(lm.layout.num_experts):
            part = P.random_partition(I, N, 1000 * l + e)
            rnd.perm[l, e] = P.permutation(part, N)
            m = M[l][e]
            rnd.gates[l, e] = P.gate_neurons(m, part, N, r=r) if len(m) \
                else rnd.perm[l, e].reshape(N, -1)[:, :r]
    return rnd


def save(ref: Refactoring, out: str | Path, overwrite: bool = False) -> Path:
    """Write ``ref`` into folder ``out`` (created); an existing refactoring there is replaced
    only with ``overwrite`` (each file written to a temporary name, then renamed)."""
    from workbench.tensorfiles import save_folder

    tensors = {"perm": ref.perm, "gates": ref.gates, "tokens": ref.tokens,
               **{f"objective_{k}": v.astype(np.float64) for k, v in ref.objective.items()}}
    return save_folder(out, WEIGHTS, CONFIG, tensors, ref.meta, FORMAT,
                       "MoE-Prism refactoring", overwrite)


def load(path: str | Path, lm=None) -> Refactoring:
    """The refactoring in folder ``path``, checked (module docstring); with ``lm`` also that
    it was made for this model and expert shape. :class:`InputError` naming what is wrong."""
    from workbench.fileio import shorten
    from workbench.tensorfiles import load_header, load_weights

    path = Path(path)
    meta, (L, E, I, N, r) = load_header(
        path, CONFIG, FORMAT, "MoE-Prism refactoring",
        ("layers", "experts", "neurons", "subexperts", "gate_neurons"))
    if I % N or r > I // N:
        raise InputError(f"{str(path / CONFIG)!r}: {N} sub-experts must divide the {I} "
                         f"neurons with at least {r} each")
    if lm is not None:
        lay = lm.layout
        from workbench.prism.profile import neuron_layout

        mine = (lay.num_layers, lay.num_experts, neuron_layout(lay.blocks[0])[0])
        if meta.get("config_hash") != lm.config_hash or (L, E, I) != mine:
            raise InputError(
                f"the refactoring in {str(path)!r} was made for "
                f"{shorten(meta.get('model_id'))} (config {shorten(meta.get('config_hash'))}, "
                f"{L} layers × {E} experts × {I} neurons), "
                f"not for {lm.model_id!r} (config {lm.config_hash}, {mine[0]} × {mine[1]} × "
                f"{mine[2]})")
    want = {"perm": (L, E, I), "gates": (L, E, N, r), "tokens": (L, E),
            **{f"objective_{k}": (L, E) for k in OBJECTIVES}}
    budget = 8 * sum(int(np.prod(s)) for s in want.values()) + (1 << 20)
    t = load_weights(path, WEIGHTS, budget)
    for k, s in want.items():
        if k not in t or t[k].shape != s:
            raise InputError(f"{str(path / WEIGHTS)!r}: {k} must have shape {s}, not "
                             f"{None if k not in t else t[k].shape}")
    # the kinds first, before any cast or arithmetic: a NaN cast to int warns (and means
    # nothing), so the file's fault is named instead
    for k in ("perm", "gates", "tokens"):
        if t[k].dtype.kind not in "iu":
            raise InputError(f"{str(path / WEIGHTS)!r}: {k} must hold whole numbers (an "
                             f"integer dtype), not {t[k].dtype}")
    for k in OBJECTIVES:
        a = t[f"objective_{k}"]
        if a.dtype.kind not in "iuf" or not np.isfinite(a).all():
            raise InputError(f"{str(path / WEIGHTS)!r}: objective_{k} must hold finite "
                             f"numbers ({a.dtype})")
    perm, gates = t["perm"].astype(np.int64), t["gates"].astype(np.int64)
    if not (np.sort(perm, -1) == np.arange(I)).all():
        raise InputError(f"{str(path / WEIGHTS)!r}: every perm row must be a permutation of "
                         f"the {I} neurons")
    group = np.empty_like(perm)  # each neuron's sub-expert under perm
    np.put_along_axis(group, perm, np.broadcast_to(np.arange(I) // (I // N), perm.shape), -1)
    in_group = np.take_along_axis(group, gates.reshape(L, E, -1).clip(0, I - 1), -1)
    if (gates < 0).any() or (gates >= I).any() or (
            in_group.reshape(L, E, N, r) != np.arange(N)[:, None]).any():
        raise InputError(f"{str(path / WEIGHTS)!r}: every gate neuron must be a neuron of its "
                         f"own sub-expert")
    return Refactoring(perm=perm, gates=gates,
                       objective={k: t[f"objective_{k}"] for k in OBJECTIVES},
                       tokens=t["tokens"].astype(np.int64), meta=meta)


__all__ = ["CALIBRATION_SEED", "FORMAT", "Refactoring", "calibration_requests", "load",
           "refactor", "save"]
