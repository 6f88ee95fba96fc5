"""ActiveEvict (docs/references.md): budget-aware pre-eviction and budget-aware dynamic top-k.

The live runtime (:mod:`workbench.runtime.offload`) drives this module once per MoE layer:

1. **Router lookahead** (offload.py): at layer l the routers of layers l+1 … l+D are applied to
   layer l's MoE input; layer l+1's predicted top-k set (per token, the router's own top-k) and
   p̂_{l+1}(e) = mean over tokens of softmax(router logits) (eq. 10–12) come here.
2. **Hotness** (eq. 8–9): :class:`Hotness` keeps, per layer, the routing indicators of the last
   ``ae_window`` tokens; u(e) = Σ_t γ^(T−t)·1_t(e), h(e) = u(e) / Σ_{e'∈C_l} u(e') over the layer's
   resident experts C_l.
3. **Importance** (eq. 13): s(e) = α·h(e) + (1−α)·p̂(e).
4. **Release target** (eq. 14–17): Δ = (k − Ĥ) + r_k with Ĥ the predicted top-k of l+1 already
   resident and r_k = Σ_{j<r_max} 1[p_(k+j) − p_(k+j+1) < τ] on the sorted p̂_{l+1}.
5. **Pre-eviction**: while layer l still computes (after all of its misses have a slot), resident
   experts are evicted in ascending s until the cache has at least Δ free slots. Loading stays
   on demand, after layer l+1's gate (fetch precision = recall = 100 % by construction).
6. **Budget-aware dynamic top-k** (eq. 18–21, :func:`budget_topk`): at the gate of layer l,
   k_l = max{k ≤ k_max : u_l(k) ≤ B − H_l}, at least 1.

How the paper's per-layer budget maps onto the workbench's cache
-----------------------------------------------------------------
The paper gives each layer its own budget B_l; the workbench has **one pool of slots shared by
every offloaded layer** (VisMMOE §3.4 slab cache). So:

- *B − H_l* (eq. 18, "slots available for new experts") is read as the pool's **free slots** at
  the gate of layer l: B = ``num_slots``, H_l = slots occupied. Pre-eviction is what makes slots
  free ahead of demand; evictable-but-occupied slots do not count, because using them would put
  an eviction back on the critical path, which is exactly what the paper avoids. (Without
  ``active_evict`` the free budget is only the never-used slots, so ``dynamic_topk`` is meant to
  be combined with it, as in the paper.)
- *Release Δ slots*: slots already free count towards Δ; only the shortfall is evicted.
- *Which experts may be pre-evicted*: any resident expert of any offloaded layer except (a) the
  experts the current layer routed (it still needs them) and (b) layer l+1's predicted top-k
  (Ĥ counts them as resident; evicting them would contradict the release target). Candidates
  are ranked by s(e) of **their own** layer: h from that layer's window and resident set, p̂
  from the freshest prediction made for that layer (this step's for l+1, earlier ones for the
  rest; 0 if none yet). Ties go to the smaller (layer, expert).
- *Multi-token steps* (prefill): the predicted demand of l+1 is the union of every token's
  predicted top-k; the prediction gap is |demand \\ resident| and the boundary term r is taken
  at rank |demand| of the mean p̂. For one token (decode) this is eq. 17 exactly.
- *Dynamic top-k* applies to **decode** steps of **offloaded** layers: the prefill routes every
  prompt token through the full top-k (its demand is the union over all prompt tokens, which a
  free-slot budget would cut to one expert per token), and pinned layers are outside the cache
  budget. The chosen k is one per (step, layer); the experts then receive the model's own
  router output for top-k = k_l (so weights are renormalised exactly as that router does).

The paper's B is a **per-layer** budget (eq. 5: |C_l| ≤ B_l; eq. 18: B − H_l with
H_l = |C_l|, and pre-eviction frees slots among layer l+1's own residents). The reading above
is the same formula applied to the pool the layer draws from; with one pool per layer (the
replay's ``scope="per-layer"``) it would be the paper's exactly. The live runtime has the
shared pool only, so per-layer budgets are not measured live (issue 39 §7).

When dynamic top-k can act: pre-eviction has already released Δ = (k − Ĥ) + r_k slots before
the gate, so u_l(k) > B − H_l only when the router misses more experts than the lookahead
predicted plus the r_k slots of slack — a misprediction of more than r_k experts — or when too
few candidates remain to release Δ (every other resident protected or predicted: pools of a
few k slots; with per-layer budgets, B_l < k + r_max). With many experts per layer the sorted p̂ is
flat at the top-k boundary, so r_k = r_max almost always and the slack covers nearly every
misprediction (BENCHMARKS.md, "ActiveEvict: dynamic top-k, importance ablation and α").

The paper gives no numbers for α, γ, T, τ, r_max or k_max; the defaults below are this
workbench's choices (α = 0.5 sits on the paper's reported plateau, Fig. 9; k_max = the model's
top-k, i.e. dynamic top-k only narrows routing, as in the paper's Fig. 8).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Iterable

import numpy as np
import param

from workbench.errors import KnobError
from workbench.knobs import KnobGroup

if TYPE_CHECKING:
    from workbench.knobs import Knobs, ModelShape

Key = tuple[int, int]  # (layer, expert)


class ActiveEvictKnobs(KnobGroup):
    """Router lookahead, ActiveEvict pre-eviction and budget-aware dynamic top-k (ActiveEvict)."""

    title = "Lookahead & ActiveEvict"

    lookahead_depth = param.Integer(
        default=2, bounds=(0, None), softbounds=(0, 8),
        doc="Router lookahead: at each MoE layer l apply the routers of layers l+1 … l+D to "
            "layer l's MoE input and record the predicted top-k (store variable pred_ids). "
            "0 disables recording (ActiveEvict still looks one layer ahead).")
    active_evict = param.Boolean(
        default=False,
        doc="ActiveEvict: before layer l+1 runs, free (k − Ĥ) + r_k cache slots by evicting "
            "the least important experts (s = α·hotness + (1−α)·predicted probability). "
            "Experts are still loaded only on demand, after the gate.")
    ae_alpha = param.Number(
        default=0.5, bounds=(0.0, 1.0), softbounds=(0.0, 1.0),
        doc="α of the importance s = α·h + (1−α)·p̂: 1 = hotness only (≈ LRU/LFU), "
            "0 = cross-layer prediction only.")
    ae_decay = param.Number(
        default=0.9, bounds=(0.0, 1.0), inclusive_bounds=(False, True), softbounds=(0.5, 1.0),
        doc="γ of the hotness u(e) = Σ γ^(T−t)·1_t(e): 1 counts every token of the window "
            "alike, smaller values favour recent tokens.")
    ae_window = param.Integer(
        default=32, bounds=(1, None), softbounds=(1, 256),
        doc="T: hotness window in tokens (per layer; prefill tokens count one by one).")
    ae_tau = param.Number(
        default=0.02, bounds=(0.0, 1.0), softbounds=(0.0, 0.2),
        doc="τ: a gap p_(k+j) − p_(k+j+1) of the predicted next-layer probabilities below τ "
            "marks an uncertain top-k boundary and reserves one more slot.")
    ae_rmax = param.Integer(
        default=2, bounds=(0, None), softbounds=(0, 8),
        doc="r_max: at most this many extra slots for boundary uncertainty (0: none).")
    dynamic_topk = param.Boolean(
        default=False,
        doc="Budget-aware dynamic top-k (changes routing, hence outputs): at each offloaded "
            "layer of a decode step use the largest k ≤ k_max whose misses fit the free cache "
            "slots (at least 1). Best combined with active_evict.")
    k_max = param.Integer(
        default=None, allow_None=True, bounds=(1, None),
        doc="Largest k dynamic top-k may choose; None = the model's top-k (only narrows "
            "routing). Values above the model's top-k widen routing when slots are free.")

    def check(self, knobs: "Knobs", shape: "ModelShape", *, live: bool = True) -> None:
        """``k_max`` ≤ the model's experts per layer; ``active_evict`` runs live only."""
        if not live:
            if self.active_evict:
                raise KnobError(
                    "active_evict runs live only (it acts on the router lookahead's "
                    "probabilities, which traces do not keep): pass active_evict=False to "
                    "replay this trace under the other policies")
            return
        if self.k_max is not None and shape.num_experts is not None \
                and self.k_max > shape.num_experts:
            raise KnobError(f"k_max must be between 1 and {shape.num_experts} (experts per "
                            f"layer), not {self.k_max}")


_AE = ActiveEvictKnobs.param


# -- hotness ----------------------------------------------------------------------------------
class Hotness:
    """Per-layer sliding window of routing indicators; u(e) = Σ_{t=1..T} γ^(T−t)·1_t(e)."""

    def __init__(self, num_layers: int, num_experts: int, window: int, decay: float) -> None:
        self.E = num_experts
        self.window = int(window)
        self.buf = np.zeros((num_layers, self.window, num_experts), np.float32)
        # oldest row weighs γ^(T−1), the newest 1
        self.weights = (float(decay) ** np.arange(self.window - 1, -1, -1)).astype(np.float32)
        self._u: dict[int, np.ndarray] = {}

    def observe(self, layer: int, topk_ids: np.ndarray) -> None:
        """Append the tokens of one layer call (``topk_ids [T, k]``, -1 = none) to the window."""
        ids = np.asarray(topk_ids)
        n = ids.shape[0]
        if n == 0:
            return
        W = self.window
        x = np.zeros((min(n, W), self.E), np.float32)
        rows = ids[-W:]
        r, c = np.nonzero(rows >= 0)
        x[r, rows[r, c]] = 1.0
        b = self.buf[layer]
        if n >= W:
            b[:] = x
        else:
            b[:-n] = b[n:].copy()
            b[-n:] = x
        self._u.pop(layer, None)

    def u(self, layer: int) -> np.ndarray:
        """Decayed usage ``[E]`` of ``layer`` over its window."""
        if layer not in self._u:
            self._u[layer] = self.weights @ self.buf[layer]
        return self._u[layer]


# -- the paper's formulas, as pure functions ------------------------------------------------------
def release_target(p_hat: np.ndarray, demand: int, predicted_resident: int, tau: float,
                   r_max: int) -> int:
    """Δ = (k − Ĥ) + r_k (eq. 17) with k = ``demand`` (predicted experts of the next layer),
    Ĥ = ``predicted_resident`` and r_k over the descending-sorted ``p_hat`` (eq. 16)."""
    p = np.sort(np.asarray(p_hat, np.float64))[::-1]
    r = 0
    for j in range(int(r_max)):
        a = demand + j  # 1-based rank k+j → index k+j−1; its successor → index k+j
        if a < 1 or a >= len(p):
            break
        if p[a - 1] - p[a] < tau:
            r += 1
    return max(demand - predicted_resident, 0) + r


def budget_topk(ranked: np.ndarray, is_resident, avail: int) -> int:
    """k_l = max{k ≤ k_max : u_l(k) ≤ avail} (eq. 20), at least 1.

    ``ranked [T, k_max]``: each token's experts by descending router probability;
    ``is_resident(e)``; ``avail`` = free slots (B − H_l). u_l(k) counts the distinct experts of
    every token's top-k that are not resident (the misses the layer would load).
    """
    ranked = np.asarray(ranked)
    kmax = ranked.shape[1]
    missing: set[int] = set()
    best = 1
    for k in range(1, kmax + 1):
        for e in np.unique(ranked[:, k - 1]).tolist():
            if e >= 0 and not is_resident(e):
                missing.add(e)
        if len(missing) > avail:
            break
        best = k
    return best


class ActiveEvict:
    """Per-run state of ActiveEvict: hotness windows and the latest p̂ per layer."""

    def __init__(self, num_layers: int, num_experts: int, *, alpha: float = _AE.ae_alpha.default,
                 decay: float = _AE.ae_decay.default, window: int = _AE.ae_window.default,
                 tau: float = _AE.ae_tau.default, r_max: int = _AE.ae_rmax.default) -> None:
        """The defaults are the knobs' (``ae_alpha``, ``ae_decay``, ``ae_window``, ``ae_tau``,
        ``ae_rmax``)."""
        self.alpha, self.tau, self.r_max = float(alpha), float(tau), int(r_max)
        self.hot = Hotness(num_layers, num_experts, window, decay)
        self.p_hat = np.zeros((num_layers, num_experts), np.float64)
        self.release_log: list[tuple[int, int]] = []  # (next layer, Δ) of every decision

    @classmethod
    def from_knobs(cls, knobs, num_layers: int, num_experts: int) -> "ActiveEvict":
        return cls(num_layers, num_experts, alpha=knobs.ae_alpha, decay=knobs.ae_decay,
                   window=knobs.ae_window, tau=knobs.ae_tau, r_max=knobs.ae_rmax)

    def observe(self, layer: int, topk_ids: np.ndarray) -> None:
        self.hot.observe(layer, topk_ids)

    def scores(self, keys: Iterable[Key], resident: Iterable[Key]) -> dict[Key, float]:
        """s(e) = α·h(e) + (1−α)·p̂(e) for ``keys``, h normalised over each layer's resident set."""
        by_layer: dict[int, list[int]] = {}
        for l, e in resident:
            by_layer.setdefault(l, []).append(e)
        norm: dict[int, float] = {}
        out = {}
        a = self.alpha
        for l, e in keys:
            u = self.hot.u(l)
            if l not in norm:
                norm[l] = float(u[by_layer.get(l, [])].sum())
            h = float(u[e]) / norm[l] if norm[l] > 0 else 0.0
            out[(l, e)] = a * h + (1 - a) * float(self.p_hat[l, e])
        return out

    def pre_evict(self, cache, next_layer: int, demand: set[int], p_next: np.ndarray,
                  protected: set[Hashable]) -> list[Key]:
        """Before ``next_layer`` runs: record p̂, compute Δ and evict (ascending importance)
        until at least Δ slots are free. Never evicts ``protected`` keys or the predicted
        ``demand`` of ``next_layer``. Returns the evicted keys."""
        self.p_hat[next_layer] = p_next
        resident_next = sum(1 for e in demand if (next_layer, e) in cache)
        delta = release_target(p_next, len(demand), resident_next, self.tau, self.r_max)
        self.release_log.append((next_layer, delta))
        free = cache.free_slots()
        need = delta - free
        if need <= 0:
            return []
        resident = cache.resident()
        cands = [key for key in resident if key not in protected
                 and not (key[0] == next_layer and key[1] in demand)]
        if not cands:
            return []
        s = self.scores(cands, resident)
        victims = sorted(cands, key=lambda key: (s[key], key))[:need]
        for key in victims:
            cache.evict(key)
        return victims
