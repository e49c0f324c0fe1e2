"""The flagship drafter: Kimi K2.x `eagle3.1-mla` (config as TorchSpec publishes it, plus the 3.1
flags its EAGLE 3.1 checkpoint sets). Full-size weights are ~2 GB, so shapes are checked on the
meta device: the reader must produce the architecture those weights have."""

from eagle31_export.formats.drafter import expected_shapes
from eagle31_export.formats.drafter_formats import detect_format

KIMI_EAGLE31_MLA = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
    "intermediate_size": 18432, "num_hidden_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "vocab_size": 163840, "draft_vocab_size": 163840,
    "torch_dtype": "bfloat16", "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True,
                     "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                     "use_mtp_layernorm": False},
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 0,
    "fc_norm": True, "norm_output": True,
}


def test_kimi_mla_drafter_config_reads_into_the_canonical_model():
    fmt = detect_format(KIMI_EAGLE31_MLA, ["layers.0.self_attn.q_a_proj.weight", "fc.weight"])
    cfg, unknown = fmt.read_config(KIMI_EAGLE31_MLA)
    assert unknown == []
    assert cfg.attention == "mla" and cfg.eagle_version == "3.1"
    assert cfg.aux_layer_ids == (1, 29, 57)  # output-of-layer numbering, as Kimi K2's 61 layers give
    assert cfg.rope_scaling["type"] == "yarn"
    shapes = expected_shapes(cfg)
    assert shapes["fc.weight"] == (7168, 3 * 7168)
    assert shapes["fc_norm.2.weight"] == (7168,)
    attn = "layers.0.self_attn."
    assert shapes[attn + "q_a_proj.weight"] == (1536, 2 * 7168)  # the midlayer reads cat(embed, hidden)
    assert shapes[attn + "q_b_proj.weight"] == (64 * (128 + 64), 1536)
    assert shapes[attn + "kv_a_proj_with_mqa.weight"] == (512 + 64, 2 * 7168)
    assert shapes[attn + "kv_b_proj.weight"] == (64 * (128 + 128), 512)
    assert shapes[attn + "o_proj.weight"] == (7168, 64 * 128)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (18432, 7168)
    assert shapes["lm_head.weight"] == (163840, 7168)
