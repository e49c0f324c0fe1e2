"""`export vllm` / `export sglang`: the drafter layouts and server arguments each server reads,
and the proof that every format's tapped ids name the same target tensors."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from eagle31_export.errors import CheckpointError
from eagle31_export.export.sglang import export_sglang
from eagle31_export.export.trtllm import export_trtllm
from eagle31_export.export.vllm import export_vllm
from factories import drafter_config_for, random_drafter
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter, write_drafter
from eagle31_export.reference.target import ReferenceTarget


def tensor_names(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, eagle31_dir, llama_target):
    root = tmp_path_factory.mktemp("bundles")
    return {
        "vllm": export_vllm(eagle31_dir, llama_target, root / "vllm", num_speculative_tokens=5),
        "sglang": export_sglang(eagle31_dir, llama_target, root / "sglang", num_steps=5),
        "trtllm": export_trtllm(eagle31_dir, llama_target, root / "trtllm", max_draft_len=5),
    }


def test_vllm_drafter_and_speculative_config(bundles, llama_target):
    out = bundles["vllm"]
    config = json.loads((out / "drafter" / "config.json").read_text())
    # Before-layer numbering at the top level, where vLLM reads it; no eagle_config list that
    # some releases would read in the same numbering.
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "eagle_config" not in config
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert config["draft_vocab_size"] == 128 and config["architectures"] == ["LlamaForCausalLM"]
    names = tensor_names(out / "drafter")
    assert {"fc.weight", "fc_norm.0.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert any(n.startswith("midlayer.") for n in names) and not any(n.startswith("layers.") for n in names)
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec == {"method": "eagle3", "model": "drafter", "num_speculative_tokens": 5}  # relative to the bundle
    readme = (out / "README.md").read_text()
    # `vllm serve` fails under the CPU build (vllm/entrypoints/cli/main.py asks for the distribution `vllm`)
    assert "vllm serve" not in readme
    server = f"python -m vllm.entrypoints.openai.api_server --model {llama_target.resolve()} "
    assert server in readme and f"--speculative-config '{json.dumps(spec)}'" in readme
    # the default dtype is not the exact comparison: an fp32 line that also returns per-step accepted counts
    parity_line = next(line for line in readme.splitlines() if line.startswith(server) and "--dtype float32" in line)
    assert "--per-request-spec-decode-metrics detailed" in parity_line
    assert "bf16" in readme and "metrics.speculative_decoding" in readme
    assert read_drafter(out / "drafter").config.aux_layer_ids == (1, 3, 4)  # read back: output-of-layer


def test_vllm_eagle_layout_states_the_tap_count_and_norm_before_residual(bundles):
    """vLLM 0.32's llama_eagle3.py sizes fc from num_aux_hidden_states (else eagle_config's list, else 3), never
    from the top-level list, and reads norm_before_residual with default false: both are written explicitly."""
    config = json.loads((bundles["vllm"] / "drafter" / "config.json").read_text())
    assert config["num_aux_hidden_states"] == 3 == len(config["eagle_aux_hidden_state_layer_ids"])
    assert config["norm_before_residual"] is False


def test_vllm_speculators_layout_puts_the_tap_count_where_vllm_reads_it(tmp_path, llama_info, llama_target):
    """vLLM 0.32 builds the drafter's model config from transformer_layer_config plus named top-level keys
    (vllm/transformers_utils/configs/speculators/algos.py: update_eagle3), of which num_aux_hidden_states is not
    one; norm_before_residual it defaults to TRUE there. A 4-tap drafter must say 4 inside the layer config."""
    cfg = drafter_config_for(llama_info, fc_norm=True, norm_output=True, aux_layer_ids=(1, 2, 3, 4))
    src = write_drafter(random_drafter(cfg, seed=9), tmp_path / "src", "specforge")
    out = export_vllm(src, llama_target, tmp_path / "v", layout="speculators")
    config = json.loads((out / "drafter" / "config.json").read_text())
    with safe_open(str(out / "drafter" / "model.safetensors"), framework="pt") as f:
        fc_inputs = f.get_slice("fc.weight").get_shape()[1]
    assert fc_inputs == 4 * llama_info.hidden_size
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 4
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4, 5]  # before-layer, top level (copied by vLLM)
    assert config["norm_before_residual"] is False
    assert read_drafter(out / "drafter").config.num_aux_hidden_states == 4


def test_a_speculators_config_whose_two_tap_counts_disagree_is_refused(tmp_path, llama_info):
    cfg = drafter_config_for(llama_info, aux_layer_ids=(1, 2, 3, 4))
    src = write_drafter(random_drafter(cfg, seed=9), tmp_path / "src", "speculators")
    config = json.loads((src / "config.json").read_text())
    config["transformer_layer_config"]["num_aux_hidden_states"] = 3
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="what vLLM reads"):
        read_drafter(src)


def test_sglang_drafter_and_flags(bundles):
    out = bundles["sglang"]
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # output-of-layer
    assert config["fc_norm"] is True and config["norm_output"] is True
    args = json.loads((out / "sglang_args.json").read_text())["args"]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--speculative-draft-model-path"] == "drafter"  # relative to the bundle
    assert flags["--speculative-num-steps"] == "5" and flags["--speculative-eagle-topk"] == "1"
    assert flags["--speculative-num-draft-tokens"] == "6"
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path" in (out / "README.md").read_text()


def test_every_format_taps_the_same_target_tensors(bundles, llama_target):
    """vLLM's before-layer ids v and the output-of-layer ids o of SGLang / TensorRT-LLM name the
    same tensors: HF hidden_states[v] == hidden_states[o + 1] == the reference tap of layer o."""
    from eagle31_export.formats.target.checkpoint import load_causal_lm

    model = load_causal_lm(llama_target)
    ids = torch.tensor([[5, 9, 200, 17, 3]])
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    vllm_ids = json.loads((bundles["vllm"] / "drafter" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    sgl_ids = json.loads((bundles["sglang"] / "drafter" / "config.json").read_text())[
        "eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    import yaml

    trt_ids = yaml.safe_load((bundles["trtllm"] / "llm_api.yaml").read_text())[
        "speculative_config"]["eagle3_layers_to_capture"]
    target = ReferenceTarget(model, tuple(sgl_ids))
    target.reset()
    _, taps = target.forward(ids)
    taps = taps.split(model.config.hidden_size, dim=-1)
    for v, o, t, tap in zip(vllm_ids, sgl_ids, trt_ids, taps):
        assert o == t
        assert torch.equal(hidden[v], hidden[o + 1])
        assert torch.allclose(hidden[v], tap, atol=1e-6)


def test_vllm_uses_speculators_layout_when_eagle_cannot_hold_the_drafter(tmp_path, llama_info, llama_target):
    cfg = drafter_config_for(llama_info, norm_before_fc=True)
    src = write_drafter(random_drafter(cfg), tmp_path / "src", "speculators")
    out = export_vllm(src, llama_target, tmp_path / "v")
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_fc"] is True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "input_norm.weight" in tensor_names(out / "drafter")


def test_mla_drafter_gets_the_deepseek_eagle3_architecture(tmp_path, llama_info, llama_target):
    cfg = drafter_config_for(llama_info, mla=True, fc_norm=True, norm_output=True)
    src = write_drafter(random_drafter(cfg), tmp_path / "src", "modelopt")
    for export, name in ((export_vllm, "v"), (export_sglang, "s")):
        config = json.loads((export(src, llama_target, tmp_path / name) / "drafter" / "config.json").read_text())
        assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["kv_lora_rank"] == 16
        assert config["fc_norm"] is True and config["norm_output"] is True


def test_vllm_mla_drafter_has_the_config_and_weight_names_vllm_loads(tmp_path, llama_info, llama_target):
    """vLLM 0.32: a deepseek_v3 draft is turned into DeepSeek MTP (vllm/config/speculative.py:
    hf_config_override) and refused; kimi_k2 maps to DeepseekV3Config (vllm/transformers_utils/config.py) and is
    left alone. Eagle3DeepseekV2ForCausalLM (vllm/model_executor/models/deepseek_eagle3.py) loads `midlayer.*` as
    layers.0, fuses q_a_proj + kv_a_proj_with_mqa, renames d2t, skips t2d, and keeps fc / fc_norm.i / norm /
    lm_head; the names below are the ones it maps."""
    cfg = drafter_config_for(llama_info, mla=True, fc_norm=True, norm_output=True)
    src = write_drafter(random_drafter(cfg), tmp_path / "src", "modelopt")
    out = export_vllm(src, llama_target, tmp_path / "v")
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert {k: config[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                   "v_head_dim")} == {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                                      "qk_rope_head_dim": 4, "v_head_dim": 8}
    assert config["num_aux_hidden_states"] == 3 and config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    attn = "midlayer.self_attn."
    assert tensor_names(out / "drafter") == {
        "fc.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "norm.weight", "lm_head.weight",
        "d2t", "t2d", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
        "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight", attn + "q_a_proj.weight", attn + "q_a_layernorm.weight",
        attn + "q_b_proj.weight", attn + "kv_a_proj_with_mqa.weight", attn + "kv_a_layernorm.weight",
        attn + "kv_b_proj.weight", attn + "o_proj.weight"}
    assert read_drafter(out / "drafter").config.attention == "mla"  # read back by us too


def test_sglang_refuses_norm_before_fc(cli, tmp_path, llama_info, llama_target):
    src = write_drafter(random_drafter(drafter_config_for(llama_info, norm_before_fc=True)), tmp_path / "s",
                        "speculators")
    code, _, err = cli("export", "sglang", "--drafter", src, "--target", llama_target, "--out", tmp_path / "b")
    assert code == 2 and "norm_before_fc" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_bad_input_one_line_and_nothing_written(cli, tmp_path, kind, eagle31_dir, llama_target):
    base = ("export", kind, "--drafter", eagle31_dir, "--target", llama_target)
    code, _, err = cli(*base, "--out", tmp_path / "a", "--tp", "3")
    assert code == 2 and "not divisible by --tp 3" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()
    code, _, err = cli(*base, "--out", tmp_path / "b")
    assert code == 0
    code, _, err = cli(*base, "--out", tmp_path / "b")
    assert code == 2 and "already exists" in err
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no temporary folders left behind


KIMI = Path(__file__).resolve().parents[1] / "examples" / "kimi" / "models"


def test_every_export_writes_the_taps_of_a_drafter_that_names_none(tmp_path, llama_info, llama_target):
    """A drafter without eagle_aux_hidden_state_layer_ids (inspect: a problem) is exported with the taps
    resolved for its target, stated in each engine's own numbering: nothing is left to an engine's default."""
    bare = write_drafter(random_drafter(drafter_config_for(llama_info, aux_layer_ids=None)), tmp_path / "bare", "eagle")
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads((bare / "config.json").read_text())
    vllm = json.loads((export_vllm(bare, llama_target, tmp_path / "v") / "drafter" / "config.json").read_text())
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and "eagle_config" not in vllm  # before layer i
    sglang = json.loads((export_sglang(bare, llama_target, tmp_path / "s") / "drafter" / "config.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # outputs; SGLang adds one
    trtllm = export_trtllm(bare, llama_target, tmp_path / "t")
    assert json.loads((trtllm / "drafter" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # outputs of layers, TensorRT-LLM's own
    yaml_options = yaml.safe_load((trtllm / "llm_api.yaml").read_text())
    assert yaml_options["speculative_config"]["eagle3_layers_to_capture"] == [1, 3, 4]


@pytest.mark.parametrize("taps, written", [((1, 3, 4), [1, 3, 4]), ((2, 3, 5), [3, 4, 6])],
                         ids=["first-tap-1", "first-tap-2"])
def test_sglang_on_a_deepseek_target_writes_what_its_first_id_guess_reads_right(tmp_path, taps, written):
    """SGLang's DeepSeek-V2/V3 model (Kimi K2's) reads a list starting at 1 as outputs of layers and any other
    as before-layer ids (sglang 0.5.23, models/deepseek_v2.py): ids not starting at 1 are written before-layer."""
    ckpt = read_drafter(KIMI / "drafter-eagle31")
    src = write_drafter(DrafterCheckpoint(ckpt.config.replace(aux_layer_ids=taps), ckpt.tensors), tmp_path / "d",
                        "modelopt")
    out = export_sglang(src, KIMI / "target", tmp_path / "s")
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written
    captured = [i + 1 for i in written] if written[0] == 1 else written  # what SGLang then captures (before layer)
    assert captured == [i + 1 for i in taps]


def test_sglang_refuses_layer_0_on_a_deepseek_target(cli, tmp_path):
    ckpt = read_drafter(KIMI / "drafter-eagle31")
    src = write_drafter(DrafterCheckpoint(ckpt.config.replace(aux_layer_ids=(0, 3, 4)), ckpt.tensors), tmp_path / "d",
                        "modelopt")
    code, _, err = cli("export", "sglang", "--drafter", src, "--target", KIMI / "target", "--out", tmp_path / "s")
    assert code == 2 and "output of layer 0" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()
