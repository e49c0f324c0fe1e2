"""`eagle31-export export <kind>`: one sub-command per artifact kind, each in cli/export_<kind>_cmd.py."""

from __future__ import annotations

import importlib

import typer

KINDS = ("onnx", "trtllm", "vllm", "sglang", "engine", "triton")


def register(app: typer.Typer) -> None:
    export_app = typer.Typer(help="Export a drafter/target pair for a runtime.", no_args_is_help=True)
    for kind in KINDS:
        name = f"eagle31_export.cli.export_{kind}_cmd"
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.register(export_app)
    app.add_typer(export_app, name="export")
