"""A random Llama-shaped bf16 target (about 1 GB with the benchmarks' defaults) and an EAGLE 3.1
drafter that takes its embeddings from it, made by code into `work` once and reused by later runs.
Shared by the memory benchmarks (reference_memory.py, onnx_export_memory.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def make_mid_pair(work: Path, hidden: int, layers: int, intermediate: int, vocab: int) -> tuple[Path, Path]:
    """(target, drafter) folders under `work`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from factories import drafter_config_for, make_target, random_drafter
    from eagle31_export.formats.drafter.checkpoint import write_drafter
    from eagle31_export.formats.target.checkpoint import read_target_info

    target, drafter = work / "target", work / "drafter"
    if not (target / "config.json").is_file():
        make_target(target, "llama", seed=0, dtype=torch.bfloat16, num_layers=layers, hidden=hidden,
                    vocab=vocab, heads=16, kv_heads=4, intermediate=intermediate)
    if not (drafter / "config.json").is_file():
        cfg = drafter_config_for(read_target_info(target), fc_norm=True, norm_output=True,
                                 draft_vocab_size=vocab // 2, torch_dtype="bfloat16")
        ckpt = random_drafter(cfg, seed=1)  # no embed_tokens: the target's are used
        ckpt.tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in ckpt.tensors.items()}
        write_drafter(ckpt, drafter, "specforge")
    return target, drafter
