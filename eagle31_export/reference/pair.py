"""Load a drafter and its target together, checked for compatibility, as reference backends."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from eagle31_export.config import TargetInfo
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint
from eagle31_export.formats.pair import read_pair
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


def load_pair(drafter_path: str | os.PathLike, target_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              act_quant: bool = False, kernels=None, nvfp4_semantics: str = "exact") -> ReferencePair:
    spec = read_pair(drafter_path, target_path)
    target = load_target(target_path, spec.aux_layer_ids, dtype=dtype, act_quant=act_quant,
                         nvfp4_semantics=nvfp4_semantics)
    drafter = build_drafter(spec.checkpoint, dtype=dtype, target_model=target.model, kernels=kernels)
    return ReferencePair(spec.checkpoint, spec.target_info, spec.aux_layer_ids, target, ReferenceDrafterBackend(drafter))
