"""`eagle31-export export trtllm`: a TensorRT-LLM (PyTorch backend) bundle for the pair."""

from __future__ import annotations

from pathlib import Path

import typer


def register(export_app: typer.Typer) -> None:
    export_app.command("trtllm")(trtllm)


def trtllm(
    drafter: Path = typer.Option(..., "--drafter", help="Drafter checkpoint folder (any supported format)."),
    target: Path = typer.Option(..., "--target", help="Target checkpoint folder (validated, referenced by path)."),
    out: Path = typer.Option(..., "--out", help="Bundle folder to write."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size."),
    max_draft_len: int = typer.Option(3, "--max-draft-len", help="Draft tokens per verification."),
    copy_target: bool = typer.Option(False, "--copy-target", help="Copy the target into the bundle."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
) -> None:
    """Drafter in TensorRT-LLM's Eagle3 layout + LLM-API YAML for trtllm-serve / trtllm-bench."""
    from eagle31_export.export.trtllm import export_trtllm

    path = export_trtllm(drafter, target, out, tp, pp, max_draft_len, copy_target, force)
    typer.echo(f"TensorRT-LLM bundle written to {path} (see {path / 'README.md'} for the trtllm-serve command)")
