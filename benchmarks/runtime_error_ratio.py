"""RUNTIME_ERROR_RATIO (parity/numerics.py), measured: the scale of a faithful runtime's margin shifts
in units of the error the measuring replay finds at each decision.

The tie budget expects sum_s Phi(-margin_s / (r x e_s)) ties over the decisions whose flip the
comparison sees (parity/numerics.py: expected_ties). A faithful runtime's own rounding is another draw
of its precision, so its ties fix r: this prints, for our runtime over the faithful tiny pair (the
reference pair's loop at the precision generating autoregressively, parity replaying in one forward,
as benchmarks/verdict_power.py runs it; 8 held-out prompts of 32 tokens a run, depth 3), the ties it
showed, the ties N(0, e^2) predicts (r = 1), and the r at which the expectation equals the ties seen,
with drafts compared and on accepted counts only.

    .venv/bin/python benchmarks/runtime_error_ratio.py --runs 20 --precision bf16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verdict_power import DEPTH, EAGLE31, PAIR, PRECISIONS, prompt_windows  # noqa: E402

from eagle31_export.parity.numerics import RUNTIME_ERROR_RATIO, expected_ties, measurer_for  # noqa: E402
from eagle31_export.parity.ties import judge  # noqa: E402
from eagle31_export.runtime.registry import LoadOptions, PairSource, load_speculator  # noqa: E402

GRID = [round(0.5 + 0.01 * i, 2) for i in range(451)]  # r from 0.5 to 5.0


def measure(name: str, runs: int, prompts_a_run: int, tokens: int) -> dict[bool, tuple[int, list[float]]]:
    """drafts compared (True) / counts only (False) -> (ties seen, expected ties at each r of GRID)."""
    dtype, fp4, target_name = PRECISIONS[name]
    target = PAIR.folder / target_name
    reference = load_speculator("reference", PairSource.of(EAGLE31, target), LoadOptions(act_quant=fp4))
    runtime = load_speculator("reference", PairSource.of(EAGLE31, target), LoadOptions(dtype=dtype, act_quant=fp4))
    measurer = measurer_for(reference, dtype == torch.float32, dtype, fp4)
    prompts = prompt_windows(tokens, runs * prompts_a_run)[: runs * prompts_a_run]
    out = {True: [0, [0.0] * len(GRID)], False: [0, [0.0] * len(GRID)]}
    for i, prompt in enumerate(prompts):
        run = runtime.run(prompt, tokens, DEPTH)
        ref, measured = measurer.replay(reference, prompt, run)
        for seen in (True, False):
            shown = run if seen else type(run)(run.tokens, [], run.accepted_per_step, run.depth)
            judged = judge(ref, shown, measured, seen)
            if judged is None:
                continue
            out[seen][0] += judged.budget.observed
            for j, r in enumerate(GRID):
                out[seen][1][j] += expected_ties(ref, shown, measured, seen, r).expected
    return {seen: (ties, expected) for seen, (ties, expected) in out.items()}


def fitted(ties: int, expected: list[float]) -> float | None:
    """The r of GRID at which the expectation first reaches the ties seen (None: beyond the grid)."""
    return next((r for r, e in zip(GRID, expected) if e >= ties), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--precision", action="append", choices=["bf16", "bf16+FP4 act"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"parity's RUNTIME_ERROR_RATIO: {RUNTIME_ERROR_RATIO:g}; {args.runs} runs of {args.prompts} prompts, "
          f"{args.tokens} tokens, depth {DEPTH}", flush=True)
    for name in args.precision or ["bf16"]:
        for seen, (ties, expected) in measure(name, args.runs, args.prompts, args.tokens).items():
            at = {r: e for r, e in zip(GRID, expected)}
            print(f"{name:13} {'drafts compared' if seen else 'counts only':15}: {ties} ties; expected at r = 1: "
                  f"{at[1.0]:.1f}, r = 2: {at[2.0]:.1f}; expected = seen at r = {fitted(ties, expected)}", flush=True)


if __name__ == "__main__":
    main()
