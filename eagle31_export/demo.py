"""The demo: a tiny pair made by code, through every format, inspected, and speculated."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from eagle31_export.fixtures import drafter_config_for, make_target, random_drafter
from eagle31_export.formats.drafter import write_drafter
from eagle31_export.formats.drafter_formats import FORMATS
from eagle31_export.formats.safetensors_io import atomic_output_dir
from eagle31_export.formats.target import read_target_info
from eagle31_export.inspection import inspect_path
from eagle31_export.reference.pair import load_pair
from eagle31_export.reference.speculate import greedy_decode, speculate

PROMPTS = [[1, 5, 9, 13, 17], [200, 3, 77, 41], [8, 8, 8, 8, 8, 8], [250, 120, 60, 30, 15]]
DEPTHS = range(1, 7)


def run_demo(out: Path, force: bool = True) -> None:
    console = Console()
    with atomic_output_dir(out, force=force) as tmp:
        target = make_target(tmp / "target", "llama")
        info = read_target_info(target)
        variants = {"EAGLE-3": drafter_config_for(info), "EAGLE 3.1": drafter_config_for(info, fc_norm=True,
                                                                                            norm_output=True)}
        rows, reports = [], {}
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("formats and speculation", total=len(variants) * (len(FORMATS) + len(DEPTHS)))
            for label, cfg in variants.items():
                ckpt = random_drafter(cfg, seed=1)  # same weights for both variants: only the flags differ
                for fmt in FORMATS:
                    folder = tmp / "drafters" / f"{label.replace(' ', '').lower()}-{fmt}"
                    write_drafter(ckpt, folder, fmt)
                    reports[folder.name] = inspect_path(folder, target)
                    progress.advance(task)
                pair = load_pair(folder, target, dtype=torch.float32)
                for depth in DEPTHS:
                    taus, lossless = [], True
                    for prompt in PROMPTS:
                        res = speculate(pair.target, pair.drafter, prompt, 24, depth)
                        taus.append(res.acceptance_length)
                        lossless &= res.tokens == greedy_decode(pair.target, prompt, 24)
                    rows.append((label, depth, sum(taus) / len(taus), lossless))
                    progress.advance(task)
        (tmp / "inspect.json").write_text(json.dumps(reports, indent=2) + "\n")
        (tmp / "tau.json").write_text(json.dumps([dict(zip(("drafter", "depth", "tau", "lossless"), r))
                                                  for r in rows], indent=2) + "\n")
    _render(console, reports, rows, out)


def _render(console: Console, reports: dict, rows: list, out: Path) -> None:
    table = Table(title="drafter formats (read back and checked against the target)")
    for col in ("checkpoint", "format", "EAGLE", "tapped (output of layer)", "problems"):
        table.add_column(col)
    for name, rep in reports.items():
        table.add_row(name, rep["format"], rep["eagle_version"], str(rep["tapped_layers"]["output_of_layer"]),
                      str(len(rep["problems"])))
    console.print(table)
    tau = Table(title="acceptance length tau, greedy (random-weight tiny pair: tau ~ 1 is expected)")
    for col in ("drafter", "depth", "tau", "output == target greedy"):
        tau.add_column(col)
    for label, depth, t, lossless in rows:
        tau.add_row(label, str(depth), f"{t:.3f}", "yes" if lossless else "[red]NO[/]")
    console.print(tau)
    console.print(f"artifacts in {out}")
