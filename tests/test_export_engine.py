"""`export engine`: one clear line where TensorRT is missing; with a stand-in TensorRT module, the
build follows the documented sequence (plugins registered, library loaded through the registry,
parse_from_file, precision flag, optimisation profile for dynamic inputs, serialised engine)."""

import json
import sys
import types

import onnx
import pytest
from onnx import TensorProto, helper



@pytest.fixture
def onnx_dir(tmp_path):
    folder = tmp_path / "onnx"
    folder.mkdir()
    x = helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["tokens", 64])
    y = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["tokens", 64])
    graph = helper.make_graph([helper.make_node("Identity", ["hidden"], ["out"])], "g", [x], [y])
    onnx.save(helper.make_model(graph), folder / "drafter_step.onnx")
    return folder


def test_missing_tensorrt_is_one_line_exit_2(monkeypatch, cli, tmp_path, onnx_dir):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails, as on machines without it
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "TensorRT is not installed" in err and "pip install tensorrt" in err
    assert not (tmp_path / "e").exists()


def test_bad_arguments(cli, tmp_path, onnx_dir):
    code, _, err = cli("export", "engine", "--onnx", tmp_path / "none", "--out", tmp_path / "e")
    assert code == 2 and "export onnx" in err
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e", "--fp16", "--bf16")
    assert code == 2 and "at most one of" in err


class FakeTensorRT(types.ModuleType):
    """Records what the builder is asked to do; mirrors the TensorRT 10 Python API surface used."""

    def __init__(self):
        super().__init__("tensorrt")
        self.__version__ = "10.fake"
        self.calls = []
        fake = self

        class Logger:
            WARNING = 2

            def __init__(self, level):
                pass

        class Registry:
            all_creators = [types.SimpleNamespace(name="Eagle31FcNorm", plugin_namespace="eagle31")]

            def load_library(self, path):
                fake.calls.append(("load_library", path))

        class Input:
            name, shape = "hidden", (-1, 64)

        class Network:
            num_inputs = 1

            def get_input(self, i):
                return Input()

        class Parser:
            num_errors = 0

            def __init__(self, network, logger):
                pass

            def parse_from_file(self, path):
                fake.calls.append(("parse_from_file", path))
                return True

        class Profile:
            def set_shape(self, name, lo, opt, hi):
                fake.calls.append(("set_shape", name, lo, opt, hi))

        class Config:
            def set_memory_pool_limit(self, pool, size):
                pass

            def set_flag(self, flag):
                fake.calls.append(("set_flag", flag))

            def add_optimization_profile(self, profile):
                fake.calls.append(("add_optimization_profile",))

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                return Network()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                return b"ENGINE"

        self.Logger, self.Builder, self.OnnxParser = Logger, Builder, Parser
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace()
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)
        self.BuilderFlag = types.SimpleNamespace(FP16="FP16", BF16="BF16", FP8="FP8")
        self.get_plugin_registry = lambda: Registry()
        self.init_libnvinfer_plugins = lambda logger, ns: fake.calls.append(("init_libnvinfer_plugins", ns))


def test_build_sequence_with_a_stand_in_tensorrt(monkeypatch, cli, tmp_path, onnx_dir):
    fake = FakeTensorRT()
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    library = tmp_path / "libeagle31_plugins.so"
    library.write_bytes(b"\x7fELF")
    code, out, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e",
                         "--plugins", library, "--fp16", "--max-tokens", "512")
    assert code == 0, err
    assert fake.calls[0] == ("init_libnvinfer_plugins", "")
    assert ("load_library", str(library)) in fake.calls
    assert ("parse_from_file", str(onnx_dir / "drafter_step.onnx")) in fake.calls
    assert ("set_flag", "FP16") in fake.calls
    assert ("set_shape", "hidden", [1, 64], [64, 64], [512, 64]) in fake.calls
    assert (tmp_path / "e" / "drafter_step.engine").read_bytes() == b"ENGINE"
    record = json.loads((tmp_path / "e" / "engines.json").read_text())
    assert record["precision"] == "fp16" and record["eagle31_plugins_registered"] == ["eagle31::Eagle31FcNorm"]
    assert (tmp_path / "e" / "manifest.json").is_file()


def test_missing_plugin_library(monkeypatch, cli, tmp_path, onnx_dir):
    monkeypatch.setitem(sys.modules, "tensorrt", FakeTensorRT())
    code, _, err = cli("export", "engine", "--onnx", onnx_dir, "--out", tmp_path / "e",
                       "--plugins", tmp_path / "missing.so")
    assert code == 2 and "plugin library not found" in err
    assert not (tmp_path / "e").exists()
