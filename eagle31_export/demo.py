"""The demo: the embedded tiny trained pair through inspect, NVFP4, every export that runs here,
parity on ONNX Runtime, and EAGLE-3 vs EAGLE 3.1 acceptance at depths 1..6."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from eagle31_export.errors import MissingRuntimeError
from eagle31_export.formats.safetensors_io import built_in_place
from eagle31_export.inspection import inspect_path
from eagle31_export.parity.acceptance import tau_by_depth, teacher_forced_agreement, text_prompts
from eagle31_export.parity.compare import loop_runner, run_parity
from eagle31_export.parity.report import write_report
from eagle31_export.parity.tiny_pair import (
    DRAFTERS,
    TARGET,
    TARGET_NVFP4,
    held_out_prompts,
    held_out_texts,
    mixed_length_prompts,
    models_dir,
    tokenizer,
)
from eagle31_export.reference.pair import load_pair

DEPTHS = range(1, 7)
PROMPTS = 8
NEW_TOKENS = 32


def run_demo(out: Path, force: bool = True) -> None:
    console = Console()
    torch.set_num_threads(1)  # tiny models: threads only contend
    models = models_dir()
    drafter31 = models / DRAFTERS["EAGLE 3.1"]
    prompts = held_out_prompts(64)[:PROMPTS]
    # built in place: the serving bundles record absolute paths of their own files
    with built_in_place(out, force=force) as tmp, Progress(console=console, transient=True) as progress:
        steps = progress.add_task("demo", total=6)
        reports = {name: inspect_path(models / name, None if name.startswith("target") else models / TARGET)
                   for name in (TARGET, TARGET_NVFP4, *DRAFTERS.values())}
        (tmp / "inspect.json").write_text(json.dumps(reports, indent=2) + "\n")
        progress.advance(steps)
        exports = _exports(drafter31, models / TARGET, tmp)
        (tmp / "exports.json").write_text(json.dumps(exports, indent=2) + "\n")
        progress.advance(steps)
        pair = load_pair(drafter31, models / TARGET)
        from eagle31_export.runtime.onnxruntime import load_backends

        ort = loop_runner(*load_backends(tmp / "onnx"))
        parity = run_parity(loop_runner(pair.target, pair.drafter), ort, mixed_length_prompts(), 3, NEW_TOKENS,
                            runtime_name="onnxruntime")
        write_report(parity, tmp / "parity")
        progress.advance(steps)
        taus, agreement = {}, {}
        windows = text_prompts(tokenizer(), held_out_texts(), 256 + max(DEPTHS))[:8]
        for target in (TARGET, TARGET_NVFP4):
            for label, folder in DRAFTERS.items():
                pair = load_pair(models / folder, models / target)
                taus[(target, label)] = tau_by_depth(pair, prompts, DEPTHS, NEW_TOKENS)
                agreement[(target, label)] = teacher_forced_agreement(pair, windows, max(DEPTHS)).per_position
                progress.advance(steps, 0.75)
        (tmp / "tau.json").write_text(json.dumps([{"target": t, "drafter": d, "tau_by_depth": v,
                                                   "teacher_forced_agreement": agreement[(t, d)]}
                                                  for (t, d), v in taus.items()], indent=2) + "\n")
        _plot_taus(taus, tmp / "tau_by_depth.png")
    _render(console, reports, exports, parity, taus, agreement, out)


def _exports(drafter: Path, target: Path, tmp: Path) -> dict[str, str]:
    """Every export that can run on this machine; the rest say why not."""
    from eagle31_export.export.engine import build_engines
    from eagle31_export.export.onnx_export import export_onnx
    from eagle31_export.export.sglang import export_sglang
    from eagle31_export.export.triton import export_triton
    from eagle31_export.export.trtllm import export_trtllm
    from eagle31_export.export.vllm import export_vllm

    done = {}
    export_onnx(drafter, tmp / "onnx", target)
    done["onnx"] = "drafter step graphs + target graph with Eagle31 plugin nodes (ONNX Runtime verified below)"
    export_trtllm(drafter, target, tmp / "trtllm", max_draft_len=3)
    done["trtllm"] = "TensorRT-LLM drafter folder + LLM-API YAML (trtllm-serve --config)"
    export_vllm(drafter, target, tmp / "vllm")
    done["vllm"] = "vLLM drafter + --speculative-config"
    export_sglang(drafter, target, tmp / "sglang")
    done["sglang"] = "SGLang drafter + server flags"
    export_triton(tmp / "trtllm", tmp / "triton-trtllm", "trtllm")
    done["triton-trtllm"] = "Triton LLM-API repository (TensorRT-LLM PyTorch backend)"
    export_triton(tmp / "trtllm", tmp / "triton-cpu", "cpu")
    done["triton-cpu"] = "Triton python-backend repository on ONNX Runtime (eagle31-export serve)"
    try:
        build_engines(tmp / "onnx", tmp / "engines")
        done["engines"] = "TensorRT engines"
    except MissingRuntimeError as err:
        done["engines"] = f"skipped: {err}"
    return done


def _plot_taus(taus: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (target, label), by_depth in taus.items():
        style = "-" if target == TARGET else ":"
        ax.plot(list(by_depth), list(by_depth.values()), "o" + style, label=f"{label} ({target})")
    ax.set(xlabel="draft depth", ylabel="tau (tokens per target forward)",
           title="Tiny pair, held-out stdlib files, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _render(console: Console, reports: dict, exports: dict, parity, taus: dict, agreement: dict, out: Path) -> None:
    table = Table(title="inspect")
    for col in ("checkpoint", "kind / format", "EAGLE", "tapped (output of layer)", "quantization", "problems"):
        table.add_column(col)
    for name, rep in reports.items():
        quant = rep.get("quantization") or {}
        table.add_row(name, f"{rep['kind']} {rep.get('format', '')}", rep.get("eagle_version", ""),
                      str((rep.get("tapped_layers") or {}).get("output_of_layer", "")),
                      f"{quant.get('algo', '')} {quant.get('format', '')}".strip() or "-", str(len(rep["problems"])))
    console.print(table)
    exp = Table(title="exports")
    exp.add_column("artifact")
    exp.add_column("result")
    for name, what in exports.items():
        exp.add_row(name, what)
    console.print(exp)
    verdict = "[green]PASS[/]" if parity.passed else "[red]FAIL[/]"
    console.print(f"parity, ONNX Runtime vs PyTorch reference (EAGLE 3.1, depth 3, {len(parity.rows)} prompts): "
                  f"{verdict}, tau {parity.tau('reference'):.3f} vs {parity.tau('runtime'):.3f}")
    console.print(_by_depth_table("acceptance length tau by draft depth (held-out files, greedy)",
                                  {key: [by_depth[d] for d in DEPTHS] for key, by_depth in taus.items()}))
    console.print(_by_depth_table("teacher-forced agreement by draft position (held-out real text; free of the "
                                  "repetition a tiny target's own greedy text shows)", agreement))
    console.print(f"artifacts, parity report and plots in {out}")


def _by_depth_table(title: str, rows: dict[tuple[str, str], list[float]]) -> Table:
    """One row per (target, drafter), one column per draft depth."""
    table = Table(title=title)
    for col in ("target", "drafter", *map(str, DEPTHS)):
        table.add_column(col)
    for (target, label), values in rows.items():
        table.add_row(target, label, *(f"{v:.2f}" for v in values))
    return table
