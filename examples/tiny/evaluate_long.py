"""Measure tau by context over the tiny pair stretched to long context (yarn x32, 32768 positions):
the short-context drafters stretched, beside the drafters fine-tuned at long context (models/long,
train_long.py), both over the same stretched target.

    python examples/tiny/evaluate_long.py     # the table in README.md, "Long-context drafters"

tau = tokens per target forward pooled over a length's prompts (accepted drafts plus one bonus token a
round, over the rounds); acc@k = fraction of those rounds whose k-th draft was accepted. Prompts: the
demo's (parity/context.py: the held-out files' tokens end to end, prompt i of length L their i-th run
of L tokens), greedy, 32 new tokens each.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eagle31_export.demo.long_pair import long_trained_drafters, write_long_context_pair
from eagle31_export.demo.run import context_runs, pooled_tau
from eagle31_export.reference.statistics import accepted_per_position

MODELS = Path(__file__).resolve().parent / "models"


def rows(kind: str, depth: int, runs: dict, lengths: tuple[int, ...]) -> list[str]:
    """One markdown row per drafter (tau by length, then acc@1..depth by length), and the 3.1/3 ratio."""
    taus = {label: [pooled_tau(runs[label][n]) for n in lengths] for label in runs}
    out = []
    for label, by_length in runs.items():
        acc = []
        for n in lengths:
            results = by_length[n]
            counts = [sum(c) for c in zip(*(accepted_per_position(r.accepted_per_step, depth) for r in results))]
            acc.append(" ".join(f"{c / sum(len(r.accepted_per_step) for r in results):.2f}" for c in counts))
        out.append(f"| {kind} | {depth} | {label} | " + " | ".join(f"{t:.2f}" for t in taus[label])
                   + " | " + " / ".join(acc) + " |")
    ratio = [a / b for a, b in zip(taus["EAGLE 3.1"], taus["EAGLE-3"])]
    out.append(f"| {kind} | {depth} | 3.1 / 3 | " + " | ".join(f"{r:.2f}" for r in ratio) + " | |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per length")
    ap.add_argument("--depths", default="3,6")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lengths = tuple(int(n) for n in args.lengths.split(","))
    depths = [int(d) for d in args.depths.split(",")]
    trained = long_trained_drafters(MODELS)
    kinds = {"stretched": None, "long-trained": trained} if trained else {"stretched": None}
    print("| drafters | depth | drafter | " + " | ".join(f"tau@{n}" for n in lengths)
          + " | acc@1..depth at " + " / ".join(map(str, lengths)) + " |")
    print("|---|---|---|" + "---|" * len(lengths) + "---|", flush=True)
    for kind, drafters in kinds.items():
        with tempfile.TemporaryDirectory(prefix="tiny-long-eval-") as work:
            long = write_long_context_pair(MODELS, Path(work), "yarn", drafters)
            for depth in depths:
                began = time.time()
                runs = context_runs(long, lengths, args.prompts, depth)
                print("\n".join(rows(kind, depth, runs, lengths)), flush=True)
                print(f"<!-- {kind}, depth {depth}: {time.time() - began:.0f}s -->", flush=True)


if __name__ == "__main__":
    main()
