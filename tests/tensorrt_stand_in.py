"""A stand-in `tensorrt` module with exactly the API surface one release's binding has.

Which names exist comes from tests/data/tensorrt_python_api.json, read from NVIDIA/TensorRT's
pybind11 sources of each release, or from the release's binding wheel where its sources are not
published (tests/data/read_tensorrt_python_api.py; the data says which, per release); a name the release lacks is
absent here too, so code that uses it fails as it would on that release. The stand-in records
what it is asked to do; it builds nothing (TensorRT cannot be installed on these machines)."""

from __future__ import annotations

import json
import types
from pathlib import Path

API = json.loads((Path(__file__).parent / "data" / "tensorrt_python_api.json").read_text())


def release_names(release: str) -> set[str]:
    return set(API["releases"][release])


def stand_in(release: str, creators=(("eagle31", "Eagle31FcNorm"), ("eagle31", "Eagle31PostNormFeedback"))):
    names = release_names(release)
    trt = types.ModuleType("tensorrt")
    trt.__version__ = f"{release}.0"
    trt.calls = calls = []

    def has(name):
        return name in names

    def members(scope: str, impl: dict) -> dict:
        return {k: v for k, v in impl.items() if has(f"{scope}.{k}")}

    def enum(scope: str, values: list[str]):
        return types.SimpleNamespace(**{v: f"{scope}.{v}" for v in values if has(f"{scope}.{v}")})

    trt.BuilderFlag = enum("BuilderFlag", ["FP16", "BF16", "FP8", "FP4"])
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(
        **{v: i for i, v in ((0, "EXPLICIT_BATCH"), (1, "STRONGLY_TYPED")) if has(f"NetworkDefinitionCreationFlag.{v}")})
    trt.MemoryPoolType = enum("MemoryPoolType", ["WORKSPACE"])

    class Logger:
        WARNING = "WARNING"

        def __init__(self, level):
            calls.append(("Logger", level))

    if not has("Logger.WARNING"):
        del Logger.WARNING

    class Tensor:
        def __init__(self, name):
            self.name, self.shape = name, None

    class Network:
        def __init__(self, flags):
            self.flags, self.inputs = flags, []

    network_impl = {"num_inputs": property(lambda self: len(self.inputs)),
                    "get_input": lambda self, i: self.inputs[i]}
    NetworkT = type("INetworkDefinition", (Network,), members("INetworkDefinition", network_impl))

    def parse_from_file(self, path):
        import onnx

        calls.append(("parse_from_file", path))
        model = onnx.load(path, load_external_data=False)
        initializers = {t.name for t in model.graph.initializer}
        self.network.inputs = [Tensor(v.name) for v in model.graph.input if v.name not in initializers]
        return True

    class Parser:
        def __init__(self, network, logger):
            self.network = network

    ParserT = type("OnnxParser", (Parser,), members("OnnxParser", {
        "parse_from_file": parse_from_file, "num_errors": property(lambda self: 0),
        "get_error": lambda self, i: None}))

    profile_impl = {"set_shape": lambda self, name, lo, opt, hi: calls.append(("set_shape", name, lo, opt, hi))}
    ProfileT = type("IOptimizationProfile", (), members("IOptimizationProfile", profile_impl))
    config_impl = {
        "set_memory_pool_limit": lambda self, pool, size: calls.append(("set_memory_pool_limit", pool, size)),
        "set_flag": lambda self, flag: calls.append(("set_flag", flag)),
        "add_optimization_profile": lambda self, p: calls.append(("add_optimization_profile",)),
    }
    ConfigT = type("IBuilderConfig", (), members("IBuilderConfig", config_impl))

    def create_network(self, flags=0):
        calls.append(("create_network", flags))
        return NetworkT(flags)

    builder_impl = {"create_network": create_network, "create_builder_config": lambda self: ConfigT(),
                    "create_optimization_profile": lambda self: ProfileT(),
                    "build_serialized_network": lambda self, network, config: b"ENGINE"}
    BuilderT = type("Builder", (), {"__init__": lambda self, logger: None, **members("Builder", builder_impl)})

    found = [types.SimpleNamespace(plugin_namespace=ns, name=n) for ns, n in creators]
    registry_impl = {"load_library": lambda self, path: calls.append(("load_library", path)),
                     "all_creators": property(lambda self: found),
                     "plugin_creator_list": property(lambda self: found)}
    RegistryT = type("IPluginRegistry", (), members("IPluginRegistry", registry_impl))

    for name, value in (("Logger", Logger), ("Builder", BuilderT), ("OnnxParser", ParserT),
                        ("get_plugin_registry", lambda: RegistryT()),
                        ("init_libnvinfer_plugins", lambda logger, ns: calls.append(("init_libnvinfer_plugins", ns)))):
        if has(name):
            setattr(trt, name, value)
    return trt
