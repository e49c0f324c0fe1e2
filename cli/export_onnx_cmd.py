"""`eagle31-export export onnx`: drafter (and target) graphs with EAGLE 3.1 plugin nodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from eagle31_export.cli.common import DrafterOpt, ForceOpt, parse_dtype, print_json
from eagle31_export.cli.progress import ProgressDisplay
from eagle31_export.errors import MissingRuntimeError


def register(export_app: typer.Typer) -> None:
    export_app.command("onnx")(onnx_cmd)


def onnx_cmd(
    drafter: DrafterOpt,
    target: Optional[Path] = typer.Option(None, "--target", help="Target checkpoint folder: also exports target.onnx "
                                                                 "(and supplies the drafter's embeddings / lm_head)."),
    out: Path = typer.Option(..., "--out", help="Folder to write."),
    flavor: str = typer.Option("onnxruntime", "--flavor", help="NVFP4 target weights: tensorrt (FLOAT4E2M1 + "
                                                               "DequantizeLinear, W4A16), tensorrt-w4a4 (also activations "
                                                               "dynamically FP4-quantized: FP4 GEMMs on Blackwell, "
                                                               "TensorRT >= 10.8) or onnxruntime (packed uint8 + local "
                                                               "function)."),
    chain_depth: Optional[int] = typer.Option(None, "--chain-depth", min=1,
                                              help="Also export the greedy depth-N chain as one graph."),
    dtype: str = typer.Option("fp32", "--dtype", help="Compute dtype of the graphs: fp32, fp16 or bf16."),
    max_positions: Optional[int] = typer.Option(None, "--max-positions", min=1,
                                                help="Rows of the rope tables (default: max_position_embeddings)."),
    force: ForceOpt = False,
    as_json: bool = typer.Option(False, "--json", help="Print where the graphs went, and the phase timings, as JSON."),
) -> None:
    """ONNX graphs of one drafter step (first / next), optionally the whole chain and the target."""
    try:
        from eagle31_export.export.onnx_export import OnnxExportOptions, export_onnx
    except ModuleNotFoundError as err:
        if err.name not in ("onnx", "onnxscript"):
            raise
        raise MissingRuntimeError("the onnx package is not installed; pip install onnx") from None

    options = OnnxExportOptions(flavor=flavor, chain_depth=chain_depth, dtype=parse_dtype(dtype),
                                max_positions=max_positions)
    console = Console(stderr=True)
    with ProgressDisplay("export onnx", console) as display:
        phases = display.phases()
        path = export_onnx(drafter, out, target, options, force=force, progress=phases)
    meta = json.loads((path / "graphs.json").read_text())
    if as_json:
        graphs = {f"drafter_{role}": entry.get("file") for role, entry in meta["drafter"]["graphs"].items()}
        if "target" in meta:
            graphs["target"] = meta["target"].get("file")
        print_json({"out": str(path), "graphs": graphs, "no_target_graph": meta.get("no_target_graph"),
                    "timings": phases.as_json()})
        return
    typer.echo(f"ONNX graphs written to {path} (inputs/outputs in {path / 'graphs.json'})")
    if "no_target_graph" in meta:
        console.print(f"[yellow]note: drafter graphs only: {meta['no_target_graph']}; `speculate` and `parity` "
                      "on ONNX Runtime verify with the reference target[/]")
