"""The `reference` runtime: the PyTorch reference pair, as a registry entry.

Its artifacts, when given, are an exported drafter (a checkpoint folder or a serving bundle):
running it against the source drafter checks that the export reads back as the same drafter.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from eagle31_export.errors import UserError
from eagle31_export.reference.pair import ReferencePair, load_pair
from eagle31_export.runtime.contract import LoadOptions, LoopSpeculator, PairSource

EXACT_DTYPES = (torch.float32, torch.float64)


class ReferenceSpeculator(LoopSpeculator):
    def __init__(self, pair: ReferencePair, exact: bool, source: PairSource | None = None,
                 options: LoadOptions | None = None):
        super().__init__("reference", pair.target, pair.drafter, exact)
        self.pair = pair
        self.source, self.options = source, options
        self.compute_dtype = options.dtype if options is not None else torch.float32

    def at_precision(self, dtype: torch.dtype) -> "ReferenceSpeculator | None":
        """The same pair computing in `dtype` (the same activation and NVFP4 semantics): what parity
        measures the runtime's precision with (parity/numerics.py)."""
        if self.source is None or self.options is None:
            return None
        return load(self.source, replace(self.options, dtype=dtype))


def _kernel_provider(name: str, device: str = "cpu"):
    if name == "torch":
        return None  # the drafter's default: reference/ops.py
    if name == "plugins":
        from eagle31_export.kernels.torch_ops import PluginKernels, device_problem

        problem = device_problem(device)
        if problem is not None:
            raise UserError(f"--kernels plugins --device {device}: {problem}")
        return PluginKernels()
    raise UserError(f"unknown --kernels {name!r}; choose torch or plugins")


def _drafter_and_target(source: PairSource) -> tuple[Path | None, Path | None]:
    drafter, target = source.artifacts or source.drafter, source.target
    if source.artifacts is not None and (source.artifacts / "graphs.json").is_file():
        raise UserError("an ONNX export runs on --runtime onnxruntime; the reference runtime takes checkpoints")
    if drafter is not None and (drafter / "bundle.json").is_file():
        from eagle31_export.export.bundle import read_bundle

        record = read_bundle(drafter)
        drafter, target = Path(record["drafter"]), target or Path(record["target"])
    return drafter, target


def load(source: PairSource, options: LoadOptions = LoadOptions(), workdir: Path | None = None) -> ReferenceSpeculator:
    if options.chain:
        raise UserError("--chain applies to --runtime onnxruntime")
    drafter, target = _drafter_and_target(source)
    if source.capture is not None:  # the reference drafter over a capture: the target is not loaded
        from eagle31_export.runtime.on_capture import load_reference

        speculator = load_reference(drafter, source.capture, options, _kernel_provider(options.kernels,
                                                                                      options.device))
        return place(speculator, options.device)
    if drafter is None or target is None:
        raise UserError("--runtime reference needs --drafter and --target")
    kernels = _kernel_provider(options.kernels, options.device)
    pair = load_pair(drafter, target, dtype=options.dtype, act_quant=options.act_quant, kernels=kernels,
                     nvfp4_semantics=options.nvfp4_semantics)
    return place(ReferenceSpeculator(pair, exact=options.dtype in EXACT_DTYPES, source=source, options=options),
                 options.device)


def place(speculator: LoopSpeculator, device: str) -> LoopSpeculator:
    """Move the reference target and drafter modules to `device` (resolved: cpu or cuda). The pair is
    read on the CPU, then moved once; the backends move each call's inputs to their module's device
    and hand results back on the caller's, so the loop, the sampler and the comparisons stay on CPU.
    The target first: a drafter sharing its embeddings as the same Parameter then finds them moved."""
    model = getattr(speculator.target, "model", None)
    if isinstance(model, torch.nn.Module):
        model.to(device)
    module = getattr(speculator.drafter, "drafter", None)
    if isinstance(module, torch.nn.Module):
        module.to(device)
    return speculator


def prepare_servable(pair_dir: Path, target: Path) -> None:
    """Nothing to derive: the Triton model loads `pair_dir/drafter` and the target as they are."""
