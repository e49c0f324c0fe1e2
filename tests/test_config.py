import pytest

from eagle31_export.config import (
    ConfigError,
    DrafterConfig,
    Rope,
    TargetInfo,
    before_layer_to_output,
    compatibility_problems,
    default_aux_layer_ids,
    output_to_before_layer,
    rope_differences,
)

BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=256, draft_vocab_size=128)


def test_fc_norm_and_norm_before_fc_are_exclusive():
    with pytest.raises(ConfigError, match="fc_norm.*norm_before_fc"):
        DrafterConfig(**BASE, fc_norm=True, norm_before_fc=True)


def test_eagle_version_follows_the_two_flags():
    assert DrafterConfig(**BASE).eagle_version == "3"
    assert DrafterConfig(**BASE, fc_norm=True).eagle_version == "3.1"
    assert DrafterConfig(**BASE, norm_output=True).eagle_version == "3.1"


def test_default_taps_name_the_same_tensors_in_both_numberings():
    # docs/tapped-layers.md#defaults: for N=32 vLLM's (2, 16, 29) before-layer == outputs of layers (1, 15, 28).
    assert default_aux_layer_ids(32) == (1, 15, 28)
    assert output_to_before_layer(default_aux_layer_ids(32)) == (2, 16, 29)
    assert before_layer_to_output((2, 16, 29)) == (1, 15, 28)


def test_tap_count_must_match_ids():
    with pytest.raises(ConfigError, match="name 2 layers"):
        DrafterConfig(**BASE, aux_layer_ids=(1, 2), num_aux_hidden_states=3)


def test_compatibility_problems_name_each_mismatch():
    cfg = DrafterConfig(**BASE, aux_layer_ids=(1, 3, 9))
    target = TargetInfo("llama", hidden_size=32, num_hidden_layers=8, vocab_size=300, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128)
    problems = compatibility_problems(cfg, target, d2t_max_target_id=400)
    assert any("hidden size 64" in p for p in problems)
    assert any("vocab_size 256" in p for p in problems)
    assert any("[9]" in p and "out of range" in p for p in problems)
    assert any("target id 400" in p for p in problems)


LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=8, vocab_size=256, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128)
KIMI_YARN = {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
             "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("rope", [
    {"rope_theta": 50000.0, "rope_scaling": {**KIMI_YARN, "type": "yarn"}},  # transformers v4, older key
    {"rope_theta": 50000, "rope_scaling": {**KIMI_YARN, "rope_type": "yarn"}},  # transformers v4
    {"rope_parameters": {"rope_theta": 50000.0, "rope_type": "yarn", **KIMI_YARN}},  # transformers v5
])
def test_target_reads_its_rope_in_either_spelling(rope):
    info = TargetInfo.from_hf_config({**LLAMA, **rope})
    assert info.rope_theta == 50000.0
    assert info.rope_scaling.get("rope_type", info.rope_scaling.get("type")) == "yarn"
    assert "rope_theta" not in info.rope_scaling
    assert info.rope == Rope("yarn", 50000.0, (("factor", 32.0), ("original_max_position_embeddings", 4096.0),
                                               ("beta_fast", 1.0), ("beta_slow", 1.0), ("mscale", 1.0),
                                               ("mscale_all_dim", 1.0), ("truncate", True)))


def test_a_default_rope_is_no_rope_scaling_in_every_spelling():
    v5 = TargetInfo.from_hf_config({**LLAMA, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}})
    v4 = TargetInfo.from_hf_config({**LLAMA, "rope_theta": 10000.0, "rope_scaling": None})
    assert v5.rope_scaling is None and v4.rope_scaling is None and v5.rope == v4.rope == Rope("default", 10000.0)
    unnamed = TargetInfo.from_hf_config(LLAMA)
    assert (unnamed.rope_theta, unnamed.rope_scaling) == (None, None)


def test_a_per_layer_type_rope_is_read_from_full_attention():
    layered = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    info = TargetInfo.from_hf_config({**LLAMA, "rope_parameters": layered})
    assert info.rope == Rope("linear", 1e6, (("factor", 8.0),))


def test_a_malformed_target_rope_is_refused_by_name():
    with pytest.raises(ConfigError, match="target rope_scaling is 'yarn'"):
        TargetInfo.from_hf_config({**LLAMA, "rope_scaling": "yarn"})
    with pytest.raises(ConfigError, match="target rope_theta is -1"):
        TargetInfo.from_hf_config({**LLAMA, "rope_theta": -1})


def test_rope_differences_name_each_field_with_both_values():
    target = Rope.of(10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    drafter = Rope.of(10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                "original_max_position_embeddings": 8192})
    (line,) = rope_differences(drafter, target)
    assert line.startswith("drafter llama3 rope_scaling differs from the target's in low_freq_factor "
                           "(drafter 2, target 1) and high_freq_factor (drafter absent, target 4): "
                           "positions beyond 8192 are rotated differently")


def test_an_unknown_target_theta_is_not_compared():
    assert rope_differences(Rope.of(10000.0, None), Rope.of(None, None)) == []
    assert rope_differences(Rope.of(10000.0, None), Rope.of(10000.0, {"type": "default", "factor": 2})) == []
