"""A whole tiny Llama: our quantizer vs ModelOpt's mtq.quantize + export_hf_checkpoint, bit for bit.

ModelOpt runs on CPU here because its "max" calibration forward does not fake-quantize
(that path asserts CUDA amax); only quantize + export are used, as a user would.
"""

import json

import pytest
import torch

from factories import make_target
from eagle31_export.formats.nvfp4.calibration import default_calibration_prompts
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.formats.target.checkpoint import inspect_target, load_causal_lm

mtq = pytest.importorskip("modelopt.torch.quantization")
from modelopt.torch.export import export_hf_checkpoint  # noqa: E402
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("mo") / "src", "llama", seed=4, dtype=torch.bfloat16, num_layers=3)


@pytest.fixture(scope="module")
def modelopt_export(bf16_llama, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.bfloat16).eval()
    prompts = default_calibration_prompts(model.config.vocab_size)

    def forward_loop(m):
        for ids in prompts:
            m(input_ids=torch.tensor([ids]))

    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    out = tmp_path_factory.mktemp("mo") / "modelopt"
    export_hf_checkpoint(model, export_dir=out)
    return out


@pytest.fixture(scope="module")
def ours(bf16_llama, tmp_path_factory):
    return quantize_checkpoint(bf16_llama, tmp_path_factory.mktemp("mo") / "ours", "modelopt").out


def test_every_tensor_bit_exact_with_modelopt_export(modelopt_export, ours):
    theirs, mine = load_file(modelopt_export / "model.safetensors"), load_file(ours / "model.safetensors")
    assert sorted(theirs) == sorted(mine)
    assert sum(n.endswith(".weight_scale_2") for n in mine) == 3 * 7
    for name in theirs:
        assert theirs[name].dtype == mine[name].dtype and theirs[name].shape == mine[name].shape, name
        assert torch.equal(bits(theirs[name]), bits(mine[name])), name  # input_scale included


def test_declarations_match_modelopt_except_producer(modelopt_export, ours):
    for fname in ("hf_quant_config.json", "config.json"):
        theirs, mine = json.loads((modelopt_export / fname).read_text()), json.loads((ours / fname).read_text())
        for doc in (theirs, mine):
            doc.get("quantization_config", doc).pop("producer")
        assert theirs == mine, fname
    assert (ours / "manifest.json").is_file()


def test_reader_accepts_modelopt_export(modelopt_export):
    report = inspect_target(modelopt_export)
    q = report["quantization"]
    assert q["format"] == "modelopt" and q["algo"] == "NVFP4" and q["group_size"] == 16
    assert q["quantized_linears"] == 21 and q["excluded"] == ["lm_head", "model.embed_tokens"]
    assert q["kv_cache"] is None and report["problems"] == []


def test_load_equals_explicit_modelopt_dequantization(modelopt_export, bf16_llama):
    """W4A16 reference == the plain model with every weight dequantized by ModelOpt's own code."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(modelopt_export / "model.safetensors")
    explicit = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in explicit.named_modules():
            if f"{name}.weight_scale" not in tensors:
                continue
            packed = tensors[f"{name}.weight"]
            shape = (packed.shape[0], packed.shape[1] * 2)
            q = NVFP4QTensor(torch.Size(shape), torch.float32, packed)
            module.weight.copy_(q.dequantize(scale=tensors[f"{name}.weight_scale"], block_sizes={-1: 16},
                                             double_scale=tensors[f"{name}.weight_scale_2"], dtype=torch.float32))
    ours = load_causal_lm(modelopt_export, dtype=torch.float32)
    ids = torch.tensor([[3, 17, 99, 4, 250, 31, 7]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, explicit(ids).logits)
