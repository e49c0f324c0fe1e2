"""Target checkpoints: detect, validate and load into a transformers causal LM.

Plain BF16/FP16/FP32 Hugging Face checkpoints load through transformers. NVFP4 checkpoints
(ModelOpt or compressed-tensors) are detected from their declarations, validated while
streamed, and loaded into the plain architecture with dequantized weights (W4A16
emulation), optionally with NVFP4 fake-quantized Linear inputs (W4A4 emulation).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from eagle31_export.config import TargetInfo
from eagle31_export.errors import CheckpointError
from eagle31_export.formats.nvfp4_reader import NVFP4Checkpoint
from eagle31_export.formats.nvfp4_scheme import detect_scheme
from eagle31_export.formats.safetensors_io import read_json


def read_target_config(path: str | os.PathLike) -> dict[str, Any]:
    return read_json(Path(path) / "config.json")


def read_target_info(path: str | os.PathLike) -> TargetInfo:
    return TargetInfo.from_hf_config(read_target_config(path))


def is_nvfp4(path: str | os.PathLike) -> bool:
    return detect_scheme(path) is not None


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype = torch.float32, act_quant: bool = False):
    """A transformers causal LM with the checkpoint's weights, in `dtype`, in eval mode.

    NVFP4 checkpoints get dequantized weights; with `act_quant` every quantized Linear also
    fake-quantizes its input to NVFP4, as the runtime's W4A4 GEMMs do.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if detect_scheme(path) is not None:
        from eagle31_export.formats.nvfp4_model import build_model

        return build_model(NVFP4Checkpoint.open(path), dtype=dtype, act_quant=act_quant)
    if act_quant:
        raise CheckpointError(f"{path}: --act-quant needs an NVFP4 checkpoint; this one is not quantized")
    return _load_plain(path, dtype)


def _load_plain(path: str | os.PathLike, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read the target config ({err})") from None
    model = AutoModelForCausalLM.from_pretrained(
        str(path), config=config, dtype=dtype, local_files_only=True, trust_remote_code=False
    )
    return model.eval()


def inspect_target(path: str | os.PathLike) -> dict[str, Any]:
    """Architecture, quantization (None when unquantized) and problems of a target folder.

    For NVFP4 every header and every block scale is read and checked (weights are not), so
    a damaged checkpoint raises CheckpointError here rather than at load time.
    """
    cfg = read_target_config(path)
    info = TargetInfo.from_hf_config(cfg)
    if detect_scheme(path, cfg) is None:
        return {"kind": "target", "quantization": None, "config": info.__dict__, "problems": []}
    ckpt = NVFP4Checkpoint.open(path)
    ckpt.validate()
    scheme = ckpt.scheme
    kv = None
    if scheme.kv_cache or ckpt.kv_scales:
        kv = {"algo": scheme.kv_cache, "scales": len(ckpt.kv_scales)}
    quantization = {
        "algo": "NVFP4",
        "format": scheme.format,
        "group_size": scheme.group_size,
        "activations": "nvfp4" if scheme.act_quant else None,
        "quantized_linears": len(ckpt.linears),
        "excluded": list(scheme.excluded),
        "kv_cache": kv,
    }
    return {"kind": "target", "quantization": quantization, "config": info.__dict__, "problems": ckpt.problems}
