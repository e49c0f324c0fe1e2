"""Numerical ties told from bugs, where a comparison is exact in principle but not bit for bit.

Half precision, NVFP4 kernels and batched calls change logits in their last bits. Where the
reference's two best candidates are that close, the runtime may pick the other one: a numerical
tie, not a bug. Replay (reference/replay.py) follows the runtime's own sequence, so every
generated position and every round is judged on the same prefix, and records how close each
decision was: `token_gaps` (the target's logit of its greedy token minus its logit of the
runtime's token) and `draft_margins` (the drafter's top-1 minus top-2 logit per draft step).

A difference is a tie when that gap is at most the tolerance for the runtime's precision
(`parity.compare.Thresholds`: fp32 or half precision; printed in the report); every other
difference is a failure with its symptom:
- a token that differs: tie when the target's gap there is within the tolerance;
- a round whose accepted count differs while the tokens it verified agree: the first draft
  position whose outcome differs, k = min(a, b) + 1, is a tie when the reference drafter's top-2
  margin at step k is within the tolerance (the runtime's own draft is not reported by every
  runtime, so the margin to the runner-up stands for it); a round that verified a tied token
  before k differs because of that token.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle31_export.reference.speculate import SpecResult


@dataclass
class Divergence:
    """One place where the runtime and the reference decided differently."""

    kind: str  # "token" (a generated token) or "round" (an accepted count)
    index: int  # generated-token index, or round index
    gap: float  # the reference's logit gap there (see the module docstring)
    tie: bool
    draft_position: int | None = None  # rounds: the first draft position (1-based) whose outcome differs

    def describe(self) -> str:
        where = (f"token {self.index}" if self.kind == "token"
                 else f"round {self.index}, draft position {self.draft_position}")
        return f"{where}: reference logit gap {self.gap:.3g}"


def divergences(ref: SpecResult, run: SpecResult, tolerance: float,
                run_drafts: list[list[int]] | None = None) -> list[Divergence] | None:
    """Every differing token and round, each judged tie or not; None where the reference result
    carries no gaps (not a replay) or the rounds cannot be aligned (different counts). With
    `run_drafts` (a runtime that reports them), a round whose drafts differ at the same accepted
    count is judged at its first differing draft too."""
    if ref.token_gaps is None or ref.draft_margins is None or len(ref.accepted_per_step) != len(run.accepted_per_step):
        return None
    found = [Divergence("token", i, gap, gap <= tolerance)
             for i, (a, b, gap) in enumerate(zip(ref.tokens, run.tokens, ref.token_gaps)) if a != b]
    tied_tokens = {d.index for d in found if d.tie}
    done = 1  # tokens[0] is the prefill's; round r verifies tokens[done:done + depth]
    for r, (a, b) in enumerate(zip(ref.accepted_per_step, run.accepted_per_step)):
        k = min(a, b) + 1 if a != b else _first_differing_draft(ref, run_drafts, r)
        if k is not None:
            if any(done + j in tied_tokens for j in range(k)):  # a tied token before k decided it
                gap = 0.0
            else:
                margins = ref.draft_margins[r] if r < len(ref.draft_margins) else []
                gap = margins[k - 1] if k - 1 < len(margins) else float("inf")
            found.append(Divergence("round", r, gap, gap <= tolerance, k))
        done += b + 1
    return found


def _first_differing_draft(ref: SpecResult, run_drafts: list[list[int]] | None, r: int) -> int | None:
    if run_drafts is None or r >= len(run_drafts) or r >= len(ref.drafts):
        return None
    return next((k + 1 for k, (x, y) in enumerate(zip(ref.drafts[r], run_drafts[r])) if x != y), None)
