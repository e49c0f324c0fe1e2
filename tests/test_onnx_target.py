"""ONNX target graphs: logits, tapped states and KV cache against the reference target, for the
Llama and Qwen families, and for NVFP4 checkpoints in both weight flavours."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from eagle31_export.export import onnx_nvfp4 as Q
from eagle31_export.export.onnx_export import OnnxExportOptions, export_onnx
from factories import drafter_config_for, make_target, random_drafter, without_padding
from eagle31_export.formats.drafter.checkpoint import write_drafter
from eagle31_export.formats.target.checkpoint import load_causal_lm, read_target_info
from eagle31_export.reference.target import ReferenceTarget

LAYERS = 4


def export_pair(tmp, target, options=OnnxExportOptions()):
    info = read_target_info(target)
    drafter = write_drafter(random_drafter(drafter_config_for(info), seed=1), tmp / "drafter", "specforge")
    return export_onnx(drafter, tmp / "onnx", target, options)


def target_feeds(ids, start, past):
    return without_padding({"input_ids": ids.numpy(), "position_ids": np.arange(start, start + ids.shape[1])[None],
                            **past})


def empty_past(layers=LAYERS, kv_heads=2, head_dim=16):
    zeros = np.zeros((1, kv_heads, 0, head_dim), np.float32)
    return {f"past_{kv}_{i}": zeros for i in range(layers) for kv in ("key", "value")}


def appended(past, outputs, layers=LAYERS):
    """The cache after a call: its `past_*` feeds with the call's `new_*` entries appended."""
    return {f"past_{kv}_{i}": np.concatenate([past[f"past_{kv}_{i}"], outputs[f"new_{kv}_{i}"]], axis=2)
            for i in range(layers) for kv in ("key", "value")}


def run(runner, feeds):
    if isinstance(runner, ReferenceEvaluator):
        return dict(zip(runner.output_names, runner.run(None, feeds)))
    names = [o.name for o in runner.get_outputs()]
    return dict(zip(names, runner.run(names, feeds)))


def check_against_reference(runner, model, aux_ids, atol=1e-4):
    """A 7-token prefill, then 2 tokens on top of the returned cache, as the speculation loop does."""
    ref = ReferenceTarget(model, aux_ids)
    ref.reset()
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    logits, aux = ref.forward(ids)
    first = empty_past()
    got = run(runner, target_feeds(ids, 0, first))
    np.testing.assert_allclose(got["logits"], logits.numpy(), atol=atol, rtol=0)
    np.testing.assert_allclose(got["aux_hidden_states"], aux.numpy(), atol=atol, rtol=0)
    more = torch.tensor([[5, 9]])
    logits, aux = ref.forward(more)
    past = appended(first, got)
    got = run(runner, target_feeds(more, 7, past))
    np.testing.assert_allclose(got["logits"], logits.numpy(), atol=atol, rtol=0)
    np.testing.assert_allclose(got["aux_hidden_states"], aux.numpy(), atol=atol, rtol=0)
    assert got["new_key_0"].shape[2] == 2  # this call's entries only
    np.testing.assert_allclose(appended(past, got)["past_key_0"], ref.cache.layers[0].keys.numpy(), atol=atol, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_target_graph_matches_the_reference(tmp_path, family):
    target = make_target(tmp_path / family, family, seed=4, num_layers=LAYERS)
    out = export_pair(tmp_path, target)
    onnx.checker.check_model(str(out / "target.onnx"), full_check=True)
    session = ort.InferenceSession(str(out / "target.onnx"), providers=["CPUExecutionProvider"])
    check_against_reference(session, load_causal_lm(target), (1, 1, 0))  # default taps for N=4


@pytest.fixture(scope="module")
def nvfp4_targets(tmp_path_factory):
    """The tiny target quantized by `quantize`, in both checkpoint formats."""
    quantize_checkpoint = pytest.importorskip("eagle31_export.formats.target.quantize").quantize_checkpoint

    tmp = tmp_path_factory.mktemp("nvfp4")
    plain = make_target(tmp / "plain", "llama", seed=6, num_layers=LAYERS)
    return {fmt: quantize_checkpoint(plain, tmp / fmt, fmt).out for fmt in ("modelopt", "compressed-tensors")}


def test_tensorrt_flavour_is_the_modelopt_two_level_dequantize(tmp_path, nvfp4_targets):
    """FP4 weights as FLOAT4E2M1 initializers, DQ(fp8 scale, weight_scale_2) then DQ(fp4, that,
    axis=-1, block_size=16); onnx.reference runs it and matches the (dequantized) reference target."""
    target = nvfp4_targets["modelopt"]
    out = export_pair(tmp_path, target, OnnxExportOptions(flavor="tensorrt"))
    onnx.checker.check_model(str(out / "target.onnx"), full_check=True)
    model = onnx.load(str(out / "target.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    fp4 = [t for t in inits.values() if t.data_type == TensorProto.FLOAT4E2M1]
    assert len(fp4) == 7 * LAYERS  # q, k, v, o, gate, up, down; lm_head stays in high precision
    assert inits["model.layers.0.self_attn.q_proj.weight_scale"].data_type == TensorProto.FLOAT8E4M3FN
    producers = {o: n for n in model.graph.node for o in n.output}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
          and inits[n.input[0]].data_type == TensorProto.FLOAT4E2M1]
    assert len(dq) == len(fp4)
    for node in dq:
        attrs = {a.name: a.i for a in node.attribute}
        assert attrs == {"axis": -1, "block_size": 16}
        scale_dq = producers[node.input[1]]
        assert scale_dq.op_type == "DequantizeLinear"
        assert inits[scale_dq.input[0]].data_type == TensorProto.FLOAT8E4M3FN
        assert scale_dq.input[1].endswith(".weight_scale_2")
    check_against_reference(ReferenceEvaluator(model), load_causal_lm(target), (1, 1, 0))
    # ...and it is exactly what ONNX Runtime's CPU provider cannot run:
    with pytest.raises(Exception, match="NOT_IMPLEMENTED|DequantizeLinear"):
        session = ort.InferenceSession(str(out / "target.onnx"), providers=["CPUExecutionProvider"])
        run(session, target_feeds(torch.tensor([[1]]), 0, empty_past()))


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_onnxruntime_flavour_unpacks_in_a_local_function(tmp_path, nvfp4_targets, fmt):
    target = nvfp4_targets[fmt]
    out = export_pair(tmp_path, target, OnnxExportOptions(flavor="onnxruntime"))
    onnx.checker.check_model(str(out / "target.onnx"), full_check=True)
    model = onnx.load(str(out / "target.onnx"), load_external_data=False)
    assert not [t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT4E2M1]
    packed = {t.name: t for t in model.graph.initializer}["model.layers.0.mlp.down_proj.weight"]
    assert packed.data_type == TensorProto.UINT8 and list(packed.dims) == [64, 64]  # [out, in/2]
    assert [(f.domain, f.name) for f in model.functions] == [(Q.OPS_DOMAIN, Q.DEQUANTIZE)]
    assert sum(n.op_type == Q.DEQUANTIZE for n in model.graph.node) == 7 * LAYERS
    session = ort.InferenceSession(str(out / "target.onnx"), providers=["CPUExecutionProvider"])
    check_against_reference(session, load_causal_lm(target), (1, 1, 0))


def test_both_flavours_dequantize_to_identical_weights(tmp_path, nvfp4_targets):
    """One Linear through both flavours: bit-identical fp32 weights (same DequantizeLinear order)."""
    from eagle31_export.export.onnx_graph import ExternalWeights, GraphBuilder

    weight = next(iter(Q.read_nvfp4_weights(nvfp4_targets["modelopt"]).items()))
    results = []
    for flavor in Q.FLAVORS:
        g = GraphBuilder(flavor, ExternalWeights(tmp_path, f"{flavor}.data", inline_below=1 << 30))
        g.output(Q.dequantized_weight(g, *weight, flavor), "w", TensorProto.FLOAT, list(weight[1].shape))
        model = g.model([Q.dequantize_function()] if flavor == "onnxruntime" else [])
        results.append(ReferenceEvaluator(model).run(None, {})[0])
    from eagle31_export.formats.nvfp4.numerics import dequantize

    want = dequantize(weight[1].packed, weight[1].scale, weight[1].scale_2).numpy()
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], want)
