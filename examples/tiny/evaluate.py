"""Measure the tiny pair: tau by depth (greedy) and teacher-forced agreement on held-out files.

    python examples/tiny/evaluate.py            # prints the table recorded in README.md
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle31_export.demo.pair import DRAFTERS, TARGET, TARGET_NVFP4, EmbeddedPair
from eagle31_export.parity.acceptance import teacher_forced_agreement, tau_by_depth, text_prompts
from eagle31_export.runtime.registry import PairSource, load_speculator

DEPTHS = range(1, 7)


def main() -> None:
    torch.set_num_threads(1)
    pair = EmbeddedPair.open(Path(__file__).resolve().parent / "models")
    models, texts, tokenizer = pair.folder, pair.held_out_texts(), pair.tokenizer()
    prompts = text_prompts(tokenizer, texts, 64)
    sequences = text_prompts(tokenizer, texts, 256 + 6)
    print(f"{len(prompts)} held-out prompts of 64 tokens, 32 new tokens each; agreement over "
          f"{len(sequences)} windows of 256 tokens")
    print("| target | drafter | " + " | ".join(f"tau@{d}" for d in DEPTHS) + " | agreement@1..6 |")
    print("|---|---|" + "---|" * len(DEPTHS) + "---|")
    for target in (TARGET, TARGET_NVFP4):
        for label, folder in DRAFTERS.items():
            reference = load_speculator("reference", PairSource.of(models / folder, models / target))
            taus = tau_by_depth(reference, prompts, DEPTHS, 32)
            agree = teacher_forced_agreement(reference.pair, sequences, max(DEPTHS)).per_position
            print(f"| {target} | {label} | " + " | ".join(f"{taus[d]:.3f}" for d in DEPTHS)
                  + " | " + " ".join(f"{a:.2f}" for a in agree) + " |", flush=True)


if __name__ == "__main__":
    main()
