"""`eagle31-export demo`: the main job on the embedded default."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(out: Path = typer.Option(Path("out/demo"), "--out", help="Where the demo writes its artifacts."),
         force: bool = typer.Option(True, "--force/--no-force", help="Replace an earlier demo output.")) -> None:
    """The tiny trained pair through inspect, NVFP4, every export, parity on ONNX Runtime, and tau by depth."""
    from eagle31_export.demo import run_demo

    run_demo(out, force=force)
