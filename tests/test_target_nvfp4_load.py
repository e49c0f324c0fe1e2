"""The reference target from an NVFP4 checkpoint: W4A16 (dequantized weights) and W4A4 emulation."""

import pytest
import torch
from safetensors.torch import load_file

from factories import make_target
from eagle31_export.formats.nvfp4.numerics import fake_quant_activation, reciprocal_f32
from eagle31_export.formats.nvfp4.model import ActQuantLinear
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.formats.target.checkpoint import inspect_target, load_causal_lm
from eagle31_export.reference.target import load_target

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
IDS = torch.tensor([[11, 42, 7, 199, 3, 64, 128, 5]])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    src = make_target(root / "src", "qwen3", seed=5, num_layers=3)
    return src, quantize_checkpoint(src, root / "nvfp4", "modelopt").out


def explicit_dequantized_model(src, nvfp4_dir):
    """The plain model with each quantized weight decoded by hand: nibble table * block scale * global scale."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(nvfp4_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    quantized = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if f"{name}.weight_scale" not in tensors:
                continue
            packed = tensors[f"{name}.weight"]
            codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
            block = tensors[f"{name}.weight_scale"].float() * tensors[f"{name}.weight_scale_2"]
            module.weight.copy_((E2M1[codes.long()].reshape(*block.shape, 16) * block[..., None]).flatten(1))
            quantized.append((name, module, tensors[f"{name}.input_scale"].item()))
    return model, quantized


def test_w4a16_logits_equal_explicitly_dequantized_model(pair):
    src, nvfp4_dir = pair
    explicit, quantized = explicit_dequantized_model(*pair)
    assert len(quantized) == 3 * 7
    model = load_causal_lm(nvfp4_dir, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, explicit(IDS).logits)
    assert not any(isinstance(m, ActQuantLinear) for m in model.modules())


def test_w4a4_fake_quantizes_every_quantized_linear_input(pair):
    src, nvfp4_dir = pair
    explicit, quantized = explicit_dequantized_model(*pair)
    for _, module, input_scale in quantized:
        module.register_forward_pre_hook(
            lambda _m, args, gs=reciprocal_f32(input_scale): (fake_quant_activation(args[0], gs),))
    model = load_causal_lm(nvfp4_dir, dtype=torch.float32, act_quant=True)
    swapped = {n for n, m in model.named_modules() if isinstance(m, ActQuantLinear)}
    assert swapped == {n for n, _, _ in quantized}
    assert set(model.state_dict()) == set(explicit.state_dict())  # wrapping does not rename parameters
    with torch.no_grad():
        w4a4 = model(IDS).logits
        assert torch.equal(w4a4, explicit(IDS).logits)
        w4a16 = load_causal_lm(nvfp4_dir, dtype=torch.float32)(IDS).logits
    assert not torch.equal(w4a4, w4a16)
    assert (w4a4 - w4a16).abs().max() < 0.5 * w4a16.abs().max()


def test_bf16_and_reference_target(pair):
    _, nvfp4_dir = pair
    model = load_causal_lm(nvfp4_dir, dtype=torch.bfloat16, act_quant=True)
    assert next(model.parameters()).dtype == torch.bfloat16
    target = load_target(nvfp4_dir, (0, 2), dtype=torch.float32, act_quant=True)
    logits, taps = target.forward(IDS)
    assert logits.shape == (1, 8, 256) and taps.shape == (1, 8, 2 * 64)


def test_tied_embeddings_quantize_and_load(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=96,
                               tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    assert "lm_head.weight" not in load_file(tmp_path / "src" / "model.safetensors")
    out = quantize_checkpoint(tmp_path / "src", tmp_path / "q", "compressed-tensors").out
    report = inspect_target(out)
    assert report["problems"] == [] and "lm_head" in report["quantization"]["excluded"]
    model = load_causal_lm(out, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
