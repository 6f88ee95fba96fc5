"""Sub-experts on the live runtime (MoE-Prism).

Every routed expert runs through a :class:`~workbench.prism.execute.PrismView`: k_active of
its N sub-experts, or the token's K best of its routed experts' (``global_k``). The layer's
fused expert tensors are put into the sub-expert layout in place (and back, exactly, when the
offloader is removed; a layout kept between runs is installed as is and the module gets its own
tensors back: :func:`~workbench.prism.execute.install_layout`), so every copy made from them —
host store, slots, the pinned prefix — is in the layout the views read without copying. With
the shortcut (every sub-expert of every routed expert runs), the views run whole experts over
the unchanged layout.

With sub-expert offloading (``prism_offload``) the cache's keys are sub-experts
e·N + s (:attr:`SubExpertStage.part` = N keys per expert, slots of 1/N): only the sub-experts
a call runs are looked up, fetched and priced, each with its share of its expert's op.
"""

from __future__ import annotations

import numpy as np
import torch

from workbench.knobs import Knobs
from workbench.models.adapter import MoEBlock
from workbench.prism.knobs import PrismKnobs, choose_kernel
from workbench.runtime.stages.base import LayerCall, RunContext, Stage, StageSetup


def _resolved(ps, top_k: int, device: torch.device, balance: str):
    """``ps`` (a :class:`~workbench.prism.execute.PrismSetup`) with its kernel ``auto``
    resolved (:func:`~workbench.prism.knobs.choose_kernel`) for experts as wide as its
    permutation."""
    kernel = choose_kernel(ps.kernel, width=int(ps.perm.shape[-1]), subexperts=ps.subexperts,
                           k_active=ps.k_active, global_k=ps.global_k, top_k=int(top_k),
                           device=torch.device(device).type, balance=balance)
    return ps if kernel == ps.kernel else ps._replace(kernel=kernel)


class SubExpertStage(Stage):
    """MoE-Prism's views (one per MoE layer), the layout change, and the per-call pricing of
    the sub-experts each view chose; counts the sub-experts asked for and run, over the run."""

    COUNTS = ("subexperts_asked", "subexperts_ran")

    def __init__(self, prism, part: int, prices, device: torch.device) -> None:
        self.prism = prism  # a workbench.prism.execute.PrismSetup
        self.part = part
        self.prices = prices
        self.device = device
        self.views: dict[int, object] = {}  # MoE layer → its PrismView
        self.relaid: set[int] = set()  # layers whose experts are in the sub-expert layout
        #: the model's own expert tensors of a layer whose layout is a kept one, given back
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_knobs(cls, knobs: Knobs, run: RunContext) -> "SubExpertStage | None":
        """MoE-Prism (``prism=True``): the :class:`~workbench.prism.execute.PrismSetup` of the
        run's refactoring (and trained gate, ``prism_router``); None when off."""
        pk: PrismKnobs = knobs.group("prism")
        if not pk.prism:
            return None
        from workbench.prism.execute import PrismSetup

        lm = run.runtime.lm
        # checked there (prism_k too); the runtime's copy, shared and read-only
        ref, k_active = run.runtime.prism_refactoring(knobs)
        router = None
        if pk.prism_router:  # a trained sub-expert gate (seed §4.3.2) instead of the proxy's
            from workbench.prism.finetune import load as load_router

            router = torch.as_tensor(load_router(pk.prism_router, lm, ref).weight)
        N = ref.subexperts
        ps = PrismSetup(torch.tensor(ref.perm), torch.tensor(ref.gates), N, k_active,
                        pk.prism_k, router, bool(pk.prism_shortcut), pk.prism_kernel)
        ps = _resolved(ps, lm.layout.top_k, run.device, getattr(knobs, "balance", "none"))
        return cls(ps, N if pk.prism_offload else 1, run.prices, run.device)

    @classmethod
    def from_setup(cls, setup: StageSetup) -> "SubExpertStage | None":
        ps = setup.prism
        if ps is None:
            return None
        # ReaLB's controller (any) runs experts in low precision
        ps = _resolved(ps, setup.layout.top_k, setup.device,
                       "none" if setup.balance is None else "realb")
        return cls(ps, ps.subexperts if setup.prism_offload else 1, setup.prices, setup.device)

    def store_dims(self) -> dict[str, int]:
        return {"subexperts": self.prism.subexperts}

    @property
    def whole(self) -> bool:
        """The shortcut: every sub-expert of every routed expert runs, so every layer runs
        whole experts through the model's own forward, its layout unchanged."""
        ps = self.prism
        return bool(ps.shortcut and ps.global_k is None and ps.k_active >= ps.subexperts
                    and self.part == 1)

    def record(self, result) -> None:
        result.prism_kernel = "shortcut" if self.whole else self.prism.kernel

    @classmethod
    def store_attrs(cls, result) -> dict[str, str]:
        """``prism_kernel_run``: how sub-experts ran (``knob.prism_kernel`` may say auto)."""
        kernel = getattr(result, "prism_kernel", None)
        return {} if kernel is None else {"prism_kernel_run": kernel}

    @property
    def subexperts_asked(self) -> int:
        return sum(v.asked for v in self.views.values())

    @property
    def subexperts_ran(self) -> int:
        return sum(v.ran for v in self.views.values())

    # -- install / remove ---------------------------------------------------------------------
    def runner(self, b: MoEBlock, view):
        """``b``'s experts run through a sub-expert view over ``view``."""
        from workbench.prism.execute import PrismView

        ps = self.prism
        whole = self.whole
        view = PrismView(view, ps.perm, ps.gates, b.index, ps.subexperts, ps.k_active,
                         b.experts.act_fn, ps.global_k, ps.router, whole=whole,
                         apply_gate=getattr(b.experts, "_apply_gate", None), kernel=ps.kernel)
        self.views[b.index] = view
        if not whole:
            self.relayout(b)
            view.capture_gates(b.experts.gate_up_proj.data, self.device)
        return view

    def uninstall(self, b: MoEBlock) -> None:
        if b.index in self.relaid:
            self.relayout(b, back=True)

    def slot_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """A cache slot's weight shapes: one key's (a sub-expert's block with offloading)."""
        if self.part == 1:
            return shapes
        from workbench.prism.execute import subexpert_shapes

        return subexpert_shapes(shapes, self.part)

    def host_rows(self, host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The host store's rows of one layer: one per key (views: no copy)."""
        if self.part == 1:
            return host
        from workbench.prism.execute import subexpert_rows

        return subexpert_rows(host, self.part)

    def relayout(self, b: MoEBlock, back: bool = False) -> None:
        """``b``'s fused expert tensors into the sub-expert layout (``back``: out of it,
        exactly), in place of the module's parameters. A kept layout
        (:func:`~workbench.prism.execute.install_layout`) is installed as is, and its removal
        gives the module its own tensors back."""
        from workbench.prism.execute import from_subexpert_layout, install_layout

        perm, N = self.prism.perm[b.index], self.prism.subexperts
        gu, down = b.experts._parameters["gate_up_proj"], b.experts._parameters["down_proj"]
        with torch.no_grad():
            if back:
                own = self.own.pop(b.index, None)
                gu.data, down.data = own if own is not None else from_subexpert_layout(
                    gu.data, down.data, perm, N)
                self.relaid.discard(b.index)
                return
            own = (gu.data, down.data)
            gu.data, down.data, kept = install_layout(b.experts, perm, N)
            if kept:
                self.own[b.index] = own
        self.relaid.add(b.index)

    # -- per call -----------------------------------------------------------------------------
    def price(self, call: LayerCall) -> None:
        """The view chooses its sub-experts; the keys looked up and their modeled compute
        follow what runs."""
        b, p = call.block, self.prices
        view = self.views[b.index]
        view.choose(call.hidden_states, call.ids, call.weights, b.num_experts)
        low_mask = (np.array([e in call.low for e in call.experts], bool) if call.low
                    else None)  # None: every expert native (no per-call mask to build)
        if view.whole:  # the shortcut: each routed slot runs all
            N = view.N  # priced as every sub-expert run (= the expert's op), no per-call count
            lows = low_mask if low_mask is not None else [False] * len(call.tokens)
            call.compute_s = [p.subexpert_op(N * n, N, N, call.low_precision if lo else "native")
                              for n, lo in zip(call.tokens, lows)]
            return
        # router-side: the sub-experts each slot runs, priced
        experts = call.experts
        code = view.subexpert_codes(call.ids, b.num_experts)[experts]  # (runs, parts)
        compute_s = p.subexperts_coded(code, view.N, low_mask, call.low_precision)
        if self.part > 1:  # each sub-expert carries its share of its expert's op
            sub_ids = view.subexpert_ids(call.ids)
            call.key_ids = sub_ids if call.real is None else sub_ids[call.real]
            # (call.tokens: hybrid's rule, per sub-expert)
            call.keys, call.tokens, compute_s = view.subexpert_keys(
                call.ids, b.num_experts, experts, compute_s)
        else:  # an expert a global K left idle is not looked up (nothing of it runs)
            runs = code // (view.N + 1)
            ran = runs > 0
            if not ran.all():
                call.keys = [e for e, r in zip(experts, ran) if r]
                compute_s = compute_s[ran]
                runs = runs[ran]
            call.low &= set(call.keys)  # an idle expert runs in no precision
            # hybrid's rule, per key: the tokens that run some sub-expert of it
            if view.global_k is None:  # each routed slot runs w sub-experts: runs ÷ w
                call.tokens = (runs // min(view.k_active, view.N)).tolist()
            else:
                per_expert = view.tokens_per_expert(call.ids, b.num_experts)
                call.tokens = [int(per_expert[e]) for e in call.keys]
        call.compute_s = compute_s.tolist()

    def finish(self, call: LayerCall) -> None:
        """Which sub-experts each slot ran, for the store."""
        call.event.sub_chosen = self.views[call.block.index].take()
