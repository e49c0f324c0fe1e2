"""`eagle31-export verify DIR`: an output against its manifest.json; exit 0 when it matches, 1 on any
difference (each one named), 2 when DIR is no output of this tool."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import typer

from eagle31_export.cli.common import print_json


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)


def verify(
    folder: Path = typer.Argument(..., help="An output of this tool (a folder holding manifest.json)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Check every file against manifest.json (sha256) and each referenced target (size, header)."""
    from eagle31_export.formats.outputs import read_manifest, verify_output
    from eagle31_export.formats.trtllm_options import yaml_switch_warnings

    manifest = read_manifest(folder)
    differences = verify_output(folder)
    warnings = yaml_switch_warnings(folder)  # what would turn speculation off, changed or not
    if (folder / "bundle.json").is_file() and not differences:
        from eagle31_export.inspection import bundle_lints

        warnings += bundle_lints(folder)  # what the engine would run differently (docs/silent-bugs.md)
    files = len(manifest["files"])
    references = {role: ref["path"] for role, ref in (manifest.get("references") or {}).items()}
    if as_json:
        print_json({"folder": str(folder), "ok": not differences, "files": files, "references": references,
                    "differences": [asdict(d) for d in differences], "warnings": warnings})
    else:
        for warning in warnings:
            typer.echo(f"warning: {warning}", err=True)
        for difference in differences:
            typer.echo(str(difference))
        checked = f"{files} files" + (f" and {len(references)} referenced folder(s)" if references else "")
        if differences:
            typer.echo(f"{folder}: {len(differences)} difference(s) from manifest.json ({checked} checked)", err=True)
        else:
            typer.echo(f"{folder}: OK, {checked} match manifest.json", err=True)
    raise typer.Exit(1 if differences else 0)
