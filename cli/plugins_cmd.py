"""`eagle31-export plugins build [--cuda/--no-cuda] [--tensorrt-root DIR] [--build-dir DIR]`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from eagle31_export.cli.common import print_json
from eagle31_export.cli.progress import working
from eagle31_export.kernels.build import BuildResult, build_plugins

_PARTS = {"cpu": "CPU kernels", "cuda": "CUDA kernels", "tensorrt": "TensorRT plugins"}


def register(app: typer.Typer) -> None:
    plugins_app = typer.Typer(help="Build the EAGLE 3.1 fused kernels and TensorRT plugins.", no_args_is_help=True)
    plugins_app.command("build")(build)
    app.add_typer(plugins_app, name="plugins")


def build(
    cuda: Optional[bool] = typer.Option(
        None, "--cuda/--no-cuda", help="Require / skip the CUDA kernels (default: build them when nvcc is found)."
    ),
    tensorrt_root: Optional[Path] = typer.Option(
        None, "--tensorrt-root", envvar="TENSORRT_ROOT", help="TensorRT install (or headers) root: builds the plugins."
    ),
    tensorrt_compile_only: bool = typer.Option(
        False, "--tensorrt-compile-only", help="Only compile the TensorRT wrappers (headers suffice; no library)."
    ),
    build_dir: Optional[Path] = typer.Option(None, "--build-dir", help="CMake build folder (default: plugins/build)."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Parallel compile jobs (default: all cores)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Configure and build with CMake; report what was built and why anything was skipped."""
    console = Console(stderr=as_json)
    with working("building plugins with CMake (the CUDA kernels take a minute)", "build", console):
        result = build_plugins(
            build_dir, cuda=cuda, tensorrt_root=tensorrt_root, tensorrt_compile_only=tensorrt_compile_only, jobs=jobs
        )
    if as_json:
        print_json(_as_dict(result))
    else:
        _render(console, result)


def _as_dict(result: BuildResult) -> dict:
    return {
        "build_dir": str(result.build_dir),
        "parts": result.parts,
        "tensorrt_version": result.tensorrt_version or None,
        "libraries": {part: str(path) for part, path in result.libraries.items()},
    }


def _render(console: Console, result: BuildResult) -> None:
    table = Table(title=f"plugins build: {result.build_dir}")
    table.add_column("part")
    table.add_column("status", overflow="fold")
    table.add_column("library", overflow="fold")
    for part, label in _PARTS.items():
        status = result.parts[part]
        if part == "tensorrt" and result.tensorrt_version:
            label = f"{label} (TensorRT {result.tensorrt_version})"
        colour = "green" if status == "built" or status.startswith("compiled") else "yellow"
        library = result.libraries.get(part)
        table.add_row(label, f"[{colour}]{status}[/]", str(library) if library else "-")
    console.print(table)
