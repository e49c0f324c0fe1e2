"""`diagnose` outputs: diagnose.json, the per-depth table (as text cells for the CLI to draw) and
PNG plots, one quantity against draft depth in each."""

from __future__ import annotations

import json
from pathlib import Path

from eagle31_export.formats.outputs import atomic_output_dir
from eagle31_export.parity.diagnose import DiagnoseReport

# (header, DepthRow field, format): the per-depth table, in the order the CLI draws it; "/d1": relative to
# depth 1; "cont.": the target's continuation up to the anchor; "draft": the chain's own drafted tokens;
# H: entropy of the draft distribution
COLUMNS = (
    ("depth", "depth", "{:d}"),
    ("agree", "agreement", "{:.3f}"),
    ("accept", "acceptance", "{:.3f}"),
    ("fed\n/d1", "fed_back_rms_rel", "{:.2f}x"),
    ("pre\n/d1", "pre_norm_rms_rel", "{:.2f}x"),
    ("post\n/d1", "post_norm_rms_rel", "{:.2f}x"),
    ("attn\nsink", "attention_sink", "{:.3f}"),
    ("attn\nprompt", "attention_prompt", "{:.3f}"),
    ("attn\ncont.", "attention_continuation", "{:.3f}"),
    ("attn\ndraft", "attention_drafted", "{:.3f}"),
    ("H\n(nats)", "entropy", "{:.2f}"),
)
NOT_VISIBLE = "n/a"


def table(report: DiagnoseReport) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the per-depth table; a quantity the runtime cannot show reads n/a."""
    rows = []
    for row in report.rows:
        cells = []
        for _, name, fmt in COLUMNS:
            value = getattr(row, name)
            cells.append(NOT_VISIBLE if value is None else fmt.format(value))
        rows.append(cells)
    return [header for header, _, _ in COLUMNS], rows


def fc_input_line(report: DiagnoseReport) -> str:
    fc = report.fc_input
    names = [f"layer {i}" for i in fc.aux_layer_ids] or [f"source {i}" for i in range(len(fc.rms))]
    raw = ", ".join(f"{n}: {v:.3g}" for n, v in zip(names, fc.rms))
    line = f"tapped states entering fc (RMS, any depth): {raw} ({fc.imbalance:.2f}x apart)"
    if fc.rms_into_fc is not None and fc.normalised_by:
        line += "; after " + fc.normalised_by + ": " + ", ".join(f"{v:.3g}" for v in fc.rms_into_fc)
    elif fc.normalised_by is None:
        line += "; no fc_norm: fc multiplies them as they are"
    return line


def write_diagnose(report: DiagnoseReport, folder: Path, force: bool = False, inputs=()) -> list[Path]:
    """diagnose.json and the plots, written atomically like every output (`formats/outputs.py`);
    `inputs`: what the run read, which `folder` may not touch."""
    folder = Path(folder)
    with atomic_output_dir(folder, force=force, inputs=inputs) as tmp:
        (tmp / "diagnose.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
        names = [p.name for p in plots(report, tmp)]
    return [folder / "diagnose.json", *(folder / n for n in names)]


def plots(report: DiagnoseReport, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = f"{report.label} drafter ({report.attention.upper()}, {report.runtime})"
    depths = [r.depth for r in report.rows]
    panels = (
        ("agreement_by_depth.png", _agreement),
        ("fed_back_rms_by_depth.png", _rms),
        ("attention_by_depth.png", _attention),
        ("entropy_by_depth.png", _entropy),
        ("fc_input_rms.png", _fc_input),
    )
    paths = []
    for name, draw in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, report, depths)
        fig.suptitle(title, fontsize=9)
        paths.append(_save(fig, folder / name))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (_, draw) in zip(axes.flat, panels):
        draw(ax, report, depths)
    axes.flat[-1].axis("off")
    axes.flat[-1].text(0, 1, "\n".join(_wrap(s) for s in report.verdict), va="top", fontsize=8, wrap=True)
    fig.suptitle(title)
    paths.append(_save(fig, folder / "diagnose.png"))
    return paths


def _wrap(sentence: str, width: int = 60) -> str:
    import textwrap

    return textwrap.fill(sentence, width)


def _depth_axis(ax, depths) -> None:
    ax.set_xlabel("draft depth")
    ax.set_xticks(depths)


def _agreement(ax, report, depths) -> None:
    ax.plot(depths, report.column("agreement"), "o-", label="agreement at this depth")
    ax.plot(depths, report.column("acceptance"), "s--", label="acceptance (all steps up to it agree)")
    ax.set(ylabel="fraction of positions", ylim=(0, 1.05), title="Agreement with the target")
    _depth_axis(ax, depths)
    ax.legend(fontsize=8)


def _rms(ax, report, depths) -> None:
    for name, label, style in (("fed_back_rms_rel", "fed back", "o-"), ("pre_norm_rms_rel", "pre-norm h", "s--"),
                               ("post_norm_rms_rel", "post-norm norm(h)", "x:")):
        values = report.column(name)
        if all(v is not None for v in values):
            ax.plot(depths, values, style, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    seen = [v for name in ("fed_back_rms_rel", "pre_norm_rms_rel", "post_norm_rms_rel")
            for v in report.column(name) if v is not None]
    # a flat line should look flat: the axis spans at least 0.9..1.2
    ax.set_ylim(min(0.9, min(seen) * 0.95), max(1.2, max(seen) * 1.05))
    ax.set(ylabel="RMS relative to depth 1", title="State fed back into the next step")
    _depth_axis(ax, depths)
    ax.legend(fontsize=8)
    _not_visible(ax, report, ("pre_norm_rms", "post_norm_rms"))


def _attention(ax, report, depths) -> None:
    if report.rows[0].attention_sink is None:
        ax.set(title="Attention mass")
        ax.text(0.5, 0.5, f"not visible on {report.runtime}", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    for name, label, style in (("attention_sink", f"first {report.num_sinks} tokens (sinks)", "o-"),
                               ("attention_prompt", "prompt", "s-"),
                               ("attention_continuation", "target continuation", "^-"),
                               ("attention_drafted", "own drafted tokens", "x--")):
        ax.plot(depths, report.column(name), style, label=label)
    ax.set(ylabel="attention mass", ylim=(0, 1.05), title="Where the drafter attends")
    _depth_axis(ax, depths)
    ax.legend(fontsize=8)


def _entropy(ax, report, depths) -> None:
    ax.plot(depths, report.column("entropy"), "o-")
    ax.set(ylabel="nats", ylim=(0, max(report.column("entropy")) * 1.15 + 1e-9), title="Draft-distribution entropy")
    _depth_axis(ax, depths)


def _fc_input(ax, report, depths) -> None:
    fc = report.fc_input
    names = [str(i) for i in fc.aux_layer_ids] or [str(i) for i in range(len(fc.rms))]
    xs = list(range(len(names)))
    ax.bar([x - 0.2 for x in xs], fc.rms, width=0.4, label="target state")
    if fc.rms_into_fc is not None and fc.normalised_by:
        ax.bar([x + 0.2 for x in xs], fc.rms_into_fc, width=0.4, label=f"after {fc.normalised_by}")
    ax.set(xlabel="tapped layer (output of)", ylabel="RMS", title="Tapped states entering fc (any depth)",
           xticks=xs, xticklabels=names)
    ax.legend(fontsize=8)


def _not_visible(ax, report, names) -> None:
    hidden = [n for n in names if n in report.unavailable]
    if hidden:
        ax.text(0.02, 0.02, f"not visible on {report.runtime}: " + ", ".join(hidden), transform=ax.transAxes,
                fontsize=7, color="grey")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
