"""`eagle31-export diagnose`: does this drafter drift with depth? Per draft depth: agreement with the
target, fed-back state RMS, attention on sinks / prompt / its own drafts, entropy; plus the RMS of
each tapped state entering fc. A table, a verdict in words, and with --out diagnose.json and plots."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich import box
from rich.table import Table

from eagle31_export.cli.common import DeviceOpt, print_json
from eagle31_export.cli.progress import ProgressDisplay


def register(app: typer.Typer) -> None:
    app.command("diagnose")(diagnose)


def diagnose(
    drafter: Path = typer.Option(..., "--drafter", help="Drafter checkpoint folder (any supported format, run by the "
                                                        "PyTorch reference) or an `export onnx` folder (run by "
                                                        "ONNX Runtime; shows fewer quantities)."),
    target: Optional[Path] = typer.Option(None, "--target", help="Target checkpoint folder (an `export onnx` folder "
                                                                 "with a target graph uses that graph)."),
    capture: Optional[Path] = typer.Option(None, "--capture", help="A folder from `eagle31-export capture`, instead "
                                                                   "of --target (targets larger than one machine)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL: {\"prompt_ids\": [...]} or {\"text\": ...} "
                                                                   "(default: 8 seeded random-token prompts)."),
    depth: int = typer.Option(6, "--depth", help="Measure draft depths 1..N."),
    positions: int = typer.Option(32, "--positions", help="Anchor positions per prompt (the target continues each "
                                                          "prompt by positions + depth - 1 tokens)."),
    num_sinks: int = typer.Option(4, "--num-sinks", help="How many first tokens count as attention sinks."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write diagnose.json and PNG plots here."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier diagnosis at --out."),
    as_json: bool = typer.Option(False, "--json", help="Print diagnose.json to stdout."),
    device: DeviceOpt = "cpu",
) -> None:
    """Measure attention drift per draft depth, teacher-forced on the target's own continuation."""
    from eagle31_export.formats.outputs import check_output
    from eagle31_export.parity.diagnose import diagnose as run_diagnose
    from eagle31_export.parity.diagnose_report import fc_input_line, table, write_diagnose

    from eagle31_export.formats.outputs import check_consumed

    inputs = [drafter, target, capture, prompts]
    check_consumed(drafter, given=["target"] if target is not None else [])  # an `export onnx` folder
    check_consumed(capture)
    if out is not None:
        check_output(out, force, inputs)  # before the run, not after it
    with ProgressDisplay("diagnose") as display:
        phases = display.phases()
        report = run_diagnose(drafter, target, prompts_file=prompts, depth=depth, positions=positions,
                              num_sinks=num_sinks, progress=phases, capture=capture, device=device)
        written = []
        if out is not None:
            with phases.phase("write"):
                written = write_diagnose(report, out, force=force, inputs=inputs)
    if as_json:
        print_json({**report.to_json(), "timings": phases.as_json()})
        return
    console = Console()
    headers, rows = table(report)
    grid = Table(title=f"{report.label} drafter, {report.attention.upper()} attention, "
                       f"{report.runtime}: {report.prompts} prompts, {report.positions} positions per depth",
                 box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for header in headers:
        grid.add_column(header, justify="right")
    for row in rows:
        grid.add_row(*row)
    console.print(grid)
    console.print(f"fed-back state RMS at depth 1: {report.rows[0].fed_back_rms:.4g}")
    console.print(fc_input_line(report))
    console.print(f"tau estimate at depth {report.depth} (1 + sum of acceptance): {report.tau_estimate:.3f}")
    for quantity, why in report.unavailable.items():
        console.print(f"[dim]not visible: {escape(quantity)}: {escape(why)}[/dim]")
    head, *rest = report.verdict
    console.print(f"[bold {'red' if report.drifts else 'green'}]{escape(head)}[/]")
    for sentence in rest:
        console.print(f"  {escape(sentence)}")
    if written:
        console.print(escape(f"wrote {', '.join(p.name for p in written)} to {out}"))
