"""Acceptance statistics: the ONE definition of tau and per-position acceptance.

Standard library only: this file is also copied next to the Triton TensorRT-LLM model, which
runs where this package may not be installed (see runtime/triton_models/).

- tau (acceptance length) = tokens produced per target verification = 1 + accepted / rounds
  (vLLM's `mean_acceptance_length`; docs/speculation.md#acceptance-length);
- per-position acceptance at draft position i (1-based) = rounds whose i-th draft was accepted / rounds.
"""

from __future__ import annotations


def acceptance_length(accepted_total: int, rounds: int) -> float:
    """tau: accepted drafts plus the bonus token, per verification round (0.0 with no rounds)."""
    return 1.0 + accepted_total / rounds if rounds else 0.0


def accepted_per_position(accepted_per_step: list[int], depth: int) -> list[int]:
    """Rounds whose draft at position i+1 was accepted (a chain accepts a prefix of its drafts)."""
    return [sum(a >= i for a in accepted_per_step) for i in range(1, depth + 1)]


def per_position_acceptance(accepted_per_step: list[int], depth: int) -> list[float]:
    rounds = max(len(accepted_per_step), 1)
    return [count / rounds for count in accepted_per_position(accepted_per_step, depth)]


def rounds_from_counts(output_tokens: int, accepted_total: int) -> int:
    """Verification rounds, from what a runtime reports (output length and accepted drafts).

    The prefill yields one token and every round yields its accepted drafts plus one bonus
    token, so output_tokens = 1 + rounds + accepted_total (a round cut by max_tokens counts whole).
    """
    return max(output_tokens - 1 - accepted_total, 0)


def statistics(accepted_per_step: list[int], draft_tokens: list[list[int]]) -> dict:
    """Acceptance statistics under the names TensorRT-LLM's Triton model uses, plus tau."""
    drafted = sum(len(d) for d in draft_tokens)
    accepted = sum(accepted_per_step)
    return {
        "accepted_per_step": list(accepted_per_step),
        "acceptance_length": acceptance_length(accepted, len(accepted_per_step)),
        "total_accepted_draft_tokens": accepted,
        "total_draft_tokens": drafted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "draft_tokens": [list(d) for d in draft_tokens],
    }
