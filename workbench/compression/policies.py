"""Visual-token compression policies (VisMMOE Algorithm 1) and their knobs.

A policy decides, once per request, which of the request's N visual tokens survive past the
pinned prefix. It sees a :class:`SelectionInput`:

- ``saliency`` ``[N]`` float: head-averaged attention each merged visual token receives in the
  vision encoder's last block (:mod:`workbench.compression.saliency`), raw (not normalised), in
  the order of the visual positions of the sequence; ``None`` when the policy does not ask for it.
- ``prefix_topk`` ``[P, N, k]`` int64: the top-k expert ids each visual token was routed to in
  each of the P = ``pinned_layers`` pinned-prefix MoE layers; ``None`` when P = 0, or for a
  policy with ``needs_prefix_routing = False`` (``random``) when the router lookahead asked for
  the selection before the prefix was complete.

and returns the **sorted** indices (into ``0..N-1``) of the visual tokens to keep, exactly
K_keep = ⌊βN⌋ of them. Text tokens are never given to a policy, so they are never pruned.

Algorithm 1 (``affinity``): s̃ = min-max(s); K_core = ⌊αN⌋ most salient tokens form I_core;
a token's active-expert set E_i is its (layer, expert) pairs over the pinned prefix;
E_target = ∪_{j∈I_core} E_j; for i ∉ I_core, Δ_i = |E_i \\ E_target| / |E_i| and
p_i = s̃_i − λΔ_i; I_keep = I_core ∪ TopK(p, K_keep − K_core). ``saliency`` is the same with
λ = 0 (VisionZip-like); ``random`` keeps a uniformly random K_keep-subset drawn from a generator
seeded by the ``seed`` knob (reproducible); ``none`` keeps everything (the hooks are not even
installed). With ``pinned_layers = 0`` there is no prefix routing, so Δ = 0 and ``affinity``
reduces to ``saliency``. Ties in TopK are broken towards the lower index (stable sort).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import param

from workbench.errors import KnobError
from workbench.knobs import GenerationKnobs, KnobGroup
from workbench.policies.registry import NeedsFlag, Registry, declared_kwargs

if TYPE_CHECKING:
    # torch is imported inside the functions that compute: this module stays torch-free, since
    # its knob group and registry are read by Knobs (the CLI, replay, the dashboard)
    import torch

    from workbench.knobs import Knobs, ModelShape


@dataclass
class SelectionInput:
    """What a compression policy sees for one request (see the module docstring)."""

    num_visual: int
    num_experts: int
    saliency: torch.Tensor | None = None  # [N] float, raw
    prefix_topk: torch.Tensor | None = None  # [P, N, k] int64, P = pinned layers


COMPRESSION: Registry[CompressionPolicy] = Registry("compression", "compression")


class CompressionKnobs(KnobGroup):
    """Visual-token compression behind the pinned prefix (VisMMOE Algorithm 1)."""

    title = "Token compression"

    compression = param.Selector(
        default="none", objects=["none"],  # every registered policy: bound by workbench.features
        doc="Which visual tokens survive past the pinned prefix: 'affinity' (Algorithm 1), "
            "'saliency' (affinity with λ = 0), 'random' (seeded by seed), 'none' (all). "
            "Text tokens are never pruned.")
    alpha = param.Number(
        default=0.1, bounds=(0.0, 1.0), softbounds=(0.0, 0.5),
        doc="α: share of visual tokens kept for saliency alone (the core, K_core = ⌊αN⌋, "
            "at most K_keep); their experts form the target set E_target.")
    beta = param.Number(
        default=0.5, bounds=(0.0, 1.0), inclusive_bounds=(False, True), softbounds=(0.1, 1.0),
        doc="β: keep ratio, K_keep = ⌊βN⌋ of the N visual tokens reach the layers after the "
            "pinned prefix (paper: 0.5 main results, 0.7). Used only when compression ≠ none.")
    lam = param.Number(
        default=2.0, bounds=(0.0, None), softbounds=(0.0, 5.0),
        doc="λ: weight of the marginal expert expansion Δ against saliency, p = s̃ − λΔ "
            "(paper: 2). λ = 0 is saliency-only.")

    def check(self, knobs: "Knobs", shape: "ModelShape", *, live: bool = True) -> None:
        """Live, with compression on: the salient core is part of the kept tokens (α ≤ β)."""
        if live and self.selected("compression").prunes and self.alpha > self.beta:
            raise KnobError(f"alpha must be at most beta (the salient core is part of the "
                            f"kept tokens), not alpha={self.alpha} > beta={self.beta}")


class CompressionPolicy:
    """Base: ``select(inp)`` → sorted kept visual indices (``LongTensor [K_keep]``, CPU)."""

    name = "?"
    #: what the policy reads: "saliency" (the placement installs the vision-saliency hook only
    #: for policies that need it) and "prefix_routing" (the selection waits until every pinned
    #: layer has routed, so ``prefix_topk`` is complete; without it the placement may select as
    #: soon as the router lookahead asks, see
    #: :meth:`~workbench.compression.placement.PrunedPlacement.prefill_keep_mask`)
    needs: frozenset[str] = frozenset({"prefix_routing"})
    needs_saliency = NeedsFlag("saliency")
    needs_prefix_routing = NeedsFlag("prefix_routing")
    #: False: keep every token, install nothing
    prunes = True

    def __init__(self, beta: float = CompressionKnobs.param.beta.default) -> None:
        self.beta = float(beta)

    @classmethod
    def from_knobs(cls, knobs: "Knobs") -> "CompressionPolicy":
        """The policy of a run of ``knobs``: a built-in reads its knob group's fields (and the
        run's ``seed``); the base gives ``__init__`` the knobs it declares
        (:func:`~workbench.policies.registry.declared_kwargs`: an outside policy's)."""
        return cls(**declared_kwargs(cls, knobs))

    @classmethod
    def semantic_floor(cls, group: "CompressionKnobs") -> int:
        """L_semantic the policy asks for under its knob group: how many pinned layers' routing
        its selection reads (the base: none)."""
        return 0

    def k_keep(self, n: int) -> int:
        """K_keep = ⌊βN⌋."""
        return int(self.beta * n)

    def select(self, inp: SelectionInput) -> torch.Tensor:
        raise NotImplementedError




@COMPRESSION.register("none")
class NoCompression(CompressionPolicy):
    """Keep every visual token (the model runs unchanged)."""

    prunes = False

    @classmethod
    def from_knobs(cls, knobs: "Knobs") -> "NoCompression":
        return cls(knobs.group("compression").beta)

    def select(self, inp: SelectionInput) -> torch.Tensor:
        import torch

        return torch.arange(inp.num_visual)


@COMPRESSION.register("random")
class RandomCompression(CompressionPolicy):
    """Keep a uniformly random ⌊βN⌋-subset; the generator is seeded with the ``seed`` knob."""

    needs = frozenset()

    def __init__(self, beta: float = CompressionKnobs.param.beta.default,
                 seed: int = GenerationKnobs.param.seed.default) -> None:
        super().__init__(beta)
        self.seed = int(seed)

    @classmethod
    def from_knobs(cls, knobs: "Knobs") -> "RandomCompression":
        return cls(knobs.group("compression").beta, knobs.group("generation").seed)

    def select(self, inp: SelectionInput) -> torch.Tensor:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        n = inp.num_visual
        return torch.randperm(n, generator=g)[: self.k_keep(n)].sort().values


@COMPRESSION.register("affinity")
class AffinityCompression(CompressionPolicy):
    """Algorithm 1: saliency core plus the tokens that add the fewest new (layer, expert)
    pairs to the core's working set, traded off against saliency by λ."""

    needs = frozenset({"saliency", "prefix_routing"})

    def __init__(self, beta: float = CompressionKnobs.param.beta.default,
                 alpha: float = CompressionKnobs.param.alpha.default,
                 lam: float = CompressionKnobs.param.lam.default) -> None:
        super().__init__(beta)
        self.alpha = float(alpha)
        self.lam = float(lam)

    @classmethod
    def from_knobs(cls, knobs: "Knobs") -> "AffinityCompression":
        group: CompressionKnobs = knobs.group("compression")
        return cls(group.beta, group.alpha, group.lam)

    @classmethod
    def semantic_floor(cls, group: "CompressionKnobs") -> int:
        """The marginal expansion (λ > 0) reads the first pinned layer's routing at least."""
        return 1 if group.lam > 0 else 0

    def select(self, inp: SelectionInput) -> torch.Tensor:
        if inp.saliency is None:
            raise RuntimeError(f"compression {self.name!r} needs the vision saliency, which "
                               f"was not computed for this request")
        return affinity_keep(inp.saliency, inp.prefix_topk, inp.num_experts,
                             self.alpha, self.beta, self.lam)


@COMPRESSION.register("saliency")
class SaliencyCompression(AffinityCompression):
    """Saliency-only (VisionZip-like): Algorithm 1 with λ = 0, whatever the ``lam`` knob says."""

    def __init__(self, beta: float = CompressionKnobs.param.beta.default,
                 alpha: float = CompressionKnobs.param.alpha.default) -> None:
        super().__init__(beta, alpha, 0.0)

    @classmethod
    def from_knobs(cls, knobs: "Knobs") -> "SaliencyCompression":
        group: CompressionKnobs = knobs.group("compression")
        return cls(group.beta, group.alpha)

    @classmethod
    def semantic_floor(cls, group: "CompressionKnobs") -> int:
        return 0  # λ = 0 whatever the knob: no prefix routing read


def minmax(s: torch.Tensor) -> torch.Tensor:
    """s̃ = (s − min) / (max − min) in [0, 1] (all zeros when s is constant)."""
    s = s.double()
    return (s - s.min()) / (s.max() - s.min()).clamp_min(1e-300)


def marginal_expansion(prefix_topk: torch.Tensor, core: torch.Tensor,
                       num_experts: int) -> torch.Tensor:
    """Δ_i = |E_i \\ E_target| / |E_i| for every token i (``[N]`` float64).

    ``prefix_topk`` ``[P, N, k]``: E_i = {(p, prefix_topk[p, i, j])}; ids < 0 (not routed) are
    ignored. E_target = ∪ over ``core`` of E_j. A token with an empty E_i gets Δ = 0."""
    import torch

    P, N, _ = prefix_topk.shape
    ids = prefix_topk.long()
    valid = ids >= 0
    flat = (ids.clamp_min(0) + (torch.arange(P) * num_experts)[:, None, None]).permute(1, 0, 2)
    m = torch.zeros(N, P * num_experts, dtype=torch.bool)  # multi-hot over (layer, expert)
    m.scatter_(1, flat.reshape(N, -1), valid.permute(1, 0, 2).reshape(N, -1))
    target = m[core].any(0)
    size = m.sum(1)
    return ((m & ~target).sum(1).double() / size.clamp_min(1).double()).where(
        size > 0, torch.zeros((), dtype=torch.float64))


def affinity_keep(saliency: torch.Tensor, prefix_topk: torch.Tensor | None, num_experts: int,
                  alpha: float, beta: float, lam: float) -> torch.Tensor:
    """Algorithm 1: sorted indices of the ⌊βN⌋ visual tokens to keep (see module docstring).

    ``saliency`` ``[N]`` raw scores; ``prefix_topk`` ``[P, N, k]`` or ``None`` (Δ = 0).
    K_core = min(⌊αN⌋, K_keep)."""
    import torch

    s = saliency.detach().to("cpu")
    n = s.numel()
    k_keep = int(beta * n)
    k_core = min(int(alpha * n), k_keep)
    st = minmax(s)
    order = torch.argsort(-st, stable=True)  # ties → lower index first
    core = order[:k_core]
    if prefix_topk is None or lam == 0.0 or prefix_topk.shape[0] == 0:
        p = st.clone()
    else:
        p = st - lam * marginal_expansion(prefix_topk.detach().to("cpu"), core, num_experts)
    p[core] = -float("inf")
    extra = torch.argsort(-p, stable=True)[: k_keep - k_core]
    return torch.cat([core, extra]).sort().values
