"""What `inspect` reports about a drafter or target folder, as one JSON-able dict."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from eagle31_export.config import output_to_before_layer
from eagle31_export.errors import CheckpointError
from eagle31_export.formats.drafter import read_drafter
from eagle31_export.formats.pair import pair_problems
from eagle31_export.formats.safetensors_io import read_json
from eagle31_export.formats.target import inspect_target, read_target_info


def is_drafter(path: Path) -> bool:
    from eagle31_export.formats.drafter_formats import looks_like_drafter  # the markers detect_format uses

    return looks_like_drafter(read_json(path / "config.json"))


def inspect_path(path: str | os.PathLike, target: str | os.PathLike | None = None) -> dict[str, Any]:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; pass a drafter or target checkpoint folder")
    if not is_drafter(path):
        if target is not None:
            raise CheckpointError(f"{path} is a target checkpoint; --target only applies to drafters")
        return inspect_target(path)
    return inspect_drafter(path, target)


def inspect_drafter(path: Path, target: str | os.PathLike | None) -> dict[str, Any]:
    ckpt = read_drafter(path, strict=False)  # value problems are reported, not raised
    cfg = ckpt.config
    problems: list[str] = list(ckpt.problems)
    ids = cfg.aux_layer_ids
    if target is not None:
        info = read_target_info(target)
        problems += pair_problems(ckpt, info) if not ckpt.problems else []
        if not any("tapped" in p for p in problems):
            ids = cfg.resolved_aux_layer_ids(info.num_hidden_layers)
    config = cfg.to_dict()
    config["aux_layer_ids"] = list(ids) if ids is not None else None
    return {
        "kind": "drafter",
        "format": ckpt.format,
        "eagle_version": cfg.eagle_version,
        "config": config,
        "tapped_layers": {
            "output_of_layer": list(ids) if ids is not None else None,
            "before_layer": list(output_to_before_layer(ids)) if ids is not None else None,
        },
        "tensors": sorted(ckpt.tensors),
        "unknown_config_keys": ckpt.unknown_config_keys,
        "problems": problems,
    }
