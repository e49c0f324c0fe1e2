"""Numerical ties told from bugs, where a comparison is exact in principle but not bit for bit.

Half precision, NVFP4 kernels and batched calls change logits in their last bits. Where the
reference's two best candidates are that close, the runtime may pick the other one: a numerical
tie, not a bug. Replay (reference/replay.py) follows the runtime's own sequence, so every generated position and
every round is judged on the same prefix, and keeps every decision's best candidates with their
logits (`token_tops`, `draft_tops`).

This is the one tie rule of every verdict: greedy runs, runs under load (parity/concurrency.py) and
greedy requests in mixed batches (parity/mixed_batches.py) are judged by `judge`, a sampled round's
drafts by the same factor against the same measurement (parity/sampling.py). Its thresholds are
parity/numerics.py's, each with where it comes from: TIE_ERRORS and the tie budget's
RUNTIME_ERROR_RATIO and BUDGET_ALPHA.

A difference is a tie when the reference's logit of the runtime's own choice is within TIE_ERRORS
times the error the runtime's precision measurably makes at that very decision (parity/numerics.py:
the reference replayed again at the runtime's precision) of the reference's best there;
every other difference is a failure with its symptom, naming the runtime's choice by its rank among
the reference's candidates where it is not the runner-up:
- a token that differs: the target's greedy token against the runtime's;
- a round whose accepted count differs while the tokens it verified agree: the first draft position
  whose outcome differs, k = min(a, b) + 1, or where the runtime reports its drafts the first that
  differs if that comes first (in the last round, cut by max_new_tokens, both sides accept drafts
  whose tokens are not returned). The runtime's draft there is known where the runtime
  reports its drafts (ours, Triton), and where it accepted more than the reference (the token it
  committed): judged by its own logit, whatever the top-2 margin (a draft ranked far down is no tie
  because the best two happen to be close). Elsewhere (vLLM rejecting what the reference accepted)
  the reference's runner-up stands for it, the least gap any other draft could have. A round whose
  verified tokens up to k differ is decided by the first of them, judged as a token (and not
  counted again). In the last round, where max_new_tokens cut the token the runtime's target chose
  on draft k, the target may have decided it: a tie if the target's top-2 gap there is one. Where
  draft k reads a token past the last one returned, the two sides no longer share a prefix (the
  reference's decisions there follow its own drafts): listed as past the cut, not judged: neither a
  tie nor a failure, and not counted against the tie budget.

A rule that took only the runner-up as a tie for a known draft failed a faithful bf16 runtime of
ours (benchmarks/verdict_power.py: its draft was the reference's 3rd choice where the best three lay
within 0.54 x the measured error), so the runtime's own choice is judged by its own gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle31_export.parity.numerics import TIE_ERRORS, Measured, TieBudget, expected_ties
from eagle31_export.reference.speculate import SpecResult, Top


@dataclass
class Divergence:
    """One place where the runtime and the reference decided differently."""

    kind: str  # "token" (a generated token) or "round" (an accepted count)
    index: int  # generated-token index, or round index
    gap: float  # the reference's fp32 logit gap between its choice and the runtime's (or its runner-up)
    tie: bool  # judged a numerical tie (False past the cut too: not judged at all, see `past_cut`)
    draft_position: int | None = None  # rounds: the first draft position (1-based) whose outcome differs
    error: float | None = None  # the measured error scale at this decision (parity/numerics.py)
    rank: int | None = None  # the runtime's choice among the reference's candidates (None: not known)
    decided_by_token: bool = False  # a round that differs because a token it verified differs (not counted again)
    past_cut: bool = False  # a round that differs only past max_new_tokens, off the runtime's returned tokens

    @property
    def counted(self) -> bool:
        """A tie the budget counts: the decision itself was judged a tie (not a token's echo)."""
        return self.tie and not self.decided_by_token

    @property
    def untied(self) -> bool:
        """A difference judged, and not a tie: a failure."""
        return not self.tie and not self.past_cut

    @property
    def ratio(self) -> float | None:
        """The gap in units of the measured error (None: not measured, or not finite)."""
        if self.error is None or self.error <= 0 or not math.isfinite(self.error) or not math.isfinite(self.gap):
            return None
        return self.gap / self.error

    def describe(self) -> str:
        where = (f"token {self.index}" if self.kind == "token"
                 else f"round {self.index}, draft position {self.draft_position}")
        said = f"{where}: reference logit gap {self.gap:.3g}"
        if self.ratio is not None:
            said += f" = {self.ratio:.2g} x the measured error {self.error:.2g}"
        if self.decided_by_token:
            said = f"{where}: decided by a differing token it verified"
        elif self.past_cut:
            said = (f"{where}: past max_new_tokens, where the runtime returns no tokens and the reference follows "
                    "its own drafts: not the same prefix, not judged")
        elif self.rank is not None and self.rank > 2:
            said += f"; the runtime chose the reference's choice {self.rank}"
        elif self.rank is None and self.kind == "token" and not math.isfinite(self.gap):
            said += "; the runtime chose none of the reference's best candidates"
        elif self.rank is None and self.kind == "round" and not self.tie and self.gap == math.inf:
            said += "; the runtime chose none of the reference's best candidates"
        return said


@dataclass
class Judged:
    """One run against the reference replayed along it: every difference, and its tie budget."""

    found: list[Divergence]
    budget: TieBudget

    @property
    def ties(self) -> list[Divergence]:
        return [d for d in self.found if d.tie]

    @property
    def untied(self) -> list[Divergence]:
        return [d for d in self.found if d.untied]

    @property
    def past_cut(self) -> list[Divergence]:
        return [d for d in self.found if d.past_cut]


def judge(ref: SpecResult, run: SpecResult, measured: Measured, drafts_reported: bool,
          tie_errors: float = TIE_ERRORS) -> Judged | None:
    """`run` judged against `ref` (the reference replayed along it) and `measured` (the error of each of
    `ref`'s decisions): every difference a tie or not (`divergences`, reading the runtime's drafts where
    it reports them), and the ties counted against what the precision explains (parity/numerics.py:
    expected_ties). None where the rounds cannot be aligned."""
    found = divergences(ref, run, measured, tie_errors, run.drafts if drafts_reported else None)
    if found is None:
        return None
    budget = expected_ties(ref, run, measured, drafts_reported)
    budget.observed = sum(d.counted for d in found)
    return Judged(found, budget)


def divergences(ref: SpecResult, run: SpecResult, measured: Measured, tie_errors: float = TIE_ERRORS,
                run_drafts: list[list[int]] | None = None) -> list[Divergence] | None:
    """Every differing token and round, each judged tie or not against `measured` (the error scale
    of each of `ref`'s decisions); None where the reference result carries no candidates (not a
    replay) or the rounds cannot be aligned (different counts). With `run_drafts` (a runtime that
    reports them), a round whose drafts differ at the same accepted count is judged at its first
    differing draft too, and every judged draft by the runtime's own choice."""
    if ref.token_tops is None or ref.draft_tops is None or len(ref.accepted_per_step) != len(run.accepted_per_step):
        return None
    found = [_judged("token", i, top, b, _at(measured.token_errors, i), tie_errors)
             for i, (a, b, top) in enumerate(zip(ref.tokens, run.tokens, ref.token_tops)) if a != b]
    tokens = {d.index: d.tie for d in found}
    done = 1  # tokens[0] is the prefill's; round r verifies tokens[done:done + depth]
    for r, (a, b) in enumerate(zip(ref.accepted_per_step, run.accepted_per_step)):
        steps = (min(a, b) + 1 if a != b else None, _first_differing_draft(ref, run_drafts, r))
        k_step = min((s for s in steps if s is not None), default=None)
        if k_step is not None and done + k_step - 2 >= len(run.tokens):
            # draft k reads the tokens up to done + k - 2: past the last one returned, the runtime's prefix is
            # not known and the reference's decisions follow its own drafts (the last round, cut)
            found.append(Divergence("round", r, math.nan, False, k_step, past_cut=True))
        elif k_step is not None:
            verified = [done + j for j in range(k_step) if done + j in tokens]
            if verified:  # a token it verified up to k differs: the target decided the round, judged there
                found.append(Divergence("round", r, 0.0, all(tokens[i] for i in verified), k_step,
                                        decided_by_token=True))
            else:
                found.append(_round(ref, run, run_drafts, r, k_step, done, measured, tie_errors))
        done += b + 1
    return found


def _round(ref: SpecResult, run: SpecResult, run_drafts, r: int, step: int, done: int, measured: Measured,
           tie_errors: float) -> Divergence:
    tops = ref.draft_tops[r] if r < len(ref.draft_tops) else []
    if step - 1 >= len(tops):
        return Divergence("round", r, math.inf, False, step)
    top, error = tops[step - 1], _at(_at(measured.draft_errors, r, []), step - 1)
    theirs = None
    if run_drafts is not None and r < len(run_drafts) and step - 1 < len(run_drafts[r]):
        theirs = run_drafts[r][step - 1]
    elif run.accepted_per_step[r] >= step and done + step - 1 < len(run.tokens):
        theirs = run.tokens[done + step - 1]  # accepted by the runtime: its draft was the token it committed
    found = _judged("round", r, top, theirs, error, tie_errors, step)
    at = done + step - 1  # the target's decision on draft `step`
    if not found.tie and len(run.tokens) <= at < len(ref.token_tops):
        # max_new_tokens cut the token the runtime's target chose there: the target may have decided it
        target = _judged("token", at, ref.token_tops[at], None, _at(measured.token_errors, at), tie_errors)
        if target.tie:
            return Divergence("round", r, target.gap, True, step, target.error)  # the target's top-2 gap
    return found


def _judged(kind: str, index: int, top: Top, theirs: int | None, error: float, tie_errors: float,
            step: int | None = None) -> Divergence:
    """A difference where the reference's candidates are `top` and the runtime chose `theirs` (None:
    unknown, its runner-up stands for it): a tie where the reference's logit of the runtime's own
    choice is within tie_errors x the error of its best."""
    rank = top.rank(theirs) if theirs is not None else None
    other = top.values[1] if theirs is None and len(top.values) > 1 else top.value(theirs) if theirs is not None else None
    gap = top.values[0] - other if other is not None else math.inf
    return Divergence(kind, index, gap, gap <= tie_errors * error, step, error, rank)


def _at(values: list, i: int, default=math.inf):
    return values[i] if i < len(values) else default
def _first_differing_draft(ref: SpecResult, run_drafts: list[list[int]] | None, r: int) -> int | None:
    if run_drafts is None or r >= len(run_drafts) or r >= len(ref.drafts):
        return None
    return next((k + 1 for k, (x, y) in enumerate(zip(ref.drafts[r], run_drafts[r])) if x != y), None)
