"""`eagle31-export export vllm`: the drafter as vLLM reads it and the `--speculative-config` JSON."""

from __future__ import annotations

from typing import Annotated

import typer

from eagle31_export.cli.common import echo_bundle_warnings, BundleOutOpt, CopyTargetOpt, DrafterOpt, ForceOpt, PpOpt, RuntimeVersionOpt, TargetOpt, TpOpt
from eagle31_export.cli.progress import working


def register(export_app: typer.Typer) -> None:
    export_app.command("vllm")(vllm)


def vllm(
    drafter: DrafterOpt,
    target: TargetOpt,
    out: BundleOutOpt,
    tp: TpOpt = 1,
    pp: PpOpt = 1,
    k: Annotated[int, typer.Option("--num-speculative-tokens", min=1, help="Draft tokens per verification.")] = 3,
    copy_target: CopyTargetOpt = False,
    force: ForceOpt = False,
    runtime_version: RuntimeVersionOpt = None,
    layout: Annotated[str, typer.Option("--layout", help="Drafter layout: auto (the EAGLE layout where it holds the drafter) or speculators.")] = "auto",
) -> None:
    """Drafter for vLLM's eagle3 method (before-layer tap numbering) + README with the server command."""
    from eagle31_export.export.vllm import export_vllm

    with working("export vllm"):
        path = export_vllm(drafter, target, out, tp, pp, k, copy_target, force, runtime_version, layout)
    echo_bundle_warnings(path)
    typer.echo(f"vLLM bundle written to {path} (see {path / 'README.md'} for the vLLM server command)")
