"""Reference vs runtime: run the same prompts through both speculation loops and compare.

Pass rules (defaults in `Thresholds`):
- greedy: generated tokens identical for every prompt (speculation is lossless, so any
  difference is a runtime bug, not noise);
- greedy: every round's `accepted_per_step` (and drafts, where the runtime reports them) identical
  too (a random or weak drafter accepts little, so drafts are where a drafter-side bug shows first);
- greedy replay, any precision, and every run judged with ties (under load, mixed batches, a sampled
  run's drafts and its greedy check): a difference where the runtime's choice lies within TIE_ERRORS
  times the error the runtime's precision measurably makes at that decision is a numerical tie,
  counted and listed (parity/ties.py, parity/numerics.py: the one tie rule, and where its thresholds
  come from); every other difference fails with its symptom, and so do more ties than that precision
  explains (the tie budget). A difference past max_new_tokens is listed as not judged, never a tie;
- fp16/bf16 runtime, greedy without replay: mean tau within `tau_rel_tol` of the reference
  (statistical: differing tokens are counted, not failed on);
- sampling: per-position acceptance rates within a binomial confidence bound.
Each failure is named by its symptom, which points at the usual cause.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from eagle31_export.errors import UserError
from eagle31_export.parity.blind_spots import blind_spots
from eagle31_export.parity.concurrency import (
    BATCHING, ConcurrencyRow, Judge, LoadRuns, check_runtime_serves, compare_levels, compare_repeats, run_levels,
)
from eagle31_export.parity.context import ContextRow
from eagle31_export.parity.diagnose import per_depth_side, per_depth_sides
from eagle31_export.parity.evidence import inconclusive_reasons
from eagle31_export.parity.mixed_batches import MixedBatchRow, check_mixed_batches
from eagle31_export.parity.sampling import ALPHA, CORRECTION, GreedyDrafts, SamplingCheck, check_sampled
from eagle31_export.parity.symptoms import (  # noqa: F401 (re-exported)
    ACCEPTS_MORE, ACCEPTS_MORE_UNSEEN, CONTEXT_DEPENDENT, LATER_POSITIONS, POSITION_1, context_dependence,
    context_symptom,
)
from eagle31_export.parity.numerics import BUDGET_ALPHA, TIE_ERRORS, Measured, Measurer, TieBudget, measurer_for
from eagle31_export.parity.ties import Divergence, Judged, judge
from eagle31_export.progress import Phases
from eagle31_export.reference.speculate import LoopObserver, Round, Sampling, SpecResult
from eagle31_export.reference.statistics import accepted_per_position
from eagle31_export.runtime.registry import Speculator


@dataclass(frozen=True)
class Thresholds:
    tau_rel_tol: float = 0.02
    logits_atol: float = 1e-3  # fp32 runtimes: first-step draft logits
    half_precision_logits_atol: float = 5e-2
    sampling_z: float = 3.0  # the rejection rule's per-position rates (autoregressive, our runtimes)
    # greedy-drafts: (b)'s family-wise false-alarm rate over all of its tests (parity/sampling.py)
    sampled_alpha: float = ALPHA
    # Ties, in every verdict: the runtime's choice within tie_errors x the error its precision measurably
    # makes at that decision (parity/numerics.py: TIE_ERRORS, and where it comes from)
    tie_errors: float = TIE_ERRORS
    fp4_activations: bool = False  # the compared target quantizes its activations (W4A4)


@dataclass
class PromptRow:
    prompt_index: int
    prompt_len: int
    tokens_identical: bool
    accepted_identical: bool
    drafts_identical: bool
    first_divergent_round: int | None
    tau_reference: float
    tau_runtime: float
    first_logits_max_abs_diff: float | None
    per_position_reference: list[float]
    per_position_runtime: list[float]
    rounds_reference: int
    rounds_runtime: int
    target_forwards_reference: int = 0  # replay: 1; autoregressive: the prefill and one per round
    symptom: str | None = None
    # rounds whose draft at position i+1 was accepted (the counters vLLM keeps)
    accepted_per_position_reference: list[int] = field(default_factory=list)
    accepted_per_position_runtime: list[int] = field(default_factory=list)
    # replay: every differing token / round, as a numerical tie or not (parity/ties.py); None: not judged
    ties: list[str] | None = None
    untied: list[str] | None = None
    past_cut: list[str] = field(default_factory=list)  # differences past max_new_tokens: not judged, not ties
    # ties this prompt's precision explains (parity/numerics.py): observed, expected, decisions
    tie_budget: dict | None = None
    largest_tie: float | None = None  # the largest tie's gap in units of its measured error (at most TIE_ERRORS)
    # greedy, rounds aligned: the context (prompt and tokens before it) each round drafted at, and the rounds
    # that differ beyond a tie (whether differences wait for the context to grow: symptoms.context_dependence)
    round_contexts: list[int] = field(default_factory=list)
    differing_rounds: list[int] = field(default_factory=list)


@dataclass
class ParityReport:
    runtime: str
    depth: int
    temperature: float
    exact: bool
    thresholds: Thresholds
    mode: str = "autoregressive"
    # what the runtime lets us see: drafts (our runtimes) or tokens and acceptance counts only (vLLM)
    drafts_reported: bool = True
    drafts_source: str | None = None  # how they are known where the engine's loop does not return them (vllm: a log)
    rows: list[PromptRow] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # per draft depth, both sides: teacher-forced agreement/acceptance and fed-back state RMS (parity/diagnose.py)
    per_depth: dict | None = None
    # seconds per phase of the run (load_reference, load_runtime, compare, per_depth): eagle31_export/progress.py
    timings: dict[str, float] = field(default_factory=dict)
    # --concurrency: one row per level C (C = 1 first), parity/concurrency.py
    concurrency: list[ConcurrencyRow] = field(default_factory=list)
    # why a PASS would show nothing (parity/evidence.py); said first, and the exit status says it
    inconclusive: list[str] = field(default_factory=list)
    runtime_dtype: dict | None = None  # what the runtime computes in and how that is known (vllm: set/observed/stated)
    sampling: Sampling | None = None  # temperature > 0: what both sides sampled from, and by which rule
    sampled: SamplingCheck | None = None  # greedy-drafts rule: (a) drafts exact and (b) acceptance law (parity/sampling.py)
    sampling_rule_basis: str | None = None  # how the runtime's rule is known (set, observed, stated)
    context: list[ContextRow] = field(default_factory=list)  # --context: acceptance by prompt length
    # how the runtime's precision was measured (parity/numerics.py): the low side's precision, TIE_ERRORS, the
    # error scales and normalized margin shifts over every decision; None where ties are not measured
    numerics: dict | None = None
    activations: dict | None = None  # FP4 activations or not, and how that is known (set, observed, stated)
    # the engine's rejection sampler as found where it is served (vllm: our plugin's /metrics gauge):
    # {"state", "broken", "how"}; None where the runtime does not say
    engine_sampler: dict | None = None
    engine_chunk_tail: dict | None = None  # vllm: which token its drafter reads at a prefill chunk's end
    # vllm: what our plugin did not recognise on the engine's vLLM ("<what>: unknown on vLLM X.Y (why): left as
    # shipped"), said beside the verdict; it changes no verdict, and nothing it names is called healthy
    engine_unknown: list[str] = field(default_factory=list)
    # sampled runs with --concurrency: greedy requests among sampled ones at each C > 1 (parity/mixed_batches.py)
    mixed_batches: list[MixedBatchRow] = field(default_factory=list)
    # greedy: differences that wait for the context to grow (symptoms.context_dependence); None: not shown
    context_dependence: dict | None = None
    # a failing serving bundle: what `inspect` says of the drafter it hands its engine (inspection.bundle_lints)
    inspect_names: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def verdict(self) -> str:
        """PASS, FAIL, or INCONCLUSIVE: passed, but nothing a drafter bug would change was compared."""
        if self.failures:
            return "FAIL"
        return "INCONCLUSIVE" if self.inconclusive else "PASS"

    def judge_evidence(self) -> None:
        """Where drafts are not compared one by one, whether the accepted counts showed anything."""
        # rates are compared under sampling, and in half precision where differences are not judged as ties
        statistical = self.temperature != 0 or not (self.exact or self.ties_judged)
        if self.sampled is not None:
            self.inconclusive = self.sampled.inconclusive_reasons()
            return
        if self.drafts_reported and not statistical:
            self.inconclusive = []  # every draft compared: a drafter bug shows whatever is accepted
            return
        self.inconclusive = inconclusive_reasons(self.rows, self.depth, statistical)

    @property
    def compared(self) -> str:
        """What the comparison covers, in words (the report says it)."""
        if self.sampled is not None:
            return (f"(a) every accepted token equals the reference drafter's greedy draft and every rejection's token "
                    f"differs from it (exact; a difference where the drafter's top-2 margin is within "
                    f"{self.sampled.tie_errors:g} x the error {self.sampled.precision or 'the runtime precision'} "
                    f"measurably makes at that draft step is a tie, listed, and no more of them than that precision "
                    f"explains); (b) the reference's draft accepted or emitted per "
                    f"position and over all (tau) against the target's probabilities, exact tails, {CORRECTION} over "
                    f"every test at a family-wise false-alarm rate of {self.sampled.alpha:g} (statistical); rule "
                    f"{self.sampled.rule}")
        if self.temperature != 0:
            return (f"per-position acceptance rates within {self.thresholds.sampling_z:g} sigma "
                    "(sampling: statistical)")
        seen = "tokens, rounds, accepted per round" + (", drafts" if self.drafts_reported else
                                                      " and per position (the runtime reports no drafts)")
        if self.ties_judged:
            where = ("fp32" if self.exact else "half precision") + (
                " with FP4 activations" if self.thresholds.fp4_activations else "")
            said = (f"{seen}: identical ({where}), except numerical ties (the runtime's choice the reference's "
                    f"runner-up within {self.thresholds.tie_errors:g} x the error {self.numerics_precision} measurably "
                    "makes at that decision), which are listed, and no more of them than that precision explains")
            if self.numerics and self.numerics.get("median_error") is not None:
                said += (f"; a bug that moves a decision by less than {self.thresholds.tie_errors:g} x its measured "
                         f"error (median {self.numerics['median_error']:.2g} logits here) is not told from "
                         "precision one decision at a time")
            if self.not_excluded:
                said += "; a PASS here does not exclude " + "; nor ".join(self.not_excluded)
            return said
        if self.exact:
            return f"{seen}: identical (fp32, exact)"
        return (f"mean tau within {self.thresholds.tau_rel_tol:.0%}; prompts with differing tokens counted, not "
                "failed (half precision: statistical)")

    @property
    def not_excluded(self) -> list[str]:
        """What a PASS at this comparison's precision cannot exclude (parity/blind_spots.py)."""
        if self.temperature != 0 or not self.ties_judged:
            return []
        return blind_spots(self.exact, self.thresholds.fp4_activations, self.drafts_reported)

    @property
    def ties_judged(self) -> bool:
        return bool(self.rows) and all(r.ties is not None for r in self.rows)

    @property
    def tie_count(self) -> int:
        return sum(len(r.ties or []) for r in self.rows)

    @property
    def numerics_precision(self) -> str:
        return (self.numerics or {}).get("precision") or "the runtime's precision"

    @property
    def tie_budget(self) -> TieBudget | None:
        """The ties of every prompt against what the measured errors explain (parity/numerics.py)."""
        if not self.ties_judged or any(r.tie_budget is None for r in self.rows):
            return None
        total = TieBudget()
        for row in self.rows:
            total.add(TieBudget(row.tie_budget["expected"], row.tie_budget["decisions"], row.tie_budget["observed"]))
        return total

    def tau(self, side: str) -> float:
        values = [getattr(r, f"tau_{side}") for r in self.rows]
        return sum(values) / max(len(values), 1)

    def to_json(self) -> dict:
        return {"passed": self.passed, "verdict": self.verdict, "inconclusive": self.inconclusive,
                "runtime": self.runtime, "mode": self.mode, "depth": self.depth,
                "temperature": self.temperature, "exact_comparison": self.exact,
                "compared": self.compared, "not_excluded": self.not_excluded,
                "drafts_reported": self.drafts_reported, "drafts_source": self.drafts_source,
                "thresholds": asdict(self.thresholds), "numerics": self.numerics, "activations": self.activations,
                "ties": self.tie_count if self.ties_judged else None,
                "tie_budget": None if self.tie_budget is None else self.tie_budget.to_json(),
                "tau_reference": self.tau("reference"),
                "tau_runtime": self.tau("runtime"), "failures": self.failures,
                "prompts": [asdict(r) for r in self.rows], "per_depth": self.per_depth,
                "concurrency": [{**asdict(c), "tokens_per_second": c.tokens_per_second} for c in self.concurrency],
                "runtime_dtype": self.runtime_dtype, "engine_sampler": self.engine_sampler,
                "engine_chunk_tail": self.engine_chunk_tail, "engine_unknown": self.engine_unknown,
                "mixed_batches": [asdict(row) for row in self.mixed_batches],
                "context_dependence": self.context_dependence, "inspect_names": self.inspect_names,
                "sampling": None if self.sampling is None else {**self.sampling.to_json(),
                                                                "rule_basis": self.sampling_rule_basis},
                "sampled_check": None if self.sampled is None else self.sampled.to_json(),
                "context": [row.to_json() for row in self.context],
                "timings": self.timings}


def _counts(result: SpecResult) -> list[int]:
    return accepted_per_position(result.accepted_per_step, result.depth)


def _position_symptom(ref: SpecResult, run: SpecResult) -> str | None:
    """For a runtime that reports counts, not drafts: the earliest draft position whose outcome differs
    names the cause. Rounds at the same boundaries (replay) differ first at position min(a, b) + 1;
    otherwise the per-position counts tell."""
    if len(ref.accepted_per_step) == len(run.accepted_per_step):
        differing = [(i, a, b) for i, (a, b) in enumerate(zip(ref.accepted_per_step, run.accepted_per_step)) if a != b]
        if not differing:
            return None
        index, a, b = min(differing, key=lambda d: min(d[1], d[2]))
        first = min(a, b)
        where = f"round {index}: {b} drafts accepted vs {a}, so draft position {first + 1} differs"
    else:
        ref_counts, run_counts = _counts(ref), _counts(run)
        first = next((i for i, (a, b) in enumerate(zip(ref_counts, run_counts)) if a != b), None)
        if first is None:
            return None
        where = f"draft position {first + 1} accepted in {run_counts[first]} rounds vs {ref_counts[first]}"
    if first == 0:
        return f"{where}: {POSITION_1}"
    return f"{where}, position 1 never does: {LATER_POSITIONS}"


def _draft_symptom(ref: SpecResult, run: SpecResult) -> str | None:
    """For a runtime that reports its drafts but not its first step's logits (vLLM's draft log): the
    earliest draft position that differs in any round names the cause."""
    differing = [(k, r) for r, (ours, theirs) in enumerate(zip(ref.drafts, run.drafts))
                 for k, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if not differing:
        return None
    k, r = min(differing)
    where = f"round {r}: draft {k + 1} is {run.drafts[r][k]}, the reference's {ref.drafts[r][k]}"
    return f"{where}: {POSITION_1}" if k == 0 else f"{where}, position 1 never does: {LATER_POSITIONS}"


def _symptom(ref: SpecResult, run: SpecResult, round_index: int | None, logits_diff: float | None,
             logits_atol: float, drafts_reported: bool = True) -> str | None:
    """Name what diverged first; each pattern has a usual cause (docs/tapped-layers.md, docs/eagle31.md,
    docs/nvfp4.md)."""
    if ref.tokens[:1] != run.tokens[:1]:
        return "the target's own first token differs: target weights or NVFP4 scales"
    found = (_position_symptom(ref, run) if not drafts_reported
             else _draft_symptom(ref, run) if logits_diff is None else None)
    if found is not None:
        return found
    if logits_diff is not None and logits_diff > logits_atol:
        return (f"first-step draft logits differ (max {logits_diff:.3g}): tapped layers, fc or fc_norm weights "
                "(check aux layer numbering and fc_norm)")
    if round_index is not None:
        return "first-step drafts agree, later drafts differ: fed-back state (pre- vs post-norm feedback, norm_output)"
    if ref.tokens != run.tokens:
        return "target outputs differ later in the sequence: target weights or numerics"
    return None


def _accepts_more(ref: SpecResult, run: SpecResult, drafts_reported: bool, tied: set[int]) -> str | None:
    """The runtime accepted more drafts than the reference does on the same prefix in some round, and
    fewer in none (rounds judged numerical ties aside): its verification or the counts it reports, not its
    drafter, where its drafts in those rounds are the reference's (a runtime that reports none: said so)."""
    if len(ref.accepted_per_step) != len(run.accepted_per_step):
        return None
    rounds = [(r, a, b) for r, (a, b) in enumerate(zip(ref.accepted_per_step, run.accepted_per_step))
              if a != b and r not in tied]
    more = [(r, a, b) for r, a, b in rounds if b > a]
    if not more or len(more) < len(rounds):
        return None
    if drafts_reported:
        more = [(r, a, b) for r, a, b in more
                if r < min(len(ref.drafts), len(run.drafts)) and ref.drafts[r][:b] == run.drafts[r][:b]]
        if not more:
            return None  # its drafter drafted otherwise, and better: a drafter difference
    r, a, b = more[0]
    same = "of the same drafts " if drafts_reported else ""
    return (f"round {r}: {b} drafts accepted {same}where the reference accepts {a}, and no round accepts fewer "
            f"({len(more)} rounds more): {ACCEPTS_MORE if drafts_reported else ACCEPTS_MORE_UNSEEN}")


def _round_contexts(prompt: list[int], run: SpecResult) -> list[int]:
    """The context each of the runtime's rounds drafted at: the prompt and the tokens committed before it."""
    out, done = [], 1  # tokens[0] is the prefill's
    for accepted in run.accepted_per_step:
        out.append(len(prompt) + done)
        done += accepted + 1
    return out


def _judged_symptom(found: list[Divergence] | None, untied: list[Divergence]) -> str | None:
    """Along the runtime's own sequence a token that differs beyond a tie is the target's (greedy
    tokens do not depend on the drafter), and the rounds that verified it differ because of it; past
    a tie, the first untied round names the cause. None: the usual symptom rules apply."""
    tokens = [d for d in untied if d.kind == "token"]
    if tokens:
        return _untied_symptom(tokens[0])
    if untied and found and found[0].tie:
        return _untied_symptom(untied[0])
    return None


def _untied_symptom(first: Divergence) -> str:
    """The symptom of the first difference that is not a numerical tie."""
    if first.kind == "token":
        which = "first token" if first.index == 0 else f"token {first.index}"
        return f"the target's own {which} differs: target weights or NVFP4 scales"
    return POSITION_1 if first.draft_position == 1 else LATER_POSITIONS


class FirstDraftLogits(LoopObserver):
    """Keeps the first round's step-1 draft logits: where tap, fc and fc_norm bugs show first."""

    wants_draft_logits = True

    def __init__(self):
        self.logits: torch.Tensor | None = None

    def on_round(self, round: Round) -> None:
        if round.index == 0:
            self.logits = round.first_draft_logits


def _max_abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    return float((a.double() - b.double()).abs().max())


def compare_prompt(index: int, prompt: list[int], ref: SpecResult, run: SpecResult, logits_diff: float | None,
                   logits_atol: float, drafts_reported: bool = True, in_order: bool = True,
                   measured: Measured | None = None, tie_errors: float = TIE_ERRORS) -> PromptRow:
    """One prompt's row. A runtime that reports no drafts (`Speculator.reports_drafts`) is compared on
    tokens and accepted counts; one whose rounds come as counts only (`rounds_in_order`) on their multiset.
    `measured`: the error the runtime's precision makes at each of the replay's decisions: judge every
    difference as a numerical tie or not (parity/ties.py), and count them against the tie budget."""
    divergent = (next((i for i, (a, b) in enumerate(zip(ref.drafts, run.drafts)) if a != b), None)
                 if drafts_reported else None)
    judged = judge(ref, run, measured, drafts_reported, tie_errors) if measured is not None and in_order else None
    found = judged.found if judged is not None else None
    untied = judged.untied if judged is not None else []
    same_rounds = (ref.accepted_per_step == run.accepted_per_step if in_order
                   else sorted(ref.accepted_per_step) == sorted(run.accepted_per_step))
    aligned = in_order and len(ref.accepted_per_step) == len(run.accepted_per_step)
    if found is not None:
        differing = sorted({d.index for d in untied if d.kind == "round" and not d.decided_by_token})
    elif aligned:
        differing = [r for r, (a, b) in enumerate(zip(ref.accepted_per_step, run.accepted_per_step))
                     if a != b or (drafts_reported and r < len(ref.drafts) and r < len(run.drafts)
                                   and ref.drafts[r] != run.drafts[r])]
    else:
        differing = []
    # rounds judged ties, or past max_new_tokens (not judged): neither more nor fewer accepted
    tied = {d.index for d in found or [] if d.kind == "round" and (d.tie or d.past_cut)}
    more = _accepts_more(ref, run, drafts_reported, tied) if aligned and (found is None or untied) else None
    return PromptRow(
        prompt_index=index, prompt_len=len(prompt), tokens_identical=ref.tokens == run.tokens,
        accepted_identical=same_rounds, drafts_identical=divergent is None,
        first_divergent_round=divergent, tau_reference=ref.acceptance_length, tau_runtime=run.acceptance_length,
        first_logits_max_abs_diff=logits_diff, per_position_reference=ref.per_position_acceptance,
        per_position_runtime=run.per_position_acceptance, rounds_reference=len(ref.accepted_per_step),
        rounds_runtime=len(run.accepted_per_step),
        symptom=None if found is not None and not untied else (
            more or _judged_symptom(found, untied) or _symptom(ref, run, divergent, logits_diff, logits_atol,
                                                               drafts_reported)),
        accepted_per_position_reference=_counts(ref), accepted_per_position_runtime=_counts(run),
        ties=None if judged is None else [d.describe() for d in judged.ties],
        untied=None if judged is None else [d.describe() for d in untied],
        past_cut=[] if judged is None else [d.describe() for d in judged.past_cut],
        tie_budget=None if judged is None else judged.budget.to_json(),
        largest_tie=max((d.ratio for d in judged.ties if d.ratio is not None), default=None) if judged else None,
        round_contexts=_round_contexts(prompt, run) if aligned else [], differing_rounds=differing,
    )


MODES = ("replay", "autoregressive")


def run_parity(reference: Speculator, runtime: Speculator, prompts: list[list[int]], depth: int, max_new_tokens: int,
               temperature: float = 0.0, seed: int = 0, exact: bool | None = None,
               thresholds: Thresholds = Thresholds(), on_prompt: Callable[[int], None] | None = None,
               mode: str | None = None, per_depth_positions: int = 8, progress=None,
               concurrency: tuple[int, ...] = (1,), repeat: int = 0, top_p: float = 1.0, top_k: int = 0,
               sampling_rule: str | None = None) -> ParityReport:
    """At `temperature` > 0 both sides sample from the target's distribution cut by `top_p` / `top_k`,
    under `sampling_rule` (None: the runtime's own; `Speculator.sampling_rule` refuses one it does not
    run); greedy-drafts is compared by `compare_sampled`. `mode` "replay" (greedy only; the default there): the reference drafter is replayed at the
    runtime's round boundaries with one target forward per prompt; "autoregressive": the reference
    runs its own loop (the only mode for sampling). `per_depth_positions` > 0: also measure both
    sides per draft depth at that many positions per prompt (`per_depth_sides`). `progress`: phases
    `compare` (prompts done) and `per_depth`, timed into `report.timings` (eagle31_export/progress.py).
    `concurrency`: levels C at which the runtime also runs every prompt with C requests in flight
    (parity/concurrency.py); `repeat`: every level sent that many more times, each send against the
    level's first (`run_repeats`)."""
    phases = Phases.of(progress)
    sampling, basis = None, None
    if temperature != 0:
        rule, basis = runtime.sampling_rule(sampling_rule)
        sampling = Sampling(temperature, top_p, top_k, rule)
        if rule == "greedy-drafts":
            return compare_sampled(reference, runtime, prompts, depth, max_new_tokens, sampling, seed, thresholds,
                                   phases, basis, concurrency)
    mode = mode or ("replay" if temperature == 0 and hasattr(reference, "replay") else "autoregressive")
    if mode not in MODES:
        raise UserError(f"unknown parity mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "replay" and (temperature != 0 or not hasattr(reference, "replay")):
        raise UserError("replay parity compares greedy runs of a reference pair; use --mode autoregressive")
    exact = runtime.exact if exact is None else exact
    check_runtime_serves(runtime, concurrency)
    report = ParityReport(runtime.name, depth, temperature, exact, thresholds, mode,
                          drafts_reported=runtime.reports_drafts, sampling=sampling, sampling_rule_basis=basis)
    measurer = (measurer_for(reference, exact, runtime.compute_dtype, thresholds.fp4_activations)
                if mode == "replay" else None)
    with phases.phase("compare", total=len(prompts)):
        runs, refs, seconds = _compare_prompts(report, reference, runtime, prompts, depth, max_new_tokens,
                                               temperature, seed, exact, thresholds, mode, on_prompt, phases,
                                               measurer)
    report.drafts_reported = report.drafts_reported and runtime.reports_drafts  # vllm: placeholders refused
    load = run_levels(runtime, prompts, depth, max_new_tokens, temperature, seed, concurrency, phases, repeat)
    report.failures = _failures(report)
    _add_levels(report, runs, seconds, refs, load, _tie_judge(reference, prompts, report, measurer))
    _summarize(report, measurer)
    report.judge_evidence()
    if per_depth_positions:
        with phases.phase("per_depth"):
            report.per_depth = per_depth_sides(reference, runtime, prompts, depth, per_depth_positions)
    report.timings = phases.as_json()
    return report


def run_parity_in_turn(load_runtime: Callable[[], Speculator], load_reference: Callable[[], Speculator],
                       prompts: list[list[int]], depth: int, max_new_tokens: int, seed: int = 0,
                       thresholds: Thresholds = Thresholds(), per_depth_positions: int = 8,
                       progress=None, concurrency: tuple[int, ...] = (1,), repeat: int = 0) -> ParityReport:
    """Greedy replay parity holding one side in memory at a time, for pairs whose target fits once but
    not twice: the runtime generates every prompt and is released; only then is the reference loaded,
    to replay its drafter at the runtime's round boundaries. The per-depth section measures both sides
    on the runtime's own greedy continuations (the reference target's, where parity passes).
    `concurrency`: as for `run_parity`; the levels run while the runtime is loaded."""
    phases = Phases.of(progress)
    with phases.phase("load_runtime"):
        runtime = load_runtime()
    try:
        check_runtime_serves(runtime, concurrency)
        runs = []
        with phases.phase("runtime", total=len(prompts)):
            for i, prompt in enumerate(prompts):
                logits = FirstDraftLogits()
                runs.append((runtime.run(prompt, max_new_tokens, depth, 0.0, seed + i, observer=logits), logits))
                phases("runtime", i + 1, len(prompts))
        load = run_levels(runtime, prompts, depth, max_new_tokens, 0.0, seed, concurrency, phases, repeat)
        positions = _positions_within(runs, depth, per_depth_positions)
        continuations = [run.tokens[:positions + depth - 1] for run, _ in runs]
        per_depth = {"positions_per_prompt": positions}
        if positions:
            with phases.phase("per_depth"):
                per_depth["runtime"] = per_depth_side(runtime, prompts, depth, positions, continuations)
    except BaseException:
        runtime.close()
        raise
    report = ParityReport(runtime.name, depth, 0.0, runtime.exact, thresholds, "replay",
                          drafts_reported=runtime.reports_drafts)
    compute_dtype = runtime.compute_dtype
    if not runtime.rounds_in_order:
        runtime.close()
        raise UserError(f"the {runtime.name} runtime reported acceptance counts without the order of its rounds, "
                        "which replay needs: use --mode autoregressive (or start vLLM with "
                        "--per-request-spec-decode-metrics detailed)")
    runtime.close()  # a server it started stops before the reference loads
    del runtime
    gc.collect()  # the runtime's weights and sessions go before the reference's arrive
    with phases.phase("load_reference"):
        reference = load_reference()
    if not hasattr(reference, "replay"):
        raise UserError("replay parity compares greedy runs of a reference pair; use --mode autoregressive")
    atol = thresholds.logits_atol if report.exact else thresholds.half_precision_logits_atol
    with phases.phase("load_measure"):
        measurer = measurer_for(reference, report.exact, compute_dtype, thresholds.fp4_activations)
    refs = []
    with phases.phase("compare", total=len(prompts)):
        for i, (prompt, (run, run_logits)) in enumerate(zip(prompts, runs)):
            ref_logits = FirstDraftLogits()
            ref, measured = _replayed(reference, measurer, prompt, run, ref_logits)
            refs.append(ref)
            row = compare_prompt(i, prompt, ref, run, _max_abs_diff(ref_logits.logits, run_logits.logits), atol,
                                 report.drafts_reported, measured=measured, tie_errors=thresholds.tie_errors)
            row.target_forwards_reference = 1
            report.rows.append(row)
            phases("compare", i + 1, len(prompts))
    report.failures = _failures(report)
    _add_levels(report, [run for run, _ in runs], phases.timings.get("runtime", 0.0), refs, load,
                _tie_judge(reference, prompts, report, measurer))
    _summarize(report, measurer)
    report.judge_evidence()
    if positions:
        with phases.phase("per_depth"):
            per_depth["reference"] = per_depth_side(reference, prompts, depth, positions, continuations)
        report.per_depth = per_depth
    report.timings = phases.as_json()
    return report


def _positions_within(runs, depth: int, wanted: int) -> int:
    """Per-depth anchors per prompt that every runtime continuation is long enough for."""
    if not wanted:
        return 0
    return max(0, min(wanted, *(len(run.tokens) - depth + 1 for run, _ in runs)))


def _add_levels(report: ParityReport, runs: list[SpecResult], seconds: float, refs: list[SpecResult],
                load: LoadRuns, judge: Judge | None = None) -> None:
    """The concurrency rows and their failures, where levels beyond C = 1 ran."""
    if not load.runs and not load.repeats:
        return
    report.concurrency, failures = compare_levels(runs, seconds, refs, load, report.depth, report.exact,
                                                  report.thresholds.tau_rel_tol, judge)
    report.failures += failures + _level_budgets(report) + compare_repeats(report.concurrency, runs, load,
                                                                             report.exact, judge)


def _level_budgets(report: ParityReport) -> list[str]:
    """Each judged level's ties against what the runtime's precision explains: the prompts that differ
    from C = 1 as judged, every other prompt with its C = 1 ties (the same run there)."""
    out = []
    for row in report.concurrency[1:]:
        if not row.ties_judged or row.tie_budget is None:
            continue
        judged = set(row.differing_prompts) | set(row.tied_prompts)
        budget = TieBudget(row.tie_budget["expected"], row.tie_budget["decisions"], row.tie_budget["observed"])
        for base in report.rows:
            if base.prompt_index not in judged and base.tie_budget is not None:
                b = base.tie_budget
                budget.add(TieBudget(b["expected"], b["decisions"], b["observed"]))
        row.tie_budget = budget.to_json()
        if budget.exceeded:
            out.append(f"concurrency {row.concurrency}: {budget.observed} numerical ties, more differences than the "
                       f"runtime's precision explains ({report.numerics_precision}: {budget.expected:.2g} expected "
                       f"over {budget.decisions} decisions, at most {budget.allowed} at p = {BUDGET_ALPHA:g}): a small "
                       f"systematic error under load ({BATCHING})")
    return out


def _tie_judge(reference: Speculator, prompts: list[list[int]], report: ParityReport,
               measurer: Measurer | None) -> Judge | None:
    """Greedy, with a reference that replays: each run under load judged along its own sequence, against
    the error the runtime's precision measurably makes there (parity/ties.py, parity/numerics.py)."""
    if report.temperature != 0 or not hasattr(reference, "replay") or measurer is None or measurer.unavailable:
        return None
    return _judge_with(reference, prompts, measurer, report.drafts_reported, report.thresholds.tie_errors)


def _judge_with(reference: Speculator, prompts: list[list[int]], measurer: Measurer | None, drafts_reported: bool,
                tie_errors: float) -> Callable[[int, SpecResult], Judged | None]:
    """(prompt index, a greedy run of it) -> the run judged by the one tie rule (parity/ties.py: judge),
    against the reference replayed along it and the error measured at each decision (none excused where
    the precision cannot be measured)."""
    def judged(index: int, run: SpecResult) -> Judged | None:
        ref, measured = _replayed(reference, measurer, prompts[index], run)
        if measured is None:
            measured = Measured.unmeasured(ref, "not measured")
        return judge(ref, run, measured, drafts_reported and len(run.drafts) == len(run.accepted_per_step),
                     tie_errors)
    return judged


def _replayed(reference: Speculator, measurer: Measurer | None, prompt: list[int], run: SpecResult,
              observer=None) -> tuple[SpecResult, Measured | None]:
    """The reference's replay of `run`, and the error of each decision where the precision is measured."""
    if measurer is None:
        return reference.replay(prompt, run, observer=observer), None
    return measurer.replay(reference, prompt, run, observer)


def _summarize(report: ParityReport, measurer: Measurer | None) -> None:
    """The measurement's figures, and the tie budget's verdict, into the report."""
    if measurer is not None and measurer.unavailable:
        report.numerics = measurer.summary(report.thresholds.tie_errors)  # said in the report: nothing excused as a tie
    if measurer is None or not report.ties_judged:
        return
    report.numerics = measurer.summary(report.thresholds.tie_errors)
    report.numerics["largest_tie"] = max((r.largest_tie for r in report.rows if r.largest_tie is not None),
                                         default=None)
    budget = report.tie_budget
    if budget is not None and budget.exceeded:
        report.failures.append(
            f"{budget.observed} numerical ties: more differences than the runtime's precision explains "
            f"({report.numerics_precision}: {budget.expected:.2g} expected over {budget.decisions} decisions, at "
            f"most {budget.allowed} at p = {BUDGET_ALPHA:g}): a small systematic error, each of whose differences "
            f"alone is within the measured error ({_tie_symptom(report)})")


def _tie_symptom(report: ParityReport) -> str:
    """Where a run's ties fall names what is slightly off: target tokens, the first draft step, later ones."""
    ties = [t for row in report.rows for t in row.ties or []]
    if sum(t.startswith("token") for t in ties) * 2 > len(ties):
        return "the target's own tokens: target weights or NVFP4 scales"
    return POSITION_1 if any("draft position 1:" in t for t in ties) else LATER_POSITIONS


def _compare_prompts(report, reference, runtime, prompts, depth, max_new_tokens, temperature, seed, exact,
                     thresholds, mode, on_prompt, phases,
                     measurer: Measurer | None = None) -> tuple[list[SpecResult], list[SpecResult], float]:
    """Each prompt on both sides, one row each; (the runtime's results, the reference's, the runtime's seconds)."""
    runs, refs, seconds = [], [], 0.0
    for i, prompt in enumerate(prompts):
        run_logits, ref_logits = FirstDraftLogits(), FirstDraftLogits()
        start = time.perf_counter()
        run = runtime.run(prompt, max_new_tokens, depth, report.sampling or temperature, seed + i, observer=run_logits)
        seconds += time.perf_counter() - start
        measured = None
        if mode == "replay":
            (ref, measured), forwards = _replayed(reference, measurer, prompt, run, ref_logits), 1
        else:
            ref = reference.run(prompt, max_new_tokens, depth, report.sampling or temperature, seed + i,
                                observer=ref_logits)
            forwards = 1 + len(ref.accepted_per_step)
        atol = thresholds.logits_atol if exact else thresholds.half_precision_logits_atol
        diff = _max_abs_diff(ref_logits.logits, run_logits.logits)
        row = compare_prompt(i, prompt, ref, run, diff, atol, runtime.reports_drafts, runtime.rounds_in_order,
                             measured=measured, tie_errors=thresholds.tie_errors)
        row.target_forwards_reference = forwards
        report.rows.append(row)
        runs.append(run)
        refs.append(ref)
        if on_prompt:
            on_prompt(i)
        phases("compare", i + 1, len(prompts))
    return runs, refs, seconds


def compare_sampled(reference: Speculator, runtime: Speculator, prompts: list[list[int]], depth: int,
                    max_new_tokens: int, sampling: Sampling, seed: int, thresholds: Thresholds, phases: Phases,
                    rule_basis: str | None = None, concurrency: tuple[int, ...] = (1,)) -> ParityReport:
    """Sampled runs under the greedy-drafts rule: the runtime generates each prompt (seed + i) and the
    reference is replayed along its output (parity/sampling.py: (a) drafts exact, (b) acceptance law).
    The rows' reference side is what the target's probabilities expect along the runtime's rounds.
    `concurrency` levels C > 1: batches mixing greedy and sampled requests (parity/mixed_batches.py)."""
    check_runtime_serves(runtime, concurrency)
    if not hasattr(reference, "replay_sampled"):
        raise UserError("sampling parity under the greedy-drafts rule replays a reference pair (--drafter, --target)")
    report = ParityReport(runtime.name, depth, sampling.temperature, runtime.exact, thresholds, "sampled-replay",
                          drafts_reported=runtime.reports_drafts, sampling=sampling, sampling_rule_basis=rule_basis)
    measurer = measurer_for(reference, runtime.exact, runtime.compute_dtype, thresholds.fp4_activations)
    tie_errors, replays, errors = thresholds.tie_errors, [], []
    with phases.phase("compare", total=len(prompts)):
        for i, prompt in enumerate(prompts):
            run = runtime.run(prompt, max_new_tokens, depth, sampling, seed + i)
            rounds, measured = _replayed_sampled(reference, measurer, prompt, run, sampling)
            replays.append(rounds)
            errors.append(measured)
            one = check_sampled(replays[-1:], depth, errors[-1:], tie_errors, thresholds.sampled_alpha, sampling.rule,
                                first_index=i)
            report.rows.append(_sampled_row(prompt, run, one))
            phases("compare", i + 1, len(prompts))
    report.drafts_reported = report.drafts_reported and runtime.reports_drafts  # vllm: placeholders refused
    precision = None if measurer is None or measurer.unavailable else measurer.precision
    report.sampled = check_sampled(replays, depth, errors, tie_errors, thresholds.sampled_alpha, sampling.rule,
                                   precision=precision)
    judged = _judge_with(reference, prompts, measurer, runtime.reports_drafts, tie_errors)
    if report.sampled.wants_greedy and hasattr(reference, "replay"):
        report.sampled.greedy = _greedy_drafts(runtime, prompts, depth, max_new_tokens, seed, judged, phases)
    report.failures = report.sampled.failures()
    report.mixed_batches, mixed = check_mixed_batches(runtime, prompts, depth, max_new_tokens, sampling, seed,
                                                      concurrency, judged, phases)
    report.failures += mixed
    if measurer is not None:
        report.numerics = measurer.summary(tie_errors)
    report.judge_evidence()
    report.timings = phases.as_json()
    return report


def _replayed_sampled(reference: Speculator, measurer: Measurer | None, prompt: list[int], run: SpecResult,
                      sampling: Sampling) -> tuple[list, list[list[float]]]:
    """The reference along a sampled run, and the measured error of each draft step (every one 0 where the
    precision cannot be measured: no difference excused as a tie)."""
    if measurer is None:
        rounds = reference.replay_sampled(prompt, run, sampling)
        return rounds, [[0.0] * len(r.margins) for r in rounds]
    return measurer.replay_sampled(reference, prompt, run, sampling)


def _greedy_drafts(runtime: Speculator, prompts: list[list[int]], depth: int, max_new_tokens: int, seed: int,
                   judged: Callable[[int, SpecResult], Judged | None], phases: Phases) -> GreedyDrafts:
    """The runtime run greedy over the same prompts, each replayed and judged by the one tie rule: does
    its drafter draft as the reference's (under greedy-drafts its drafts are the argmax whatever the
    temperature), and are its target's greedy tokens the reference target's? A round decided by a
    differing target token is the target's, not the drafter's; a prompt whose rounds cannot be aligned
    clears nothing; more ties than the runtime's precision explains clear nothing either."""
    rounds, ties, untied, tokens, unaligned, budget = 0, 0, [], [], [], TieBudget()
    with phases.phase("greedy_drafts", total=len(prompts)):
        for i, prompt in enumerate(prompts):
            run = runtime.run(prompt, max_new_tokens, depth, 0.0, seed + i)
            found = judged(i, run)
            if found is None:
                unaligned.append(i)
            else:
                rounds += len(run.accepted_per_step)
                ties += len(found.ties)
                budget.add(found.budget)
                untied += [f"prompt {i}, {d.describe()} ({_untied_symptom(d)})" for d in found.untied
                           if d.kind == "round" and not d.decided_by_token]
                tokens += [f"prompt {i}, {d.describe()}" for d in found.untied if d.kind == "token"]
            phases("greedy_drafts", i + 1, len(prompts))
    return GreedyDrafts(len(prompts), rounds, ties, untied, tokens, unaligned, budget)


def _sampled_row(prompt: list[int], run: SpecResult, check: SamplingCheck) -> PromptRow:
    """A prompt's row of a sampled check: the reference side holds the expected acceptance."""
    drafts, rounds = check.prompts[0], max(len(run.accepted_per_step), 1)
    exact = drafts.mismatch is None
    return PromptRow(
        prompt_index=drafts.prompt_index, prompt_len=len(prompt), tokens_identical=True, accepted_identical=exact,
        drafts_identical=exact, first_divergent_round=None, tau_reference=1 + check.expected / rounds,
        tau_runtime=run.acceptance_length, first_logits_max_abs_diff=None,
        per_position_reference=[law.expected / rounds for law in check.positions],
        per_position_runtime=run.per_position_acceptance, rounds_reference=len(run.accepted_per_step),
        rounds_runtime=len(run.accepted_per_step), target_forwards_reference=1, symptom=drafts.symptom,
        accepted_per_position_reference=[round(law.expected) for law in check.positions],
        accepted_per_position_runtime=_counts(run), ties=drafts.ties,
        untied=[drafts.mismatch] if drafts.mismatch else [])


def _context_evidence(report: ParityReport) -> list[str]:
    """Greedy: where every prompt's differences wait for the context to grow (symptoms.context_dependence),
    said first, and each prompt's symptom by draft position gives way to it."""
    rounds = [(c, r in row.differing_rounds) for row in report.rows for r, c in enumerate(row.round_contexts)]
    found = context_dependence(rounds)
    report.context_dependence = found
    if found is None:
        return []
    for row in report.rows:
        if row.symptom and (POSITION_1 in row.symptom or LATER_POSITIONS in row.symptom):
            row.symptom = row.symptom.replace(POSITION_1, CONTEXT_DEPENDENT).replace(LATER_POSITIONS,
                                                                                      CONTEXT_DEPENDENT)
    return [context_symptom(found)]


def _failures(report: ParityReport) -> list[str]:
    """Greedy: each failing prompt with its symptom, behind the context evidence where there is some."""
    if report.temperature != 0:
        return _sampling_failures(report)
    evidence = _context_evidence(report)
    found = _greedy_failures(report)
    return evidence + found if found else []


def _greedy_failures(report: ParityReport) -> list[str]:
    if report.ties_judged:
        return [f"prompt {row.prompt_index}: {row.untied[0]}, not a numerical tie (a tie: the reference's "
                f"runner-up within {report.thresholds.tie_errors:g} x the measured error) ({row.symptom})"
                for row in report.rows if row.untied]
    if not report.exact:  # half precision: the tau rule decides
        ref, run = report.tau("reference"), report.tau("runtime")
        if abs(run - ref) <= report.thresholds.tau_rel_tol * ref:
            return []
        return [f"tau {run:.3f} vs reference {ref:.3f}: beyond {report.thresholds.tau_rel_tol:.0%}"
                + (f"; the runtime {ACCEPTS_MORE}" if run > ref else "")]
    out = []
    for row in report.rows:
        if not row.tokens_identical:
            out.append(f"prompt {row.prompt_index}: generated tokens differ ({row.symptom})")
        elif not row.accepted_identical:
            out.append(f"prompt {row.prompt_index}: accepted_per_step differs ({row.symptom})")
        elif report.drafts_reported and not row.drafts_identical:
            out.append(f"prompt {row.prompt_index}: drafts differ from round {row.first_divergent_round} "
                       f"({row.symptom})")
    return out


def _sampling_failures(report: ParityReport) -> list[str]:
    """Acceptance at each draft position is a binomial rate over all rounds of all prompts:
    compare the two sides with a two-proportion z bound."""
    out = []
    n_ref = sum(r.rounds_reference for r in report.rows)
    n_run = sum(r.rounds_runtime for r in report.rows)
    if not n_ref or not n_run:
        return ["no speculation rounds to compare"]
    for pos in range(report.depth):
        p_ref = sum(r.per_position_reference[pos] * r.rounds_reference for r in report.rows) / n_ref
        p_run = sum(r.per_position_runtime[pos] * r.rounds_runtime for r in report.rows) / n_run
        pooled = (p_ref * n_ref + p_run * n_run) / (n_ref + n_run)
        sigma = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / n_ref + 1 / n_run))
        if abs(p_ref - p_run) > report.thresholds.sampling_z * sigma:
            out.append(f"draft position {pos + 1}: acceptance {p_run:.3f} vs reference {p_ref:.3f} "
                       f"(beyond {report.thresholds.sampling_z:g} sigma over {n_ref}/{n_run} rounds)"
                       + (f": the runtime {ACCEPTS_MORE}" if p_run > p_ref else ""))
    return out
