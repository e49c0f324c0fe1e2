"""`eagle31-export serve`: a real Triton server (nvidia-pytriton's tritonserver) on a model repository."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    repo: Path = typer.Argument(..., help="Model repository (from `export triton`)."),
    port: int = typer.Option(8000, "--port", help="HTTP port on 127.0.0.1."),
    grpc_port: int = typer.Option(8001, "--grpc-port", help="gRPC port on 127.0.0.1 (streaming)."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Enable metrics on this port."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait for the models to load."),
) -> None:
    """Serve REPO on 127.0.0.1 until Ctrl-C; logs go to the terminal."""
    from eagle31_export.runtime.triton_server import TritonServer

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
