"""What a drafter bug looks like from the acceptance it leaves, in words (docs/tapped-layers.md,
docs/eagle31.md, docs/silent-bugs.md): the first draft step reads the taps through fc (and fc_norm or
norm_before_fc), embeds the last token with the drafter's embed_tokens (or the target's) and maps its
token with d2t; later steps read the drafter's own fed-back state; every step attends over positions
(rope, max_position_embeddings, a sliding window), which shows as differences that wait for the
context to grow; and a runtime that accepts more than the reference accepted of the same drafts is
wrong in its verification or in what it reports."""

from __future__ import annotations

import math

POSITION_1 = ("what the first draft step reads differs: tapped layers, fc or the norms of fc's input (check aux layer "
              "numbering, fc_norm and norm_before_fc), the draft-to-target vocabulary map (d2t), or the token "
              "embeddings the drafter reads (its own embed_tokens against the target's)")
LATER_POSITIONS = "later drafts differ: fed-back state (pre- vs post-norm feedback, norm_output)"
CONTEXT_DEPENDENT = ("drafts differ only once the context is long: how the drafter attends over positions (rope_theta "
                     "or rope_scaling, max_position_embeddings, a sliding window), not what a draft step reads")
ACCEPTS_MORE = "accepts more than the reference: the engine's verification or its metrics"
# a runtime that reports no drafts: more accepted may also be a drafter that differs and happens to draft better
ACCEPTS_MORE_UNSEEN = (f"{ACCEPTS_MORE} (or a drafter that differs and drafts better: the runtime reports no drafts "
                       "to tell)")

# CONTEXT_DEPENDENT is said only where so late a first difference is this unlikely for differences that do not
# depend on the context (a permutation test over the rounds: `context_dependence`)
CONTEXT_P = 0.01

def position_symptom(position: int) -> str:
    """The usual cause of a difference first seen at draft position `position` (1-based)."""
    return POSITION_1 if position == 1 else LATER_POSITIONS


def context_dependence(rounds: list[tuple[int, bool]]) -> dict | None:
    """Whether the rounds' differences wait for the context to grow: `rounds` holds every compared
    round of every prompt as (context length when it drafted, whether it differed beyond a tie). With C
    the shortest context at which any round differs, m of the N rounds drafted at C or more and k of
    them differing: were the differences placed among the rounds whatever their context, all k would
    fall among those m with probability p = C(m, k) / C(N, k) (a permutation test of the earliest
    difference). Where p < CONTEXT_P: {"from": C, "agree_before": N - m, "differ_after": k, "after": m,
    "p": p}; else None (fewer than two differences, or too little agreement before them to tell)."""
    differing = [c for c, differs in rounds if differs]
    if len(differing) < 2:  # one difference says nothing of a pattern
        return None
    start = min(differing)
    after = sum(1 for c, _ in rounds if c >= start)
    k = len(differing)
    p = math.comb(after, k) / math.comb(len(rounds), k)
    if p >= CONTEXT_P:
        return None
    return {"from": start, "agree_before": len(rounds) - after, "differ_after": k, "after": after, "p": p}


def context_symptom(found: dict) -> str:
    return (f"every round drafted at a context under {found['from']} tokens agrees ({found['agree_before']} rounds), "
            f"{found['differ_after']} of the {found['after']} from there on differ (P = {found['p']:.1g} were the "
            f"differences placed whatever the context): {CONTEXT_DEPENDENT}")
