"""Greedy acceptance at every draft depth from one target generation.

Greedy speculative decoding emits the target's own greedy text whatever the drafter and the depth
(parity checks that of every runtime), and the drafter's committed cache at a position holds what
the target's tapped state there made of it, whenever it was read. So the chain a round drafts from
anchor j (the position before the round's newest token) is a function of the greedy text alone: the
teacher-forced chain from j (`ttt_forward`) while its drafts match the text. Let L(j) be how many
of its first `max_depth` drafts match; a round at depth d from j accepts min(d, L(j)) drafts and the
next round's anchor is j + accepted + 1. One target generation and one teacher-forced pass of each
drafter give every depth's rounds, where `speculate` runs the whole loop once a depth; the rounds are
the loop's, up to near-ties that the two summation orders may take apart
(tests/test_acceptance_chains.py compares them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle31_export.reference.drafter import Eagle3Drafter
from eagle31_export.reference.speculate import PREFILL_CHUNK
from eagle31_export.reference.statistics import acceptance_length
from eagle31_export.reference.target import ReferenceTarget
from eagle31_export.reference.ttt import ttt_forward


@dataclass(frozen=True)
class GreedyText:
    """A prompt, the target's greedy continuation past it, and the tapped state at every position but the last."""

    ids: list[int]  # prompt + continuation
    prompt_len: int
    taps: torch.Tensor  # [1, len(ids) - 1, k*H]


@torch.no_grad()
def greedy_text(target: ReferenceTarget, prompt: list[int], new_tokens: int) -> GreedyText:
    """The target's greedy continuation of `prompt` (`new_tokens`, no stop token), tapped. The prompt
    goes in PREFILL_CHUNK pieces keeping one logit row, so 8k-token prompts hold no [T, V] logits."""
    target.reset()
    taps = []
    for start in range(0, len(prompt), PREFILL_CHUNK):
        logits, piece = target.forward(torch.tensor([prompt[start:start + PREFILL_CHUNK]]), logits_to_keep=1)
        taps.append(piece)
    ids = list(prompt) + [int(logits[0, -1].argmax())]
    while len(ids) < len(prompt) + new_tokens:
        logits, piece = target.forward(torch.tensor([ids[-1:]]))
        taps.append(piece)
        ids.append(int(logits[0, -1].argmax()))
    return GreedyText(ids, len(prompt), torch.cat(taps, dim=1))


@torch.no_grad()
def chain_lengths(drafter: Eagle3Drafter, text: GreedyText, max_depth: int) -> list[int]:
    """L(j) for every anchor j a round can start from (prompt_len - 1 onward, while its whole chain of
    `max_depth` drafts lies inside the text): how many of the chain's drafts match the text."""
    ids = torch.tensor([text.ids])
    last = len(text.ids) - 2 - max_depth  # step k at anchor j predicts token j + 2 + k
    anchors = torch.arange(text.prompt_len - 1, last + 1)
    taps = text.taps[:, :last + 1].to(drafter.fc.weight.dtype)
    steps = ttt_forward(drafter, taps, ids[:, :last + 1 + max_depth], max_depth, anchors=anchors)
    matched = torch.ones(anchors.numel(), dtype=torch.bool)
    lengths = torch.zeros(anchors.numel(), dtype=torch.long)
    for k, logits in enumerate(steps):
        drafted = drafter.draft_to_target(logits[0].argmax(-1))
        matched &= drafted == ids[0, anchors + 2 + k]
        lengths += matched
    return lengths.tolist()


def rounds_at_depth(lengths: list[int], depth: int, new_tokens: int) -> list[int]:
    """Accepted drafts per round of greedy speculation at `depth` making `new_tokens` tokens, as
    `speculate` runs it: the prefill makes the first token; a round accepts min(depth, L) and adds
    one bonus token; the last round is cut at `new_tokens` but counted whole."""
    made, anchor, accepted = 1, 0, []
    while made < new_tokens:
        if anchor >= len(lengths):
            raise ValueError(f"the text holds chains for {len(lengths)} anchors; {new_tokens} tokens at depth "
                             f"{depth} need more (generate new_tokens + depth + 1 tokens)")
        took = min(depth, lengths[anchor])
        accepted.append(took)
        made += took + 1
        anchor += took + 1
    return accepted


@dataclass(frozen=True)
class DepthAcceptance:
    """One prompt's greedy speculation at one depth."""

    accepted_per_step: list[int]
    depth: int

    @property
    def tau(self) -> float:
        return acceptance_length(sum(self.accepted_per_step), len(self.accepted_per_step))


def acceptance_by_depth(drafter: Eagle3Drafter, text: GreedyText, depths, new_tokens: int) -> dict[int, DepthAcceptance]:
    """Every depth's rounds over one greedy text (`greedy_text` with at least new_tokens + max depth + 1
    tokens)."""
    lengths = chain_lengths(drafter, text, max(depths))
    return {d: DepthAcceptance(rounds_at_depth(lengths, d, new_tokens), d) for d in depths}
