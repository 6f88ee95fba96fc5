"""The Expert parallel knob group: EP ranks and placement, EPLB, capacity-aware dispatch, MACS,
ReaLB (torch-free).

One group (one card, ``knobs.group("ep")``) for the mechanisms of this package that spread a
layer's experts over ranks: :mod:`workbench.sim.ep` (ranks), :mod:`workbench.sim.placement`
and :mod:`workbench.sim.eplb` (which rank owns each expert), :mod:`workbench.sim.dispatch` and
:mod:`workbench.sim.macs` (capacity-aware dispatch), :mod:`workbench.sim.realb` (precision by
rank). Registered from :mod:`workbench.features`, as every feature's group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import param

from workbench.errors import KnobError
from workbench.knobs import KnobGroup
from workbench.sim.placement import check_eplb
from workbench.sim.realb import balances

if TYPE_CHECKING:
    from workbench.knobs import Knobs, ModelShape


class ExpertParallelKnobs(KnobGroup):
    """Expert parallelism (MACS, ReaLB): experts spread over ranks, each MoE layer waits for
    its most loaded rank. Ranks are virtual (:mod:`workbench.sim.ep`): every routed token is
    attributed to the rank owning its expert; what the model computes does not change."""

    title = "Expert parallel"

    ep_ranks = param.Integer(
        default=1, bounds=(1, 4096), softbounds=(1, 64),
        doc="Expert-parallel ranks the experts of a layer are spread over (1: no EP). At most "
            "the model's experts per layer.")
    placement = param.Selector(
        default="contiguous", objects=["contiguous"],  # the EP placements: workbench.features
        doc="Which rank owns each expert: 'contiguous' (e on ⌊e·R/E⌋), 'round-robin' (e mod R), "
            "'eplb' (EPLB: replicas of the busiest experts, refitted every eplb_interval steps "
            "on the last eplb_window; in the EP views and replay).")
    eplb_window = param.Integer(
        default=16, bounds=(1, None), softbounds=(1, 256),
        doc="EPLB: steps of per-expert load a plan is fitted on (the past only).")
    eplb_interval = param.Integer(
        default=8, bounds=(1, None), softbounds=(1, 256),
        doc="EPLB: steps between rebalances (each moves the changed experts' weights over "
            "the interconnect: modeled, its own lane).")
    num_redundant_experts = param.Integer(
        default=0, bounds=(0, None), softbounds=(0, 64),
        doc="EPLB: extra expert slots per layer for replicas of the busiest experts (experts + "
            "these must be a multiple of ep_ranks).")
    interconnect = param.Selector(
        default="nvlink-a100", objects=["nvlink-a100"],  # the interconnects: workbench.features
        doc="GPU-to-GPU link the modeled dispatch and combine all-to-alls cross (see "
            "docs/hardware-profiles.md, Interconnects).")

    dispatch = param.Selector(
        default="topk", objects=["topk"],  # the dispatch policies: workbench.features
        doc="Capacity-aware dispatch: 'topk' keeps the router's choice; 'capacity-drop' (CAI-MoE "
            "Token Drop) drops an overloaded expert's lowest-scoring tokens; 'macs' (MACS: "
            "semantic load, modality-aware capacity, local rerouting, fail-safe drop; the "
            "macs_* knobs) — live (inside the experts forward) and in trace replay.")
    capacity_factor = param.Number(
        default=1.0, bounds=(0.0, 1000.0), inclusive_bounds=(False, True), softbounds=(0.05, 5.0),
        doc="γ0: each expert's capacity is ⌈γ0 · tokens · k / experts⌉ per (step, layer).")
    capacity_scope = param.Selector(
        default="prefill", objects=["prefill", "all"],  # workbench.sim.dispatch.CAPACITY_SCOPES
        doc="Where capacity-aware dispatch acts: 'prefill' (the prefill step only; decode steps "
            "keep the router's top-k, as CAI-MoE's released code skips capacity at sequence "
            "length 1, docs/macs.md) or 'all' (every step, decode too: with a few tokens per "
            "step C = min_capacity; the workbench before this knob).")
    min_capacity = param.Integer(
        default=1, bounds=(0, None), softbounds=(0, 16),
        doc="Smallest capacity of an expert, whatever the batch (DeepSpeed-MoE uses 4).")
    # ReaLB (issue 15; workbench.sim.realb): low precision on overloaded, visual ranks
    balance = param.Selector(
        default="none", objects=["none", "fp4-all", "realb", "realb-seq", "realb-m1",
                                 "realb-m2"],
        doc="Rank balancing by precision (live): 'none'; 'fp4-all' runs every expert in "
            "low_precision (quantised offline); 'realb' runs the experts of hot (IB_d > "
            "realb_c), visual (R_vd > M_d) ranks in it, M_d by AIMD, converting their weights "
            "while the dispatch all-to-all runs; 'realb-seq' the same, the conversion after it "
            "(not overlapped); 'realb-m1'/'realb-m2' hold M_d at 0 / 0.7.")
    low_precision = param.Selector(
        default="nvfp4", objects=["nvfp4", "fp8"],
        doc="The low precision of balance (workbench.fake_quant: weights and activations "
            "quantised → dequantised; priced with the profile's FP4/FP8 rate where it has one).")
    low_precision_down_input = param.Selector(
        default="quantised", objects=["quantised", "native"],
        doc="The down projection's input in low precision: 'quantised' (W4A4 / W8A8: every "
            "expert GEMM takes quantised activations, ReaLB's NVFP4 scheme, seed 004 App. "
            "Quantization Details) or 'native' (W4A16 there: only the layer input quantised, "
            "the workbench before this knob; kept for comparison). Numerics only: the clock "
            "prices both alike.")
    realb_tau = param.Number(
        default=1.5, bounds=(1.0, 100.0),
        doc="ReaLB τ: M_d halves when the layer's IB_global exceeds it, else grows by 0.1.")
    realb_c = param.Number(
        default=1.0, bounds=(0.0, 100.0),
        doc="ReaLB C: a rank is hot when its load exceeds C × the mean.")
    realb_gate = param.Number(
        default=0.0, bounds=(0.0, None), softbounds=(0.0, 4096.0),
        doc="ReaLB Γ: act only when a layer call's routed assignments exceed it (paper: 2048 "
            "= 256 × 8 ranks; the embedded model's batches of 8 make ≈ 2 400 in the prefill "
            "and 32 per decode step).")
    realb_carry = param.Boolean(
        default=False,
        doc="ReaLB's M_d lives on across the Runtime's runs with the same balance, ranks and "
            "placement (a server's controller sees batch after batch; off: every run starts "
            "at M_d = 0.9).")
    # MACS (dispatch = macs; seed 002 §3, workbench.sim.macs)
    macs_delta = param.Number(
        default=1.5, bounds=(0.0, 100.0), softbounds=(0.0, 5.0),
        doc="MACS δ: a visual token's semantic weight is σ(−δ·H̃), H̃ its feature entropy "
            "z-scored within its image (paper: 1.5).")
    macs_rho = param.Number(
        default=0.6, bounds=(0.0, 2.0), softbounds=(0.0, 1.0),
        doc="MACS ρ: capacity C_j = C_base·(1 + ρ·m_j·(R_v − 0.5)) for visual (m = +1) and text "
            "(m = −1) experts (paper: 0.6; above 0.8 visual experts cannibalise text capacity).")
    macs_eta = param.Number(
        default=0.5, bounds=(0.0, 1.0),
        doc="MACS η: a rerouting candidate's score is (1−η)·router probability + η·cosine "
            "to the expert's calibrated centroid (the paper gives no value; 0.5 here).")
    macs_semantic_load = param.Boolean(
        default=True, doc="MACS +SL: count a visual token's load as its semantic weight w(x) "
                          "(off: every token counts 1). Needs the model's features: live only.")
    macs_dynamic_capacity = param.Boolean(
        default=True, doc="MACS +DC: scale each expert's capacity with the batch's effective "
                          "visual ratio R_v by its calibrated class (off: static capacity).")
    macs_reroute = param.Boolean(
        default=True, doc="MACS +SR: move an overflow token to a same-rank expert with room "
                          "before dropping it (needs every expert's router probability: live "
                          "only).")
    macs_selection = param.Selector(
        default="entropy", objects=["entropy", "retention", "router", "modality-prior", "random"],
        doc="MACS token selection (seed Table 3): who an overloaded expert keeps — 'entropy' "
            "(entropy-weighted score w·G_j, MACS), 'retention' (eq. 11's w·max G, token "
            "level), 'router' (router score), 'modality-prior' (text first), 'random'.")
    macs_calibration = param.String(
        default=None, allow_None=True,
        doc="Folder of a MACS calibration (expert classes, centroids; workbench calibrate-macs). "
            "None: the model's default (workspace, then beside the model); replay without one "
            "takes the classes from the trace itself (in-sample).")

    def check(self, knobs: "Knobs", shape: "ModelShape", *, live: bool = True) -> None:
        """Every rank owns at least one expert: ``ep_ranks`` ≤ experts per layer; a dispatch
        that needs a recorded trace (``needs`` holds "trace") does not run live."""
        if shape.num_experts is not None and self.ep_ranks > shape.num_experts:
            raise KnobError(f"ep_ranks must be at most the model's {shape.num_experts} experts "
                            f"per layer (each rank owns at least one), not {self.ep_ranks}")
        placement = self.selected("placement")
        if shape.num_experts is not None:
            placement.check_sizes(self, shape.num_experts)
        dispatch = self.selected("dispatch")
        if live and placement.dynamic and (
                getattr(dispatch, "per_rank", False) or balances(self.balance)):
            what = (f"balance={self.balance}" if balances(self.balance)
                    else f"dispatch={self.dispatch}")
            raise KnobError(f"placement {self.placement!r} replicates experts over the run's "
                            f"history; live {what} decides per owning rank: use contiguous or "
                            f"round-robin with it")
        needs = getattr(dispatch, "needs", frozenset())
        if live and "trace" in needs:
            raise KnobError(f"dispatch {self.dispatch!r} runs in trace replay only "
                            f"(workbench replay); live runs take another")
        if not live and balances(self.balance):
            raise KnobError(f"balance={self.balance!r} runs experts in low precision live; in "
                            f"replay use ds.moe.realb(...) (modeled) and balance='none'")
        if not live and "router" in needs:
            raise KnobError(f"dispatch {self.dispatch!r} needs every expert's router "
                            f"probability, which a trace does not record: live runs only")
        on = [] if live else dispatch.live_only_knobs(self)
        if on:
            raise KnobError(f"dispatch {self.dispatch!r} with "
                            f"{' and '.join(f'{n}=true' for n in on)} needs the model's "
                            f"features and router (live runs only); a trace replays it with "
                            f"{' '.join(f'--set {n}=false' for n in on)}")


__all__ = ["ExpertParallelKnobs", "check_eplb"]
