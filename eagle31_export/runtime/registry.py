"""The runtime registry: what the user gave (checkpoints, exported artifacts, a server URL) and a
runtime name become one `Speculator`. Every caller (speculate, parity, the demo, the Triton
model) goes through `load_speculator`; runtime names exist only in `RUNTIMES`.

Adding a runtime = one module with `load(source, options, workdir) -> Speculator` (and, if the
Triton `cpu` repository can serve it, `prepare_servable(pair_dir, target) -> artifacts`) plus one entry below.
The module imports the contract (`runtime/contract.py`), never this registry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from eagle31_export.errors import UserError
# The contract, importable from here too (callers and docs name these through the registry).
from eagle31_export.runtime.contract import (  # noqa: F401
    BatchFigures, ConcurrentRun, LoadOptions, LoopSpeculator, PairSource, Speculator,
)


DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str | None, runtime: str | None = None) -> str:
    """`cpu` or `cuda` for `--device NAME` (`auto`: cuda where torch sees a GPU, else cpu); refuses
    cuda where torch sees none, and on a runtime that computes on CPU only (`Runtime.devices`)."""
    name = (name or "cpu").lower()
    if name not in DEVICES:
        raise UserError(f"unknown --device {name!r}; choose one of {', '.join(DEVICES)}")
    devices = runtime_named(runtime).devices if runtime is not None else ("cpu", "cuda")
    available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if available and "cuda" in devices else "cpu"
    if name == "cuda" and not available:
        version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
        raise UserError(f"--device cuda: no CUDA device is visible to torch (torch {version}, CUDA build: "
                        f"{torch.version.cuda or 'no'}); use --device cpu")
    if name not in devices:
        raise UserError(f"--device {name}: --runtime {runtime} computes on {' or '.join(devices)} only in this "
                        f"process; use --device {devices[0]}, or --runtime reference")
    return name


@dataclass(frozen=True)
class Runtime:
    name: str
    help: str
    module: Callable[[], object]  # imported on use: runtimes pull in heavy libraries
    devices: tuple[str, ...] = ("cpu", "cuda")  # where it can compute (--device)
    # how the engine reads NVFP4 scales; parity's reference reads them the same way (NVFP4_SEMANTICS)
    nvfp4_semantics: str = "exact"

    def load(self, source: PairSource, options: LoadOptions = LoadOptions(),
             workdir: Path | None = None) -> Speculator:
        return self.module().load(source, options, workdir)

    @property
    def servable(self) -> bool:
        """Whether the Triton `cpu` repository can serve the pair on this runtime."""
        return hasattr(self.module(), "prepare_servable")

    def prepare_servable(self, pair_dir: Path, target: Path) -> Path | None:
        """Write what this runtime needs next to `pair_dir/drafter` (e.g. the ONNX graphs); returns
        the artifacts folder to pass back as `PairSource.artifacts`, or None."""
        return self.module().prepare_servable(pair_dir, target)


def _reference():
    from eagle31_export.runtime import reference_runtime

    return reference_runtime


def _onnxruntime():
    from eagle31_export.runtime import onnxruntime

    return onnxruntime


def _vllm():
    from eagle31_export.runtime import vllm_runtime

    return vllm_runtime


def _triton():
    from eagle31_export.runtime import triton_client

    return triton_client


RUNTIMES: dict[str, Runtime] = {r.name: r for r in (
    Runtime("reference", "the PyTorch reference over checkpoints", _reference),
    # ONNX Runtime runs here with its CPUExecutionProvider only
    Runtime("onnxruntime", "the exported ONNX graphs on ONNX Runtime (CPU)", _onnxruntime, ("cpu",)),
    # the server decides where it computes; this process only sends requests
    Runtime("triton", "a running Triton server (--url HOST:PORT)", _triton, ("cpu",)),
    # the engine decides where it computes (its own build: CPU or GPU); this process sends requests
    Runtime("vllm", "a real vLLM engine: a server at --url, or one started locally from --vllm VENV over a "
                    "bundle of `export vllm`", _vllm, ("cpu",), nvfp4_semantics="vllm"),
)}

DEFAULT_SERVING_RUNTIME = "onnxruntime"  # what the Triton `cpu` repository runs unless told otherwise


def runtime_named(name: str) -> Runtime:
    try:
        return RUNTIMES[name]
    except KeyError:
        raise UserError(f"unknown --runtime {name!r}; choose one of {', '.join(RUNTIMES)}") from None


def load_speculator(name: str, source: PairSource, options: LoadOptions = LoadOptions(),
                    workdir: str | os.PathLike | None = None) -> Speculator:
    """The speculator for runtime `name` over `source`. `workdir`: where a runtime may write what it
    derives on the fly (the caller owns and removes it). `options.device` is resolved here, once."""
    runtime = runtime_named(name)
    options = replace(options, device=resolve_device(options.device, name))
    return runtime.load(source, options, Path(workdir) if workdir is not None else None)
