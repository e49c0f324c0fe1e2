"""Target checkpoints: detect, validate and load into a transformers causal LM.

Plain BF16/FP16/FP32 Hugging Face checkpoints are handled here; NVFP4 checkpoints
(ModelOpt, compressed-tensors) are detected and dequantized on load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from eagle31_export.config import TargetInfo
from eagle31_export.errors import CheckpointError
from eagle31_export.formats.safetensors_io import read_json


def read_target_config(path: str | os.PathLike) -> dict[str, Any]:
    return read_json(Path(path) / "config.json")


def read_target_info(path: str | os.PathLike) -> TargetInfo:
    return TargetInfo.from_hf_config(read_target_config(path))


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype = torch.float32, act_quant: bool = False):
    """A transformers causal LM with the checkpoint's weights, in `dtype`, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if act_quant:
        raise CheckpointError(f"{path}: --act-quant needs an NVFP4 checkpoint; this one is not quantized")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read the target config ({err})") from None
    model = AutoModelForCausalLM.from_pretrained(
        str(path), config=config, dtype=dtype, local_files_only=True, trust_remote_code=False
    )
    return model.eval()


def inspect_target(path: str | os.PathLike) -> dict[str, Any]:
    cfg = read_target_config(path)
    info = TargetInfo.from_hf_config(cfg)
    return {"kind": "target", "quantization": None, "config": info.__dict__, "problems": []}
