"""TensorRT engines from the exported ONNX graphs, with the project's plugin library loaded.

What is checked before TensorRT is imported (so that it is said on any machine):

- the export: `graphs.json` names each graph's role; an `--flavor onnxruntime` NVFP4 export is refused
  (its `Nvfp4Dequantize` unpacks nibbles with BitShift / BitwiseAnd on UINT8, which TensorRT's ONNX
  parser does not import: onnx-tensorrt docs/operators.md);
- the optimization profiles and the memory each graph needs at the largest shape of each
  (`tensorrt_profiles`), refused when it exceeds the device's.

Then, against the installed TensorRT (every `trt.` name used here is checked against the bindings
of each supported release by tests/test_tensorrt_api.py, from tests/data/tensorrt_python_api.json):

- TensorRT 11 networks are always strongly typed and its `BuilderFlag` has no FP16 / BF16 / FP8
  (NvInfer.h, python/src/infer/pyCore.cpp of release/11.0, 11.1; the 11.2-11.4 binding wheels):
  the precision is the graph's own dtypes, and a precision flag the graph does not already have is
  refused. On 10.x the flag is set where the binding has it; NVFP4 graphs are built strongly typed there too;
- releases whose parser runs the model-local function instead of our plugin (before 10.7) get a
  warning; NVFP4 graphs need 10.8 (`capabilities.TENSORRT_CAPABILITIES`).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx
from onnx import TensorProto

from eagle31_export.errors import MissingRuntimeError, UserError
from eagle31_export.export import capabilities as caps
from eagle31_export.export.tensorrt_profiles import GIB, GraphPlan, ServingLimits, gib, plan_graph
from eagle31_export.formats.outputs import atomic_output_dir, check_consumed, check_output
from eagle31_export.formats.safetensors_io import write_json

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")
INSTALL_HINT = ("TensorRT is not installed; on a machine with an NVIDIA GPU run `pip install tensorrt` "
                "(or `pip install -e .[tensorrt]`) with NVIDIA's package index reachable")
GRAPHS_JSON = "graphs.json"
PLUGIN_DOMAIN = "eagle31"
NVFP4_HELPER_DOMAIN = "eagle31.ops"  # onnx_nvfp4.OPS_DOMAIN: standard-op helpers TensorRT cannot import


@dataclass
class EnginePlan:
    """What `export engine` will build, known before TensorRT is imported."""

    onnx_dir: Path
    dtype: str  # the graphs' compute dtype (graphs.json)
    graphs: list[GraphPlan]
    uses_plugins: bool
    uses_fp4: bool
    limits: ServingLimits
    device_bytes: float | None = None
    device_name: str = ""
    notes: list[str] = field(default_factory=list)

    def lines(self, workspace_gib: float) -> list[str]:
        out = [f"limits: --max-batch {self.limits.max_batch}, --max-seq-len {self.limits.max_seq_len}, "
               f"--draft-depth {self.limits.draft_depth}; graphs in {self.dtype}"]
        for g in self.graphs:
            out.append(f"{g.file} ({g.role}): weights {gib(g.weight_bytes)}")
            for p in g.profiles:
                bound = f" ({p.bound()})" if p.bound() else ""
                out.append(f"  profile {p.summary()}: activations about {gib(p.activation_bytes)} at the largest "
                           f"shape{bound}; largest value {p.largest}")
            total = g.weight_bytes + g.activation_bytes + workspace_gib * GIB
            out.append(f"  needs about {gib(total)} (weights + largest profile + {workspace_gib:g} GiB workspace)"
                       + (f" of {gib(self.device_bytes)} on {self.device_name}" if self.device_bytes else ""))
        return out


def read_export(onnx_dir: Path) -> dict:
    if not onnx_dir.is_dir():
        raise UserError(f"{onnx_dir}: no such folder; pass the --out of `eagle31-export export onnx`")
    meta_path = onnx_dir / GRAPHS_JSON
    if not meta_path.is_file():
        raise UserError(f"{onnx_dir}: no {GRAPHS_JSON}; pass the --out of `eagle31-export export onnx`")
    try:
        return json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{meta_path}: not readable JSON ({e}); re-run `eagle31-export export onnx`") from None


def graph_roles(meta: dict, onnx_dir: Path) -> dict[str, str]:
    """file -> role of every graph graphs.json lists."""
    roles = {f"drafter_{role}": g["file"] for role, g in (meta.get("drafter") or {}).get("graphs", {}).items()}
    if meta.get("target"):
        roles["target"] = meta["target"]["file"]
    missing = [f for f in roles.values() if not (onnx_dir / f).is_file()]
    if not roles or missing:
        raise UserError(f"{onnx_dir}: {GRAPHS_JSON} lists {missing[0] if missing else 'no graphs'}, not found; "
                        "re-run `eagle31-export export onnx`")
    return {file: role for role, file in roles.items()}


def max_positions(meta: dict) -> int | None:
    """The fewest rope-table rows of the export's graphs (positions a sequence may reach)."""
    return min((g["max_positions"] for g in (meta.get("target") or {}, meta.get("drafter") or {})
                if g.get("max_positions")), default=None)


def check_flavor(meta: dict, onnx_dir: Path) -> None:
    """An NVFP4 export in the `onnxruntime` flavour is not an engine's input (module docstring)."""
    quant = (meta.get("target") or {}).get("quantization")
    if quant and meta.get("flavor") == "onnxruntime":
        raise UserError(f"{onnx_dir}: NVFP4 graphs of --flavor onnxruntime (nibbles unpacked with BitShift/BitwiseAnd, "
                        "which TensorRT's ONNX parser does not import) cannot be built; re-export with "
                        "`eagle31-export export onnx --flavor tensorrt` (or tensorrt-w4a4)")


def plan_engines(onnx_dir: str | os.PathLike, limits: ServingLimits, device_memory_gib: float | None = None) -> EnginePlan:
    """Profiles and memory estimates of every graph of an export (no TensorRT needed)."""
    onnx_dir = Path(onnx_dir)
    meta = read_export(onnx_dir)
    check_consumed(onnx_dir, given=["drafter", "target"])  # its graphs, by manifest; engines need no checkpoint
    check_flavor(meta, onnx_dir)
    roles = graph_roles(meta, onnx_dir)
    chain = ((meta.get("drafter") or {}).get("graphs") or {}).get("chain") or {}
    limits = limits.for_export(max_positions(meta), int(chain["depth"]) if chain.get("depth") else None)
    limits.validate(max_positions(meta))
    plans, plugins, fp4 = [], False, False
    for file, role in sorted(roles.items()):
        plans.append(plan_graph(onnx_dir / file, role, limits))
        check_sized(plans[-1])
        model = onnx.load(str(onnx_dir / file), load_external_data=False)
        plugins |= any(n.domain == PLUGIN_DOMAIN for n in model.graph.node)
        fp4 |= any(t.data_type == TensorProto.FLOAT4E2M1 for t in model.graph.initializer)
    plan = EnginePlan(onnx_dir, meta.get("dtype", "fp32"), plans, plugins, fp4, limits)
    if device_memory_gib is not None:
        plan.device_bytes, plan.device_name = device_memory_gib * GIB, "the device (--device-memory)"
    else:
        plan.device_bytes, plan.device_name = device_memory()
    return plan


def check_sized(graph: GraphPlan) -> None:
    """A graph none of whose computed values shape inference could size has no estimate to check or
    print: refused rather than planned as 0 bytes."""
    unsized = next((p for p in graph.profiles if p.sizeless), None)
    if unsized is not None:
        raise UserError(f"{graph.file}: no value it computes could be sized at profile {unsized.summary()} "
                        f"({unsized.unsized} unsized, first {unsized.first_unsized}), so its memory cannot be "
                        "estimated; re-export it with `eagle31-export export onnx` (a graph of ours is sized in full)")


def check_memory(plan: EnginePlan, workspace_gib: float) -> None:
    if plan.device_bytes is None:
        plan.notes.append("no GPU memory size found (no CUDA device visible to torch, no nvidia-smi): the memory "
                          "estimate was not checked; pass --device-memory GIB to check it")
        return
    for g in plan.graphs:
        total = g.weight_bytes + g.activation_bytes + workspace_gib * GIB
        if total > plan.device_bytes:
            worst = g.worst
            if worst.unresolved and not worst.lower_bound:  # sized with a guessed length: said, not refused
                plan.notes.append(f"{g.file}: about {gib(total)} at the largest shape of profile {worst.summary()}, "
                                  f"above {gib(plan.device_bytes)} on {plan.device_name}; {worst.bound()}; "
                                  "TensorRT's build will say if it does not fit")
                continue
            raise UserError(f"{g.file}: about {gib(total)} needed at the largest shape of profile {worst.summary()} "
                            f"(weights {gib(g.weight_bytes)}, activations {gib(worst.activation_bytes)}, workspace "
                            f"{workspace_gib:g} GiB) exceeds {gib(plan.device_bytes)} on {plan.device_name}; lower "
                            "--max-batch or --max-seq-len")


def device_memory() -> tuple[float | None, str]:
    """(total bytes, name) of the first CUDA device: from torch where it sees one, else nvidia-smi."""
    try:
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken CUDA setup is the same as none here
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout.splitlines()
            name, mib = out[0].rsplit(",", 1)
            return float(mib) * (1 << 20), name.strip()
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            pass
    return None, ""


# ---- TensorRT -------------------------------------------------------------------------------

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


def tensorrt_version(trt) -> str:
    version = str(getattr(trt, "__version__", "") or "")
    try:
        caps.parse_version(version)
    except UserError:
        raise UserError(f"the installed TensorRT reports version {version!r}, not a release number; reinstall it") from None
    return version


def strongly_typed_only(version: str) -> bool:
    """TensorRT 11 builds every network strongly typed (NvInfer.h 11.x: kSTRONGLY_TYPED 'always enabled')."""
    return caps.parse_version(version).major >= 11


def check_tensorrt(plan: EnginePlan, version: str, precision: str, warn: Callable[[str], None]) -> None:
    """Refuse what this TensorRT cannot build; warn where it would silently build something else."""
    features = {caps.TRT_PLUGINS} if plan.uses_plugins else set()
    if plan.uses_fp4:
        features.add(caps.TRT_FP4)
    problems = caps.tensorrt_problems(version, features)
    if caps.TRT_FP4 in problems:
        raise UserError(problems[caps.TRT_FP4] + "; upgrade TensorRT")
    if caps.TRT_PLUGINS in problems:
        warn(problems[caps.TRT_PLUGINS] + ": its parser imports Eagle31FcNorm / Eagle31PostNormFeedback as their "
             "model-local functions (standard ops) and never calls the plugins; the engine is correct but unfused")
    wanted = None if precision == "fp32" else precision
    if strongly_typed_only(version) and wanted not in (None, plan.dtype):
        raise UserError(f"TensorRT {version} builds strongly typed networks only (no BuilderFlag.{wanted.upper()}): "
                        f"an engine computes in its graphs' dtypes, and these are {plan.dtype}; drop --{wanted}, or "
                        f"re-export with `eagle31-export export onnx --dtype {wanted}`" if wanted != "fp8" else
                        f"TensorRT {version} builds strongly typed networks only (no BuilderFlag.FP8): FP8 kernels "
                        "need FP8-quantized graphs, which `export onnx` does not write; drop --fp8")
    if plan.uses_fp4 and wanted is not None and not strongly_typed_only(version):
        raise UserError("NVFP4 graphs are built strongly typed (their Q/DQ types fix each layer's precision); "
                        f"drop --{wanted}")


def load_plugins(trt, logger, library: Path | None) -> list[str]:
    """Register TensorRT's own plugins, then ours from `library`; return the creators now known."""
    trt.init_libnvinfer_plugins(logger, "")
    if library is not None:
        if not library.is_file():
            raise UserError(f"{library}: plugin library not found; build it with `eagle31-export plugins build`")
        # Loading through the registry keeps the handle alive for the process (deserialisation too).
        registry = trt.get_plugin_registry()
        if hasattr(registry, "load_library"):
            registry.load_library(str(library))
        else:
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    registry = trt.get_plugin_registry()
    # all_creators (IPluginCreatorInterface) exists in every 10.x and 11.x binding; plugin_creator_list
    # (IPluginCreator only) is gone from 11.0 (tests/data/tensorrt_python_api.json).
    creators = registry.all_creators
    return sorted(f"{getattr(c, 'plugin_namespace', '')}::{getattr(c, 'name', '')}" for c in creators)


def _builder_flag(trt, precision: str):
    """BuilderFlag.FP16 / BF16 / FP8 where the binding has it (no TensorRT 11 binding does). Each name
    is spelled out so that tests/test_tensorrt_api.py can check it against every release."""
    return {"fp16": getattr(trt.BuilderFlag, "FP16", None), "bf16": getattr(trt.BuilderFlag, "BF16", None),
            "fp8": getattr(trt.BuilderFlag, "FP8", None)}.get(precision)


def build_one(trt, logger, graph: Path, plan: GraphPlan, precision: str, strongly_typed: bool,
              workspace_gib: float) -> bytes:
    builder = trt.Builder(logger)
    flags = 0
    if strongly_typed:
        # TensorRT 10 takes the flag; in 11 every network is strongly typed and the flag is deprecated.
        flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        if flag is not None:
            flags = 1 << int(flag)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # parse_from_file resolves the external-weights files next to the graph.
    if not parser.parse_from_file(str(graph)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise UserError(f"{graph.name}: TensorRT's ONNX parser failed: {errors[0] if errors else 'unknown error'}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * GIB))
    if precision != "fp32" and not strongly_typed:
        flag = _builder_flag(trt, precision)
        if flag is None:
            raise UserError(f"this TensorRT has no BuilderFlag.{precision.upper()}; drop --{precision}")
        config.set_flag(flag)
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for p in plan.profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            if name in inputs:
                profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise UserError(f"{graph.name}: TensorRT could not build an engine (see the TensorRT log above)")
    return bytes(engine)


def build_engines(onnx_dir: str | os.PathLike, out: str | os.PathLike, plugins: str | os.PathLike | None = None,
                  precision: str = "fp32", limits: ServingLimits = ServingLimits(), workspace_gib: float = 4.0,
                  force: bool = False, device_memory_gib: float | None = None,
                  show: Callable[[str], None] = lambda line: None,
                  warn: Callable[[str], None] = lambda line: None) -> Path:
    """One `<graph>.engine` per ONNX graph, plus engines.json recording how they were built.

    `show` hears the plan (profiles, memory estimates) before anything is built; `warn` hears what
    the installed TensorRT will do differently from what the graphs ask."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    onnx_dir, out = Path(onnx_dir), Path(out)
    inputs = [onnx_dir, plugins]
    plan = plan_engines(onnx_dir, limits, device_memory_gib)
    for line in plan.lines(workspace_gib):
        show(line)
    check_memory(plan, workspace_gib)
    for note in plan.notes:
        warn(note)
    check_output(out, force, inputs)  # before the slow import and build
    trt = import_tensorrt()
    version = tensorrt_version(trt)
    check_tensorrt(plan, version, precision, warn)
    strongly_typed = strongly_typed_only(version) or plan.uses_fp4
    logger = trt.Logger(trt.Logger.WARNING)
    creators = load_plugins(trt, logger, Path(plugins) if plugins else None)
    ours = [c for c in creators if "Eagle31" in c]
    if plan.uses_plugins and plugins and not ours:
        warn(f"{plugins} registered no Eagle31 plugin: the engines run the model-local functions instead")
    with atomic_output_dir(out, force=force, inputs=inputs) as tmp:
        built = {}
        for g in plan.graphs:
            graph = onnx_dir / g.file
            (tmp / f"{graph.stem}.engine").write_bytes(
                build_one(trt, logger, graph, g, precision, strongly_typed, workspace_gib))
            built[g.file] = {"engine": f"{graph.stem}.engine", "role": g.role,
                             "profiles": [{"index": i, "name": p.name, "inputs": p.shapes}
                                          for i, p in enumerate(g.profiles)]}
        write_json(tmp / "engines.json", {
            "tensorrt_version": version, "precision": plan.dtype if strongly_typed else precision,
            "strongly_typed": strongly_typed,
            "plugin_library": str(Path(plugins).resolve()) if plugins else None,
            "eagle31_plugins_registered": ours,
            "limits": {"max_batch": plan.limits.max_batch, "max_seq_len": plan.limits.max_seq_len,
                       "draft_depth": plan.limits.draft_depth},
            "engines": built,
        })
    return out
