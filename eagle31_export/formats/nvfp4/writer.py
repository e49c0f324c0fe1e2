"""Writing NVFP4 checkpoints tensor by tensor, in either convention.

`ShardedWriter` holds at most one shard in memory. `LinearWriter` names a quantized
Linear's tensors for the target convention and turns scales into compressed-tensors'
reciprocal global scales (or back), recording source values that FP32 reciprocals would
not reproduce so that a conversion round trip is lossless.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle31_export.errors import UserError
from eagle31_export.formats.nvfp4.numerics import reciprocal_f32
from eagle31_export.formats.nvfp4.scheme import EXACT_INVERSE_KEY, HF_QUANT_CONFIG, QuantScheme, exact_inverse
from eagle31_export.formats.safetensors_io import INDEX_NAME, SINGLE_NAME, write_json

DEFAULT_MAX_SHARD_BYTES = 2 << 30
# Files of a source checkpoint that a writer produces itself rather than copies.
_NOT_COPIED = {INDEX_NAME, "config.json", HF_QUANT_CONFIG, "manifest.json"}

# `progress(done, total, description)`: `done` of `total` tensors written so far, and what is
# being done ("quantize: model.layers.0.mlp.up_proj.weight"). The library only reports; a UI
# (the CLI's `quantize`) draws it.
ProgressCallback = Callable[[int, int, str], None]


class ShardedWriter:
    """Accumulates tensors into shards of at most `max_shard_bytes`, written as they fill."""

    def __init__(self, folder: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.pending_records: dict[str, str] = {}
        self.shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor, exact_source: float | None = None) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes
        if exact_source is not None:
            self.pending_records[name] = float(exact_source).hex()

    def close(self) -> None:
        """Write the last shard; name shards as transformers does; index when sharded."""
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            os.replace(self.shards[0][0], self.folder / SINGLE_NAME)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(path, self.folder / final)
            weight_map.update({n: final for n in names})
        write_json(self.folder / INDEX_NAME, {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})

    def _flush(self) -> None:
        path = self.folder / f".shard-{len(self.shards):05d}.safetensors"
        metadata = {"format": "pt"}
        if self.pending_records:
            metadata[EXACT_INVERSE_KEY] = json.dumps(self.pending_records, sort_keys=True)
        save_file(self.pending, str(path), metadata=metadata)
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes, self.pending_records = {}, 0, {}


def other_convention(stored: float, recorded: float | None) -> tuple[float, float | None]:
    """(value in the other convention, source value to record or None).

    The record is needed only when the FP32 reciprocal of the new value misses the source.
    """
    new = exact_inverse(stored, recorded)
    return new, (stored if reciprocal_f32(new) != stored else None)


class LinearWriter:
    """Writes quantized Linears (scales given in ModelOpt's convention) for `scheme`."""

    def __init__(self, writer: ShardedWriter, scheme: QuantScheme):
        self.writer, self.scheme = writer, scheme

    def add(self, module: str, packed: torch.Tensor, weight_scale: torch.Tensor,
            weight_scale_2: float, input_scale: float | None,
            records: dict[str, float | None] | None = None) -> None:
        """`records`: per role ('global', 'input'), the exact other-convention value if known."""
        records = records or {}
        s = self.scheme
        self.writer.add(f"{module}.{s.suffix('packed')}", packed)
        self.writer.add(f"{module}.{s.suffix('scale')}", weight_scale)
        self._scalar(f"{module}.{s.suffix('global')}", weight_scale_2, records.get("global"))
        if input_scale is not None:
            self._scalar(f"{module}.{s.suffix('input')}", input_scale, records.get("input"))

    def add_kv_scale(self, attn_module: str, which: str, value: float) -> None:
        name = self.scheme.kv_scale_name(attn_module, which)
        self.writer.add(name, _scalar_tensor(value, self.scheme))

    def _scalar(self, name: str, scale: float, known_inverse: float | None) -> None:
        record = None
        if self.scheme.is_reciprocal():
            # `scale` is ModelOpt's value; store its reciprocal, and `scale` where needed.
            value, record = other_convention(scale, known_inverse)
        else:
            value = scale
            # Keep the compressed-tensors value this came from if its reciprocal misses it.
            if known_inverse is not None and reciprocal_f32(scale) != known_inverse:
                record = known_inverse
        self.writer.add(name, _scalar_tensor(value, self.scheme), record)


def _scalar_tensor(value: float, scheme: QuantScheme) -> torch.Tensor:
    # ModelOpt writes 0-dim scalars, compressed-tensors shape [1].
    t = torch.tensor(value, dtype=torch.float32)
    return t.reshape(1) if scheme.format == "compressed-tensors" else t


def check_distinct(src: Path, out: Path) -> None:
    """Refuse to write a checkpoint over its own source (--force would delete the source)."""
    if Path(out).resolve() == Path(src).resolve():
        raise UserError(f"--out {out} is the input checkpoint itself; write to another folder")


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config and the like: every top-level file that is not weights
    or a declaration the writer produces."""
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in _NOT_COPIED:
            shutil.copy2(p, dst / p.name)


def tensor_steps(progress: ProgressCallback | None, total: int, title: str) -> Callable[..., None]:
    """`step(name, n=1)`: counts `n` more of `total` tensors handled and reports it to `progress`.

    `progress` (None: nothing is reported) is called once with (0, total, title) at the start,
    then with (done, total, "<title>: <name>") after each step.
    """
    if progress is None:
        return lambda *_: None
    done = 0
    progress(0, total, title)

    def step(name: str, n: int = 1) -> None:
        nonlocal done
        done += n
        progress(done, total, f"{title}: {name}")

    return step
