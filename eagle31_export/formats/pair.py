"""A drafter and its target read together, checked for compatibility, taps resolved.

Every command that takes `--drafter D --target T` starts here, so "does not fit" is decided
in one place (the rules themselves are `config.compatibility_problems`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle31_export.config import TargetInfo, compatibility_problems, with_max_positions
from eagle31_export.errors import UserError
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter
from eagle31_export.formats.target.checkpoint import read_target_info


@dataclass
class PairSpec:
    """A drafter checkpoint fitted to a target: nothing loaded but the drafter's lazy tensors."""

    checkpoint: DrafterCheckpoint
    target_path: Path
    target_info: TargetInfo
    aux_layer_ids: tuple[int, ...]  # output-of-layer numbering, resolved against the target


def pair_problems(ckpt: DrafterCheckpoint, info: TargetInfo) -> list[str]:
    """Every reason `ckpt` cannot run on a target described by `info`, as user-facing lines."""
    d2t = ckpt.d2t()
    top = int((torch.arange(d2t.numel()) + d2t).max()) if d2t.numel() else None
    return compatibility_problems(ckpt.config, info, top)


def check_fits(ckpt: DrafterCheckpoint, info: TargetInfo, drafter_name: object, target_name: object) -> None:
    problems = pair_problems(ckpt, info)
    if problems:
        raise UserError(f"drafter {drafter_name} does not fit target {target_name}: {problems[0]}")


def read_pair(drafter: str | os.PathLike | DrafterCheckpoint, target: str | os.PathLike) -> PairSpec:
    """Read the drafter (or take a checkpoint already read) and the target's config; refuse a misfit."""
    ckpt = drafter if isinstance(drafter, DrafterCheckpoint) else read_drafter(drafter)
    name = ckpt.path if isinstance(drafter, DrafterCheckpoint) else drafter
    info = read_target_info(target)
    check_fits(ckpt, info, name, target)
    # a drafter config without max_position_embeddings serves its target's context (config.with_max_positions)
    ckpt.config = with_max_positions(ckpt.config, info)
    ids = ckpt.config.resolved_aux_layer_ids(info.num_hidden_layers)
    return PairSpec(ckpt, Path(target), info, ids)
