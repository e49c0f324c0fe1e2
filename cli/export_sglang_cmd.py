"""`eagle31-export export sglang`: the drafter in the SpecForge layout and SGLang's server flags."""

from __future__ import annotations

from typing import Annotated

import typer

from eagle31_export.cli.common import echo_bundle_warnings, BundleOutOpt, CopyTargetOpt, DrafterOpt, ForceOpt, PpOpt, RuntimeVersionOpt, TargetOpt, TpOpt
from eagle31_export.cli.progress import working


def register(export_app: typer.Typer) -> None:
    export_app.command("sglang")(sglang)


def sglang(
    drafter: DrafterOpt,
    target: TargetOpt,
    out: BundleOutOpt,
    tp: TpOpt = 1,
    pp: PpOpt = 1,
    steps: Annotated[int, typer.Option("--num-steps", min=1, help="Draft steps (tokens) per verification.")] = 3,
    copy_target: CopyTargetOpt = False,
    force: ForceOpt = False,
    runtime_version: RuntimeVersionOpt = None,
) -> None:
    """Drafter for SGLang's EAGLE3 algorithm + README with the `sglang.launch_server` flags."""
    from eagle31_export.export.sglang import export_sglang

    with working("export sglang"):
        path = export_sglang(drafter, target, out, tp, pp, steps, copy_target, force, runtime_version)
    echo_bundle_warnings(path)
    typer.echo(f"SGLang bundle written to {path} (see {path / 'README.md'} for the server command)")
