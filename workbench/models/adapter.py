"""Find the MoE structure of any supported ``transformers`` model from its modules.

No per-model code and no dispatch on model names: an *experts module* is a module whose own
parameters are all 3-D tensors sharing the leading dimension E (transformers ≥ 5 stores routed
experts fused: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and whose forward is
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.
Its parent is the *MoE block*; the block's child with a 2-D ``weight`` of shape ``[E, H]`` is the
*router*; every other child with parameters is a *shared expert* (or its gate).
"""

from __future__ import annotations

import copy

from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.errors import UnsupportedArchitectureError

#: Architectures the exactness tests cover (model_type → transformers class family).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "qwen3_vl_moe": "Qwen3-VL-MoE (Qwen3-VL-30B-A3B layout)",
    "qwen3_moe": "Qwen3-MoE",
    "qwen2_moe": "Qwen2-MoE (shared expert)",
    "mixtral": "Mixtral",
    "olmoe": "OLMoE",
    "deepseek_v2": "DeepSeek-V2 (shared experts)",
}


@dataclass
class MoEBlock:
    """One MoE layer of the model. ``index`` counts MoE layers only, from 0, in execution order."""

    index: int
    name: str
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    shared: dict[str, nn.Module]
    num_experts: int
    top_k: int
    expert_params: tuple[str, ...]

    @property
    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of one expert's slice of each fused parameter."""
        return {p: tuple(getattr(self.experts, p).shape[1:]) for p in self.expert_params}

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (all its fused-parameter slices)."""
        total = 0
        for p in self.expert_params:
            t = getattr(self.experts, p)
            total += t[0].numel() * t.element_size()
        return total

    @property
    def shared_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for m in self.shared.values() for p in m.parameters())

    def route(self, hidden_states: torch.Tensor, top_k: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run this layer's own router on ``hidden_states [T, H]``: ``(logits [T, E],
        weights [T, k], ids [T, k])``, exactly what the block hands its experts.

        ``top_k`` (optional) runs the router with another top-k (on a shallow copy whose
        ``top_k`` differs; the model's router is untouched), so selection and weight
        normalisation are the model's own for that k. The router's ``forward`` is called directly: module hooks (e.g.
        transformers' router-logit recording) do not see these extra calls. Every supported
        transformers ≥ 5 router returns ``(router_logits, top_k_weights, top_k_index)``.
        """
        r = self.router
        saved = getattr(r, "top_k", None)
        if top_k is not None and top_k != saved:
            if not isinstance(saved, int):
                raise UnsupportedArchitectureError(
                    f"router of MoE layer {self.index} ({type(r).__name__}) has no integer "
                    f"top_k attribute, so it cannot route with another k")
            # a shallow copy with another k: the model's router is never changed
            r = copy.copy(r)
            r.__dict__["top_k"] = int(top_k)
        out = r.forward(hidden_states)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise UnsupportedArchitectureError(
                f"router of MoE layer {self.index} ({type(r).__name__}) returned "
                f"{type(out).__name__}, not (router_logits, top_k_weights, top_k_index)")
        return out


@dataclass
class MoELayout:
    """All MoE layers of a model plus the sizes the memory plan needs (bytes)."""

    architecture: str
    model_type: str
    blocks: list[MoEBlock]
    total_bytes: int
    routed_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.routed_bytes = sum(b.expert_bytes * b.num_experts for b in self.blocks)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def num_experts(self) -> int:
        return max(b.num_experts for b in self.blocks)

    @property
    def top_k(self) -> int:
        return max(b.top_k for b in self.blocks)

    @property
    def expert_bytes(self) -> int:
        return max(b.expert_bytes for b in self.blocks)

    @property
    def shared_bytes(self) -> int:
        return sum(b.shared_bytes for b in self.blocks)

    @property
    def backbone_bytes(self) -> int:
        """Everything that is not a routed expert: embeddings, attention, norms, routers,
        shared experts, the vision tower. Always resident."""
        return self.total_bytes - self.routed_bytes

    @property
    def supported(self) -> bool:
        return self.model_type in SUPPORTED_ARCHITECTURES

    def summary(self) -> dict:
        return {
            "architecture": self.architecture,
            "model_type": self.model_type,
            "tested": self.supported,
            "moe_layers": self.num_layers,
            "experts_per_layer": self.num_experts,
            "top_k": self.top_k,
            "shared_expert_modules": sorted({n for b in self.blocks for n in b.shared}),
            "bytes_per_expert": self.expert_bytes,
            "expert_params": {p: list(s) for p, s in self.blocks[0].expert_shapes.items()},
            "routed_expert_bytes": self.routed_bytes,
            "shared_expert_bytes": self.shared_bytes,
            "backbone_bytes": self.backbone_bytes,
        }


def _fused_experts(module: nn.Module) -> tuple[int, tuple[str, ...]] | None:
    """(E, param names) if ``module`` holds fused routed experts, else None."""
    params = dict(module.named_parameters(recurse=False))
    if not params or any(p.dim() != 3 for p in params.values()):
        return None
    leading = {p.shape[0] for p in params.values()}
    if len(leading) != 1:
        return None
    return leading.pop(), tuple(params)


def _top_k(block: nn.Module, router: nn.Module, config) -> int:
    for obj in (router, block):
        for attr in ("top_k", "num_experts_per_tok"):
            v = getattr(obj, attr, None)
            if isinstance(v, int) and v > 0:
                return v
    for cfg in (config, getattr(config, "text_config", None)):
        v = getattr(cfg, "num_experts_per_tok", None) if cfg is not None else None
        if isinstance(v, int) and v > 0:
            return v
    raise UnsupportedArchitectureError(f"cannot find top-k of MoE block {type(block).__name__}")


def find_moe_blocks(model: nn.Module) -> MoELayout:
    """Discover every MoE block of ``model`` (see module docstring for the rules)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "unknown")
    blocks: list[MoEBlock] = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            fused = _fused_experts(child)
            if fused is None:
                continue
            n_exp, pnames = fused
            router = None
            for sib in module.children():
                w = getattr(sib, "weight", None)
                if sib is not child and isinstance(w, torch.Tensor) and w.dim() == 2 \
                        and w.shape[0] == n_exp:
                    router = sib
                    break
            if router is None:
                continue
            shared = {
                n: m for n, m in module.named_children()
                if m is not child and m is not router and any(True for _ in m.parameters())
            }
            blocks.append(MoEBlock(
                index=len(blocks), name=f"{name}.{child_name}" if name else child_name,
                block=module, router=router, experts=child, shared=shared,
                num_experts=n_exp, top_k=_top_k(module, router, config), expert_params=pnames,
            ))
    if not blocks:
        supported = "; ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} (model_type {model_type!r}) has no MoE block with fused "
            f"routed experts that the adapter can find; supported architectures: {supported}")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return MoELayout(architecture=type(model).__name__, model_type=model_type, blocks=blocks,
                     total_bytes=total)
