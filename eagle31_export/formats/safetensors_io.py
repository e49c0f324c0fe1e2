"""Lazy, streaming access to (possibly sharded) safetensors checkpoints, and atomic writes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle31_export.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "pytorch_model.pt")


class SafetensorsDir(Mapping[str, torch.Tensor]):
    """A read-only mapping name -> tensor over every shard of a checkpoint folder.

    Tensors are read one at a time on access (`safe_open`), so memory does not grow with
    model size. Shapes and dtypes are available without reading data.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._where = _tensor_locations(self.folder)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            shard = self._where[name]
        except KeyError:
            raise KeyError(name) from None
        with _open(self.folder / shard) as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, name: str) -> Path:
        return self.folder / self._where[name]

    def shape_and_dtype(self, name: str) -> tuple[list[int], str]:
        with _open(self.file_of(name)) as f:
            sl = f.get_slice(name)
            return list(sl.get_shape()), str(sl.get_dtype())

    def iter_shards(self) -> Iterator[tuple[Path, list[str]]]:
        """(shard path, tensor names) in file order, for streaming passes."""
        by_shard: dict[str, list[str]] = {}
        for name, shard in self._where.items():
            by_shard.setdefault(shard, []).append(name)
        for shard in sorted(by_shard):
            yield self.folder / shard, by_shard[shard]


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
    """A shard's size must match what its header declares: a truncated download fails here, by name."""
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); re-save or re-download it") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    expected, found = 8 + header_len + end, path.stat().st_size
    if found < expected:
        raise CheckpointError(f"{path}: truncated ({found} bytes, the header declares {expected}); "
                              "re-download or re-save the checkpoint")


def _tensor_locations(folder: Path) -> dict[str, str]:
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: malformed index ({err}); expected a 'weight_map' object") from None
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise CheckpointError(f"{index}: names shard {shard}, which is missing from {folder}")
            check_complete(folder / shard)
        return dict(weight_map)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        pickles = [n for n in PICKLE_NAMES if (folder / n).exists()]
        if pickles:
            raise CheckpointError(
                f"{folder}: only pickle weights ({pickles[0]}); pickle is not loaded for safety: "
                "convert the checkpoint to safetensors first"
            )
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    where: dict[str, str] = {}
    for shard in shards:
        check_complete(folder / shard)
        with _open(folder / shard) as f:
            for name in f.keys():
                where[name] = shard
    return where


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None


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


def write_manifest(folder: Path) -> None:
    """manifest.json: sha256 and size of every file in the folder (recursively)."""
    folder = Path(folder)
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            files[str(p.relative_to(folder))] = {"sha256": sha256_of(p), "bytes": p.stat().st_size}
    write_json(folder / "manifest.json", {"files": files})


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it is renamed to `out` with a manifest.

    On any error the temporary folder is removed and `out` is untouched: nothing half-written.
    """
    from eagle31_export.errors import UserError

    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out} already exists; choose another --out or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        write_manifest(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the result is an ordinary folder
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def built_in_place(out: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Like `atomic_output_dir`, but built at its final path: for outputs whose files record their
    own absolute paths (serving bundles name their drafter folder). On any error the folder is
    removed, so a failed run still leaves nothing half-written."""
    from eagle31_export.errors import UserError

    out = Path(out)
    if out.exists():
        if not force:
            raise UserError(f"{out} already exists; choose another --out or pass --force to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    try:
        yield out
        write_manifest(out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
