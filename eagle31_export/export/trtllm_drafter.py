"""Whether TensorRT-LLM would run a drafter like the reference, and the drafter folder of its bundle.

The layout itself (config keys, `midlayer.*` names, int32 `d2t`, no `t2d`) is a format like any
other: `formats.drafter.formats.TrtllmFormat`, read back by `formats.drafter.checkpoint.read_drafter`. What
stays here is a runtime expectation, not a layout: drafters TensorRT-LLM would run differently
from the reference are refused, never written.

Tapped layers arrive in ascending order (`bundle.ascending_taps`): TensorRT-LLM concatenates the
captured states in layer order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle31_export.errors import UserError
from eagle31_export.export.bundle import write_drafter_files
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint
from eagle31_export.formats.drafter.formats import consumer_layout


def trtllm_problems(ckpt: DrafterCheckpoint) -> list[str]:
    """Why TensorRT-LLM would run this drafter differently from the reference (silently)."""
    cfg, names = ckpt.config, set(ckpt.tensors)
    problems = []
    if cfg.norm_before_residual:
        problems.append("the drafter uses norm_before_residual, which TensorRT-LLM's Eagle3 layer does not "
                        "implement (it would add the un-normed state); serve it with vLLM or SGLang")
    if cfg.num_aux_hidden_states < 2:
        problems.append("the drafter taps one layer; TensorRT-LLM skips fc for a single tapped layer, "
                        "so it cannot run this drafter")
    ids = list(cfg.aux_layer_ids or ())
    if ids != sorted(set(ids)):
        problems.append(f"tapped layers {ids} are not strictly ascending; TensorRT-LLM concatenates them in "
                        "layer order (export through checked_pair, which reorders fc)")
    if cfg.draft_vocab_size == cfg.vocab_size and "d2t" in names and bool(ckpt.tensors["d2t"].any()):
        problems.append("d2t permutes a full-size draft vocabulary; TensorRT-LLM ignores d2t when "
                        "draft_vocab_size == vocab_size")
    if cfg.effective_target_hidden_size != cfg.hidden_size and "embed_tokens.weight" not in names:
        problems.append("hidden sizes differ from the target's, so TensorRT-LLM needs the drafter's own "
                        "embed_tokens, which this checkpoint lacks")
    if cfg.draft_vocab_size != cfg.vocab_size and "lm_head.weight" not in names:
        problems.append("the drafter has a reduced vocabulary but no lm_head")
    return problems


def write_trtllm_drafter(ckpt: DrafterCheckpoint, folder: Path) -> dict[str, Any]:
    """Write config.json + model.safetensors into `folder` (inside the caller's atomic output)."""
    problems = trtllm_problems(ckpt)
    if problems:
        raise UserError(f"cannot export for TensorRT-LLM: {problems[0]}")
    fmt, patch = consumer_layout("trtllm", ckpt.config)
    return write_drafter_files(ckpt, folder, fmt, patch)
