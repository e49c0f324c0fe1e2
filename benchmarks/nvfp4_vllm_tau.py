"""Mean acceptance length (tau) of the tiny EAGLE 3.1 drafter over each tiny NVFP4 target: the
reference as W4A16, as W4A4 and as W4A4 reading scales the way vLLM does, beside vLLM's own engine
(its CPU build with our plugin: `make setup-vllm`), on the same prompts, in one run.

    .venv/bin/python benchmarks/nvfp4_vllm_tau.py [--vllm .venv-vllm] [--work DIR]

Targets: the ModelOpt example (`examples/tiny/models/target-nvfp4`), its compressed-tensors
conversion, and `quantize` output of the BF16 tiny target in both formats. vLLM computes
compressed-tensors targets in fp32 and ModelOpt ones in bf16 (its `modelopt_fp4` takes bf16/fp16
only); the reference columns are fp32, each its own greedy speculation (depth 3, 32 new tokens,
parity's default prompts). The last columns are `parity --runtime vllm --act-quant`'s verdict and
its count of numerical ties (parity/ties.py), from the same vLLM run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from eagle31_export.formats.nvfp4.convert import convert_checkpoint
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.formats.target.checkpoint import read_target_info
from eagle31_export.parity.sides import check_parity, default_prompts
from eagle31_export.runtime.registry import LoadOptions, PairSource, load_speculator

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "models"
DRAFTER = TINY / "drafter-eagle31"
DEPTH, TOKENS = 3, 32
REFERENCES = {"W4A16": dict(act_quant=False, nvfp4_semantics="exact"),
              "W4A4": dict(act_quant=True, nvfp4_semantics="exact"),
              "W4A4, vLLM's scales": dict(act_quant=True, nvfp4_semantics="vllm")}


def targets(work: Path) -> list[tuple[str, Path, torch.dtype]]:
    return [("ModelOpt example", TINY / "target-nvfp4", torch.bfloat16),
            ("its compressed-tensors conversion",
             convert_checkpoint(TINY / "target-nvfp4", work / "converted", "compressed-tensors"), torch.float32),
            ("quantize, compressed-tensors",
             quantize_checkpoint(TINY / "target", work / "q-ct", "compressed-tensors").out, torch.float32),
            ("quantize, ModelOpt", quantize_checkpoint(TINY / "target", work / "q-mo", "modelopt").out, torch.bfloat16)]


def reference_tau(target: Path, prompts: list[list[int]], **options) -> float:
    speculator = load_speculator("reference", PairSource.of(DRAFTER, target), LoadOptions(**options))
    results = [speculator.run(p, TOKENS, DEPTH) for p in prompts]
    return sum(r.acceptance_length for r in results) / len(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=os.environ.get("EAGLE31_VLLM", str(ROOT / ".venv-vllm")))
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        header = ["target", "vLLM dtype", *REFERENCES, "vLLM", "parity", "ties"]
        print(" | ".join(header))
        for name, target, dtype in targets(work):
            prompts = default_prompts(read_target_info(target).vocab_size)  # parity's own prompts
            taus = [reference_tau(target, prompts, **o) for o in REFERENCES.values()]
            report = check_parity("vllm", None, DRAFTER, target, None, None, DEPTH, TOKENS, act_quant=True,
                                  runtime_options={"vllm": args.vllm, "dtype": dtype})
            print(" | ".join([name, str(dtype).removeprefix("torch."), *(f"{t:.3f}" for t in taus),
                              f"{report.tau('runtime'):.3f}", "PASS" if report.passed else "FAIL",
                              str(report.tie_count)]))


if __name__ == "__main__":
    main()
