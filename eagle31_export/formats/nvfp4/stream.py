"""Low-level streaming over safetensors shards: headers, scalars, and tensors in file order.

Reading a multi-GB checkpoint fast and in bounded memory comes down to three things done
here: parse each shard header once (not once per tensor), visit tensors in file order with
the kernel told what comes next (POSIX_FADV_WILLNEED, so cold reads are large sequential
I/O), and hand out zero-copy views of a memory map that is reopened regularly, because the
pages touched through a mapping count in the process RSS until it is unmapped.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle31_export.errors import CheckpointError
from eagle31_export.formats.safetensors_io import INDEX_NAME, read_header, read_json

# Hand out at most this many bytes through one mapping before reopening it.
REOPEN_BYTES = 64 << 20
# Ask the kernel to read this far ahead of the tensor being handed out.
PREFETCH_BYTES = 256 << 20


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: str
    shape: list[int]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def shard_files(folder: Path) -> list[Path]:
    """The shard files of a checkpoint folder (those its index names, else every *.safetensors)."""
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: malformed index; expected a 'weight_map' object of tensor name -> "
                                  "shard file name")
        return [folder / s for s in sorted(set(weight_map.values())) if (folder / s).is_file()]
    return sorted(folder.glob("*.safetensors"))


def read_shard_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Every tensor's dtype, shape and byte range, and the header metadata, checked against
    the file size (`safetensors_io.read_header`): a file cut short (interrupted download or
    copy) is named here precisely."""
    found, metadata = read_header(path)
    entries = {name: TensorEntry(path, e.dtype, list(e.shape), e.begin, e.end) for name, e in found.items()}
    return entries, metadata


def read_f32_scalars(entries: list[TensorEntry]) -> list[float]:
    """Values of float32 scalars (shape [] or [1]), one small read each, one open per file."""
    values: list[float] = []
    fds: dict[Path, int] = {}
    try:
        for e in entries:
            if e.path not in fds:
                fds[e.path] = os.open(e.path, os.O_RDONLY)
            values.append(struct.unpack("<f", os.pread(fds[e.path], 4, e.begin))[0])
    finally:
        for fd in fds.values():
            os.close(fd)
    return values


class safe_open_checked:
    """safe_open with a one-line error naming the file."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self.f = safe_open(str(self.path), framework="pt")
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({err}); "
                                  "re-download or re-export it") from None
        return self.f

    def __exit__(self, *exc):
        del self.f
        return False


class TensorStream:
    """Zero-copy tensors, best requested in file order (see the module docstring).

    A tensor stays valid after the stream moves on: it keeps its mapping alive until dropped.
    """

    def __init__(self, entries: dict[str, TensorEntry]):
        self.entries = entries
        self.path: Path | None = None
        self.handle = None
        self.fd: int | None = None
        self.handed_out = 0
        self.prefetched_to = 0

    def __enter__(self) -> "TensorStream":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if entry.path != self.path or self.handed_out > REOPEN_BYTES:
            self._reopen(entry.path)
        if entry.end > self.prefetched_to and hasattr(os, "posix_fadvise"):
            self.prefetched_to = max(entry.end, entry.begin + PREFETCH_BYTES)
            os.posix_fadvise(self.fd, entry.begin, self.prefetched_to - entry.begin, os.POSIX_FADV_WILLNEED)
        self.handed_out += entry.nbytes
        return self.handle.get_tensor(name)

    def _reopen(self, path: Path) -> None:
        same_file = path == self.path
        self.close(keep_fd=same_file)
        self._ctx = safe_open_checked(path)
        self.handle, self.path = self._ctx.__enter__(), path
        if self.fd is None:
            self.fd = os.open(path, os.O_RDONLY)
            self.prefetched_to = 0

    def close(self, keep_fd: bool = False) -> None:
        if self.handle is not None:
            self.handle = None
            self._ctx.__exit__(None, None, None)
        if self.fd is not None and not keep_fd:
            os.close(self.fd)
            self.fd = None
        self.handed_out = 0
        if not keep_fd:
            self.path = None
