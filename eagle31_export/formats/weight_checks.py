"""Value checks over checkpoint tensors, one streaming pass: the weights a checkpoint holds must be
usable before anything computes with them or exports them.

- dtypes (from the headers, no data read): weights and norms floating point, index maps integer,
  masks boolean or integer;
- values: every floating-point value finite (no NaN, no Inf), norm weights not all zero.

The pass reads each tensor once, in file order, in pieces of about `chunk_bytes` (memory stays at
one piece whatever the model size), and costs one vectorised reduction per piece: `aminmax`, whose
minimum and maximum are both finite exactly when every value is (NaN propagates through min/max,
an Inf becomes one of them), and both zero exactly when every value is zero. It runs at memory
speed (a float32 `sum` or `isfinite().all()` is 30x slower on bfloat16). The same function checks
tensors already in memory (a loaded model's parameters), so readers, loaders and `inspect` share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from eagle31_export.formats.safetensors_io import SafetensorsDir

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
INT_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
# role -> dtypes a tensor of that role may be stored in
ROLE_DTYPES: dict[str, tuple[str, ...]] = {
    "weight": FLOAT_DTYPES,
    "norm": FLOAT_DTYPES,
    "index": INT_DTYPES,
    "mask": ("BOOL",) + INT_DTYPES,
}
_TORCH_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
                torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
                torch.int64: "I64"}
CHUNK_BYTES = 64 << 20


@dataclass
class _State:
    finite: bool = True
    nonzero: bool = False


@dataclass
class WeightScan:
    """The outcome of one pass: problems as user-facing lines, and how much was read."""

    problems: list[str] = field(default_factory=list)
    bytes_read: int = 0


def role_of(name: str, ndim: int) -> str:
    """A norm weight (RMSNorm/LayerNorm scale: 1-D, named *norm*) or an ordinary weight."""
    module, _, leaf = name.rpartition(".")
    last = module.rpartition(".")[2]
    if ndim == 1 and leaf == "weight" and ("norm" in last or (last.isdigit() and "norm" in module)):
        return "norm"
    return "weight"


def check_values(items: Iterable[tuple[str, torch.Tensor]], roles: Mapping[str, str],
                 where: Mapping[str, str] | None = None, zero_norms_ok: bool = False) -> WeightScan:
    """Problems of the float tensors among `items` ((name, piece) pairs; a name may come in several
    pieces, in order). `roles` maps name -> 'weight' or 'norm' (others are skipped); `where`
    names the place to print for each name (default: the name)."""
    states: dict[str, _State] = {}
    scan = WeightScan()
    for name, piece in items:
        role = roles.get(name)
        if role not in ("weight", "norm") or not piece.is_floating_point():
            continue
        state = states.setdefault(name, _State())
        scan.bytes_read += piece.numel() * piece.element_size()
        if piece.numel() == 0 or not state.finite:
            continue
        low, high = torch.aminmax(piece.detach())
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            state.finite = False
        elif not state.nonzero:
            state.nonzero = bool(low != 0) or bool(high != 0)
    label = where or {}
    for name, state in states.items():
        place = label.get(name, name)
        if not state.finite:
            scan.problems.append(f"{place}: contains NaN or Inf values; the checkpoint is damaged or was saved "
                                 "after a diverged training step")
        elif roles[name] == "norm" and not state.nonzero and not zero_norms_ok:
            scan.problems.append(f"{place}: norm weight is all zeros, which zeroes every activation through it; "
                                 "the checkpoint is damaged or incomplete")
    return scan


def dtype_problems(dtypes: Mapping[str, str], roles: Mapping[str, str], where: Mapping[str, str] | None = None
                   ) -> list[str]:
    """Problems of stored dtypes (safetensors names, e.g. 'BF16') against each tensor's role."""
    label = where or {}
    out = []
    for name, role in roles.items():
        dtype = dtypes.get(name)
        allowed = ROLE_DTYPES.get(role)
        if dtype is None or allowed is None or dtype in allowed:
            continue
        kind = {"weight": "a floating-point weight", "norm": "a floating-point norm weight",
                "index": "an integer index map", "mask": "a boolean mask"}[role]
        out.append(f"{label.get(name, name)}: stored as {dtype}, expected {kind} ({', '.join(allowed)})")
    return out


def scan_checkpoint(source: SafetensorsDir, roles: Mapping[str, str], where: Mapping[str, str] | None = None,
                    zero_norms_ok: bool = False, chunk_bytes: int = CHUNK_BYTES) -> WeightScan:
    """dtype and value problems of the tensors of `source` named in `roles`, in one streaming pass."""
    dtypes = {n: source.shape_and_dtype(n)[1] for n in roles if n in source}
    problems = dtype_problems(dtypes, roles, where)
    float_names = [n for n, r in roles.items() if r in ("weight", "norm") and dtypes.get(n) in FLOAT_DTYPES]
    scan = check_values(source.iter_chunks(float_names, chunk_bytes), roles, where, zero_norms_ok)
    scan.problems[:0] = problems
    return scan


def scan_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], roles: Mapping[str, str],
                 zero_norms_ok: bool = False) -> WeightScan:
    """The same checks over tensors already in memory (e.g. a loaded model's named parameters)."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    dtypes = {n: _TORCH_NAMES.get(t.dtype, str(t.dtype)) for n, t in items}
    problems = dtype_problems(dtypes, {n: r for n, r in roles.items() if n in dtypes})
    scan = check_values(items, roles, zero_norms_ok=zero_norms_ok)
    scan.problems[:0] = problems
    return scan
