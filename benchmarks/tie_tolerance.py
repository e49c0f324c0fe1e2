"""How far the reference's own decisions move between fp32 and half precision: the basis of parity's
half-precision tie tolerance (`parity.compare.Thresholds.tie_gap_half_precision`).

    .venv/bin/python benchmarks/tie_tolerance.py [--pair examples/tiny/models] [--tokens 32]

For each target of the pair (the BF16 target; the NVFP4 target as W4A16 and as W4A4, `--act-quant`),
the fp32 reference generates greedily from parity's default prompts; along those same sequences the
reference in bf16 computes its logits too. At every generated position it prints the distribution
of |gap_bf16 - gap_fp32|, where gap is the fp32 greedy token's logit minus the runner-up's: how far
rounding alone moves a decision's margin. A margin smaller than that shift may flip between an
fp32 and a bf16 engine: a numerical tie. The tolerance is printed beside it, and the ratio.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from eagle31_export.parity.compare import Thresholds
from eagle31_export.parity.sides import default_prompts
from eagle31_export.reference.target import load_target

ROOT = Path(__file__).resolve().parents[1]


def greedy_sequences(target, prompts: list[list[int]], tokens: int) -> list[torch.Tensor]:
    """Each prompt followed by the fp32 target's own greedy continuation."""
    out = []
    for prompt in prompts:
        seq = torch.tensor([prompt])
        for _ in range(tokens):
            target.reset()
            logits, _ = target.forward(seq)
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
        out.append(seq)
    return out


def margin_shifts(fp32, half, sequences: list[torch.Tensor], tokens: int) -> torch.Tensor:
    """|gap_half - gap_fp32| at every generated position, gaps taken at the fp32 top-2 tokens."""
    shifts = []
    for seq in sequences:
        fp32.reset()
        half.reset()
        a = fp32.forward(seq)[0][0, -tokens - 1:-1].double()
        b = half.forward(seq)[0][0, -tokens - 1:-1].double()
        top2 = a.topk(2, dim=-1).indices
        gap_a = a.gather(1, top2[:, :1]) - a.gather(1, top2[:, 1:])
        gap_b = b.gather(1, top2[:, :1]) - b.gather(1, top2[:, 1:])
        shifts.append((gap_b - gap_a).abs().flatten())
    return torch.cat(shifts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, default=ROOT / "examples" / "tiny" / "models")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    thresholds = Thresholds()
    print("|margin shift| between the reference in fp32 and in bf16, beside the half-precision tie tolerance")
    rows = [("target (bf16 weights)", args.pair / "target", False),
            ("target-nvfp4, W4A16", args.pair / "target-nvfp4", False),
            ("target-nvfp4, W4A4 (--act-quant)", args.pair / "target-nvfp4", True)]
    print(f"{'target':36} {'positions':>9} {'median':>8} {'p99':>8} {'max':>8} {'tolerance':>9} {'max/tol':>8}")
    for name, path, act_quant in rows:
        tolerance = replace(thresholds, fp4_activations=act_quant).tie_gap(exact=False)
        fp32 = load_target(path, (0,), torch.float32, act_quant=act_quant)
        half = load_target(path, (0,), torch.bfloat16, act_quant=act_quant)
        prompts = default_prompts(fp32.model.config.vocab_size)
        shifts = margin_shifts(fp32, half, greedy_sequences(fp32, prompts, args.tokens), args.tokens)
        print(f"{name:36} {shifts.numel():9d} {shifts.median():8.3f} {shifts.quantile(0.99):8.3f} "
              f"{shifts.max():8.3f} {tolerance:9g} {float(shifts.max()) / tolerance:8.2f}")


if __name__ == "__main__":
    main()
