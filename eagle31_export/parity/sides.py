"""Which two speculation setups a parity run compares, and the prompts it runs.

The reference side is always the PyTorch pair (drafter + target checkpoints). The runtime side
comes from the runtime registry (`runtime/registry.py`), given the same checkpoints plus the
exported artifacts (BUNDLE) or a server URL; e.g. `reference` over an exported drafter checks
that the export reads back as the same drafter, `onnxruntime` runs an `export onnx` folder
(exported on the fly when none is given), `triton` asks a running server.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import torch

from eagle31_export.errors import UserError
from eagle31_export.formats.prompts import read_prompts
from eagle31_export.formats.target import read_target_info
from eagle31_export.parity.compare import ParityReport, run_parity
from eagle31_export.runtime.registry import LoadOptions, PairSource, load_speculator, runtime_named


def bundle_sources(bundle: Path) -> tuple[Path | None, Path | None]:
    """The drafter/target an `export onnx` folder was exported from, where it records them."""
    meta = bundle / "graphs.json"
    if meta.is_file():
        src = json.loads(meta.read_text()).get("source", {})
        return (Path(src["drafter"]) if src.get("drafter") else None,
                Path(src["target"]) if src.get("target") else None)
    return None, None


def default_prompts(vocab_size: int, count: int = 8, seed: int = 0) -> list[list[int]]:
    """A seeded set of token-id prompts of mixed lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.choice((4, 8, 16, 32, 64)))] for _ in range(count)]


def check_parity(runtime: str, bundle: Path | None, drafter: Path | None, target: Path | None, url: str | None,
                 prompts_file: Path | None, depth: int, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 progress=None, mode: str | None = None) -> ParityReport:
    """The whole parity check: both sides from the registry, the prompts, the comparison.
    `progress(total)` returns a per-prompt callback (the CLI draws it)."""
    runtime_named(runtime)  # an unknown name fails before anything loads
    if bundle is not None and not bundle.is_dir():
        raise UserError(f"{bundle}: no such bundle folder")
    src_drafter, src_target = bundle_sources(bundle) if bundle else (None, None)
    drafter, target = drafter or src_drafter, target or src_target
    if drafter is None or target is None:
        raise UserError("parity needs the reference pair: pass --drafter D --target T "
                        "(or a bundle that records where it was exported from)")
    vocab = read_target_info(target).vocab_size
    prompts = read_prompts(prompts_file, target, vocab) if prompts_file else default_prompts(vocab)
    options = LoadOptions(dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="eagle31-parity-") as workdir:  # an on-the-fly export lives here
        reference = load_speculator("reference", PairSource.of(drafter, target), options)
        other = load_speculator(runtime, PairSource.of(drafter, target, bundle, url), options, workdir)
        on_prompt = progress(len(prompts)) if progress else None
        return run_parity(reference, other, prompts, depth, max_new_tokens, temperature, seed, other.exact,
                          on_prompt=on_prompt, mode=mode)
