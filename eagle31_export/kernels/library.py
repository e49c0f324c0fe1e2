"""ctypes bindings of the kernel libraries' C ABI (plugins/include/eagle31_kernels.h).

`KernelLibrary` wraps either library (CPU or CUDA: the two share one signature, the CUDA one
adds a stream). It validates and flattens torch tensors, allocates the outputs and calls the
kernel; it knows nothing about torch.library (see torch_ops.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import torch

from eagle31_export.errors import MissingRuntimeError

ABI_VERSION = 1
MAX_SOURCES = 8
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_STATUS = {1: "bad argument", 2: "unsupported dtype", 3: "CUDA launch failed"}

_c_int, _c_i32, _c_i64, _c_float, _c_void = ctypes.c_int, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class KernelLibrary:
    """One loaded kernel library; `device` is "cpu" or "cuda"."""

    def __init__(self, path: Path | str, device: str):
        self.path = Path(path)
        self.device = device
        try:
            self._lib = ctypes.CDLL(str(self.path))
        except OSError as err:
            raise MissingRuntimeError(f"cannot load {self.path}: {err}") from None
        suffix = "cpu" if device == "cpu" else "cuda"
        self._fc_norm = getattr(self._lib, f"eagle31_fc_norm_{suffix}")
        self._post_norm = getattr(self._lib, f"eagle31_post_norm_feedback_{suffix}")
        stream = [_c_void] if device == "cuda" else []
        self._fc_norm.argtypes = [_c_int, ctypes.POINTER(_c_void), _c_i32, _c_void, _c_void,
                                  _c_i64, _c_i64, _c_i64, _c_float, _c_i32, *stream]
        self._post_norm.argtypes = [_c_int, _c_void, _c_void, _c_void, _c_void, _c_void,
                                    _c_i64, _c_i64, _c_float, _c_i32, *stream]
        self._fc_norm.restype = self._post_norm.restype = _c_int
        if device == "cpu":
            self._lib.eagle31_kernels_abi_version.restype = _c_i32
            found = self._lib.eagle31_kernels_abi_version()
            if found != ABI_VERSION:
                raise MissingRuntimeError(
                    f"{self.path} has kernel ABI {found}, expected {ABI_VERSION}: rebuild with `eagle31-export plugins build`"
                )

    def fc_norm(self, sources: Sequence[torch.Tensor], weight: torch.Tensor, eps: float, has_norm: bool) -> torch.Tensor:
        check_fc_norm_args(sources, weight)
        sources = [s.contiguous() for s in sources]
        weight = weight.contiguous()
        out = sources[0].new_empty((*sources[0].shape[:-1], weight.shape[0]))
        if out.numel() == 0:
            return out
        rows, hidden_in = _rows(sources[0]), sources[0].shape[-1]
        pointers = (_c_void * len(sources))(*[s.data_ptr() for s in sources])
        status = self._call(
            self._fc_norm, sources[0],
            DTYPE_CODES[weight.dtype], pointers, len(sources), weight.data_ptr(), out.data_ptr(),
            rows, hidden_in, weight.shape[0], float(eps), int(bool(has_norm)),
        )
        _check(status, "fc_norm", self.path)
        return out

    def post_norm_feedback(
        self, residual: torch.Tensor, update: torch.Tensor, norm_weight: torch.Tensor, eps: float, norm_output: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_post_norm_args(residual, update, norm_weight)
        residual, update, norm_weight = residual.contiguous(), update.contiguous(), norm_weight.contiguous()
        normed, fed_back = torch.empty_like(residual), torch.empty_like(residual)
        if residual.numel() == 0:
            return normed, fed_back
        status = self._call(
            self._post_norm, residual,
            DTYPE_CODES[residual.dtype], residual.data_ptr(), update.data_ptr(), norm_weight.data_ptr(),
            normed.data_ptr(), fed_back.data_ptr(), _rows(residual), residual.shape[-1], float(eps),
            int(bool(norm_output)),
        )
        _check(status, "post_norm_feedback", self.path)
        return normed, fed_back

    def _call(self, fn, like: torch.Tensor, *args) -> int:
        if self.device == "cpu":
            return fn(*args)
        # Launch on the tensors' device and on PyTorch's current stream, so the kernel is ordered
        # with the surrounding torch work exactly like a native op.
        with torch.cuda.device(like.device):
            return fn(*args, torch.cuda.current_stream(like.device).cuda_stream)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _check(status: int, op: str, path: Path) -> None:
    if status != 0:
        raise RuntimeError(f"eagle31 {op} kernel ({path.name}) failed: {_STATUS.get(status, f'status {status}')}")


def _check_dtype(op: str, tensors: Sequence[torch.Tensor]) -> None:
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        raise TypeError(f"eagle31::{op} supports float32, float16 and bfloat16 tensors, got {dtype}")
    for t in tensors:
        if t.dtype != dtype or t.device != tensors[0].device:
            raise TypeError(f"eagle31::{op}: all tensors must share one dtype and device, got {t.dtype} on {t.device} "
                            f"and {dtype} on {tensors[0].device}")


def check_fc_norm_args(sources: Sequence[torch.Tensor], weight: torch.Tensor) -> None:
    """Shape / dtype contract of eagle31::fc_norm (shared with the fake kernel)."""
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"eagle31::fc_norm takes 1..{MAX_SOURCES} sources, got {len(sources)}")
    _check_dtype("fc_norm", [*sources, weight])
    first = tuple(sources[0].shape)
    if not first:
        raise ValueError("eagle31::fc_norm sources must have a hidden dimension")
    for i, s in enumerate(sources):
        if tuple(s.shape) != first:
            raise ValueError(f"eagle31::fc_norm source {i} has shape {tuple(s.shape)}, source 0 has {first}")
    if weight.dim() != 2 or weight.shape[1] != len(sources) * first[-1]:
        raise ValueError(
            f"eagle31::fc_norm weight must be [H, {len(sources)}*{first[-1]}], got {tuple(weight.shape)}"
        )


def check_post_norm_args(residual: torch.Tensor, update: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """Shape / dtype contract of eagle31::post_norm_feedback (shared with the fake kernel)."""
    _check_dtype("post_norm_feedback", [residual, update, norm_weight])
    if residual.dim() < 1 or residual.shape != update.shape or tuple(norm_weight.shape) != (residual.shape[-1],):
        raise ValueError(
            "eagle31::post_norm_feedback needs residual and update of one shape [..., H] and norm_weight [H]; got "
            f"{tuple(residual.shape)}, {tuple(update.shape)}, {tuple(norm_weight.shape)}"
        )
