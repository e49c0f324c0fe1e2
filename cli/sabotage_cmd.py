"""`eagle31-export sabotage BUNDLE_OR_DRAFTER --bug NAME --out DIR`: a broken copy on purpose, one class of
silent bug users have reported; `eagle31-export sabotage --list` names every class with its reports."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eagle31_export.cli.common import print_json
from eagle31_export.errors import UserError


def register(app: typer.Typer) -> None:
    app.command("sabotage")(sabotage)


def sabotage(
    source: Optional[Path] = typer.Argument(None, help="A serving bundle (export vllm|sglang|trtllm) or a drafter "
                                            "folder to copy broken."),
    bug: Optional[str] = typer.Option(None, "--bug", help="The class of bug (see --list)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder to write the broken copy to."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier output of this tool at --out."),
    list_: bool = typer.Option(False, "--list", help="Name every class with its description and public reports."),
    as_json: bool = typer.Option(False, "--json", help="--list as one JSON object."),
) -> None:
    """Write a copy of a bundle or drafter that differs exactly as one reported silent bug (docs/silent-bugs.md),
    to show what inspect, verify and parity say about it. Never serve the copy."""
    from eagle31_export.sabotage import catalogue, sabotage_named, write_sabotaged

    if list_:
        classes = catalogue()
        if as_json:
            print_json({"classes": classes})
            return
        for c in classes:
            reports = "; ".join(c["reports"]) or "no public report found"
            typer.echo(f"{c['name']:20} {c['description']}\n{'':20} reports: {reports}")
        return
    if source is None or bug is None or out is None:
        raise UserError("sabotage needs BUNDLE_OR_DRAFTER, --bug NAME and --out DIR (or --list)")
    chosen = sabotage_named(bug)
    written = write_sabotaged(source, chosen.name, out, force=force)
    typer.echo(f"{written}: a copy of {source} broken as {chosen.name} ({chosen.description}); never serve it")
