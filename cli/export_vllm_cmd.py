"""`eagle31-export export vllm`: the drafter as vLLM reads it and the `--speculative-config` JSON."""

from __future__ import annotations

from pathlib import Path

import typer


def register(export_app: typer.Typer) -> None:
    export_app.command("vllm")(vllm)


def vllm(
    drafter: Path = typer.Option(..., "--drafter", help="Drafter checkpoint folder (any supported format)."),
    target: Path = typer.Option(..., "--target", help="Target checkpoint folder (validated, referenced by path)."),
    out: Path = typer.Option(..., "--out", help="Bundle folder to write."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size."),
    k: int = typer.Option(3, "--num-speculative-tokens", help="Draft tokens per verification."),
    copy_target: bool = typer.Option(False, "--copy-target", help="Copy the target into the bundle."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
) -> None:
    """Drafter for vLLM's eagle3 method (before-layer tap numbering) + README with `vllm serve`."""
    from eagle31_export.export.vllm import export_vllm

    path = export_vllm(drafter, target, out, tp, pp, k, copy_target, force)
    typer.echo(f"vLLM bundle written to {path} (see {path / 'README.md'} for the vllm serve command)")
