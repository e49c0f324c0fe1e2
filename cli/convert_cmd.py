"""`eagle31-export convert DIR --out DIR`: pickle weights (pytorch_model.bin) to safetensors, tensors only."""

from __future__ import annotations

from pathlib import Path

import typer

from eagle31_export.cli.progress import working


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)


def convert(
    src: Path = typer.Argument(..., help="A checkpoint folder with pytorch_model.bin (or its shards and index)."),
    out: Path = typer.Option(..., "--out", help="Folder to write: the same checkpoint with safetensors weights."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier output of this tool at --out."),
) -> None:
    """Convert pickle weights to safetensors with torch.load(weights_only=True): tensors only, no code runs."""
    from eagle31_export.formats.convert import convert_pickle_checkpoint

    with working("convert"):
        result = convert_pickle_checkpoint(src, out, force=force)
    typer.echo(f"{result.tensors} tensors ({result.bytes / 1e6:.1f} MB) written as safetensors to {result.out}")
