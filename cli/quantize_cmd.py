"""`eagle31-export quantize MODEL_DIR --out DIR [--format ...] [--exclude ...] [--experts-only] [--calib-prompts FILE]`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from eagle31_export.cli.progress import ProgressDisplay
from eagle31_export.errors import UserError


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)


def quantize(
    model_dir: Path = typer.Argument(..., help="A BF16/FP16/FP32 Hugging Face checkpoint folder, or an NVFP4 one "
                                               "to convert to --format."),
    out: Path = typer.Option(..., "--out", help="Output folder (written atomically, with manifest.json)."),
    fmt: str = typer.Option("modelopt", "--format", help="modelopt or compressed-tensors."),
    exclude: Optional[List[str]] = typer.Option(
        None, "--exclude", help="Keep matching Linears unquantized (exact name, substring or wildcard; repeatable). "
                                "lm_head, routers and vision towers are always kept."),
    experts_only: bool = typer.Option(
        False, "--experts-only", help="Quantize only the routed MoE experts (ModelOpt's NVFP4_EXPERTS_ONLY_CFG: the "
                                      "layout of the published Kimi K2.x NVFP4 checkpoints)."),
    calib_prompts: Optional[Path] = typer.Option(
        None, "--calib-prompts", help="JSONL calibration prompts: {\"prompt_ids\": [...]} or {\"text\": ...} "
                                      "(needs a tokenizer in MODEL_DIR). Default: a built-in set of token-id prompts."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
) -> None:
    """Quantize a checkpoint to NVFP4 (ModelOpt numerics, bit-exact), or convert NVFP4 between formats."""
    from eagle31_export.formats.prompts import read_prompts
    from eagle31_export.formats.target.quantize import quantize_checkpoint
    from eagle31_export.formats.target.checkpoint import read_target_info

    if fmt not in ("modelopt", "compressed-tensors"):
        raise UserError(f"--format {fmt!r}: use modelopt or compressed-tensors")
    prompts = None
    if calib_prompts is not None:
        prompts = read_prompts(calib_prompts, model_dir, read_target_info(model_dir).vocab_size)
    console = Console(stderr=True)
    with ProgressDisplay("quantize", console) as display:
        result = quantize_checkpoint(model_dir, out, fmt, exclude=tuple(exclude or ()), prompts=prompts, force=force,
                                     progress=display.tensor_steps(), inputs=(calib_prompts,) if calib_prompts else (),
                                     experts_only=experts_only)
    for note in result.notes:
        console.print(f"[yellow]note: {note}[/]")
    if result.quantized:
        console.print(f"[green]{len(result.quantized)} Linears quantized to NVFP4 ({result.format}); "
                      f"{len(result.excluded)} modules kept unquantized[/]")
    console.print(f"wrote {result.out}")

