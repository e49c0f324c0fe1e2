"""`export onnx --flavor tensorrt-w4a4`: every quantized Linear's input goes through ModelOpt's
TRT_FP4DynamicQuantize -> DequantizeLinear x2 form, and what those nodes compute (run by
onnx.reference with our TRT_FP4DynamicQuantize) is the W4A4 reference's activation quantization
(formats/nvfp4/numerics.py: fake_quant_activation, what `parity --act-quant` runs) bit for bit; the graph's
greedy decisions equal the W4A4 reference target's. A zero scale is written as ModelOpt writes it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from eagle31_export.export import onnx_nvfp4 as Q
from eagle31_export.export import onnx_w4a4 as W
from eagle31_export.export.onnx_export import OnnxExportOptions, export_onnx
from eagle31_export.formats.drafter.checkpoint import write_drafter
from eagle31_export.formats.nvfp4.numerics import fake_quant_activation
from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint
from eagle31_export.formats.target.checkpoint import load_causal_lm, read_target_info
from eagle31_export.reference.target import ReferenceTarget
from factories import drafter_config_for, make_target, random_drafter

LAYERS = 4


@pytest.fixture(scope="module")
def w4a4(tmp_path_factory):
    quantize_checkpoint = pytest.importorskip("eagle31_export.formats.target.quantize").quantize_checkpoint
    tmp = tmp_path_factory.mktemp("w4a4")
    plain = make_target(tmp / "plain", "llama", seed=6, num_layers=LAYERS)
    target = quantize_checkpoint(plain, tmp / "modelopt", "modelopt").out
    drafter = write_drafter(random_drafter(drafter_config_for(read_target_info(target)), seed=1), tmp / "d", "specforge")
    out = export_onnx(drafter, tmp / "onnx", target, OnnxExportOptions(flavor=W.W4A4))
    return target, onnx.load(str(out / "target.onnx"))


def feeds(model, ids):
    """A prefill on an empty cache (and an all-ones mask where the graph takes one)."""
    past = {f"past_{kv}_{i}": np.zeros((1, 2, 0, 16), np.float32) for i in range(LAYERS) for kv in ("key", "value")}
    out = {"input_ids": ids, "position_ids": np.arange(ids.shape[1])[None], **past}
    if "attention_mask" in {i.name for i in model.graph.input}:
        out["attention_mask"] = np.ones(ids.shape, np.int64)
    return out


def test_every_quantized_linear_input_is_dynamically_quantized_as_modelopt_writes_it(w4a4):
    target, model = w4a4
    onnx.checker.check_model(model, full_check=True)
    quantizers = [n for n in model.graph.node if n.op_type == W.DYNAMIC_QUANTIZE]
    assert len(quantizers) == 7 * LAYERS and {n.domain for n in quantizers} == {"trt"}
    inits = {t.name: t for t in model.graph.initializer}
    consumers = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    infos = NVFP4Checkpoint.open(target).linears
    for q in quantizers:
        assert {a.name: a.i for a in q.attribute} == {"axis": -1, "block_size": 16,
                                                      "scale_type": TensorProto.FLOAT8E4M3FN}
        module = q.input[1].removesuffix(".input_scale")
        scale = onnx.numpy_helper.to_array(inits[q.input[1]])
        assert scale == np.float32(infos[module].input_scale) and scale > 0
        scale_dq = consumers[q.output[1]][0]
        assert scale_dq.op_type == "DequantizeLinear" and scale_dq.input[1] == q.input[1]
        value_dq = consumers[q.output[0]][0]
        assert value_dq.op_type == "DequantizeLinear" and value_dq.input[1] == scale_dq.output[0]
        assert {a.name: a.i for a in value_dq.attribute} == {"axis": -1, "block_size": 16}


def test_activation_quantization_equals_the_w4a4_reference_bit_for_bit(w4a4):
    """The FP4 values and FP8 block scales TRT_FP4DynamicQuantize yields (what an FP4 GEMM consumes)
    are the W4A4 reference's: dequantized in the reference's order they give its output bit for bit
    (zeros compared without their sign: E2M1's -0 decodes to +0 in formats/nvfp4/numerics.py). The graph's own
    DequantizeLinear product (block scale x input_scale, where the reference divides by 1 / input_scale)
    may round the last bit differently."""
    target, model = w4a4
    infos = NVFP4Checkpoint.open(target).linears
    evaluator = ReferenceEvaluator(model, new_ops=W.reference_ops())
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3)).numpy()
    values = evaluator.run(None, feeds(model, ids), intermediate=True)
    checked, last_bit = 0, 0
    for q in (n for n in model.graph.node if n.op_type == W.DYNAMIC_QUANTIZE):
        module = q.input[1].removesuffix(".input_scale")
        gs = infos[module].input_global_scale
        x = values[q.input[0]]
        expected = fake_quant_activation(torch.from_numpy(x), gs)
        codes = torch.from_numpy(values[q.output[0]].astype(np.float32))
        block = torch.from_numpy(values[q.output[1]].astype(np.float32))
        ours = (codes.reshape(*block.shape, 16) * (block / gs).unsqueeze(-1)).reshape(x.shape) + 0.0
        np.testing.assert_array_equal(ours.numpy().view(np.uint32), (expected + 0.0).numpy().view(np.uint32),
                                      err_msg=module)
        graph_dq = values[q.name.rsplit("/", 1)[0] + "/x"] + np.float32(0.0)
        ulps = np.abs(graph_dq.view(np.int32).astype(np.int64) - (expected + 0.0).numpy().view(np.int32))
        assert ulps.max() <= 2, module
        last_bit += int((ulps > 0).sum())
        checked += x.size
    assert checked > 0 and last_bit < checked


def test_greedy_decisions_equal_the_w4a4_reference_target(w4a4):
    """The decisions `parity --act-quant` compares: the W4A4 reference target's greedy continuation of a
    prompt (16 tokens, decoded one forward at a time), and the graph's argmax at every position of
    prompt + continuation in one call (causal: the same decisions), which must name each next token."""
    target, model = w4a4
    evaluator = ReferenceEvaluator(model, new_ops=W.reference_ops())
    ref = ReferenceTarget(load_causal_lm(target, act_quant=True), (1, 1, 0))
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    ref.reset()
    logits, _ = ref.forward(prompt)
    continuation = [int(logits[0, -1].argmax())]
    while len(continuation) < 16:
        logits, _ = ref.forward(torch.tensor([continuation[-1:]]))
        continuation.append(int(logits[0, -1].argmax()))
    ids = torch.cat([prompt, torch.tensor([continuation[:-1]])], dim=1)
    got = dict(zip(evaluator.output_names, evaluator.run(None, feeds(model, ids.numpy()))))
    assert got["logits"][0, prompt.shape[1] - 1:].argmax(-1).tolist() == continuation
    ref.reset()
    logits, _ = ref.forward(ids)
    np.testing.assert_allclose(got["logits"], logits.numpy(), atol=1e-4, rtol=0)
    w16 = ReferenceTarget(load_causal_lm(target), (1, 1, 0))  # ...and the W4A16 target computes otherwise
    w16.reset()
    assert np.abs(w16.forward(ids)[0].numpy() - got["logits"]).max() > 1e-3


def test_a_zero_scale_becomes_modelopts_one_and_the_weight_stays_zero(tmp_path):
    from eagle31_export.export.onnx_graph import ExternalWeights, GraphBuilder

    zero = Q.Nvfp4Weight(torch.full((4, 8), 0x99, dtype=torch.uint8), torch.zeros(4, 1).to(torch.float8_e4m3fn),
                         torch.tensor(0.0))
    g = GraphBuilder("z", ExternalWeights(tmp_path, "z.data"))
    g.output(Q.dequantized_weight(g, "m", zero, "tensorrt"), "w", TensorProto.FLOAT, [4, 16])
    model = g.model()
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert inits["m.weight_scale_2"] == np.float32(1.0)
    assert (inits["m.weight_scale"].astype(np.float32) == 1.0).all()
    assert (ReferenceEvaluator(model).run(None, {})[0] == 0).all()
    assert W.positive_scale(0.0) == 1.0 and W.positive_scale(0.25) == 0.25


def test_a_weight_only_checkpoint_has_no_w4a4_form(tmp_path, monkeypatch):
    from eagle31_export.errors import UserError

    class Info:
        input_scale = None

    monkeypatch.setattr(NVFP4Checkpoint, "open", classmethod(lambda cls, folder: type("C", (), {
        "linears": {"model.layers.0.mlp.up_proj": Info()}})()))
    with pytest.raises(UserError, match="weight-only NVFP4.*--flavor tensorrt"):
        Q.read_input_scales(tmp_path)
