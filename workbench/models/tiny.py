"""Tiny random-weight models of every supported architecture, built from the real transformers
config and model classes (no download). For tests, benchmarks and quick experiments: the weights
are random, so routing has no learned structure; use the embedded model for that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: arch name → (config class, model class, config kwargs). Every MoE layer is sparse.
_COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               bos_token_id=0, eos_token_id=1, pad_token_id=0,
               max_position_embeddings=256, tie_word_embeddings=False)


def _specs() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    import transformers as tf

    return {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
            _COMMON, num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=16,
            num_experts=8, num_experts_per_tok=2, head_dim=8, decoder_sparse_step=1)),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, dict(
            _COMMON, num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            decoder_sparse_step=1)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(
            _COMMON, num_hidden_layers=3, intermediate_size=16, num_local_experts=8,
            num_experts_per_tok=2)),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM, dict(
            _COMMON, num_hidden_layers=3, intermediate_size=16, num_experts=8,
            num_experts_per_tok=2)),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, dict(
            _COMMON, num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=16,
            num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, topk_method="greedy", n_group=1, topk_group=1)),
        "qwen3_vl_moe": (tf.Qwen3VLMoeConfig, tf.Qwen3VLMoeForConditionalGeneration, dict(
            text_config=dict(
                vocab_size=160, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=16,
                num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                               out_hidden_size=32, patch_size=8, spatial_merge_size=2,
                               temporal_patch_size=2, in_channels=3,
                               num_position_embeddings=64, deepstack_visual_indexes=[0]),
            image_token_id=150, video_token_id=151, vision_start_token_id=152,
            vision_end_token_id=153, tie_word_embeddings=False)),
    }


TINY_ARCHITECTURES: tuple[str, ...] = tuple(_specs())


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny random model of ``arch`` (eval mode). Router weights are re-drawn with a larger
    scale so that tokens spread over experts instead of all ties."""
    specs = _specs()
    if arch not in specs:
        raise ValueError(f"arch must be one of {', '.join(specs)}, not {arch!r}")
    cfg_cls, model_cls, kw = specs[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).to(dtype).eval()
    return model


def tiny_inputs(model, arch: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random model inputs for a :func:`tiny_model` (seeded): 14 text tokens, or for the
    vision-language architecture a prompt with one 4×4-patch image (4 merged visual tokens)."""
    torch.manual_seed(seed)
    if arch != "qwen3_vl_moe":
        return {"input_ids": torch.randint(3, 120, (1, 14))}
    cfg = model.config
    grid = torch.tensor([[1, 4, 4]])  # 16 patches → 4 merged visual tokens
    n_vis = int(grid.prod()) // cfg.vision_config.spatial_merge_size ** 2
    ids = torch.cat([torch.randint(3, 140, (4,)), torch.tensor([cfg.vision_start_token_id]),
                     torch.full((n_vis,), cfg.image_token_id),
                     torch.tensor([cfg.vision_end_token_id]), torch.randint(3, 140, (5,))])
    v = cfg.vision_config
    pix = torch.randn(int(grid.prod()), v.in_channels * v.temporal_patch_size * v.patch_size ** 2)
    mm = (ids == cfg.image_token_id).long()  # 0 text, 1 image: needed for multimodal RoPE
    return {"input_ids": ids[None], "mm_token_type_ids": mm[None], "pixel_values": pix,
            "image_grid_thw": grid}


def greedy_outputs(model, inputs: dict[str, torch.Tensor], max_new_tokens: int = 6
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits of one forward pass, greedy tokens of generate)`` on ``inputs``: what an
    offloaded model must reproduce (the exactness tests compare it inside and outside)."""
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return logits, tokens


def tiny_tokenizer():
    """A character-level tokenizer (printable ASCII; ids < 128) for the tiny models:
    id 0 ``<pad>``, id 1 ``<eos>``, then one id per character."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in map(chr, range(32, 127)):
        vocab[c] = len(vocab)
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                   eos_token="<eos>", unk_token="<unk>")


def save_tiny_checkpoint(arch: str, path: str | Path, seed: int = 0) -> Path:
    """A loadable checkpoint directory: tiny random model + character tokenizer (text
    architectures; the VL tiny model is for module-level tests only)."""
    path = Path(path)
    tiny_model(arch, seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
