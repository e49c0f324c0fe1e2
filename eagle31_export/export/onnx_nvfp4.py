"""NVFP4 linear weights in ONNX graphs, in two flavours.

- `tensorrt`: the weight is a FLOAT4E2M1 initializer [out, in] and is dequantized by the two
  DequantizeLinear nodes ModelOpt emits for TensorRT: the fp8 block scales are dequantized with the
  per-tensor `weight_scale_2`, and the result scales the FP4 weight (axis=-1, block_size=16).
  ONNX Runtime's CPU provider has no FLOAT4E2M1 kernels; `onnx.reference` runs it.
- `onnxruntime`: the packed uint8 weight [out, in/2] and the fp8 scales stay as they are in the
  checkpoint; a model-local function `Nvfp4Dequantize` of standard ops (nibble unpack, E2M1 table
  lookup, block scale) produces the same fp32 weight, just before its MatMul and for that MatMul
  only (`GraphBuilder.wait_for`; sessions do not constant-fold it): the packed bytes stay the
  only copy held.

Both compute W[r, 16b+j] = e2m1(nibble) * (float(scale[r, b]) * weight_scale_2), in that order (the
DequantizeLinear order), so the two flavours give bit-identical weights.

FLOAT4E2M1 raw data is packed two per byte with the even element in the low nibble, which is
exactly the ModelOpt / compressed-tensors checkpoint packing: the bytes are copied, not repacked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from onnx import FunctionProto, TensorProto, helper, numpy_helper

from eagle31_export.errors import UserError
from eagle31_export.export.onnx_graph import OPSET, GraphBuilder

FLAVORS = ("tensorrt", "tensorrt-w4a4", "onnxruntime")
TENSORRT_FLAVORS = ("tensorrt", "tensorrt-w4a4")  # FLOAT4E2M1 weights; -w4a4 also quantizes activations (onnx_w4a4)
BLOCK = 16
OPS_DOMAIN = "eagle31.ops"  # helper functions that are not TensorRT plugins
DEQUANTIZE = "Nvfp4Dequantize"
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@dataclass(frozen=True)
class Nvfp4Weight:
    """One quantized Linear, in ModelOpt's conventions."""

    packed: torch.Tensor  # uint8 [out, in/2]
    scale: torch.Tensor  # float8_e4m3fn [out, in/16]
    scale_2: torch.Tensor  # fp32 scalar: amax / (6 * 448)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]


def read_nvfp4_weights(folder: str | os.PathLike) -> dict[str, Nvfp4Weight]:
    """Every NVFP4 Linear of a ModelOpt or compressed-tensors checkpoint, by module name; {} if
    the checkpoint is not NVFP4. Scales come back in ModelOpt's convention (the reader inverts
    compressed-tensors' global scales)."""
    try:
        from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint
        from eagle31_export.formats.target.checkpoint import is_nvfp4
    except ImportError:  # a build without NVFP4 checkpoint support loads plain checkpoints only
        return {}
    if not is_nvfp4(folder):
        return {}
    ckpt = NVFP4Checkpoint.open(folder)
    return {q.name: Nvfp4Weight(q.packed, q.weight_scale, q.weight_scale_2) for q in ckpt.iter_linears()}


def dequantized_weight(g: GraphBuilder, module: str, w: Nvfp4Weight, flavor: str, after: str | None = None) -> str:
    """Nodes producing the fp32 weight [out, in] of one NVFP4 Linear; with `after` (the activation it
    multiplies) the `onnxruntime` flavour dequantizes only once that is computed (`GraphBuilder.wait_for`),
    so that one dense weight at a time exists."""
    out_f, in_f = w.shape
    if flavor in TENSORRT_FLAVORS:
        w = positive_scales(w)
    scale = g.tensor(f"{module}.weight_scale", w.scale)
    scale_2 = g.tensor(f"{module}.weight_scale_2", w.scale_2.reshape(()))
    if flavor in TENSORRT_FLAVORS:
        fp4 = g.tensor_raw(f"{module}.weight", TensorProto.FLOAT4E2M1, [out_f, in_f],
                           w.packed.contiguous().numpy().tobytes())
        block_scale = g.op("DequantizeLinear", scale, scale_2)
        return g.op("DequantizeLinear", fp4, block_scale, axis=-1, block_size=BLOCK)
    if flavor == "onnxruntime":
        packed = g.tensor(f"{module}.weight", w.packed)
        return g.op(DEQUANTIZE, packed if after is None else g.wait_for(packed, after), scale, scale_2,
                    domain=OPS_DOMAIN)
    raise UserError(f"unknown --flavor {flavor!r}; choose one of {', '.join(FLAVORS)}")


def positive_scales(w: Nvfp4Weight) -> Nvfp4Weight:
    """A Linear with weight_scale_2 == 0 (an all-zero weight) as ModelOpt's ONNX export writes it: per-tensor
    scale 1.0 (modelopt/onnx/quantization/quant_utils.py, get_weights_scaling_factor_2: "if
    per_block_quant_scale == 0: per_block_quant_scale = 1.0"), block scales 1.0 and zero codes (what
    quantizing zeros gives), since TensorRT's parser rejects a non-positive constant scale. The weight
    stays all zeros (+0.0 where the checkpoint's codes gave -0.0)."""
    if float(w.scale_2) > 0:
        return w
    return Nvfp4Weight(torch.zeros_like(w.packed), torch.ones(w.scale.shape, dtype=torch.float32).to(w.scale.dtype),
                       torch.tensor(1.0, dtype=torch.float32))


def read_input_scales(folder: str | os.PathLike) -> dict[str, float]:
    """module -> input_scale (ModelOpt's convention) of every NVFP4 Linear; refused for a weight-only checkpoint."""
    from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint

    scales = {name: info.input_scale for name, info in NVFP4Checkpoint.open(folder).linears.items()}
    missing = [name for name, s in scales.items() if s is None]
    if missing:
        raise UserError(f"{folder}: --flavor tensorrt-w4a4 quantizes activations with the checkpoint's input scales, "
                        f"and {missing[0]} has none (weight-only NVFP4); use --flavor tensorrt (W4A16)")
    return scales


def dequantize_function() -> FunctionProto:
    """Nvfp4Dequantize(packed uint8 [out, in/2], scale e4m3 [out, in/16], scale_2 fp32) -> fp32 [out, in]."""
    table = numpy_helper.from_array(np.array(E2M1, dtype=np.float32), "e2m1")
    nodes = [
        helper.make_node("Constant", [], ["e2m1"], value=table),
        helper.make_node("Constant", [], ["low_mask"], value=numpy_helper.from_array(np.array(15, np.uint8))),
        helper.make_node("Constant", [], ["four"], value=numpy_helper.from_array(np.array(4, np.uint8))),
        helper.make_node("Constant", [], ["last"], value_ints=[-1]),
        helper.make_node("Constant", [], ["blocks"], value_ints=[0, -1, BLOCK]),
        helper.make_node("Constant", [], ["rows"], value_ints=[0, -1]),
        # Even elements sit in the low nibble, odd ones in the high nibble.
        helper.make_node("BitwiseAnd", ["packed", "low_mask"], ["even"]),
        helper.make_node("BitShift", ["packed", "four"], ["odd"], direction="RIGHT"),
        helper.make_node("Unsqueeze", ["even", "last"], ["even_1"]),
        helper.make_node("Unsqueeze", ["odd", "last"], ["odd_1"]),
        helper.make_node("Concat", ["even_1", "odd_1"], ["nibbles"], axis=-1),
        helper.make_node("Cast", ["nibbles"], ["nibble_idx"], to=TensorProto.INT64),
        helper.make_node("Gather", ["e2m1", "nibble_idx"], ["values"]),
        # First DequantizeLinear: fp8 block scale * per-tensor scale_2.
        helper.make_node("Cast", ["scale"], ["scale_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["scale_f", "scale_2"], ["block_scale"]),
        # Second DequantizeLinear: every block of 16 values times its block scale.
        helper.make_node("Reshape", ["values", "blocks"], ["value_blocks"]),
        helper.make_node("Unsqueeze", ["block_scale", "last"], ["block_scale_1"]),
        helper.make_node("Mul", ["value_blocks", "block_scale_1"], ["weight_blocks"]),
        helper.make_node("Reshape", ["weight_blocks", "rows"], ["weight"]),
    ]
    return helper.make_function(OPS_DOMAIN, DEQUANTIZE, ["packed", "scale", "scale_2"], ["weight"], nodes,
                                [helper.make_opsetid("", OPSET)],
                                doc_string="NVFP4 weight dequantization in standard ops (ONNX Runtime has no "
                                           "FLOAT4E2M1 kernels): same result as the two DequantizeLinear nodes.")
