import pytest

from workbench.errors import UnsupportedArchitectureError
from workbench.models.adapter import SUPPORTED_ARCHITECTURES, find_moe_blocks
from workbench.models.tiny import TINY_ARCHITECTURES, tiny_model

SHARED = {"qwen2_moe": {"shared_expert", "shared_expert_gate"}, "deepseek_v2": {"shared_experts"}}


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_finds_router_experts_and_shared_experts(arch):
    model = tiny_model(arch)
    lay = find_moe_blocks(model)
    assert lay.model_type == arch and lay.supported
    assert lay.num_layers == 3 and lay.num_experts == 8 and lay.top_k == 2
    for b in lay.blocks:
        assert set(b.expert_params) == {"gate_up_proj", "down_proj"}
        assert b.router.weight.shape == (8, b.experts.gate_up_proj.shape[-1])
        assert set(b.shared) == SHARED.get(arch, set())
    # bytes: fused tensors / E, and the backbone is everything else
    b = lay.blocks[0]
    per = (b.experts.gate_up_proj.numel() + b.experts.down_proj.numel()) * 4 // 8
    assert lay.expert_bytes == per
    total = sum(p.numel() * 4 for p in model.parameters())
    assert lay.backbone_bytes == total - 3 * 8 * per


def test_dense_model_is_refused_with_the_supported_list():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(UnsupportedArchitectureError) as e:
        find_moe_blocks(tf.LlamaForCausalLM(cfg))
    msg = str(e.value)
    assert "LlamaForCausalLM" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg
