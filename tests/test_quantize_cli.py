"""`eagle31-export quantize` end to end: both formats, exclusions, calibration prompts, errors."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from factories import make_target
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.formats.target.checkpoint import inspect_target


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("cli") / "src", "llama", seed=9, dtype=torch.bfloat16, num_layers=2)


def write_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the cat sat on a mat and dog ran".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def test_quantize_compressed_tensors_with_exclusions_and_prompts(cli, src, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3, 4, 5, 6]}\n\n{"prompt_ids": [200, 100, 50]}\n')
    out = tmp_path / "ct"
    code, _, err = cli("quantize", src, "--out", out, "--format", "compressed-tensors",
                       "--exclude", "*down_proj", "--exclude", "model.layers.1.self_attn.o_proj",
                       "--calib-prompts", prompts)
    assert code == 0, err
    assert "11 Linears quantized" in err
    report = inspect_target(out)
    q = report["quantization"]
    assert q["format"] == "compressed-tensors" and q["quantized_linears"] == 11 and report["problems"] == []
    assert q["excluded"] == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.down_proj",
                             "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.o_proj"]
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.uint8
    # The prompts file drove calibration: same input scales as the library with those ids.
    lib = quantize_checkpoint(src, tmp_path / "lib", "compressed-tensors", prompts=[[1, 2, 3, 4, 5, 6], [200, 100, 50]],
                              exclude=["*down_proj", "model.layers.1.self_attn.o_proj"]).out
    assert torch.equal(load_file(lib / "model.safetensors")["model.layers.1.mlp.up_proj.input_global_scale"],
                       tensors["model.layers.1.mlp.up_proj.input_global_scale"])
    manifest = json.loads((out / "manifest.json").read_text())["files"]
    assert set(manifest) == {"config.json", "generation_config.json", "model.safetensors"}
    assert manifest["model.safetensors"]["sha256"] == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def test_default_modelopt_then_convert_with_force(cli, src, tmp_path):
    out = tmp_path / "mo"
    code, _, err = cli("quantize", src, "--out", out)
    assert code == 0, err
    assert (out / "hf_quant_config.json").is_file()
    code, _, err = cli("quantize", src, "--out", out)
    assert code == 2 and "already exists" in err and "--force" in err and "Traceback" not in err
    # An NVFP4 input is converted (losslessly) rather than re-quantized.
    ct = tmp_path / "ct"
    ct.mkdir()
    code, _, err = cli("quantize", out, "--out", ct, "--format", "compressed-tensors", "--force")
    assert code == 0, err
    assert "converted to compressed-tensors" in err
    assert inspect_target(ct)["quantization"]["format"] == "compressed-tensors"


def test_text_prompts_use_the_model_tokenizer(cli, src, tmp_path):
    import shutil

    model = tmp_path / "with_tok"
    shutil.copytree(src, model)
    write_tokenizer(model)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "the cat sat on a mat"}\n{"text": "a dog ran"}\n')
    code, _, err = cli("quantize", model, "--out", tmp_path / "q", "--calib-prompts", prompts)
    assert code == 0, err
    assert (tmp_path / "q" / "tokenizer.json").is_file()  # side files travel with the weights


@pytest.mark.parametrize("args,fragment", [
    (["--exclude", "model.layers.9.*"], "--exclude 'model.layers.9.*' matches no Linear"),
    (["--format", "gguf"], "--format 'gguf'"),
    (["--calib-prompts", "PROMPTS:{\"prompt_ids\": [1, 2]}\nnot json\n"], "p.jsonl:2: not JSON"),
    (["--calib-prompts", "PROMPTS:{\"text\": \"hello\"}\n"], "has no tokenizer"),
    (["--calib-prompts", "PROMPTS:{\"prompt_ids\": [1, 99999]}\n"], "outside the model's vocabulary"),
    (["--out", "SRC", "--force"], "is the input checkpoint itself"),
])
def test_bad_arguments_fail_with_one_line_and_write_nothing(cli, src, tmp_path, args, fragment):
    args = list(args)
    for i, a in enumerate(args):
        if a == "SRC":
            args[i] = src
        elif a.startswith("PROMPTS:"):
            (tmp_path / "p.jsonl").write_text(a[len("PROMPTS:"):])
            args[i] = tmp_path / "p.jsonl"
    code, _, err = cli("quantize", src, "--out", tmp_path / "out", *args)
    assert code == 2
    assert fragment in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_linears_that_cannot_be_quantized_are_kept_and_declared(tmp_path):
    """in_features not a multiple of 16, and an all-zero fused group, stay in BF16 and are excluded."""
    from safetensors.torch import save_file

    src = make_target(tmp_path / "src", "llama", seed=2, dtype=torch.bfloat16, num_layers=2, hidden=40, heads=2,
                      kv_heads=1, intermediate=64)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"].zero_()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    result = quantize_checkpoint(src, tmp_path / "q", "modelopt")
    assert result.quantized == ["model.layers.0.mlp.down_proj"]
    assert any("in_features 40 is not a multiple of 16" in n for n in result.notes)
    assert any(n.startswith("model.layers.1.mlp.down_proj: all-zero weight") for n in result.notes)
    report = inspect_target(result.out)
    assert report["problems"] == [] and report["quantization"]["quantized_linears"] == 1
    assert "model.layers.1.mlp.down_proj" in report["quantization"]["excluded"]
