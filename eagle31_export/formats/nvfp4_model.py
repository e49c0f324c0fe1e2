"""An NVFP4 checkpoint as a plain transformers model: the reference target's numerics.

W4A16 emulation: every quantized Linear gets its dequantized weight. W4A4 emulation
(`act_quant=True`): those Linears are also swapped for `ActQuantLinear`, which NVFP4
fake-quantizes its input under the checkpoint's static input scale, as the runtime's FP4 GEMM does.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle31_export.errors import CheckpointError
from eagle31_export.formats.nvfp4 import dequantize, fake_quant_activation
from eagle31_export.formats.nvfp4_reader import NVFP4Checkpoint



class ActQuantLinear(nn.Linear):
    """nn.Linear whose input is NVFP4-quantized-dequantized first (dynamic per-16-block
    scales under the static global scale). Shares the wrapped Linear's parameters, so the
    model's state dict is unchanged."""

    def __init__(self, linear: nn.Linear, input_global_scale: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # A Python float, not a buffer: `model.to(bfloat16)` must not round it.
        self.input_global_scale = float(input_global_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_quant_activation(x, self.input_global_scale), self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", input_global_scale={self.input_global_scale:.6g}"


def build_model(ckpt: NVFP4Checkpoint, dtype: torch.dtype, act_quant: bool = False) -> nn.Module:
    """The checkpoint's architecture with dequantized weights, in `dtype`, in eval mode."""
    if act_quant and not ckpt.scheme.act_quant:
        raise CheckpointError(f"{ckpt.folder}: activation quantization requested, but the checkpoint is "
                              "weight-only NVFP4 (no input scales); drop --act-quant")
    model = _empty_model(ckpt, dtype)
    state = model.state_dict(keep_vars=True)
    filled: set[str] = set()
    for name, tensor in ckpt.iter_other_tensors():
        if name in state:
            _assign(ckpt, state, name, tensor)
            filled.add(name)
    for q in ckpt.iter_linears():
        name = f"{q.name}.weight"
        if name not in state:
            raise CheckpointError(f"{ckpt.folder}: NVFP4 Linear {q.name} has no counterpart in "
                                  f"{type(model).__name__}; is config.json the right architecture?")
        weight = dequantize(q.packed, q.weight_scale, q.weight_scale_2, dtype)
        _assign(ckpt, state, name, weight)
        filled.add(name)
    _check_complete(ckpt, model, filled)
    if act_quant:
        for info in ckpt.linears.values():
            _swap_linear(model, info.name, info.input_global_scale)
    return model.eval()


def plain_config(config: dict[str, Any]):
    """A transformers config without `quantization_config`, so no quantizer is attached."""
    from transformers import CONFIG_MAPPING

    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"config.json model_type {model_type!r} is not a transformers architecture; "
                              "only built-in causal LMs are supported (trust_remote_code is never used)")
    return CONFIG_MAPPING[model_type].from_dict(cfg)


def _empty_model(ckpt: NVFP4Checkpoint, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:  # skip random init: every parameter is overwritten from the checkpoint
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    config = plain_config(ckpt.config)
    with no_init_weights():
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError as err:
            raise CheckpointError(f"{ckpt.folder}: cannot build a causal LM from config.json ({err})") from None
    # Tie before loading (from_pretrained does too): a tied lm_head is then the embedding
    # parameter itself, filled once, rather than a separate uninitialised tensor.
    model.tie_weights()
    return model


def _assign(ckpt: NVFP4Checkpoint, state: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    target = state[name]
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{ckpt.tensors.file_of(name) if name in ckpt.headers else ckpt.folder}: "
                              f"{name} has shape {list(tensor.shape)}; the model expects {list(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def _check_complete(ckpt: NVFP4Checkpoint, model: nn.Module, filled: set[str]) -> None:
    # named_parameters() lists a tied parameter once, under the name that owns it.
    needed = {n for n, _ in model.named_parameters()}
    persistent = set(model.state_dict().keys())
    needed |= {n for n, _ in model.named_buffers() if n in persistent}
    missing = sorted(needed - filled)
    if missing:
        raise CheckpointError(f"{ckpt.folder}: tensor {missing[0]} is missing from the checkpoint "
                              f"({len(missing)} missing in all); is it complete?")


def _swap_linear(model: nn.Module, name: str, input_global_scale: float | None) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    linear = getattr(parent, child)
    if not isinstance(linear, nn.Linear):
        raise CheckpointError(f"NVFP4 module {name} is a {type(linear).__name__} in the model, not a Linear; "
                              "activation quantization is only emulated for Linear layers")
    setattr(parent, child, ActQuantLinear(linear, input_global_scale))
