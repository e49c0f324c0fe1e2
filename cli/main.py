"""`eagle31-export`: the Typer application. Thin: parse, call the library, render.

Sub-commands live one per module and are registered here.
"""

from __future__ import annotations

import sys
import traceback

import typer

from eagle31_export.cli import (
    capture_cmd,
    convert_cmd,
    demo_cmd,
    diagnose_cmd,
    export_cmd,
    inspect_cmd,
    parity_cmd,
    plugins_cmd,
    quantize_cmd,
    sabotage_cmd,
    serve_cmd,
    speculate_cmd,
    verify_cmd,
)
from eagle31_export.errors import UserError
from eagle31_export.process_memory import return_freed_memory

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
    return_freed_memory()  # long prompts: freed activations leave the process (process_memory.py)


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
    verify_cmd.register(app)
    convert_cmd.register(app)
    capture_cmd.register(app)
    diagnose_cmd.register(app)
    sabotage_cmd.register(app)


_register()


def main() -> None:
    try:
        code = app(standalone_mode=False)  # click returns typer.Exit codes instead of raising here
        if isinstance(code, int) and code:
            sys.exit(code)
    except UserError as err:
        if _DEBUG["on"]:
            traceback.print_exc()
        print(f"error: {_one_line(str(err))}", file=sys.stderr)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except OSError as err:  # the system refused a file operation (permissions, a full disk, a file in the way)
        if _DEBUG["on"]:
            traceback.print_exc()
        where = f"{err.filename}: " if err.filename else ""
        hint = ""
        if isinstance(err, (FileExistsError, NotADirectoryError)):
            hint = " (a file is in the way of a folder this command writes: choose another --out)"
        print(f"error: {where}{_one_line(err.strerror or str(err))}{hint}", file=sys.stderr)
        sys.exit(2)
    except Exception as err:  # usage errors: click's, or those of the click that newer typers vendor (typer._click)
        import click

        if isinstance(err, (click.exceptions.ClickException, typer.exceptions.TyperException)) and hasattr(err, "show"):
            if type(err).__name__ == "NoArgsIsHelpError":  # a bare command or group: its help, as asked
                err.show()
                sys.exit(2)
            if _DEBUG["on"] or "--debug" in sys.argv[1:2]:
                traceback.print_exc()
            print(f"error: {_usage_line(err)}", file=sys.stderr)
            sys.exit(getattr(err, "exit_code", 2) or 2)
        if isinstance(err, (click.exceptions.Exit, typer.Exit)):
            sys.exit(err.exit_code)
        raise


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _usage_line(err: Exception) -> str:
    """A usage error of the CLI framework as one line: the command, the option, the value as typed
    and what is wrong with it, and where the help is."""
    ctx = getattr(err, "ctx", None)
    command = ctx.command_path if ctx is not None else app.info.name
    message = err.format_message()
    param = getattr(err, "param", None)
    problems = getattr(err.__cause__, "errors", None)  # typer validates values with pydantic
    if param is not None and callable(problems) and type(err).__name__ == "BadParameter":
        try:
            first = problems()[0]
            value, reason = first.get("input"), str(first.get("msg", ""))
        except (IndexError, TypeError, AttributeError, KeyError, ValueError):
            value = None
        if value is not None:
            name = max(getattr(param, "opts", None) or [param.name], key=len)
            message = f"{name} {value}: {reason[:1].lower()}{reason[1:]}"
    return f"{command}: {_one_line(message)} (see {command} --help)"


if __name__ == "__main__":
    main()
