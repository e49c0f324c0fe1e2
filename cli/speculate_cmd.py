"""`eagle31-export speculate`: run the reference speculation loop and print tokens and statistics."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from eagle31_export.cli.common import parse_dtype, print_json
from eagle31_export.errors import UserError


def register(app: typer.Typer) -> None:
    app.command("speculate")(speculate)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def encode_prompt(target: Path, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except (OSError, ValueError):
        raise UserError(f"{target}: no tokenizer next to the target; pass --prompt-ids instead of --prompt") from None
    return tok(prompt, add_special_tokens=True)["input_ids"]


def speculate(
    drafter: Path = typer.Option(..., "--drafter", help="Drafter checkpoint folder."),
    target: Path = typer.Option(..., "--target", help="Target checkpoint folder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text (needs a tokenizer next to the target)."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt token ids, used as given: 1,2,3."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1),
    depth: int = typer.Option(3, "--depth", min=1, help="Draft tokens per round."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16."),
    act_quant: bool = typer.Option(False, "--act-quant/--no-act-quant", help="NVFP4 targets: emulate W4A4."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Chain speculative decoding with the PyTorch reference; prints tokens and acceptance statistics."""
    from eagle31_export.reference.pair import load_pair
    from eagle31_export.reference.speculate import speculate as run

    if (prompt is None) == (prompt_ids is None):
        raise UserError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    ids = parse_prompt_ids(prompt_ids) if prompt_ids is not None else encode_prompt(target, prompt)
    pair = load_pair(drafter, target, dtype=parse_dtype(dtype), act_quant=act_quant)
    result = run(pair.target, pair.drafter, ids, max_new_tokens, depth, temperature, seed)
    if as_json:
        print_json(result.to_json())
        return
    console = Console()
    console.print(f"tokens: {result.tokens}")
    console.print(f"rounds: {len(result.accepted_per_step)}  accepted per round: {result.accepted_per_step}")
    console.print(f"acceptance length (tau): {result.acceptance_length:.3f}")
    console.print("per-position acceptance: " + ", ".join(f"{r:.2f}" for r in result.per_position_acceptance))
