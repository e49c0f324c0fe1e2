"""What a drafter bug looks like from the acceptance it leaves, in words (docs/tapped-layers.md,
docs/eagle31.md): the first draft step reads the taps through fc (and fc_norm or norm_before_fc) and maps its token with
d2t; later steps read the drafter's own fed-back state."""

POSITION_1 = ("what the first draft step reads differs: tapped layers, fc or the norms of fc's input (check aux layer "
              "numbering, fc_norm and norm_before_fc), or the draft-to-target vocabulary map (d2t)")
LATER_POSITIONS = "later drafts differ: fed-back state (pre- vs post-norm feedback, norm_output)"


def position_symptom(position: int) -> str:
    """The usual cause of a difference first seen at draft position `position` (1-based)."""
    return POSITION_1 if position == 1 else LATER_POSITIONS
