"""Copy a safetensors checkpoint folder with some tensors under other names.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte range of
the data that follows) and the data: renaming tensors rewrites the header only, and the data is
copied as it is (streamed by the OS), so a copy costs no more than a plain one.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Mapping

from eagle31_export.formats.safetensors_io import INDEX_NAME, read_json, write_json

HEADER_ALIGN = 8  # safetensors pads its header with spaces to a multiple of 8 bytes


def copy_folder_renaming(src: Path, dest: Path, renames: Mapping[str, str], skip: tuple[str, ...] = ()) -> list[str]:
    """Copy `src` to `dest` (hidden names and `skip` left out) with each tensor `old` of `renames`
    stored as `renames[old]`; the index's weight map follows. Returns the files rewritten."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".*", *skip))
    if not renames:
        return []
    rewritten = []
    for shard in sorted(dest.glob("*.safetensors")):
        if _rename_in_shard(src / shard.name, shard, renames):
            rewritten.append(shard.name)
    index = dest / INDEX_NAME
    if index.is_file():
        doc = read_json(index)
        weight_map = doc.get("weight_map") or {}
        if any(name in weight_map for name in renames):
            doc["weight_map"] = {renames.get(name, name): file for name, file in weight_map.items()}
            write_json(index, doc)
            rewritten.append(INDEX_NAME)
    return rewritten


def _rename_in_shard(src: Path, dest: Path, renames: Mapping[str, str]) -> bool:
    with open(src, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        if not any(name in header for name in renames):
            return False
        renamed = {renames.get(name, name): entry for name, entry in header.items()}
        text = json.dumps(renamed, separators=(",", ":")).encode()
        text += b" " * (-len(text) % HEADER_ALIGN)
        with open(dest, "wb") as out:
            out.write(struct.pack("<Q", len(text)))
            out.write(text)
            shutil.copyfileobj(f, out, 1 << 22)  # the data, after the old header
    return True
