"""Whether a PASS showed anything: a comparison where the reference accepts (almost) no drafts compares
nothing a drafter bug would change.

A runtime that reports its drafts (ours) is compared draft by draft: a drafter bug shows there
whatever is accepted. One that reports only tokens and acceptance counts (vLLM) shows a drafter bug
(taps, fc_norm, norm_output, d2t) only as drafts accepted on one side and not on the other. Where the
reference accepts no draft at some position, both sides agree there whatever the runtime's drafter
does: tau 1.000 on both sides, PASS, and nothing checked. So, where drafts are not compared one by
one, the reference's accepted rounds are counted per draft position, over every prompt:

- exact comparisons (greedy, every round's accepted count compared): a position the reference never
  accepted is a position at which no drafter difference could be seen;
- statistical comparisons (half precision, sampling): rates are compared, and a rate over fewer than
  `MIN_ACCEPTED_STATISTICAL` accepted rounds cannot tell a change of a few percent.

Either makes a PASS inconclusive: the pair does not fit (a drafter that was not trained for this
target), or the prompts are too short for the deeper positions. The CLI exits with
`EXIT_INCONCLUSIVE` then (0 pass, 1 fail, 2 bad input, 3 pass that showed nothing).
"""

from __future__ import annotations

EXIT_INCONCLUSIVE = 3
MIN_ACCEPTED_EXACT = 1  # one accepted round at a position is compared draft by draft
MIN_ACCEPTED_STATISTICAL = 10  # a rate over fewer accepted rounds cannot tell a change of a few percent


def accepted_by_position(rows) -> tuple[int, list[int]]:
    """(the reference's rounds, its rounds accepted at each draft position), summed over prompts."""
    rounds = sum(r.rounds_reference for r in rows)
    width = max((len(r.accepted_per_position_reference) for r in rows), default=0)
    per_position = [sum(r.accepted_per_position_reference[i] for r in rows
                        if i < len(r.accepted_per_position_reference)) for i in range(width)]
    return rounds, per_position


def inconclusive_reasons(rows, depth: int, statistical: bool) -> list[str]:
    """Why a PASS over `rows` (parity.compare.PromptRow) would show nothing; [] where it shows something."""
    rounds, per_position = accepted_by_position(rows)
    per_position = (per_position + [0] * depth)[:depth]
    if not rounds:
        return ["the reference ran no speculation rounds: nothing was compared (give longer --max-new-tokens)"]
    if not any(per_position):
        return [f"the reference accepted no draft in {rounds} rounds, so both sides agree whatever the drafter does: "
                "this drafter does not fit this target (or the prompts are not text it was trained on); "
                "PASS shows nothing"]
    least = MIN_ACCEPTED_STATISTICAL if statistical else MIN_ACCEPTED_EXACT
    thin = [(i + 1, n) for i, n in enumerate(per_position) if n < least]
    if not thin:
        return []
    shown = ", ".join(f"position {p}: {n}" for p, n in thin)
    rule = (f"at least {least} per position for a statistical comparison" if statistical
            else "a position never accepted is never compared")
    return [f"too few rounds accepted at draft positions to see a difference there ({shown} of {rounds} rounds; "
            f"{rule}): the drafter fits this target poorly or the prompts are too short; PASS is inconclusive there"]
