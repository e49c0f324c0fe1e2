"""`eagle31-export demo`: the main job on the embedded default (the library computes, this draws)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from eagle31_export.cli.progress import ProgressDisplay


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(out: Path = typer.Option(Path("out/demo"), "--out", help="Where the demo writes its artifacts."),
         pair: str = typer.Option("examples/tiny/models", "--pair",
                                  help="The demo pair's models folder, or an example's name: tiny "
                                       "(examples/tiny/models) or kimi (examples/kimi/models), in a checkout."),
         force: bool = typer.Option(True, "--force/--no-force", help="Replace an earlier demo output.")) -> None:
    """The tiny trained pair through inspect, NVFP4, every export, parity on ONNX Runtime, and tau by depth."""
    import torch

    from eagle31_export.demo.pair import pair_folder
    from eagle31_export.demo.run import STEPS, run_demo

    torch.set_num_threads(1)  # tiny models: threads only contend
    console = Console()
    with ProgressDisplay(console=console) as display:
        done = [0.0]

        def advance(step: str, amount: float) -> None:
            done[0] += amount
            display.update("demo", done[0], STEPS, label=step)

        result = run_demo(out, pair_folder(pair), force=force, progress=advance)
    _render(console, result)


def _render(console: Console, result) -> None:
    from eagle31_export.demo.run import CONTEXT_DEPTH, CONTEXT_PROMPTS, DEPTHS

    table = Table(title="inspect")
    for col in ("checkpoint", "kind / format", "EAGLE", "tapped (output of layer)", "quantization", "problems"):
        table.add_column(col)
    for name, rep in result.reports.items():
        quant = rep.get("quantization") or {}
        table.add_row(name, f"{rep['kind']} {rep.get('format', '')}", rep.get("eagle_version", ""),
                      str((rep.get("tapped_layers") or {}).get("output_of_layer", "")),
                      f"{quant.get('algo', '')} {quant.get('format', '')}".strip() or "-", str(len(rep["problems"])))
    console.print(table)
    exp = Table(title="exports")
    exp.add_column("artifact")
    exp.add_column("result")
    for name, what in result.exports.items():
        exp.add_row(name, what)
    console.print(exp)
    parity = result.parity
    verdict = _verdict(parity)
    console.print(f"parity, ONNX Runtime vs PyTorch reference (EAGLE 3.1, depth 3, {len(parity.rows)} prompts): "
                  f"{verdict}, tau {parity.tau('reference'):.3f} vs {parity.tau('runtime'):.3f}")
    vllm = result.vllm
    if isinstance(vllm, str):
        console.print(f"parity, vLLM vs PyTorch reference: {vllm}")
    else:
        verdict = _verdict(vllm)
        console.print(f"parity, vLLM (a real engine) vs PyTorch reference (EAGLE 3.1, depth 3, {len(vllm.rows)} "
                      f"prompts, {'fp32: exact' if vllm.exact else 'bf16: statistical'}): {verdict}, tau "
                      f"{vllm.tau('reference'):.3f} vs {vllm.tau('runtime'):.3f}")
    console.print(_by_depth_table("acceptance length tau by draft depth (greedy)", DEPTHS,
                                  {key: [by_depth[d] for d in DEPTHS] for key, by_depth in result.taus.items()}))
    console.print(_by_depth_table("teacher-forced agreement by draft position (on held-out real text where the "
                                  "pair has it: free of the repetition a tiny target's own greedy text shows)",
                                  DEPTHS, result.agreement))
    if result.context_taus:
        lengths = sorted({n for by_length in result.context_taus.values() for n in by_length})
        table = Table(title=f"tau by context length (depth {CONTEXT_DEPTH}, {CONTEXT_PROMPTS} held-out prompts a "
                            "length)")
        for col in ("drafter", *map(str, lengths)):
            table.add_column(col)
        for label, by_length in result.context_taus.items():
            table.add_row(label, *(f"{by_length[n]:.2f}" for n in lengths))
        console.print(table)
        console.print(f"tau by context: tokens per target forward over a length's prompts; the target stretched to "
                      f"32768 positions by yarn; drafters: {result.context_drafters} (tau_by_context.json, .png)")
    for name, rows in result.claims.items():
        console.print(_claims_table({"template": "prompt format"}.get(name, name), rows))
    if result.claims:
        console.print("the seed's claims: a few prompts of each row (claims_prompts.json beside the pair); the full "
                      "tables, with enough prompts to tell the drafters apart, are the pair's evaluation "
                      "(examples/smollm2/README.md); claims.json, tau_by_context.png, tau_by_template.png")
    console.print(f"artifacts, parity report and plots in {result.out}")


def _claims_table(name: str, rows) -> Table:
    """EAGLE-3 against EAGLE 3.1 on one claims table (context lengths, prompt formats), at CLAIMS_DEPTH."""
    from eagle31_export.demo.run import CLAIMS_DEPTH

    table = Table(title=f"tau by {name}: EAGLE-3 vs EAGLE 3.1 (depth {CLAIMS_DEPTH}, mean ± standard error over "
                        "prompts; the difference paired over the same prompts)")
    for col in (name, "prompts", "mean tokens", "EAGLE-3", "EAGLE 3.1", "3.1 - 3"):
        table.add_column(col)
    for row in rows:
        table.add_row(row.label, str(len(row.prompt_tokens)), f"{sum(row.prompt_tokens) / len(row.prompt_tokens):.0f}",
                      f"{row.tau('EAGLE-3', CLAIMS_DEPTH)}", f"{row.tau('EAGLE 3.1', CLAIMS_DEPTH)}",
                      f"{row.difference('EAGLE-3', 'EAGLE 3.1', CLAIMS_DEPTH):+.3f}")
    return table


def _verdict(report) -> str:
    colour = {"PASS": "green", "FAIL": "red"}.get(report.verdict, "yellow")
    return f"[{colour}]{report.verdict}[/]"


def _by_depth_table(title: str, depths, rows: dict[tuple[str, str], list[float]]) -> Table:
    """One row per (target, drafter), one column per draft depth."""
    table = Table(title=title)
    for col in ("target", "drafter", *map(str, depths)):
        table.add_column(col)
    for (target, label), values in rows.items():
        table.add_row(target, label, *(f"{v:.2f}" for v in values))
    return table
