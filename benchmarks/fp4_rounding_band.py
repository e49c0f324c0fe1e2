"""How far fp32 moves NVFP4 activations from float64: the figure behind parity's FP4_ROUNDING_BAND.

    .venv/bin/python benchmarks/fp4_rounding_band.py [TARGET ...]   # default: the tiny NVFP4 target

Each target runs one 64-token prompt in fp32 and in float64, quantizing activations (W4A4). At every
quantized Linear's input, in call order, the difference is taken in E2M1 units (the block's scaled
values, 6 at its amax: what rounds against the FP4 boundaries). Calls after the first whose FP4
values differ are left out: from there on the two runs compute from different inputs. Printed beside
the band parity uses, so that the ratio is read in one run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import eagle31_export.formats.nvfp4.model as nvfp4_model
from eagle31_export.formats.nvfp4.numerics import BLOCK_SIZE, E2M1_MAX, fake_quant_activation
from eagle31_export.formats.target.checkpoint import load_causal_lm
from eagle31_export.parity.numerics import FP4_ROUNDING_BAND

ROOT = Path(__file__).resolve().parents[1]


def inputs_at(path: Path, dtype: torch.dtype, ids: torch.Tensor) -> list[tuple[torch.Tensor, float]]:
    """Every quantized Linear's input (and global scale) of one forward, in call order."""
    seen = []

    def recording(x, gs):
        seen.append((x.detach().double(), float(gs)))
        return fake_quant_activation(x, gs)

    nvfp4_model.fake_quant_activation = recording
    try:
        with torch.no_grad():
            load_causal_lm(path, dtype=dtype, act_quant=True)(ids)
    finally:
        nvfp4_model.fake_quant_activation = fake_quant_activation
    return seen


def clean_differences(path: Path) -> list[float]:
    ids = torch.randint(100, 400, (1, 64), generator=torch.Generator().manual_seed(0))
    out = []
    for (x32, gs), (x64, _) in zip(inputs_at(path, torch.float32, ids), inputs_at(path, torch.float64, ids)):
        blocks = x64.reshape(*x64.shape[:-1], -1, BLOCK_SIZE)
        units = E2M1_MAX / blocks.abs().amax(-1, keepdim=True).clamp(min=1e-30)
        out.append(float(((x32 - x64).reshape(blocks.shape) * units).abs().max()))
        if not torch.equal(fake_quant_activation(x32.float(), gs), fake_quant_activation(x64.float(), gs)):
            break  # an FP4 rounding differs: the runs part here
    return out


def main() -> None:
    targets = [Path(a) for a in sys.argv[1:]] or [ROOT / "examples" / "tiny" / "models" / "target-nvfp4"]
    print(f"parity's FP4_ROUNDING_BAND: {FP4_ROUNDING_BAND:g} E2M1 units")
    for path in targets:
        diffs = clean_differences(path)
        print(f"{path.name:>16} ({path.parent.parent.name}): {len(diffs)} quantized inputs before the runs part, "
              f"fp32 - float64 max {max(diffs):.2e} units, median of the per-input max {sorted(diffs)[len(diffs) // 2]:.2e}; "
              f"band / max = {FP4_ROUNDING_BAND / max(diffs):.1f}")


if __name__ == "__main__":
    main()
