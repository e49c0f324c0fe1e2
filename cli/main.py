"""`eagle31-export`: the Typer application. Thin: parse, call the library, render.

Sub-commands live one per module and are registered here.
"""

from __future__ import annotations

import sys
import traceback

import typer

from eagle31_export.cli import (
    demo_cmd,
    export_cmd,
    inspect_cmd,
    parity_cmd,
    plugins_cmd,
    quantize_cmd,
    serve_cmd,
    speculate_cmd,
)
from eagle31_export.errors import UserError

app = typer.Typer(
    name="eagle31-export",
    help="Convert EAGLE 3.1 drafters and NVFP4 targets for TensorRT-LLM / TensorRT / Triton, and prove acceptance parity.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_DEBUG = {"on": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    _DEBUG["on"] = debug


def _register() -> None:
    """Every command, explicitly and in help order: a missing module fails the import loudly."""
    inspect_cmd.register(app)
    speculate_cmd.register(app)
    demo_cmd.register(app)
    quantize_cmd.register(app)
    plugins_cmd.register(app)
    export_cmd.register(app)
    serve_cmd.register(app)
    parity_cmd.register(app)


_register()


def main() -> None:
    try:
        code = app(standalone_mode=False)  # click returns typer.Exit codes instead of raising here
        if isinstance(code, int) and code:
            sys.exit(code)
    except UserError as err:
        if _DEBUG["on"]:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # usage errors: click's, or those of the click that newer typers vendor (typer._click)
        import click

        if isinstance(err, (click.exceptions.ClickException, typer.exceptions.TyperException)) and hasattr(err, "show"):
            err.show()
            sys.exit(2)
        if isinstance(err, (click.exceptions.Exit, typer.Exit)):
            sys.exit(err.exit_code)
        raise


if __name__ == "__main__":
    main()
