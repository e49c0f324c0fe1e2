"""`export vllm` / `export sglang`: the drafter layouts and server arguments each server reads,
and the proof that every format's tapped ids name the same target tensors."""

import json

import pytest
import torch
from safetensors import safe_open

from eagle31_export.export.sglang import export_sglang
from eagle31_export.export.trtllm import export_trtllm
from eagle31_export.export.vllm import export_vllm
from factories import drafter_config_for, random_drafter
from eagle31_export.formats.drafter import read_drafter, write_drafter
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
    assert f"vllm serve {llama_target.resolve()} " in readme and f"--speculative-config '{json.dumps(spec)}'" in readme
    assert read_drafter(out / "drafter").config.aux_layer_ids == (1, 3, 4)  # read back: output-of-layer


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
    from eagle31_export.formats.target import load_causal_lm

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
