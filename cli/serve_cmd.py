"""`eagle31-export serve`: a real Triton server (nvidia-pytriton's tritonserver) on a model repository."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from eagle31_export.cli.common import finite_number


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    repo: Path = typer.Argument(..., help="Model repository (from `export triton`)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="HTTP port on 127.0.0.1."),
    grpc_port: int = typer.Option(8001, "--grpc-port", min=1, max=65535, help="gRPC port on 127.0.0.1 (streaming)."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", min=1, max=65535, help="Enable metrics on this port."),
    timeout: float = typer.Option(300.0, "--timeout", min=0.0, callback=finite_number, help="Seconds to wait for the models to load."),
) -> None:
    """Serve REPO on 127.0.0.1 until Ctrl-C; logs go to the terminal."""
    from eagle31_export.formats.outputs import check_artifacts
    from eagle31_export.runtime.triton_server import TritonServer

    if repo.is_dir():
        check_artifacts(repo)  # what the models load: files by sha256, the target by size and header

    def interrupt(_signum, _frame):  # `kill` stops the server as cleanly as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    server = TritonServer([repo], http_port=port, grpc_port=grpc_port, metrics_port=metrics_port)
    server.start()
    server.follow_log(sys.stderr)
    try:
        server.wait_ready(timeout)
        typer.echo(f"ready: HTTP {server.http_url}, gRPC {server.grpc_url} (Ctrl-C stops)", err=True)
        server.process.wait()
        code = server.process.returncode
        if code:
            from eagle31_export.errors import UserError

            raise UserError(f"tritonserver exited with code {code}: {server.failure()}")
    except KeyboardInterrupt:
        typer.echo("stopping tritonserver", err=True)
    finally:
        code = server.stop()
    typer.echo(f"tritonserver stopped (exit code {code})", err=True)
