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
from typing import Callable

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
    batching: dict | None = None  # BatchFigures.to_json(): how many requests the runtime really ran together
    # tie-aware (a Judge given): prompts that differ from C = 1 by numerical ties only, each tie, and the
    # first difference beyond a tie of every prompt in `differing_prompts` (parity/ties.py)
    tied_prompts: list[int] = field(default_factory=list)
    ties: list[str] = field(default_factory=list)
    untied: list[str] = field(default_factory=list)
    ties_judged: bool = False
    # the level's ties against what the runtime's precision explains (parity/numerics.py: TieBudget.to_json),
    # over every prompt: a prompt identical to C = 1 brings its C = 1 ties (parity/compare.py adds them)
    tie_budget: dict | None = None
    repeats: list["RepeatRow"] = field(default_factory=list)  # --repeat: each later send against this level's first
    # where the client itself never kept C requests in flight (a starved client): what batching it could show
    batching_not_shown: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


@dataclass
class LoadRuns:
    """The runs at each level C > 1, timed (the C = 1 runs are the parity run itself)."""

    runs: dict[int, ConcurrentRun] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    repeats: dict[int, list[tuple[ConcurrentRun, float]]] = field(default_factory=dict)  # --repeat, C = 1 too


def run_levels(runtime: Speculator, prompts: list[list[int]], depth: int, max_new_tokens: int,
               temperature: float, seed: int, levels: tuple[int, ...], progress=None, repeat: int = 0) -> LoadRuns:
    """Every prompt at each level C > 1 (phase `concurrency`, one unit a level); then, with `repeat`,
    every level again that many times (`run_repeats`)."""
    out, extra = LoadRuns(), [c for c in levels if c > 1]
    phases = Phases.of(progress)
    if extra:
        with phases.phase("concurrency", total=len(extra)):
            for n, c in enumerate(extra):
                start = time.perf_counter()
                out.runs[c] = runtime.run_concurrently(prompts, max_new_tokens, depth, c, temperature, seed)
                out.seconds[c] = time.perf_counter() - start
                phases("concurrency", n + 1, len(extra))
    run_repeats(runtime, prompts, depth, max_new_tokens, temperature, seed, levels, repeat, out, phases)
    return out


def pooled_counts(results: list[SpecResult], depth: int) -> dict:
    """Rounds, accepted drafts and rounds accepted per draft position, summed over requests (what
    vLLM's spec_decode counters count)."""
    steps = [a for r in results for a in r.accepted_per_step]
    return {"rounds": len(steps), "accepted": sum(steps), "accepted_per_position": accepted_per_position(steps, depth)}


# (prompt index, a run of it) -> the run judged against the reference replayed along it (parity/ties.py:
# Judged, a layer above this one: `.ties`, `.untied` and `.budget` with observed, expected and decisions);
# None where the rounds cannot be aligned
Judge = Callable[[int, SpecResult], "object | None"]


def compare_levels(base: list[SpecResult], base_seconds: float, references: list[SpecResult], load: LoadRuns,
                   depth: int, exact: bool, tau_rel_tol: float,
                   judge: Judge | None = None) -> tuple[list[ConcurrencyRow], list[str]]:
    """Rows for C = 1 and every level run, and the failures. With `judge` (greedy, a reference that
    replays), any precision: every prompt identical to C = 1 except where the reference's own logit
    gap makes the difference a numerical tie (batched logits differ from single-sequence ones in their
    last bits, and batch composition depends on timing). Without: at fp32 every prompt identical to
    C = 1; in half precision tau within `tau_rel_tol` of C = 1."""
    rows = [_row(1, ConcurrentRun(base), base_seconds, base, references, depth)]
    rows += [_row(c, run, load.seconds[c], base, references, depth) for c, run in sorted(load.runs.items())]
    if judge is not None:
        for row, (_, run) in zip(rows[1:], sorted(load.runs.items())):
            if row.per_request:
                _judge_ties(row, run.results, judge)
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
        output_tokens=sum(len(r.tokens) for r in results), runtime_counters=run.pooled, per_request=per_request,
        batching=run.batching.to_json() if run.batching is not None else None)


NOT_BATCHED = "the runtime did not batch"


def _judge_ties(row: ConcurrencyRow, results: list[SpecResult], judge: Judge) -> None:
    """Sort the row's differing prompts into numerical ties and real differences."""
    real, budget = [], {"observed": 0, "expected": 0.0, "decisions": 0}
    for i in row.differing_prompts:
        found = judge(i, results[i])
        untied = found.untied if found is not None else []
        row.ties += [f"prompt {i}: {d.describe()}" for d in (found.ties if found is not None else [])]
        if found is not None:
            for key in budget:
                budget[key] += getattr(found.budget, key)
        if found is None or untied:
            real.append(i)
            row.untied.append(f"prompt {i}: " + (untied[0].describe() if untied else "rounds cannot be aligned"))
        else:
            row.tied_prompts.append(i)
    row.differing_prompts, row.ties_judged, row.tie_budget = real, True, budget


def client_kept(row: ConcurrencyRow) -> int | None:
    """The most requests the client itself had in flight at once at this level (None: not measured)."""
    return (row.batching or {}).get("in_flight") or None


def batching_not_shown(row: ConcurrencyRow) -> str | None:
    """Why a level says nothing about the engine's batching: its client never had C requests in flight at
    once (a client starved of CPU sends them one after another), so the engine had nothing more to batch."""
    kept, wanted = client_kept(row), min(row.concurrency, row.prompts)
    if kept is None or kept >= wanted:
        return None
    return (f"concurrency {row.concurrency}: the client kept at most {kept} of {wanted} in flight: batching "
            f"{'not shown' if kept <= 1 else f'shown up to {kept} only'} (the engine's side judged on what it was sent)")


def _row_failures(row: ConcurrencyRow, base: ConcurrencyRow, exact: bool, tau_rel_tol: float) -> list[str]:
    c, out = row.concurrency, []
    steps = (row.runtime_counters or {}).get("engine_steps")
    batched_steps = steps is not None and 0 < steps < row.rounds  # some engine step verified two requests or more
    row.batching_not_shown = batching_not_shown(row)
    kept = client_kept(row)
    # the engine is at fault only for what it was sent: two or more requests in flight at once (or, where the
    # client's count is not measured, the level's C)
    sent_together = (kept if kept is not None else row.prompts) > 1
    if (row.batching is not None and row.prompts > 1 and sent_together and row.batching["largest"] <= 1
            and not batched_steps):
        out.append(f"concurrency {c}: {NOT_BATCHED}: it never ran more than one request at once although the "
                   f"client had {kept or c} in flight ({row.batching['source']}); requests in flight were queued, "
                   "not served together")
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
    if (exact or row.ties_judged) and row.differing_prompts:
        shown = ", ".join(str(i) for i in row.differing_prompts[:8])
        beyond = f"; first beyond a numerical tie: {row.untied[0]}" if row.untied else ""
        out.append(f"concurrency {c}: {len(row.differing_prompts)} of {row.prompts} prompts differ from concurrency 1 "
                   f"(prompts {shown}; tokens the same for {row.same_tokens_as_c1}{beyond}): {BATCHING}")
    if not exact and not row.ties_judged and base.tau and abs(row.tau - base.tau) > tau_rel_tol * base.tau:
        out.append(f"concurrency {c}: tau {row.tau:.3f} vs {base.tau:.3f} at concurrency 1, beyond "
                   f"{tau_rel_tol:.0%}: {BATCHING}")
    return out


# --repeat: the prompts sent again at each level, each send against the level's first (vLLM issue
# 41838: acceptance that regressed at concurrency 4 over hours, traced to prefix-cache blocks published
# before their KV was written; an engine with prefix caching serves later sends from cached blocks).

MAX_REPEAT = 100
CACHED_KV = ("blocks it served from the prefix cache hold other KV than the first run computed (published "
             "before their KV was written: vLLM issue 41838), or batch composition changed a decision")
NOT_CACHED = "nothing came from the prefix cache, so batch composition or state left by earlier requests"


@dataclass
class RepeatRow:
    """One later send of every prompt at a level (`--repeat`), compared with the level's first send
    (at C = 1, the parity run itself) prompt by prompt: tokens and every round's accepted count."""

    repeat: int  # 1..N
    prompts: int
    same_as_first: int  # prompts whose tokens and rounds equal the first send's
    differing_prompts: list[int]  # beyond numerical ties, where judged
    first_differences: list[str]  # where each differing prompt first differs
    tied_prompts: list[int]  # differ from the first by numerical ties only (parity/ties.py)
    seconds: float
    # the engine's own counters over this send (vLLM: vllm:prefix_cache_hits / _queries deltas, in
    # tokens; whether it caches prefixes and in blocks of how many tokens); None where it does not say
    prefix_cache_hits: int | None = None
    prefix_cache_queries: int | None = None
    prefix_caching: bool | None = None
    cache_block_size: int | None = None
    pooled_difference: str | None = None  # no per-request counts: the pooled counters against the first's


def check_repeat(repeat: int) -> int:
    if not 0 <= repeat <= MAX_REPEAT:
        raise UserError(f"--repeat {repeat}: give how many times to send the prompts again, 0 to {MAX_REPEAT}")
    return repeat


def run_repeats(runtime: Speculator, prompts: list[list[int]], depth: int, max_new_tokens: int, temperature: float,
                seed: int, levels: tuple[int, ...], repeat: int, out: LoadRuns, progress=None) -> None:
    """Every prompt sent `repeat` more times at each level, C = 1 included (phase `repeat`, one unit a
    send), into `out.repeats`; same seeds as the first send."""
    if not check_repeat(repeat):
        return
    phases, total = Phases.of(progress), repeat * len(levels)
    with phases.phase("repeat", total=total):
        for n, (c, _) in enumerate((c, k) for c in levels for k in range(repeat)):
            start = time.perf_counter()
            run = runtime.run_concurrently(prompts, max_new_tokens, depth, c, temperature, seed)
            out.repeats.setdefault(c, []).append((run, time.perf_counter() - start))
            phases("repeat", n + 1, total)


def compare_repeats(rows: list[ConcurrencyRow], base: list[SpecResult], load: LoadRuns, exact: bool,
                    judge: Judge | None = None) -> list[str]:
    """Each repeat against its level's first send, into `row.repeats`; the failures. Like the levels
    (`compare_levels`): with `judge`, a prompt that differs by numerical ties only is listed, not
    failed; without, fp32 fails on any difference and half precision counts them."""
    by_level, failures = {row.concurrency: row for row in rows}, []
    for c, sends in sorted(load.repeats.items()):
        first_run = ConcurrentRun(base) if c == 1 else load.runs[c]
        for k, (run, seconds) in enumerate(sends, 1):
            row = _repeat_row(k, run, seconds, first_run, judge)
            by_level[c].repeats.append(row)
            failures += _repeat_failures(c, row, len(sends), exact or judge is not None)
    return failures


def _repeat_row(k: int, run: ConcurrentRun, seconds: float, first: ConcurrentRun, judge: Judge | None) -> RepeatRow:
    per_request = run.per_request and first.per_request
    found = {i: _first_difference(r, f, per_request) for i, (r, f) in enumerate(zip(run.results, first.results))}
    differing = [i for i, d in found.items() if d is not None]
    tied = [i for i in differing if judge is not None and per_request and _tied(judge(i, run.results[i]))]
    real = [i for i in differing if i not in tied]
    pooled = run.pooled or {}
    row = RepeatRow(repeat=k, prompts=len(run.results), same_as_first=len(run.results) - len(differing),
                    differing_prompts=real, first_differences=[f"prompt {i}: {found[i]}" for i in real],
                    tied_prompts=tied, seconds=seconds, prefix_cache_hits=pooled.get("prefix_cache_hits"),
                    prefix_cache_queries=pooled.get("prefix_cache_queries"),
                    prefix_caching=pooled.get("prefix_caching"),
                    cache_block_size=pooled.get("cache_block_size"))
    if not per_request:
        depth = next((r.depth for r in first.results), 0)
        keys = ("rounds", "accepted", "accepted_per_position")
        mine = {k: pooled.get(k) for k in keys}
        theirs = ({k: first.pooled.get(k) for k in keys} if first.pooled else pooled_counts(first.results, depth))
        if pooled and mine != theirs:
            row.pooled_difference = (f"pooled counters {mine['rounds']} rounds / {mine['accepted']} accepted / per "
                                     f"position {mine['accepted_per_position']} vs {theirs['rounds']} / "
                                     f"{theirs['accepted']} / {theirs['accepted_per_position']} in the first send")
    return row


def _tied(found) -> bool:
    return found is not None and not found.untied


def _first_difference(run: SpecResult, first: SpecResult, rounds: bool) -> str | None:
    """Where a prompt's send first differs from its first send; None where it does not."""
    def first_index(a: list, b: list) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if run.tokens != first.tokens:
        i = first_index(run.tokens, first.tokens)
        return f"tokens differ from token {i}"
    if rounds and run.accepted_per_step != first.accepted_per_step:
        i = first_index(run.accepted_per_step, first.accepted_per_step)
        shown = lambda steps: str(steps[i]) if i < len(steps) else "none"  # noqa: E731
        return (f"round {i} accepted {shown(run.accepted_per_step)} drafts vs {shown(first.accepted_per_step)} "
                "in the first send")
    return None


def _repeat_failures(c: int, row: RepeatRow, repeats: int, strict: bool) -> list[str]:
    where, out = f"concurrency {c}, repeat {row.repeat} of {repeats}", []
    cause = CACHED_KV if row.prefix_cache_hits else NOT_CACHED
    if row.pooled_difference:
        out.append(f"{where}: {row.pooled_difference} (the runtime reports no per-request counts): {cause}")
    if strict and row.differing_prompts:
        shown = ", ".join(str(i) for i in row.differing_prompts[:8])
        out.append(f"{where}: {len(row.differing_prompts)} of {row.prompts} prompts differ from this level's first "
                   f"send (prompts {shown}; {row.first_differences[0]}): {cause}")
    return out
