"""Pickle checkpoints (`pytorch_model.bin`, sharded or not) to safetensors, without unpickling code.

The original EAGLE release publishes its EAGLE-3 drafters as `pytorch_model.bin`. Nothing else
in this package reads pickle; `eagle31-export convert` is the one place that does, and only with
`torch.load(weights_only=True)`: PyTorch's restricted unpickler, which builds tensors and plain
containers and refuses every other object (no code runs). A file holding anything but a flat
name -> tensor mapping is refused.

The output is the same checkpoint with `model.safetensors` (or shards plus
`model.safetensors.index.json`) in place of the pickle files; every other file (config.json, the
tokenizer, ...) is copied as it is.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle31_export.errors import CheckpointError, UserError
from eagle31_export.formats.safetensors_io import INDEX_NAME, SINGLE_NAME, SafetensorsDir, read_json, write_json

PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLES = ("pytorch_model.bin", "model.pt", "pytorch_model.pt")


@dataclass
class ConvertResult:
    out: Path
    tensors: int = 0
    bytes: int = 0
    shards: list[str] = field(default_factory=list)


def pickle_files(src: Path) -> tuple[list[Path], dict[str, str] | None]:
    """(pickle shard files in order, the index's weight_map or None) of a checkpoint folder."""
    index = src / PICKLE_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: malformed index; expected a 'weight_map' object of tensor name -> file")
        files = []
        for name in sorted(set(weight_map.values())):
            if Path(name).name != name or not (src / name).is_file():
                raise CheckpointError(f"{index}: names shard {name!r}, which is not a file in {src}")
            files.append(src / name)
        return files, weight_map
    for name in PICKLE_SINGLES:
        if (src / name).is_file():
            return [src / name], None
    raise UserError(f"{src}: no pickle weights to convert (looked for {PICKLE_INDEX}, {', '.join(PICKLE_SINGLES)})")


def load_tensors_only(path: Path) -> dict[str, torch.Tensor]:
    """A flat name -> tensor mapping from a pickle file, read with PyTorch's weights-only unpickler."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap" not in str(err):  # files in the legacy (pre-zip) format cannot be mapped
                    raise
                obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, OSError) as err:
        raise CheckpointError(f"{path}: not a tensors-only PyTorch file ({_reason(err)}); refused without running "
                              "anything it holds") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        kind = type(obj).__name__
        raise CheckpointError(f"{path}: holds a {kind}, not a flat mapping of tensor names to tensors; "
                              "save the model's state_dict() instead")
    return obj


def _reason(err: Exception) -> str:
    """What the weights-only unpickler objected to, without PyTorch's advice to unpickle fully."""
    text = str(err)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"it references {found.group(1)}, which tensors and plain containers never do"
    return (text.strip().splitlines() or [type(err).__name__])[0][:200]


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, each with its own storage (safetensors stores no aliases: tied copies
    are written twice)."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        out[name] = t
    return out


def convert_pickle_checkpoint(src: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> ConvertResult:
    """Write `src` (a checkpoint folder with pickle weights) to `out` with safetensors weights."""
    from eagle31_export.formats.outputs import atomic_output_dir, check_output

    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such checkpoint folder")
    if any(src.glob("*.safetensors")):
        raise UserError(f"{src} already holds safetensors weights; nothing to convert")
    files, weight_map = pickle_files(src)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src}: no config.json; expected a drafter or target checkpoint folder")
    read_json(src / "config.json")  # a damaged config fails here, not in the reader after conversion
    check_output(out, force, [src])
    result = ConvertResult(Path(out))
    skip = {p.name for p in files} | {PICKLE_INDEX}
    with atomic_output_dir(out, force=force, inputs=[src]) as tmp:
        names: dict[str, str] = {}
        for i, path in enumerate(files):
            tensors = load_tensors_only(path)
            if weight_map is not None:
                listed = {n for n, f in weight_map.items() if f == path.name}
                if set(tensors) != listed:
                    odd = sorted(set(tensors) ^ listed)[0]
                    raise CheckpointError(f"{src / PICKLE_INDEX}: does not match {path.name} (tensor {odd!r}); "
                                          "the index and the shards do not belong together")
            twice = sorted(set(tensors) & set(names))
            if twice:
                raise CheckpointError(f"{path}: tensor {twice[0]!r} is also in {names[twice[0]]}")
            shard = SINGLE_NAME if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            save_file(_unshared(tensors), str(tmp / shard), metadata={"format": "pt"})
            names.update(dict.fromkeys(tensors, shard))
            result.shards.append(shard)
            result.tensors += len(tensors)
            result.bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        if len(files) > 1:
            write_json(tmp / INDEX_NAME, {"metadata": {"total_size": result.bytes}, "weight_map": names})
        for item in sorted(src.iterdir()):
            if item.is_file() and item.name not in skip and not item.name.startswith("."):
                shutil.copy2(item, tmp / item.name)
        SafetensorsDir(tmp)  # what was written reads back
    return result
