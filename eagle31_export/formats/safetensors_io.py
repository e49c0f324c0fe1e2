"""Lazy, streaming access to (possibly sharded) safetensors checkpoints, and atomic writes.

Every shard header is read and checked before any tensor is (`read_header`): its length
against the file size, before the JSON is parsed; every tensor's dtype, shape and byte range;
the ranges tiling the data exactly. A damaged or truncated file is named in one line here, not
deep inside a loader.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle31_export.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "pytorch_model.pt")
# The safetensors library refuses headers above 100 MB; so does this reader, before reading one.
MAX_HEADER_BYTES = 100_000_000
# Bytes per element of each safetensors dtype (None: sub-byte types, whose size is not checked).
DTYPE_BYTES: dict[str, int | None] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "I64": 8, "U64": 8, "F64": 8,
    "F4": None, "F6_E2M3": None, "F6_E3M2": None,
}
# The torch dtype of each floating-point safetensors dtype a checkpoint stores weights in.
FLOAT_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# Stored dtype -> the wider dtypes that hold each of its values exactly (a cast there is lossless,
# so computing in them from stored weights gives what loading the weights in them gives).
_EXACT_UPCASTS = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64),
                  torch.float32: (torch.float64,)}


def upcasts_exactly(stored: torch.dtype, compute: torch.dtype) -> bool:
    """True when every `stored` value is exactly a `compute` value and `compute` is wider: weights
    can then stay as stored and be cast per operation with the same results."""
    return compute in _EXACT_UPCASTS.get(stored, ())


def stored_float_dtype(source: "SafetensorsDir") -> torch.dtype | None:
    """The floating-point dtype most of the checkpoint's floating-point bytes are stored in
    (None when it stores none)."""
    by_dtype: dict[str, int] = {}
    for entry in source.headers.values():
        if entry.dtype in FLOAT_TORCH_DTYPES:
            by_dtype[entry.dtype] = by_dtype.get(entry.dtype, 0) + entry.end - entry.begin
    return FLOAT_TORCH_DTYPES[max(by_dtype, key=by_dtype.get)] if by_dtype else None


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as its shard header declares it; `begin`/`end` are absolute file offsets."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str | os.PathLike) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """Every tensor's dtype, shape and byte range, and the header metadata, all checked.

    The header length is checked against the file size before anything is parsed; the JSON must
    be an object of well-formed entries whose byte ranges tile the data exactly, as the
    safetensors format requires; a file shorter than its header declares is reported as truncated.
    """
    path = Path(path)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a valid safetensors file ({what}); re-download or re-save it")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            header_len = struct.unpack("<Q", prefix)[0]
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise bad(f"header length {header_len} bytes, but the file holds {size} bytes"
                          if header_len > size - 8 else f"header length {header_len} bytes, above the 100 MB limit")
            raw = f.read(header_len)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise bad(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ is not an object of strings")
    base = 8 + header_len
    entries: dict[str, HeaderEntry] = {}
    for name, v in header.items():
        entries[name] = _entry(name, v, base, bad)
    cursor = 0
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin - base != cursor:
            raise bad(f"tensor {name!r} starts at data byte {e.begin - base}, expected {cursor} "
                      "(tensor data overlaps or leaves a gap)")
        cursor = e.end - base
    if size < base + cursor:
        raise CheckpointError(f"{path}: truncated ({size} bytes, the header declares {base + cursor}); it holds "
                              f"{max(size - base, 0)} of {cursor} bytes of tensor data: re-download or re-save it")
    if size > base + cursor:
        raise bad(f"{size - base - cursor} bytes after the last tensor")
    return entries, metadata


def _entry(name: str, v, base: int, bad) -> HeaderEntry:
    if not isinstance(v, dict):
        raise bad(f"entry {name!r} is not an object")
    dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise bad(f"tensor {name!r} has shape {shape!r}; expected a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end] with 0 <= begin <= end")
    width = DTYPE_BYTES[dtype]
    nbytes = offsets[1] - offsets[0]
    if width is not None and nbytes != math.prod(shape) * width:
        raise bad(f"tensor {name!r} is {dtype} {shape} ({math.prod(shape) * width} bytes) but occupies {nbytes} bytes")
    return HeaderEntry(dtype, tuple(shape), base + offsets[0], base + offsets[1])


class SafetensorsDir(Mapping[str, torch.Tensor]):
    """A read-only mapping name -> tensor over every shard of a checkpoint folder.

    Every shard header is read and checked once on construction (`read_header`); tensors are
    read one at a time on access (`safe_open`), so memory does not grow with model size.
    Shapes and dtypes are available without reading data.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._where, self.headers = _tensor_locations(self.folder)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            shard = self._where[name]
        except KeyError:
            raise KeyError(name) from None
        with _open(self.folder / shard) as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where  # from the headers: Mapping's default would read the tensor

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, name: str) -> Path:
        return self.folder / self._where[name]

    def shape_and_dtype(self, name: str) -> tuple[list[int], str]:
        entry = self.headers[name]
        return list(entry.shape), entry.dtype

    def nbytes(self) -> int:
        return sum(e.end - e.begin for e in self.headers.values())

    def iter_shards(self) -> Iterator[tuple[Path, list[str]]]:
        """(shard path, tensor names) in file order, for streaming passes."""
        by_shard: dict[str, list[str]] = {}
        for name, shard in self._where.items():
            by_shard.setdefault(shard, []).append(name)
        for shard in sorted(by_shard):
            yield self.folder / shard, by_shard[shard]

    def iter_chunks(self, names: list[str] | None = None, chunk_bytes: int = 64 << 20
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, piece) over the tensors in file order, each cut along its first dimension into
        pieces of about `chunk_bytes`: a pass over every value with memory bounded by one piece.

        The file mapping is reopened every `chunk_bytes` bytes: pages read through a mapping
        count in the process RSS until it is unmapped."""
        wanted = None if names is None else set(names)
        for shard, shard_names in self.iter_shards():
            todo = sorted((n for n in shard_names if wanted is None or n in wanted), key=lambda n: self.headers[n].begin)
            handed_out, f, ctx = 0, None, None
            try:
                for name in todo:
                    entry = self.headers[name]
                    if f is None or handed_out >= chunk_bytes:
                        if ctx is not None:
                            ctx.__exit__(None, None, None)
                        ctx = _open(shard)
                        f, handed_out = ctx.__enter__(), 0
                    handed_out += entry.end - entry.begin
                    width = DTYPE_BYTES[entry.dtype] or 1
                    rows = entry.shape[0] if entry.shape else 1
                    row_bytes = (entry.numel // rows if rows else 0) * width
                    if not entry.shape or row_bytes * rows <= chunk_bytes:
                        yield name, f.get_tensor(name)
                        continue
                    step = max(1, chunk_bytes // max(row_bytes, 1))
                    piece = f.get_slice(name)
                    for start in range(0, rows, step):
                        yield name, piece[start:start + step]
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)


@contextlib.contextmanager
def _open(path: Path):
    try:
        f = safe_open(str(path), framework="pt")
    except Exception as err:  # safetensors raises its own error types for header problems
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); re-save or re-download it") from None
    try:
        yield f
    finally:
        del f


def check_complete(path: Path) -> None:
    """A shard's header must be valid and its size match what the header declares: a truncated
    download fails here, by name."""
    read_header(path)


def pickle_refusal(folder: Path, pickle_name: str) -> CheckpointError:
    return CheckpointError(
        f"{folder}: only pickle weights ({pickle_name}), which are not unpickled for safety; convert the checkpoint "
        f"to safetensors with `eagle31-export convert {folder} --out DIR`"
    )


def _tensor_locations(folder: Path) -> tuple[dict[str, str], dict[str, HeaderEntry]]:
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    index = folder / INDEX_NAME
    headers: dict[str, HeaderEntry] = {}
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise CheckpointError(f"{index}: malformed index; expected a 'weight_map' object of tensor name -> "
                                  "shard file name")
        in_shard: dict[str, dict[str, HeaderEntry]] = {}
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard or shard in (".", ".."):
                raise CheckpointError(f"{index}: shard name {shard!r} is not a file name in {folder}")
            if not (folder / shard).is_file():
                raise CheckpointError(f"{index}: names shard {shard}, which is missing from {folder}")
            in_shard[shard] = read_header(folder / shard)[0]
        for name, shard in weight_map.items():
            if name not in in_shard[shard]:
                raise CheckpointError(f"{index}: places tensor {name!r} in {shard}, which does not contain it; "
                                      "the index and the shards do not belong together")
            headers[name] = in_shard[shard][name]
        return dict(weight_map), headers
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        pickles = [n for n in PICKLE_NAMES if (folder / n).exists()]
        if pickles:
            raise pickle_refusal(folder, pickles[0])
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    where: dict[str, str] = {}
    for shard in shards:
        found = read_header(folder / shard)[0]
        for name, entry in found.items():
            if name in where:
                raise CheckpointError(f"{folder}: tensor {name!r} is stored twice ({where[name]} and {shard}); "
                                      "remove the stale shard")
            where[name] = shard
            headers[name] = entry
    return where, headers


def read_json(path: Path) -> dict:
    """A JSON object from a file (configs, indexes, records): anything else is one clear error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not valid JSON (not UTF-8 text)") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: a JSON {type(obj).__name__}; expected an object {{...}}")
    return obj


def write_json(path: Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def save_tensors(tensors: Mapping[str, torch.Tensor], folder: Path, max_shard_bytes: int | None = None) -> None:
    """Write tensors as one file, or as shards plus an index when `max_shard_bytes` is set."""
    folder = Path(folder)
    items = [(k, v.contiguous()) for k, v in tensors.items()]
    if max_shard_bytes is None:
        save_file(dict(items), str(folder / SINGLE_NAME), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for _, t in items)
    write_json(folder / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, references=None) -> None:
    """manifest.json of an output folder: see `formats/outputs.py`, where outputs are defined."""
    from eagle31_export.formats.outputs import write_manifest as write

    write(folder, references)


def atomic_output_dir(out: str | os.PathLike, force: bool = False, inputs=(), references=None):
    """Build an output in a temporary sibling and move it into place when complete: the context
    manager of `formats/outputs.py` (where --out safety, --force replacement and manifests live)."""
    from eagle31_export.formats.outputs import atomic_output_dir as atomic

    return atomic(out, force, inputs, references)
