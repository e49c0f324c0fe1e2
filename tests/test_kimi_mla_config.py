"""The flagship drafter: Kimi K2.x `eagle3.1-mla` (config as TorchSpec publishes it, plus the 3.1
flags its EAGLE 3.1 checkpoint sets). Full-size weights are ~2 GB, so shapes are checked on the
meta device: the reader must produce the architecture those weights have."""

from factories import kimi_make_pair_module
from eagle31_export.formats.drafter.checkpoint import expected_shapes
from eagle31_export.formats.drafter.formats import detect_format

# the published config (examples/kimi/make_pair.py) plus the flags of its EAGLE 3.1 checkpoint
KIMI_EAGLE31_MLA = {**kimi_make_pair_module().PUBLISHED_DRAFTER, "fc_norm": True, "norm_output": True}


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
