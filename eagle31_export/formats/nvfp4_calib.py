"""Activation calibration for NVFP4: the absolute maximum of every quantized Linear's input.

input_scale = amax / (6 * 448), with amax taken over every calibration prompt, as
ModelOpt's "max" calibration does. Prompts are token-id lists; a JSONL file may give them as
`{"prompt_ids": [...]}` or, when the model folder has a tokenizer, `{"text": "..."}`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from eagle31_export.errors import UserError

DEFAULT_PROMPTS = 8
DEFAULT_PROMPT_LENGTH = 64


def default_calibration_prompts(vocab_size: int, count: int = DEFAULT_PROMPTS,
                                length: int = DEFAULT_PROMPT_LENGTH) -> list[list[int]]:
    """A fixed set of token-id prompts that fits any vocabulary (seeded, so reproducible).

    Random ids exercise every Linear but are not text: real prompts (--calib-prompts) give
    input scales closer to deployment traffic.
    """
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


def read_calibration_prompts(path: str | os.PathLike, model_dir: str | os.PathLike,
                             vocab_size: int) -> list[list[int]]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such calibration prompts file")
    tokenizer = None
    prompts: list[list[int]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: not JSON ({err}); each line must be an object with 'prompt_ids' or 'text'") from None
        if isinstance(row, dict) and "prompt_ids" in row:
            ids = row["prompt_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
                raise UserError(f"{where}: 'prompt_ids' must be a non-empty list of integers")
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            tokenizer = tokenizer or _tokenizer(model_dir, where)
            ids = tokenizer(row["text"])["input_ids"]
            if not ids:
                raise UserError(f"{where}: 'text' tokenizes to no tokens; give a non-empty prompt")
        else:
            raise UserError(f"{where}: expected an object with 'prompt_ids' (list of ints) or 'text' (string)")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise UserError(f"{where}: token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1})")
        prompts.append(ids)
    if not prompts:
        raise UserError(f"{path}: no prompts; add JSONL lines with 'prompt_ids' or 'text'")
    return prompts


def _tokenizer(model_dir: str | os.PathLike, where: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, ImportError):
        raise UserError(f"{where}: has 'text' but {model_dir} has no tokenizer; give 'prompt_ids' instead") from None


@torch.no_grad()
def calibrate_input_amax(model: nn.Module, linears: dict[str, nn.Linear],
                         prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """amax of each Linear's input over all prompts (one prompt per forward, no padding).

    The amax is taken in the activation dtype and returned as FP32, as ModelOpt does.
    Linears that never ran are absent from the result.
    """
    amax: dict[str, torch.Tensor] = {}

    def observer(name: str):
        def hook(_module, args):
            x = args[0].detach()
            value = torch.maximum(x.amax().abs(), x.amin().abs()).float()
            amax[name] = value if name not in amax else torch.maximum(amax[name], value)

        return hook

    handles = [module.register_forward_pre_hook(observer(name)) for name, module in linears.items()]
    try:
        for ids in prompts:
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return amax
