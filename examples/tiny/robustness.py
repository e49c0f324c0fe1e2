"""EAGLE-3 vs EAGLE 3.1 on the tiny pair: tau and per-depth acceptance (a) by context length and
(b) under prompt-template perturbations, with the ratio 3.1 / 3. Prints the markdown tables recorded
in README.md.

    python examples/tiny/robustness.py            # about 2 minutes on an idle 2-core machine

Greedy speculation at depth 6, 32 new tokens per prompt, on the held-out standard-library files.
tau = tokens per target forward (mean ± standard error over prompts); acc@k = fraction of rounds whose k-th draft was accepted (pooled
over all rounds of all prompts).
(a) windows of N tokens from the held-out files (one per file, from its middle). The target was
trained on 256-token windows, so N + 32 <= 256 is the context it handles; one row past it shows
what happens beyond.
(b) the first ~128 tokens of each held-out file (its header and first lines), as they are and
perturbed: a system-prompt-like prefix, 2-space or tab indentation, extra blank lines and trailing
spaces, a different file header (shebang, coding line, licence comment; it replaces the file's own
leading comments, and its docstring where the docstring ends within the prompt). Each prompt ends
at the same point of the code in every variant.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from eagle31_export.demo.pair import DRAFTERS, EmbeddedPair
from eagle31_export.parity.acceptance import text_prompts
from eagle31_export.runtime.registry import PairSource, load_speculator

TRAINED_CONTEXT = 256  # examples/tiny/train.py: the target's training windows
SYSTEM_PREFIX = ("# System: you are a careful Python assistant. Complete the module below,\n"
                 "# keeping its style; answer with code only.\n\n")
OTHER_HEADER = ("#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\n"
                "# Copyright (c) 2024 Example Org. Licensed under the MIT License.\n\n")
_LEADING_HEADER = re.compile(r'\A(?:[ \t]*(?:#[^\n]*)?\n)*(?:[rRuU]?("""|\'\'\')[\s\S]*?\1[ \t]*\n)?')


def reindent(text: str, unit: str) -> str:
    """Each leading group of 4 spaces becomes `unit`."""
    def fix(m: re.Match) -> str:
        return unit * (len(m.group(0)) // 4) + " " * (len(m.group(0)) % 4)

    return re.sub(r"^ +", fix, text, flags=re.MULTILINE)


def loosen(text: str) -> str:
    """Extra blank lines and trailing spaces."""
    return re.sub(r"\n\n", "\n\n\n", text).replace(":\n", ":  \n")


def other_header(text: str) -> str:
    """The file's own leading comments and docstring replaced by a different header."""
    return OTHER_HEADER + text[_LEADING_HEADER.match(text).end():]


PERTURBATIONS = {
    "as is": lambda t: t,
    "system-prompt prefix": lambda t: SYSTEM_PREFIX + t,
    "2-space indentation": lambda t: reindent(t, "  "),
    "tab indentation": lambda t: reindent(t, "\t"),
    "blank lines + trailing spaces": loosen,
    "different file header": other_header,
}


def file_heads(tokenizer, texts: list[str], tokens: int) -> list[str]:
    """Each file's beginning, cut at the end of the line where its first `tokens` tokens end."""
    heads = []
    for text in texts:
        lines, head = text.splitlines(keepends=True), ""
        for line in lines:
            head += line
            if len(tokenizer(head)["input_ids"]) >= tokens:
                break
        heads.append(head.rstrip("\n") + "\n")
    return heads


def measure(speculator, prompts: list[list[int]], depth: int, new_tokens: int) -> tuple[list[float], list[float]]:
    """tau of each prompt, and per-depth acceptance pooled over all rounds."""
    taus, accepted, rounds = [], [0] * depth, 0
    for prompt in prompts:
        result = speculator.run(prompt, new_tokens, depth)
        taus.append(result.acceptance_length)
        for a in result.accepted_per_step:
            for k in range(a):
                accepted[k] += 1
        rounds += len(result.accepted_per_step)
    return taus, [a / rounds for a in accepted]


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, (var / n) ** 0.5


def table(title: str, column: str, rows: list[tuple[str, list[list[int]]]], speculators: dict, depth: int,
          new_tokens: int, note=lambda label: "") -> None:
    e3, e31 = speculators["EAGLE-3"], speculators["EAGLE 3.1"]
    accs = " ".join(f"@{k}" for k in range(1, depth + 1))
    print(f"\n{title}\n")
    print(f"| {column} | prompts | mean tokens | tau EAGLE-3 | tau EAGLE 3.1 | tau 3.1/3 |"
          f" acc{accs} EAGLE-3 | acc{accs} EAGLE 3.1 | acc 3.1/3 {accs} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, prompts in rows:
        taus3, acc3 = measure(e3, prompts, depth, new_tokens)
        taus31, acc31 = measure(e31, prompts, depth, new_tokens)
        (tau3, se3), (tau31, se31) = mean_se(taus3), mean_se(taus31)
        mean_len = sum(map(len, prompts)) / len(prompts)
        ratios = " ".join(f"{b / a:.2f}" if a else "-" for a, b in zip(acc3, acc31))
        print(f"| {label}{note(label)} | {len(prompts)} | {mean_len:.0f} | {tau3:.2f} ± {se3:.2f} "
              f"| {tau31:.2f} ± {se31:.2f} | {tau31 / tau3:.3f} "
              f"| {' '.join(f'{a:.2f}' for a in acc3)} | {' '.join(f'{a:.2f}' for a in acc31)} | {ratios} |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 192, 224, 448])
    ap.add_argument("--head-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pair = EmbeddedPair.open(Path(__file__).resolve().parent / "models")
    tokenizer, texts = pair.tokenizer(), pair.held_out_texts()
    speculators = {label: load_speculator("reference", PairSource.of(pair.drafter(label), pair.target))
                   for label in DRAFTERS}

    by_length = [(f"{n}", text_prompts(tokenizer, texts, n)) for n in args.lengths]
    past = lambda label: (f" (past the {TRAINED_CONTEXT}-token training window)"  # noqa: E731
                          if int(label) + args.new_tokens > TRAINED_CONTEXT else "")
    table(f"(a) by context length (held-out windows; depth {args.depth}, {args.new_tokens} new tokens)",
          "context tokens", by_length, speculators, args.depth, args.new_tokens, past)

    heads = file_heads(tokenizer, texts, args.head_tokens)
    perturbed = [(name, [tokenizer(fn(h))["input_ids"] for h in heads]) for name, fn in PERTURBATIONS.items()]
    table(f"(b) under prompt-template perturbation (the first ~{args.head_tokens} tokens of each held-out file; "
          f"depth {args.depth}, {args.new_tokens} new tokens)", "prompt", perturbed, speculators, args.depth,
          args.new_tokens)


if __name__ == "__main__":
    main()
