"""Weights kept in their stored dtype, arithmetic in the compute dtype, one operation at a time.

A bf16 checkpoint loaded in fp32 holds twice its bytes. Since bf16 -> fp32 is exact, casting a
weight just before the operation that uses it gives the same results as loading it in fp32;
`compute_in` arranges that for a loaded model, so the reference holds about the checkpoint's
bytes plus one transient piece:

- `nn.Linear`: `F.linear(x, W.to(dtype), b)`, over blocks of output rows when the cast weight
  would be large (an fp32 lm_head of 128256 x 4096 is 2 GB; a block is `CHUNK_BYTES`);
- `nn.Embedding`: index the stored table, cast the rows (the hidden stream then runs in `dtype`);
  a table loaded from a file is read through a read-only mapping of that file whose pages are
  given back after each lookup (`process_memory`, "tables read by rows"): a 16k-token prompt over
  a 128k vocabulary would otherwise leave most of the table resident;
- any other module with its own floating-point parameters: small ones (norms) are cast once,
  large ones (fused MoE experts, routers) are cast for the duration of each call.

Where the compute dtype is narrower than the stored one, or not an exact widening of it, the
weights are cast once, as loading them in that dtype did.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from eagle31_export.formats.safetensors_io import upcasts_exactly
from eagle31_export.process_memory import file_mapping_at, release_read_only_pages

# Bytes of the cast weight one Linear step materialises; below it a Linear is one GEMM (so small
# models compute exactly as with weights loaded in the compute dtype; blocks may change BLAS
# blocking by an ulp).
CHUNK_BYTES = 64 << 20
# A module's own weights up to this many elements (norm scales) are cast once: negligible memory.
SMALL_NUMEL = 1 << 20


class UpcastLinear(nn.Linear):
    """nn.Linear whose weight stays stored and is cast to `compute_dtype` per call, by row blocks."""

    compute_dtype: torch.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return chunked_linear(x, self.weight, self.bias, self.compute_dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", stored={self.weight.dtype}, compute={self.compute_dtype}"


class UpcastEmbedding(nn.Embedding):
    """nn.Embedding whose table stays stored; the gathered rows are cast to `compute_dtype`."""

    compute_dtype: torch.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        table, of = getattr(self, "file_table", (None, None))
        if table is None or of != self.weight.data_ptr():  # no file behind it, or other weights since
            return super().forward(input_ids).to(self.compute_dtype)
        rows = F.embedding(input_ids, table, self.padding_idx).to(self.compute_dtype)  # a copy of the rows
        release_read_only_pages(table.data_ptr(), table.numel() * table.element_size())
        return rows


def read_only_table(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight`'s bytes through a read-only mapping of the file it is mapped from (a safetensors
    checkpoint loaded lazily); None where it is not in a file, or differs from the file there."""
    nbytes = weight.numel() * weight.element_size()
    if weight.device.type != "cpu" or not weight.is_contiguous() or not nbytes:
        return None
    place = file_mapping_at(weight.data_ptr(), nbytes)
    if place is None:
        return None
    path, offset, _ = place
    try:
        data = np.memmap(path, np.uint8, mode="r", offset=offset, shape=(nbytes,))
    except (OSError, ValueError):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not writable": it is only read
        table = torch.frombuffer(data, dtype=weight.dtype).view(weight.shape)
    same = torch.equal(table[:1], weight[:1]) and torch.equal(table[-1:], weight[-1:])
    return table if same else None


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                   chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """F.linear(x, weight.to(dtype), bias.to(dtype)) with at most `chunk_bytes` of cast weight alive."""
    bias = None if bias is None else bias.to(dtype)
    rows = max(1, chunk_bytes // max(1, weight.shape[1] * dtype.itemsize))
    if weight.shape[0] <= rows:
        return F.linear(x, weight.to(dtype), bias)
    out = x.new_empty(*x.shape[:-1], weight.shape[0], dtype=dtype)
    for start in range(0, weight.shape[0], rows):
        stop = min(start + rows, weight.shape[0])
        out[..., start:stop] = F.linear(x, weight[start:stop].to(dtype), None if bias is None else bias[start:stop])
    return out


def compute_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Make `model` compute in `dtype` while its floating-point weights stay as stored (see the
    module docstring). Idempotent; returns `model`."""
    for module in model.modules():
        if getattr(module, "computes_from_storage", False):
            continue  # casts its own storage per call (NVFP4 Linears: packed codes and fp8 scales)
        own = [p for p in module.parameters(recurse=False) if p.is_floating_point() and p.dtype != dtype]
        for p in own:
            if not upcasts_exactly(p.dtype, dtype):
                p.data = p.data.to(dtype)  # narrower (or sideways) compute: cast once, as a load in `dtype` does
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and upcasts_exactly(buf.dtype, dtype):
                setattr(module, name, buf.to(dtype))  # rotary tables, routing biases: small
        own = [p for p in own if p.dtype != dtype]
        if type(module) in (nn.Embedding, UpcastEmbedding):
            # max_norm renormalises rows in place: such a table is never read through the file
            table = read_only_table(module.weight.data) if module.max_norm is None else None
            if own or table is not None:
                module.__class__, module.compute_dtype = UpcastEmbedding, dtype
                module.file_table = (table, module.weight.data_ptr())
            continue
        if not own:
            continue
        if type(module) in (nn.Linear, UpcastLinear):
            module.__class__, module.compute_dtype = UpcastLinear, dtype
        elif sum(p.numel() for p in own) <= SMALL_NUMEL:
            for p in own:
                p.data = p.data.to(dtype)
        else:
            _upcast_around_calls(module, own, dtype)
    model.compute_dtype = dtype
    return model


def _upcast_around_calls(module: nn.Module, params: list[nn.Parameter], dtype: torch.dtype) -> None:
    """The module's own large parameters (fused experts) are cast for each call and restored after:
    one such module's cast copy is alive at a time. The swap is serialised per module."""
    if getattr(module, "_stored_forward", None) is not None:
        return
    inner, lock = module.forward, threading.RLock()

    def forward(*args, **kwargs):
        with lock:
            stored = [p.data for p in params]
            try:
                for p in params:
                    p.data = p.data.to(dtype)
                return inner(*args, **kwargs)
            finally:
                for p, data in zip(params, stored):
                    p.data = data

    module._stored_forward = inner
    module.forward = forward


def stored_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as held (shared tensors once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
