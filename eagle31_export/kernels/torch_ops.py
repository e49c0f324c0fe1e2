"""The fused operations as torch custom ops, and `PluginKernels`, the drafter's provider over them.

    torch.ops.eagle31.fc_norm(sources: list[Tensor], weight: Tensor, eps: float, has_norm: bool) -> Tensor
    torch.ops.eagle31.post_norm_feedback(residual, update, norm_weight, eps: float, norm_output: bool)
        -> (normed, fed_back)

The signatures follow the TensorRT plugins (plugins/README.md): `fc_norm` takes the FOLDED weight.
CPU tensors run the C++ kernels through ctypes; CUDA tensors run the CUDA kernels when their
library is loaded, else the same kernel form in plain torch. Fake kernels let `torch.export`
trace both ops as single nodes.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import torch

from eagle31_export.errors import MissingRuntimeError
from eagle31_export.kernels.build import CPU_LIBRARY, CUDA_LIBRARY, default_build_dir, ensure_cpu_library
from eagle31_export.kernels.folding import fold_fc_norm_weights
from eagle31_export.kernels.library import KernelLibrary, check_fc_norm_args, check_post_norm_args

# The libraries the ops dispatch to, per device type. Loading is explicit (load_cpu_kernels /
# load_cuda_kernels, or PluginKernels); an op on a device with nothing loaded looks in the default
# build folder once before giving up.
_LOADED: dict[str, KernelLibrary] = {}


def load_cpu_kernels(path: Path | str | None = None) -> KernelLibrary:
    """Load (building if needed, when `path` is None) the CPU kernels the ops will use."""
    _LOADED["cpu"] = KernelLibrary(path or ensure_cpu_library(), "cpu")
    return _LOADED["cpu"]


def load_cuda_kernels(path: Path | str | None = None) -> KernelLibrary:
    """Load the CUDA kernels (built by `eagle31-export plugins build`) the ops will use on GPU."""
    path = Path(path or default_build_dir() / "lib" / CUDA_LIBRARY)
    if not path.is_file():
        raise MissingRuntimeError(f"CUDA kernel library {path} not found: run `eagle31-export plugins build --cuda`")
    _LOADED["cuda"] = KernelLibrary(path, "cuda")
    return _LOADED["cuda"]


def loaded_library(device_type: str) -> KernelLibrary | None:
    if device_type not in _LOADED:
        name = CPU_LIBRARY if device_type == "cpu" else CUDA_LIBRARY
        try:
            candidate = default_build_dir() / "lib" / name
        except Exception:  # no plugin sources next to the package: nothing built either
            return None
        if candidate.is_file():
            _LOADED[device_type] = KernelLibrary(candidate, device_type)
    return _LOADED.get(device_type)


def device_problem(device: str) -> str | None:
    """Why the plugin kernels cannot run on `device` (cpu or cuda), in words; None when they can.
    Without the CUDA library the ops would quietly fall back to their plain-torch form on GPU
    tensors, which is `--kernels torch` under another name: callers refuse it instead."""
    if device == "cuda" and loaded_library("cuda") is None:
        return ("only the CPU plugin kernels are available (no CUDA kernel library is built); run "
                "`eagle31-export plugins build --cuda`, or use --kernels torch or --device cpu")
    return None


def _cpu_library() -> KernelLibrary:
    lib = loaded_library("cpu")
    if lib is None:
        raise MissingRuntimeError(
            "the eagle31 CPU kernels are not built: run `eagle31-export plugins build` "
            "or call eagle31_export.kernels.load_cpu_kernels()"
        )
    return lib


def _cuda_library_or_warn() -> KernelLibrary | None:
    lib = loaded_library("cuda")
    if lib is None:
        warnings.warn("eagle31 CUDA kernels not loaded: CUDA tensors use the plain-torch kernel form", stacklevel=3)
    return lib


# ------------------------------------------------------------------------------------------
# Plain-torch kernel form (what the kernels compute, for devices without a compiled kernel).
# ------------------------------------------------------------------------------------------


def fc_norm_kernel_form(sources: Sequence[torch.Tensor], weight: torch.Tensor, eps: float, has_norm: bool) -> torch.Tensor:
    """y = sum_i s_i * (W'_i @ a_i), s_i = 1/rms(a_i) (1 without norm), in fp32 (fp64 stays fp64)."""
    hidden = sources[0].shape[-1]
    compute = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    acc = None
    for i, a in enumerate(sources):
        af = a.to(compute)
        part = torch.nn.functional.linear(af, weight[:, i * hidden:(i + 1) * hidden].to(compute))
        if has_norm:
            part = part * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + eps)
        acc = part if acc is None else acc + part
    return acc.to(sources[0].dtype)


def post_norm_feedback_kernel_form(residual, update, norm_weight, eps: float, norm_output: bool):
    from eagle31_export.reference.ops import post_norm_feedback

    normed, fed_back = post_norm_feedback(residual, update, norm_weight, eps, norm_output)
    return normed, fed_back.clone() if norm_output else fed_back  # custom-op outputs must not alias


# ------------------------------------------------------------------------------------------
# The custom ops.
# ------------------------------------------------------------------------------------------


@torch.library.custom_op("eagle31::fc_norm", mutates_args=())
def fc_norm(sources: list[torch.Tensor], weight: torch.Tensor, eps: float, has_norm: bool) -> torch.Tensor:
    check_fc_norm_args(sources, weight)
    return fc_norm_kernel_form(sources, weight, eps, has_norm)


@fc_norm.register_kernel("cpu")
def _fc_norm_cpu(sources, weight, eps, has_norm):
    return _cpu_library().fc_norm(sources, weight, eps, has_norm)


@fc_norm.register_kernel("cuda")
def _fc_norm_cuda(sources, weight, eps, has_norm):
    lib = _cuda_library_or_warn()
    if lib is None:
        check_fc_norm_args(sources, weight)
        return fc_norm_kernel_form(sources, weight, eps, has_norm)
    return lib.fc_norm(sources, weight, eps, has_norm)


@fc_norm.register_fake
def _fc_norm_fake(sources, weight, eps, has_norm):
    check_fc_norm_args(sources, weight)
    return sources[0].new_empty((*sources[0].shape[:-1], weight.shape[0]))


@torch.library.custom_op("eagle31::post_norm_feedback", mutates_args=())
def post_norm_feedback(
    residual: torch.Tensor, update: torch.Tensor, norm_weight: torch.Tensor, eps: float, norm_output: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    check_post_norm_args(residual, update, norm_weight)
    return post_norm_feedback_kernel_form(residual, update, norm_weight, eps, norm_output)


@post_norm_feedback.register_kernel("cpu")
def _post_norm_feedback_cpu(residual, update, norm_weight, eps, norm_output):
    return _cpu_library().post_norm_feedback(residual, update, norm_weight, eps, norm_output)


@post_norm_feedback.register_kernel("cuda")
def _post_norm_feedback_cuda(residual, update, norm_weight, eps, norm_output):
    lib = _cuda_library_or_warn()
    if lib is None:
        check_post_norm_args(residual, update, norm_weight)
        return post_norm_feedback_kernel_form(residual, update, norm_weight, eps, norm_output)
    return lib.post_norm_feedback(residual, update, norm_weight, eps, norm_output)


@post_norm_feedback.register_fake
def _post_norm_feedback_fake(residual, update, norm_weight, eps, norm_output):
    check_post_norm_args(residual, update, norm_weight)
    return torch.empty_like(residual), torch.empty_like(residual)


# ------------------------------------------------------------------------------------------
# The drafter's kernel provider.
# ------------------------------------------------------------------------------------------


class PluginKernels:
    """`DrafterKernels` over the eagle31 ops: the reference drafter runs with the plugin kernels.

    The fc_norm weights are folded into the fc weight on first use and cached per weight
    tensor (and version), as the exported graph does once at export time.
    """

    def __init__(self, cpu_library: Path | str | None = None, cuda_library: Path | str | None = None):
        load_cpu_kernels(cpu_library)
        if cuda_library is not None:
            load_cuda_kernels(cuda_library)
        self._folded: dict[int, tuple[tuple, torch.Tensor]] = {}

    def fc_norm(self, sources, fc_weight, norm_weights, eps):
        sources = list(sources)
        folded = self._fold(fc_weight, norm_weights, len(sources))
        dtype = torch.promote_types(sources[0].dtype, folded.dtype)  # as the reference's linear would require
        return torch.ops.eagle31.fc_norm(
            [s.to(dtype) for s in sources], folded.to(dtype), float(eps), norm_weights is not None
        )

    def post_norm_feedback(self, residual, update, norm_weight, eps, norm_output):
        dtype = torch.promote_types(torch.promote_types(residual.dtype, update.dtype), norm_weight.dtype)
        normed, fed_back = torch.ops.eagle31.post_norm_feedback(
            residual.to(dtype), update.to(dtype), norm_weight.to(dtype), float(eps), bool(norm_output)
        )
        return normed, fed_back

    def _fold(self, fc_weight, norm_weights, num_sources):
        if norm_weights is None:
            return fc_weight
        norm_weights = list(norm_weights)
        # The key holds the tensors themselves, so an id is never reused while its entry exists.
        key = (fc_weight, fc_weight._version, *[(w, w._version) for w in norm_weights])
        cached = self._folded.get(id(fc_weight))
        if cached is not None and _same_key(cached[0], key):
            return cached[1]
        folded = fold_fc_norm_weights(fc_weight.detach(), [w.detach() for w in norm_weights], num_sources)
        self._folded[id(fc_weight)] = (key, folded)
        return folded


def _same_key(a: tuple, b: tuple) -> bool:
    if len(a) != len(b) or a[0] is not b[0] or a[1] != b[1]:
        return False
    return all(x[0] is y[0] and x[1] == y[1] for x, y in zip(a[2:], b[2:]))
