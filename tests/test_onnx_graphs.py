"""ONNX drafter graphs: valid models, plugin nodes as
docs/runtimes.md#tensorrt-onnx-parser-plugin-or-local-function describes them, local
functions that ARE what ONNX Runtime runs, and step-by-step parity with the reference drafter."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import AttributeProto, TensorProto
from onnx.reference import ReferenceEvaluator

from eagle31_export.export import onnx_plugins as P
from eagle31_export.export.onnx_export import OnnxExportOptions, export_onnx
from eagle31_export.export.onnx_graph import OPSET, ExternalWeights, GraphBuilder
from factories import drafter_config_for, random_drafter, without_padding
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from eagle31_export.formats.target.checkpoint import load_causal_lm
from eagle31_export.reference.attention import KVCache
from eagle31_export.reference.drafter import build_drafter
from eagle31_export.reference.ops import fc_norm_fusion, post_norm_feedback


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, eagle31_dir, llama_target):
    return export_onnx(eagle31_dir, tmp_path_factory.mktemp("onnx") / "out", llama_target,
                       OnnxExportOptions(chain_depth=3))


@pytest.fixture(scope="module")
def target_model(llama_target):
    return load_causal_lm(llama_target)


def graphs(folder):
    return sorted(folder.glob("*.onnx"))


def run_ort(path, feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, without_padding(feeds))))


def empty_past(layers, heads, key_dim, value_dim, dtype=np.float32):
    feeds = {}
    for i in range(layers):
        feeds[f"past_key_{i}"] = np.zeros((1, heads, 0, key_dim), dtype)
        feeds[f"past_value_{i}"] = np.zeros((1, heads, 0, value_dim), dtype)
    return feeds


def test_export_folder_layout(export_dir):
    names = {p.name for p in export_dir.iterdir()}
    assert {"drafter_first.onnx", "drafter_next.onnx", "drafter_chain.onnx", "drafter.onnx.data",
            "target.onnx", "target.onnx.data", "drafter_d2t.safetensors", "graphs.json", "manifest.json"} <= names
    assert not list(export_dir.parent.glob(".out.tmp-*"))  # the temporary folder was renamed, not left


def test_every_graph_passes_the_full_checker(export_dir):
    for path in graphs(export_dir):
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
        assert {o.domain: o.version for o in model.opset_import}[""] >= 23
        # weights live in the shared external-data files, not inside the protobuf
        assert path.stat().st_size < 200_000


def test_plugin_nodes_follow_the_tensorrt_parser_rules(export_dir):
    """docs/runtimes.md#tensorrt-onnx-parser-plugin-or-local-function:
    op_type == plugin name, string attributes plugin_namespace and
    plugin_version, and a model-local function of the same domain and name as the fallback."""
    seen = set()
    for path in graphs(export_dir):
        model = onnx.load(str(path), load_external_data=False)
        functions = {(f.domain, f.name): f for f in model.functions}
        for node in model.graph.node:
            if node.domain != P.DOMAIN:
                continue
            seen.add((path.name, node.op_type))
            assert node.op_type in P.PLUGINS
            attrs = {a.name: a for a in node.attribute}
            for key, value in (("plugin_namespace", P.PLUGIN_NAMESPACE), ("plugin_version", P.PLUGIN_VERSION)):
                assert attrs[key].type == AttributeProto.STRING and attrs[key].s.decode() == value
            function = functions[(node.domain, node.op_type)]
            assert function.domain == node.domain
            spec = P.PLUGINS[node.op_type]
            assert set(function.attribute) == set(spec.attributes)
            assert set(attrs) == set(spec.attributes) | {"plugin_namespace", "plugin_version"}
            assert attrs["eps"].type == AttributeProto.FLOAT and attrs["eps"].f == pytest.approx(1e-6)
            if node.op_type == "Eagle31FcNorm":
                assert attrs["has_norm"].i == 1 and attrs["num_sources"].i == len(node.input) - 1 == 3
            else:
                assert attrs["norm_output"].i == 1 and len(node.output) == 2
    assert ("drafter_first.onnx", "Eagle31FcNorm") in seen and ("drafter_first.onnx", "Eagle31PostNormFeedback") in seen
    assert ("drafter_next.onnx", "Eagle31PostNormFeedback") in seen
    assert ("drafter_next.onnx", "Eagle31FcNorm") not in seen  # later steps take the fed-back state: no fc
    assert ("drafter_chain.onnx", "Eagle31FcNorm") in seen


def test_onnxruntime_runs_the_local_functions(export_dir, tmp_path):
    """Without model.functions ONNX Runtime cannot load the graph: the functions are what runs."""
    copy = shutil.copytree(export_dir, tmp_path / "copy")
    model = onnx.load(str(copy / "drafter_first.onnx"), load_external_data=False)
    ort.InferenceSession(str(copy / "drafter_first.onnx"), providers=["CPUExecutionProvider"])  # loads as exported
    del model.functions[:]
    onnx.save(model, str(copy / "no_functions.onnx"))
    with pytest.raises(Exception, match="Eagle31"):
        ort.InferenceSession(str(copy / "no_functions.onnx"), providers=["CPUExecutionProvider"])


def _single_node_model(node_fn, inputs, outputs):
    """One plugin node plus its local function, run by ONNX Runtime; `outputs` name -> shape."""
    g = GraphBuilder("plugin", ExternalWeights(".", "unused.data", inline_below=1 << 30))
    names = [g.input(n, TensorProto.FLOAT, list(a.shape)) for n, a in inputs.items()]
    result = node_fn(g, names)
    result = result if isinstance(result, tuple) else (result,)
    for value, (name, shape) in zip(result, outputs.items()):
        g.output(value, name, TensorProto.FLOAT, shape)
    model = g.model(P.plugin_functions(g))
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.numpy() for k, v in inputs.items()})


@pytest.mark.parametrize("has_norm", [True, False])
def test_fc_norm_function_matches_the_reference_op(has_norm):
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 5, 16, generator=gen) * (i + 1) for i in range(3)]
    fc = torch.randn(8, 48, generator=gen)
    norms = [1 + torch.rand(16, generator=gen) for _ in range(3)] if has_norm else None
    from eagle31_export.kernels.folding import fold_fc_norm_weights

    folded = fold_fc_norm_weights(fc, norms, 3)
    inputs = {f"s{i}": s for i, s in enumerate(sources)} | {"w": folded}
    (got,) = _single_node_model(lambda g, n: P.fc_norm(g, n[:3], n[3], 1e-6, has_norm), inputs, {"y": [2, 5, 8]})
    want = fc_norm_fusion(sources, fc, norms, 1e-6)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_output", [True, False])
def test_post_norm_feedback_function_matches_the_reference_op(norm_output):
    gen = torch.Generator().manual_seed(1)
    residual, update, weight = torch.randn(2, 3, 32, generator=gen), torch.randn(2, 3, 32, generator=gen), \
        1 + torch.rand(32, generator=gen)
    got = _single_node_model(lambda g, n: P.post_norm_feedback(g, n[0], n[1], n[2], 1e-6, norm_output),
                             {"r": residual, "u": update, "w": weight},
                             {"normed": [2, 3, 32], "fed_back": [2, 3, 32]})
    normed, fed_back = post_norm_feedback(residual, update, weight, 1e-6, norm_output)
    np.testing.assert_allclose(got[0], normed.numpy(), atol=1e-6)
    np.testing.assert_allclose(got[1], fed_back.numpy(), atol=1e-6)


VARIANTS = {
    "eagle3": dict(),
    "eagle31": dict(fc_norm=True, norm_output=True),
    "eagle31-mla": dict(fc_norm=True, norm_output=True, mla=True),
    # Kimi K2's rope: yarn with mscale (cos/sin factor and softmax scale), short original context
    "eagle31-mla-yarn": dict(fc_norm=True, norm_output=True, mla=True, rope_theta=50000.0, rope_scaling={
        "type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16}),
    "norm_before_fc": dict(norm_before_fc=True),
    "norm_before_residual-5taps": dict(norm_before_residual=True, aux_layer_ids=(0, 1, 3, 5, 7)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_drafter_steps_match_the_reference(variant, tmp_path, llama_info, llama_target, target_model):
    """First step, two fed-back steps and the chain graph against the reference, fp32: logits and
    fed-back state within 1e-4, past + new KV entries equal to the reference cache."""
    cfg = drafter_config_for(llama_info, **VARIANTS[variant])
    fmt = "speculators" if cfg.norm_before_fc else "specforge"  # SpecForge has no norm_before_fc
    folder = write_drafter(random_drafter(cfg, seed=3), tmp_path / "drafter", fmt)
    out = export_onnx(folder, tmp_path / "onnx", llama_target, OnnxExportOptions(chain_depth=3))
    ref = build_drafter(read_drafter(folder), target_model=target_model)
    heads, kd, vd = (cfg.num_attention_heads, cfg.mla.qk_head_dim, cfg.mla.v_head_dim) if cfg.mla else \
        (cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
    gen = torch.Generator().manual_seed(5)
    ids, positions = torch.randint(0, cfg.vocab_size, (1, 6), generator=gen), torch.arange(6).unsqueeze(0)
    aux = torch.randn(1, 6, cfg.fc_in_features, generator=gen)
    cache = KVCache()
    with torch.no_grad():
        want = ref(ids, positions, aux, cache, True)
    feeds = {"input_ids": ids.numpy(), "position_ids": positions.numpy(), "aux_hidden_states": aux.numpy(),
             **empty_past(cfg.num_layers, heads, kd, vd)}
    got = run_ort(out / "drafter_first.onnx", feeds)
    np.testing.assert_allclose(got["logits"], want.logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["fed_back_hidden"], want.fed_back.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got["target_token_ids"], ref.draft_to_target(want.logits.argmax(-1)).numpy())
    chain = run_ort(out / "drafter_chain.onnx", feeds)
    chain_tokens, fed = [int(got["target_token_ids"][0, -1])], got["fed_back_hidden"][:, -1:]
    kv = {f"{kind}_{i}": got[f"new_{kind}_{i}"] for i in range(cfg.num_layers) for kind in ("key", "value")}
    for step in range(1, 3):
        token, position = torch.tensor([[chain_tokens[-1]]]), torch.tensor([[5 + step]])
        with torch.no_grad():
            want = ref(token, position, want.fed_back[:, -1:], cache, False)
        step_feeds = {"input_ids": token.numpy(), "position_ids": position.numpy(), "hidden_states": fed}
        step_feeds.update({f"past_{name}": cached for name, cached in kv.items()})
        nxt = run_ort(out / "drafter_next.onnx", step_feeds)
        kv = {name: np.concatenate([cached, nxt[f"new_{name}"]], axis=2) for name, cached in kv.items()}
        np.testing.assert_allclose(nxt["logits"], want.logits.numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(nxt["fed_back_hidden"], want.fed_back.numpy(), atol=1e-4, rtol=0)
        assert nxt["new_key_0"].shape[2] == 1  # this call's entry only
        np.testing.assert_allclose(kv["key_0"], cache.keys[0].numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(kv["value_0"], cache.values[0].numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(chain["draft_logits"][:, step], want.logits[:, -1].numpy(), atol=1e-4, rtol=0)
        fed = nxt["fed_back_hidden"]
        chain_tokens.append(int(nxt["target_token_ids"][0, -1]))
    assert chain["draft_token_ids"][0].tolist() == chain_tokens
    assert chain["new_key_0"].shape[2] == 6  # the chain returns its first step's entries only


def test_fp16_graphs_run_on_onnxruntime(tmp_path, eagle31_dir, llama_target, target_model):
    out = export_onnx(eagle31_dir, tmp_path / "fp16", llama_target, OnnxExportOptions(dtype=torch.float16))
    model = onnx.load(str(out / "drafter_first.onnx"), load_external_data=False)
    assert model.graph.input[2].type.tensor_type.elem_type == TensorProto.FLOAT16
    ref = build_drafter(read_drafter(eagle31_dir), dtype=torch.float16, target_model=target_model)
    aux = torch.randn(1, 4, ref.cfg.fc_in_features, generator=torch.Generator().manual_seed(2))
    ids, positions = torch.tensor([[3, 1, 4, 1]]), torch.arange(4).unsqueeze(0)
    with torch.no_grad():
        want = ref(ids, positions, aux.half(), KVCache(), True)
    got = run_ort(out / "drafter_first.onnx", {"input_ids": ids.numpy(), "position_ids": positions.numpy(),
                                                "aux_hidden_states": aux.half().numpy(),
                                                **empty_past(1, 2, 16, 16, np.float16)})
    np.testing.assert_allclose(got["logits"].astype(np.float32), want.logits.float().numpy(), atol=2e-2)


def test_bf16_graphs_run_in_the_onnx_reference_evaluator(tmp_path, eagle31_dir, llama_target, target_model):
    """bf16 graphs (for TensorRT) have no ONNX Runtime CPU kernels; onnx.reference runs them."""
    import ml_dtypes

    out = export_onnx(eagle31_dir, tmp_path / "bf16", llama_target, OnnxExportOptions(dtype=torch.bfloat16))
    onnx.checker.check_model(str(out / "drafter_first.onnx"), full_check=True)
    ref = build_drafter(read_drafter(eagle31_dir), dtype=torch.bfloat16, target_model=target_model)
    aux = torch.randn(1, 3, ref.cfg.fc_in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    ids, positions = torch.tensor([[3, 1, 4]]), torch.arange(3).unsqueeze(0)
    with torch.no_grad():
        want = ref(ids, positions, aux, KVCache(), True)
    evaluator = ReferenceEvaluator(onnx.load(str(out / "drafter_first.onnx")))
    feeds = {"input_ids": ids.numpy(), "position_ids": positions.numpy(),
             "aux_hidden_states": aux.float().numpy().astype(ml_dtypes.bfloat16),
             **empty_past(1, 2, 16, 16, ml_dtypes.bfloat16)}
    logits = evaluator.run(["logits"], without_padding(feeds))[0]
    assert logits.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(logits.astype(np.float32), want.logits.float().numpy(), atol=0.1)
    assert (logits.astype(np.float32).argmax(-1) == want.logits.float().argmax(-1).numpy()).mean() > 0.6


def test_graphs_json_describes_every_graph(export_dir):
    import json

    meta = json.loads((export_dir / "graphs.json").read_text())
    assert meta["opset"] == OPSET and meta["dtype"] == "fp32" and meta["plugins"]["plugin_namespace"] == "eagle31"
    first = meta["drafter"]["graphs"]["first"]
    assert [i["name"] for i in first["inputs"]] == ["input_ids", "position_ids", "aux_hidden_states",
                                                    "past_key_0", "past_value_0", "attention_mask"]
    assert first["inputs"][2]["shape"] == ["batch", "sequence", 192]
    assert [o["name"] for o in first["outputs"]][:3] == ["logits", "target_token_ids", "fed_back_hidden"]
    assert meta["drafter"]["graphs"]["chain"]["depth"] == 3
    assert meta["drafter"]["aux_layer_ids"] == [1, 3, 4] == meta["target"]["aux_layer_ids"]
    assert meta["target"]["kv_cache"] == {**meta["target"]["kv_cache"], "layers": 8, "heads": 2, "key_dim": 16}
    assert meta["source"]["drafter"].endswith("eagle31-specforge") and meta["source"]["target"].endswith("llama")
    for role in ("first", "next", "chain"):
        assert (export_dir / meta["drafter"]["graphs"][role]["file"]).is_file()


def test_batch_axis_is_dynamic(export_dir):
    """Two identical rows give the batch-1 result twice (rows of equal length; no padding mask)."""
    gen = torch.Generator().manual_seed(9)
    feeds = {"input_ids": torch.randint(0, 256, (1, 4), generator=gen).numpy(),
             "position_ids": np.arange(4)[None], "aux_hidden_states": torch.randn(1, 4, 192, generator=gen).numpy(),
             **empty_past(1, 2, 16, 16)}
    single = run_ort(export_dir / "drafter_first.onnx", feeds)
    double = run_ort(export_dir / "drafter_first.onnx", {k: np.concatenate([v, v]) for k, v in feeds.items()})
    for name in ("logits", "fed_back_hidden", "new_key_0"):
        np.testing.assert_allclose(double[name], np.concatenate([single[name]] * 2), atol=1e-5)


def test_positions_past_the_rope_table_are_a_user_error(export_dir):
    from eagle31_export.errors import UserError
    from eagle31_export.runtime.onnxruntime import load_backends

    target, drafter = load_backends(export_dir)
    with pytest.raises(UserError, match="--max-positions"):
        drafter.forward(torch.tensor([[1]]), torch.tensor([[512]]), torch.zeros(1, 1, 192), True)
