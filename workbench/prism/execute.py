"""Elastic execution of sub-experts (issue 16 §2; issue 41 §1): a fused sub-expert product
over the (permuted) fused expert tensors, checked against the model's own experts forward
run over sub-experts.

A sub-expert s of expert e is the ``gate_up_proj`` rows (its gate and up halves) and the
``down_proj`` columns of the neurons the refactoring put in it (``perm[e][s·I/N :
(s+1)·I/N]``). The offloader stores a prism layer's experts in the *sub-expert layout* while
installed (:func:`to_subexpert_layout`, at install; undone bit for bit at removal), where each
sub-expert is one contiguous block of each tensor: the host store, the cache slots and the
transfers move the same bytes as always, and sub-expert offloading copies contiguous blocks.

:class:`PrismView` wraps the offloader's :class:`~workbench.runtime.slots.ExpertsView`. A call
for whole experts runs the **fused product** (:meth:`PrismView._fused`): one grouped GEMM per
projection with one group per expert, as the model's grouped forward has, the model's own gate
on each sub-expert's outputs, and the sub-experts a routed slot did not choose zeroed before
the down projection. Sub-expert offloading's slots run it too (:meth:`PrismView.run_blocks`:
the call's blocks placed in whole experts, an absent sub-expert's activations zeroed). The
reference is the model's own experts forward with each sub-expert an expert of its own
(:meth:`PrismView.run_subexperts`: a routed slot (token, e, w) becomes slots (token, e·N + s,
w) for the sub-experts it runs, the others the forward's sentinel): it computed every path
until the fused product replaced it, which cost 1.45× the unmodified runtime here (N× the rows
in N× the groups of 1/N the size, BENCHMARKS.md); it still runs a one-sub-expert host call,
and the two agree allclose on every kind of call (tested). Every path of the offloader (cache
hits, misses, the host, the pinned prefix, sub-expert offloading's own slots) calls the view,
so all of them run sub-experts alike. With every sub-expert active the layer computes
Σ_s A[:, S_s]·down[:, S_s] = the expert's output (a sum in another order: equal up to float
rounding; tested).

Which sub-experts run (:meth:`PrismView.choose`, router-side, before the cache is consulted):
the proxy gate scores each sub-expert on the token by the mean |activation| of its r gate
neurons, from resident copies of their rows (:meth:`PrismView.capture_gates`); per routed
expert its ``k_active`` best run, or, with a global K, the token's K best (expert, sub-expert)
pairs by score × routing weight. The float32 tensor operations define the choice; a decode
call takes it without them where it can prove it the same (:meth:`PrismView._choose_bounded`:
each score from the routed experts' rows only, in float64, with a bound on its distance to
the float32 score; a near tie falls back), and otherwise in one compiled pass after the
float32 product (:meth:`PrismView._choose_compiled`). The router's expert choice is kept (seed §4.3.1: "the model's
top-level router can then use these lightweight scores to select which sub-experts to
execute"); each sub-expert's output is weighted by its expert's routing weight. A trained gate
(:mod:`workbench.prism.finetune`, ``prism_router``) may score instead of the proxy.

The shortcut (``prism_shortcut``, default): when every sub-expert of every routed expert runs
(k_active = N, no global K, whole-expert caching), the view runs whole experts over the
model's unchanged layout (``whole``; the offloader then skips the layout change) and records
every routed slot as having run all N — the same sums in the model's own order, the same store
and modeled clock as the sub-expert path (tested), at the unmodified runtime's cost.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

from workbench.options import get_options
from workbench.prism.knobs import KERNELS


def _gate_up_rows(perm: torch.Tensor, N: int) -> torch.Tensor:
    """long [E, 2I]: the original ``gate_up_proj`` row at each row of the sub-expert layout
    (sub-expert s's gate rows, then its up rows, for s = 0 … N−1)."""
    E, I = perm.shape
    p = perm.reshape(E, N, 1, I // N)
    return torch.cat([p, p + I], 2).reshape(E, 2 * I)


def to_subexpert_layout(gate_up: torch.Tensor, down: torch.Tensor, perm: torch.Tensor,
                        N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's fused expert tensors (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
    in the sub-expert layout, same shapes: expert e's sub-expert s is rows
    ``s·2c … (s+1)·2c`` of ``gate_up`` (its c = I/N gate rows, then its up rows) and, in
    ``down``'s bytes read as [E, N, c, H], the block ``[e, s]``: its c down columns
    *transposed* (a [c, H] block). So the down bytes, read as [E, I, H], are each expert's
    down matrix transposed with its neurons in sub-expert order — the operand of a whole
    expert's fused sub-expert product (:meth:`PrismView.__call__`) — and each sub-expert is
    one contiguous block (what sub-expert offloading's host store and slots copy). The
    ``[E, H, I]`` view of those bytes is *not* the expert's down matrix.
    :func:`from_subexpert_layout` restores the input bit for bit."""
    E, H, I = down.shape
    rows = _flat(_gate_up_rows(perm.to(gate_up.device), N))
    gu = gate_up.reshape(E * 2 * I, -1).index_select(0, rows).view(gate_up.shape)
    # down's columns in perm's order are the rows of its transpose: [E, I, H], gathered from
    # the transposed view in one copy (a transposed copy, then a row gather, took ≈ 1.4× as
    # long: 2.4 GB of experts converted on every run past the kept budget)
    p = perm.to(down.device).long()
    d = down.transpose(1, 2)[torch.arange(E, device=down.device)[:, None], p]
    return gu, d.view(E, H, I)


def from_subexpert_layout(gate_up: torch.Tensor, down: torch.Tensor, perm: torch.Tensor,
                          N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_subexpert_layout` (a permutation: exact)."""
    E, H, I = down.shape
    rows = _inverse(_flat(_gate_up_rows(perm.to(gate_up.device), N)))
    gu = gate_up.reshape(E * 2 * I, -1).index_select(0, rows).view(gate_up.shape)
    # each expert's columns back in place, gathered from the transposed view in one copy
    # (a row gather, then a transposed copy, took ≈ 2× as long)
    p = perm.to(down.device).long()
    inv = torch.empty_like(p).scatter_(1, p, torch.arange(I, device=p.device).expand(E, I))
    d = torch.gather(down.reshape(E, I, H).transpose(1, 2), 2, inv[:, None, :].expand(E, H, I))
    return gu, d


def _flat(rows: torch.Tensor) -> torch.Tensor:
    """long [E·R]: the rows ``rows`` [E, R] (each expert's own, 0 … R−1) of a tensor's
    [E·R, …] view — a row gather is one ``index_select`` (5× a gather over an index
    as large as the tensor, here)."""
    E, R = rows.shape
    return (rows + torch.arange(E, device=rows.device)[:, None] * R).reshape(-1)


def _inverse(p: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation ``p`` (long [n])."""
    inv = torch.empty_like(p)
    inv[p] = torch.arange(len(p), device=p.device)
    return inv


#: sub-expert layouts kept between runs: host (CPU) tensors, up to at least this many bytes in
#: a process (:func:`layout_budget`). A run with the same refactoring then installs its
#: layer's layout without converting, and its removal hands the model its own tensors back
#: (kept meanwhile: 2× the layer's expert bytes while kept). Converting both ways was ≈ 8 % of
#: a run of the embedded model (cProfile, 12 layers); past the budget, or on an accelerator,
#: each run converts — of a random model of this architecture with 512-wide experts (2.4 GB
#: of them), that was half of every MoE-Prism run (BENCHMARKS.md, *Wider experts*).
LAYOUT_CACHE_BYTES = 256 << 20


def layout_budget() -> int:
    """Bytes of sub-expert layouts kept between runs: the ``prism_layout_cache_bytes`` option
    (``workbench.set_options``); when it is None, the larger of :data:`LAYOUT_CACHE_BYTES`
    and half the host memory available now
    (:func:`~workbench.runtime.device.host_available_bytes`, a memory cgroup's limit
    included), asked at each layer's install after its layout was made: beyond the 256 MiB
    floor, what is kept stays under about a third of what was free."""
    budget = get_options()["prism_layout_cache_bytes"]
    if budget is not None:
        return budget
    from workbench.runtime.device import host_available_bytes

    return max(LAYOUT_CACHE_BYTES, host_available_bytes() // 2)


class _Kept(NamedTuple):
    params: tuple  # weak references to the module's gate_up / down parameters
    held: tuple[int, ...]  # their data pointers and in-place versions, the layout's versions
    perm: torch.Tensor
    N: int
    layout: tuple[torch.Tensor, torch.Tensor]

    @staticmethod
    def state(params, layout) -> tuple[int, ...]:
        return (*(p.data_ptr() for p in params), *(p._version for p in params),
                *(t._version for t in layout))

    def holds(self, params, perm: torch.Tensor, N: int) -> bool:
        """Whether this layout is still ``params``' under ``perm``, ``N``: the same parameters
        over the same memory, none of them nor the layout written in place since (a write
        through another alias of their memory, ``p.data.add_``, is not seen), the same
        partition."""
        return (all(r() is p for r, p in zip(self.params, params)) and self.N == N
                and self.held == self.state(params, self.layout)
                and self.perm.shape == perm.shape and torch.equal(self.perm, perm))


_kept: "weakref.WeakKeyDictionary[torch.nn.Module, _Kept]" = weakref.WeakKeyDictionary()


def install_layout(module: torch.nn.Module, perm: torch.Tensor, N: int
                   ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``module``'s (an experts module's) ``gate_up_proj``/``down_proj`` in the sub-expert
    layout (:func:`to_subexpert_layout`), and whether it is a kept one
    (:func:`layout_budget`): then the caller gives the module's parameters their own
    tensors back at removal instead of :func:`from_subexpert_layout` (the same bits)."""
    params = (module._parameters["gate_up_proj"], module._parameters["down_proj"])
    kept = _kept.get(module)
    if kept is not None and kept.holds(params, perm, N):
        return (*kept.layout, True)
    _kept.pop(module, None)
    gu, d = to_subexpert_layout(params[0].data, params[1].data, perm, N)
    if gu.device.type == "cpu" and gu.nbytes + d.nbytes + sum(
            k.layout[0].nbytes + k.layout[1].nbytes for k in _kept.values()) \
            <= layout_budget():
        _kept[module] = _Kept(tuple(weakref.ref(p) for p in params),
                              _Kept.state(params, (gu, d)), perm.clone(), N, (gu, d))
        return gu, d, True
    return gu, d, False


class PrismSetup(NamedTuple):
    """What a run with ``prism=True`` hands the offloader: the refactoring's ``perm`` [L, E,
    I] and ``gates`` [L, E, N, r] (tensors), its ``subexperts`` N, and the choice — per
    expert ``k_active``, or a token's ``global_k`` best (None: per expert) — by the proxy
    gate, or by a trained ``router`` [L, E·N, H] (:mod:`workbench.prism.finetune`; None: the
    proxy gate)."""

    perm: torch.Tensor
    gates: torch.Tensor
    subexperts: int
    k_active: int
    global_k: int | None = None
    router: torch.Tensor | None = None
    #: with every sub-expert of every routed expert running (k_active = N, no global K),
    #: run whole experts instead (:class:`PrismView` ``whole``)
    shortcut: bool = True
    #: the kernel: "fused" or "per-subexpert" (:class:`PrismView` ``kernel``; the
    #: ``prism_kernel`` knob as :func:`~workbench.prism.knobs.choose_kernel` resolves it;
    #: "auto" is resolved by the stage)
    kernel: str = "fused"


def subexpert_shapes(shapes: dict[str, tuple[int, ...]], N: int) -> dict[str, tuple[int, ...]]:
    """One sub-expert's block shapes (a cache slot of sub-expert offloading) from one
    expert's: ``gate_up_proj`` (2I, H) → (2I/N, H), ``down_proj`` (H, I) → (I/N, H) — its
    down columns transposed, as the sub-expert layout holds them (:func:`subexpert_rows`)."""
    (two_i, H), (H2, I) = shapes["gate_up_proj"], shapes["down_proj"]
    return {"gate_up_proj": (two_i // N, H), "down_proj": (I // N, H2)}


def subexpert_rows(layer: dict[str, torch.Tensor], N: int) -> dict[str, torch.Tensor]:
    """A layer's fused tensors in the sub-expert layout as ``[E·N, …]`` blocks, row e·N + s
    the sub-expert s of expert e (views, no copy; ``down_proj`` [E·N, c, H], its columns
    transposed): what the host store of sub-expert offloading addresses by (layer, e·N + s),
    and the *block form* :meth:`PrismView.run_subexperts` takes."""
    gu, down = layer["gate_up_proj"], layer["down_proj"]
    E, H, I = down.shape
    return {"gate_up_proj": gu.reshape(E * N, 2 * (I // N), gu.shape[2]),
            "down_proj": down.reshape(E * N, I // N, H)}


def model_form(blocks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sub-expert blocks (:func:`subexpert_rows`' form) as the model's experts forward takes
    one expert's weights — ``down_proj`` [n, H, c], a transposed view (no copy)."""
    return {"gate_up_proj": blocks["gate_up_proj"],
            "down_proj": blocks["down_proj"].transpose(1, 2)}


def _count_loop(ids, chosen, E, per_sub, code, sub_ids):
    """One layer call's counts (:meth:`PrismView.choose`; compiled: :func:`_compiled`).
    ``ids`` int [T, k] the routing (an id ≥ ``E``: routed nowhere), ``chosen`` int [T, k, w]
    the sub-experts each slot runs (-1 padding). Adds one to ``per_sub[e, s]`` (int64 [E, N],
    zeros) per routed slot of expert e that runs sub-expert s, sets ``code[e]`` (int64 [E]) to
    expert e's (runs, parts) as runs·(N + 1) + parts (its (token, sub-expert) runs and
    distinct sub-experts: :meth:`Prices.subexperts_coded`'s code) and ``sub_ids[t, j·w + i]``
    (int64 [T, k·w]) to the id e·N + s of each (slot, sub-expert) that runs, -1 elsewhere;
    returns (routed slots, sub-expert runs). Writes only inside the arrays it is given."""
    T, k = ids.shape
    w = chosen.shape[2]
    N = per_sub.shape[1]
    routed = 0
    runs = 0
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            for i in range(w):
                s = chosen[t, j, i]
                sub_ids[t, j * w + i] = e * N + s if s >= 0 else -1
            if e >= E:
                continue
            routed += 1
            for i in range(w):
                s = chosen[t, j, i]
                if s >= 0:
                    runs += 1
                    if e >= 0 and s < N:
                        per_sub[e, s] += 1
    for e in range(E):
        n = 0
        parts = 0
        for s in range(N):
            n += per_sub[e, s]
            parts += per_sub[e, s] != 0
        code[e] = n * (N + 1) + parts
    return routed, runs


#: below this a score's sum of two products may round differently when halved than the
#: model's mean does (float32 subnormals): such a call takes the tensor path
_TINY = np.float32(2.0 ** -120)


def _choose_loop(act, gu, ids, dest, E, N, ka, chosen):
    """The proxy gate's choice for one layer call's slots, from the routed slots' gate-neuron
    outputs (:meth:`PrismView.choose`, float32 and r ≤ 2 gate neurons per sub-expert only;
    compiled: :func:`_compiled`). Row q of ``act`` float32 [S, G] (the model's activation of
    the gate outputs) and ``gu`` float32 [S, 2G] (the gate then up outputs) is slot
    ``dest[q]`` (int64 [S]); ``ids`` int64 [S] each slot's expert (≥ ``E``: routed nowhere);
    ``chosen`` int64 [S, ka] written by slot: each routed slot's ``ka`` best sub-experts of N
    by the score mean |act · up| over their r = G / N neurons, best first, -1 for a slot
    routed nowhere. The same as the tensor path's score and ``topk`` wherever the order is
    strict: returns False — ``chosen`` then unfinished, the call takes the tensor path —
    where two scores of a slot are equal (``topk`` breaks ties its own way), a score is NaN
    or infinite, or a sum is tiny enough for halving it to round differently from the
    model's mean."""
    S, G = act.shape
    r = G // N
    score = np.empty(N, np.float32)
    taken = np.empty(N, np.bool_)
    for q in range(S):
        slot = dest[q]
        if ids[slot] >= E:
            for i in range(ka):
                chosen[slot, i] = -1
            continue
        for s in range(N):
            tot = abs(act[q, s * r] * gu[q, G + s * r])
            if r == 2:
                tot = tot + abs(act[q, s * r + 1] * gu[q, G + s * r + 1])
            if not (tot < np.inf) or (tot > 0 and tot < _TINY):  # NaN, ∞, tiny
                return False
            score[s] = tot / np.float32(r)
        for s in range(N):
            taken[s] = False
            for u in range(s + 1, N):
                if score[s] == score[u]:
                    return False
        for i in range(ka):
            best = -1
            for s in range(N):
                if not taken[s] and (best < 0 or score[s] > score[best]):
                    best = s
            taken[best] = True
            chosen[slot, i] = best
    return True


#: float32's unit roundoff (half an ulp of 1)
_U32 = 2.0 ** -24
#: float32's smallest normal number: below it a CPU in flush-to-zero mode reads or writes 0
_TINY32 = 2.0 ** -126
#: an absolute slack for each float32 operation the exact path makes after the products (an
#: underflow, flushed or not; the activation's exp overflowing where |act| < 3e-37)
_ABS = 1e-36
#: the relative error allowed to the model's float32 activation (SiLU: exp, an addition, a
#: division; ≈ 3 roundings, measured ≤ 2.9 u; taken as 16 u)
_ACT_ERR = 16 * _U32
#: |d silu / dx| ≤ 1.0998 everywhere
_SILU_LIP = 1.1
#: past this a float32 sum or product may overflow (float32's largest is 3.4e38)
_BIG = 1e37


def _bounded_loop(x, w, wnorm, ids, E, N, ka, chosen, scores, bounds):
    """The proxy gate's choice for a call's slots with every score *bounded*, not
    reproduced (:meth:`PrismView._choose_bounded`; compiled: :func:`_compiled`): where it
    returns True, ``chosen`` is the choice the float32 tensor path makes, proven so by error
    bounds; False: some order is not certain, or an input is outside what the bounds cover
    — ``chosen`` unfinished, the exact paths choose.

    ``x`` float32 [T, H] the tokens, ``w`` float32 [E, 2G, H] each expert's gate-neuron rows
    (gate rows, then up rows; G = N·r), ``wnorm`` float64 [E, 2G] their Euclidean norms,
    ``ids`` int64 [T, k] the routing (≥ ``E``: routed nowhere, written -1 and never read;
    < 0: False), ``chosen`` int64 [T, k, ka]; ``scores`` and ``bounds`` float64 [T, k, N]
    get each routed slot's scores and their bounds (for tests; unset where False returned
    early). For each routed slot each sub-expert's score — the mean over its r neurons of
    |silu(x·g)·(x·u)| — is computed in float64 from the rows of that slot's expert only,
    with a bound B on its distance to the float32 path's score:

    - each product x·w differs from the float32 one by at most γ_H·‖x‖·‖w‖ (any summation
      order, FMA or not: γ_H = H·u / (1 − H·u), u = 2⁻²⁴, with Σ|x_i w_i| ≤ ‖x‖‖w‖; +1 %
      for this loop's own float64 rounding) plus H·2⁻¹²⁵ (products and partial sums flushed
      to zero below float32's smallest normal number, on a CPU in flush-to-zero mode; a
      nonzero |x_i| below it returns False, and :meth:`PrismView._choose_bounded` refuses
      such rows);
    - silu moves by at most 1.1× its input's error, and the model's float32 silu is within
      ``_ACT_ERR`` of silu (relative) or ``_ABS``;
    - the product rounds once (``|·|`` is exact), the sum of r terms and the mean by at
      most γ_{r+1} of the sum;
    - nothing the float32 path computes may overflow: a sum Σ|x_i w_i| (≤ ‖x‖‖w‖), a
      product or the sum of a sub-expert's r terms that could reach ``_BIG`` returns False.

    The float32 path takes its ``topk`` (best first) from those scores, so the choice is
    certain when each of the ka best intervals [score − B, score + B] lies strictly above
    every interval after it (no tie can then exist, nor a NaN). A slot where that fails
    makes the call return False (the other slots' scores still computed)."""
    T, H = x.shape
    k = ids.shape[1]
    G = w.shape[1] // 2
    r = G // N
    gam = 1.01 * H * _U32 / (1.0 - H * _U32)
    flush = H * 2.0 * _TINY32
    gam_r = (r + 1) * _U32 / (1.0 - (r + 1) * _U32)
    order = np.empty(N, np.int64)
    certain = True
    for t in range(T):
        xn = 0.0
        for h in range(H):
            v = np.float64(x[t, h])
            if v != 0.0 and abs(v) < _TINY32:  # subnormal: flushed to 0 in FTZ mode
                return False
            xn += v * v
        xn = np.sqrt(xn)
        if not (xn < np.inf):
            return False
        for j in range(k):
            e = ids[t, j]
            if e >= E:
                for i in range(ka):
                    chosen[t, j, i] = -1
                continue
            if e < 0:
                return False
            for s in range(N):
                tot = 0.0
                err = 0.0
                for q in range(r):
                    rg = s * r + q
                    ru = G + rg
                    # two dot products, four running sums each (float64: any order is far
                    # inside the bound)
                    g0 = g1 = g2 = g3 = 0.0
                    u0 = u1 = u2 = u3 = 0.0
                    h = 0
                    while h + 4 <= H:
                        a0, a1 = np.float64(x[t, h]), np.float64(x[t, h + 1])
                        a2, a3 = np.float64(x[t, h + 2]), np.float64(x[t, h + 3])
                        g0 += a0 * w[e, rg, h]
                        g1 += a1 * w[e, rg, h + 1]
                        g2 += a2 * w[e, rg, h + 2]
                        g3 += a3 * w[e, rg, h + 3]
                        u0 += a0 * w[e, ru, h]
                        u1 += a1 * w[e, ru, h + 1]
                        u2 += a2 * w[e, ru, h + 2]
                        u3 += a3 * w[e, ru, h + 3]
                        h += 4
                    while h < H:
                        g0 += np.float64(x[t, h]) * w[e, rg, h]
                        u0 += np.float64(x[t, h]) * w[e, ru, h]
                        h += 1
                    g = (g0 + g1) + (g2 + g3)
                    u = (u0 + u1) + (u2 + u3)
                    sg, su = xn * wnorm[e, rg], xn * wnorm[e, ru]  # ≥ Σ|x_i w_i|
                    if not (sg < _BIG and su < _BIG):  # float32 may overflow (or NaN)
                        return False
                    dg = gam * sg + flush
                    du = gam * su + flush
                    a = g / (1.0 + np.exp(-g))
                    da = _SILU_LIP * dg + _ACT_ERR * (abs(a) + _SILU_LIP * dg) + _ABS
                    big = (abs(a) + da) * (abs(u) + du)
                    if not (big < _BIG):
                        return False
                    tot += abs(a * u)
                    err += (abs(a) + da) * du + abs(u) * da + _U32 * big + _ABS
                if not (tot + err < _BIG):  # the float32 sum of the r terms (NaN too)
                    return False
                sc = tot / r
                scores[t, j, s] = sc
                bounds[t, j, s] = err / r + gam_r * (tot + err) / r + _ABS
            # the sub-experts by score, best first (insertion sort: N is small)
            for s in range(N):
                i = s
                while i > 0 and scores[t, j, order[i - 1]] < scores[t, j, s]:
                    order[i] = order[i - 1]
                    i -= 1
                order[i] = s
            for i in range(ka):
                lo = scores[t, j, order[i]] - bounds[t, j, order[i]]
                for m in range(i + 1, N):
                    if not (lo > scores[t, j, order[m]] + bounds[t, j, order[m]]):
                        certain = False
                chosen[t, j, i] = order[i]
    return certain


def _key_loop(per_sub, experts, compute_s, keys, tokens, share):
    """Sub-expert offloading's keys of a layer call (:meth:`PrismView.subexpert_keys`). For
    each expert ``experts[i]`` (int64 [n]) and each of its sub-experts s that runs
    (``per_sub[e, s]`` > 0, in that order): its key e·N + s, its tokens, and its share of the
    expert's modeled op ``compute_s[i]`` by tokens (``compute_s[i]`` · tokens / the expert's
    runs), into ``keys``, ``tokens`` (int64) and ``share`` (float64; each at least n·N
    long); returns how many, or -1 for an expert id outside ``per_sub`` (nothing read)."""
    N = per_sub.shape[1]
    for i in range(experts.shape[0]):
        if experts[i] < 0 or experts[i] >= per_sub.shape[0]:
            return -1
    m = 0
    for i in range(experts.shape[0]):
        e = experts[i]
        runs = 0
        for s in range(N):
            runs += per_sub[e, s]
        for s in range(N):
            n = per_sub[e, s]
            if n != 0:
                keys[m] = e * N + s
                tokens[m] = n
                share[m] = compute_s[i] * n / runs
                m += 1
    return m


def _slots_loop(ids, experts, E, chosen, present, ran, per, rows, mask):
    """One fused call's slots (:meth:`PrismView._plan_compiled`; compiled: :func:`_compiled`),
    exactly :meth:`PrismView._plan_tensors`' integer work. ``ids`` int64 [P] each slot's
    expert (≥ ``E``: routed nowhere), ``experts`` int64 [n] the call's (its position table:
    :func:`~workbench.runtime.slots.positions`), ``chosen`` int64 [P, w] each slot's
    sub-experts (-1 padding), ``present`` bool [n, N] the sub-experts this call holds ([0, 0]:
    all). Writes ``ran`` int16 [P, w] = ``chosen`` where the slot's sub-expert runs here (its
    expert in the call, chosen, present); ``per`` int [2n + 1] zeros: slots per position,
    then each position's end (the counts' running sum); ``rows`` int64 [P]:
    the slots of the call's experts grouped by expert, in slot order within one (a stable
    sort by position); ``mask`` float32 [P, N] zeros (or [0, N]: none wanted): row q counts
    the here-runs of slot ``rows[q]``'s sub-experts. Returns S, the slots in the call
    (``rows[:S]``, ``mask[:S]``), or -1 (nothing written) for an expert id (of ``ids`` or
    ``experts``) outside 0 … E or a sub-expert past N − 1 (N: ``mask``'s columns)."""
    P = ids.shape[0]
    w = chosen.shape[1]
    n = experts.shape[0]
    N = mask.shape[1]
    for i in range(n):  # (writes below index by these: out of range, nothing is written)
        if experts[i] < 0 or experts[i] > E:
            return -1
    for p in range(P):
        if ids[p] < 0 or ids[p] > E:
            return -1
        for i in range(w):
            if chosen[p, i] >= N:
                return -1
    lut = np.full(E + 1, n, np.int64)
    for i in range(n):
        lut[experts[i]] = i
    local = np.empty(P, np.int64)
    for p in range(P):
        e = ids[p]
        q = lut[e]
        local[p] = q
        per[q] += 1
        for i in range(w):
            s = chosen[p, i]
            if q < n and s >= 0 and (present.shape[0] == 0 or present[q, s]):
                ran[p, i] = s
    start = np.empty(n + 1, np.int64)
    at = 0
    for q in range(n + 1):
        start[q] = at
        at += per[q]
        if q < n:
            per[n + 1 + q] = at
    for p in range(P):
        q = local[p]
        if q < n:
            r = start[q]
            start[q] = r + 1
            rows[r] = p
            if mask.shape[0]:
                for i in range(w):
                    s = chosen[p, i]
                    if s >= 0 and (present.shape[0] == 0 or present[q, s]):
                        mask[r, s] += 1.0
    return P - per[n]


def _place_loop(subs, rows, N, E, experts, src, present):
    """Sub-expert offloading's blocks placed in whole experts (:meth:`PrismView.run_blocks`;
    compiled: :func:`_compiled`). ``subs`` int64 [m] sub-expert ids e·N + s, ``rows`` int64
    [m] the block row of each. Writes ``experts`` int64 [≥ n] the experts ascending, ``src``
    int64 [≥ n·N] the block row of each whole-expert row (a sub-expert not among ``subs``:
    the first block, ``rows[0]``) and ``present`` bool [≥ n·N] which are among ``subs``;
    returns n, or -1 for an id outside 0 … E·N − 1 (nothing placed)."""
    m = subs.shape[0]
    seen = np.zeros(E, np.bool_)
    for j in range(m):
        if subs[j] < 0 or subs[j] >= E * N:
            return -1
        seen[subs[j] // N] = True
    at = np.empty(E, np.int64)
    n = 0
    for e in range(E):
        if seen[e]:
            at[e] = n
            experts[n] = e
            n += 1
    for p in range(n * N):
        src[p] = rows[0] if m else 0
        present[p] = False
    for j in range(m):
        p = at[subs[j] // N] * N + subs[j] % N
        src[p] = rows[j]
        present[p] = True
    return n


_COMPILED: dict = {}


def _compiled(loop):
    """``loop`` (one of this module's ``_…_loop`` functions, its Python source the reference
    the tests hold it to) compiled by numba: cached on disk as the replay kernels are, compiled
    or loaded on first use (this module stays importable without numba's start-up)."""
    fn = _COMPILED.get(loop)
    if fn is None:
        from numba import njit

        fn = _COMPILED[loop] = njit(cache=True, error_model="numpy", boundscheck=False)(loop)
    return fn


def _host(t: torch.Tensor) -> np.ndarray:
    """``t`` as a C-contiguous int64 host array (a view when it is one already)."""
    return np.ascontiguousarray(t.detach().cpu().numpy(), np.int64)


def _is_silu(act_fn) -> bool:
    """Whether ``act_fn`` is SiLU as torch computes it: ``F.silu``, an ``nn.SiLU`` (not a
    subclass), or transformers' ``SiLUActivation`` with its own forward (a hub kernel may
    replace that forward: then not)."""
    if act_fn is torch.nn.functional.silu:
        return True
    if "forward" in getattr(act_fn, "__dict__", {}):
        return False  # a forward set on the instance
    t = type(act_fn)
    if t is torch.nn.SiLU:
        return t.forward is torch.nn.SiLU.forward
    fwd = getattr(t, "forward", None)
    return (t.__name__ == "SiLUActivation" and t.__module__ == "transformers.activations"
            and getattr(fwd, "__module__", None) == "transformers.activations"
            and getattr(fwd, "__qualname__", None) == "SiLUActivation.forward")


def _exact_f32_matmul() -> bool:
    """Whether float32 matrix products on the CPU are float32 throughout: no bf16 or TF32
    allowed by torch's ``fp32_precision`` settings (the global one, oneDNN's, oneDNN's
    matmul), ``torch.set_float32_matmul_precision`` or oneDNN's ``*_DEFAULT_FPMATH_MODE``
    environment variables."""
    mk = torch.backends.mkldnn
    for prec in (getattr(torch.backends, "fp32_precision", "none"),
                 getattr(mk, "fp32_precision", "none"),
                 getattr(getattr(mk, "matmul", None), "fp32_precision", "none")):
        if prec not in ("none", "ieee"):
            return False
    for var in ("ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE"):
        if os.environ.get(var, "").strip().upper() not in ("", "STRICT"):
            return False
    try:  # (raises once the settings above were used: the legacy and new APIs mixed)
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:
        return False


class PrismView:
    """An :class:`ExpertsView` over sub-experts (module docstring). ``perm`` [L, E, I] and
    ``gates`` [L, E, N, r] (a :class:`~workbench.prism.refactor.Refactoring`'s), ``layer``
    the MoE layer, ``k_active`` sub-experts per (token, expert). The weights it is handed
    are in the sub-expert layout (:func:`to_subexpert_layout`; the offloader converts the
    layer at install), so a call splits them into sub-experts without copying."""

    def __init__(self, inner, perm: torch.Tensor, gates: torch.Tensor, layer: int,
                 subexperts: int, k_active: int, act_fn, global_k: int | None = None,
                 router: torch.Tensor | None = None, whole: bool = False,
                 apply_gate=None, kernel: str = "fused") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, not {kernel!r}")
        self.inner, self.layer = inner, layer
        #: how a call runs its sub-experts (the ``prism_kernel`` knob): "fused" — one group
        #: per expert (:meth:`_fused`); "per-subexpert" — the model's forward over the chosen
        #: sub-experts only (:meth:`run_subexperts`)
        self.kernel = kernel
        #: the model's gating of one expert's [.., 2I] up-projection output into [.., I] (its
        #: experts module's ``_apply_gate``; None: act(gate)·up over the two halves), applied
        #: to each sub-expert's 2c outputs by the fused product
        self.apply_gate = apply_gate if apply_gate is not None else self._act_gate
        #: the shortcut: every sub-expert of every routed expert runs, so each call runs whole
        #: experts through the model's own forward over the *unchanged* layout (the offloader
        #: then leaves the tensors as they are) — the same sums, in the model's own order, at
        #: the unmodified runtime's cost; what ran is recorded as for sub-experts
        self.whole = whole
        #: a trained sub-expert gate's rows of this layer [E·N, H] (None: the proxy gate)
        self.router = None if router is None else router[layer]
        #: the seed's K: a token's K best sub-experts among its routed experts' (None: the
        #: k_active best of each routed expert)
        self.global_k = global_k
        self.perm = perm[layer]  # [E, I]
        self.N, self.k_active, self.act_fn = subexperts, k_active, act_fn
        # each gate neuron's gate row in the sub-expert layout (its up row: + c)
        E, I = self.perm.shape
        c = I // subexperts
        where = torch.empty_like(self.perm).scatter_(
            1, self.perm, torch.arange(I).expand(E, I))  # neuron → position in perm
        g = torch.gather(where, 1, gates[layer].reshape(E, -1))  # [E, N·r] positions
        self.gate_rows = (g // c) * 2 * c + g % c
        self.c = c
        #: (token, expert) sub-expert runs this view was asked for / ran (counters)
        self.asked = 0
        self.ran = 0
        #: the layer call in progress (:meth:`choose` … :meth:`take`): long [T, k, w] the
        #: sub-experts each slot runs (-1 padding), and int16 the same where they ran
        self._chosen_call: torch.Tensor | None = None
        self._ran_call: torch.Tensor | None = None
        #: the call's counts (:meth:`choose`): int64 [E, N] tokens per sub-expert, [E] codes,
        #: [T, k·w] the sub-expert ids that run
        self._per_sub: np.ndarray | None = None
        self._code: np.ndarray | None = None
        self._sub_ids: np.ndarray | None = None
        #: [E, 2·N·r, H]: the resident gate-neuron rows of each expert, its gate rows then
        #: their up rows
        self._gu_rows: torch.Tensor | None = None
        self._gu_w = None  # [E, H, 2·N·r]: the same, one grouped product's operand
        self._dense_w = None  # [H, E·2·N·r]: every expert's, one dense product's operand
        #: the bounded choice's operands (:meth:`_bounded_operands`; None: not read yet)
        self._gu_np: tuple[np.ndarray, np.ndarray] | bool | None = None

    #: the proxy gate computes every expert's gate-neuron outputs by one dense product when it
    #: costs at most this many multiply-adds (T·E·2G·H); else only the routed slots', grouped
    #: by expert
    DENSE_MACS = 1 << 22

    def _act_gate(self, out: torch.Tensor) -> torch.Tensor:
        gate, up = out.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def capture_gates(self, gate_up: torch.Tensor, device: torch.device) -> None:
        """Keep the layer's gate-neuron rows resident on ``device`` (from ``gate_up`` [E, 2I,
        H] in the sub-expert layout, read at install before the layer is offloaded): the
        proxy gate is router-side — it picks a token's sub-experts before any expert is
        looked up, so only those need to be resident or fetched. 2·r·N rows per expert."""
        rows = self.gate_rows.to(gate_up.device)  # [E, N·r]
        E, two_i, H = gate_up.shape
        # each expert's gate rows then their up rows (+ c), as rows of the [E·2I, H] matrix:
        # one index_select (advanced indexing of [E, 2I, H] took ≈ 10× as long)
        flat = torch.cat([rows, rows + self.c], 1) + torch.arange(
            E, device=rows.device)[:, None] * two_i
        self._gu_rows = gate_up.reshape(E * two_i, H).index_select(0, flat.reshape(-1)).view(
            E, -1, H).to(device)
        self._gu_w = self._dense_w = self._gu_np = None

    def choose(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The layer call starts: long [T, k, w], the sub-experts each routed slot will run,
        -1 padding (a slot routed nowhere — id ``num_experts`` — runs none). Per expert: the
        proxy gate's k_active best (w = k_active; all, in order, when k_active = N). With a
        global K: the token's K best (token, sub-expert) pairs by score × the slot's routing
        weight (w = N, the others -1)."""
        T, k = top_k_index.shape
        N, ka, dev = self.N, self.k_active, top_k_index.device
        ids = _host(top_k_index)  # [T, k] on the host: the compiled passes read it
        # the choice in one compiled pass where it is exactly the tensor path's (a decode
        # call is bound by its number of tensor operations; None: the tensors choose)
        chosen = None
        if self.global_k is None and ka < N:
            # from the routed experts' rows with proven bounds (a decode call), else by
            # the float32 product itself in one compiled pass
            chosen = self._choose_bounded(hidden_states, ids, num_experts)
            if chosen is None:
                chosen = self._choose_compiled(hidden_states, top_k_index, num_experts)
        if chosen is None and self.global_k is None and ka >= N and dev.type == "cpu":
            # every sub-expert of each routed slot, in order (the tensor path's, built on
            # the host: four tensor operations cost ≈ 40 µs a call in a run)
            all_n = np.empty((T, k, N), np.int64)
            all_n[...] = np.arange(N)
            all_n[ids >= num_experts] = -1
            chosen = torch.from_numpy(all_n)
        if chosen is None:  # (after a compiled pass that found a tie or NaN, the product
            # runs again here: rare, and the tensor path stays whole and separate)
            chosen = self._choose_tensors(hidden_states, top_k_index, top_k_weights,
                                          num_experts)
        self._chosen_call = chosen
        self._ran_call = torch.full(chosen.shape, -1, dtype=torch.int16, device=dev)
        # the call's counts in one compiled pass on the host (a decode call is bound by
        # operation count: this replaced 11 small tensor operations here and in pricing)
        routed_slots, runs = self._count(ids, chosen, num_experts)
        self.asked += routed_slots * N  # every routed slot runs once, in some call
        self.ran += runs
        return chosen

    def _choose_bounded(self, hidden_states: torch.Tensor, ids: np.ndarray,
                        num_experts: int) -> torch.Tensor | None:
        """The k_active best sub-experts of each slot (long [T, k, k_active], -1 for a slot
        routed nowhere; ``ids`` int64 [T, k] the routing on the host) by one compiled pass
        over the routed experts' gate-neuron rows only (:func:`_bounded_loop`): each score
        computed in float64 with a proven bound on its distance to the float32 path's, so
        the choice is that path's wherever the bounds separate the order. None where they do
        not (a near-tie), and where the bound is not known to hold: not float32 on the CPU,
        an activation other than SiLU, float32 matrix products allowed a lower precision
        (``torch.set_float32_matmul_precision``, oneDNN's ``fp32_precision``), a call past
        :attr:`DENSE_MACS` (a prefill: the grouped product is faster there), a trained gate.

        A decode call's dense product reads every expert's rows (≈ 256 KiB a layer on the
        embedded model, cold in a run) to use a quarter or less of them; this reads the
        routed ones only, in one call (BENCHMARKS.md, issue 41 §1, stop 61)."""
        if self._gu_np is None:  # once a view (a view lives one run): whether it can
            self._gu_np = self._bounded_operands()
        if (self._gu_np is False or hidden_states.dtype != torch.float32
                or hidden_states.device.type != "cpu"):
            return None
        w, wnorm = self._gu_np
        T, k = ids.shape
        E, G2, H = w.shape
        if T * E * G2 * H > self.DENSE_MACS or hidden_states.shape != (T, H):
            return None
        chosen = np.empty((T, k, self.k_active), np.int64)
        scores = np.empty((T, k, self.N))
        ok = _compiled(_bounded_loop)(hidden_states.detach().numpy(), w, wnorm, ids,
                                      num_experts, self.N, self.k_active, chosen, scores,
                                      np.empty_like(scores))
        return torch.from_numpy(chosen) if ok else None

    def _bounded_operands(self) -> tuple[np.ndarray, np.ndarray] | bool:
        """The bounded choice's operands — the resident rows as numpy [E, 2G, H] and their
        float64 norms [E, 2G] — or False where its bounds are not known to hold: a trained
        gate, rows not float32 on the CPU, an activation other than SiLU, a float32 product
        allowed a lower precision (:func:`_exact_f32_matmul`, read when the view first
        chooses), a subnormal weight (a CPU in flush-to-zero mode reads it as 0)."""
        rows = self._gu_rows
        if (self.router is not None or rows is None or rows.dtype != torch.float32
                or rows.device.type != "cpu" or rows.shape[1] % (2 * self.N)
                or not _is_silu(self.act_fn) or not _exact_f32_matmul()):
            return False
        w = rows.numpy()
        a = np.abs(w)
        if ((a > 0) & (a < _TINY32)).any():
            return False
        return w, rows.double().norm(dim=-1).numpy()

    def _choose_tensors(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
        """:meth:`choose`'s choice by tensor operations (the reference of the compiled one)."""
        T, k = top_k_index.shape
        N, ka, dev = self.N, self.k_active, top_k_index.device
        routed = top_k_index < num_experts
        if self.global_k is None and ka >= N:
            chosen = torch.arange(N, device=dev).expand(T, k, N)
        else:
            score = self._scores(hidden_states, top_k_index, num_experts)  # [T, k, N]
            if self.global_k is None:
                chosen = score.topk(ka, dim=-1).indices
            else:
                w = (score * top_k_weights[..., None].to(score.dtype)).masked_fill(
                    ~routed[..., None], float("-inf")).reshape(T, k * N)
                K = min(self.global_k, k * N)
                pick = torch.zeros((T, k * N), dtype=torch.bool, device=dev)
                pick.scatter_(1, w.topk(K, dim=-1).indices, True)
                pick &= torch.isfinite(w)  # a token with fewer routed slots than K
                chosen = torch.arange(N, device=dev).expand(T, k, N).masked_fill(
                    ~pick.reshape(T, k, N), -1)
        return chosen.masked_fill(~routed[..., None], -1)

    def _choose_compiled(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         num_experts: int) -> torch.Tensor | None:
        """The k_active best sub-experts of each slot (long [T, k, k_active], -1 for a slot
        routed nowhere) from the proxy gate's product (:meth:`_gate_outputs`), the model's
        activation and one compiled pass (:func:`_choose_loop`) — where that is exactly
        :meth:`_choose_tensors`' choice: float32 on the CPU, at most 2 gate neurons per
        sub-expert (a mean of one or two numbers has one rounding), and no tie, NaN or
        near-subnormal score in the call. None otherwise."""
        if self.router is not None or self._gu_rows is None:
            return None
        T, k = top_k_index.shape
        G = self._gu_rows.shape[1] // 2
        if (hidden_states.dtype != torch.float32 or hidden_states.device.type != "cpu"
                or G // self.N > 2 or G % self.N):
            return None
        gu, rows = self._gate_outputs(hidden_states, top_k_index, num_experts)
        with torch.no_grad():
            act = self.act_fn(gu[..., :G])
        chosen = torch.empty((T, k, self.k_active), dtype=torch.long)
        ok = _compiled(_choose_loop)(
            act.reshape(T * k, G).numpy(), gu.reshape(T * k, 2 * G).numpy(),
            _host(top_k_index).reshape(-1),
            np.arange(T * k, dtype=np.int64) if rows is None else _host(rows),
            num_experts, self.N, self.k_active, chosen.view(T * k, self.k_active).numpy())
        return chosen if ok else None

    def _gate_outputs(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      num_experts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed slots' gate-neuron outputs, each expert's gate rows then up rows, from
        the resident rows: ``(gu, None)`` with gu [T, k, 2G] by one dense product over every
        expert's rows when that is small (:attr:`DENSE_MACS`; a decode step's call is bound by
        operation count), the slots' gathered from it; else ``(gu, rows)`` with gu [T·k, 2G]
        by one grouped product over the slots sorted by expert (as the experts forward
        groups them), ``rows`` long [T·k] the slot of each row. A slot routed nowhere is
        computed as expert E − 1."""
        T, k = top_k_index.shape
        ids = top_k_index.long().clamp(max=num_experts - 1)
        E, G2, H = self._gu_rows.shape
        if T * E * G2 * H <= self.DENSE_MACS:
            if self._dense_w is None:  # [H, E·2G]: expert e's gate rows then up rows
                self._dense_w = self._gu_rows.reshape(E * G2, H).T.contiguous()
            with torch.no_grad():
                return torch.gather((hidden_states @ self._dense_w).view(T, E, G2), 1,
                                    ids[..., None].expand(T, k, G2)), None
        from transformers.integrations.moe import _grouped_mm

        if self._gu_w is None:  # [E, H, 2G]: each expert's gate rows then up rows, as one operand
            self._gu_w = self._gu_rows.transpose(1, 2)
        flat = ids.reshape(-1)
        rows = torch.argsort(flat, stable=True)  # slots grouped by expert
        offs = torch.cumsum(torch.bincount(flat, minlength=self._gu_w.shape[0]), 0).to(
            torch.int32)
        with torch.no_grad():  # one grouped product: no [T, k, G, H] gather of rows
            # (index_select: the same rows as x[rows // k], ≈ 7× faster on a prefill call)
            return _grouped_mm(hidden_states.index_select(0, rows // k), self._gu_w, offs), rows

    def _scores(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                num_experts: int) -> torch.Tensor:
        """[T, k, N]: the proxy gate's score of each slot's sub-experts — the mean
        |act(gate)·up| of its r gate neurons (from :meth:`_gate_outputs`) — or the trained
        gate's (``router``). A slot routed nowhere scores as expert E − 1 (it runs
        nothing)."""
        T, k = top_k_index.shape
        if self.router is not None:  # trained: σ(W[e·N + s] · x), positive like the proxy's
            ids = top_k_index.long().clamp(max=num_experts - 1)
            if self.router.device != hidden_states.device:
                self.router = self.router.to(hidden_states.device)
            with torch.no_grad():
                s = torch.sigmoid(hidden_states.float() @ self.router.T).reshape(
                    T, num_experts, self.N)
                return torch.gather(s, 1, ids[..., None].expand(T, k, self.N)).to(
                    hidden_states.dtype)
        G = self._gu_rows.shape[1] // 2  # gate-neuron rows per expert
        gu, rows = self._gate_outputs(hidden_states, top_k_index, num_experts)
        with torch.no_grad():
            s = self._proxy_score(gu[..., :G], gu[..., G:])  # [T, k, N] or [T·k, N]
        if rows is None:
            return s
        score = torch.empty_like(s)
        score.index_copy_(0, rows, s)
        return score.view(T, k, self.N)

    def _proxy_score(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """[..., N]: the mean |act(gate)·up| over each sub-expert's r gate neurons, from the
        gate-neuron outputs ``gate``/``up`` [..., N·r] (sub-expert by sub-expert)."""
        return (self.act_fn(gate) * up).abs().unflatten(-1, (self.N, -1)).mean(-1)

    def subexpert_codes(self, top_k_index: torch.Tensor, num_experts: int) -> np.ndarray:
        """int64 [E] (after :meth:`choose`): each expert's (runs, parts) in the layer call as
        runs·(N + 1) + parts — its (token, sub-expert) runs and distinct sub-experts, the code
        :meth:`~workbench.sim.costs.Prices.subexperts_coded` prices."""
        return self._call_counts()[1]

    def _call_counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The counts :meth:`choose` made of the call in progress — tokens per sub-expert
        [E, N], codes [E], sub-expert ids [T, k·w] (read them, never change them)."""
        if self._per_sub is None:
            raise RuntimeError("a layer call's counts are asked for before choose (or after "
                               "take)")
        return self._per_sub, self._code, self._sub_ids

    def _count(self, ids: np.ndarray, chosen: torch.Tensor, num_experts: int
               ) -> tuple[int, int]:
        """Count the call (:func:`_count_loop`; ``ids`` int64 [T, k] its routing on the host)
        into the view's arrays; returns (routed slots, sub-expert runs)."""
        T, k, w = chosen.shape
        self._per_sub = np.zeros((num_experts, self.N), np.int64)
        self._code = np.empty(num_experts, np.int64)
        self._sub_ids = np.empty((T, k * w), np.int64)
        return _compiled(_count_loop)(ids, _host(chosen), num_experts, self._per_sub,
                                      self._code, self._sub_ids)

    def subexpert_ids(self, top_k_index: torch.Tensor) -> np.ndarray:
        """int64 [T, k·w] (after :meth:`choose`): the sub-expert id e·N + s of each (slot,
        sub-expert) the layer call will run, -1 elsewhere — the routing of a trace whose
        experts are sub-experts (:meth:`~workbench.traces.trace.Trace.as_subexperts`)."""
        return self._call_counts()[2]

    def subexpert_keys(self, top_k_index: torch.Tensor, num_experts: int, experts,
                       compute_s: np.ndarray) -> tuple[list[int], list[int], np.ndarray]:
        """(after :meth:`choose`) Sub-expert offloading's keys of the call: for each of
        ``experts`` (ascending) the sub-experts that run, as ids e·N + s, their tokens, and
        each one's share of its expert's modeled op ``compute_s`` (float64, aligned with
        ``experts``) by tokens."""
        per_sub = self._call_counts()[0]
        ex = np.asarray(experts, np.int64)
        cap = len(ex) * self.N
        keys, tokens, share = np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap)
        m = _compiled(_key_loop)(per_sub, ex, np.asarray(compute_s, np.float64), keys, tokens,
                                 share)
        if m < 0:
            raise ValueError(f"subexpert_keys: experts must be ids in 0 … {num_experts - 1}, "
                             f"not {ex.tolist()}")
        return keys[:m].tolist(), tokens[:m].tolist(), share[:m]

    def tokens_per_expert(self, top_k_index: torch.Tensor, num_experts: int) -> np.ndarray:
        """int64 [E]: tokens of the layer call that will run some sub-expert of each expert
        (after :meth:`choose`; with a global K a routed token may run none of an expert's)."""
        runs = (self._chosen_call >= 0).any(-1)  # [T, k]
        return torch.bincount(top_k_index.long()[runs], minlength=num_experts).cpu().numpy()

    def take(self):
        """int16 [T, k, w] (numpy): the sub-experts each slot of the layer call ran, -1
        padding (w = k_active, or N with a global K); ends the call."""
        c, self._ran_call, self._chosen_call = self._ran_call, None, None
        self._per_sub = self._code = self._sub_ids = None
        return None if c is None else c.cpu().numpy()

    def __call__(self, weights: dict[str, torch.Tensor], experts, num_experts: int,
                 hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, *args: Any, all_routed=None, **kwargs: Any
                 ) -> torch.Tensor:
        """The layer output share of whole experts ``experts`` (``weights`` theirs, in the
        sub-expert layout): each routed slot's chosen sub-experts, by the fused sub-expert
        product (:meth:`_fused`). ``all_routed``: ``experts`` are every expert the layer
        routed to, ascending (a tensor; :class:`ExpertsView`) — then ids map to positions by
        a sorted search. Something else the model hands its experts forward (``args``,
        ``kwargs``; none of the supported architectures does) goes to the model's own forward
        over sub-experts (:meth:`run_subexperts`)."""
        if self.whole:
            return self._run_whole(weights, experts, num_experts, hidden_states, top_k_index,
                                   top_k_weights, *args, all_routed=all_routed, **kwargs)
        if args or kwargs or self.kernel == "per-subexpert":
            subs = [int(e) * self.N + s for e in experts for s in range(self.N)]
            return self.run_subexperts(subexpert_rows(weights, self.N), subs, num_experts,
                                       hidden_states, top_k_index, top_k_weights, *args,
                                       **kwargs)
        return self._fused(weights, experts, num_experts, hidden_states, top_k_index,
                           top_k_weights, all_routed)

    def run_blocks(self, blocks: dict[str, torch.Tensor], subs, num_experts: int,
                   hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, *args: Any, rows=None, **kwargs: Any
                   ) -> torch.Tensor:
        """The layer output share of sub-experts ``subs`` (ids e·N + s, ``blocks`` theirs in
        block form: sub-expert offloading's cache slots) by the fused product: the blocks
        placed in whole experts of the sub-expert layout (a sub-expert not in this call reads
        another's block, its activations zeroed: ``present``), each routed slot's chosen
        sub-experts among ``subs`` run. ``rows``: the row of ``blocks`` each of ``subs`` is
        (the slot pool's tensors and the call's slots: placed straight from the pool, one
        copy; None: row j is ``subs[j]``'s). ``args`` or ``kwargs``: the model's forward per
        sub-expert, as :meth:`__call__`."""
        per_sub = bool(args or kwargs) or self.kernel == "per-subexpert"
        if rows is not None and per_sub:  # the model's forward takes them compact
            at_rows = torch.as_tensor(list(rows), dtype=torch.long)
            blocks = {n: t.index_select(0, at_rows.to(t.device)) for n, t in blocks.items()}
            rows = None
        if per_sub:
            return self.run_subexperts(blocks, subs, num_experts, hidden_states, top_k_index,
                                       top_k_weights, *args, **kwargs)
        N, dev = self.N, blocks["gate_up_proj"].device
        E = num_experts
        subs_a = np.asarray(subs, np.int64).reshape(-1)
        m = len(subs_a)
        rows_a = (np.arange(m, dtype=np.int64) if rows is None
                  else np.asarray(rows, np.int64).reshape(-1))
        if len(rows_a) != m:
            raise ValueError(f"run_blocks: one row per sub-expert: {m} sub-experts, "
                             f"{len(rows_a)} rows")
        # each whole-expert row's block; a sub-expert not in this call reads the call's first
        # block instead of zeros: ``present`` zeroes its activations, so its weights add
        # exact zeros (one compiled pass: a decode call is bound by its operation count)
        experts = np.empty(min(m, E), np.int64)
        src, present = np.empty(len(experts) * N, np.int64), np.empty(len(experts) * N, bool)
        n = _compiled(_place_loop)(subs_a, rows_a, N, E, experts, src, present)
        if n < 0:
            raise ValueError(f"run_blocks: sub-expert ids must be in 0 … {E * N - 1}, not "
                             f"{subs_a.tolist()}")
        experts, src, present = experts[:n], src[:n * N], present[:n * N]
        src_t = torch.from_numpy(src).to(dev)
        whole = {name: t.index_select(0, src_t) for name, t in blocks.items()}
        two_c, H = whole["gate_up_proj"].shape[1:]
        gu = whole["gate_up_proj"].view(n, N * two_c, H)  # [n, 2I, H], the sub-expert layout
        # every sub-expert of the call's experts here (k_active = N: an expert's sub-experts
        # are hits or misses together): no mask, the same sums (× 1 is exact)
        return self._fused({"gate_up_proj": gu, "down_proj": whole["down_proj"]},
                           experts, num_experts, hidden_states, top_k_index, top_k_weights,
                           None, present=None if present.all() else
                           torch.from_numpy(present).view(n, N).to(dev))

    def _fused(self, weights: dict[str, torch.Tensor], experts, num_experts: int,
               x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               all_routed: torch.Tensor | None, present: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The fused sub-expert product of whole experts (issue 41 §1): one group per expert,
        as the model's grouped forward has, not one per sub-expert. Per routed slot of an
        expert of this call: ``gate_up`` [2I, H] (sub-expert layout) over the token, the
        model's own gate (``_apply_gate``, else act(gate)·up) on each sub-expert's 2c
        outputs, the sub-experts the slot did not choose zeroed, then the down bytes read as
        [I, H] (:func:`to_subexpert_layout`) — Σ over the chosen sub-experts of their
        outputs, the same sums as the per-sub-expert path (:meth:`run_subexperts`) in another
        order (tested allclose), in the rows and groups of a whole-expert call. A zeroed
        sub-expert still costs its share of the two products here; what saves compute on
        hardware is what is fetched (sub-expert offloading) and a kernel that skips the
        zeroed blocks. ``present`` bool [n, N]: the sub-experts of each expert this call
        holds (None: all) — the others run elsewhere (another call, the host)."""
        from transformers.integrations.moe import _grouped_mm

        gu = weights["gate_up_proj"]  # [n, 2I, H]
        n, two_i, H = gu.shape
        N, c = self.N, self.c
        dev = top_k_index.device
        T, k = top_k_index.shape
        if self._chosen_call is None or self._chosen_call.shape[:2] != top_k_index.shape:
            self.choose(x, top_k_index, top_k_weights, num_experts)  # on its own
        # some sub-experts of a slot's expert may not run here: those are zeroed by a mask
        partial = (self._chosen_call.shape[-1] < N or self.global_k is not None
                   or present is not None)
        plan = (self._plan_compiled(experts, num_experts, top_k_index, all_routed, present,
                                    partial) if dev.type == "cpu" else None)
        if plan is None:
            plan = self._plan_tensors(experts, num_experts, top_k_index, all_routed, present,
                                      partial)
        rows, offs, mask = plan
        S = len(rows)
        if not S:
            return torch.zeros_like(x)
        up = _grouped_mm(x.index_select(0, rows // k), gu.transpose(1, 2), offs)  # [S, 2I]
        # the model's gate over [S, 2I] rows read as every sub-expert's gate outputs, then
        # every up output (one copy of ``up``): its own halves, as long as in the model's
        # forward. Over [S·N, 2c] rows (each sub-expert's halves) the activation ran ≈ 2×
        # slower on this CPU, strided in 16s, and one ulp apart in ~4 % of its values
        act = self.apply_gate(up.view(S, N, 2, c).transpose(1, 2).reshape(S, 2 * N * c)
                              ).view(S, N, c)
        if mask is not None:  # (counts 0 or 1: exact in any dtype)
            act = act * mask.to(act.dtype)[..., None]
        down = weights["down_proj"].reshape(n, two_i // 2, H)  # the bytes as [n, I, H]
        out = _grouped_mm(act.reshape(S, N * c), down, offs)  # [S, H]
        out = out * top_k_weights.reshape(-1).index_select(0, rows)[:, None].to(out.dtype)
        full = (torch.empty if len(rows) == T * k else torch.zeros)(  # every slot here: all set
            (T * k, H), dtype=out.dtype, device=dev)
        full.index_copy_(0, rows, out)
        # summed over each token's slots as the model's forward sums (reshape + sum)
        return full.view(T, k, H).sum(1).to(x.dtype)

    def _plan_tensors(self, experts, num_experts: int, top_k_index: torch.Tensor,
                      all_routed: torch.Tensor | None, present: torch.Tensor | None,
                      partial: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`_fused`'s slots by tensor operations (any device; the reference of
        :meth:`_plan_compiled`): records what runs here in the call's ``_ran_call`` and
        returns ``(rows, offs, mask)`` — long [S] the call's slots (flat T·k index) grouped by
        expert, a stable sort; int32 [n] the groups' ends; float32 [S, N] how often each row's
        sub-experts run here (``partial``; else None)."""
        from workbench.runtime.slots import positions

        n = len(experts)
        T, k = top_k_index.shape
        chosen = self._chosen_call.to(top_k_index.device)  # [T, k, w] sub-experts, -1 padding
        local = positions(experts, num_experts, top_k_index, all_routed).long()  # n: not here
        here = (local < n)[..., None] & (chosen >= 0)  # [T, k, w]: what this call runs
        if present is not None:
            here &= present[local.clamp(max=n - 1)[..., None], chosen.clamp(min=0)]
        ran = self._ran_call
        self._ran_call = torch.where(here.to(ran.device), chosen.to(ran.device, torch.int16),
                                     ran)
        flat = local.reshape(-1)
        # the slots grouped by expert, the ones not here (position n) last: one stable sort
        per = torch.bincount(flat, minlength=n + 1)
        S = T * k - int(per[n:].sum())
        rows = torch.argsort(flat, stable=True)[:S]
        offs = torch.cumsum(per[:n], 0).to(torch.int32)
        if not partial:
            return rows, offs, None
        w = chosen.shape[-1]
        pick = chosen.reshape(T * k, w).index_select(0, rows)
        mask = torch.zeros((S, self.N), dtype=torch.float32, device=flat.device).scatter_add_(
            1, pick.clamp(min=0).long(),
            here.reshape(T * k, w).index_select(0, rows).to(torch.float32))
        return rows, offs, mask

    def _plan_compiled(self, experts, num_experts: int, top_k_index: torch.Tensor,
                       all_routed: torch.Tensor | None, present: torch.Tensor | None,
                       partial: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """:meth:`_plan_tensors`' result and record, bit for bit, by one compiled pass on the
        host (:func:`_slots_loop`; a decode call is bound by its ≈ 15 tensor operations
        there). ``all_routed`` is every expert the call's slots are routed to, ``experts``
        themselves (its contract), so the position table equals the sorted search. None
        where the call's record is not on the host, or for an id the arrays cannot index
        (then the tensor operations name it)."""
        ran = self._ran_call
        if ran.device.type != "cpu" or self._chosen_call.device.type != "cpu":
            return None
        T, k = top_k_index.shape
        P = T * k
        w = self._chosen_call.shape[-1]
        chosen = _host(self._chosen_call).reshape(P, w)
        ex = _host(all_routed) if all_routed is not None else np.asarray(
            [int(e) for e in experts] if isinstance(experts, (list, tuple)) else experts,
            np.int64).reshape(-1)
        n = len(ex)
        pres = (np.zeros((0, 0), bool) if present is None
                else np.ascontiguousarray(present.cpu().numpy(), bool))
        ran_a = ran.numpy().reshape(P, w).copy()  # (a new record, as torch.where's)
        per = np.zeros(2 * n + 1, np.int32)  # the counts, then the groups' ends
        rows = np.empty(P, np.int64)
        mask = np.zeros((P if partial else 0, self.N), np.float32)
        S = _compiled(_slots_loop)(_host(top_k_index).reshape(-1), ex, num_experts, chosen,
                                   pres, ran_a, per, rows, mask)
        if S < 0:  # ids out of range: the tensor path says so
            return None
        self._ran_call = torch.from_numpy(ran_a.reshape(ran.shape))
        return (torch.from_numpy(rows[:S]), torch.from_numpy(per[n + 1:]),
                torch.from_numpy(mask[:S]) if partial else None)

    def fake_quant(self, weights: dict[str, torch.Tensor], experts, precision: str
                   ) -> dict[str, torch.Tensor]:
        """Whole experts ``experts`` (``weights`` theirs, in the sub-expert layout) quantised
        → dequantised to ``precision`` (ReaLB's low precision) in the model's own layout and
        put back in the sub-expert one: the values each expert has when ReaLB quantises the
        unmodified model (block groups run along the matrices' rows, which the sub-expert
        layout of ``down_proj`` does not keep)."""
        from workbench.precision import fake_quant

        perm = self.perm[torch.as_tensor([int(e) for e in experts], dtype=torch.long)]
        gu, d = from_subexpert_layout(weights["gate_up_proj"], weights["down_proj"], perm,
                                      self.N)
        gu = torch.stack([fake_quant(t, precision) for t in gu])
        d = torch.stack([fake_quant(t, precision) for t in d])
        gu, d = to_subexpert_layout(gu, d, perm, self.N)
        return {"gate_up_proj": gu, "down_proj": d}

    def record_all(self) -> None:
        """The shortcut on a layer the model's own forward ran whole (pinned): every routed
        slot of the call ran every sub-expert."""
        self._ran_call = self._chosen_call.to(self._ran_call.device, torch.int16)

    def _run_whole(self, weights, experts, num_experts, hidden_states, top_k_index,
                   top_k_weights, *args, all_routed=None, **kwargs) -> torch.Tensor:
        """The shortcut (``whole``): whole experts ``experts`` (``weights`` in the model's own
        layout), their routed slots recorded as having run every sub-expert."""
        if self._chosen_call is None or self._chosen_call.shape[:2] != top_k_index.shape:
            self.choose(hidden_states, top_k_index, top_k_weights, num_experts)
        chosen = self._chosen_call
        if all_routed is not None:  # every routed slot is in this call
            self._ran_call = chosen.to(self._ran_call.device, torch.int16)
        else:
            ids = torch.as_tensor([int(e) for e in experts], dtype=top_k_index.dtype,
                                  device=top_k_index.device)
            here = torch.isin(top_k_index, ids)[..., None] & (chosen >= 0)
            self._ran_call = torch.where(here.to(self._ran_call.device),
                                         chosen.to(self._ran_call.device, torch.int16),
                                         self._ran_call)
        return self.inner(weights, experts, num_experts, hidden_states, top_k_index,
                          top_k_weights, *args, all_routed=all_routed, **kwargs)

    def run_subexperts(self, weights: dict[str, torch.Tensor], subs, num_experts: int,
                       hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer output share of sub-experts ``subs`` (ids e·N + s, ``weights`` their
        own blocks in block form: :func:`subexpert_rows`, a cache slot's, a host row's), by
        the model's own experts forward over sub-experts (one group each) — each routed
        slot's chosen sub-experts among them, weighted by the slot's routing weight. Every call
        of a layer (hits, each miss, the host) records the slots it ran."""
        N, dev = self.N, top_k_index.device
        if self._chosen_call is None or self._chosen_call.shape[:2] != top_k_index.shape:
            self.choose(hidden_states, top_k_index, top_k_weights, num_experts)  # on its own
        chosen = self._chosen_call.to(dev)  # [T, k, w] (the host path runs on the host)
        # a slot routed nowhere has id E: its keys E·N + s are past every sub-expert's
        keys = top_k_index.long()[..., None] * N + chosen.clamp(min=0)
        mine = torch.zeros(num_experts * N + N, dtype=torch.bool, device=dev)
        mine[torch.as_tensor([int(x) for x in subs], dtype=torch.long, device=dev)] = True
        here = mine[keys] & (chosen >= 0)
        ran = self._ran_call
        self._ran_call = torch.where(here.to(ran.device), chosen.to(ran.device, torch.int16),
                                     ran)
        T = top_k_index.shape[0]
        ids = keys.masked_fill(~here, num_experts * N)  # the sentinel: not in this call
        w = top_k_weights[..., None].expand_as(here).masked_fill(~here, 0)
        return self.inner(model_form(weights), subs, num_experts * N, hidden_states,
                          ids.reshape(T, -1).to(top_k_index.dtype), w.reshape(T, -1),
                          *args, **kwargs)


__all__ = ["KERNELS", "LAYOUT_CACHE_BYTES", "PrismSetup", "PrismView", "from_subexpert_layout",
           "install_layout", "layout_budget", "model_form", "subexpert_rows",
           "subexpert_shapes", "to_subexpert_layout"]
