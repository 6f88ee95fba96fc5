"""ReaLB's controller (issue 15 §2; seed 004): which expert-parallel ranks run their experts in
low precision, per MoE layer, from the layer's per-rank load — torch-free, the same live and on
traces.

Per MoE layer with per-rank loads ``Load_d`` (routed assignments) and vision ratios ``R_vd``
(the share of a rank's assignments that are visual tokens):

- IB_d = Load_d / mean_d Load_d, IB_global = max_d IB_d;
- the **LB gate**: nothing switches unless the layer's aggregate load Σ_d Load_d exceeds Γ
  (``gate``; the paper: 2048 = 256 per rank × 8 ranks);
- a **hotspot** rank (IB_d > C, C = 1) whose R_vd > M_d runs its experts in the low precision;
  every other rank stays native;
- **AIMD** on M_d, per (layer, rank), starting at 0.9, after each gated decision: if
  IB_global > τ (1.5) then M_d ← 0.5·M_d, else M_d ← min(1, M_d + 0.1).

Variants (``mode``): ``realb`` (the above); ``fixed`` (M_d held at ``fixed_m``: ReaLB-m1 is
0, ReaLB-m2 0.7); ``all`` (every rank low, every layer, the gate aside: FP4-All); ``none``
(every rank native).
M_d is kept per (layer, rank) — the decisions are per MoE layer, and a layer's ranks see their
own traffic (the paper's Fig. 9 plots one layer's ranks); say so where it matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODES = ("none", "all", "realb", "fixed")
#: the ``balance`` knob's settings → (controller mode, fixed M_d): the seed's variants
BALANCES = {"none": ("none", 0.0), "fp4-all": ("all", 0.0), "realb": ("realb", 0.0),
            "realb-seq": ("realb", 0.0), "realb-m1": ("fixed", 0.0), "realb-m2": ("fixed", 0.7)}
#: the settings that convert weights online (FP4-All keeps its experts quantised offline)
ONLINE_SWITCH = ("realb", "realb-seq", "realb-m1", "realb-m2")
#: the settings that convert after the dispatch all-to-all, not under it (ReaLB-seq)
SEQUENTIAL = ("realb-seq",)


def balances(balance: str) -> bool:
    """Whether a ``balance`` setting runs any expert in low precision (every one but 'none')."""
    return BALANCES.get(balance, (balance,))[0] != "none"  # unknown: for_balance refuses it


def switch_s(profile, expert_bytes: float, low_experts: np.ndarray, precision: str,
             metadata_s: float = 0.0) -> np.ndarray:
    """Modeled seconds of ReaLB's online precision transformation (seed 004 §4.3: the
    scheduling metadata S, then the weights T) per layer call: every rank converts the
    weights of its ``low_experts`` (count per rank, ``[..., R]``) from 16 bits to
    ``precision`` (reads 16 bits, writes the low ones, at the profile's memory bandwidth, one
    kernel per rank that converts anything), the ranks in parallel — the slowest sets it; plus
    ``metadata_s`` (the allgather of the per-rank loads) on every call. Overlapped with the
    dispatch all-to-all (ReaLB) the layer waits for max(dispatch, S + T); sequential
    (ReaLB-seq) for dispatch + S + T."""
    n = np.asarray(low_experts, np.float64)
    bits = 8.0 if precision == "fp8" else 4.0 + 8.0 / 16
    per_rank = np.where(n > 0, profile.kernel_overhead_s
                        + n * expert_bytes * (1.0 + bits / 16.0) / profile.device_mem_bandwidth,
                        0.0)
    return per_rank.max(axis=-1) + metadata_s


@dataclass
class ReaLBDecision:
    """One layer's decision: ``low`` bool [R] (ranks in low precision), ``ib`` [R] (IB_d),
    ``ib_global``, ``vision`` [R] (R_vd), ``m`` [R] (M_d used), ``gated`` (the gate let it
    act)."""

    low: np.ndarray
    ib: np.ndarray
    ib_global: float
    vision: np.ndarray
    m: np.ndarray
    gated: bool


class ReaLB:
    """The controller's state over a run: M_d per (layer, rank) (module docstring)."""

    @classmethod
    def for_balance(cls, balance: str, layers: int, ranks: int, **kw) -> "ReaLB":
        """The controller of a ``balance`` knob setting (:data:`BALANCES`)."""
        if balance not in BALANCES:
            from workbench.errors import KnobError

            raise KnobError(f"balance must be one of {', '.join(BALANCES)}, not {balance!r}")
        mode, fixed = BALANCES[balance]
        return cls(layers, ranks, mode, fixed_m=fixed, **kw)

    def __init__(self, layers: int, ranks: int, mode: str = "realb", *, c: float = 1.0,
                 tau: float = 1.5, m0: float = 0.9, decrease: float = 0.5,
                 increase: float = 0.1, gate: float = 0.0, fixed_m: float = 0.0) -> None:
        from workbench.errors import InputError

        if mode not in MODES:
            raise InputError(f"ReaLB mode must be one of {', '.join(MODES)}, not {mode!r}")
        for name, v, lo in (("layers", layers, 0), ("ranks", ranks, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise InputError(f"ReaLB {name} must be a whole number ≥ {lo}, not {v!r}")
        # each setting: (value, lowest, highest)
        for name, v, lo, hi in (("c", c, 0.0, None), ("tau", tau, 1.0, None),
                                ("m0", m0, 0.0, 1.0), ("decrease", decrease, 0.0, 1.0),
                                ("increase", increase, 0.0, 1.0), ("gate", gate, 0.0, None),
                                ("fixed_m", fixed_m, 0.0, 1.0)):
            ok = (not isinstance(v, bool) and isinstance(v, (int, float, np.integer,
                                                              np.floating))
                  and np.isfinite(v) and v >= lo and (hi is None or v <= hi))
            if not ok:
                span = f"in {lo:g} … {hi:g}" if hi is not None else f"a finite number ≥ {lo:g}"
                raise InputError(f"ReaLB {name} must be {span}, not {v!r}")
        self.mode, self.c, self.tau = mode, float(c), float(tau)
        self.decrease, self.increase, self.gate = float(decrease), float(increase), float(gate)
        start = float(fixed_m) if mode == "fixed" else float(m0)
        self.m = np.full((layers, ranks), start)

    def decide(self, layer: int, load: np.ndarray, visual: np.ndarray) -> ReaLBDecision:
        """The decision for one MoE layer call: ``load`` [R] assignments per rank, ``visual``
        [R] the visual ones among them. Updates M_d (``realb`` mode, when gated)."""
        load = np.asarray(load, np.float64)
        R = len(load)
        total = float(load.sum())
        mean = total / R if R else 0.0
        ib = load / mean if mean > 0 else np.zeros(R)
        ib_global = float(ib.max()) if R else 0.0
        with np.errstate(invalid="ignore", divide="ignore"):
            vision = np.where(load > 0, np.asarray(visual, np.float64) / load, 0.0)
        m = self.m[layer].copy()
        gated = total > self.gate
        if self.mode == "all":  # FP4-All: every layer, whatever the gate (no balancing)
            low = load > 0
        elif self.mode == "none" or not gated:
            low = np.zeros(R, bool)
        else:
            low = (ib > self.c) & (vision > m)
        if self.mode == "realb" and gated:
            if ib_global > self.tau:
                self.m[layer] *= self.decrease
            else:
                self.m[layer] = np.minimum(1.0, self.m[layer] + self.increase)
        return ReaLBDecision(low=low, ib=ib, ib_global=ib_global, vision=vision, m=m,
                             gated=gated)


def realb_over_time(counts: np.ndarray, visual: np.ndarray, rank_of_expert: np.ndarray,
                    ranks: int, controller: ReaLB, price_native, price_low,
                    hidden_phase_s: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Run ``controller`` over per-(step, layer, expert) routed ``counts`` and their ``visual``
    part ([S, L, E]): per (step, layer) the ranks' loads, the decision, and the modeled compute
    of every rank — each expert priced by ``price_native(n)`` or ``price_low(n)`` (its
    rank's precision) — and the slowest rank's, native vs with the decisions. Returns arrays
    ``low`` [S, L, R], ``m`` [S, L, R], ``ib`` / ``vision`` [S, L, R] (IB_d, R_vd),
    ``ib_global`` [S, L], ``gated`` [S, L],
    ``compute_native_s`` / ``compute_s`` [S, L] (slowest rank), all *modeled* times."""
    from workbench.errors import InputError

    counts = np.asarray(counts)
    visual = np.asarray(visual)
    if counts.ndim != 3 or visual.shape != counts.shape:
        raise InputError(f"counts and visual must both be [steps, layers, experts], not "
                         f"{counts.shape} and {visual.shape}")
    if (counts < 0).any() or (visual < 0).any() or (visual > counts).any():
        raise InputError("counts must be ≥ 0 and visual between 0 and counts")
    counts, visual = counts.astype(np.int64), visual.astype(np.int64)
    S, L, E = counts.shape
    owner = np.zeros((E, ranks))
    owner[np.arange(E), rank_of_expert] = 1.0
    load = counts @ owner  # [S, L, R]
    vis = visual @ owner
    native_e = _priced(price_native, counts)
    low_e = _priced(price_low, counts)
    native_r = native_e @ owner
    low_r = low_e @ owner
    out = {k: np.zeros((S, L, ranks)) for k in ("low", "m", "ib", "vision")}
    out.update({k: np.zeros((S, L)) for k in ("ib_global", "gated", "compute_native_s",
                                              "compute_s")})
    for s in range(S):
        for l in range(L):
            d = controller.decide(l, load[s, l], vis[s, l])
            out["low"][s, l], out["m"][s, l] = d.low, d.m
            out["ib"][s, l], out["vision"][s, l] = d.ib, d.vision
            out["ib_global"][s, l], out["gated"][s, l] = d.ib_global, d.gated
            per_rank = np.where(d.low, low_r[s, l], native_r[s, l])
            out["compute_native_s"][s, l] = native_r[s, l].max() if ranks else 0.0
            out["compute_s"][s, l] = per_rank.max() if ranks else 0.0
    out["low"] = out["low"].astype(bool)
    out["gated"] = out["gated"].astype(bool)
    return out


class RealbCarry:
    """ReaLB's M_d carried from one run to the next (the ``realb_carry`` knob: a server's
    controller that lives across batches), one [layers, ranks] array per (balance, ranks,
    placement).

    Invariant: the only state runs of one :class:`~workbench.runtime.runtime.Runtime` share. It
    is owned here, handed to each run explicitly (``Runtime.realb_carry``) and changed only by
    the controller whose ``m`` :meth:`share` returned: a run that does not ask for it (knob off)
    neither reads nor changes it.
    """

    def __init__(self) -> None:
        self._m: dict[tuple, np.ndarray] = {}

    def share(self, key: tuple, m: np.ndarray) -> np.ndarray:
        """The M_d carried under ``key``; ``m`` (a fresh controller's) the first time. The array
        returned is shared: the run's AIMD updates to it are the next run's start."""
        return self._m.setdefault(key, m)

    def clear(self) -> None:
        """Forget every carried M_d: the next run that carries starts from a fresh controller."""
        self._m.clear()


def _priced(price, counts: np.ndarray) -> np.ndarray:
    """``price(n)`` of every count (:meth:`Prices.many`), 0 where nothing was routed."""
    from workbench.sim.costs import Prices

    return np.where(counts > 0, Prices.many(price, counts).reshape(counts.shape), 0.0)


__all__ = ["BALANCES", "balances", "MODES", "ONLINE_SWITCH", "ReaLB", "RealbCarry", "switch_s", "ReaLBDecision", "realb_over_time"]
