"""Parity reports: report.json, a ten-second report.md, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from eagle31_export.formats.outputs import atomic_output_dir
from eagle31_export.parity.compare import ParityReport
from eagle31_export.parity.concurrency_report import concurrency_lines, concurrency_plot
from eagle31_export.parity.context import context_lines, context_plot


def write_report(report: ParityReport, folder: Path, force: bool = False, inputs=()) -> list[Path]:
    """The report folder, written atomically like every output (`formats/outputs.py`); `inputs`:
    what the parity run read, which `folder` may not touch."""
    folder = Path(folder)
    with atomic_output_dir(folder, force=force, inputs=inputs) as tmp:
        (tmp / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
        (tmp / "report.md").write_text(markdown(report))
        names = [p.name for p in plots(report, tmp)]
    return [folder / "report.json", folder / "report.md", *(folder / n for n in names)]


def markdown(report: ParityReport) -> str:
    verdict = report.verdict
    worst = min(report.rows, key=lambda r: (r.tokens_identical, r.accepted_identical, r.drafts_identical,
                                            -abs(r.tau_runtime - r.tau_reference),
                                            -(r.first_logits_max_abs_diff or 0.0)), default=None)
    diffs = [r.first_logits_max_abs_diff for r in report.rows if r.first_logits_max_abs_diff is not None]
    lines = [
        f"# Acceptance parity: **{verdict}**",
        "",
        *[f"**Inconclusive:** {reason}" + "\n" for reason in report.inconclusive],
        *[f"**Unknown to our vLLM plugin:** {line}" + "\n" for line in report.engine_unknown],
        f"runtime `{report.runtime}` vs PyTorch reference, depth {report.depth}, "
        f"temperature {report.temperature}, {len(report.rows)} prompts",
        "",
        f"mode: {report.mode} (reference target forwards: "
        f"{sum(r.target_forwards_reference for r in report.rows)} for {len(report.rows)} prompts)"
        + ("; the reference column holds what the target's probabilities expect along the runtime's rounds"
           if report.sampled else ""),
        "",
        "| | reference | runtime |",
        "|---|---|---|",
        f"| mean tau | {report.tau('reference'):.3f} | {report.tau('runtime'):.3f} |",
        f"| prompts with identical tokens | {len(report.rows)} | {sum(r.tokens_identical for r in report.rows)} |",
        f"| prompts with identical accepted_per_step | {len(report.rows)} "
        f"| {sum(r.accepted_identical for r in report.rows)} |",
        _drafts_row(report),
        *_position_rows(report),
        "",
        f"compared: {report.compared}",
        "",
        *dtype_lines(report),
    ]
    if diffs:
        lines += [f"first-step draft logits: max abs difference {max(diffs):.3g}", ""]
    if worst is not None:
        lines += [f"worst prompt: #{worst.prompt_index} (tau {worst.tau_reference:.3f} -> {worst.tau_runtime:.3f}"
                  + (f"; {worst.symptom}" if worst.symptom else "") + ")", ""]
    if report.failures:
        lines += ["## Failures", ""] + [f"- {f}" for f in report.failures] + [""]
    if report.inspect_names:
        lines += ["inspect names, for the bundle's drafter (what `eagle31-export inspect` and `verify` say of it):",
                  ""] + [f"- inspect names: {line}" for line in report.inspect_names] + [""]
    lines += sampled_lines(report)
    lines += tie_lines(report)
    lines += per_depth_lines(report)
    lines += context_lines(report.context, report.runtime)
    lines += concurrency_lines(report.concurrency, report.runtime, report.tau("reference"))
    lines += repeat_lines(report)
    lines += ["Thresholds: " + ", ".join(f"{k}={v}" for k, v in report.to_json()["thresholds"].items()),
              "", "Plots: `acceptance_by_position.png`, `tau_per_prompt.png`, `tau_vs_context.png`"
              + (", `per_depth.png`" if report.per_depth else "")
              + (", `tau_by_concurrency.png`" if report.concurrency else "")
              + (", `tau_by_context.png`" if report.context else "")
              + (", `sampled_acceptance.png`" if report.sampled else "") + ".", ""]
    return "\n".join(lines)


def sampled_lines(report: ParityReport) -> list[str]:
    """The greedy-drafts check (parity/sampling.py): (a) the drafts, (b) acceptance against its law."""
    check, sampling = report.sampled, report.sampling
    if check is None:
        return []
    observed, expected, half = check.tau
    lines = [f"## Sampling: {sampling.describe()}", "",
             f"rule: {sampling.to_json()['rule_text']} ({report.sampling_rule_basis})", "",
             f"(a) drafts: {check.accepted_checked} accepted tokens and {check.rejections_checked} rejections checked "
             f"over {check.rounds} rounds; " + ("every one as the reference drafter drafts" if check.drafts_exact else
                                               f"at fault: {check.at_fault}"), "",
             *([f"{len(check.emitted_drafts)} rejections emitted the reference's own draft; the sampler is shown "
                "wrong, so they tell nothing of the drafter", ""] if check.emitted_drafts and check.sampler_wrong
               and check.greedy is None else []),
             *([f"the drafter checked greedy, as the sampled run left it open: {check.greedy.describe()}", ""]
               if check.greedy is not None else []),
             f"(b) acceptance: tau {observed:.3f} observed vs {expected:.3f} expected from the target's probabilities "
             f"(95 %: +-{half:.3f}; z {_z(check.tau_z)})", "",
             "| draft position | rounds reaching it | accepted | expected | 95 % interval | z | rejections emitting "
             "the draft | z of the draft accepted or emitted (0 whatever was drafted) |", "|---|---|---|---|---|---|---|---|"]
    for law in check.positions:
        low, high = law.interval()
        lines.append(f"| {law.position} | {law.reached} | {law.accepted} | {law.expected:.1f} | {low:.1f} .. {high:.1f} "
                     f"| {_z(law.z)} | {law.matched} (at most {law.match_bound:.1f} with a correct sampler) "
                     f"| {_z(law.z_either)} |")
    need = check.prompts_to_see()
    if need is not None:
        lines += ["", f"(b) would see a change of 0.1 in tau (95 % confidence, 80 % power) with about {need} prompts "
                      f"like these ({len(check.prompts)} ran)."]
    return lines + [""]


def _z(z: float | None) -> str:
    return "-" if z is None else f"{z:+.1f}"


def dtype_lines(report: ParityReport) -> list[str]:
    """What the runtime computes in, and whether that was observed, set or only stated."""
    d, lines = report.runtime_dtype, []
    if d:
        said = {"observed": "observed", "set": "set", "stated": "**stated, not observed**"}.get(d["basis"], d["basis"])
        lines = [f"runtime dtype: {d['dtype']}, {said}: {d['how']}", ""]
    a = report.activations
    if a:
        which = "FP4 (NVFP4, W4A4)" if a["fp4"] else "not quantized (W4A16 where the weights are NVFP4)"
        lines += [f"activations compared: {which}, {a['basis']}: {a['how']}", ""]
    e = report.engine_sampler
    if e and report.temperature != 0:
        lines += [f"engine's sampler: {e['state']} ({e['how']})", ""]
    if report.drafts_source:
        lines += [f"engine's drafts: {report.drafts_source}", ""]
    t = report.engine_chunk_tail
    if t:
        lines += [f"engine's drafter at a prefill chunk's end reads: {t['state']} ({t['how']})", ""]
    for row in report.mixed_batches:
        lines += [f"mixed batch at concurrency {row.concurrency} (largest batch {row.largest_batch}): "
                  f"{len(row.exact_prompts)} of {len(row.greedy_prompts)} greedy requests among "
                  f"{len(row.sampled_prompts)} sampled ones decoded as the reference"
                  + (f" ({len(row.ties)} numerical ties)" if row.ties else "")
                  + (f"; first difference: {row.untied[0]}" if row.untied else ""), ""]
    return lines


def repeat_lines(report: ParityReport) -> list[str]:
    """--repeat: each later send of every level against its first, with the engine's prefix-cache
    hits over it (tokens), so that a send the cache never served shows."""
    rows = [(row.concurrency, r) for row in report.concurrency for r in row.repeats]
    if not rows:
        return []
    n = max(r.repeat for _, r in rows)
    lines = [f"## Repeats: the prompts sent again at each level, {n} more time{'s' if n > 1 else ''}", "",
             "| C | repeat | same as the first send | differing (beyond ties) | by ties only "
             "| prefix-cache hits / queries (tokens) | seconds |",
             "|---|---|---|---|---|---|---|"]
    for c, r in rows:
        cache = ("not reported" if r.prefix_cache_hits is None
                 else f"{r.prefix_cache_hits} / {r.prefix_cache_queries}")
        differing = ", ".join(map(str, r.differing_prompts[:8])) or "none"
        lines.append(f"| {c} | {r.repeat} | {r.same_as_first}/{r.prompts} | {differing} | {len(r.tied_prompts)} "
                     f"| {cache} | {r.seconds:.1f} |")
    lines.append("")
    for c in sorted({c for c, _ in rows}):
        mine = [r for level, r in rows if level == c]
        if all(r.prefix_cache_hits is not None for r in mine):
            hits, queries = sum(r.prefix_cache_hits for r in mine), sum(r.prefix_cache_queries or 0 for r in mine)
            cold = [r.repeat for r in mine if not r.prefix_cache_hits]
            lines.append(f"- C = {c}: {hits} of {queries} prompt tokens served from the prefix cache over "
                         f"{len(mine)} repeats" + (f"; repeats {', '.join(map(str, cold))} hit no cached block"
                                                   if cold else ""))
    if any(r.prefix_cache_hits is not None for _, r in rows):
        lines += _cold_cache_note([r for _, r in rows]) + [
            "", "Hits and queries: the engine's vllm:prefix_cache_hits / vllm:prefix_cache_queries over each send.", ""]
    return lines


def _cold_cache_note(repeats) -> list[str]:
    if any(r.prefix_cache_hits for r in repeats) or all(r.prefix_cache_hits is None for r in repeats):
        return []
    if any(r.prefix_caching is False for r in repeats):
        return ["", "**No send hit the prefix cache:** the engine runs without prefix caching "
                "(vllm:cache_config_info enable_prefix_caching False)."]
    block = next((r.cache_block_size for r in repeats if r.cache_block_size), None)
    size = f" of {block} tokens" if block else ""
    return ["", f"**No send hit the prefix cache:** it serves whole blocks{size} only (vllm:cache_config_info "
            "block_size); give prompts longer than a block (--prompts)."]


def tie_lines(report: ParityReport) -> list[str]:
    """Each numerical tie (parity/ties.py), by prompt: what was not failed on, and why."""
    unmeasured = (report.numerics or {}).get("unavailable")
    if unmeasured:
        return [f"Numerical ties not judged: {unmeasured}; no difference is excused as a tie.", ""]
    past = [f"- prompt {r.prompt_index}: {d}" for r in report.rows for d in r.past_cut]
    past = ([f"Not judged ({len(past)}; past max_new_tokens, not ties, not counted):", "", *past, ""] if past else [])
    if not report.ties_judged or not report.tie_count:
        return past
    n, budget = report.numerics or {}, report.tie_budget
    lines = [f"## Numerical ties ({report.tie_count}; the runtime's choice within {report.thresholds.tie_errors:g} x "
             f"the error {report.numerics_precision} measurably makes at that decision)", ""]
    if n.get("median_error") is not None:
        lines += [f"Measured over {n['decisions']} decisions: error median {n['median_error']:.2g}, p99 "
                  f"{n['p99_error']:.2g} logits; top-2 margin shift / error median {n['z_median']:.2g}, p99 "
                  f"{n['z_p99']:.2g}, max {n['z_max']:.2g}."
                  + (f" Largest tie: {n['largest_tie']:.2g} x its measured error." if n.get("largest_tie") is not None
                     else ""), ""]
    if budget is not None:
        lines += [f"Tie budget: {budget.observed} observed, {budget.expected:.2g} expected over {budget.decisions} "
                  f"decisions, at most {budget.allowed} allowed.", ""]
    return lines + [f"- prompt {r.prompt_index}: {tie}" for r in report.rows for tie in r.ties] + [""] + past


def _drafts_row(report: ParityReport) -> str:
    if not report.drafts_reported:
        return f"| prompts with identical drafts | {len(report.rows)} | not reported by {report.runtime} |"
    return f"| prompts with identical drafts | {len(report.rows)} | {sum(r.drafts_identical for r in report.rows)} |"


def _position_rows(report: ParityReport) -> list[str]:
    """Rounds accepted at each draft position, summed over prompts (what vLLM's counters count)."""
    rows = []
    for pos in range(report.depth):
        ref = sum(r.accepted_per_position_reference[pos] for r in report.rows if r.accepted_per_position_reference)
        run = sum(r.accepted_per_position_runtime[pos] for r in report.rows if r.accepted_per_position_runtime)
        rows.append(f"| rounds accepted at draft position {pos + 1} | {ref} | {run} |")
    rounds = (sum(r.rounds_reference for r in report.rows), sum(r.rounds_runtime for r in report.rows))
    return [f"| rounds | {rounds[0]} | {rounds[1]} |", *rows]


def per_depth_lines(report: ParityReport) -> list[str]:
    """Both sides per draft depth (teacher-forced): agreement and the RMS of the fed-back state."""
    per = report.per_depth
    if not per:
        return []
    ref, run = per["reference"], per["runtime"]
    lines = [f"## Per draft depth (teacher-forced, {per['positions_per_prompt']} positions per prompt)", ""]
    for side, data in (("reference", ref), (report.runtime, run)):
        if "unavailable" in data:
            lines.append(f"{side}: not measured ({data['unavailable']})")
    if "unavailable" in ref or "unavailable" in run:
        return lines + [""]
    lines += ["| depth | agreement reference | agreement runtime | fed-back RMS reference | fed-back RMS runtime |",
              "|---|---|---|---|---|"]
    for k in range(report.depth):
        lines.append(f"| {k + 1} | {ref['agreement'][k]:.3f} | {run['agreement'][k]:.3f} "
                     f"| {ref['fed_back_rms'][k]:.4g} | {run['fed_back_rms'][k]:.4g} |")
    return lines + [""]


def plots(report: ParityReport, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    depth = range(1, report.depth + 1)
    ref = [_pooled(report, "reference", i) for i in range(report.depth)]
    run = [_pooled(report, "runtime", i) for i in range(report.depth)]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(depth, ref, "o-", label="reference")
    ax.plot(depth, run, "x--", label=report.runtime)
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="Acceptance by draft position",
           xticks=list(depth))
    ax.legend()
    paths.append(_save(fig, folder / "acceptance_by_position.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    idx = [r.prompt_index for r in report.rows]
    ax.bar([i - 0.2 for i in idx], [r.tau_reference for r in report.rows], width=0.4, label="reference")
    ax.bar([i + 0.2 for i in idx], [r.tau_runtime for r in report.rows], width=0.4, label=report.runtime)
    ax.set(xlabel="prompt", ylabel="tau (tokens per target forward)", title="Acceptance length per prompt",
           xticks=idx)
    ax.legend()
    paths.append(_save(fig, folder / "tau_per_prompt.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r.prompt_len for r in report.rows], [r.tau_reference for r in report.rows], label="reference")
    ax.scatter([r.prompt_len for r in report.rows], [r.tau_runtime for r in report.rows], marker="x",
               label=report.runtime)
    ax.set(xlabel="prompt length (tokens)", ylabel="tau", title="Acceptance length vs context length")
    ax.legend()
    paths.append(_save(fig, folder / "tau_vs_context.png"))
    if report.per_depth:
        paths.append(_per_depth_plot(report, folder / "per_depth.png"))
    if report.concurrency:
        paths.append(concurrency_plot(report.concurrency, report.runtime, report.tau("reference"),
                                      folder / "tau_by_concurrency.png", _save))
    if report.sampled is not None:
        paths.append(_sampled_plot(report, folder / "sampled_acceptance.png"))
    if report.context:
        paths.append(context_plot(report.context, report.runtime, folder / "tau_by_context.png", _save))
    return paths


def _sampled_plot(report: ParityReport, path: Path) -> Path:
    """Accepted drafts per position: observed against the target's expectation with its 95 % interval."""
    import matplotlib.pyplot as plt

    laws = report.sampled.positions
    x = [law.position for law in laws]
    rate = lambda n, law: n / law.reached if law.reached else 0.0  # noqa: E731
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(x, [rate(law.expected, law) for law in laws],
                yerr=[[rate(law.expected - law.interval()[0], law) for law in laws],
                      [rate(law.interval()[1] - law.expected, law) for law in laws]],
                fmt="o-", capsize=4, label="expected (target probabilities, 95 %)")
    ax.plot(x, [rate(law.accepted, law) for law in laws], "x--", label=f"{report.runtime} observed")
    ax.set(xlabel="draft position", ylabel="acceptance rate among rounds reaching it", ylim=(0, 1.05), xticks=x,
           title=f"Sampled acceptance ({report.sampling.describe()})")
    ax.legend()
    return _save(fig, path)


def _per_depth_plot(report: ParityReport, path: Path) -> Path:
    return _save(per_depth_figure(report), path)


def per_depth_figure(report: ParityReport):
    """Agreement and fed-back state RMS per draft depth, both sides. The RMS is drawn relative to the
    reference's at depth 1, as `diagnose` draws it, on a linear axis spanning at least 0.9..1.2 with
    no offset: a flat column in the table is a flat line, and a runtime that feeds back the wrong
    state (pre- instead of post-norm) stands apart by the ratio of the two magnitudes."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    depth = list(range(1, report.depth + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sides = (("reference", report.per_depth["reference"], "o-"),
             (report.runtime, report.per_depth["runtime"], "x--"))
    base = next((data["fed_back_rms"][0] for _, data, _ in sides if "unavailable" not in data), None)
    seen = []
    for label, data, style in sides:
        if "unavailable" in data:
            continue
        left.plot(depth, data["agreement"], style, label=label)
        relative = [v / base for v in data["fed_back_rms"]] if base else data["fed_back_rms"]
        right.plot(depth, relative, style, label=label)
        seen += relative
    left.set(xlabel="draft depth", ylabel="agreement with the target", ylim=(0, 1.05), xticks=depth,
             title="Teacher-forced agreement per depth")
    right.axhline(1.0, color="grey", lw=0.8)
    if seen:
        right.set_ylim(min(0.9, min(seen) * 0.95), max(1.2, max(seen) * 1.05))
    right.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))
    right.set(xlabel="draft depth", ylabel="RMS relative to the reference at depth 1", xticks=depth,
              title="State fed back into the next step")
    for ax in (left, right):
        if ax.lines:
            ax.legend()
    missing = [f"{label}: {data['unavailable']}" for label, data, _ in sides if "unavailable" in data]
    if missing:
        fig.text(0.01, 0.01, "not measured: " + "; ".join(missing)[:200], fontsize=7, color="grey")
    return fig


def _pooled(report: ParityReport, side: str, pos: int) -> float:
    rounds = [getattr(r, f"rounds_{side}") for r in report.rows]
    rates = [getattr(r, f"per_position_{side}")[pos] for r in report.rows]
    total = sum(rounds)
    return sum(a * n for a, n in zip(rates, rounds)) / total if total else 0.0


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
