"""`eagle31-export speculate`: run the speculation loop on a runtime (reference, ONNX Runtime, Triton, vLLM) and print tokens and statistics."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from eagle31_export.cli.common import (
    SEED_MAX,
    DeviceOpt,
    EngineTimeoutOpt,
    MaxBatchedTokensOpt,
    PortOpt,
    RuntimeUrlOpt,
    VllmOpt,
    finite_number,
    parse_dtype,
    print_json,
    vllm_options,
)
from eagle31_export.cli.progress import ProgressDisplay
from eagle31_export.errors import UserError
from eagle31_export.reference.speculate import check_prompt_ids
from eagle31_export.runtime.registry import RUNTIMES

RUNTIME_HELP = "; ".join(f"{name}: {r.help}" for name, r in RUNTIMES.items())


def register(app: typer.Typer) -> None:
    app.command("speculate")(speculate)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    negative = [i for i in ids if i < 0]
    if negative:
        raise UserError(f"--prompt-ids: token id {negative[0]} is negative; token ids count from 0")
    return ids


def speculate(
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="Drafter checkpoint folder (reference runtime)."),
    target: Optional[Path] = typer.Option(None, "--target", help="Target checkpoint folder (reference runtime; with "
                                                                 "onnxruntime, when the export has no target graph)."),
    capture: Optional[Path] = typer.Option(None, "--capture", help="Instead of --target: a folder written by "
                                                                   "`eagle31-export capture` (greedy, its prompts)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text (needs a tokenizer next to the target)."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt token ids, used as given: 1,2,3."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1),
    depth: int = typer.Option(3, "--depth", min=1, help="Draft tokens per round."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, callback=finite_number),
    seed: int = typer.Option(0, "--seed", min=0, max=SEED_MAX),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16."),
    act_quant: bool = typer.Option(False, "--act-quant/--no-act-quant", help="NVFP4 targets: emulate W4A4."),
    as_json: bool = typer.Option(False, "--json"),
    runtime: str = typer.Option("reference", "--runtime", help=RUNTIME_HELP),
    url: RuntimeUrlOpt = None,
    onnx_dir: Optional[Path] = typer.Option(None, "--onnx", help="Folder written by `export onnx` (--runtime onnxruntime)."),
    bundle: Optional[Path] = typer.Option(None, "--bundle", help="Folder written by `export vllm` (--runtime vllm; "
                                                                 "default: exported on the fly from --drafter/--target)."),
    chain: bool = typer.Option(False, "--chain/--no-chain", help="onnxruntime: draft with the exported chain graph "
                                                                 "(one call per round; temperature 0 only)."),
    kernels: str = typer.Option("torch", "--kernels", help="reference runtime: the fused ops as plain torch (torch) "
                                                           "or through the plugin kernels (plugins, built on demand)."),
    device: DeviceOpt = "cpu",
    vllm: VllmOpt = None,
    port: PortOpt = None,
    engine_timeout: EngineTimeoutOpt = 600.0,
    max_num_batched_tokens: MaxBatchedTokensOpt = None,
) -> None:
    """Chain speculative decoding (PyTorch reference, exported ONNX graphs, a Triton or vLLM server); prints tokens and acceptance statistics."""
    from eagle31_export.formats.tokenizer import load_tokenizer
    from eagle31_export.reference.speculate import ProgressObserver
    from eagle31_export.runtime.registry import LoadOptions, PairSource, load_speculator, resolve_device

    if (prompt is None) == (prompt_ids is None):
        raise UserError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if prompt is not None and target is None:
        raise UserError("--prompt needs --target (for its tokenizer); or pass --prompt-ids")
    if chain and temperature != 0:
        raise UserError("--chain drafts greedily; use --temperature 0 or drop --chain")
    if prompt is not None:
        tokenizer = load_tokenizer(target, "pass --prompt-ids instead of --prompt")
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        ids = parse_prompt_ids(prompt_ids)
    if target is not None:  # before anything loads: ids the target's embedding has no row for
        from eagle31_export.formats.target.checkpoint import read_target_info

        check_prompt_ids(ids, read_target_info(target).vocab_size, "--prompt-ids")
    if capture is not None and target is not None:
        raise UserError("pass --target or --capture, not both")
    if onnx_dir is not None and bundle is not None:
        raise UserError("pass --onnx (onnxruntime) or --bundle (vllm), not both")
    from eagle31_export.formats.outputs import check_consumed

    given = [role for role, value in (("drafter", drafter), ("target", target)) if value is not None]
    for output in (onnx_dir or bundle, capture, drafter):  # outputs of this tool, checked before loading
        check_consumed(output, given if output is not drafter else ())
    options = LoadOptions(dtype=parse_dtype(dtype), act_quant=act_quant, kernels=kernels, chain=chain,
                          device=resolve_device(device, runtime), depth=depth,
                          **vllm_options(vllm, port, engine_timeout, max_num_batched_tokens))
    with ProgressDisplay("speculate") as display, contextlib.ExitStack() as stack:
        phases = display.phases()
        with phases.phase("load"):
            speculator = load_speculator(runtime, PairSource.of(drafter, target, onnx_dir or bundle, url, capture),
                                         options)
        stack.callback(speculator.close)  # a server the runtime started stops whatever happens
        chain_depth = getattr(getattr(speculator, "drafter", None), "chain_depth", None)
        if chain and chain_depth is not None and depth > chain_depth:
            raise UserError(f"the chain graph drafts {chain_depth} tokens per round; run with --depth <= "
                            f"{chain_depth}")
        with phases.phase("generate", total=max_new_tokens):
            result = speculator.run(ids, max_new_tokens, depth, temperature, seed,
                                    observer=ProgressObserver(phases, max_new_tokens))
    if as_json:
        print_json({**result.to_json(), "device": options.device, "timings": phases.as_json()})
        return
    console = Console()
    console.print(f"tokens: {result.tokens}")
    console.print(f"rounds: {len(result.accepted_per_step)}  accepted per round: {result.accepted_per_step}")
    console.print(f"acceptance length (tau): {result.acceptance_length:.3f}")
    console.print("per-position acceptance: " + ", ".join(f"{r:.2f}" for r in result.per_position_acceptance))
