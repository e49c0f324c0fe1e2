"""`eagle31-export export triton`: a Triton model repository from a serving bundle."""

from __future__ import annotations

from pathlib import Path

import typer

from eagle31_export.runtime.registry import DEFAULT_SERVING_RUNTIME, RUNTIMES


def register(export_app: typer.Typer) -> None:
    export_app.command("triton")(triton)


def triton(
    bundle: Path = typer.Option(..., "--bundle", help="Folder written by `export trtllm|vllm|sglang`."),
    out: Path = typer.Option(..., "--out", help="Model repository folder to write."),
    flavor: str = typer.Option(..., "--flavor", help="trtllm (TensorRT-LLM LLM API) or cpu (speculation loop)."),
    runtime: str = typer.Option(DEFAULT_SERVING_RUNTIME, "--runtime",
                                help="cpu flavour: the runtime the repository runs (" +
                                     "; ".join(f"{n}: {r.help}" for n, r in RUNTIMES.items() if r.servable) + ")."),
    copy_target: bool = typer.Option(False, "--copy-target/--link-target",
                                     help="Copy the target into the repository (self-contained), or link it "
                                          "(a symlink to the bundle's target; the default)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
) -> None:
    """Triton repository: TensorRT-LLM's LLM-API model (trtllm) or python-backend speculation (cpu)."""
    from eagle31_export.runtime.triton_repo import export_triton

    path = export_triton(bundle, out, flavor, force, runtime, copy_target=copy_target)
    hint = f"eagle31-export serve {path}" if flavor == "cpu" else f"see {path / 'README.md'}"
    typer.echo(f"Triton repository written to {path} ({hint})")
