"""An NVFP4 checkpoint as a plain transformers model: the reference target's numerics.

W4A16 emulation: every quantized Linear gets its dequantized weight. W4A4 emulation
(`act_quant=True`): those Linears are also swapped for `ActQuantLinear`, which NVFP4
fake-quantizes its input under the checkpoint's static input scale, as the runtime's FP4 GEMM does.

With `packed=True` (the reference target) the quantized Linears are `NVFP4Linear`s instead: they
hold the codes and scales as stored (about a seventh of the fp32 bytes) and dequantize them, with
the same `dequantize`, inside each call, so outputs are bit-identical to the dense weights; other
tensors stay in their stored dtype where the compute dtype widens it exactly (the caller then
computes in `dtype`: `reference.upcast.compute_in`). Routed experts, fused into 3-D parameters by
transformers, are still dequantized into dense parameters in `dtype`.
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
from eagle31_export.formats.nvfp4.numerics import dequantize, fake_quant_activation
from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint
from eagle31_export.formats.safetensors_io import upcasts_exactly

# Bytes of dequantized weight an NVFP4Linear materialises at a time: below it, one GEMM over the
# whole weight (exactly what the dense model computes); above it, blocks of output rows.
DEQUANT_CHUNK_BYTES = 64 << 20
# Bound on `dequantize`'s int64 code temporaries while one block of the weight is decoded.
_DEQUANT_TEMP_BYTES = 16 << 20
# A quantized Linear whose dense weight is at most this many bytes keeps it after its first call:
# small models' forwards are otherwise dominated by decoding (a large one's memory is what packing saves).
DENSE_CACHE_BYTES = 1 << 20


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


class NVFP4Linear(nn.Module):
    """A quantized Linear kept packed: uint8 codes, FP8-E4M3 block scales and the FP32 global scale,
    as stored; each call dequantizes (`nvfp4.dequantize`, into the input's dtype) by blocks of
    output rows. With `input_global_scale` set, the input is NVFP4 fake-quantized first (W4A4).
    The codes and scales are non-persistent buffers: the state dict holds no dense weight."""

    computes_from_storage = True  # reference.upcast leaves it alone: it casts its own storage

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, input_global_scale: float | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_packed", packed, persistent=False)
        self.register_buffer("weight_scale", weight_scale, persistent=False)
        self.register_buffer("weight_scale_2", torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(()),
                             persistent=False)
        self.bias = linear.bias
        # A Python float, as in ActQuantLinear: a dtype cast of the model must not round it.
        self.input_global_scale = None if input_global_scale is None else float(input_global_scale)
        self._dense: tuple | None = None  # (dtype, device, codes' and scales' storage), weight: the last decoded

    def dense_weight(self, dtype: torch.dtype, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop of the dequantized weight [out, in] in `dtype` (what the dense model holds).

        Filled by blocks of rows: `dequantize`'s own temporaries (int64 codes, fp32 values) are
        several times the result's bytes, and each element depends only on its own code and scale."""
        stop = self.out_features if stop is None else stop
        out = torch.empty(stop - start, self.in_features, dtype=dtype, device=self.weight_packed.device)
        rows = max(1, _DEQUANT_TEMP_BYTES // (self.in_features * 8))
        for r in range(start, stop, rows):
            end = min(r + rows, stop)
            out[r - start:end - start] = dequantize(self.weight_packed[r:end], self.weight_scale[r:end],
                                                    self.weight_scale_2, dtype)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_global_scale is not None:
            x = fake_quant_activation(x, self.input_global_scale)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        rows = max(1, DEQUANT_CHUNK_BYTES // max(1, self.in_features * x.dtype.itemsize))
        if self.out_features <= rows:
            return F.linear(x, self._whole_weight(x.dtype), bias)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for start in range(0, self.out_features, rows):
            stop = min(start + rows, self.out_features)
            w = self.dense_weight(x.dtype, start, stop)
            out[..., start:stop] = F.linear(x, w, None if bias is None else bias[start:stop])
        return out

    def _whole_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight, decoded again only when it is large or its codes, scales, dtype or device changed."""
        if self.out_features * self.in_features * dtype.itemsize > DENSE_CACHE_BYTES:
            return self.dense_weight(dtype)
        key = (dtype, self.weight_packed.device, self.weight_packed.data_ptr(), self.weight_scale.data_ptr(),
               self.weight_scale_2.data_ptr())
        if self._dense is None or self._dense[0] != key:
            self._dense = (key, self.dense_weight(dtype))
        return self._dense[1]

    def extra_repr(self) -> str:
        scale = "" if self.input_global_scale is None else f", input_global_scale={self.input_global_scale:.6g}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed{scale}")


def build_model(ckpt: NVFP4Checkpoint, dtype: torch.dtype, act_quant: bool = False, packed: bool = False) -> nn.Module:
    """The checkpoint's architecture with dequantized weights, in `dtype`, in eval mode; with `packed`,
    quantized Linears stay packed (`NVFP4Linear`) and other tensors as stored (module docstring)."""
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
            _assign(ckpt, state, name, tensor, keep_stored=dtype if packed else None)
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
        if slot is None and packed and _is_linear(model, q.name):
            _swap_packed(ckpt, model, q)
            filled.add(name)
            continue
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
    from eagle31_export.formats.layer_names import past_layers

    layers = int(plain_config(ckpt.config).get_text_config().num_hidden_layers)
    names = [f"{m}.weight" for m in ckpt.linears] + ckpt.other_tensor_names()
    found = {n: s for n in names if n not in shapes and (s := experts.slot(n)) is not None
             and not past_layers(n, layers)}  # stored layers past the config's (MTP heads) are ignored
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
        return isinstance(model.get_submodule(name), (nn.Linear, NVFP4Linear))
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


def _assign(ckpt: NVFP4Checkpoint, state: dict[str, torch.Tensor], name: str, tensor: torch.Tensor,
            keep_stored: torch.dtype | None = None) -> None:
    """Copy `tensor` into the model's; with `keep_stored` (the compute dtype) a floating-point tensor
    the compute dtype widens exactly is held as stored instead (the model's tensor takes its data)."""
    target = state[name]
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{ckpt.tensors.file_of(name) if name in ckpt.headers else ckpt.folder}: "
                              f"{name} has shape {list(tensor.shape)}; the model expects {list(target.shape)}")
    with torch.no_grad():
        if (keep_stored is not None and target.is_floating_point() and tensor.dtype != target.dtype
                and upcasts_exactly(tensor.dtype, keep_stored)):
            # a copy, not the view of the file mapping the reader hands out: the file may change later
            target.data = tensor.clone()
        else:
            target.copy_(tensor)


def _swap_packed(ckpt: NVFP4Checkpoint, model: nn.Module, q) -> None:
    parent_name, _, child = q.name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    linear = getattr(parent, child)
    if isinstance(linear, NVFP4Linear) or tuple(linear.weight.shape) != (q.info.out_features, q.info.in_features):
        shape = [q.info.out_features, q.info.in_features]
        expected = list(linear.weight.shape) if isinstance(linear, nn.Linear) else "one NVFP4 Linear"
        raise CheckpointError(f"{ckpt.tensors.file_of(q.info.tensor_names['packed'])}: {q.name}.weight has shape "
                              f"{shape}; the model expects {expected}")
    # copies, not views of the reader's file mapping: the file may change while the model lives
    setattr(parent, child, NVFP4Linear(linear, q.packed.clone(), q.weight_scale.clone(), q.weight_scale_2))


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
    if isinstance(linear, NVFP4Linear):
        linear.input_global_scale = float(input_global_scale)
        return
    if not isinstance(linear, nn.Linear):
        raise CheckpointError(f"NVFP4 module {name} is a {type(linear).__name__} in the model, not a Linear; "
                              "activation quantization is only emulated for Linear layers")
    setattr(parent, child, ActQuantLinear(linear, input_global_scale))
