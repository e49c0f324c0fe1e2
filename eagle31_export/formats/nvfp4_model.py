"""An NVFP4 checkpoint as a plain transformers model: the reference target's numerics.

W4A16 emulation: every quantized Linear gets its dequantized weight. W4A4 emulation
(`act_quant=True`): those Linears are also swapped for `ActQuantLinear`, which NVFP4
fake-quantizes its input under the checkpoint's static input scale, as the runtime's FP4 GEMM does.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle31_export.errors import CheckpointError
from eagle31_export.formats.experts import ExpertLayout, ExpertSlot, expert_problems, swap_experts
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
    experts = ExpertLayout.of(model)
    _check_experts(ckpt, experts, {n: tuple(t.shape) for n, t in state.items()})
    filled: set[str] = set()
    slots: dict[str, set[tuple[int, int]]] = {}  # fused expert parameter -> (expert, part) filled
    parts: dict[str, int] = {}  # fused expert parameter -> Linears concatenated per expert
    for name, tensor in ckpt.iter_other_tensors():
        if name in state:
            _assign(ckpt, state, name, tensor)
            filled.add(name)
        elif experts is not None and (slot := experts.slot(name)) is not None and slot.param in state:
            _assign_expert(ckpt, state, slot, tensor, name)
            slots.setdefault(slot.param, set()).add((slot.expert, slot.part))
            parts[slot.param] = slot.parts
    for q in ckpt.iter_linears():
        name = f"{q.name}.weight"
        slot = experts.slot(name) if experts is not None and name not in state else None
        if name not in state and slot is None:
            raise CheckpointError(f"{ckpt.folder}: NVFP4 Linear {q.name} has no counterpart in "
                                  f"{type(model).__name__} (neither a Linear nor a routed expert of it); "
                                  "is config.json the right architecture?")
        weight = dequantize(q.packed, q.weight_scale, q.weight_scale_2, dtype)
        if slot is None:
            _assign(ckpt, state, name, weight)
            filled.add(name)
        else:
            _assign_expert(ckpt, state, slot, weight, name)
            slots.setdefault(slot.param, set()).add((slot.expert, slot.part))
            parts[slot.param] = slot.parts
    for param, done in slots.items():
        if len(done) == state[param].shape[0] * parts[param]:
            filled.add(param)
    _check_complete(ckpt, model, filled)
    if act_quant:
        _quantize_activations(model, ckpt, experts)
    return model.eval()


def _check_experts(ckpt: NVFP4Checkpoint, experts: ExpertLayout | None, shapes: dict[str, tuple[int, ...]]) -> None:
    """Per-expert tensors (quantized or not) against the model's expert count, before any is read."""
    if experts is None:
        return
    from eagle31_export.formats.target import _past_layers

    layers = int(plain_config(ckpt.config).get_text_config().num_hidden_layers)
    names = [f"{m}.weight" for m in ckpt.linears] + ckpt.other_tensor_names()
    found = {n: s for n in names if n not in shapes and (s := experts.slot(n)) is not None
             and not _past_layers(n, layers)}  # stored layers past the config's (MTP heads) are ignored
    problems = expert_problems(found, shapes)
    if problems:
        raise CheckpointError(f"{ckpt.folder}: {problems[0]}")


def _assign_expert(ckpt: NVFP4Checkpoint, state: dict[str, torch.Tensor], slot: ExpertSlot, tensor: torch.Tensor,
                   name: str) -> None:
    target = state[slot.param][slot.expert, slot.rows(tuple(state[slot.param].shape))]
    if tuple(target.shape) != tuple(tensor.shape):
        where = ckpt.tensors.file_of(name) if name in ckpt.headers else ckpt.folder
        raise CheckpointError(f"{where}: {name} has shape {list(tensor.shape)}; expert {slot.expert} of "
                              f"{slot.experts_module} expects {list(target.shape)} (moe_intermediate_size / "
                              "hidden_size in config.json)")
    with torch.no_grad():
        target.copy_(tensor)


def _quantize_activations(model: nn.Module, ckpt: NVFP4Checkpoint, experts: ExpertLayout | None) -> None:
    """W4A4 emulation: every quantized Linear fake-quantizes its input under its own input scale;
    routed experts do so inside their fused module, expert by expert."""
    by_experts: dict[str, dict[str, float]] = {}
    for info in ckpt.linears.values():
        slot = experts.slot(f"{info.name}.weight") if experts is not None else None
        if slot is None or _is_linear(model, info.name):
            _swap_linear(model, info.name, info.input_global_scale)
        else:
            by_experts.setdefault(slot.experts_module, {})[info.name] = float(info.input_global_scale)
    for prefix, scales in by_experts.items():
        def hook(name: str, x: torch.Tensor, scales=scales) -> torch.Tensor:
            scale = scales.get(name)
            return x if scale is None else fake_quant_activation(x, scale)

        swap_experts(model, prefix, hook)


def _is_linear(model: nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), nn.Linear)
    except AttributeError:
        return False


# Model types published checkpoints declare for a transformers architecture of another name: Kimi K2
# is DeepSeek-V3 (transformers reads a `kimi_k2` text config as deepseek_v3 itself, in
# models/kimi_k25/configuration_kimi_k25.py; docs/nvfp4.md#published-nvfp4-moe-targets).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def plain_config(config: dict[str, Any]):
    """A transformers config without `quantization_config`, so no quantizer is attached."""
    from transformers import CONFIG_MAPPING

    # a deep copy: transformers rewrites nested objects (rope_scaling) of the dict it is given
    cfg = copy.deepcopy({k: v for k, v in config.items() if k != "quantization_config"})
    model_type = MODEL_TYPE_ALIASES.get(cfg.get("model_type"), cfg.get("model_type"))
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"config.json model_type {model_type!r} is not a transformers architecture; "
                              "only built-in causal LMs are supported (trust_remote_code is never used)")
    cfg["model_type"] = model_type
    cfg.pop("auto_map", None)  # remote code is never run: the built-in class stands in for it
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
