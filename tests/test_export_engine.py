"""`export engine`: one clear line where TensorRT is missing or cannot build what was exported; profiles
sized from named dimensions and serving limits; the memory estimate printed and checked; against
stand-ins that have exactly the Python API of TensorRT 10.0, 10.8 and 11.1 (tests/tensorrt_stand_in.py)."""

import json
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from eagle31_export.formats.outputs import write_manifest
from tensorrt_stand_in import stand_in

KV = 2 * 8 * 4  # heads x head_dim x float32 bytes of one cached position


def write_export(folder, flavor="tensorrt", quantized=False, mask_dim="present_sequence", max_positions=64):
    """A minimal export: graphs.json and two graphs with the project's named dimensions."""
    folder.mkdir()
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    past = helper.make_tensor_value_info("past_key_0", TensorProto.FLOAT, ["batch", 2, "past_sequence", 8])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", mask_dim])
    new = helper.make_tensor_value_info("new_key", TensorProto.FLOAT, ["batch", 2, "sequence", 8])
    present = helper.make_tensor_value_info("present_key_0", TensorProto.FLOAT, ["batch", 2, "present_sequence", 8])
    ids_out = helper.make_tensor_value_info("ids_out", TensorProto.INT64, ["batch", "sequence"])
    nodes = [helper.make_node("Concat", ["past_key_0", "new_key"], ["present_key_0"], axis=2),
             helper.make_node("Identity", ["input_ids"], ["ids_out"])]
    for name in ("target", "drafter_next"):
        graph = helper.make_graph(nodes, name, [ids, past, new, mask], [present, ids_out],
                                  [numpy_helper.from_array(np.ones(4, np.float32), "w")])
        onnx.save(helper.make_model(graph), folder / f"{name}.onnx")
    meta = {"dtype": "fp32", "flavor": flavor,
            "drafter": {"graphs": {"next": {"file": "drafter_next.onnx"}}, "max_positions": max_positions},
            "target": {"file": "target.onnx", "max_positions": max_positions,
                       "quantization": {"algo": "NVFP4", "modules": 1, "flavor": flavor} if quantized else None}}
    (folder / "graphs.json").write_text(json.dumps(meta))
    write_manifest(folder)  # an export as `export onnx` writes it: `export engine` checks what it consumes
    return folder


@pytest.fixture
def onnx_dir(tmp_path):
    return write_export(tmp_path / "onnx")


def test_missing_tensorrt_is_one_line_exit_2(monkeypatch, cli, tmp_path, onnx_dir):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails, as on machines without it
    code, out, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--device-memory", "80")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "TensorRT is not installed" in err and "pip install tensorrt" in err
    assert "profile decode" in out  # the plan is said before TensorRT is needed
    assert not (tmp_path / "e").exists()


def test_bad_arguments(cli, tmp_path, onnx_dir):
    code, _, err = cli("export", "engine", "--onnx", tmp_path / "none", "--out", tmp_path / "e")
    assert code == 2 and "export onnx" in err
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--fp16", "--bf16")
    assert code == 2 and "at most one of" in err
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--max-seq-len", "65", "--plan")
    assert code == 2 and "64 positions" in err and "--max-positions" in err


def test_an_unknown_dimension_name_is_refused(cli, tmp_path):
    folder = write_export(tmp_path / "onnx", mask_dim="kv_length")
    code, _, err = cli("export", "engine", "--onnx", folder, "--out", tmp_path / "e", "--plan")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'kv_length'" in err


def test_an_onnxruntime_flavour_nvfp4_export_is_refused_naming_the_tensorrt_flavour(cli, tmp_path):
    folder = write_export(tmp_path / "onnx", flavor="onnxruntime", quantized=True)
    code, _, err = cli("export", "engine", "--onnx", folder, "--out", tmp_path / "e", "--plan")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--flavor tensorrt" in err and "BitShift" in err


def set_shapes(trt):
    return {c[1]: c[2:] for c in trt.calls if c[0] == "set_shape"}


@pytest.mark.parametrize("release", ["10.0", "10.8", "11.1"])
def test_profiles_from_named_dims_and_serving_limits(monkeypatch, cli, tmp_path, onnx_dir, release):
    trt = stand_in(release)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    code, out, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--max-batch", "8",
                         "--max-seq-len", "64", "--draft-depth", "3", "--device-memory", "80")
    assert code == 0, err
    shapes = [c[1:] for c in trt.calls if c[0] == "set_shape"]
    # target: prefill (whole prompt, empty cache) then decode (depth + 1 tokens on up to 63 cached)
    assert ("past_key_0", [1, 2, 0, 8], [1, 2, 0, 8], [8, 2, 0, 8]) in shapes
    assert ("input_ids", [1, 1], [1, 64], [8, 64]) in shapes
    assert ("input_ids", [1, 1], [8, 4], [8, 4]) in shapes
    assert ("past_key_0", [1, 2, 0, 8], [8, 2, 32, 8], [8, 2, 63, 8]) in shapes
    # the mask spans past + new tokens
    assert ("attention_mask", [1, 1], [8, 36], [8, 67]) in shapes
    # drafter_next: one token per call
    assert ("input_ids", [1, 1], [8, 1], [8, 1]) in shapes
    assert sum(c[0] == "add_optimization_profile" for c in trt.calls) == 3  # target 2, drafter_next 1
    record = json.loads((tmp_path / "e" / "engines.json").read_text())
    assert record["strongly_typed"] is (release == "11.1")
    assert [p["name"] for p in record["engines"]["target.onnx"]["profiles"]] == ["prefill", "decode"]
    # the estimate: at most the two caches of the decode profile's largest shape, and the mask, are alive
    assert "profile decode (batch 1..8..8, sequence 1..4..4, past_sequence 0..32..63)" in out


def test_tensorrt_11_has_no_precision_flags(monkeypatch, cli, tmp_path, onnx_dir):
    """TensorRT 11's BuilderFlag has no FP16 (pyCore.cpp 11.1): the graphs' dtype is the precision."""
    trt = stand_in("11.1")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--fp16",
                       "--device-memory", "80")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "strongly typed" in err and "--dtype fp16" in err
    assert not (tmp_path / "e").exists()
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--device-memory", "80")
    assert code == 0, err
    assert not [c for c in trt.calls if c[0] == "set_flag"]


def test_tensorrt_10_sets_the_precision_flag(monkeypatch, cli, tmp_path, onnx_dir):
    trt = stand_in("10.8")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    library = tmp_path / "libeagle31_plugins.so"
    library.write_bytes(b"\x7fELF")
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--plugins", library,
                       "--fp16", "--device-memory", "80")
    assert code == 0, err
    assert trt.calls[1] == ("init_libnvinfer_plugins", "")
    assert ("load_library", str(library)) in trt.calls
    assert ("set_flag", "BuilderFlag.FP16") in trt.calls
    assert ("parse_from_file", str(onnx_dir / "target.onnx")) in trt.calls
    record = json.loads((tmp_path / "e" / "engines.json").read_text())
    assert record["precision"] == "fp16" and record["eagle31_plugins_registered"] == [
        "eagle31::Eagle31FcNorm", "eagle31::Eagle31PostNormFeedback"]
    assert (tmp_path / "e" / "target.engine").read_bytes() == b"ENGINE"


def test_memory_beyond_the_device_is_refused_with_the_estimate(cli, tmp_path, onnx_dir):
    code, out, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--max-batch", "64",
                         "--max-seq-len", "64", "--workspace", "0", "--device-memory", "0.0001")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "exceeds" in err and "--max-batch" in err and "activations" in err
    assert "activations about" in out
    assert not (tmp_path / "e").exists()


def test_plugins_on_a_parser_that_prefers_local_functions_warn(monkeypatch, cli, tmp_path):
    folder = write_export(tmp_path / "onnx")
    model = onnx.load(folder / "drafter_next.onnx")
    model.graph.node.append(helper.make_node("Eagle31PostNormFeedback", ["ids_out"], ["unused"], domain="eagle31",
                                             plugin_namespace="eagle31"))
    model.opset_import.append(helper.make_opsetid("eagle31", 1))
    onnx.save(model, folder / "drafter_next.onnx")
    write_manifest(folder)
    monkeypatch.setitem(sys.modules, "tensorrt", stand_in("10.1"))
    code, _, err = cli("export", "engine", "--onnx", folder, "--out", tmp_path / "e", "--device-memory", "80")
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "10.7" in warning[0] and "model-local functions" in warning[0]
    monkeypatch.setitem(sys.modules, "tensorrt", stand_in("10.8"))
    code, _, err = cli("export", "engine", "--onnx", folder, "--out", tmp_path / "e2", "--device-memory", "80")
    assert code == 0 and "warning" not in err, err


def test_missing_plugin_library(monkeypatch, cli, tmp_path, onnx_dir):
    monkeypatch.setitem(sys.modules, "tensorrt", stand_in("10.8"))
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e",
                       "--plugins", tmp_path / "missing.so", "--device-memory", "80")
    assert code == 2 and "plugin library not found" in err
    assert not (tmp_path / "e").exists()


def test_the_exported_graphs_are_sized_in_full_and_refused_above_the_device(cli, tmp_path):
    """The tiny pair's real graphs (NVFP4 target, W4A4 flavour, chain): shape inference sizes every value
    at every profile's largest shape, so the estimate is not a bound from guesses, and a device too small
    for it refuses the build in one line."""
    from pathlib import Path

    pair = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models"
    code, _, err = cli("export", "onnx", "--drafter", pair / "drafter-eagle31", "--target", pair / "target-nvfp4",
                       "--flavor", "tensorrt-w4a4", "--chain-depth", "3", "--out", tmp_path / "onnx")
    assert code == 0, err
    code, out, err = cli("export", "engine", "--onnx", tmp_path / "onnx", "--out", tmp_path / "e", "--plan",
                         "--max-batch", "8", "--device-memory", "80")
    assert code == 0, err
    assert out.count("profile prefill") == 3 and out.count("profile decode") == 4  # target, first, chain; + next
    assert "upper bound" not in out
    assert "attention/MatMul [8, 2, 3072, 1024]" in out  # batch 8 x (2 query heads per KV head x 1024 tokens)
    code, _, err = cli("export", "engine", "--onnx", tmp_path / "onnx", "--out", tmp_path / "e", "--plan",
                       "--max-batch", "8", "--device-memory", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "exceeds 2.00 GiB" in err, err


def test_an_export_changed_since_it_was_written_is_refused_naming_the_file(cli, tmp_path, onnx_dir):
    graph = onnx_dir / "target.onnx"
    raw = bytearray(graph.read_bytes())
    raw[-1] ^= 1
    graph.write_bytes(bytes(raw))
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--plan")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "target.onnx" in err, err


def _graph_with_a_custom_op(folder, named_output_shape):
    """A target graph whose custom op (domain `custom`, unknown to shape inference) writes a [4, 64, 1024]
    fp32 value, consumed by a Relu; `named_output_shape`: whether the graph declares that value's shape."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Expand", ["input_ids", "shape"], ["wide"], name="widen"),
             helper.make_node("Widen", ["wide"], ["custom_out"], domain="custom", name="custom"),
             helper.make_node("Relu", ["custom_out"], ["out"])]
    shape = numpy_helper.from_array(np.array([64, 1, 1], np.int64), "shape")
    graph = helper.make_graph(nodes, "target", [ids], [out], [shape])
    if named_output_shape:
        graph.value_info.append(helper.make_tensor_value_info("custom_out", TensorProto.FLOAT, [4, 64, 1024]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])
    onnx.save(model, folder / "target.onnx")
    write_manifest(folder)


def test_a_value_shape_inference_cannot_size_makes_the_estimate_a_lower_bound(cli, tmp_path):
    """A custom op's [64, 1024] fp32 output has no inferred shape: it and what is computed from it count 0
    bytes, so the plan calls the estimate a lower bound, never an upper one; declared, the same value is
    counted (4 x 64 x 1024 x 4 bytes) and the plan is plain."""
    from eagle31_export.export.tensorrt_profiles import ServingLimits, plan_graph

    folder = write_export(tmp_path / "onnx")
    _graph_with_a_custom_op(folder, named_output_shape=False)
    code, out, err = cli("export", "engine", "--onnx", folder, "--out", tmp_path / "e", "--plan",
                         "--max-batch", "4", "--max-seq-len", "64", "--device-memory", "80")
    assert code == 0, err
    assert "lower bound" in out and "upper bound" not in out, out
    assert "custom_out, made by custom.Widen" in out, out
    limits = ServingLimits(max_batch=4, max_seq_len=64, draft_depth=3)
    unsized = plan_graph(folder / "target.onnx", "target", limits)
    assert all(p.lower_bound and p.shapeless == 2 for p in unsized.profiles)
    _graph_with_a_custom_op(folder, named_output_shape=True)
    sized = plan_graph(folder / "target.onnx", "target", limits)
    for before, after in zip(unsized.profiles, sized.profiles):
        assert not after.lower_bound and after.bound() == ""
        # the declared value and the Relu's output it feeds, live together, now count
        assert after.activation_bytes == 2 * 4 * 64 * 1024 * 4 > before.activation_bytes


def test_a_graph_whose_computed_values_cannot_be_sized_is_refused(cli, tmp_path):
    folder = write_export(tmp_path / "onnx")
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Widen", ["input_ids"], ["out"], domain="custom")], "target", [ids],
                              [out])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)]),
              folder / "target.onnx")
    write_manifest(folder)
    code, _, err = cli("export", "engine", "--onnx", folder, "--out", tmp_path / "e", "--plan", "--device-memory", "80")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "cannot be estimated" in err, err
