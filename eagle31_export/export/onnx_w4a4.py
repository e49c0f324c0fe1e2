"""W4A4 NVFP4 target graphs for TensorRT (`export onnx --flavor tensorrt-w4a4`).

The `tensorrt` flavour dequantizes FP4 weights and leaves activations in the compute dtype (W4A16):
TensorRT then runs FP32/BF16 GEMMs. This flavour also quantizes every quantized Linear's input the
way ModelOpt's TensorRT export does (modelopt/torch/quantization/export_onnx.py, `export_fp4`,
dynamic path), so that TensorRT >= 10.8 on Blackwell can run FP4 x FP4 GEMMs:

    x_fp4, x_scale_fp8 = trt::TRT_FP4DynamicQuantize(x, input_scale, axis=-1, block_size=16,
                                                     scale_type=FLOAT8E4M3FN)
    x_scale = DequantizeLinear(x_scale_fp8, input_scale)
    x_dq    = DequantizeLinear(x_fp4, x_scale, axis=-1, block_size=16)
    y       = MatMul(x_dq, W_dq^T)

`input_scale` is the checkpoint's static per-tensor activation scale (ModelOpt's convention,
amax / (6 * 448)); where it is 0 ModelOpt writes 1.0 (`export_fp4`: "if amax is None or amax == 0:
sx_f32_per_tensor = 1.0"), and TensorRT's parser rejects a non-positive constant scale
(onnx-tensorrt onnxOpImporters.cpp, QuantDequantLinearHelper: "Scale coefficients must all be
positive"), so 0 becomes 1.0 here too.

The pass rewrites a finished target graph (`onnx_target` writes the W4A16 form): every MatMul whose
weight comes from a FLOAT4E2M1 initializer gets its activation input quantized. `reference_ops`
gives `onnx.reference.ReferenceEvaluator` an implementation of the custom op, with the arithmetic of
the FP4 quantization kernels our W4A4 reference follows (formats/nvfp4/numerics.py: fake_quant_activation);
TensorRT publishes no bit-level formula for its own kernel (docs/nvfp4-tensorrt.md).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

W4A4 = "tensorrt-w4a4"
TRT_DOMAIN = "trt"
DYNAMIC_QUANTIZE = "TRT_FP4DynamicQuantize"
BLOCK = 16


def positive_scale(scale: float) -> float:
    """ModelOpt's rule for a zero per-tensor scale (module docstring)."""
    return float(scale) if scale > 0 else 1.0


def quantize_activations(model: onnx.ModelProto, input_scales: dict[str, float]) -> onnx.ModelProto:
    """`model` with the input of every FP4-weight MatMul dynamically NVFP4-quantized (module docstring).

    `input_scales`: module name -> input_scale; a module without one is refused (a weight-only
    checkpoint has no W4A4 form)."""
    g = model.graph
    fp4 = {t.name for t in g.initializer if t.data_type == TensorProto.FLOAT4E2M1}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    inserts: dict[int, list[onnx.NodeProto]] = {}
    positions = {id(n): i for i, n in enumerate(g.node)}
    for node in list(g.node):
        if node.op_type != "DequantizeLinear" or node.input[0] not in fp4:
            continue
        module = node.input[0].removesuffix(".weight")
        matmul = _weight_matmul(node, consumers)
        if matmul is None:
            continue
        if module not in input_scales:
            raise ValueError(f"{module}: no input_scale")
        scale = g.initializer.add()
        scale.CopyFrom(numpy_helper.from_array(np.array(positive_scale(input_scales[module]), np.float32),
                                               f"{module}.input_scale"))
        x, prefix = matmul.input[0], f"{matmul.name}/input_quantizer"
        quantized, block_scale_fp8 = f"{prefix}/x_fp4", f"{prefix}/x_scale_fp8"
        nodes = [
            helper.make_node(DYNAMIC_QUANTIZE, [x, scale.name], [quantized, block_scale_fp8],
                             name=f"{prefix}/{DYNAMIC_QUANTIZE}", domain=TRT_DOMAIN, axis=-1, block_size=BLOCK,
                             scale_type=TensorProto.FLOAT8E4M3FN),
            helper.make_node("DequantizeLinear", [block_scale_fp8, scale.name], [f"{prefix}/x_scale"],
                             name=f"{prefix}/DequantizeLinear"),
            helper.make_node("DequantizeLinear", [quantized, f"{prefix}/x_scale"], [f"{prefix}/x_dq"],
                             name=f"{prefix}/DequantizeLinear_1", axis=-1, block_size=BLOCK),
            # DequantizeLinear yields the scale's type (fp32); back to the activation's dtype
            helper.make_node("CastLike", [f"{prefix}/x_dq", x], [f"{prefix}/x"], name=f"{prefix}/CastLike"),
        ]
        matmul.input[0] = f"{prefix}/x"
        inserts.setdefault(positions[id(matmul)], []).extend(nodes)
    ordered = []
    for i, node in enumerate(g.node):
        ordered.extend(inserts.get(i, []))
        ordered.append(node)
    del g.node[:]
    g.node.extend(ordered)
    if inserts and not any(o.domain == TRT_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(TRT_DOMAIN, 1))
    return model


def _weight_matmul(dequantize: onnx.NodeProto, consumers) -> onnx.NodeProto | None:
    """The MatMul that multiplies by this dequantized weight (through Transpose / CastLike / Cast)."""
    value = dequantize.output[0]
    for _ in range(4):
        users = consumers.get(value, [])
        if len(users) != 1:
            return None
        user = users[0]
        if user.op_type == "MatMul" and list(user.input).index(value) == 1:
            return user
        if user.op_type not in ("Transpose", "CastLike", "Cast"):
            return None
        value = user.output[0]
    return None


def reference_ops() -> list[type]:
    """The custom ops of W4A4 graphs for `onnx.reference.ReferenceEvaluator(model, new_ops=...)`."""
    import ml_dtypes  # noqa: PLC0415 - onnx's own dependency for its float8 / float4 types
    from onnx.reference.op_run import OpRun  # noqa: PLC0415

    class TRT_FP4DynamicQuantize(OpRun):  # noqa: N801 - the op's name
        op_domain = TRT_DOMAIN

        def _run(self, x, double_quant_scale, axis=-1, block_size=BLOCK, scale_type=TensorProto.FLOAT8E4M3FN):
            if axis not in (-1, x.ndim - 1) or block_size != BLOCK or scale_type != TensorProto.FLOAT8E4M3FN:
                raise NotImplementedError("only axis=-1, block_size=16, FLOAT8E4M3FN scales (ModelOpt's NVFP4)")
            f32 = np.float32
            blocks = x.astype(f32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
            # The FP4 kernels are given the reciprocal of the per-tensor scale ("global scale").
            global_scale = f32(1.0) / f32(np.asarray(double_quant_scale).reshape(()))
            amax = np.abs(blocks).max(axis=-1, keepdims=True)
            block_scale = (global_scale * (amax * f32(1.0 / 6.0))).astype(f32)
            block_scale = np.clip(block_scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
            sf = block_scale.astype(f32)
            with np.errstate(divide="ignore"):
                inverse = np.where(sf == 0, f32(0), f32(1.0) / (sf * (f32(1.0) / global_scale))).astype(f32)
            scaled = np.clip((blocks * inverse).astype(f32), -6.0, 6.0)
            codes = scaled.astype(ml_dtypes.float4_e2m1fn).reshape(x.shape)
            return codes, block_scale.reshape(*x.shape[:-1], x.shape[-1] // BLOCK)

    return [TRT_FP4DynamicQuantize]
