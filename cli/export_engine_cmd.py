"""`eagle31-export export engine`: TensorRT engines from exported ONNX graphs (GPU machines)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eagle31_export.cli.common import ForceOpt, echo_warnings


def register(export_app: typer.Typer) -> None:
    export_app.command("engine")(engine)


def engine(
    onnx: Path = typer.Option(..., "--onnx", help="Folder written by `export onnx`."),
    out: Path = typer.Option(..., "--out", help="Folder for the .engine files."),
    plugins: Optional[Path] = typer.Option(None, "--plugins", help="Plugin library (.so) with the Eagle31 plugins."),
    fp16: bool = typer.Option(False, "--fp16", help="Allow FP16 kernels (TensorRT 10; TensorRT 11 computes in the "
                                                    "graphs' dtype: export them with --dtype fp16)."),
    bf16: bool = typer.Option(False, "--bf16", help="Allow BF16 kernels (TensorRT 10; see --fp16)."),
    fp8: bool = typer.Option(False, "--fp8", help="Allow FP8 kernels (TensorRT 10, Hopper and newer)."),
    max_batch: int = typer.Option(1, "--max-batch", min=1, help="Most sequences served together."),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", min=1,
                                              help="Most positions per sequence (prompt + generated tokens; "
                                                   "default: 4096, or the export's rope table when shorter)."),
    draft_depth: Optional[int] = typer.Option(None, "--draft-depth", min=1,
                                              help="Drafted tokens per round (default: the export's chain depth, "
                                                   "else 4)."),
    workspace: float = typer.Option(4.0, "--workspace", min=0.0, help="TensorRT workspace pool, GiB."),
    device_memory: Optional[float] = typer.Option(None, "--device-memory", min=0.0,
                                                  help="GPU memory to check the estimate against, GiB (default: "
                                                       "the first CUDA device's)."),
    plan_only: bool = typer.Option(False, "--plan", help="Print the profiles and memory estimates, build nothing "
                                                         "(no TensorRT needed)."),
    force: ForceOpt = False,
) -> None:
    """Build one TensorRT engine per ONNX graph, with the plugin library registered.

    Each graph gets optimization profiles sized from the model and --max-batch / --max-seq-len /
    --draft-depth (a prefill profile on an empty cache, a decode profile on a filled one); the
    activation memory at their largest shapes is printed, and refused above the device's memory.
    """
    from eagle31_export.errors import UserError
    from eagle31_export.export.engine import build_engines, check_memory, plan_engines
    from eagle31_export.export.tensorrt_profiles import ServingLimits

    chosen = [name for name, on in (("fp16", fp16), ("bf16", bf16), ("fp8", fp8)) if on]
    if len(chosen) > 1:
        raise UserError(f"choose at most one of --fp16, --bf16, --fp8 (got {', '.join('--' + c for c in chosen)})")
    limits = ServingLimits(max_batch=max_batch, max_seq_len=max_seq_len, draft_depth=draft_depth)
    if plan_only:
        plan = plan_engines(onnx, limits, device_memory)
        for line in plan.lines(workspace):
            typer.echo(line)
        check_memory(plan, workspace)
        echo_warnings(plan.notes)
        return
    path = build_engines(onnx, out, plugins, chosen[0] if chosen else "fp32", limits, workspace, force=force,
                         device_memory_gib=device_memory, show=typer.echo, warn=lambda line: echo_warnings([line]))
    typer.echo(f"TensorRT engines written to {path}")
