"""Measure the tiny pair: tau by depth (greedy) and teacher-forced agreement on held-out files.

    python examples/tiny/evaluate.py            # prints the table recorded in README.md
"""

from __future__ import annotations

import torch

from eagle31_export.parity.acceptance import teacher_forced_agreement, tau_by_depth, text_prompts
from eagle31_export.parity.tiny_pair import DRAFTERS, TARGET, TARGET_NVFP4, held_out_texts, models_dir, tokenizer
from eagle31_export.reference.pair import load_pair

DEPTHS = range(1, 7)


def main() -> None:
    torch.set_num_threads(1)
    models = models_dir()
    texts = held_out_texts()
    prompts = text_prompts(tokenizer(), texts, 64)
    sequences = text_prompts(tokenizer(), texts, 256 + 6)
    print(f"{len(prompts)} held-out prompts of 64 tokens, 32 new tokens each; agreement over "
          f"{len(sequences)} windows of 256 tokens")
    print("| target | drafter | " + " | ".join(f"tau@{d}" for d in DEPTHS) + " | agreement@1..6 |")
    print("|---|---|" + "---|" * len(DEPTHS) + "---|")
    for target in (TARGET, TARGET_NVFP4):
        for label, folder in DRAFTERS.items():
            pair = load_pair(models / folder, models / target)
            taus = tau_by_depth(pair, prompts, DEPTHS, 32)
            agree = teacher_forced_agreement(pair, sequences, max(DEPTHS)).per_position
            print(f"| {target} | {label} | " + " | ".join(f"{taus[d]:.3f}" for d in DEPTHS)
                  + " | " + " ".join(f"{a:.2f}" for a in agree) + " |", flush=True)


if __name__ == "__main__":
    main()
