"""Replay: the reference drafter at exactly another run's round boundaries, with ONE target forward.

Greedy speculation is lossless, so a faithful runtime's tokens are the target's greedy
continuation. Parity therefore needs no autoregressive reference run: the target runs once over
the prompt plus what the runtime committed (tapping the aux layers), and the drafter is replayed
round by round at the boundaries the runtime's `accepted_per_step` fixes. Its drafts are then
verified against that forward's greedy tokens, as the loop would have verified them.

The last round may have been cut by `max_new_tokens`; its accepted drafts are appended to the
forward (they are what the runtime verified), so every round's drafts can be checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle31_export.reference.speculate import (
    DrafterBackend,
    LoopObserver,
    Round,
    Sampling,
    SpecResult,
    TargetBackend,
    Top,
    _draft_steps,
    _Sampler,
)


def verified_sequence(prompt: list[int], run: SpecResult, target: TargetBackend | None = None
                      ) -> tuple[list[int], list[int]]:
    """(the sequence the runtime verified, the position of the newest token at each round's start).
    A runtime that reports no drafts (vLLM) leaves the last round's accepted drafts past
    `max_new_tokens` unknown: they are the target's greedy tokens (greedy speculation is lossless), so
    `target` continues the sequence by them, one forward each (at most depth - 1)."""
    starts, m = [], len(prompt)
    for accepted in run.accepted_per_step:
        starts.append(m)
        m += accepted + 1
    kept = 1 + sum(a + 1 for a in run.accepted_per_step[:-1]) if run.accepted_per_step else len(run.tokens)
    seq = list(prompt) + list(run.tokens[:kept])
    if not run.accepted_per_step:
        return seq, starts
    if len(run.drafts) == len(run.accepted_per_step):
        return seq + list(run.drafts[-1][: run.accepted_per_step[-1]]), starts
    tail = list(run.tokens[kept: kept + run.accepted_per_step[-1]])
    while len(tail) < run.accepted_per_step[-1] and target is not None:
        target.reset()
        logits, _ = target.forward(torch.tensor([seq + tail]))
        tail.append(int(logits[0, -1].argmax()))
    return seq + tail, starts


@torch.no_grad()
def replay_greedy(target: TargetBackend, drafter: DrafterBackend, prompt: list[int], run: SpecResult,
                  observer: LoopObserver | None = None, follow: list[list[int]] | None = None) -> SpecResult:
    """The reference's result for `run`'s rounds: tokens are the target's greedy tokens along the
    runtime's sequence, drafts are the reference drafter's at the runtime's round boundaries. Every
    decision's best candidates are kept (`token_tops`, `draft_tops`). `follow`: per round, the drafts
    fed back at steps 2..depth instead of this drafter's own (another replay's, so that a pair at
    another precision is measured at the very same decisions: parity/numerics.py)."""
    observer = observer or LoopObserver()
    seq, starts = verified_sequence(prompt, run, target)
    target.reset()
    logits, taps = target.forward(torch.tensor([seq]))
    greedy = [int(t) for t in logits[0].argmax(-1)]  # greedy[j]: the target's token after seq[: j + 1]
    p = len(prompt)
    tokens = greedy[p - 1: p - 1 + len(run.tokens)]
    result = SpecResult(tokens=tokens, drafts=[], accepted_per_step=[], depth=run.depth,
                        token_gaps=_token_gaps(logits[0, p - 1: p - 1 + len(run.tokens)], tokens, run.tokens),
                        draft_margins=[], draft_tops=[],
                        # past the run's tokens too: the target's decisions on the last round's drafts that
                        # max_new_tokens cut (parity/ties.py judges a round there by either side)
                        token_tops=[Top.of(row) for row in logits[0, p - 1:]])
    observer.on_prefill(tokens[0])
    sampler, vocab = _Sampler(0.0, 0), logits.shape[-1]
    drafter.reset()
    for index, m in enumerate(starts):
        committed = drafter.length
        ids, positions = torch.tensor([seq[committed + 1: m + 1]]), torch.arange(committed, m).unsqueeze(0)
        margins: list[float] = []
        tops: list[Top] = []
        drafts, _, first_logits = _draft_steps(drafter, ids, positions, taps[:, committed:m], m, run.depth,
                                               sampler, vocab, margins, tops,
                                               follow[index] if follow is not None and index < len(follow) else None)
        result.draft_margins.append(margins)
        result.draft_tops.append(tops)
        drafter.truncate(m)
        accepted = _accepted(drafts, seq, greedy, m)
        result.drafts.append(drafts)
        result.accepted_per_step.append(accepted)
        observer.on_round(Round(index, drafts, accepted, drafts[:accepted] + greedy[m + accepted: m + accepted + 1],
                                first_logits if observer.wants_draft_logits else None))
    return result


def _token_gaps(logits: torch.Tensor, greedy: list[int], committed: list[int]) -> list[float]:
    """Per generated position: the logit of the target's own greedy token minus that of the token the
    run committed there (0 where they agree): how far from a tie a differing token was."""
    rows = torch.arange(len(greedy))
    wide = logits.double()
    return [float(g) for g in wide[rows, torch.tensor(greedy, dtype=torch.long)]
            - wide[rows, torch.tensor(committed[:len(greedy)], dtype=torch.long)]]


def _accepted(drafts: list[int], seq: list[int], greedy: list[int], m: int) -> int:
    """Leading drafts equal to the target's greedy token, checked while the drafts follow `seq`
    (past that, the single forward saw another prefix and cannot judge them)."""
    accepted = 0
    for i, draft in enumerate(drafts):
        if m + i >= len(greedy) or draft != greedy[m + i]:
            break
        accepted += 1
        if m + 1 + i >= len(seq) or seq[m + 1 + i] != draft:
            break
    return accepted


@dataclass
class SampledRound:
    """One round of a sampled run under the greedy-drafts rule, with what the reference says of it:
    its greedy drafts at the round's start (and the drafter's top-2 margin at each step), and
    `p_drafts[i]`, the target's probability of draft i + 1 under the run's sampling, for every draft
    position the run's own sequence reaches along the reference's drafts (None past it)."""

    index: int
    start: int  # position of the newest token when the round began
    accepted: int  # the run's
    committed: list[int]  # the run's tokens this round (accepted drafts, then the recovered or bonus token)
    drafts: list[int]
    margins: list[float]
    p_drafts: list[float | None]
    # per reached position, the target's largest probability of any other token (None past them): how
    # likely a token sampled with some other draft masked out is to be this draft, at most
    p_rivals: list[float | None]
    tops: list[Top] = field(default_factory=list)  # each draft step's best candidates (parity/numerics.py)


@torch.no_grad()
def replay_sampled(target: TargetBackend, drafter: DrafterBackend, prompt: list[int], run: SpecResult,
                   sampling: Sampling, follow: list[list[int]] | None = None) -> list[SampledRound]:
    """The reference pair along a sampled run's own sequence, with one target forward. Under the
    greedy-drafts rule the drafts at each round's start are determined by the tokens before it, and
    each draft the run reached was accepted with probability p_target(draft) on the same prefix: the
    target's distribution after the round's start and the drafts before it, which the run's tokens
    are wherever it accepted them. `follow`: per round, the drafts fed back at steps 2..depth instead of
    this drafter's own (as in replay_greedy: a pair at another precision measured at the same decisions)."""
    seq = list(prompt) + list(run.tokens)
    target.reset()
    logits, taps = target.forward(torch.tensor([seq]))
    sampler, vocab = _Sampler(0.0, 0), logits.shape[-1]
    drafter.reset()
    rounds, m = [], len(prompt)
    for index, accepted in enumerate(run.accepted_per_step):
        committed = drafter.length
        ids, positions = torch.tensor([seq[committed + 1: m + 1]]), torch.arange(committed, m).unsqueeze(0)
        margins: list[float] = []
        tops: list[Top] = []
        drafts, _, _ = _draft_steps(drafter, ids, positions, taps[:, committed:m], m, run.depth, sampler, vocab,
                                    margins, tops, follow[index] if follow is not None and index < len(follow) else None)
        drafter.truncate(m)
        tokens = seq[m + 1: m + 2 + accepted]
        rounds.append(SampledRound(index, m, accepted, tokens, drafts, margins,
                                   *_draft_probabilities(logits[0], seq, m, drafts, accepted, sampling), tops=tops))
        m += accepted + 1
    return rounds


def _draft_probabilities(logits: torch.Tensor, seq: list[int], m: int, drafts: list[int], accepted: int,
                         sampling: Sampling) -> tuple[list[float | None], list[float | None]]:
    """(p_target(draft i + 1), the largest p_target of another token) for the positions the round reached
    (i <= accepted) whose prefix is on `seq`: the logits at m + i read seq up to m + i, which must hold
    the drafts before i."""
    out: list[float | None] = [None] * len(drafts)
    rivals: list[float | None] = [None] * len(drafts)
    reached = [i for i in range(min(accepted + 1, len(drafts)))
               if m + i < len(seq) and seq[m + 1: m + 1 + i] == drafts[:i]]
    if reached:
        probs = sampling.probs(logits[[m + i for i in reached]])
        for row, i in enumerate(reached):
            out[i] = float(probs[row, drafts[i]])
            others = probs[row].clone()
            others[drafts[i]] = 0
            rivals[i] = float(others.max())
    return out, rivals
