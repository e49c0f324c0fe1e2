"""`eagle31-export speculate`: run the speculation loop (PyTorch reference or ONNX Runtime) and print tokens and statistics."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from eagle31_export.cli.common import parse_dtype, print_json
from eagle31_export.errors import UserError


def register(app: typer.Typer) -> None:
    app.command("speculate")(speculate)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def encode_prompt(target: Path, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except (OSError, ValueError):
        raise UserError(f"{target}: no tokenizer next to the target; pass --prompt-ids instead of --prompt") from None
    return tok(prompt, add_special_tokens=True)["input_ids"]


def speculate(
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="Drafter checkpoint folder (reference runtime)."),
    target: Optional[Path] = typer.Option(None, "--target", help="Target checkpoint folder (reference runtime; with "
                                                                 "onnxruntime, when the export has no target graph)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text (needs a tokenizer next to the target)."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt token ids, used as given: 1,2,3."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1),
    depth: int = typer.Option(3, "--depth", min=1, help="Draft tokens per round."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16."),
    act_quant: bool = typer.Option(False, "--act-quant/--no-act-quant", help="NVFP4 targets: emulate W4A4."),
    as_json: bool = typer.Option(False, "--json"),
    runtime: str = typer.Option("reference", "--runtime", help="reference (PyTorch) or onnxruntime."),
    onnx_dir: Optional[Path] = typer.Option(None, "--onnx", help="Folder written by `export onnx` (--runtime onnxruntime)."),
    chain: bool = typer.Option(False, "--chain/--no-chain", help="onnxruntime: draft with the exported chain graph "
                                                                 "(one call per round; temperature 0 only)."),
    kernels: str = typer.Option("torch", "--kernels", help="reference runtime: the fused ops as plain torch (torch) "
                                                           "or through the plugin kernels (plugins, built on demand)."),
) -> None:
    """Chain speculative decoding (PyTorch reference or exported ONNX graphs); prints tokens and acceptance statistics."""
    from eagle31_export.reference.speculate import speculate as run

    if (prompt is None) == (prompt_ids is None):
        raise UserError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if prompt is not None and target is None:
        raise UserError("--prompt needs --target (for its tokenizer); or pass --prompt-ids")
    ids = parse_prompt_ids(prompt_ids) if prompt_ids is not None else encode_prompt(target, prompt)
    target_backend, drafter_backend = _backends(runtime, drafter, target, onnx_dir, chain, temperature,
                                                parse_dtype(dtype), act_quant, kernels)
    result = run(target_backend, drafter_backend, ids, max_new_tokens, depth, temperature, seed)
    if as_json:
        print_json(result.to_json())
        return
    console = Console()
    console.print(f"tokens: {result.tokens}")
    console.print(f"rounds: {len(result.accepted_per_step)}  accepted per round: {result.accepted_per_step}")
    console.print(f"acceptance length (tau): {result.acceptance_length:.3f}")
    console.print("per-position acceptance: " + ", ".join(f"{r:.2f}" for r in result.per_position_acceptance))


def _kernel_provider(name: str):
    if name == "torch":
        return None  # the drafter's default: reference/ops.py
    if name == "plugins":
        from eagle31_export.kernels.torch_ops import PluginKernels

        return PluginKernels()
    raise UserError(f"unknown --kernels {name!r}; choose torch or plugins")


def _backends(runtime, drafter, target, onnx_dir, chain, temperature, dtype, act_quant, kernels="torch"):
    """(target, drafter) backends for the one speculation loop."""
    if runtime == "reference":
        if drafter is None or target is None:
            raise UserError("--runtime reference needs --drafter and --target")
        if onnx_dir is not None or chain:
            raise UserError("--onnx / --chain apply to --runtime onnxruntime")
        from eagle31_export.reference.pair import load_pair

        pair = load_pair(drafter, target, dtype=dtype, act_quant=act_quant, kernels=_kernel_provider(kernels))
        return pair.target, pair.drafter
    if runtime != "onnxruntime":
        raise UserError(f"unknown --runtime {runtime!r}; choose reference or onnxruntime")
    if onnx_dir is None:
        raise UserError("--runtime onnxruntime needs --onnx DIR (the output of `eagle31-export export onnx`)")
    if chain and temperature != 0:
        raise UserError("--chain drafts greedily; use --temperature 0 or drop --chain")
    from eagle31_export.runtime.onnxruntime import load_backends

    target_backend, drafter_backend = load_backends(onnx_dir, chain=chain)
    if target_backend is None:  # drafter graphs only: verify with the reference target
        if target is None:
            raise UserError(f"{onnx_dir} has no target graph; pass --target for the reference target")
        from eagle31_export.reference.target import load_target

        target_backend = load_target(target, tuple(drafter_backend.export.meta["drafter"]["aux_layer_ids"]),
                                     dtype=dtype, act_quant=act_quant)
    return target_backend, drafter_backend
