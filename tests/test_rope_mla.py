"""The MLA drafter attention (Kimi K2.x `eagle3.1-mla`) and yarn rope, checked against an
independent implementation: transformers' DeepseekV3 attention and its rope initialisers."""

import pytest
import torch

from eagle31_export.config import DrafterConfig, MlaConfig
from eagle31_export.reference.attention import KVCache, MlaAttention
from eagle31_export.reference.rope import attention_factor, inv_frequencies

# Kimi K2's rope scaling (DeepSeek-V3 style yarn), on a short original context for a tiny test.
YARN = {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64}


def _hf_rope(scaling, dim, theta=50000.0, max_pos=2048):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_rope_head_dim=dim, qk_nope_head_dim=8,
                           v_head_dim=8, rope_theta=theta, rope_scaling=scaling, max_position_embeddings=max_pos,
                           kv_lora_rank=16, q_lora_rank=24)
    kind = (scaling or {}).get("type", "default")
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu") if kind != "default" else None, cfg


def test_yarn_frequencies_and_attention_factor_match_transformers():
    (inv_hf, factor_hf), _ = _hf_rope(YARN, 16)
    inv = inv_frequencies(16, 50000.0, YARN, 2048)
    torch.testing.assert_close(inv.float(), inv_hf.float(), rtol=1e-6, atol=0)
    assert attention_factor(YARN) == pytest.approx(factor_hf)


@pytest.mark.parametrize("scaling", [None, YARN])
def test_mla_attention_matches_transformers_deepseek_v3(scaling):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    _, hf_cfg = _hf_rope(scaling, 8)
    hf_cfg.rope_interleave = True
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = DeepseekV3Attention(hf_cfg, 0).double().eval()
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                        head_dim=16, vocab_size=100, draft_vocab_size=100, rope_theta=50000.0, rope_scaling=scaling,
                        max_position_embeddings=2048, attention="mla",
                        mla=MlaConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                      v_head_dim=8))
    ours = MlaAttention(cfg, 0, in_features=64).double()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and not [m for m in missing if m != "inv_freq"]

    t = 7
    x = torch.randn(1, t, 64, dtype=torch.float64)
    positions = torch.arange(100, 100 + t).unsqueeze(0)  # past the original context: yarn matters
    rotary = DeepseekV3RotaryEmbedding(hf_cfg)
    cos, sin = rotary(x, positions)
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        expected = hf(x, (cos.double(), sin.double()), mask)[0]
        got = ours(x, positions, KVCache())
    # transformers computes its RMSNorms and rope angles in fp32 even for a float64 module, hence
    # ~1e-8 differences; a layout or scale mistake (interleaved rope, yarn mscale) is O(1).
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
