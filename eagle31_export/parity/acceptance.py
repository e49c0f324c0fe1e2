"""Acceptance measurements of a drafter on real text: tau by depth, and teacher-forced agreement.

A tiny target's greedy text tends to repeat itself, which inflates tau; teacher-forced
agreement per draft position on held-out REAL text does not have that bias, so both are reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle31_export.reference.pair import ReferencePair
from eagle31_export.reference.target import tapped_forward
from eagle31_export.reference.ttt import ttt_forward
from eagle31_export.runtime.registry import Speculator


def text_prompts(tokenizer, texts: list[str], context_len: int, per_text: int = 1) -> list[list[int]]:
    """`per_text` windows of `context_len` tokens from each text, evenly spaced."""
    prompts = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        if len(ids) <= context_len:
            continue
        for i in range(per_text):
            start = (len(ids) - context_len) * (i + 1) // (per_text + 1)
            prompts.append(ids[start:start + context_len])
    return prompts


def tau_by_depth(speculator: Speculator, prompts: list[list[int]], depths, max_new_tokens: int) -> dict[int, float]:
    """Mean acceptance length (greedy) over prompts, per draft depth."""
    out = {}
    for depth in depths:
        taus = [speculator.run(p, max_new_tokens, depth).acceptance_length for p in prompts]
        out[depth] = sum(taus) / len(taus)
    return out


@dataclass
class Agreement:
    per_position: list[float]  # fraction of positions where draft step k == target greedy token
    positions: int


@torch.no_grad()
def teacher_forced_agreement(pair: ReferencePair, sequences: list[list[int]], unroll: int) -> Agreement:
    """Chain drafts fed the real next tokens, compared with the target's own greedy prediction."""
    drafter = pair.drafter.drafter
    hits = [0] * unroll
    total = 0
    for seq in sequences:
        x = torch.tensor([seq])
        logits, taps = tapped_forward(pair.target, x[:, :-1])
        t = x.shape[1] - unroll - 1
        greedy = logits.argmax(-1)[0]
        for k, step_logits in enumerate(ttt_forward(drafter, taps[:, :t].to(drafter.fc.weight.dtype), x, unroll)):
            drafted = drafter.draft_to_target(step_logits[0].argmax(-1))
            hits[k] += int((drafted == greedy[1 + k:1 + k + t]).sum())
        total += t
    return Agreement([h / total for h in hits], total)
