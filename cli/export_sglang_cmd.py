"""`eagle31-export export sglang`: the drafter in the SpecForge layout and SGLang's server flags."""

from __future__ import annotations

from pathlib import Path

import typer


def register(export_app: typer.Typer) -> None:
    export_app.command("sglang")(sglang)


def sglang(
    drafter: Path = typer.Option(..., "--drafter", help="Drafter checkpoint folder (any supported format)."),
    target: Path = typer.Option(..., "--target", help="Target checkpoint folder (validated, referenced by path)."),
    out: Path = typer.Option(..., "--out", help="Bundle folder to write."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size."),
    steps: int = typer.Option(3, "--num-steps", help="Draft steps (tokens) per verification."),
    copy_target: bool = typer.Option(False, "--copy-target", help="Copy the target into the bundle."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
) -> None:
    """Drafter for SGLang's EAGLE3 algorithm + README with the `sglang.launch_server` flags."""
    from eagle31_export.export.sglang import export_sglang

    path = export_sglang(drafter, target, out, tp, pp, steps, copy_target, force)
    typer.echo(f"SGLang bundle written to {path} (see {path / 'README.md'} for the server command)")
