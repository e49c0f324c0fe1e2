"""Load a drafter and its target together, checked for compatibility, as reference backends."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from eagle31_export.config import TargetInfo, compatibility_problems
from eagle31_export.errors import UserError
from eagle31_export.formats.drafter import DrafterCheckpoint, read_drafter
from eagle31_export.formats.target import read_target_info
from eagle31_export.reference.drafter import build_drafter
from eagle31_export.reference.speculate import ReferenceDrafterBackend
from eagle31_export.reference.target import ReferenceTarget, load_target


@dataclass
class ReferencePair:
    checkpoint: DrafterCheckpoint
    target_info: TargetInfo
    aux_layer_ids: tuple[int, ...]
    target: ReferenceTarget
    drafter: ReferenceDrafterBackend


def check_pair(ckpt: DrafterCheckpoint, info: TargetInfo) -> list[str]:
    d2t = ckpt.d2t()
    top = int((torch.arange(d2t.numel()) + d2t).max()) if d2t.numel() else None
    return compatibility_problems(ckpt.config, info, top)


def load_pair(drafter_path: str | os.PathLike, target_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              act_quant: bool = False, kernels=None) -> ReferencePair:
    ckpt = read_drafter(drafter_path)
    info = read_target_info(target_path)
    problems = check_pair(ckpt, info)
    if problems:
        raise UserError(f"drafter {drafter_path} does not fit target {target_path}: {problems[0]}")
    ids = ckpt.config.resolved_aux_layer_ids(info.num_hidden_layers)
    target = load_target(target_path, ids, dtype=dtype, act_quant=act_quant)
    drafter = build_drafter(ckpt, dtype=dtype, target_model=target.model, kernels=kernels)
    return ReferencePair(ckpt, info, ids, target, ReferenceDrafterBackend(drafter))
