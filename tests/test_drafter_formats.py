"""Every drafter format: read -> write -> read is lossless; malformed checkpoints fail with one clear line."""

import itertools
import json

import pytest
import torch
from safetensors.torch import save_file

from eagle31_export.config import DrafterConfig, MlaConfig
from eagle31_export.errors import CheckpointError
from factories import drafter_config_for, random_drafter
from eagle31_export.formats.drafter.checkpoint import expected_shapes, format_drafter, read_drafter, write_drafter
from eagle31_export.formats.drafter.formats import (
    FORMATS,
    MLA_ARCHITECTURE_PATCH,
    consumer_layout,
    detect_format,
    looks_like_drafter,
)

ALL = sorted(FORMATS)


def _no_t2d(fmt):
    return set() if FORMATS[fmt].stores_t2d else {"t2d"}


def _variants(info):
    return {
        "eagle3": drafter_config_for(info),
        "eagle31": drafter_config_for(info, fc_norm=True, norm_output=True, aux_layer_ids=(0, 3, 6)),
        "k5-residual": drafter_config_for(info, fc_norm=True, aux_layer_ids=(0, 1, 2, 5, 7),
                                          norm_before_residual=True),
    }


def _assert_same(a, b, skip=()):
    assert a.config == b.config
    names = set(a.tensors) - set(skip)
    assert names == set(b.tensors) - set(skip)
    for name in names:
        x, y = a.tensors[name], b.tensors[name]
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("variant", ["eagle3", "eagle31", "k5-residual"])
def test_round_trip_is_lossless(tmp_path, llama_info, fmt, variant):
    ckpt = random_drafter(_variants(llama_info)[variant], seed=3)
    first = read_drafter(write_drafter(ckpt, tmp_path / "a", fmt))
    assert first.format == fmt
    assert first.unknown_config_keys == []
    _assert_same(ckpt, first, skip=_no_t2d(fmt))
    second = read_drafter(write_drafter(first, tmp_path / "b", fmt))
    _assert_same(first, second)
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads(
        (tmp_path / "b" / "config.json").read_text())


def test_conversion_between_every_pair_of_formats(tmp_path, llama_info):
    ckpt = random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True, aux_layer_ids=(1, 3, 4)))
    for src in ALL:
        for dst in ALL:
            a = read_drafter(write_drafter(ckpt, tmp_path / f"{src}", src, force=True))
            b = read_drafter(write_drafter(a, tmp_path / f"{src}-{dst}", dst))
            assert b.config == ckpt.config, (src, dst)
            _assert_same(a, b, skip={"t2d"})


def test_norm_before_fc_round_trips_where_the_format_has_it(tmp_path, llama_info):
    ckpt = random_drafter(drafter_config_for(llama_info, norm_before_fc=True))
    for fmt in ("speculators", "modelopt", "trtllm"):
        back = read_drafter(write_drafter(ckpt, tmp_path / fmt, fmt))
        assert back.config.norm_before_fc and "input_norm.weight" in back.tensors
    with pytest.raises(CheckpointError, match="norm_before_fc"):
        write_drafter(ckpt, tmp_path / "eagle", "eagle")
    assert not (tmp_path / "eagle").exists()


def test_sharded_checkpoint_reads_like_a_single_file(tmp_path, eagle31_ckpt):
    write_drafter(eagle31_ckpt, tmp_path / "sharded", "speculators", max_shard_bytes=20_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    _assert_same(eagle31_ckpt, read_drafter(tmp_path / "sharded"))


def test_layer_numbering_is_converted_at_the_edge(tmp_path, llama_info):
    ckpt = random_drafter(drafter_config_for(llama_info, aux_layer_ids=(1, 3, 4)))
    stored = {}
    for fmt in ALL:
        cfg = json.loads((write_drafter(ckpt, tmp_path / fmt, fmt) / "config.json").read_text())
        stored[fmt] = cfg.get("eagle_aux_hidden_state_layer_ids") or cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert stored["eagle"] == stored["speculators"] == [2, 4, 5]  # vLLM: before layer i
    assert stored["specforge"] == stored["modelopt"] == stored["trtllm"] == [1, 3, 4]  # output of layer i


def _edit_config(folder, drop=(), **values):
    """Rewrite the drafter's config.json: remove the keys in `drop`, then set `values`."""
    cfg = json.loads((folder / "config.json").read_text())
    for key in drop:
        del cfg[key]
    cfg.update(values)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_unknown_config_keys_are_reported(tmp_path, eagle31_ckpt):
    folder = write_drafter(eagle31_ckpt, tmp_path / "d", "specforge")
    _edit_config(folder, mystery_knob=7)
    assert read_drafter(folder).unknown_config_keys == ["mystery_knob"]


def test_use_aux_norm_alias_enables_fc_norm(tmp_path, eagle31_ckpt):
    folder = write_drafter(eagle31_ckpt, tmp_path / "d", "specforge")
    _edit_config(folder, drop=["fc_norm"], use_aux_norm=True)
    assert read_drafter(folder).config.fc_norm


def _edit_tensors(folder, edit):
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_missing_tensor_names_the_tensor_and_shape(tmp_path, eagle31_ckpt):
    folder = write_drafter(eagle31_ckpt, tmp_path / "d", "eagle")
    _edit_tensors(folder, lambda t: t.pop("fc_norm.1.weight"))
    with pytest.raises(CheckpointError, match=r"'fc_norm.1.weight' missing \(expected shape \[64\]\)"):
        read_drafter(folder)


def test_wrong_shape_names_file_tensor_expected_and_found(tmp_path, eagle31_ckpt):
    folder = write_drafter(eagle31_ckpt, tmp_path / "d", "eagle")
    _edit_tensors(folder, lambda t: t.update({"fc.weight": torch.zeros(64, 100)}))
    with pytest.raises(CheckpointError, match=r"model.safetensors:fc.weight: shape \[64, 100\], expected \[64, 192\]"):
        read_drafter(folder)


def test_fc_norm_weights_without_the_flag_are_refused(tmp_path, eagle31_ckpt):
    # The silent EAGLE 3.1 -> EAGLE-3 downgrade: weights present, flag dropped from config.json.
    folder = write_drafter(eagle31_ckpt, tmp_path / "d", "specforge")
    _edit_config(folder, fc_norm=False)
    with pytest.raises(CheckpointError, match="unexpected tensors.*fc_norm"):
        read_drafter(folder)


def test_d2t_outside_the_target_vocab_is_refused(tmp_path, eagle31_ckpt):
    folder = write_drafter(eagle31_ckpt, tmp_path / "d", "eagle")

    def corrupt(t):
        t["d2t"][-1] = 10_000

    _edit_tensors(folder, corrupt)
    with pytest.raises(CheckpointError, match="d2t.*outside the vocabulary of 256"):
        read_drafter(folder)


def test_pickle_only_checkpoint_is_refused(tmp_path, eagle31_ckpt):
    folder = write_drafter(eagle31_ckpt, tmp_path / "d", "eagle")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="pickle.*convert the checkpoint to safetensors"):
        read_drafter(folder)


def test_both_norm_flags_are_refused(tmp_path, eagle31_ckpt):
    folder = write_drafter(eagle31_ckpt, tmp_path / "d", "speculators")
    _edit_config(folder, norm_before_fc=True)
    with pytest.raises(CheckpointError, match="both fc_norm.*and norm_before_fc"):
        read_drafter(folder)


def test_truncated_safetensors_is_one_clear_error(tmp_path, eagle31_ckpt):
    folder = write_drafter(eagle31_ckpt, tmp_path / "d", "eagle")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated \(\d+ bytes, the header declares \d+\)"):
        read_drafter(folder)


def test_not_a_drafter_is_one_clear_error(llama_target):
    with pytest.raises(CheckpointError, match="cannot tell the drafter format"):
        read_drafter(llama_target)


# ---- expected shapes, computed without the reference module ---------------------------------

def _grid_configs():
    mla_ranks = (MlaConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
                 MlaConfig(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12))
    for attention, norm, layers, bias, target_hidden, k in itertools.product(
            ("gqa", "mla0", "mla1"), ("none", "fc_norm", "norm_before_fc"), (1, 2), (False, True), (None, 96), (3, 5)):
        fields = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=20, vocab_size=300, draft_vocab_size=120, target_hidden_size=target_hidden,
                      num_layers=layers, attention_bias=bias, num_aux_hidden_states=k,
                      fc_norm=norm == "fc_norm", norm_before_fc=norm == "norm_before_fc", norm_output=True)
        if attention != "gqa":
            fields.update(attention="mla", mla=mla_ranks[int(attention[-1])])
        yield pytest.param(DrafterConfig(**fields), id=f"{attention}-{norm}-L{layers}-bias{int(bias)}-"
                                                       f"ht{target_hidden}-k{k}")


@pytest.mark.parametrize("cfg", list(_grid_configs()))
def test_expected_shapes_match_the_reference_module(cfg):
    from eagle31_export.reference.drafter import Eagle3Drafter

    with torch.device("meta"):
        module = Eagle3Drafter(cfg)
    reference = [(name, tuple(t.shape)) for name, t in module.state_dict().items()] + [("t2d", (cfg.vocab_size,))]
    assert list(expected_shapes(cfg).items()) == reference  # names, shapes and order


# ---- the TensorRT-LLM layout as a format ----------------------------------------------------

def test_trtllm_layout_several_layers(tmp_path, llama_info):
    cfg = drafter_config_for(llama_info, num_layers=3, norm_before_fc=True, aux_layer_ids=(1, 3, 4))
    ckpt = random_drafter(cfg, seed=5)
    folder = write_drafter(ckpt, tmp_path / "t", "trtllm")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        d2t_dtype = f.get_tensor("d2t").dtype
    assert d2t_dtype == torch.int32 and "t2d" not in names
    assert {"midlayer.0.hidden_norm.weight", "midlayer.0.input_layernorm.weight", "midlayer.1.hidden_norm.weight",
            "midlayer.2.hidden_norm.weight", "input_norm.weight"} <= names
    assert "midlayer.1.input_layernorm.weight" not in names and not any(n.startswith("layers.") for n in names)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["target_hidden_size"] == 64
    assert config["norm_output"] is False and config["eagle_config"]["return_hidden_post_norm"] is False
    back = read_drafter(folder)
    assert back.format == "trtllm" and back.unknown_config_keys == []
    _assert_same(ckpt, back, skip={"t2d"})


def test_trtllm_omits_a_full_vocabulary_d2t(tmp_path, llama_info):
    cfg = drafter_config_for(llama_info, draft_vocab_size=llama_info.vocab_size)
    ckpt = random_drafter(cfg)
    ckpt.tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    config, tensors = format_drafter(ckpt, "trtllm")
    assert "d2t" not in tensors and "t2d" not in tensors
    ckpt.tensors["d2t"] = torch.roll(torch.arange(cfg.vocab_size), 1) - torch.arange(cfg.vocab_size)
    with pytest.raises(CheckpointError, match="full-size draft vocabulary"):
        format_drafter(ckpt, "trtllm")


def test_trtllm_and_specforge_are_told_apart(tmp_path, llama_info):
    ckpt = random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True, aux_layer_ids=(1, 3, 4)))
    trt = json.loads((write_drafter(ckpt, tmp_path / "t", "trtllm") / "config.json").read_text())
    sf = json.loads((write_drafter(ckpt, tmp_path / "s", "specforge") / "config.json").read_text())
    names = ["midlayer.self_attn.q_proj.weight", "fc.weight"]
    assert detect_format(trt, names).name == "trtllm"
    assert set(sf["eagle_config"]) == {"eagle_aux_hidden_state_layer_ids"}
    assert detect_format(sf, names).name == "specforge"
    assert read_drafter(tmp_path / "s").format == "specforge"


def test_looks_like_drafter_uses_the_detection_markers(tmp_path, eagle31_ckpt, llama_target):
    for fmt in ALL:
        assert looks_like_drafter(json.loads((write_drafter(eagle31_ckpt, tmp_path / fmt, fmt) / "config.json")
                                             .read_text())), fmt
    assert not looks_like_drafter(json.loads((llama_target / "config.json").read_text()))


def test_consumer_layouts(llama_info):
    plain = drafter_config_for(llama_info, fc_norm=True, norm_output=True)
    assert consumer_layout("vllm", plain) == ("eagle", None)
    assert consumer_layout("vllm", plain.replace(num_layers=2))[0] == "speculators"
    assert consumer_layout("vllm", drafter_config_for(llama_info, norm_before_fc=True))[0] == "speculators"
    assert consumer_layout("sglang", plain) == ("specforge", None)
    assert consumer_layout("trtllm", plain) == ("trtllm", None)
    mla = drafter_config_for(llama_info, mla=True)
    # vLLM 0.32 sends deepseek_v3 drafts down its MTP path (vllm/config/speculative.py); kimi_k2 it leaves be
    assert consumer_layout("vllm", mla) == ("eagle", {"architectures": ["Eagle3DeepseekV2ForCausalLM"],
                                                      "model_type": "kimi_k2"})
    assert consumer_layout("sglang", mla) == ("specforge", MLA_ARCHITECTURE_PATCH)
    assert consumer_layout("trtllm", mla) == ("trtllm", None)
    with pytest.raises(CheckpointError, match="unknown serving runtime"):
        consumer_layout("tgi", plain)


def _layer_config(config):
    """The dict of a drafter config.json that holds the layer keys (speculators nests them)."""
    return config.get("transformer_layer_config", config)


@pytest.mark.parametrize("fmt", ALL)
def test_rope_parameters_of_transformers_v5_become_the_rope_scaling(tmp_path, llama_info, fmt):
    """A drafter whose config spells its rope the transformers-v5 way (`rope_parameters`: theta, type
    and scaling fields in one object) keeps its yarn: read as that rope_scaling, then written back as
    rope_scaling by every format; a rope_type of "default" is no scaling. Reading only the theta would
    drop the yarn silently, as the converter of vllm-project/speculators PR 574 did."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    folder = write_drafter(random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True)),
                           tmp_path / "v5", fmt)
    config = json.loads((folder / "config.json").read_text())
    layer = _layer_config(config)
    assert "rope_theta" in layer and layer.get("rope_scaling") is None
    del layer["rope_theta"], layer["rope_scaling"]
    layer["rope_parameters"] = {"rope_theta": 50000.0, **yarn}
    (folder / "config.json").write_text(json.dumps(config))

    ckpt = read_drafter(folder)
    assert ckpt.config.rope_theta == 50000.0
    assert ckpt.config.rope_scaling == yarn
    assert ckpt.unknown_config_keys == []
    for dst in ALL:  # and every writer writes it back
        written = json.loads((write_drafter(ckpt, tmp_path / f"to-{dst}", dst) / "config.json").read_text())
        assert _layer_config(written)["rope_scaling"] == yarn, dst
        assert _layer_config(written)["rope_theta"] == 50000.0, dst
        assert read_drafter(tmp_path / f"to-{dst}").config.rope_scaling == yarn, dst

    layer["rope_parameters"] = {"rope_theta": 50000.0, "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(config))
    ckpt = read_drafter(folder)
    assert ckpt.config.rope_scaling is None and ckpt.config.rope_theta == 50000.0


def test_rope_scaling_wins_over_rope_parameters_and_per_layer_type_ropes_read_full_attention(tmp_path, llama_info):
    """Both spellings given: transformers v4 reads `rope_scaling`. v5's per-layer-type form
    (`rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}`): the drafter's layer is
    full attention."""
    folder = write_drafter(random_drafter(drafter_config_for(llama_info)), tmp_path / "d", "specforge")
    config = json.loads((folder / "config.json").read_text())
    linear = {"type": "linear", "factor": 2.0}
    config.update(rope_scaling=linear, rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 8.0})
    (folder / "config.json").write_text(json.dumps(config))
    assert read_drafter(folder).config.rope_scaling == linear
    del config["rope_scaling"], config["rope_theta"]
    config["rope_parameters"] = {
        "full_attention": {"rope_theta": 1000000.0, "rope_type": "yarn", "factor": 8.0,
                           "original_max_position_embeddings": 4096},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
    (folder / "config.json").write_text(json.dumps(config))
    cfg = read_drafter(folder).config
    assert cfg.rope_theta == 1000000.0
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
