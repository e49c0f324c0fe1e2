"""What a parity or diagnose run takes before either side loads: the prompts (seeded defaults, a
prompts file, or a capture's) and the checkpoints an exported folder records it came from. At the
bottom of parity/: the per-depth measurement (diagnose.py), the comparison (compare.py) and the
sides (sides.py) import it, never the other way round.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from eagle31_export.formats.prompts import read_prompts


def bundle_sources(bundle: Path) -> tuple[Path | None, Path | None]:
    """The drafter/target an `export onnx` folder or a serving bundle was exported from, where it
    records them (absolute, or relative to the folder)."""
    meta = bundle / "graphs.json"
    if meta.is_file():
        src = json.loads(meta.read_text()).get("source", {})
        return (bundle / src["drafter"] if src.get("drafter") else None,
                bundle / src["target"] if src.get("target") else None)
    record = bundle / "bundle.json"
    if record.is_file():
        data = json.loads(record.read_text())
        drafter = (data.get("drafter_source") or {}).get("path")
        target = data.get("target")
        return (bundle / drafter if isinstance(drafter, str) and drafter else None,
                bundle / target if isinstance(target, str) and target else None)
    return None, None


def default_prompts(vocab_size: int, count: int = 8, seed: int = 0) -> list[list[int]]:
    """A seeded set of token-id prompts of mixed lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.choice((4, 8, 16, 32, 64)))] for _ in range(count)]


def capture_prompts(capture, prompts_file: Path | None) -> list[list[int]]:
    """The captured prompts, or those of `prompts_file`, each of which the capture must hold."""
    if prompts_file is None:
        return capture.prompts()
    prompts = read_prompts(prompts_file, capture.target_path, capture.vocab_size)
    for n, prompt in enumerate(prompts):
        capture.require(prompt, f"{prompts_file} prompt {n + 1}")
    return prompts
