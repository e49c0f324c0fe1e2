"""TensorRT engines from the exported ONNX graphs, with the project's plugin library loaded.

The graphs carry `Eagle31FcNorm` / `Eagle31PostNormFeedback` nodes with `plugin_namespace`:
TensorRT's ONNX parser uses the registered plugin when the library is loaded, and falls back
to the ONNX model-local function of the same name when not. TensorRT is imported lazily: on
machines without it (CPU-only CI) the command fails with one line saying how to get it.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from eagle31_export.errors import MissingRuntimeError, UserError
from eagle31_export.formats.outputs import atomic_output_dir, check_output
from eagle31_export.formats.safetensors_io import write_json

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")
INSTALL_HINT = ("TensorRT is not installed; on a machine with an NVIDIA GPU run `pip install tensorrt` "
                "(or `pip install -e .[tensorrt]`) with NVIDIA's package index reachable")


@dataclass(frozen=True)
class ShapeRange:
    """Every dynamic ONNX dimension (batch, tokens, cache length) gets min/opt/max from this."""

    min: int = 1
    opt: int = 64
    max: int = 2048


def import_tensorrt():
    try:
        import tensorrt as trt  # noqa: PLC0415 - optional, GPU machines only
    except ImportError:
        raise MissingRuntimeError(INSTALL_HINT) from None
    # The registry's `tensorrt` package is a stub that downloads the real wheel on install;
    # a stub left behind imports but has no Builder.
    if not hasattr(trt, "Builder"):
        raise MissingRuntimeError(INSTALL_HINT)
    return trt


def onnx_graphs(onnx_dir: Path) -> list[Path]:
    if not onnx_dir.is_dir():
        raise UserError(f"{onnx_dir}: no such folder; pass the --out of `eagle31-export export onnx`")
    graphs = sorted(onnx_dir.glob("*.onnx"))
    if not graphs:
        raise UserError(f"{onnx_dir}: no *.onnx graphs; run `eagle31-export export onnx` first")
    return graphs


def load_plugins(trt, logger, library: Path | None) -> list[str]:
    """Register TensorRT's own plugins, then ours from `library`; return the creators now known."""
    trt.init_libnvinfer_plugins(logger, "")
    if library is not None:
        if not library.is_file():
            raise UserError(f"{library}: plugin library not found; build it with `eagle31-export plugins build`")
        # Loading through the registry keeps the handle alive for the process (deserialisation too);
        # ctypes is the fallback for releases without load_library.
        registry = trt.get_plugin_registry()
        if hasattr(registry, "load_library"):
            registry.load_library(str(library))
        else:
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    registry = trt.get_plugin_registry()
    creators = getattr(registry, "all_creators", None) or getattr(registry, "plugin_creator_list", [])
    return sorted(f"{getattr(c, 'plugin_namespace', '')}::{c.name}" for c in creators)


def build_one(trt, logger, graph: Path, precision: str, shapes: ShapeRange, workspace_gib: float) -> bytes:
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):  # removed (implicit) in TensorRT 10
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # parse_from_file resolves the shared external-weights file next to the graph.
    if not parser.parse_from_file(str(graph)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise UserError(f"{graph.name}: TensorRT's ONNX parser failed: {errors[0] if errors else 'unknown error'}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    flag = {"fp16": "FP16", "bf16": "BF16", "fp8": "FP8"}.get(precision)
    if flag is not None:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    profile = builder.create_optimization_profile()
    dynamic = False
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        dims = list(tensor.shape)
        if any(d < 0 for d in dims):
            dynamic = True
            pick = lambda v: [v if d < 0 else d for d in dims]  # noqa: E731
            profile.set_shape(tensor.name, pick(shapes.min), pick(shapes.opt), pick(shapes.max))
    if dynamic:
        config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise UserError(f"{graph.name}: TensorRT could not build an engine (see the TensorRT log above)")
    return bytes(engine)


def build_engines(onnx_dir: str | os.PathLike, out: str | os.PathLike, plugins: str | os.PathLike | None = None,
                  precision: str = "fp32", shapes: ShapeRange = ShapeRange(), workspace_gib: float = 4.0,
                  force: bool = False) -> Path:
    """One `<graph>.engine` per ONNX graph, plus engines.json recording how they were built."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    graphs = onnx_graphs(Path(onnx_dir))
    out = Path(out)
    inputs = [onnx_dir, plugins]
    check_output(out, force, inputs)  # before the slow import and build
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    creators = load_plugins(trt, logger, Path(plugins) if plugins else None)
    with atomic_output_dir(out, force=force, inputs=inputs) as tmp:
        built = {}
        for graph in graphs:
            (tmp / f"{graph.stem}.engine").write_bytes(build_one(trt, logger, graph, precision, shapes, workspace_gib))
            built[graph.name] = f"{graph.stem}.engine"
        write_json(tmp / "engines.json", {
            "tensorrt_version": getattr(trt, "__version__", "unknown"), "precision": precision,
            "plugin_library": str(Path(plugins).resolve()) if plugins else None,
            "eagle31_plugins_registered": [c for c in creators if "Eagle31" in c],
            "shapes": {"min": shapes.min, "opt": shapes.opt, "max": shapes.max}, "engines": built,
        })
    return out
