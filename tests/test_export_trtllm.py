"""`export trtllm`: the drafter layout and LLM-API YAML TensorRT-LLM's PyTorch backend reads
(docs/runtimes.md#tensorrt-llm), checked field by field; the bundle drafter runs exactly like the source;
bad input is refused in one line with nothing written."""

import json

import pytest
import torch
import yaml
from safetensors import safe_open

from factories import drafter_config_for, random_drafter
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter, write_drafter
from eagle31_export.reference.drafter import build_drafter
from eagle31_export.reference.pair import load_pair
from eagle31_export.reference.speculate import ReferenceDrafterBackend, speculate
from eagle31_export.reference.target import ReferenceTarget


def tensors_of(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def trtllm_architecture(config):
    """TensorRT-LLM's model-class resolution for a draft config (modeling_auto.py)."""
    arch = config["architectures"][0]
    return "EAGLE3" + arch.replace("Eagle3", "") if "draft_vocab_size" in config else arch


@pytest.fixture(scope="module")
def unordered(tmp_path_factory, llama_info):
    """An EAGLE 3.1 drafter (reduced vocab) whose config lists its taps out of layer order."""
    cfg = drafter_config_for(llama_info, fc_norm=True, norm_output=True, aux_layer_ids=(4, 1, 3))
    ckpt = random_drafter(cfg, seed=3)
    return ckpt, write_drafter(ckpt, tmp_path_factory.mktemp("src") / "specforge", "specforge")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, unordered, llama_target):
    out = tmp_path_factory.mktemp("trt") / "bundle"
    from eagle31_export.export.trtllm import export_trtllm

    return export_trtllm(unordered[1], llama_target, out, tp=2, pp=2, max_draft_len=4)


def test_drafter_config_fields(bundle):
    config = json.loads((bundle / "drafter" / "config.json").read_text())
    assert trtllm_architecture(config) == "EAGLE3LlamaForCausalLM"  # a registered Eagle3 class
    assert config["draft_vocab_size"] == 128 and config["vocab_size"] == 256
    assert config["target_hidden_size"] == 64 and isinstance(config["target_hidden_size"], int)
    # EAGLE 3.1: fc_norm at the top level; post-norm feedback under BOTH names (older releases
    # read only eagle_config.return_hidden_post_norm).
    assert config["fc_norm"] is True and config["norm_output"] is True
    eagle = config["eagle_config"]
    assert eagle["return_hidden_post_norm"] is True and eagle["norm_before_fc"] is False
    assert eagle["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # output-of-layer, ascending
    assert eagle["next_layer_regular"] is True and eagle["eh_proj_before_attn"] is False
    assert config["num_hidden_layers"] == 1 and config["bias"] is False


def test_drafter_tensors(bundle, unordered):
    ckpt, _ = unordered
    tensors = tensors_of(bundle / "drafter")
    assert not any(n.startswith("layers.") for n in tensors)
    assert {n for n in tensors if n.startswith("midlayer.")} == {
        "midlayer." + n[len("layers.0."):] for n in ckpt.tensors if n.startswith("layers.0.")}
    assert {"fc.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "norm.weight",
            "lm_head.weight", "d2t"} <= set(tensors)
    assert "t2d" not in tensors and "embed_tokens.weight" not in tensors  # from the target
    assert tensors["d2t"].dtype == torch.int32
    assert torch.equal(tensors["d2t"].long(), ckpt.tensors["d2t"])
    # Taps listed (4, 1, 3) become (1, 3, 4): fc's input blocks and fc_norm move with them.
    fc = ckpt.tensors["fc.weight"].reshape(64, 3, 64)
    assert torch.equal(tensors["fc.weight"].reshape(64, 3, 64), fc[:, [1, 2, 0]])
    assert torch.equal(tensors["fc_norm.0.weight"], ckpt.tensors["fc_norm.1.weight"])
    assert torch.equal(tensors["fc_norm.2.weight"], ckpt.tensors["fc_norm.0.weight"])


def test_llm_api_yaml_and_readme(bundle, llama_target):
    options = yaml.safe_load((bundle / "llm_api.yaml").read_text())
    spec = options["speculative_config"]
    # relative to the bundle: no file names the path the bundle was written under
    assert spec == {"decoding_type": "Eagle3", "max_draft_len": 4, "speculative_model": "drafter",
                    "eagle3_one_model": True, "eagle3_layers_to_capture": [1, 3, 4]}
    assert options["tensor_parallel_size"] == 2 and options["pipeline_parallel_size"] == 2
    assert options["return_perf_metrics"] is True
    readme = (bundle / "README.md").read_text()
    assert (f"trtllm-serve {llama_target.resolve()} --backend pytorch --host 127.0.0.1 --port 8000 "
            f"--tp_size 2 --pp_size 2 --config llm_api.yaml") in readme and "from this folder" in readme
    record = json.loads((bundle / "bundle.json").read_text())
    assert record["kind"] == "trtllm" and record["target"] == str(llama_target.resolve())
    assert record["aux_layer_ids"] == {"output_of_layer": [1, 3, 4], "before_layer": [2, 4, 5]}
    assert not (bundle / "target").exists()  # referenced, not copied
    assert set(json.loads((bundle / "manifest.json").read_text())["files"]) >= {"llm_api.yaml", "drafter/config.json"}


def test_bundle_drafter_runs_exactly_like_the_source(bundle, unordered, llama_target):
    """Read back and run with its own (ascending) taps: same drafts, same acceptance, same tokens."""
    source = load_pair(unordered[1], llama_target, dtype=torch.float64)
    back = read_drafter(bundle / "drafter")
    assert back.config.aux_layer_ids == (1, 3, 4) and back.config.norm_output and back.config.fc_norm
    target = ReferenceTarget(source.target.model, back.config.aux_layer_ids)
    drafter = ReferenceDrafterBackend(build_drafter(back, torch.float64, source.target.model))
    for prompt in ([5, 6, 7], [200, 3, 77, 41, 9]):
        a = speculate(source.target, source.drafter, prompt, 16, 3)
        b = speculate(target, drafter, prompt, 16, 3)
        assert (a.tokens, a.drafts, a.accepted_per_step) == (b.tokens, b.drafts, b.accepted_per_step)


def test_several_layers_use_midlayer_n_and_hidden_norm(tmp_path, llama_info, llama_target):
    cfg = drafter_config_for(llama_info, num_layers=2, norm_before_fc=True)
    src = write_drafter(random_drafter(cfg, seed=2), tmp_path / "src", "speculators")
    from eagle31_export.export.trtllm import export_trtllm

    out = export_trtllm(src, llama_target, tmp_path / "b")
    names = set(tensors_of(out / "drafter"))
    assert "midlayer.0.input_layernorm.weight" in names and "midlayer.0.hidden_norm.weight" in names
    # TensorRT-LLM's later ("regular") layers normalise their input with hidden_norm.
    assert "midlayer.1.hidden_norm.weight" in names and "midlayer.1.input_layernorm.weight" not in names
    assert "input_norm.weight" in names
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["eagle_config"]["norm_before_fc"] is True and config["fc_norm"] is False
    back = read_drafter(out / "drafter")
    assert back.config.num_layers == 2 and back.config.norm_before_fc
    assert set(back.tensors) == set(random_drafter(cfg).tensors) - {"t2d"}


def test_mla_drafter_resolves_to_the_eagle3_class(tmp_path, llama_info, llama_target):
    cfg = drafter_config_for(llama_info, mla=True, fc_norm=True, norm_output=True)
    src = write_drafter(random_drafter(cfg), tmp_path / "src", "modelopt")
    from eagle31_export.export.trtllm import export_trtllm

    out = export_trtllm(src, llama_target, tmp_path / "b")
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert trtllm_architecture(config) == "EAGLE3LlamaForCausalLM" and config["kv_lora_rank"] == 16  # MLA inside
    assert "midlayer.self_attn.kv_a_proj_with_mqa.weight" in tensors_of(out / "drafter")
    assert read_drafter(out / "drafter").config.attention == "mla"


def test_copy_target(tmp_path, eagle31_dir, llama_target):
    from eagle31_export.export.trtllm import export_trtllm

    out = export_trtllm(eagle31_dir, llama_target, tmp_path / "b", copy=True)
    assert (out / "target" / "config.json").is_file()
    assert "trtllm-serve target " in (out / "README.md").read_text()
    assert json.loads((out / "bundle.json").read_text())["target"] == "target"


def no_leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


def test_tp_that_does_not_divide(cli, tmp_path, eagle31_dir, llama_target):
    code, _, err = cli("export", "trtllm", "--drafter", eagle31_dir, "--target",
                       llama_target, "--out", tmp_path / "b", "--tp", "3")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "not divisible by --tp 3" in err
    assert not (tmp_path / "b").exists() and no_leftovers(tmp_path)


def test_pp_that_does_not_divide(cli, tmp_path, eagle31_dir, llama_target):
    code, _, err = cli("export", "trtllm", "--drafter", eagle31_dir, "--target",
                       llama_target, "--out", tmp_path / "b", "--pp", "3")
    assert code == 2 and "num_hidden_layers 8 is not divisible by --pp 3" in err
    assert not (tmp_path / "b").exists()


def test_incompatible_drafter(cli, tmp_path, eagle31_ckpt, llama_target):
    bad = DrafterCheckpoint(eagle31_ckpt.config.replace(aux_layer_ids=(1, 3, 12)), eagle31_ckpt.tensors)
    src = write_drafter(bad, tmp_path / "bad", "specforge")
    code, _, err = cli("export", "trtllm", "--drafter", src, "--target", llama_target, "--out", tmp_path / "b")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "does not fit target" in err and "[12]" in err
    assert not (tmp_path / "b").exists()


def test_existing_output_needs_force(cli, tmp_path, eagle31_dir, llama_target):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    args = ("export", "trtllm", "--drafter", eagle31_dir, "--target", llama_target, "--out", tmp_path / "b")
    code, _, err = cli(*args)
    assert code == 2 and "already exists" in err and "--force" in err
    assert (tmp_path / "b" / "keep.txt").read_text() == "mine"
    # --force replaces only an output of this tool (one with its manifest.json), never a folder of the user's
    code, _, err = cli(*args, "--force")
    assert code == 2 and "is not an eagle31-export output (no manifest.json)" in err
    assert (tmp_path / "b" / "keep.txt").read_text() == "mine"
    args = args[:-1] + (tmp_path / "c",)
    assert cli(*args)[0] == 0
    (tmp_path / "c" / "keep.txt").write_text("stale")
    code, out, _ = cli(*args, "--force")
    assert code == 0 and (tmp_path / "c" / "llm_api.yaml").is_file() and not (tmp_path / "c" / "keep.txt").exists()


def test_target_with_problems_is_refused(monkeypatch, cli, tmp_path, eagle31_dir, llama_target):
    import eagle31_export.formats.target.checkpoint as target_mod

    monkeypatch.setattr(target_mod, "inspect_target",
                        lambda path: {"problems": ["weight_scale of layers.0.mlp.up_proj has the wrong shape"]})
    code, _, err = cli("export", "trtllm", "--drafter", eagle31_dir, "--target", llama_target, "--out", tmp_path / "b")
    assert code == 2 and "is not servable: weight_scale" in err
    assert not (tmp_path / "b").exists()


def test_norm_before_residual_is_refused(cli, tmp_path, llama_info, llama_target):
    cfg = drafter_config_for(llama_info, norm_before_residual=True)
    src = write_drafter(random_drafter(cfg), tmp_path / "src", "speculators")
    code, _, err = cli("export", "trtllm", "--drafter", src, "--target", llama_target, "--out", tmp_path / "b")
    assert code == 2 and "norm_before_residual" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists() and no_leftovers(tmp_path)


# Eagle3DecodingConfig fields our YAML may use, as read in TensorRT-LLM's llm_args.py (docs/runtimes.md,
# "LLM-API keys checked"): decoding_type "Eagle3" (not the deprecated "Eagle"), the draft model and depth,
# the one-model mode (default true) and the capture set (outputs of layers).
EAGLE3_KEYS_WRITTEN = {"decoding_type", "max_draft_len", "speculative_model", "eagle3_one_model",
                       "eagle3_layers_to_capture"}


def test_export_never_writes_a_switch_that_turns_speculation_off(cli, bundle):
    from eagle31_export.formats.trtllm_options import SWITCH_KEYS

    spec = yaml.safe_load((bundle / "llm_api.yaml").read_text())["speculative_config"]
    assert set(spec) == EAGLE3_KEYS_WRITTEN and spec["decoding_type"] == "Eagle3"
    assert not set(spec) & set(SWITCH_KEYS)
    code, out, err = cli("inspect", bundle, "--json")
    report = json.loads(out)
    assert code == 0 and report["kind"] == "trtllm-options" and report["warnings"] == [], (out, err)
    code, _, err = cli("verify", bundle)
    assert code == 0 and "warning" not in err


def test_inspect_and_verify_warn_where_a_yaml_can_turn_speculation_off(cli, tmp_path, bundle):
    """TensorRT-LLM's acceptance_window + acceptance_length_threshold (1.2's spelling) disable speculation for
    good once the rolling acceptance falls below the threshold: a warning (the server still serves), in
    inspect and in verify (where the edited file is also a difference from the manifest)."""
    import shutil

    edited = tmp_path / "bundle"
    shutil.copytree(bundle, edited, symlinks=True)
    options = yaml.safe_load((edited / "llm_api.yaml").read_text())
    options["speculative_config"].update(acceptance_window=8, acceptance_length_threshold=1.5)
    (edited / "llm_api.yaml").write_text(yaml.safe_dump(options))
    code, out, _ = cli("inspect", edited, "--json")
    [warning] = json.loads(out)["warnings"]
    assert code == 0 and "acceptance_window 8 and acceptance_length_threshold 1.5" in warning
    assert "turns speculation off for good" in warning
    code, _, err = cli("verify", edited)
    assert code == 1 and "llm_api.yaml" in err
    assert any(line.startswith("warning: llm_api.yaml: ") and "off for good" in line for line in err.splitlines()), err

    # the later spelling (acceptance rate over iterations), a batch-size cut, and a YAML file given alone
    later = tmp_path / "later.yaml"
    later.write_text(yaml.safe_dump({"speculative_config": {
        "decoding_type": "Eagle3", "acceptance_rate_window_size": 16, "acceptance_rate_threshold": 0.3,
        "max_concurrency": 4}}))
    code, out, _ = cli("inspect", later, "--json")
    warnings = json.loads(out)["warnings"]
    assert code == 0 and len(warnings) == 2
    assert "acceptance_rate_window_size 16 and acceptance_rate_threshold 0.3" in warnings[0]
    assert "batch sizes above it" in warnings[1]
    lone = tmp_path / "lone.yaml"
    lone.write_text(yaml.safe_dump({"speculative_config": {"acceptance_length_threshold": 1.2}}))
    [warning] = json.loads(cli("inspect", lone, "--json")[1])["warnings"]
    assert "no effect alone" in warning
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    code, _, err = cli("inspect", bad)
    assert code == 2 and "expected TensorRT-LLM's LLM-API options" in err and len(err.strip().splitlines()) == 1
