"""`eagle31-export export engine`: TensorRT engines from exported ONNX graphs (GPU machines)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eagle31_export.cli.common import ForceOpt


def register(export_app: typer.Typer) -> None:
    export_app.command("engine")(engine)


def engine(
    onnx: Path = typer.Option(..., "--onnx", help="Folder written by `export onnx`."),
    out: Path = typer.Option(..., "--out", help="Folder for the .engine files."),
    plugins: Optional[Path] = typer.Option(None, "--plugins", help="Plugin library (.so) with the Eagle31 plugins."),
    fp16: bool = typer.Option(False, "--fp16", help="Allow FP16 kernels."),
    bf16: bool = typer.Option(False, "--bf16", help="Allow BF16 kernels."),
    fp8: bool = typer.Option(False, "--fp8", help="Allow FP8 kernels (Hopper and newer)."),
    max_tokens: int = typer.Option(2048, "--max-tokens", min=1, help="Upper bound for every dynamic dimension."),
    force: ForceOpt = False,
) -> None:
    """Build one TensorRT engine per ONNX graph, with the plugin library registered."""
    from eagle31_export.errors import UserError
    from eagle31_export.export.engine import ShapeRange, build_engines

    chosen = [name for name, on in (("fp16", fp16), ("bf16", bf16), ("fp8", fp8)) if on]
    if len(chosen) > 1:
        raise UserError(f"choose at most one of --fp16, --bf16, --fp8 (got {', '.join('--' + c for c in chosen)})")
    shapes = ShapeRange(min=1, opt=min(64, max_tokens), max=max_tokens)
    path = build_engines(onnx, out, plugins, chosen[0] if chosen else "fp32", shapes, force=force)
    typer.echo(f"TensorRT engines written to {path}")
