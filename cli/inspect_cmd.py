"""`eagle31-export inspect PATH [--target PATH] [--json]`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from eagle31_export.inspection import inspect_path
from eagle31_export.cli.common import print_json


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect)


def inspect(
    path: Path = typer.Argument(..., help="A drafter or target checkpoint folder, or TensorRT-LLM LLM-API options "
                                "(a YAML file, or a folder holding llm_api.yaml)."),
    target: Optional[Path] = typer.Option(None, "--target", help="Check the drafter against this target."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Detected format, EAGLE version, canonical config, tapped layers, compatibility (with --target: also the
    rope and positions); exit 1 when problems are found."""
    report = inspect_path(path, target)
    if as_json:
        print_json(report)
    else:
        _render(report)
    if report["problems"]:
        problems = report["problems"]
        typer.echo(f"{path}: {len(problems)} problem(s) found; first: {problems[0]}", err=True)
        raise typer.Exit(1)  # read, but not usable as it is: exit 2 is for what cannot be read at all


def _render(report: dict) -> None:
    console = Console()
    origin = report.get("origin", "")
    layout = f"{origin} ({report['format']} layout)" if origin and origin != report.get("format") else origin
    title = f"{report['kind']}: {layout} EAGLE {report.get('eagle_variant', '')}".strip()
    table = Table(title=title if report["kind"] == "drafter" else report["kind"], show_header=False)
    for key, value in report["config"].items():
        table.add_row(key, str(value))
    if "tapped_layers" in report:
        table.add_row("tapped (output of layer)", str(report["tapped_layers"]["output_of_layer"]))
        table.add_row("tapped (before layer, vLLM)", str(report["tapped_layers"]["before_layer"]))
        table.add_row("taps from", report.get("taps") or report["tapped_layers"]["source"])
    if "max_positions" in report:
        table.add_row("max positions", report["max_positions"])
    if "vocabulary" in report:
        v = report["vocabulary"]
        ids = f"{v['target_ids']['min']}..{v['target_ids']['max']}" if v["target_ids"] else "(out of range)"
        table.add_row("vocabulary", f"{v['draft_vocab_size']} draft ids -> target ids {ids} of {v['vocab_size']}; "
                      f"d2t {v['d2t']}; t2d {v['t2d']}")
    if report.get("quantization"):
        table.add_row("quantization", str(report["quantization"]))
    console.print(table)
    for key in report.get("unknown_config_keys", []):
        console.print(f"[yellow]unknown config key (ignored): {key}[/]")
    for warning in report.get("warnings", []):
        console.print(f"[yellow]warning: {warning}[/]")
    for problem in report["problems"]:
        console.print(f"[red]problem: {problem}[/]")
    if not report["problems"]:
        console.print("[green]no problems found[/]")
