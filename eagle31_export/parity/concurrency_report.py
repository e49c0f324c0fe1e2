"""The report's concurrency section (parity/concurrency.py): a table per level C and tau by C."""

from __future__ import annotations

from pathlib import Path

from eagle31_export.parity.concurrency import ConcurrencyRow


def concurrency_lines(rows: list[ConcurrencyRow], runtime: str, tau_reference: float) -> list[str]:
    if not rows:
        return []
    lines = [f"## Under load: {runtime} with C requests in flight", "",
             "| C | in flight (measured) | batch: largest / mean / steady mean | same tokens as C=1 "
             "| same rounds as C=1 | same as reference | rounds | accepted "
             "| accepted per position | tau | output tok/s | runtime's own counters |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        own = "" if row.runtime_counters is None else (
            f"{row.runtime_counters['rounds']} rounds, {row.runtime_counters['accepted']} accepted")
        same_rounds = f"{row.same_rounds_as_c1}/{row.prompts}" if row.per_request else "not reported per request"
        lines.append(f"| {row.concurrency} | {_in_flight(row)} | {_batch(row)} | {row.same_tokens_as_c1}/{row.prompts} "
                     f"| {same_rounds} | {row.same_tokens_as_reference}/{row.prompts} | {row.rounds} | {row.accepted} "
                     f"| {'/'.join(map(str, row.accepted_per_position))} | {row.tau:.3f} "
                     f"| {row.tokens_per_second:.1f} | {own} |")
    sources = sorted({row.batching["source"] for row in rows if row.batching})
    measured = (f"Batch sizes as measured ({'; '.join(sources)}); steady mean: prefills aside, while C requests "
                "were in flight. " if sources else "The runtime reports no batch sizes. ")
    lines += ["", f"reference tau {tau_reference:.3f}. {measured}Per-request counts compared where the runtime returns them; "
              "otherwise its pooled counters against C = 1's. Throughput is this machine's, not a benchmark "
              "(benchmarks/speedup.py).", ""]
    unshown = [row.batching_not_shown for row in rows if row.batching_not_shown]
    lines += [f"**Batching inconclusive:** {note}" for note in unshown] + ([""] if unshown else [])
    return lines + _tie_lines(rows)


def _tie_lines(rows: list[ConcurrencyRow]) -> list[str]:
    """Prompts that differ from C = 1 by numerical ties only (parity/ties.py): counted, listed, not failed."""
    judged = [row for row in rows[1:] if row.ties_judged]
    if not judged:
        return []
    lines = ["Under load, every prompt that differs from C = 1 is judged along its own sequence: "
             + "; ".join(f"C = {row.concurrency}: {len(row.tied_prompts)} by numerical ties only, "
                         f"{len(row.differing_prompts)} beyond" for row in judged), ""]
    return lines + [f"- C = {row.concurrency}, tie: {tie}" for row in judged for tie in row.ties] + (
        [""] if any(row.ties for row in judged) else [])


def _in_flight(row: ConcurrencyRow) -> str:
    return str(row.batching["in_flight"]) if row.batching and row.batching.get("in_flight") else "not measured"


def _batch(row: ConcurrencyRow) -> str:
    if not row.batching:
        return "not measured"
    b = row.batching
    steady = "-" if b.get("steady_mean") is None else f"{b['steady_mean']:.1f}"
    largest = str(b["largest"])
    if b.get("counted_largest") is not None:  # vLLM: say which measurement showed it
        largest += f" (sampled {b['sampled_largest']}, counted >= {b['counted_largest']})"
    return f"{largest} / {b['mean']:.1f} / {steady}"


def concurrency_plot(rows: list[ConcurrencyRow], runtime: str, tau_reference: float, path: Path, save) -> Path:
    """tau at each C beside the reference's: flat when batching is right."""
    import matplotlib.pyplot as plt

    levels = [r.concurrency for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, [r.tau for r in rows], "x--", label=runtime)
    ax.axhline(tau_reference, color="grey", linestyle=":", label="reference")
    ax.set(xlabel="requests in flight (C)", ylabel="tau (tokens per target forward)", xscale="log",
           xticks=levels, title="Acceptance length under load", ylim=(0, max(tau_reference, *[r.tau for r in rows]) * 1.15))
    ax.set_xticklabels([str(c) for c in levels])
    ax.minorticks_off()
    ax.legend()
    return save(fig, path)
