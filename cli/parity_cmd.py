"""`eagle31-export parity`: reference vs runtime on the same prompts; exit 0 pass, 1 fail, 2 bad input,
3 a pass that showed nothing (the reference accepted no drafts at some position: parity/evidence.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from eagle31_export.cli.common import (
    SEED_MAX,
    DeviceOpt,
    DraftLogOpt,
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
from eagle31_export.cli.speculate_cmd import RUNTIME_HELP
from eagle31_export.runtime.registry import DEFAULT_SERVING_RUNTIME


def register(app: typer.Typer) -> None:
    app.command("parity")(parity)


def parity(
    bundle: Optional[Path] = typer.Argument(None, help="Exported artifacts to check (e.g. an `export onnx` folder)."),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="Reference drafter checkpoint."),
    target: Optional[Path] = typer.Option(None, "--target", help="Reference target checkpoint."),
    capture: Optional[Path] = typer.Option(None, "--capture", help="Instead of --target: a folder written by "
                                                                   "`eagle31-export capture` (greedy only; its prompts)."),
    runtime: str = typer.Option(DEFAULT_SERVING_RUNTIME, "--runtime", help=RUNTIME_HELP),
    url: RuntimeUrlOpt = None,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL: {\"prompt_ids\": [...]} or {\"text\": ...}."),
    depth: int = typer.Option(3, "--depth", min=1),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, callback=finite_number),
    seed: int = typer.Option(0, "--seed", min=0, max=SEED_MAX),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, callback=finite_number,
                                help="Sampling: keep the smallest set of tokens holding this much of the mass."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Sampling: keep the K most likely tokens (0: all)."),
    sampling_rule: Optional[str] = typer.Option(None, "--sampling-rule", help="Sampling: rejection (drafts sampled, "
                                                "accepted with min(1, p/q); our runtimes' default) or greedy-drafts "
                                                "(vLLM's: argmax drafts accepted with p_target, checked exactly and "
                                                "statistically along the runtime's output); vllm: greedy-drafts."),
    act_quant: Optional[bool] = typer.Option(None, "--act-quant/--no-act-quant",
                                             help="NVFP4 targets: emulate W4A4 (inputs NVFP4-quantized too) on both "
                                             "sides, or not; by default as the runtime computes where it tells "
                                             "(vllm: the target's quantization config), else not."),
    mode: Optional[str] = typer.Option(None, "--mode", help="replay (greedy default: one reference target forward "
                                                            "per prompt) or autoregressive (sampling's mode)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write report.json, report.md and plots here."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier report at --out."),
    as_json: bool = typer.Option(False, "--json", help="Print report.json to stdout."),
    device: DeviceOpt = "cpu",
    runtime_dtype: Optional[str] = typer.Option(None, "--runtime-dtype", help="What the runtime computes in: fp32 "
                                                "(exact comparison, the default) or bf16 (statistical); vllm: the "
                                                "engine's --dtype; with --url, read from the server where it tells "
                                                "(its /server_info), else required."),
    vllm: VllmOpt = None,
    port: PortOpt = None,
    engine_timeout: EngineTimeoutOpt = 600.0,
    max_num_batched_tokens: MaxBatchedTokensOpt = None,
    draft_log: DraftLogOpt = None,
    concurrency: Optional[str] = typer.Option(None, "--concurrency", help="Also serve every prompt with C requests "
                                              "in flight, for each C of a list such as 1,4,16 (runtimes that serve "
                                              "requests: onnxruntime, triton, vllm); compared with C = 1 and the "
                                              "reference."),
    repeat: int = typer.Option(0, "--repeat", min=0, max=100, help="Send the prompts N more times at each "
                               "concurrency level; every send must equal the first (an engine's prefix cache "
                               "serves the later ones: vllm reports its hits)."),
    context: Optional[str] = typer.Option(None, "--context", help="Prompt lengths in tokens, such as "
                                          "1024,4096,16384: prompts built to each from held-out text (2 a length), "
                                          "acceptance compared by length; failing only at the longer lengths names "
                                          "rope or positions."),
) -> None:
    """Run reference and runtime on the same prompts; compare tokens, drafts, acceptance."""
    from eagle31_export.parity.report import markdown, write_report

    from eagle31_export.formats.outputs import check_output
    from eagle31_export.parity.concurrency import parse_levels
    from eagle31_export.parity.context import parse_lengths
    from eagle31_export.parity.evidence import EXIT_INCONCLUSIVE
    from eagle31_export.parity.sides import check_parity

    inputs = [bundle, drafter, target, capture, prompts]
    levels = parse_levels(concurrency)
    lengths = parse_lengths(context)
    if out is not None:
        check_output(out, force, inputs)  # before the run, not after it
    with ProgressDisplay(f"parity vs {runtime}") as display:
        phases = display.phases()
        report = check_parity(runtime, bundle, drafter, target, url, prompts, depth, max_new_tokens, temperature, seed,
                              phases, mode, capture=capture, act_quant=act_quant, device=device,
                              runtime_options={"dtype": parse_dtype(runtime_dtype) if runtime_dtype else None,
                                               **vllm_options(vllm, port, engine_timeout, max_num_batched_tokens,
                                                               draft_log)},
                              concurrency=levels, repeat=repeat, top_p=top_p, top_k=top_k,
                              sampling_rule=sampling_rule, context=lengths)
        if out is not None:
            with phases.phase("write"):  # report.json holds the timings up to here; stdout's also this one
                write_report(report, out, force=force, inputs=inputs)
    if as_json:
        print_json({**report.to_json(), "timings": phases.as_json()})
    else:
        Console().print(markdown(report))
    raise typer.Exit({"PASS": 0, "FAIL": 1}.get(report.verdict, EXIT_INCONCLUSIVE))
