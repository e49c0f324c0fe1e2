"""`eagle31-export capture --target T (--drafter D | --aux-layer-ids 1,2,3) --out DIR`: the target's
greedy continuations, tapped states and top-k logits over a prompt set, for parity without the target.
Under `torchrun --nproc-per-node N` the target is loaded tensor-parallel; rank 0 draws and writes."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from eagle31_export.cli.common import DeviceOpt, parse_dtype, print_json
from eagle31_export.cli.progress import ProgressDisplay
from eagle31_export.errors import UserError


def register(app: typer.Typer) -> None:
    app.command("capture")(capture)


def parse_layer_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise UserError(f"--aux-layer-ids {text!r}: expected comma-separated layer numbers like 1,15,28") from None
    if not ids:
        raise UserError("--aux-layer-ids is empty")
    return ids


def capture(
    target: Path = typer.Option(..., "--target", help="Target checkpoint folder (plain or NVFP4)."),
    out: Path = typer.Option(..., "--out", help="Capture folder to write (atomically, with manifest.json)."),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="Tap the layers this drafter reads."),
    aux_layer_ids: Optional[str] = typer.Option(None, "--aux-layer-ids", help="Or tap these layers (output of "
                                                                              "layer i numbering): 1,15,28."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL: {\"prompt_ids\": [...]} or {\"text\": ...}. "
                                                                   "Default: parity's built-in prompts."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1, help="Longest greedy run to serve."),
    depth: int = typer.Option(3, "--depth", min=1, help="Deepest draft chain to serve (with --max-new-tokens)."),
    top_k: int = typer.Option(8, "--top-k", min=1, help="Logits kept per position."),
    dtype: str = typer.Option("fp32", "--dtype", help="Compute dtype of the target: fp32, bf16 or fp16."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier capture at --out."),
    device: DeviceOpt = "cpu",
    as_json: bool = typer.Option(False, "--json", help="Print what was captured, and the phase timings, as JSON."),
) -> None:
    """Run the target once over the prompts; write what greedy speculation reads from it."""
    from eagle31_export.formats.prompts import read_prompts
    from eagle31_export.formats.target.checkpoint import read_target_info
    from eagle31_export.formats.target.tensor_parallel import launch_world
    from eagle31_export.parity.sides import default_prompts
    from eagle31_export.reference.capture import CaptureOptions, capture as run_capture, resolve_aux_layer_ids
    from eagle31_export.runtime.registry import resolve_device

    layers = resolve_aux_layer_ids(target, drafter, parse_layer_ids(aux_layer_ids) if aux_layer_ids else None)
    vocab = read_target_info(target).vocab_size
    prompt_ids = read_prompts(prompts, target, vocab) if prompts else default_prompts(vocab)
    options = CaptureOptions(max_new_tokens=max_new_tokens, depth=depth, top_k=top_k, dtype=parse_dtype(dtype),
                             force=force, device=resolve_device(device, "reference"))
    rank, world = launch_world()
    console = Console(stderr=True)
    if rank != 0:
        run_capture(target, prompt_ids, layers, out, options, inputs=(drafter, prompts))
        _leave_at_once()
    with ProgressDisplay("capture", console) as display:
        result = run_capture(target, prompt_ids, layers, out, options, progress=display, inputs=(drafter, prompts))
    if as_json:
        print_json({"out": str(result.out), "prompts": result.prompts, "continuation": result.continuation,
                    "world_size": world, "device": options.device, "timings": result.timings})
    else:
        where = f" on {world} processes (tensor-parallel)" if world > 1 else ""
        console.print(f"captured {result.prompts} prompts x {result.continuation} greedy tokens{where}; "
                      f"wrote {result.out}")
    if world > 1:
        _leave_at_once()


def _leave_at_once() -> None:
    """Under torchrun, end the process once the capture is written and the ranks have left the process
    group: gloo's threads can abort the interpreter's own teardown ("terminate called without an active
    exception"), which torchrun reports as a failed run although every rank finished its work."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
