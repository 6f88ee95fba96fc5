"""The Elastic experts knob group (MoE-Prism, issue 16 §2): torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING

import param

from workbench.errors import KnobError
from workbench.knobs import KnobGroup
from workbench.sim.realb import balances

if TYPE_CHECKING:
    from workbench.knobs import Knobs, ModelShape


#: the kernels a live layer call can run sub-experts with
#: (:class:`~workbench.prism.execute.PrismView` ``kernel``)
KERNELS = ("fused", "per-subexpert")
#: the values of the ``prism_kernel`` knob, the default first: ``auto`` is one of
#: :data:`KERNELS`, chosen per run by :func:`choose_kernel`
KERNEL_CHOICES = ("auto", *KERNELS)
#: the expert width (intermediate size, columns of ``down_proj``) from which ``auto`` runs
#: only the chosen sub-experts when some are skipped. Measured on this CPU (BENCHMARKS.md,
#: *Wider experts* and *prism_kernel=auto*): per-subexpert was faster at k_active < N with
#: 256- and 512-wide experts whose sub-expert layouts are kept between runs (as the default
#: layout budget keeps them where the host memory allows); at 128 it was slower in every
#: setting but sub-expert offloading at 1 of 4, at the embedded model's 64 not reliably
#: faster; at k_active = N fused was faster at every width. On an H200 (stop 57) neither
#: kernel was the faster across settings at width 64 or 256: ``auto`` is fused there.
AUTO_PER_SUBEXPERT_WIDTH = 256


def choose_kernel(kernel: str, *, width: int, subexperts: int, k_active: int,
                  global_k: int | None, top_k: int, device: str,
                  balance: str = "none") -> str:
    """The kernel a run of ``prism_kernel=kernel`` runs: ``kernel`` itself unless it is
    ``auto``; then ``per-subexpert`` where it skips work on wide experts on the CPU — some
    sub-experts of a routed expert go unrun (``k_active`` < ``subexperts``, or a global
    ``prism_k`` below ``top_k`` × ``subexperts``), ``width`` ≥
    :data:`AUTO_PER_SUBEXPERT_WIDTH`, ``device`` (a ``torch.device`` type) ``cpu`` — without
    ReaLB's low precision (which per-subexpert refuses); else ``fused``. A speed choice only:
    both kernels compute the same sums. (``top_k`` is the router's; a dispatch that routes a
    token to more or fewer experts only changes which kernel is the faster.)"""
    if kernel != "auto":
        return kernel
    skips = k_active < subexperts if global_k is None else global_k < top_k * subexperts
    if skips and width >= AUTO_PER_SUBEXPERT_WIDTH and device == "cpu" \
            and not balances(balance):
        return "per-subexpert"
    return "fused"


class PrismKnobs(KnobGroup):
    """MoE-Prism: each routed expert runs k_active of its sub-experts (workbench refactor)."""

    title = "Elastic experts"

    prism = param.Boolean(
        default=False,
        doc="Run experts as sub-experts (MoE-Prism; needs a refactoring: workbench refactor). "
            "Live only.")
    prism_k_active = param.Integer(
        default=None, allow_None=True, bounds=(1, None),
        doc="Sub-experts each routed expert runs, chosen per token by the proxy gate (None: "
            "all of them, which computes what the experts do). At most the refactoring's "
            "sub-experts.")
    prism_k = param.Integer(
        default=None, allow_None=True, bounds=(1, None),
        doc="The sub-experts a token runs in all, the seed's K (Table 2): its K best among "
            "its routed experts' sub-experts by proxy-gate score × the expert's routing "
            "weight — any K in 1 … top-k × N (None: prism_k_active per expert). Not with "
            "prism_k_active.")
    prism_refactoring = param.String(
        default=None, allow_None=True,
        doc="Folder of a MoE-Prism refactoring (workbench refactor --out); None: "
            "<workspace>/prism/<model config hash>, else one shipped in "
            "<model dir>/workbench/prism.")

    prism_shortcut = param.Boolean(
        default=True,
        doc="With every sub-expert of every routed expert active (k_active = N, no prism_k), "
            "run whole experts: the same sums in the model's own order, at the unmodified "
            "runtime's cost, recorded as sub-experts. False: run the sub-expert path anyway "
            "(to test or time it). Not with prism_offload, which caches sub-experts.")
    prism_kernel = param.Selector(
        objects=list(KERNEL_CHOICES), default=KERNEL_CHOICES[0],
        doc="How a live layer call runs sub-experts (the sub-expert path: prism_k_active < "
            "N, prism_k, sub-expert offloading, or prism_shortcut=False). fused: one group "
            "per expert, every sub-expert's products computed and the unchosen zeroed — the "
            "fewest tensor operations, fastest where experts are narrow (the embedded "
            "model). per-subexpert: one group per sub-expert through the model's own experts "
            "forward, only the chosen computed (k_active / N of the multiply-adds) — faster "
            "at k_active < N where experts are wide (BENCHMARKS.md, Wider experts). The same "
            "sums in another order: equal to rounding, not bit for bit. Not with ReaLB's low "
            "precision (its scales are per expert). auto: per-subexpert on the CPU when "
            "sub-experts are skipped (prism_k_active < N, or prism_k below top-k × N) and "
            "experts are at least 256 wide (without ReaLB's low precision), else fused — "
            "fused on the embedded model. Live only.")
    prism_router = param.String(
        default=None, allow_None=True,
        doc="Folder of a trained sub-expert gate (workbench.prism.finetune, seed §4.3.2) that "
            "chooses the sub-experts instead of the training-free proxy gate; trained for the "
            "run's refactoring. None: the proxy gate. In replay it describes the recording "
            "(the trace carries which sub-experts ran).")

    prism_offload = param.Boolean(
        default=False,
        doc="Cache and fetch sub-experts, not whole experts (MoE-Prism §4): the same memory in "
            "slots of 1/N of an expert (cache_slots · N of them), and only the sub-experts a "
            "token runs are copied. Live (with prism=True), or in trace replay of a run "
            "recorded with prism=True.")

    def check(self, knobs: "Knobs", shape: "ModelShape", *, live: bool = True) -> None:
        """ReaLB's low precision with sub-experts, not yet with sub-expert offloading; live
        sub-expert offloading not with what names whole experts (lookahead and predictor
        prefetch, ActiveEvict, the predictor, dynamic top-k's residency budget; replay refuses
        lookahead prefetch itself, for want of sub-expert lookahead in the trace). In replay
        ``prism``/``prism_k_active`` describe the recording: the trace carries which
        sub-experts ran (they cannot be chosen again without the hidden states)."""
        if self.prism_offload and live:
            if not self.prism:
                raise KnobError("prism_offload=True caches the sub-experts a run runs: set "
                                "prism=True too")
            # these decide on whole experts' keys (hot sets, router lookahead, residency)
            for name, off in (("active_evict", False), ("predictor", "none"),
                              ("dynamic_topk", False)):
                if getattr(knobs, name, off) != off:
                    raise KnobError(f"prism_offload=True with {name}={getattr(knobs, name)!r} "
                                    f"is not built yet (it picks whole experts): set "
                                    f"{name}={off!r}")
            # a prefetcher that reads the routing of earlier steps works on sub-expert keys
            # (as in replay); lookahead (the routers', the predictor's) names whole experts
            from workbench.policies.prefetch import PREFETCH

            pf = getattr(knobs, "prefetch", "none")
            if pf in PREFETCH and PREFETCH.get(pf).needs:
                ok = [n for n in PREFETCH.available() if not PREFETCH.get(n).needs]
                reads = " and ".join(_READS.get(n, n) for n in sorted(PREFETCH.get(pf).needs))
                raise KnobError(f"prism_offload=True with prefetch={pf!r} is not built yet (it "
                                f"reads {reads}, which name whole experts): choose one of "
                                f"{', '.join(ok)}")
        if self.prism_router is not None and not self.prism and live:
            raise KnobError("prism_router chooses sub-experts: set prism=True too")
        if not self.prism:
            return
        if self.prism_kernel == "per-subexpert" and balances(getattr(knobs, "balance", "none")):
            raise KnobError(f"prism_kernel={self.prism_kernel!r} with balance="
                            f"{knobs.balance!r} is not built (ReaLB quantises each expert "
                            f"with its own scales; this kernel's groups are sub-experts): "
                            f"set prism_kernel='fused' or 'auto', or balance='none'")
        if self.prism_offload and balances(getattr(knobs, "balance", "none")):
            raise KnobError(f"prism_offload=True with balance={knobs.balance!r} is not built "
                            f"yet (ReaLB picks whole experts' precision per rank): set "
                            f"prism_offload=false, or balance='none'")


#: what a prefetch policy's ``needs`` read, for the refusal under ``prism_offload``
_READS = {"pred_ids": "the routers' lookahead", "predicted_ids": "the predictor's outputs",
          "future": "the trace's future"}

__all__ = ["AUTO_PER_SUBEXPERT_WIDTH", "KERNELS", "KERNEL_CHOICES", "PrismKnobs",
           "choose_kernel"]
