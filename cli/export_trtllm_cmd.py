"""`eagle31-export export trtllm`: a TensorRT-LLM (PyTorch backend) bundle for the pair."""

from __future__ import annotations

from typing import Annotated

import typer

from eagle31_export.cli.common import echo_bundle_warnings, BundleOutOpt, CopyTargetOpt, DrafterOpt, ForceOpt, PpOpt, RuntimeVersionOpt, TargetOpt, TpOpt
from eagle31_export.cli.progress import working


def register(export_app: typer.Typer) -> None:
    export_app.command("trtllm")(trtllm)


def trtllm(
    drafter: DrafterOpt,
    target: TargetOpt,
    out: BundleOutOpt,
    tp: TpOpt = 1,
    pp: PpOpt = 1,
    max_draft_len: Annotated[int, typer.Option("--max-draft-len", min=1, help="Draft tokens per verification.")] = 3,
    copy_target: CopyTargetOpt = False,
    force: ForceOpt = False,
    runtime_version: RuntimeVersionOpt = None,
) -> None:
    """Drafter in TensorRT-LLM's Eagle3 layout + LLM-API YAML for trtllm-serve / trtllm-bench."""
    from eagle31_export.export.trtllm import export_trtllm

    with working("export trtllm"):
        path = export_trtllm(drafter, target, out, tp, pp, max_draft_len, copy_target, force, runtime_version)
    echo_bundle_warnings(path)
    typer.echo(f"TensorRT-LLM bundle written to {path} (see {path / 'README.md'} for the trtllm-serve command)")
