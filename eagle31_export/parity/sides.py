"""Which two speculation setups a parity run compares, and the prompts it runs.

The reference side is always the PyTorch pair (drafter + target checkpoints). The runtime side:
- `reference`:   the PyTorch reference again, over a bundle's drafter checkpoint when given
                 (checks that an exported checkpoint reads back as the same drafter);
- `onnxruntime`: an `export onnx` folder run by ONNX Runtime (exported on the fly when no bundle);
- `triton`:      a running Triton server (`--url`) serving the pair.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle31_export.errors import UserError
from eagle31_export.parity.compare import Runner, loop_runner
from eagle31_export.reference.pair import ReferencePair, load_pair

RUNTIMES = ("reference", "onnxruntime", "triton")


@dataclass
class Sides:
    reference: ReferencePair
    runtime: Runner
    runtime_name: str
    exact: bool  # fp32 end to end: accepted_per_step must match exactly
    reference_target_path: Path | None = None


def bundle_sources(bundle: Path) -> tuple[Path | None, Path | None]:
    """The drafter/target a bundle was exported from, where it records them."""
    meta = bundle / "graphs.json"
    if meta.is_file():
        src = json.loads(meta.read_text()).get("source", {})
        return (Path(src["drafter"]) if src.get("drafter") else None,
                Path(src["target"]) if src.get("target") else None)
    return None, None


def resolve_sides(runtime: str, bundle: Path | None, drafter: Path | None, target: Path | None,
                  url: str | None = None, workdir: Path | None = None) -> Sides:
    """`workdir`: where an on-the-fly ONNX export goes (the caller owns and removes it)."""
    if runtime not in RUNTIMES:
        raise UserError(f"unknown --runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if bundle is not None and not bundle.is_dir():
        raise UserError(f"{bundle}: no such bundle folder")
    src_drafter, src_target = bundle_sources(bundle) if bundle else (None, None)
    drafter, target = drafter or src_drafter, target or src_target
    if drafter is None or target is None:
        raise UserError("parity needs the reference pair: pass --drafter D --target T "
                        "(or a bundle that records where it was exported from)")
    reference = load_pair(drafter, target, dtype=torch.float32)
    if runtime == "reference":
        other = load_pair(bundle or drafter, target, dtype=torch.float32)
        sides = Sides(reference, loop_runner(other.target, other.drafter), "reference", True)
    elif runtime == "onnxruntime":
        sides = _onnxruntime_side(reference, bundle, drafter, target, workdir)
    else:
        sides = _triton_side(reference, url)
    sides.reference_target_path = Path(target)
    return sides


def _onnxruntime_side(reference, bundle, drafter, target, workdir) -> Sides:
    from eagle31_export.runtime.onnxruntime import OnnxExport, load_backends

    if bundle is None:
        from eagle31_export.export.onnx_export import export_onnx

        if workdir is None:
            raise UserError("exporting on the fly needs a work folder; pass a BUNDLE from `export onnx` instead")
        bundle = export_onnx(drafter, workdir / "onnx", target)
    export = OnnxExport.open(bundle)
    ort_target, ort_drafter = load_backends(bundle)
    if ort_target is None:
        raise UserError(f"{bundle}: exported without a target graph; export with --target for parity")
    return Sides(reference, loop_runner(ort_target, ort_drafter), "onnxruntime", export.meta.get("dtype") == "fp32")


def _triton_side(reference, url) -> Sides:
    if not url:
        raise UserError("--runtime triton needs --url HOST:PORT (HTTP) of a running server (see `eagle31-export serve`)")
    from eagle31_export.runtime.triton_client import remote_speculate

    # The server runs the whole loop; its rounds come back as a SpecResult (no draft logits).
    return Sides(reference, lambda p, n, d, t, s: remote_speculate(url, p, n, d, t, s), "triton", True)


def load_prompts(path: Path | None, target: Path, count: int = 8, seed: int = 0) -> list[list[int]]:
    """JSONL prompts ({"prompt_ids": [...]} or {"text": ...}), or a seeded default set."""
    if path is None:
        vocab = json.loads((target / "config.json").read_text()).get("vocab_size", 256)
        rng = random.Random(seed)
        return [[rng.randrange(vocab) for _ in range(rng.choice((4, 8, 16, 32, 64)))] for _ in range(count)]
    prompts, tokenizer = [], None
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n}: not JSON; each line must be {{\"prompt_ids\": [...]}} or {{\"text\": ...}}") from None
        if "prompt_ids" in row:
            prompts.append([int(i) for i in row["prompt_ids"]])
        elif "text" in row:
            tokenizer = tokenizer or _tokenizer(target)
            prompts.append(tokenizer(row["text"])["input_ids"])
        else:
            raise UserError(f"{path}:{n}: expected a \"prompt_ids\" or \"text\" field")
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return prompts


def _tokenizer(target: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except (OSError, ValueError):
        raise UserError(f"{target}: text prompts need a tokenizer next to the target; use prompt_ids") from None



def check_parity(runtime: str, bundle: Path | None, drafter: Path | None, target: Path | None, url: str | None,
                 prompts_file: Path | None, depth: int, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 progress=None):
    """The whole parity check: resolve both sides, load prompts, compare. `progress(total)` returns
    a per-prompt callback (the CLI's progress bar)."""
    import tempfile

    from eagle31_export.parity.compare import run_parity

    with tempfile.TemporaryDirectory(prefix="eagle31-parity-") as workdir:  # an on-the-fly export lives here
        sides = resolve_sides(runtime, bundle, drafter, target, url, Path(workdir))
        prompts = load_prompts(prompts_file, target or sides.reference_target_path)
        on_prompt = progress(len(prompts)) if progress else None
        reference = loop_runner(sides.reference.target, sides.reference.drafter)
        return run_parity(reference, sides.runtime, prompts, depth, max_new_tokens, temperature, seed, sides.exact,
                          sides.runtime_name, on_prompt=on_prompt)
