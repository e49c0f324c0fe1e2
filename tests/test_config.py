import pytest

from eagle31_export.config import (
    ConfigError,
    DrafterConfig,
    TargetInfo,
    before_layer_to_output,
    compatibility_problems,
    default_aux_layer_ids,
    output_to_before_layer,
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
