"""`eagle31-export export <kind>`: one sub-command per artifact kind, each in cli/export_<kind>_cmd.py."""

from __future__ import annotations

import typer

from eagle31_export.cli import (
    export_engine_cmd,
    export_onnx_cmd,
    export_sglang_cmd,
    export_triton_cmd,
    export_trtllm_cmd,
    export_vllm_cmd,
)


def register(app: typer.Typer) -> None:
    export_app = typer.Typer(help="Export a drafter/target pair for a runtime.", no_args_is_help=True)
    export_onnx_cmd.register(export_app)
    export_trtllm_cmd.register(export_app)
    export_vllm_cmd.register(export_app)
    export_sglang_cmd.register(export_app)
    export_engine_cmd.register(export_app)
    export_triton_cmd.register(export_app)
    app.add_typer(export_app, name="export")
