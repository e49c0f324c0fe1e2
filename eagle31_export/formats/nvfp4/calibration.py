"""Activation calibration for NVFP4: the absolute maximum of every quantized Linear's input.

input_scale = amax / (6 * 448), with amax taken over every calibration prompt, as
ModelOpt's "max" calibration does. Prompts are token-id lists; a JSONL file may give them as
`{"prompt_ids": [...]}` or, when the model folder has a tokenizer, `{"text": "..."}`.
"""

from __future__ import annotations

import torch
from torch import nn


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
