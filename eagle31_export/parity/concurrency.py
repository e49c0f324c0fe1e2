"""Parity under load: the same prompts with C requests in flight, against C = 1 and the reference.

Batching is where speculation breaks silently in serving engines (padding, per-sequence positions,
KV layout: acceptance falls with batch size and nothing errors). So each level C > 1 sends every
prompt with C requests in flight (`Speculator.run_concurrently`) and compares, per prompt, the
tokens and the accepted count of every round with the run at C = 1 and with the reference. A
runtime that keeps its own pooled counters (vLLM's /metrics) must also agree with the per-request
results it returned. fp32 runtimes must match exactly; half precision compares tau within the
report's tolerance and counts the prompts whose tokens differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from eagle31_export.errors import UserError
from eagle31_export.progress import Phases
from eagle31_export.reference.speculate import SpecResult
from eagle31_export.reference.statistics import accepted_per_position, acceptance_length
from eagle31_export.runtime.registry import ConcurrentRun, Speculator

MAX_CONCURRENCY = 256

BATCHING = "the runtime's batched step: per-sequence positions, cache lengths or padding masks"


def parse_levels(text: str | None) -> tuple[int, ...]:
    """`--concurrency 1,4,16` -> (1, 4, 16): sorted, unique, C = 1 always first (the baseline)."""
    if text is None:
        return (1,)
    try:
        levels = {int(part) for part in str(text).split(",") if part.strip()}
    except ValueError:
        raise UserError(f"--concurrency {text!r}: give request counts separated by commas, e.g. 1,4,16") from None
    bad = [c for c in levels if not 1 <= c <= MAX_CONCURRENCY]
    if not levels or bad:
        raise UserError(f"--concurrency {text!r}: each level must be between 1 and {MAX_CONCURRENCY}")
    return tuple(sorted(levels | {1}))


def check_runtime_serves(runtime: Speculator, levels: tuple[int, ...]) -> None:
    if max(levels) > 1 and not runtime.serves_concurrently:
        raise UserError(f"--concurrency: the {runtime.name} runtime runs one sequence at a time, so concurrency "
                        "would only queue requests; use --runtime onnxruntime, triton or vllm")


@dataclass
class ConcurrencyRow:
    """One level C: what its run saw and how it compares, prompt by prompt."""

    concurrency: int
    prompts: int
    same_tokens_as_c1: int
    same_rounds_as_c1: int
    same_tokens_as_reference: int
    same_rounds_as_reference: int
    differing_prompts: list[int]
    rounds: int
    accepted: int
    accepted_per_position: list[int]
    tau: float
    seconds: float
    output_tokens: int
    runtime_counters: dict | None = None  # the runtime's own pooled counters over this run (vLLM /metrics)
    per_request: bool = True  # False: the runtime gave no per-request counts; pooled counters compared

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


@dataclass
class LoadRuns:
    """The runs at each level C > 1, timed (the C = 1 runs are the parity run itself)."""

    runs: dict[int, ConcurrentRun] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)


def run_levels(runtime: Speculator, prompts: list[list[int]], depth: int, max_new_tokens: int,
               temperature: float, seed: int, levels: tuple[int, ...], progress=None) -> LoadRuns:
    """Every prompt at each level C > 1 (phase `concurrency`, one unit a level)."""
    out, extra = LoadRuns(), [c for c in levels if c > 1]
    if not extra:
        return out
    phases = Phases.of(progress)
    with phases.phase("concurrency", total=len(extra)):
        for n, c in enumerate(extra):
            start = time.perf_counter()
            out.runs[c] = runtime.run_concurrently(prompts, max_new_tokens, depth, c, temperature, seed)
            out.seconds[c] = time.perf_counter() - start
            phases("concurrency", n + 1, len(extra))
    return out


def pooled_counts(results: list[SpecResult], depth: int) -> dict:
    """Rounds, accepted drafts and rounds accepted per draft position, summed over requests (what
    vLLM's spec_decode counters count)."""
    steps = [a for r in results for a in r.accepted_per_step]
    return {"rounds": len(steps), "accepted": sum(steps), "accepted_per_position": accepted_per_position(steps, depth)}


def compare_levels(base: list[SpecResult], base_seconds: float, references: list[SpecResult], load: LoadRuns,
                   depth: int, exact: bool, tau_rel_tol: float) -> tuple[list[ConcurrencyRow], list[str]]:
    """Rows for C = 1 and every level run, and the failures: at fp32 every prompt identical to C = 1
    (and so to the reference); in half precision tau within `tau_rel_tol` of C = 1."""
    rows = [_row(1, ConcurrentRun(base), base_seconds, base, references, depth)]
    rows += [_row(c, run, load.seconds[c], base, references, depth) for c, run in sorted(load.runs.items())]
    failures = []
    for row in rows[1:]:
        failures += _row_failures(row, rows[0], exact, tau_rel_tol)
    return rows, failures


def _row(c: int, run: ConcurrentRun, seconds: float, base: list[SpecResult], references: list[SpecResult],
         depth: int) -> ConcurrencyRow:
    results, per_request = run.results, run.per_request
    same = lambda a, b: a.tokens == b.tokens  # noqa: E731
    rounds = lambda a, b: a.accepted_per_step == b.accepted_per_step  # noqa: E731
    differing = [i for i, (r, b) in enumerate(zip(results, base)) if not same(r, b) or (per_request and not rounds(r, b))]
    counts = pooled_counts(results, depth) if per_request or not run.pooled else dict(run.pooled)
    taus = [r.acceptance_length for r in results] if per_request else []
    tau = (sum(taus) / len(taus) if taus
           else acceptance_length(counts["accepted"], counts["rounds"]))
    return ConcurrencyRow(
        concurrency=c, prompts=len(results),
        same_tokens_as_c1=sum(same(r, b) for r, b in zip(results, base)),
        same_rounds_as_c1=sum(rounds(r, b) for r, b in zip(results, base)) if per_request else 0,
        same_tokens_as_reference=sum(same(r, f) for r, f in zip(results, references)),
        same_rounds_as_reference=sum(rounds(r, f) for r, f in zip(results, references)) if per_request else 0,
        differing_prompts=differing, rounds=counts["rounds"], accepted=counts["accepted"],
        accepted_per_position=list(counts["accepted_per_position"]), tau=tau, seconds=seconds,
        output_tokens=sum(len(r.tokens) for r in results), runtime_counters=run.pooled, per_request=per_request)


def _row_failures(row: ConcurrencyRow, base: ConcurrencyRow, exact: bool, tau_rel_tol: float) -> list[str]:
    c, out = row.concurrency, []
    if row.runtime_counters is not None and row.per_request:
        own = {k: row.runtime_counters.get(k) for k in ("rounds", "accepted", "accepted_per_position")}
        if own != {"rounds": row.rounds, "accepted": row.accepted, "accepted_per_position": row.accepted_per_position}:
            out.append(f"concurrency {c}: the runtime's own counters ({own['rounds']} rounds, {own['accepted']} "
                       f"accepted) disagree with its per-request results ({row.rounds} rounds, {row.accepted} "
                       "accepted): another client used the server, or it attributes counts to the wrong request")
    if not row.per_request:  # only pooled counters to go on: they must equal C = 1's
        pooled = (row.rounds, row.accepted, row.accepted_per_position)
        if exact and pooled != (base.rounds, base.accepted, base.accepted_per_position):
            out.append(f"concurrency {c}: pooled counters {pooled[0]} rounds / {pooled[1]} accepted / per position "
                       f"{pooled[2]} vs {base.rounds} / {base.accepted} / {base.accepted_per_position} at "
                       f"concurrency 1 (the runtime reports no per-request counts): {BATCHING}")
    if exact and row.differing_prompts:
        shown = ", ".join(str(i) for i in row.differing_prompts[:8])
        out.append(f"concurrency {c}: {len(row.differing_prompts)} of {row.prompts} prompts differ from concurrency 1 "
                   f"(prompts {shown}; tokens the same for {row.same_tokens_as_c1}): {BATCHING}")
    if not exact and base.tau and abs(row.tau - base.tau) > tau_rel_tol * base.tau:
        out.append(f"concurrency {c}: tau {row.tau:.3f} vs {base.tau:.3f} at concurrency 1, beyond "
                   f"{tau_rel_tol:.0%}: {BATCHING}")
    return out
