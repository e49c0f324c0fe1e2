"""ModelOpt <-> compressed-tensors conversion: lossless in both directions."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle31_export.errors import UserError
from factories import make_target
from eagle31_export.formats.nvfp4.numerics import reciprocal_f32
from eagle31_export.formats.nvfp4.convert import convert_checkpoint
from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.formats.target.checkpoint import inspect_target, load_causal_lm


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def all_tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(bits(a[name]), bits(b[name])), name


@pytest.fixture(scope="module")
def modelopt_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    src = make_target(root / "src", "llama", seed=7, dtype=torch.bfloat16, num_layers=2)
    (src / "tokenizer_config.json").write_text("{}")  # side files travel with the weights
    return quantize_checkpoint(src, root / "mo", "modelopt").out


def test_modelopt_to_compressed_tensors_and_back_is_lossless(modelopt_ckpt, tmp_path):
    ct = convert_checkpoint(modelopt_ckpt, tmp_path / "ct", "compressed-tensors")
    back = convert_checkpoint(ct, tmp_path / "back", "modelopt", max_shard_bytes=40_000)  # sharded on the way back
    assert len(list(back.glob("*.safetensors"))) > 1 and (back / "model.safetensors.index.json").is_file()
    assert_same_tensors(all_tensors(modelopt_ckpt), all_tensors(back))
    assert (back / "tokenizer_config.json").is_file() and (ct / "tokenizer_config.json").is_file()
    for fname in ("hf_quant_config.json",):
        a, b = json.loads((modelopt_ckpt / fname).read_text()), json.loads((back / fname).read_text())
        assert a["quantization"] == b["quantization"]


def test_compressed_tensors_layout(modelopt_ckpt, tmp_path):
    ct = convert_checkpoint(modelopt_ckpt, tmp_path / "ct", "compressed-tensors")
    mo, cts = all_tensors(modelopt_ckpt), all_tensors(ct)
    name = "model.layers.0.self_attn.q_proj"
    assert torch.equal(cts[f"{name}.weight_packed"], mo[f"{name}.weight"])
    assert torch.equal(bits(cts[f"{name}.weight_scale"]), bits(mo[f"{name}.weight_scale"]))
    assert cts[f"{name}.weight_global_scale"].shape == (1,)
    assert cts[f"{name}.weight_global_scale"].item() == reciprocal_f32(mo[f"{name}.weight_scale_2"].item())
    assert cts[f"{name}.input_global_scale"].item() == reciprocal_f32(mo[f"{name}.input_scale"].item())
    assert not (ct / "hf_quant_config.json").exists()
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert qc["ignore"] == ["lm_head", "model.embed_tokens"]
    report = inspect_target(ct)
    assert report["quantization"]["format"] == "compressed-tensors" and report["problems"] == []
    # Both formats load to the same reference, bit for bit, W4A16 and W4A4.
    ids = torch.tensor([[1, 5, 9, 200, 13]])
    for act_quant in (False, True):
        with torch.no_grad():
            a = load_causal_lm(modelopt_ckpt, torch.float32, act_quant=act_quant)(ids).logits
            b = load_causal_lm(ct, torch.float32, act_quant=act_quant)(ids).logits
        assert torch.equal(a, b)


def test_foreign_compressed_tensors_round_trip_and_kv_scales(modelopt_ckpt, tmp_path):
    """A compressed-tensors checkpoint from another producer (no records, FP8 KV scales) -> ModelOpt -> back."""
    ct = convert_checkpoint(modelopt_ckpt, tmp_path / "ct", "compressed-tensors")
    tensors = all_tensors(ct)
    gen = torch.Generator().manual_seed(0)
    for name in list(tensors):
        if name.endswith("_global_scale"):  # arbitrary FP32 values, many without an exact reciprocal
            tensors[name] = torch.rand(1, generator=gen) * 1000 + 1
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([0.02 + layer])
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.03 + layer])
    (ct / "model.safetensors").unlink()
    save_file(tensors, str(ct / "model.safetensors"), metadata={"format": "pt"})  # drops our records
    cfg = json.loads((ct / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    (ct / "config.json").write_text(json.dumps(cfg))

    mo = convert_checkpoint(ct, tmp_path / "mo", "modelopt")
    mo_tensors = all_tensors(mo)
    assert mo_tensors["model.layers.1.self_attn.k_proj.k_scale"].item() == pytest.approx(1.02)
    assert json.loads((mo / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
    inexact = [n for n, t in tensors.items() if n.endswith("_global_scale")
               and reciprocal_f32(reciprocal_f32(t.item())) != t.item()]
    assert inexact, "the test needs scales whose FP32 reciprocal does not round-trip"
    with safe_open(str(mo / "model.safetensors"), "pt") as f:
        assert "nvfp4_exact_inverse" in f.metadata()
    back = convert_checkpoint(mo, tmp_path / "back", "compressed-tensors")
    assert_same_tensors(tensors, all_tensors(back))
    kv = inspect_target(back)["quantization"]["kv_cache"]
    assert (kv["algo"], kv["scales"], kv["naming"]) == ("FP8", 4, ["compressed-tensors"])


def test_stale_record_is_ignored(modelopt_ckpt, tmp_path):
    """A record that no longer matches its tensor (edited by hand) must not override it."""
    ct = convert_checkpoint(modelopt_ckpt, tmp_path / "ct", "compressed-tensors")
    with safe_open(str(ct / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(ct / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_global_scale"
    tensors[name] = torch.tensor([123.0])
    save_file(tensors, str(ct / "model.safetensors"), metadata=metadata)
    info = NVFP4Checkpoint.open(ct).linears["model.layers.0.mlp.down_proj"]
    assert info.weight_scale_2 == reciprocal_f32(123.0)


def test_conversion_refuses_same_format_and_unknown_format(modelopt_ckpt, tmp_path):
    with pytest.raises(UserError, match="already a modelopt"):
        convert_checkpoint(modelopt_ckpt, tmp_path / "x", "modelopt")
    with pytest.raises(UserError, match="unknown NVFP4 format"):
        convert_checkpoint(modelopt_ckpt, tmp_path / "x", "gguf")
    assert not (tmp_path / "x").exists()
